// The model dtype's values in the native decode stack (decode_layers.cpp): float32 from T
// and back, 16 at a time where vec16.h has a vector path (TESSERA_DECODE_VEC), and the
// rows a thread takes of the stack's row-wise steps. Included inside decode_layers.cpp's
// anonymous namespace, after vec16.h and <torch/extension.h>.
#pragma once

// Rows of the stack's row-wise steps (norms, RoPE and the cache writes, SwiGLU; residual
// adds: this many thousand values) a thread takes at least: a step's few rows run inline,
// a prompt's thousands in parallel (serial, they left the other thread idle for an
// eighth of a 2048-token step). A row's numbers never depend on the split.
constexpr int64_t kRowGrain = 16;

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

#if TESSERA_DECODE_VEC
using vec16::F;

template <typename T>
inline F load16(const T* p);

template <>
inline F load16<float>(const float* p) {
  return vec16::load(p);
}

template <>
inline F load16<c10::BFloat16>(const c10::BFloat16* p) {
  return vec16::load_bf16(reinterpret_cast<const uint16_t*>(p));
}

template <>
inline F load16<c10::Half>(const c10::Half* p) {
  return vec16::load_half(reinterpret_cast<const uint16_t*>(p));
}

// Whether round16 and store16 take T: float32 and bf16 (float16 stays on scalar loops).
template <typename T>
constexpr bool kVecRound = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// 16 values rounded to T as round_to<T> rounds them, as float32.
template <typename T>
inline F round16(F v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return vec16::round_bf16(v);
  return v;
}

// 16 values rounded to T as round_to<T> rounds them, stored.
template <typename T>
inline void store16(T* p, F v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    vec16::store_bf16(reinterpret_cast<uint16_t*>(p), v);
  else
    vec16::store(p, v);
}
#endif

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if TESSERA_DECODE_VEC
  for (; i + 16 <= n; i += 16) vec16::store(dst + i, load16<T>(src + i));
#endif
  for (; i < n; ++i) dst[i] = f32(src[i]);
}
