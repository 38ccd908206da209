// y[T, out] = x[T, in] @ dequant(W)^T for GGUF Q4_0 / Q4_1 / Q8_0 weights, in float32.
//
// The weights stay packed as the GGUF file stores them (blocks of 32 along `in`); each
// block is dequantised in registers with gguf's own arithmetic (d * (q - 8), d * q + m,
// d * q: a product and a sum rounded separately, never fused), so the only difference
// from `x @ gguf.dequantize(W).T` is the order of the fp32 sums. Activations stay fp32.
//
// Layout (see tessera/workers/quant/blocks.py):
//   qs      Q4_x: uint8 [out, in / 2], 16 bytes a block: byte j holds element j (low
//           nibble) and element j + 16 (high nibble).  Q8_0: int8 [out, in].
//   scales  fp16 [out, in / 32];  mins fp16 [out, in / 32] (Q4_1 only).
//
// Two loops, both parallel over output rows with at::parallel_for (torch's threads):
//   T <= kSmallRows  each block is dequantised once in registers and multiplied with
//                    every row of x (memory-bound decode: weights read once).
//   T >  kSmallRows  16 output rows are dequantised and transposed into an fp32 buffer
//                    [in, 16], then every 8 rows of x run an outer-product micro-kernel
//                    (x broadcast, 16 outputs a zmm: no horizontal sums).
// Built with -march=native and -ffp-contract=off (keeps d * q + m two roundings).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "outer16.h"
#define TESSERA_AVX512 1
#else
#define TESSERA_AVX512 0
#endif

namespace {

constexpr int64_t kBlock = 32;
// GGML type ids (gguf.GGMLQuantizationType)
constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ8_0 = 8;
constexpr int64_t kSmallRows = 4;  // x rows that the register loop takes at once
constexpr int64_t kTile = 16;      // output rows per tile in the buffered loop (a zmm)

struct Packed {
  const uint8_t* qs;
  const uint16_t* scales;
  const uint16_t* mins;  // nullptr unless Q4_1
  int64_t in;
  int64_t nb;         // blocks per row
  int64_t qs_stride;  // bytes per row
};

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ---------------------------------------------------------------- portable (any CPU)

template <int QT>
void dequant_row_scalar(const Packed& w, int64_t o, float* out) {
  const uint8_t* q = w.qs + o * w.qs_stride;
  for (int64_t b = 0; b < w.nb; ++b) {
    const float d = half_to_float(w.scales[o * w.nb + b]);
    float* dst = out + b * kBlock;
    if constexpr (QT == kQ8_0) {
      const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * kBlock;
      for (int j = 0; j < kBlock; ++j) dst[j] = d * static_cast<float>(qb[j]);
    } else {
      const uint8_t* qb = q + b * (kBlock / 2);
      if constexpr (QT == kQ4_0) {
        for (int j = 0; j < kBlock / 2; ++j) {
          dst[j] = d * static_cast<float>(static_cast<int>(qb[j] & 0x0F) - 8);
          dst[j + 16] = d * static_cast<float>(static_cast<int>(qb[j] >> 4) - 8);
        }
      } else {
        const float m = half_to_float(w.mins[o * w.nb + b]);
        for (int j = 0; j < kBlock / 2; ++j) {
          dst[j] = d * static_cast<float>(qb[j] & 0x0F) + m;
          dst[j + 16] = d * static_cast<float>(qb[j] >> 4) + m;
        }
      }
    }
  }
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
void mm_portable(const float* x, int64_t T, const Packed& w, float* y, int64_t out) {
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(w.in);
    for (int64_t o = begin; o < end; ++o) {
      dequant_row_scalar<QT>(w, o, row.data());
      for (int64_t t = 0; t < T; ++t) y[t * out + o] = dot_portable(x + t * w.in, row.data(), w.in);
    }
  });
}

// ---------------------------------------------------------------- AVX-512

#if TESSERA_AVX512

// The 32 weights of block b of row o, exactly as gguf dequantises them, in two zmm:
// w0 = elements 0..15, w1 = elements 16..31.
template <int QT>
inline void dequant_block(const Packed& w, int64_t o, int64_t b, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(w.scales[o * w.nb + b]));
  if constexpr (QT == kQ8_0) {
    const uint8_t* q = w.qs + o * w.qs_stride + b * kBlock;
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i q1 =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1));
  } else {
    // A 16-entry table of the block's 16 possible values; vpermps picks by the low 4
    // bits of each lane, so the low nibble needs no mask.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if constexpr (QT == kQ4_0) {
      table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)));
    } else {
      const __m512 m = _mm512_set1_ps(_cvtsh_ss(w.mins[o * w.nb + b]));
      table = _mm512_add_ps(_mm512_mul_ps(d, iota), m);
    }
    const uint8_t* q = w.qs + o * w.qs_stride + b * (kBlock / 2);
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i hi = _mm512_srli_epi32(lo, 4);
    w0 = _mm512_permutexvar_ps(lo, table);
    w1 = _mm512_permutexvar_ps(hi, table);
  }
}

// R rows of x (R <= 4) times O output rows from o: weights dequantised in registers.
// Two accumulators per (row, output) and O = 2 outputs at once keep 4+ FMA chains going.
template <int QT, int R, int O>
inline void rows_registers(const float* x, const Packed& w, float* y, int64_t out, int64_t o) {
  __m512 acc0[O][R], acc1[O][R];
  for (int c = 0; c < O; ++c)
    for (int r = 0; r < R; ++r) acc0[c][r] = acc1[c][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    __m512 w0[O], w1[O];
    for (int c = 0; c < O; ++c) dequant_block<QT>(w, o + c, b, w0[c], w1[c]);
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * w.in + b * kBlock);
      const __m512 x1 = _mm512_loadu_ps(x + r * w.in + b * kBlock + 16);
      for (int c = 0; c < O; ++c) {
        acc0[c][r] = _mm512_fmadd_ps(w0[c], x0, acc0[c][r]);
        acc1[c][r] = _mm512_fmadd_ps(w1[c], x1, acc1[c][r]);
      }
    }
  }
  for (int c = 0; c < O; ++c)
    for (int r = 0; r < R; ++r)
      y[r * out + o + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[c][r], acc1[c][r]));
}

template <int QT, int R>
void rows_registers(const float* x, const Packed& w, float* y, int64_t out, int64_t begin,
                    int64_t end) {
  int64_t o = begin;
  for (; o + 2 <= end; o += 2) rows_registers<QT, R, 2>(x, w, y, out, o);
  if (o < end) rows_registers<QT, R, 1>(x, w, y, out, o);
}

template <int QT>
void mm_registers(const float* x, int64_t T, const Packed& w, float* y, int64_t out) {
  at::parallel_for(0, out, 32, [&](int64_t begin, int64_t end) {
    switch (T) {
      case 1: rows_registers<QT, 1>(x, w, y, out, begin, end); break;
      case 2: rows_registers<QT, 2>(x, w, y, out, begin, end); break;
      case 3: rows_registers<QT, 3>(x, w, y, out, begin, end); break;
      default: rows_registers<QT, 4>(x, w, y, out, begin, end); break;
    }
  });
}

using tessera::outer16::micro_outer;
using tessera::outer16::transpose16;
static_assert(kTile == tessera::outer16::kTile, "the buffer's tile is outer16's");

template <int QT>
void mm_buffered(const float* x, int64_t T, const Packed& w, float* y, int64_t out) {
  const int64_t tiles = (out + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(w.in * kTile);  // [in, 16]: the tile's rows, transposed
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t o0 = tile * kTile;
      const int64_t nr = std::min(kTile, out - o0);
      for (int64_t b = 0; b < w.nb; ++b) {
        __m512 lo[kTile], hi[kTile];
        for (int64_t c = 0; c < kTile; ++c) {
          if (c < nr) {
            dequant_block<QT>(w, o0 + c, b, lo[c], hi[c]);
          } else {
            lo[c] = hi[c] = _mm512_setzero_ps();
          }
        }
        transpose16(lo);
        transpose16(hi);
        float* dst = buf.data() + b * kBlock * kTile;
        for (int j = 0; j < 16; ++j) {
          _mm512_storeu_ps(dst + j * kTile, lo[j]);
          _mm512_storeu_ps(dst + (16 + j) * kTile, hi[j]);
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

#endif  // TESSERA_AVX512

template <int QT>
void mm_dispatch(const float* x, int64_t T, const Packed& w, float* y, int64_t out) {
#if TESSERA_AVX512
  if (T <= kSmallRows) {
    mm_registers<QT>(x, T, w, y, out);
  } else {
    mm_buffered<QT>(x, T, w, y, out);
  }
#else
  mm_portable<QT>(x, T, w, y, out);
#endif
}

}  // namespace

namespace tessera {

void register_decode_layers(pybind11::module& m);  // decode_layers.cpp
void register_rows(pybind11::module& m);           // rows.cpp
void register_q4_bf16(pybind11::module& m);        // q4_bf16.cpp
void register_q8_bf16(pybind11::module& m);        // q8_bf16.cpp
void register_tiled_f32(pybind11::module& m);      // tiled_f32.cpp
void register_q8_screen(pybind11::module& m);      // q8_screen.cpp
void register_kquant_mm(pybind11::module& m);      // kquant_mm.cpp
void register_kquant_q8(pybind11::module& m);      // kquant_q8.cpp

namespace {

// The packed matrix [out, in] that qs, scales and mins hold, checked; `in` from scales
// (32 inputs a block). `what` names the caller in errors.
Packed packed_matrix(const char* what, const torch::Tensor& qs, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& mins, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, what,
              ": unsupported GGML type ", qtype);
  TORCH_CHECK(qs.dim() == 2 && scales.dim() == 2 && scales.scalar_type() == torch::kFloat16 &&
                  scales.is_contiguous() && scales.size(0) == qs.size(0),
              what, ": scales must be a contiguous float16 [out, in / 32] tensor");
  const int64_t nb = scales.size(1), in = nb * kBlock;
  const int64_t qs_stride = qtype == kQ8_0 ? in : in / 2;
  TORCH_CHECK(qs.dim() == 2 && qs.size(1) == qs_stride && qs.is_contiguous() &&
                  qs.element_size() == 1,
              what, ": qs must be a contiguous [out, ", qs_stride, "] byte tensor");
  const uint16_t* mins_ptr = nullptr;
  if (qtype == kQ4_1) {
    TORCH_CHECK(mins.has_value() && mins->scalar_type() == torch::kFloat16 &&
                    mins->is_contiguous() && mins->sizes() == scales.sizes(),
                what, ": Q4_1 needs float16 mins shaped like scales");
    mins_ptr = reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>());
  }
  return Packed{static_cast<const uint8_t*>(qs.data_ptr()),
                reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), mins_ptr, in, nb,
                qs_stride};
}

}  // namespace

torch::Tensor gguf_mm(const torch::Tensor& x, const torch::Tensor& qs,
                      const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                      int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "gguf_mm: x must be a contiguous float32 [T, in] tensor");
  const Packed w = packed_matrix("gguf_mm", qs, scales, mins, qtype);
  const int64_t T = x.size(0), out = qs.size(0);
  TORCH_CHECK(x.size(1) == w.in, "gguf_mm: x has ", x.size(1), " features, W takes ", w.in);
  auto y = torch::empty({T, out}, x.options());
  if (T == 0 || out == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (qtype) {
    case kQ4_0: mm_dispatch<kQ4_0>(xp, T, w, yp, out); break;
    case kQ4_1: mm_dispatch<kQ4_1>(xp, T, w, yp, out); break;
    default: mm_dispatch<kQ8_0>(xp, T, w, yp, out); break;
  }
  return y;
}

// Rows `ids` of the packed matrix, dequantised: float32 [ids, in], each value what
// gguf.dequantize gives (dequant_row_scalar): a packed embedding's lookup.
torch::Tensor gguf_rows(const torch::Tensor& ids, const torch::Tensor& qs,
                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                        int64_t qtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.device().is_cpu(),
              "gguf_rows: ids must be a 1-D int64 CPU tensor");
  const Packed w = packed_matrix("gguf_rows", qs, scales, mins, qtype);
  const auto idc = ids.contiguous();
  const int64_t n = idc.numel(), rows = qs.size(0);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "gguf_rows: id ", id[i], " at ", i,
                " is outside the matrix's ", rows, " rows");
  auto y = torch::empty({n, w.in}, scales.options().dtype(torch::kFloat32));
  float* yp = y.data_ptr<float>();
  // a step's few rows inline; a prompt's thousands in parallel
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      switch (qtype) {
        case kQ4_0: dequant_row_scalar<kQ4_0>(w, id[i], yp + i * w.in); break;
        case kQ4_1: dequant_row_scalar<kQ4_1>(w, id[i], yp + i * w.in); break;
        default: dequant_row_scalar<kQ8_0>(w, id[i], yp + i * w.in); break;
      }
    }
  });
  return y;
}

}  // namespace tessera

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_mm", &tessera::gguf_mm, "y = x @ dequant(W)^T for packed GGUF Q4_0/Q4_1/Q8_0 weights",
        py::arg("x"), py::arg("qs"), py::arg("scales"), py::arg("mins"), py::arg("qtype"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_rows", &tessera::gguf_rows,
        "rows ids of a packed GGUF Q4_0/Q4_1/Q8_0 matrix, dequantised to float32 [ids, in]",
        py::arg("ids"), py::arg("qs"), py::arg("scales"), py::arg("mins"), py::arg("qtype"),
        py::call_guard<py::gil_scoped_release>());
  m.attr("avx512") = static_cast<bool>(TESSERA_AVX512);
  tessera::register_decode_layers(m);
  tessera::register_rows(m);
  tessera::register_q4_bf16(m);
  tessera::register_q8_bf16(m);
  tessera::register_tiled_f32(m);
  tessera::register_q8_screen(m);
  tessera::register_kquant_mm(m);
  tessera::register_kquant_q8(m);
}
