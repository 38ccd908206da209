// RMSNorm and RoPE of the native decode stack (decode_layers.cpp), in the model's dtype
// T as workers/model/llama.py computes them:
//   RMSNorm   float32 x * 1/sqrt(mean(x^2) + eps), rounded to T, times the weight in T
//   RoPE      x * cos + rotate_half(x) * sin, each product and the sum rounded to T
// Included inside decode_layers.cpp's anonymous namespace, after decode_values.h.
#pragma once

// sum of squares of x[0..n), in float32 lanes
inline float sum_squares(const float* x, int64_t n) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j] * x[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// y[r] = weight * to_T(x[r] / sqrt(mean(x[r]^2) + eps)), rows of `hidden` floats
template <typename T>
void rms_norm(const float* x, const T* weight, T* y, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * hidden;
      T* yr = y + r * hidden;
      const float mean = sum_squares(xr, hidden) / static_cast<float>(hidden);
      const float inv = 1.f / std::sqrt(mean + eps);
      int64_t i = 0;
#if TESSERA_DECODE_VEC
      if constexpr (kVecRound<T>)
        for (; i + 16 <= hidden; i += 16)
          store16<T>(yr + i, vec16::mul(load16<T>(weight + i),
                                        round16<T>(vec16::mul(vec16::load(xr + i),
                                                              vec16::set1(inv)))));
#endif
      for (; i < hidden; ++i) {
        const T normed = round_to<T>(xr[i] * inv);
        yr[i] = round_to<T>(f32(weight[i]) * f32(normed));
      }
    }
  });
}

// x [heads, D] in place: each head RMS-normed and times weight [D] (as rms_norm above,
// from T inputs: llama.py's RMSNorm over a q or k head)
template <typename T>
void head_norms(T* x, int64_t heads, int64_t head_dim, const T* weight, float eps) {
  std::vector<float> xf(head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) xf[i] = f32(xh[i]);
    const float mean = sum_squares(xf.data(), head_dim) / static_cast<float>(head_dim);
    const float inv = 1.f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < head_dim; ++i) {
      const T normed = round_to<T>(xf[i] * inv);
      xh[i] = round_to<T>(f32(weight[i]) * f32(normed));
    }
  }
}

// x [heads, D]: each head's first `rotary` dimensions rotated in place by cos/sin
// [rotary] (rotate-half layout; the rest, partial rotary's, left as they are)
template <typename T>
void rotate(T* x, int64_t heads, int64_t head_dim, int64_t rotary, const T* cos, const T* sin) {
  const int64_t half = rotary / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * head_dim;
    int64_t i = 0;
#if TESSERA_DECODE_VEC
    if constexpr (kVecRound<T>)
      for (; i + 16 <= half; i += 16) {
        const F x1 = load16<T>(xh + i), x2 = load16<T>(xh + i + half);
        const F a1 = round16<T>(vec16::mul(x1, load16<T>(cos + i)));
        const F b1 = round16<T>(vec16::mul(vec16::neg(x2), load16<T>(sin + i)));
        const F a2 = round16<T>(vec16::mul(x2, load16<T>(cos + i + half)));
        const F b2 = round16<T>(vec16::mul(x1, load16<T>(sin + i + half)));
        store16<T>(xh + i, vec16::add(a1, b1));
        store16<T>(xh + i + half, vec16::add(a2, b2));
      }
#endif
    for (; i < half; ++i) {
      const float x1 = f32(xh[i]), x2 = f32(xh[i + half]);
      const T a1 = round_to<T>(x1 * f32(cos[i]));
      const T b1 = round_to<T>(-x2 * f32(sin[i]));
      const T a2 = round_to<T>(x2 * f32(cos[i + half]));
      const T b2 = round_to<T>(x1 * f32(sin[i + half]));
      xh[i] = round_to<T>(f32(a1) + f32(b1));
      xh[i + half] = round_to<T>(f32(a2) + f32(b2));
    }
  }
}
