// y[T, out] = x[T, in] @ W^T for GGUF K-quant weights (Q4_K, Q5_K, Q6_K) with x
// quantised to int8: the fast mode's K-quant product (the exact one is kquant_mm.cpp).
//
// x is quantised once per call, each row per super-block of 256 (what llama.cpp calls
// Q8_K):
//
//     amax = max |x_i|,  d_x = amax / 127,  q_i = rint(x_i * (127 / amax))
//
// in float32 (127 / amax and the product each rounded once; rint: half to even, the
// CPU's default rounding), q_i in -127..127, and the int sums of q over each 16
// elements (bsum). A block of zeros has d_x = 0 and q = 0.
//
// A weight super-block is unpacked to its unsigned 4/5/6-bit values u and multiplied
// with q in int32; each row's sums over the super-block are exact integers (s, and m for
// the mins), scaled once per super-block in float32, each step one rounding:
//
//   Q4_K/Q5_K  w = d sc_j u - dmin m_j   (8 sub-blocks j of 32)
//              s = sum_j sc_j sum_i u q,  m = sum_j m_j sum_i q
//              y = fma(-m, d_x dmin, fma(s, d_x d, y))
//   Q6_K       w = d sc_s (u - 32)        (16 sub-blocks s of 16, sc_s int8)
//              s = sum_s sc_s sum_i u q - 32 sum_s sc_s sum_i q
//              y = fma(s, d_x d, y)
//
// so y differs from x_q @ gguf.dequantize(W)^T (x_q = d_x q) only by float32 rounding,
// and every loop below computes the same bits for a row, whatever the row count and
// whichever loop took it (batch invariance; the tests compare a batch with its rows
// one by one). The AVX512-VNNI loops:
//
// * rows (up to kGroup = 8 rows of x per unpacked super-block; what decoding takes):
//   VPMADDUBSW multiplies 64 weights by 64 of q (u8 x s8 pairs -> int16, at most
//   2 * 63 * 127: no saturation) and VPDPWSSD scales the pairs by their sub-block's scale
//   while summing them, in 16 int32 lanes reduced per super-block. Parallel over tiles of
//   kTile output rows, each swept by each group of rows, so the weights come from memory
//   once and from L2 after.
// * lanes (every full group of 16 rows; prompts and large batches): a vector's lanes are
//   16 rows of x, VPDPBUSD multiplies a broadcast quadruple of weights with each row's 4
//   of q, and a sub-block's sums take its scale with VPMULLD: 10 multiply instructions
//   per 16 rows x 32 weights where the rows loop takes 16. Parallel over groups of kOuts
//   output rows.
//
// Elsewhere a portable loop computes the same integers and float steps.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define TESSERA_KQ8_VNNI 1
#else
#define TESSERA_KQ8_VNNI 0
#endif

namespace {

constexpr int64_t kSuper = 256;
constexpr int64_t kSums = kSuper / 16;  // bsums per super-block
constexpr int kQ4_K = 12;
constexpr int kQ5_K = 13;
constexpr int kQ6_K = 14;
constexpr int64_t kGroup = 8;  // rows of x sharing one unpacked super-block
constexpr int64_t kTile = 16;  // output rows each group of rows sweeps (their weights in L2)
// Bytes ahead of the super-block at hand that a row's sweep asks the cache for: a
// thread's weights are one stream (its output rows' blocks, row after row), and the
// CPU's own prefetcher stops at each 4 KiB page.
constexpr int64_t kAhead = 2048;

constexpr int64_t block_bytes(int qt) { return qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : 210; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// x quantised: per row and super-block, d (float), q (int8 [256]) and the sums of q over
// each 16 (int16 [16]); and, for the AVX512-VNNI loops, d and the bsums again with the
// rows side by side (rows padded to a multiple of 16 with zeros): dT [nsb, Tp] and
// pairsT [nsb, pairs, Tp, 2], int16 pairs of the sums that each pair of sub-block
// weights multiplies (Q4_K/Q5_K: the 4 pairs of sums over 32; Q6_K: the 8 pairs of sums
// over 16).
struct QuantX {
  std::vector<int8_t> q;    // [T, in]
  std::vector<float> d;     // [T, nsb]
  std::vector<int16_t> bs;  // [T, nsb, 16]
  std::vector<float> dT;        // [nsb, Tp]
  std::vector<int16_t> pairsT;  // [nsb, pairs, Tp, 2]
  int64_t in, nsb, Tp, pairs;
  const int8_t* qrow(int64_t t, int64_t sb) const { return q.data() + t * in + sb * kSuper; }
  float dx(int64_t t, int64_t sb) const { return d[t * nsb + sb]; }
  const int16_t* sums(int64_t t, int64_t sb) const { return bs.data() + (t * nsb + sb) * kSums; }
  const float* dx_rows(int64_t t, int64_t sb) const { return dT.data() + sb * Tp + t; }
  const int16_t* pair_rows(int64_t t, int64_t sb, int64_t i) const {
    return pairsT.data() + ((sb * pairs + i) * Tp + t) * 2;
  }
};

void quantize_block(const float* x, int8_t* q, float* d, int16_t* bs) {
#if TESSERA_KQ8_VNNI
  __m512 amaxv = _mm512_setzero_ps();
  for (int c = 0; c < 16; ++c) amaxv = _mm512_max_ps(amaxv, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * c)));
  const float amax = _mm512_reduce_max_ps(amaxv);
#else
  float amax = 0.f;
  for (int i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(x[i]));
#endif
  if (!(amax > 0.f)) {
    *d = 0.f;
    std::memset(q, 0, kSuper);
    std::memset(bs, 0, kSums * sizeof(int16_t));
    return;
  }
  const float id = 127.f / amax;
  *d = amax / 127.f;
#if TESSERA_KQ8_VNNI
  const __m512 idv = _mm512_set1_ps(id);
  for (int c = 0; c < 16; ++c) {
    // cvtps_epi32 rounds as MXCSR says: to nearest, ties to even (as rint)
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * c), idv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * c), _mm512_cvtsepi32_epi8(qi));
    bs[c] = static_cast<int16_t>(_mm512_reduce_add_epi32(qi));
  }
#else
  for (int c = 0; c < 16; ++c) {
    int sum = 0;
    for (int i = 16 * c; i < 16 * c + 16; ++i) {
      const int v = static_cast<int>(std::nearbyint(x[i] * id));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    bs[c] = static_cast<int16_t>(sum);
  }
#endif
}

QuantX quantize(const float* x, int64_t T, int64_t in, int qt) {
  QuantX qx;
  qx.in = in;
  qx.nsb = in / kSuper;
  qx.Tp = (T + 15) / 16 * 16;
  qx.pairs = qt == kQ6_K ? 8 : 4;
  qx.q.resize(T * in);
  qx.d.resize(T * qx.nsb);
  qx.bs.resize(T * qx.nsb * kSums);
  qx.dT.assign(qx.nsb * qx.Tp, 0.f);
  qx.pairsT.assign(qx.nsb * qx.pairs * qx.Tp * 2, 0);
  at::parallel_for(0, T * qx.nsb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_block(x + i * kSuper, qx.q.data() + i * kSuper, qx.d.data() + i,
                     qx.bs.data() + i * kSums);
      const int64_t t = i / qx.nsb, sb = i % qx.nsb;
      qx.dT[sb * qx.Tp + t] = qx.d[i];
      const int16_t* bs = qx.bs.data() + i * kSums;
      for (int64_t p = 0; p < qx.pairs; ++p)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t s = 2 * p + h;  // Q4_K/Q5_K: sub-block s of 32 = bsums 2s, 2s + 1
          qx.pairsT[((sb * qx.pairs + p) * qx.Tp + t) * 2 + h] =
              qt == kQ6_K ? bs[s] : static_cast<int16_t>(bs[2 * s] + bs[2 * s + 1]);
        }
    }
  });
  return qx;
}

struct KPacked {
  const uint8_t* data;
  int64_t row_bytes, nsb, in;
  const uint8_t* block(int64_t o, int64_t sb, int qt) const {
    return data + o * row_bytes + sb * block_bytes(qt);
  }
};

// Q4_K/Q5_K's 12 scale bytes -> sc[0:8] and m[0:8] (6 bits each), one byte each.
inline void scale_min(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  uint32_t a, c, e;
  std::memcpy(&a, s, 4);
  std::memcpy(&c, s + 4, 4);
  std::memcpy(&e, s + 8, 4);
  sc = (a & 0x3F3F3F3Fu) |
       static_cast<uint64_t>((e & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
  m = (c & 0x3F3F3F3Fu) |
      static_cast<uint64_t>(((e >> 4) & 0x0F0F0F0Fu) | ((c >> 2) & 0x30303030u)) << 32;
}

// A super-block's float steps, the same in every loop (so a row's result never depends
// on which loop, or how many rows, took it): its integer sum s (and, Q4_K/Q5_K, the
// mins' sum m) times d_x d (d_x dmin), each added with one rounding.
inline float scaled(float acc, int32_t s, float ds) {
  return std::fma(static_cast<float>(s), ds, acc);
}
inline float scaled(float acc, int32_t s, float ds, int32_t m, float dm) {
  return std::fma(-static_cast<float>(m), dm, std::fma(static_cast<float>(s), ds, acc));
}

// ---------------------------------------------------------------- portable (any CPU)

// A super-block's unsigned values u [256] and per-element scale / min tables.
template <int QT>
void unpack_scalar(const uint8_t* b, uint8_t u[kSuper]) {
  if constexpr (QT == kQ6_K) {
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 4; ++r)
        for (int i = 0; i < 32; ++i) {
          const int lo = (b[64 * h + 32 * (r & 1) + i] >> (4 * (r >> 1))) & 0x0F;
          const int hi = (b[128 + 32 * h + i] >> (2 * r)) & 0x03;
          u[128 * h + 32 * r + i] = static_cast<uint8_t>(lo | (hi << 4));
        }
  } else {
    const uint8_t* qs = b + (QT == kQ5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) {
        int v = (qs[32 * (j / 2) + i] >> (4 * (j & 1))) & 0x0F;
        if constexpr (QT == kQ5_K) v |= ((b[16 + i] >> j) & 1) << 4;
        u[32 * j + i] = static_cast<uint8_t>(v);
      }
  }
}

template <int QT>
float row_dot_scalar(const QuantX& qx, int64_t t, const KPacked& w, int64_t o) {
  float acc = 0.f;
  uint8_t u[kSuper];
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const uint8_t* b = w.block(o, sb, QT);
    const int8_t* q = qx.qrow(t, sb);
    const int16_t* bs = qx.sums(t, sb);
    const float dx = qx.dx(t, sb);
    unpack_scalar<QT>(b, u);
    if constexpr (QT == kQ6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      int32_t p = 0;
      for (int s = 0; s < 16; ++s) {
        int32_t dot = 0;
        for (int i = 16 * s; i < 16 * s + 16; ++i) dot += u[i] * q[i];
        p += sc[s] * (dot - 32 * bs[s]);
      }
      acc = scaled(acc, p, dx * half_at(b + 208));
    } else {
      uint64_t sc, m;
      scale_min(b + 4, sc, m);
      int32_t p = 0, pm = 0;
      for (int j = 0; j < 8; ++j) {
        int32_t dot = 0;
        for (int i = 32 * j; i < 32 * j + 32; ++i) dot += u[i] * q[i];
        p += static_cast<int32_t>((sc >> (8 * j)) & 0xFF) * dot;
        pm += static_cast<int32_t>((m >> (8 * j)) & 0xFF) * (bs[2 * j] + bs[2 * j + 1]);
      }
      acc = scaled(acc, p, dx * half_at(b), pm, dx * half_at(b + 2));
    }
  }
  return acc;
}

template <int QT>
void mm_portable(const QuantX& qx, int64_t T, const KPacked& w, float* y, int64_t out) {
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t t = 0; t < T; ++t) y[t * out + o] = row_dot_scalar<QT>(qx, t, w, o);
  });
}

// ---------------------------------------------------------------- AVX512-VNNI

#if TESSERA_KQ8_VNNI

// A super-block unpacked: w[k] the u8 values of elements 64k .. 64k + 63, s[k] the int16
// scale of each of their pairs (VPMADDUBSW's outputs), each and aux the int16 that
// multiply the row's bsums (each: one per bsum) and its bsum pairs (aux: two to a pair;
// Q4_K/Q5_K: m_j, 8; Q6_K: sc_s, 16), d and dmin.
struct alignas(64) Unpacked {
  __m512i w[4], s[4];
  __m256i each;  // the multiplier of each of the 16 bsums (Q4_K/Q5_K: m_j twice)
  int16_t aux[16];
  float d, dmin;
};

// int16 lane l (of 32) -> scale index 2k + l / 16 (Q4_K/Q5_K: sub-blocks of 32) or
// 4k + l / 8 (Q6_K: sub-blocks of 16).
inline __m512i scale_index(int k, int per) {
  alignas(64) int16_t idx[32];
  for (int l = 0; l < 32; ++l) idx[l] = static_cast<int16_t>((64 / per) * k + l / (per / 2));
  return _mm512_load_si512(idx);
}

template <int QT>
inline void unpack(const uint8_t* b, Unpacked& u) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  if constexpr (QT == kQ6_K) {
    static const __m512i idx[4] = {scale_index(0, 16), scale_index(1, 16), scale_index(2, 16),
                                   scale_index(3, 16)};
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i sc512 = _mm512_castsi256_si512(sc);
    u.each = sc;
    _mm256_store_si256(reinterpret_cast<__m256i*>(u.aux), sc);
    u.d = half_at(b + 208);
    u.dmin = 0.f;
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      // bytes 0..31: qh bits 0-1 (r = 0) / 4-5 (r = 2); bytes 32..63: bits 2-3 / 6-7
      const __m512i ha = _mm512_and_si512(_mm512_sllv_epi16(qh, shl), bits45);
      const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(qh, shr), bits45);
      u.w[2 * h] = _mm512_ternarylogic_epi32(ql, ha, low4, 0xE4);
      u.w[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), hb, low4, 0xE4);
    }
    for (int k = 0; k < 4; ++k) u.s[k] = _mm512_permutexvar_epi16(idx[k], sc512);
  } else {
    static const __m512i idx[4] = {scale_index(0, 32), scale_index(1, 32), scale_index(2, 32),
                                   scale_index(3, 32)};
    uint64_t sc, m;
    scale_min(b + 4, sc, m);
    u.d = half_at(b);
    u.dmin = half_at(b + 2);
    const __m512i sc512 = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    const __m128i mb = _mm_cvtsi64_si128(static_cast<int64_t>(m));
    u.each = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb));
    _mm_store_si128(reinterpret_cast<__m128i*>(u.aux), _mm_cvtepu8_epi16(mb));
    const uint8_t* qs = b + (QT == kQ5_K ? 48 : 16);
    for (int h = 0; h < 2; ++h) {
      // groups 2h, 2h + 1: low nibbles = sub-blocks 4h, 4h + 2; high = 4h + 1, 4h + 3
      const __m512i z = _mm512_loadu_si512(qs + 64 * h);
      const __m512i lo = _mm512_and_si512(z, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
      u.w[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);      // sub-blocks 4h, 4h + 1
      u.w[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // 4h + 2, 4h + 3
    }
    if constexpr (QT == kQ5_K) {  // bit j of qh[i]: the fifth bit of element i of sub-block j
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int k = 0; k < 4; ++k) {
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << (2 * k))),
                                               _mm256_set1_epi8(static_cast<char>(1 << (2 * k + 1))), 1);
        const __mmask64 set = _mm512_test_epi8_mask(qh, bit);
        u.w[k] = _mm512_mask_add_epi8(u.w[k], set, u.w[k], sixteen);
      }
    }
    for (int k = 0; k < 4; ++k) u.s[k] = _mm512_permutexvar_epi16(idx[k], sc512);
  }
}

inline int32_t quad_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline int32_t pair_at(const int16_t* aux, int64_t i) { return quad_at(aux + 2 * i); }

// The sums of 8 vectors of 16 int32, in row order (a tree of adds: 24 instructions for
// the 8 rather than 8 reductions of 8).
inline __m256i sums8(const __m512i p[8]) {
  __m512i a[4], b[2];
  for (int i = 0; i < 4; ++i)  // [p2i: halves added (8 lanes) | p2i+1: the same]
    a[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(p[2 * i], p[2 * i + 1], 0x44),
                            _mm512_shuffle_i64x2(p[2 * i], p[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // 128-bit block k: 4 lanes of row 4i + k
    b[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0xDD));
  // block k: [row k, row k + 4, row k, row k + 4], each summed over its 4 lanes
  const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi32(b[0], b[1]), _mm512_unpackhi_epi32(b[0], b[1]));
  const __m512i d = _mm512_add_epi32(c, _mm512_shuffle_epi32(c, _MM_PERM_BADC));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, d));
}

// Output row o's super-block sb unpacked into u, the bytes kAhead on asked for meanwhile.
template <int QT>
inline void unpack_streamed(const KPacked& w, int64_t o, int64_t sb, Unpacked& u) {
  const uint8_t* b = w.block(o, sb, QT);
  for (int64_t line = 0; line < block_bytes(QT); line += 64)  // the stream, ahead
    _mm_prefetch(reinterpret_cast<const char*>(b + kAhead + line), _MM_HINT_T0);
  unpack<QT>(b, u);
}

// One row's products with an unpacked super-block (its 256 int8 at q), in 16 int32 lanes.
inline __m512i row_products(const Unpacked& u, const int8_t* q) {
  __m512i p = _mm512_setzero_si512();
  for (int k = 0; k < 4; ++k)
    p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(u.w[k], _mm512_loadu_si512(q + 64 * k)), u.s[k]);
  return p;
}

// One or two rows of x from t0 times output row o, into y: as rows_times_output below,
// but each row's sums reduced on their own (its 16 lanes of products and its 8 of mins
// in one vector, four adds), its float steps scalar.
template <int QT, int R>
inline void few_rows_times_output(const QuantX& qx, int64_t t0, const KPacked& w, int64_t o,
                                  float* y, int64_t out) {
  float acc[R] = {};
  Unpacked u;
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    unpack_streamed<QT>(w, o, sb, u);
    for (int r = 0; r < R; ++r) {
      const __m512i p = row_products(u, qx.qrow(t0 + r, sb));
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.sums(t0 + r, sb)));
      const __m256i pm = _mm256_madd_epi16(bs, u.each);
      __m512i v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1))), pm, 1);
      v = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
      v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
      v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));
      const int32_t sum = _mm_cvtsi128_si32(_mm512_castsi512_si128(v));
      const int32_t mins = _mm_cvtsi128_si32(_mm512_extracti32x4_epi32(v, 2));
      const float dx = qx.dx(t0 + r, sb);
      if constexpr (QT == kQ6_K)
        acc[r] = scaled(acc[r], sum - 32 * mins, dx * u.d);
      else
        acc[r] = scaled(acc[r], sum, dx * u.d, mins, dx * u.dmin);
    }
  }
  for (int r = 0; r < R; ++r) y[(t0 + r) * out + o] = acc[r];
}

// R (<= 8) rows of x from t0 times output row o, into y. Per super-block each row's 64
// products per instruction pair (VPMADDUBSW, then VPDPWSSD with the sub-block scales)
// in 16 int32 lanes, reduced to the rows' integer sums; the mins' sums (or Q6_K's -32)
// from the bsum pairs of the 8 rows at once; then the float steps for the 8 rows side
// by side, as the lanes loop takes them.
template <int QT, int R>
inline void rows_times_output(const QuantX& qx, int64_t t0, const KPacked& w, int64_t o,
                              float* y, int64_t out) {
  if constexpr (R <= 2) {
    few_rows_times_output<QT, R>(qx, t0, w, o, y, out);
    return;
  }
  __m256 acc = _mm256_setzero_ps();
  Unpacked u;
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    unpack_streamed<QT>(w, o, sb, u);
    __m512i p[8];
    for (int r = 0; r < 8; ++r) p[r] = r < R ? row_products(u, qx.qrow(t0 + r, sb)) : _mm512_setzero_si512();
    const __m256i s = sums8(p);
    __m256i m = _mm256_setzero_si256();
    for (int64_t i = 0; i < qx.pairs; ++i)
      m = _mm256_dpwssd_epi32(m, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.pair_rows(t0, sb, i))),
                              _mm256_set1_epi32(pair_at(u.aux, i)));
    const __m256 dx = _mm256_loadu_ps(qx.dx_rows(t0, sb));
    if constexpr (QT == kQ6_K) {  // sc_s (u - 32): the -32 through the bsums
      const __m256i total = _mm256_sub_epi32(s, _mm256_slli_epi32(m, 5));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dx, _mm256_set1_ps(u.d)), acc);
    } else {
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dx, _mm256_set1_ps(u.d)), acc);
      acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dx, _mm256_set1_ps(u.dmin)), acc);
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int r = 0; r < R; ++r) y[(t0 + r) * out + o] = lanes[r];
}

template <int QT>
void rows_times_output(const QuantX& qx, int64_t t0, int64_t rows, const KPacked& w, int64_t o,
                       float* y, int64_t out) {
  switch (rows) {
    case 1: rows_times_output<QT, 1>(qx, t0, w, o, y, out); break;
    case 2: rows_times_output<QT, 2>(qx, t0, w, o, y, out); break;
    case 3: rows_times_output<QT, 3>(qx, t0, w, o, y, out); break;
    case 4: rows_times_output<QT, 4>(qx, t0, w, o, y, out); break;
    case 5: rows_times_output<QT, 5>(qx, t0, w, o, y, out); break;
    case 6: rows_times_output<QT, 6>(qx, t0, w, o, y, out); break;
    case 7: rows_times_output<QT, 7>(qx, t0, w, o, y, out); break;
    default: rows_times_output<QT, 8>(qx, t0, w, o, y, out); break;
  }
}

// ------------------------------------------------ 16 rows of x in the lanes (VPDPBUSD)
//
// For each full group of 16 rows, lane t of a vector is row t: VPDPBUSD multiplies 4
// weights (one u8 quadruple broadcast to all lanes) by each row's 4 int8 of x and adds
// the 4 products, so 8 of them give a sub-block's 32 products for 16 rows, scaled once
// by its sub-block scale (VPMULLD): 10 multiply uops for 16 x 32 products of one output
// where the rows loop takes 16. The integer sums and their float steps are the rows
// loop's, so a row's result is the same bits whichever loop takes it.

constexpr int64_t kLanes = 16;
constexpr int64_t kOuts = 8;  // output rows sharing each vector of x

// x of the full groups of 16 rows in lane order: per group and super-block, 64 vectors of
// 16 rows x 4 int8. [G, nsb, 64, 16, 4]
std::vector<int8_t> lanes_of(const QuantX& qx, int64_t groups) {
  std::vector<int8_t> lanes(groups * qx.nsb * kSuper * kLanes);
  at::parallel_for(0, groups * qx.nsb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / qx.nsb, sb = i % qx.nsb;
      int8_t* dst = lanes.data() + i * kSuper * kLanes;
      for (int64_t t = 0; t < kLanes; ++t) {
        const int8_t* src = qx.qrow(g * kLanes + t, sb);
        for (int64_t k4 = 0; k4 < kSuper / 4; ++k4) std::memcpy(dst + (k4 * kLanes + t) * 4, src + 4 * k4, 4);
      }
    }
  });
  return lanes;
}

// One output row's super-block for the lanes loop: u in element order, the sub-block
// scales as int32, and the bsum pairs' multipliers (Unpacked::aux).
struct alignas(64) LaneW {
  uint8_t u[kSuper];
  int32_t sc[16];
  int16_t aux[16];
  float d, dmin;
};

template <int QT>
inline void unpack_lanes(const uint8_t* b, LaneW& lw) {
  Unpacked u;
  unpack<QT>(b, u);
  for (int k = 0; k < 4; ++k) _mm512_store_si512(lw.u + 64 * k, u.w[k]);
  std::memcpy(lw.aux, u.aux, sizeof lw.aux);
  lw.d = u.d;
  lw.dmin = u.dmin;
  if constexpr (QT == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int s = 0; s < 16; ++s) lw.sc[s] = sc[s];
  } else {
    uint64_t sc, m;
    scale_min(b + 4, sc, m);
    for (int j = 0; j < 8; ++j) lw.sc[j] = static_cast<int32_t>((sc >> (8 * j)) & 0xFF);
  }
}

// R output rows (their super-block sb unpacked in lw) times the 16 rows of group g: the
// rows' float accumulators acc[R] (16 lanes each) take the super-block.
template <int QT, int R>
inline void lanes_block(const QuantX& qx, const int8_t* xq, int64_t g, int64_t sb,
                        const LaneW* lw, __m512* acc) {
  constexpr int kSub = QT == kQ6_K ? 16 : 32;  // elements per sub-block
  __m512i s[R];
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
  for (int j = 0; j < kSuper / kSub; ++j) {
    __m512i p[R];
    for (int r = 0; r < R; ++r) p[r] = _mm512_setzero_si512();
    for (int i = 0; i < kSub / 4; ++i) {
      const int64_t k4 = j * (kSub / 4) + i;
      const __m512i x = _mm512_loadu_si512(xq + k4 * kLanes * 4);
      for (int r = 0; r < R; ++r)
        p[r] = _mm512_dpbusd_epi32(p[r], _mm512_set1_epi32(quad_at(lw[r].u + 4 * k4)), x);
    }
    for (int r = 0; r < R; ++r)
      s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(p[r], _mm512_set1_epi32(lw[r].sc[j])));
  }
  const int64_t t0 = g * kLanes;
  const __m512 dx = _mm512_loadu_ps(qx.dx_rows(t0, sb));
  for (int r = 0; r < R; ++r) {
    __m512i m = _mm512_setzero_si512();
    for (int64_t i = 0; i < qx.pairs; ++i)
      m = _mm512_dpwssd_epi32(m, _mm512_loadu_si512(qx.pair_rows(t0, sb, i)),
                              _mm512_set1_epi32(pair_at(lw[r].aux, i)));
    if constexpr (QT == kQ6_K) {
      const __m512i total = _mm512_sub_epi32(s[r], _mm512_slli_epi32(m, 5));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dx, _mm512_set1_ps(lw[r].d)), acc[r]);
    } else {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(dx, _mm512_set1_ps(lw[r].d)), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dx, _mm512_set1_ps(lw[r].dmin)), acc[r]);
    }
  }
}

constexpr int64_t kPass = 16;  // groups of rows per pass: their accumulators (32 KB) in L1

// Output rows o0 .. o0 + R times every full group of rows, a pass of groups at a time,
// each super-block of the R outputs unpacked once per pass.
template <int QT, int R>
void lanes_outputs(const QuantX& qx, const int8_t* lanes, int64_t groups, const KPacked& w,
                   int64_t o0, float* y, int64_t out, LaneW* lw, __m512* acc) {
  for (int64_t g0 = 0; g0 < groups; g0 += kPass) {
    const int64_t g1 = std::min(groups, g0 + kPass);
    for (int64_t i = 0; i < (g1 - g0) * R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < w.nsb; ++sb) {
      for (int r = 0; r < R; ++r) unpack_lanes<QT>(w.block(o0 + r, sb, QT), lw[r]);
      for (int64_t g = g0; g < g1; ++g)
        lanes_block<QT, R>(qx, lanes + (g * qx.nsb + sb) * kSuper * kLanes, g, sb, lw,
                           acc + (g - g0) * R);
    }
    for (int64_t g = g0; g < g1; ++g)
      for (int r = 0; r < R; ++r) {
        alignas(64) float rows[kLanes];
        _mm512_store_ps(rows, acc[(g - g0) * R + r]);
        for (int64_t t = 0; t < kLanes; ++t) y[(g * kLanes + t) * out + o0 + r] = rows[t];
      }
  }
}

template <int QT>
void mm_lanes(const QuantX& qx, int64_t groups, const KPacked& w, float* y, int64_t out) {
  const std::vector<int8_t> lanes = lanes_of(qx, groups);
  const int64_t chunks = (out + kOuts - 1) / kOuts;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<LaneW[]> lw(new LaneW[kOuts]);
    std::unique_ptr<__m512[]> acc(new __m512[kPass * kOuts]);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t o0 = c * kOuts;
      const int8_t* x = lanes.data();
      switch (std::min(kOuts, out - o0)) {
        case 1: lanes_outputs<QT, 1>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
        case 2: lanes_outputs<QT, 2>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
        case 3: lanes_outputs<QT, 3>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
        case 4: lanes_outputs<QT, 4>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
        case 5: lanes_outputs<QT, 5>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
        case 6: lanes_outputs<QT, 6>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
        case 7: lanes_outputs<QT, 7>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
        default: lanes_outputs<QT, 8>(qx, x, groups, w, o0, y, out, lw.get(), acc.get()); break;
      }
    }
  });
}

template <int QT>
void mm_vnni(const QuantX& qx, int64_t T, const KPacked& w, float* y, int64_t out) {
  const int64_t groups = T / kLanes;  // full groups of 16 rows take the lanes loop
  if (groups > 0) mm_lanes<QT>(qx, groups, w, y, out);
  const int64_t first = groups * kLanes;
  if (first == T) return;
  const int64_t tiles = (out + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t o_end = std::min(out, (tile + 1) * kTile);
      for (int64_t t0 = first; t0 < T; t0 += kGroup)
        for (int64_t o = tile * kTile; o < o_end; ++o)
          rows_times_output<QT>(qx, t0, std::min(kGroup, T - t0), w, o, y, out);
    }
  });
}

#endif  // TESSERA_KQ8_VNNI

template <int QT>
void mm_dispatch(const QuantX& qx, int64_t T, const KPacked& w, float* y, int64_t out) {
#if TESSERA_KQ8_VNNI
  mm_vnni<QT>(qx, T, w, y, out);
#else
  mm_portable<QT>(qx, T, w, y, out);
#endif
}

}  // namespace

namespace tessera {

torch::Tensor kquant_q8_mm(const torch::Tensor& x, const torch::Tensor& raw, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K,
              "kquant_q8_mm: unsupported GGML type ", qtype, " (Q4_K, Q5_K or Q6_K)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "kquant_q8_mm: x must be a contiguous float32 [T, in] tensor");
  const int64_t bb = block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous() &&
                  raw.size(1) % bb == 0,
              "kquant_q8_mm: the weight must be a contiguous uint8 [out, in / 256 * ", bb,
              "] tensor");
  const int64_t nsb = raw.size(1) / bb;
  const KPacked w{raw.data_ptr<uint8_t>(), raw.size(1), nsb, nsb * kSuper};
  const int64_t T = x.size(0), out = raw.size(0);
  TORCH_CHECK(x.size(1) == w.in, "kquant_q8_mm: x has ", x.size(1), " features, W takes ", w.in);
  auto y = torch::empty({T, out}, x.options());
  if (T == 0 || out == 0) return y;
  const QuantX qx = quantize(x.data_ptr<float>(), T, w.in, static_cast<int>(qtype));
  float* yp = y.data_ptr<float>();
  switch (qtype) {
    case kQ4_K: mm_dispatch<kQ4_K>(qx, T, w, yp, out); break;
    case kQ5_K: mm_dispatch<kQ5_K>(qx, T, w, yp, out); break;
    default: mm_dispatch<kQ6_K>(qx, T, w, yp, out); break;
  }
  return y;
}

void register_kquant_q8(pybind11::module& m) {
  m.def("kquant_q8_mm", &kquant_q8_mm,
        "y = x @ W^T for GGUF Q4_K/Q5_K/Q6_K weights, x quantised to int8 per 256 (Q8_K)",
        py::arg("x"), py::arg("raw"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  m.attr("kquant_q8_vnni") = static_cast<bool>(TESSERA_KQ8_VNNI);
}

}  // namespace tessera

#ifdef TESSERA_KQ8_STANDALONE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { tessera::register_kquant_q8(m); }
#endif
