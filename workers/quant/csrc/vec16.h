// Sixteen float32 / int32 lanes: one zmm where the build has AVX-512 (F and BW), two ymm
// where it has AVX2 with FMA and F16C (TESSERA_VEC16 is 512, 256, or 0 with neither; the
// build is -march=native, so the CPU it runs on decides). The tiled layouts
// (tiled_layouts.h) put one output in each lane of a 16-output tile, so the float32
// kernels over them (tiled_f32.cpp) and the argmax taken as they write (tile_argmax.h)
// are written once over these types. Every operation is lane by lane but the reductions
// (reduce_max, reduce_add, lane_sums, bits), so a lane's numbers are the same whichever
// width built it (exp included); the reductions' sums add in another order.

#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TESSERA_VEC16 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TESSERA_VEC16 256
#else
#define TESSERA_VEC16 0
#endif

namespace tessera::vec16 {

// exp's constants, both widths: x clamped at kExpFloor, n = round(x log2 e), r = x - n ln 2
// (ln 2 in two parts), e^r = 1 + r + r^2 p(r) with Cephes' polynomial p (highest degree
// first), then e^x = e^r 2^n.
constexpr float kExpFloor = -104.f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if TESSERA_VEC16 == 512

struct F {
  __m512 v;
};
struct I {
  __m512i v;
};
using Mask = __mmask16;

inline F zero() { return {_mm512_setzero_ps()}; }
inline F set1(float x) { return {_mm512_set1_ps(x)}; }
inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
// 16 fp16 values
inline F load_half(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F div(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_max(F a) { return _mm512_reduce_max_ps(a.v); }
inline float reduce_add(F a) { return _mm512_reduce_add_ps(a.v); }
// 16 bf16 values
inline F load_bf16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
}
// Each lane rounded to bf16 as c10::BFloat16(float) rounds it (nearest even; any NaN to
// 0x7FC0), the bits in the low half of an int32 lane; VCVTNEPS2BF16 would flush
// denormals to zero instead.
inline __m512i bf16_bits(__m512 a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i bias = _mm512_add_epi32(
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  return _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16),
                               _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
// a rounded to bf16 (bf16_bits), as float32
inline F round_bf16(F a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a.v), 16))}; }
// a rounded to bf16 (bf16_bits), stored as 16 bf16
inline void store_bf16(uint16_t* p, F a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(a.v)));
}
// -a (the sign bit flipped: -0 for 0, as the scalar negation)
inline F neg(F a) {
  return {_mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
}

// e^x, within ~2 ulp of expf (kExpPoly); -inf, NaN and very negative x give 0.
inline F exp(F a) {
  const __m512 x = _mm512_max_ps(a.v, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return {_mm512_scalef_ps(p, n)};
}

// Lane t of the result: the sum of v[t]'s 16 lanes, by a tree of unpacks, shuffles and
// adds (15 adds for 16 vectors, instead of one horizontal reduction per vector).
inline F lane_sums(const F* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] and v[2i + 1] folded to pairs
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v),
                         _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v[4i .. 4i + 3]'s partial sums
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // the four 128-bit lanes of each x summed in pairs
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                        _mm512_shuffle_f32x4(y[0], y[1], 0xDD))};
}

inline I set1_i(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline I load_i(const void* p) { return {_mm512_loadu_si512(p)}; }  // 64 bytes
inline void store_i(int32_t* p, I a) { _mm512_storeu_si512(p, a.v); }
// 32 int8 as 32 int16: lane c holds bytes 2c (low half) and 2c + 1 (high half)
inline I widen_s8(const int8_t* p) {
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline I and_i(I a, I b) { return {_mm512_and_si512(a.v, b.v)}; }
inline I sub_i(I a, I b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline I srli(I a, int n) { return {_mm512_srli_epi32(a.v, n)}; }
inline I slli(I a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline I srai(I a, int n) { return {_mm512_srai_epi32(a.v, n)}; }
inline F to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }

inline Mask greater(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
inline F select(Mask m, F if_false, F if_true) {
  return {_mm512_mask_mov_ps(if_false.v, m, if_true.v)};
}
inline I select(Mask m, I if_false, I if_true) {
  return {_mm512_mask_mov_epi32(if_false.v, m, if_true.v)};
}
inline bool any_nan(F a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
// lanes 0 .. count - 1 (count <= 16)
inline Mask first(int count) { return static_cast<Mask>((1u << count) - 1u); }
inline Mask equal(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline Mask unordered(F a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
// bit i: lane i of m
inline uint32_t bits(Mask m) { return m; }

#elif TESSERA_VEC16 == 256

struct F {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct I {
  __m256i lo, hi;
};
using Mask = F;  // all-ones lanes where true

inline F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, F a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F load_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F fmadd(F a, F b, F c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F div(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F max(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float reduce_max(F a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline float reduce_add(F a) {
  __m256 m = _mm256_add_ps(a.lo, a.hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline F load_bf16(const uint16_t* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16)),
          _mm256_castsi256_ps(
              _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16))};
}
// As the AVX-512 bf16_bits, round_bf16, store_bf16 and neg, on 8 lanes at a time.
inline __m256i bf16_bits8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i bias = _mm256_add_epi32(
      _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_srli_epi32(_mm256_add_epi32(u, bias), 16)),
                       _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
                       _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
inline F round_bf16(F a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(a.hi), 16))};
}
inline void store_bf16(uint16_t* p, F a) {
  // packus interleaves the two halves by 128-bit lane: the permute puts them in order
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(a.lo), bf16_bits8(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
inline F neg(F a) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}

// e^x as the AVX-512 exp computes it, lane for lane: the same polynomial, and scalef's
// p * 2^n as two exact steps, p * 2^(n >> 1) * 2^(n - (n >> 1)) (n >= -150 stays in range).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i k = _mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(254.f)));
  const __m256i k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23)));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23)));
}
inline F exp(F a) { return {exp8(a.lo), exp8(a.hi)}; }

// lane i: the sum of s[i]'s 8 lanes
inline __m256 lane_sums8(const __m256* s) {
  __m256 a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm256_hadd_ps(s[2 * i], s[2 * i + 1]);
  // b0: s0..s3's sums of lanes 0-3 (low half) and 4-7 (high half); b1: s4..s7's
  const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
// Lane t of the result: the sum of v[t]'s 16 lanes.
inline F lane_sums(const F* v) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {lane_sums8(s), lane_sums8(s + 8)};
}

inline I set1_i(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I load_i(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline void store_i(int32_t* p, I a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), a.hi);
}
inline I widen_s8(const int8_t* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(q)), _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1))};
}
inline I and_i(I a, I b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline I sub_i(I a, I b) {
  return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)};
}
inline I srli(I a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline I slli(I a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline I srai(I a, int n) { return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)}; }
inline F to_float(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }

inline Mask greater(F a, F b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)};
}
inline F select(Mask m, F if_false, F if_true) {
  return {_mm256_blendv_ps(if_false.lo, if_true.lo, m.lo),
          _mm256_blendv_ps(if_false.hi, if_true.hi, m.hi)};
}
inline I select(Mask m, I if_false, I if_true) {
  return {_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false.lo),
                                               _mm256_castsi256_ps(if_true.lo), m.lo)),
          _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false.hi),
                                               _mm256_castsi256_ps(if_true.hi), m.hi))};
}
inline bool any_nan(F a) {
  return _mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q)) != 0 ||
         _mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)) != 0;
}
inline Mask equal(F a, F b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)};
}
inline Mask unordered(F a) {
  return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)};
}
inline uint32_t bits(Mask m) {
  return static_cast<uint32_t>(_mm256_movemask_ps(m.lo)) |
         static_cast<uint32_t>(_mm256_movemask_ps(m.hi)) << 8;
}
inline Mask first(int count) {
  const __m256 c = _mm256_set1_ps(static_cast<float>(count));
  return {_mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), c, _CMP_LT_OQ),
          _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), c, _CMP_LT_OQ)};
}

#endif

}  // namespace tessera::vec16
