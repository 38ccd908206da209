// The buffered float32 loop's register pieces (AVX-512), shared by gguf_mm.cpp and
// kquant_mm.cpp: a 16 x 16 transpose in registers (a tile of 16 dequantised output rows
// into the [in, 16] buffer), and the outer-product micro-kernel that multiplies R rows of
// x with that buffer (x broadcast, 16 outputs a zmm: no horizontal sums).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace tessera::outer16 {

constexpr int64_t kTile = 16;  // output rows per tile (a zmm)

// In-place transpose of a 16 x 16 float matrix held in 16 zmm.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // u[4i + j] holds, in each 128-bit lane L, column 4L + j of rows 4i .. 4i + 3
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
  }
}

// y[r, o0 : o0 + nr] for R rows of x, from `buf` [in, 16] (16 output rows a k, zeros
// past nr): x is broadcast, so no horizontal sums are needed.
template <int R>
inline void micro_outer(const float* x, int64_t in, const float* buf, float* y, int64_t out,
                        __mmask16 mask) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    const __m512 wv = _mm512_loadu_ps(buf + k * kTile);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * in + k]), wv, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * out, mask, acc[r]);
}

}  // namespace tessera::outer16

#endif
