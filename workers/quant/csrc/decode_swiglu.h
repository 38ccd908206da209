// SwiGLU, the MLP's activation in the native decode stack (decode_layers.cpp), in the
// model's dtype T as workers/model/llama.py computes it: silu(gate) rounded to T, times
// up, rounded to T. Included inside decode_layers.cpp's anonymous namespace, after
// decode_values.h.
#pragma once

// out = to_T(to_T(silu(gate)) * up), n elements
template <typename T>
void swiglu_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if TESSERA_DECODE_VEC
  for (; i + 16 <= n; i += 16) {
    const F g = load16<T>(gate + i);
    const F e = vec16::exp(vec16::sub(vec16::zero(), g));
    const F silu = vec16::div(g, vec16::add(vec16::set1(1.f), e));
    if constexpr (kVecRound<T>) {
      store16<T>(out + i, vec16::mul(round16<T>(silu), load16<T>(up + i)));
    } else {
      float lanes[16];
      vec16::store(lanes, silu);
      for (int j = 0; j < 16; ++j)
        out[i + j] = round_to<T>(f32(round_to<T>(lanes[j])) * f32(up[i + j]));
    }
  }
#endif
  for (; i < n; ++i) {
    const float g = f32(gate[i]);
    const T s = round_to<T>(g / (1.f + std::exp(-g)));
    out[i] = round_to<T>(f32(s) * f32(up[i]));
  }
}
