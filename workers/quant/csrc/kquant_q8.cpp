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
// A weight super-block is unpacked in registers to its unsigned 4/5/6-bit values u and
// multiplied with q in int32, then scaled once per super-block in float32:
//
//   Q4_K/Q5_K  w = d sc_j u - dmin m_j   (8 sub-blocks j of 32)
//              y += d_x d (sum_j sc_j sum_i u q) - d_x dmin (sum_j m_j sum_i q)
//   Q6_K       w = d sc_s (u - 32)        (16 sub-blocks s of 16, sc_s int8)
//              y += d_x d (sum_s sc_s sum_i u q - 32 sum_s sc_s sum_i q)
//
// The integer sums are exact, so y differs from x_q @ gguf.dequantize(W)^T (x_q = d_x q)
// only by float32 rounding. The AVX512-VNNI loop multiplies 64 weights by 64 of q with
// VPMADDUBSW (u8 x s8 pairs -> int16, at most 2 * 63 * 127: no saturation) and scales
// the pairs by their sub-block's scale while summing them with VPDPWSSD; a super-block
// is unpacked once and used by up to kGroup rows of x. Parallel over output rows
// (at::parallel_for); for more rows a tile of kTile outputs is swept by each group of
// rows, so the weights come from memory once and from L2 after. Elsewhere a portable
// loop computes the same integers.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
// each 16 (int16 [16]).
struct QuantX {
  std::vector<int8_t> q;    // [T, in]
  std::vector<float> d;     // [T, nsb]
  std::vector<int16_t> bs;  // [T, nsb, 16]
  int64_t in, nsb;
  const int8_t* qrow(int64_t t, int64_t sb) const { return q.data() + t * in + sb * kSuper; }
  float dx(int64_t t, int64_t sb) const { return d[t * nsb + sb]; }
  const int16_t* sums(int64_t t, int64_t sb) const { return bs.data() + (t * nsb + sb) * kSums; }
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

QuantX quantize(const float* x, int64_t T, int64_t in) {
  QuantX qx;
  qx.in = in;
  qx.nsb = in / kSuper;
  qx.q.resize(T * in);
  qx.d.resize(T * qx.nsb);
  qx.bs.resize(T * qx.nsb * kSums);
  at::parallel_for(0, T * qx.nsb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_block(x + i * kSuper, qx.q.data() + i * kSuper, qx.d.data() + i,
                     qx.bs.data() + i * kSums);
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
      acc += static_cast<float>(p) * (dx * half_at(b + 208));
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
      acc += static_cast<float>(p) * (dx * half_at(b));
      acc -= static_cast<float>(pm) * (dx * half_at(b + 2));
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
// scale of each of their pairs (VPMADDUBSW's outputs), aux the 16 int16 that multiply the
// row's bsums (Q4_K/Q5_K: m_j twice; Q6_K: sc_s), d and dmin.
struct Unpacked {
  __m512i w[4], s[4];
  __m256i aux;
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
    u.aux = sc;
    u.d = half_at(b + 208);
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
    u.aux = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb));  // m_j for bsums 2j, 2j + 1
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

// R rows of x (from t0) times output row o, into y.
template <int QT, int R>
inline void rows_times_output(const QuantX& qx, int64_t t0, const KPacked& w, int64_t o,
                              float* y, int64_t out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  Unpacked u;
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const uint8_t* b = w.block(o, sb, QT);
    for (int64_t line = 0; line < block_bytes(QT); line += 64)  // the stream, ahead
      _mm_prefetch(reinterpret_cast<const char*>(b + kAhead + line), _MM_HINT_T0);
    unpack<QT>(b, u);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = qx.qrow(t0 + r, sb);
      __m512i p = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k)
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(u.w[k], _mm512_loadu_si512(q + 64 * k)), u.s[k]);
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.sums(t0 + r, sb)));
      const __m256i pm = _mm256_madd_epi16(bs, u.aux);  // 8 int32
      const float dx = qx.dx(t0 + r, sb);
      if constexpr (QT == kQ6_K) {  // sc_s (u - 32): the -32 through the bsums
        p = _mm512_sub_epi32(p, _mm512_zextsi256_si512(_mm256_slli_epi32(pm, 5)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dx * u.d), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dx * u.d), acc[r]);
        const __m512 mins = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(pm));
        acc[r] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(dx * u.dmin), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[(t0 + r) * out + o] = _mm512_reduce_add_ps(acc[r]);
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

template <int QT>
void mm_vnni(const QuantX& qx, int64_t T, const KPacked& w, float* y, int64_t out) {
  const int64_t tiles = (out + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t o_end = std::min(out, (tile + 1) * kTile);
      for (int64_t t0 = 0; t0 < T; t0 += kGroup)
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
  const QuantX qx = quantize(x.data_ptr<float>(), T, w.in);
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
