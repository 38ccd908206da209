// y[T, out] = x[T, in] @ dequant(W)^T for GGUF K-quant weights (Q4_K, Q5_K, Q6_K), in
// float32; and the rows of such a matrix, dequantised (a packed embedding's lookup).
//
// The weights are the file's super-blocks of 256 verbatim, one row of them per output
// (layouts: tessera/workers/quant/kquants.py). Each super-block is dequantised in
// registers with gguf's own arithmetic: (d * sc) * q - dmin * m (Q4_K, Q5_K) and
// (d * sc) * q (Q6_K), every product and difference rounded to float32 on its own (the
// build's -ffp-contract=off), so the only difference from x @ gguf.dequantize(W).T is
// the order of the float32 sums. Q4_K and Q5_K look each weight up in a table of the
// sub-block's 16 or 32 possible values (the table's entries are computed as gguf
// computes each weight); Q6_K's 6-bit values are assembled as bytes, 64 at a time.
//
// Two loops, both parallel over output rows with at::parallel_for (torch's threads):
//   T <= 12 (Q6_K: 4)   each super-block is dequantised once per 8 rows of x, 16
//                       weights a zmm, and multiplied with those rows (decode: memory
//                       bound, weights read from memory once, then from L1);
//   more rows           16 output rows are dequantised and transposed into an fp32
//                       buffer [in, 16], then every 8 rows of x run an outer-product
//                       micro-kernel (x broadcast, 16 outputs a zmm: no horizontal sums).
// Without AVX-512, a portable loop dequantises a row (the scalar code below, also the
// embedding's) and takes dot products the compiler vectorises.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "outer16.h"
#define TESSERA_KQ_AVX512 1
#else
#define TESSERA_KQ_AVX512 0
#endif

namespace {

constexpr int64_t kSuper = 256;
// GGML type ids (gguf.GGMLQuantizationType)
constexpr int kQ4_K = 12;
constexpr int kQ5_K = 13;
constexpr int kQ6_K = 14;
constexpr int64_t kRegisterRows = 8;  // the most x rows the register loop takes at once
// The most x rows the register loop takes, in groups of kRegisterRows over each output
// row's blocks (read from memory for the first group, from L1 for the others).
constexpr int64_t kGroupedRows = 16;
// Where the register loop stops being faster than the buffered one (one core, 8192 x 2048:
// Q4_K at 8 rows 3.8 ms against 5.3; Q6_K, whose 16 scales a super-block cost a product
// per 16 weights, even at 4 rows and 1.2x slower at 8). Two cores, a Llama-3.2-1B's Q4_K
// matrices (Sapphire Rapids): 9 rows 140 ms in groups against 193 buffered, 12 rows 175
// against 206, 16 rows the same; its Q6_K ones 41 against 31 at 9 rows.
constexpr int64_t register_rows_for(int qt) { return qt == kQ6_K ? 4 : 12; }
constexpr int64_t kTile = 16;         // output rows per tile in the buffered loop (a zmm)

constexpr int64_t block_bytes(int qt) { return qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : 210; }

struct KPacked {
  const uint8_t* data;
  int64_t row_bytes;
  int64_t nsb;  // super-blocks per row
  int64_t in;
  const uint8_t* block(int64_t o, int64_t sb, int qt) const {
    return data + o * row_bytes + sb * block_bytes(qt);
  }
};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K/Q5_K's 12 scale bytes -> sc[8], m[8] (6 bits each), as gguf's get_scale_min.
inline void scale_min(const uint8_t* s, uint8_t sc[8], uint8_t m[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    m[j] = s[j + 4] & 0x3F;
    sc[j + 4] = static_cast<uint8_t>((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    m[j + 4] = static_cast<uint8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

// ---------------------------------------------------------------- portable (any CPU)

// One super-block's 256 weights, exactly as gguf.dequantize gives them.
template <int QT>
void dequant_super_scalar(const uint8_t* b, float* y) {
  if constexpr (QT == kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 4; ++r)
        for (int i = 0; i < 32; ++i) {
          const int e = 128 * h + 32 * r + i;
          const int lo = (ql[64 * h + 32 * (r & 1) + i] >> (4 * (r >> 1))) & 0x0F;
          const int hi = (qh[32 * h + i] >> (2 * r)) & 0x03;
          const int q = static_cast<int8_t>(lo | (hi << 4)) - 32;
          const float ds = d * static_cast<float>(sc[e / 16]);
          y[e] = ds * static_cast<float>(q);
        }
  } else {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sc[8], m[8];
    scale_min(b + 4, sc, m);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (QT == kQ5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      const float ds = d * static_cast<float>(sc[j]);
      const float dm = dmin * static_cast<float>(m[j]);
      for (int i = 0; i < 32; ++i) {
        int q = (qs[32 * (j / 2) + i] >> (4 * (j & 1))) & 0x0F;
        if constexpr (QT == kQ5_K) q |= ((qh[i] >> j) & 1) << 4;
        y[32 * j + i] = ds * static_cast<float>(q) - dm;
      }
    }
  }
}

template <int QT>
void dequant_row_scalar(const KPacked& w, int64_t o, float* out) {
  for (int64_t sb = 0; sb < w.nsb; ++sb) dequant_super_scalar<QT>(w.block(o, sb, QT), out + sb * kSuper);
}

inline float dot_portable(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};  // independent lanes: the compiler vectorises this loop
  for (int64_t k = 0; k < n; k += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[k + j] * b[k + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

template <int QT>
void mm_portable(const float* x, int64_t T, const KPacked& w, float* y, int64_t out) {
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(w.in);
    for (int64_t o = begin; o < end; ++o) {
      dequant_row_scalar<QT>(w, o, row.data());
      for (int64_t t = 0; t < T; ++t) y[t * out + o] = dot_portable(x + t * w.in, row.data(), w.in);
    }
  });
}

// ---------------------------------------------------------------- AVX-512

#if TESSERA_KQ_AVX512

inline __m512i load_epu8_epi32(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Bit j of each lane moved to bit 4 (Q5_K's fifth bit of sub-block j).
template <int J>
inline __m512i bit_to_4(__m512i h) {
  if constexpr (J < 4) return _mm512_slli_epi32(h, 4 - J);
  else if constexpr (J == 4) return h;
  else return _mm512_srli_epi32(h, J - 4);
}

// (c & 0x0F ? a : b) bit by bit, c = 0x0F: the low 4 bits of a, the rest of b.
inline __m512i low4_of_a(__m512i a, __m512i b) {
  return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi32(0x0F), 0xE4);
}

// Calls f(k, w) for k = 0..15, w the zmm of weights 16k .. 16k + 15 of super-block b,
// each exactly as gguf dequantises it.
template <int QT, int G = 0, class F>
inline void q45_group(const uint8_t* b, const float* ds, const float* dm, __m512i h0, __m512i h1,
                      F& f) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* qs = b + (QT == kQ5_K ? 48 : 16) + 32 * G;
  const __m512i q0 = load_epu8_epi32(qs), q1 = load_epu8_epi32(qs + 16);
  const __m512i p0 = _mm512_srli_epi32(q0, 4), p1 = _mm512_srli_epi32(q1, 4);
  // sub-block 2G: the low nibbles (the table lookup ignores the high ones), 2G + 1: the high
  for (int s = 0; s < 2; ++s) {
    const int j = 2 * G + s;
    const __m512 d = _mm512_set1_ps(ds[j]), m = _mm512_set1_ps(dm[j]);
    const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(d, iota), m);
    const __m512i a0 = s == 0 ? q0 : p0, a1 = s == 0 ? q1 : p1;
    if constexpr (QT == kQ4_K) {
      f(4 * G + 2 * s, _mm512_permutexvar_ps(a0, t0));
      f(4 * G + 2 * s + 1, _mm512_permutexvar_ps(a1, t0));
    } else {
      const __m512 t1 =
          _mm512_sub_ps(_mm512_mul_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.f))), m);
      __m512i b0, b1;
      if (s == 0) {
        b0 = bit_to_4<2 * G>(h0);
        b1 = bit_to_4<2 * G>(h1);
      } else {
        b0 = bit_to_4<2 * G + 1>(h0);
        b1 = bit_to_4<2 * G + 1>(h1);
      }
      f(4 * G + 2 * s, _mm512_permutex2var_ps(t0, low4_of_a(a0, b0), t1));
      f(4 * G + 2 * s + 1, _mm512_permutex2var_ps(t0, low4_of_a(a1, b1), t1));
    }
  }
  if constexpr (G < 3) q45_group<QT, G + 1>(b, ds, dm, h0, h1, f);
}

template <int QT, class F>
inline void super_chunks(const uint8_t* b, F&& f) {
  if constexpr (QT == kQ6_K) {
    alignas(64) float ds[16];
    const __m512 scv =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    _mm512_store_ps(ds, _mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)), scv));
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i k32 = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m256i qh32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh32), qh32, 1);
      // bytes 0..31: r = 0 (qh bits 0-1 to bits 4-5), 32..63: r = 1 (bits 2-3); then r = 2, 3
      const __m512i ha = _mm512_and_si512(_mm512_sllv_epi16(qh, shl), bits45);
      const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(qh, shr), bits45);
      const __m512i v01 = _mm512_ternarylogic_epi32(ql, ha, low4, 0xE4);
      const __m512i v23 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), hb, low4, 0xE4);
      alignas(64) int8_t q[128];
      _mm512_store_si512(q, _mm512_sub_epi8(v01, k32));
      _mm512_store_si512(q + 64, _mm512_sub_epi8(v23, k32));
      for (int c = 0; c < 8; ++c) {
        const int k = 8 * h + c;
        const __m512i qi = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * c)));
        f(k, _mm512_mul_ps(_mm512_set1_ps(ds[k]), _mm512_cvtepi32_ps(qi)));
      }
    }
  } else {
    alignas(32) float ds[8], dm[8];
    // scale_min on 4 bytes at a time: a = bytes 0-3, c = 4-7, e = 8-11
    uint32_t a, c, e;
    std::memcpy(&a, b + 4, 4);
    std::memcpy(&c, b + 8, 4);
    std::memcpy(&e, b + 12, 4);
    const uint64_t sc = (a & 0x3F3F3F3Fu) |
                        static_cast<uint64_t>((e & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
    const uint64_t m = (c & 0x3F3F3F3Fu) |
                       static_cast<uint64_t>(((e >> 4) & 0x0F0F0F0Fu) | ((c >> 2) & 0x30303030u))
                           << 32;
    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc)));
    const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m)));
    _mm256_store_ps(ds, _mm256_mul_ps(_mm256_set1_ps(half_at(b)), scf));
    _mm256_store_ps(dm, _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), mf));
    __m512i h0 = _mm512_setzero_si512(), h1 = h0;
    if constexpr (QT == kQ5_K) {
      h0 = load_epu8_epi32(b + 16);
      h1 = load_epu8_epi32(b + 32);
    }
    q45_group<QT>(b, ds, dm, h0, h1, f);
  }
}

// R rows of x times O output rows from o: weights dequantised in registers, two
// accumulators (even and odd chunks) per (output, row).
template <int QT, int R, int O>
inline void rows_registers(const float* x, const KPacked& w, float* y, int64_t out, int64_t o) {
  __m512 acc[O][R][2];
  for (int c = 0; c < O; ++c)
    for (int r = 0; r < R; ++r) acc[c][r][0] = acc[c][r][1] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const float* xs = x + sb * kSuper;
    for (int c = 0; c < O; ++c) {
      // the next O output rows' block, asked for while this one's are multiplied: the
      // CPU's own prefetcher follows O streams poorly and stops at each 4 KiB page
      const char* next = reinterpret_cast<const char*>(w.block(o + c + O, sb, QT));
      for (int64_t line = 0; line < block_bytes(QT); line += 64)
        _mm_prefetch(next + line, _MM_HINT_T0);
      super_chunks<QT>(w.block(o + c, sb, QT), [&](int k, __m512 wv) {
        for (int r = 0; r < R; ++r)
          acc[c][r][k & 1] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xs + r * w.in + 16 * k), acc[c][r][k & 1]);
      });
    }
  }
  for (int c = 0; c < O; ++c)
    for (int r = 0; r < R; ++r)
      y[r * out + o + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[c][r][0], acc[c][r][1]));
}

template <int QT, int R>
void rows_registers(const float* x, const KPacked& w, float* y, int64_t out, int64_t begin,
                    int64_t end) {
  constexpr int O = R == 1 ? 4 : R <= 4 ? 2 : 1;
  int64_t o = begin;
  for (; o + O <= end; o += O) rows_registers<QT, R, O>(x, w, y, out, o);
  for (; o < end; ++o) rows_registers<QT, R, 1>(x, w, y, out, o);
}

// One output row o times R <= kRegisterRows rows of x (R known at run time).
template <int QT>
void rows_registers_one(int64_t R, const float* x, const KPacked& w, float* y, int64_t out,
                        int64_t o) {
  switch (R) {
    case 1: rows_registers<QT, 1, 1>(x, w, y, out, o); break;
    case 2: rows_registers<QT, 2, 1>(x, w, y, out, o); break;
    case 3: rows_registers<QT, 3, 1>(x, w, y, out, o); break;
    case 4: rows_registers<QT, 4, 1>(x, w, y, out, o); break;
    case 5: rows_registers<QT, 5, 1>(x, w, y, out, o); break;
    case 6: rows_registers<QT, 6, 1>(x, w, y, out, o); break;
    case 7: rows_registers<QT, 7, 1>(x, w, y, out, o); break;
    default: rows_registers<QT, 8, 1>(x, w, y, out, o); break;
  }
}

template <int QT>
void mm_registers(const float* x, int64_t T, const KPacked& w, float* y, int64_t out) {
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    if (T > kRegisterRows) {  // each output row's blocks from memory once, then from L1
      for (int64_t o = begin; o < end; ++o)
        for (int64_t t = 0; t < T; t += kRegisterRows)
          rows_registers_one<QT>(std::min(kRegisterRows, T - t), x + t * w.in, w, y + t * out,
                                 out, o);
      return;
    }
    switch (T) {
      case 1: rows_registers<QT, 1>(x, w, y, out, begin, end); break;
      case 2: rows_registers<QT, 2>(x, w, y, out, begin, end); break;
      case 3: rows_registers<QT, 3>(x, w, y, out, begin, end); break;
      case 4: rows_registers<QT, 4>(x, w, y, out, begin, end); break;
      case 5: rows_registers<QT, 5>(x, w, y, out, begin, end); break;
      case 6: rows_registers<QT, 6>(x, w, y, out, begin, end); break;
      case 7: rows_registers<QT, 7>(x, w, y, out, begin, end); break;
      default: rows_registers<QT, 8>(x, w, y, out, begin, end); break;
    }
  });
}

using tessera::outer16::micro_outer;
using tessera::outer16::transpose16;
static_assert(kTile == tessera::outer16::kTile, "the buffer's tile is outer16's");

template <int QT>
void mm_buffered(const float* x, int64_t T, const KPacked& w, float* y, int64_t out) {
  const int64_t tiles = (out + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(w.in * kTile);  // [in, 16]: the tile's rows, transposed
    alignas(64) float rows[kTile][kSuper];  // one super-block of each of the tile's rows
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t o0 = tile * kTile;
      const int64_t nr = std::min(kTile, out - o0);
      if (nr < kTile) std::memset(rows, 0, sizeof(rows));
      for (int64_t sb = 0; sb < w.nsb; ++sb) {
        for (int64_t c = 0; c < nr; ++c) {
          // the next tile's block into L2 (it waits there while this tile's products run)
          const char* next = reinterpret_cast<const char*>(w.block(o0 + kTile + c, sb, QT));
          for (int64_t line = 0; line < block_bytes(QT); line += 64)
            _mm_prefetch(next + line, _MM_HINT_T1);
          super_chunks<QT>(w.block(o0 + c, sb, QT),
                           [&](int k, __m512 wv) { _mm512_store_ps(rows[c] + 16 * k, wv); });
        }
        float* dst = buf.data() + sb * kSuper * kTile;
        for (int k = 0; k < kSuper / 16; ++k) {
          __m512 v[kTile];
          for (int c = 0; c < kTile; ++c) v[c] = _mm512_load_ps(rows[c] + 16 * k);
          transpose16(v);
          for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + (16 * k + j) * kTile, v[j]);
        }
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << nr) - 1u);
      const float* bp = buf.data();
      int64_t t = 0;
      for (; t + 8 <= T; t += 8) micro_outer<8>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask);
      switch (T - t) {
        case 1: micro_outer<1>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask); break;
        case 2: micro_outer<2>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask); break;
        case 3: micro_outer<3>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask); break;
        case 4: micro_outer<4>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask); break;
        case 5: micro_outer<5>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask); break;
        case 6: micro_outer<6>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask); break;
        case 7: micro_outer<7>(x + t * w.in, w.in, bp, y + t * out + o0, out, mask); break;
        default: break;
      }
    }
  });
}

#endif  // TESSERA_KQ_AVX512

template <int QT>
void mm_dispatch(const float* x, int64_t T, const KPacked& w, float* y, int64_t out,
                 int64_t register_rows) {
#if TESSERA_KQ_AVX512
  if (T <= register_rows) {
    mm_registers<QT>(x, T, w, y, out);
  } else {
    mm_buffered<QT>(x, T, w, y, out);
  }
#else
  (void)register_rows;
  mm_portable<QT>(x, T, w, y, out);
#endif
}

KPacked k_matrix(const char* what, const torch::Tensor& raw, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K, what,
              ": unsupported GGML type ", qtype, " (Q4_K, Q5_K or Q6_K)");
  const int64_t bb = block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous() &&
                  raw.size(1) % bb == 0,
              what, ": the weight must be a contiguous uint8 [out, in / 256 * ", bb, "] tensor");
  const int64_t nsb = raw.size(1) / bb;
  return KPacked{raw.data_ptr<uint8_t>(), raw.size(1), nsb, nsb * kSuper};
}

}  // namespace

namespace tessera {

// register_rows: the most rows of x that take the register loop (-1: this type's own
// crossover; 0: every product buffered, for tests).
torch::Tensor kquant_mm(const torch::Tensor& x, const torch::Tensor& raw, int64_t qtype,
                        int64_t register_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "kquant_mm: x must be a contiguous float32 [T, in] tensor");
  const KPacked w = k_matrix("kquant_mm", raw, qtype);
  const int64_t T = x.size(0), out = raw.size(0);
  TORCH_CHECK(x.size(1) == w.in, "kquant_mm: x has ", x.size(1), " features, W takes ", w.in);
  if (register_rows < 0) register_rows = register_rows_for(static_cast<int>(qtype));
  TORCH_CHECK(register_rows <= kGroupedRows, "kquant_mm: register_rows must be at most ",
              kGroupedRows);
  auto y = torch::empty({T, out}, x.options());
  if (T == 0 || out == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (qtype) {
    case kQ4_K: mm_dispatch<kQ4_K>(xp, T, w, yp, out, register_rows); break;
    case kQ5_K: mm_dispatch<kQ5_K>(xp, T, w, yp, out, register_rows); break;
    default: mm_dispatch<kQ6_K>(xp, T, w, yp, out, register_rows); break;
  }
  return y;
}

// Rows `ids` of the packed matrix, dequantised: float32 [ids, in], each value what
// gguf.dequantize gives (dequant_super_scalar): a packed embedding's lookup.
torch::Tensor kquant_rows(const torch::Tensor& ids, const torch::Tensor& raw, int64_t qtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.device().is_cpu(),
              "kquant_rows: ids must be a 1-D int64 CPU tensor");
  const KPacked w = k_matrix("kquant_rows", raw, qtype);
  const auto idc = ids.contiguous();
  const int64_t n = idc.numel(), rows = raw.size(0);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "kquant_rows: id ", id[i], " at ", i,
                " is outside the matrix's ", rows, " rows");
  auto y = torch::empty({n, w.in}, raw.options().dtype(torch::kFloat32));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      switch (qtype) {
        case kQ4_K: dequant_row_scalar<kQ4_K>(w, id[i], yp + i * w.in); break;
        case kQ5_K: dequant_row_scalar<kQ5_K>(w, id[i], yp + i * w.in); break;
        default: dequant_row_scalar<kQ6_K>(w, id[i], yp + i * w.in); break;
      }
    }
  });
  return y;
}

void register_kquant_mm(pybind11::module& m) {
  m.def("kquant_mm", &kquant_mm,
        "y = x @ dequant(W)^T for GGUF Q4_K/Q5_K/Q6_K weights kept as the file's super-blocks",
        py::arg("x"), py::arg("raw"), py::arg("qtype"), py::arg("register_rows") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("kquant_rows", &kquant_rows,
        "rows ids of a GGUF Q4_K/Q5_K/Q6_K matrix, dequantised to float32 [ids, in]",
        py::arg("ids"), py::arg("raw"), py::arg("qtype"), py::call_guard<py::gil_scoped_release>());
  m.attr("kquant_avx512") = static_cast<bool>(TESSERA_KQ_AVX512);
}

}  // namespace tessera

#ifdef TESSERA_KQ_STANDALONE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { tessera::register_kquant_mm(m); }
#endif
