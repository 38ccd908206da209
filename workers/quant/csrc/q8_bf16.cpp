// y[T, N] = x[T, K] @ W^T for GGUF Q8_0 weights W [N, K] (w = d * q, q int8, d fp16), on
// CPUs with AVX512_BF16: the fast and bfloat16 modes' LM head (SmolLM2's tied Q8_0
// embedding, 49152 x 576: a fifth of a decode step through the float32 kernel).
//
// Every int8 q is exact in bf16, so VDPBF16PS multiplies bf16 x with q exactly and sums
// in float32; per block b of 32 inputs, y += d_b * (x_b . q_b) in float32. float32 x is
// rounded to bf16 (nearest even) once at entry and gives float32 y; bf16 x gives bf16 y.
// The weights are the file's (d stays fp16, converted exactly).
//
// Layout (built by tessera/workers/quant/int4.py, `Q8Weight.from_packed`), N % 16 == 0:
//   qs  int8 [N / 16, K / 32, 16, 16, 2]: for output tile t, block b and pair p, 32 bytes:
//       output 16t + c's inputs 2p and 2p + 1 of the block at [c, 0..1];
//   d   fp16 [N / 16, K / 32, 16].
// A pair's 32 bytes become one zmm of 16 bf16 pairs (lane c: output 16t + c) by two
// sign extensions, two conversions to float and one VCVTNE2PS2BF16, all exact. Up to
// kDirectRows rows (one micro-kernel's) each block is expanded in registers and used at
// once; for more, each tile is expanded into a buffer that every group of up to kRows
// rows runs through, in passes of ~128 KB of x (the tile expanded again for each pass).
// The next tile's bytes are asked for block by block (tiled::NextTile) as this tile's are
// expanded.
// Expanding in registers for every row count, as the Q4 kernel does, lost above one
// group: the expansion's conversions take the same units as VDPBF16PS, and a Q8_0 pair
// costs five of them to the Q4 pair's fewer (Zen 4 EPYC: 12 / 16 / 64 rows 3.54
// / 4.15 / 14.0 ms against 2.96 / 3.86 / 12.5 buffered, 2 threads). Up to one group
// both expand each pair once, and the buffer's stores and loads cost more than they
// save: 8 rows on one thread (a share of a 16-row decode step) 4.40 ms against 5.59.
// Both sum through block_sums (bf16_blocks.h, shared with the Q4 kernel), so a row's
// result never depends on T.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "rows.h"
#include "tiled_layouts.h"
#include "vec16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TESSERA_Q8_BF16 1
#else
#define TESSERA_Q8_BF16 0
#endif

namespace tessera {

namespace {

using tiled::kBlock;

#if TESSERA_Q8_BF16
#include "bf16_blocks.h"
#include "amx_tiles.h"
#include "tile_argmax.h"

// Pair p of block b of a tile (32 int8: 16 outputs x 2 inputs) as 16 bf16 pairs.
inline __m512i expand_pair(const int8_t* q) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));       // outputs 0..7
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));  // 8..15
  const __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
  const __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(fhi, flo));  // low half from flo
}

inline __m512 block_d(const uint16_t* d) {  // a block's 16 outputs' d, fp16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
}

// R <= kDirectRows rows through one tile, each pair expanded in registers and used at once;
// before each block, that block of the next tile is asked for.
template <int R, typename Y>
inline void tile_direct(const uint16_t* x, int64_t K, int64_t nb, const int8_t* qs,
                        const uint16_t* d, Y* y, int64_t N, const tiled::NextTile& next) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    next.block(b);
    __m512 part[R];
    const int8_t* block = qs + b * 16 * 32;
    block_sums<R>(x, K, b, [block](int p) { return expand_pair(block + p * 32); }, part);
    const __m512 dq = block_d(d + b * 16);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], dq, acc[r]);
  }
  for (int r = 0; r < R; ++r) store16(y + r * N, acc[r]);
}

// R rows through one expanded tile: pairs [nb, 16] zmm, dq [nb] zmm. Same sums.
template <int R, typename Y>
inline void tile_rows(const uint16_t* x, int64_t K, int64_t nb, const __m512i* pairs,
                      const __m512* dq, Y* y, int64_t N) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 part[R];
    const __m512i* tile = pairs + b * 16;
    block_sums<R>(x, K, b, [tile](int p) { return _mm512_load_si512(tile + p); }, part);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], dq[b], acc[r]);
  }
  for (int r = 0; r < R; ++r) store16(y + r * N, acc[r]);
}

// y = x @ W^T; `argmax` (float32 y only): each row's argmax taken as y is written. With
// yp == nullptr (and argmax, not on the AMX path) the argmax alone: each tile's rows go to
// a scratch of kRows x 16 floats in L1 instead of y, and are scanned there. A 64-row decode
// step's logits are 12.6 MB; their stores, one line per row 196 KB apart (every row's line
// of a tile in one L1 set), and the scan reading them back took ~1.5 ms of the head's ~12.
template <typename Y>
void q8_rows(const uint16_t* xp, int64_t T, int64_t K, const int8_t* qp, const uint16_t* dp,
             int64_t tiles, Y* yp, TileArgmax* argmax = nullptr) {
  const int64_t nb = K / kBlock, N = tiles * 16;
  if (T == 0) return;  // no rows: nothing to write (an empty y has no data pointer)
  const bool kept = yp != nullptr;
  TORCH_CHECK(kept || (argmax != nullptr && !amx_on()), "q8_rows: no y to write");
  // where rows r0.. of a tile go (y, or the scratch), and their row stride
  const auto out = [yp, N, kept](int64_t tile, int64_t r0, Y* scratch) {
    return kept ? yp + r0 * N + tile * 16 : scratch;
  };
  const int64_t stride = kept ? N : 16;
  // each tile's rows r0 .. r0 + rows - 1, just stored at at (float32 y only)
  const auto scan = [argmax, stride](TileArgmax::Range& range, const Y* at, int64_t tile,
                                     int64_t r0, int64_t rows) {
    if constexpr (std::is_same_v<Y, float>)
      if (argmax != nullptr) argmax->scan(range, at, stride, tile, r0, rows);
  };
  const auto begin_range = [argmax](int64_t first_tile) {
    return argmax != nullptr ? argmax->begin(first_tile) : TileArgmax::Range{};
  };
  const auto end_range = [argmax](TileArgmax::Range&& range) {
    if (argmax != nullptr) argmax->end(std::move(range));
  };
  if (amx_on()) {
    const auto expand = [qp, nb](int64_t tile, int64_t b, uint16_t* out) {
      const int8_t* block = qp + (tile * nb + b) * 512;
      for (int p = 0; p < 16; ++p) _mm512_store_si512(out + p * 32, expand_pair(block + p * 32));
    };
    const auto scales = [dp, nb](int64_t tile, int64_t b, __m512& dq, __m512&) {
      dq = block_d(dp + (tile * nb + b) * 16);
    };
    if constexpr (std::is_same_v<Y, float>)
      if (argmax != nullptr)
        return amx_rows<false>(xp, T, K, nullptr, tiles, yp, expand, scales, argmax);
    return amx_rows<false>(xp, T, K, nullptr, tiles, yp, expand, scales);
  }
  if (T <= kDirectRows) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      alignas(64) Y scratch[kDirectRows * 16];
      TileArgmax::Range range = begin_range(begin);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int8_t* qt = qp + tile * nb * 512;
        const uint16_t* dt = dp + tile * nb * 16;
        tiled::NextTile next;  // the next tile's q and d
        if (tile + 1 < end)
          next = {reinterpret_cast<const char*>(qt + nb * 512), 512, dt + nb * 16, dt + nb * 16};
        Y* at = out(tile, 0, scratch);
        with_rows(T, [&](auto r) {
          tile_direct<decltype(r)::value>(xp, K, nb, qt, dt, at, stride, next);
        });
        scan(range, at, tile, 0, T);
      }
      end_range(std::move(range));
    });
    return;
  }
  const int64_t pass = rows_per_pass(K);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> pairs(nb * 16);  // C++17: over-aligned allocation
    std::vector<__m512> dq(nb);
    alignas(64) Y scratch[kRows * 16];
    TileArgmax::Range range = begin_range(begin);
    for (int64_t first = 0; first < T; first += pass) {
      const int64_t last = std::min(T, first + pass);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int8_t* qt = qp + tile * nb * 512;
        tiled::NextTile next;  // the next tile's q and d, asked for as this one is expanded
        if (tile + 1 < end)
          next = {reinterpret_cast<const char*>(qt + nb * 512), 512, dp + (tile + 1) * nb * 16,
                  dp + (tile + 1) * nb * 16};
        for (int64_t b = 0; b < nb; ++b) {
          next.block(b);
          for (int p = 0; p < 16; ++p) pairs[b * 16 + p] = expand_pair(qt + (b * 16 + p) * 32);
          dq[b] = block_d(dp + (tile * nb + b) * 16);
        }
        for (int64_t r0 = first; r0 < last; r0 += kRows) {
          const int64_t rows = std::min<int64_t>(kRows, last - r0);
          Y* at = out(tile, r0, scratch);
          with_rows(rows, [&](auto r) {
            tile_rows<decltype(r)::value>(xp + r0 * K, K, nb, pairs.data(), dq.data(), at,
                                          stride);
          });
          scan(range, at, tile, r0, rows);
        }
      }
    }
    end_range(std::move(range));
  });
}
#endif

}  // namespace

bool q8_bf16_available() { return TESSERA_Q8_BF16 != 0; }

void q8_bf16_tile_row(const uint16_t* x, int64_t K, const int8_t* qs, const uint16_t* d,
                      int64_t tile, float* y) {
#if TESSERA_Q8_BF16
  const int64_t nb = K / kBlock;
  tile_direct<1>(x, K, nb, qs + tile * nb * 512, d + tile * nb * 16, y, 16, tiled::NextTile{});
#else
  TORCH_CHECK(false, "q8_bf16_tile_row: this build has no AVX512_BF16 kernel");
#endif
}

namespace {

// y, and with `ids` (float32 x) each row's argmax of y into it; with `ids` and not
// `keep_y`, the argmax alone (y undefined), unless a row held a NaN or the AMX path runs.
torch::Tensor q8_product(const char* name, const torch::Tensor& x, const torch::Tensor& qs,
                         const torch::Tensor& d, torch::Tensor* ids,
                         [[maybe_unused]] bool keep_y = true) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              name, ": x must be a bfloat16 or float32 [T, K] CPU tensor");
  const tiled::Shape s = tiled::check_x_and_d(name, x, d);
  tiled::check_q8(name, s, qs);
  [[maybe_unused]] const int64_t tiles = s.tiles, K = s.K, N = s.N, T = s.T;
  torch::Tensor y;
#if TESSERA_Q8_BF16
  const auto xc = (x.scalar_type() == torch::kFloat32 ? x.to(torch::kBFloat16) : x).contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int8_t* qp = qs.data_ptr<int8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  if (ids != nullptr) {
    TORCH_CHECK(N > 0, name, ": no outputs to take the argmax of");
    TileArgmax argmax(T);
    if (keep_y || amx_on()) {
      y = torch::empty({T, N}, x.options());
      q8_rows(xp, T, K, qp, dp, tiles, y.data_ptr<float>(), &argmax);
    } else {
      q8_rows(xp, T, K, qp, dp, tiles, static_cast<float*>(nullptr), &argmax);
      if (argmax.any_nan()) {  // its rows are read again (argmax_rows' first NaN)
        y = torch::empty({T, N}, x.options());
        q8_rows(xp, T, K, qp, dp, tiles, y.data_ptr<float>());
      }
    }
    *ids = torch::empty({T}, x.options().dtype(torch::kInt64));
    if (T > 0)
      argmax.result(y.defined() ? y.data_ptr<float>() : nullptr, N, ids->data_ptr<int64_t>());
    return y;
  }
  y = torch::empty({T, N}, x.options());
  if (y.scalar_type() == torch::kFloat32) {
    q8_rows(xp, T, K, qp, dp, tiles, y.data_ptr<float>());
  } else {
    q8_rows(xp, T, K, qp, dp, tiles, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  }
#else
  TORCH_CHECK(false, name, ": this build has no AVX512_BF16 kernel (q8_bf16_available())");
#endif
  return y;
}

}  // namespace

torch::Tensor q8_bf16_mm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d) {
  return q8_product("q8_bf16_mm", x, qs, d, nullptr);
}

std::tuple<torch::Tensor, torch::Tensor> q8_bf16_mm_argmax(const torch::Tensor& x,
                                                           const torch::Tensor& qs,
                                                           const torch::Tensor& d) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32,
              "q8_bf16_mm_argmax: x must be a float32 [T, K] CPU tensor");
  torch::Tensor ids;
  torch::Tensor y = q8_product("q8_bf16_mm_argmax", x, qs, d, &ids);
  return {y, ids};
}

torch::Tensor q8_bf16_argmax(const torch::Tensor& x, const torch::Tensor& qs,
                             const torch::Tensor& d) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32,
              "q8_bf16_argmax: x must be a float32 [T, K] CPU tensor");
  torch::Tensor ids;
  q8_product("q8_bf16_argmax", x, qs, d, &ids, /*keep_y=*/false);
  return ids;
}

void register_q8_bf16(pybind11::module& m) {
  namespace py = pybind11;
  m.def("q8_bf16_available", &q8_bf16_available,
        "whether this CPU build has the AVX512_BF16 Q8_0 kernel");
  m.def("q8_bf16_mm", &q8_bf16_mm,
        "y = x @ W^T for Q8_0 weights in the Q8Weight layout: bf16 x gives bf16 y; float32 x "
        "is rounded to bf16 and gives the float32 sums",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::call_guard<py::gil_scoped_release>());
  m.def("q8_bf16_mm_argmax", &q8_bf16_mm_argmax,
        "q8_bf16_mm of float32 x, and each row's argmax of y (argmax_rows' answer) taken as "
        "y is written",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::call_guard<py::gil_scoped_release>());
  m.def("q8_bf16_argmax", &q8_bf16_argmax,
        "each row's argmax of q8_bf16_mm(x) for float32 x (argmax_rows' answer, int64 [T]), "
        "without writing the products to memory",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace tessera
