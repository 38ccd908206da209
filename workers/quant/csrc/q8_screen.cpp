// Each row's argmax of a Q8_0 LM head's logits (the fast head's, q8_bf16.cpp, or the exact
// head's, tiled_f32.cpp) on CPUs with AVX512_VNNI: the same indices as those kernels'
// argmax, found by screening every column cheaply in int8 and computing exactly only the
// tiles of 16 columns that can hold the maximum. A greedy decode step needs nothing else
// of the head.
//
// The screen. Each block b of 32 inputs of a row is quantised to int8 with its own scale:
// s_b = max |v| / 127, qx = round(v / s_b), where v is what the exact head multiplies (x
// rounded to bf16 for the fast head, x for the exact one). VPDPBUSD multiplies qx with the
// weights' q (64 products an instruction against VDPBF16PS's 32, with no expansion of q to
// bf16 or float), so each column j gets
//     A_j = sum_b d_jb s_b (qx_b . q_jb),
// and E_j, the exact real product, is within
//     |E_j - A_j| <= sum_b beta_b L1_jb,   beta_b = max |s_b qx - v| + eps amax_b,
// L1_jb = |d_jb| sum |q_jb|. A tile's bound is that sum with each block's largest L1_jb
// among its 16 columns (q8_screen_l1), for every row at once one small product [T, nb] x
// [nb, tiles]. eps covers every rounding, relative to sum |v| |w| <= sum_b amax_b L1_jb:
// the exact head's (two chains of K / 2 FMAs: ~(K / 2) 2^-24; the fast head's bf16
// products are exact and its sums shorter) and the screen's own (float32 sums over nb
// blocks, beta and the bound themselves: ~(nb + 8) 2^-24), so eps = 1e-4, or (K / 2 + nb
// + 64) 2^-22 where K is large enough for that to be more (K > ~670): at SmolLM2's K of
// 576, ~2e-5 of rounding against 1e-4. So a tile whose largest A plus its bound falls
// below some tile's largest A less its bound holds neither the row's maximum nor a column
// tying it.
// Every other tile is computed by the exact head's own code for one row (q8_bf16_tile_row,
// q8_f32_tile_row: the same sums in the same order as at any row count), in column order,
// and the first maximum among them is the row's argmax.
//
// On SmolLM2's greedy decode steps the screen keeps ~9 tiles of 3,072 a row on average
// (p99 ~80, at most ~110 over ~1,000 rows, the screen replayed in float64), and the head's argmax of 64 rows took 7.9 ms
// against 10.4 (fast) and 7.9 against 40 (exact); at 16 rows 2.1 against 3.7 and 2.3
// against 11.3; at one row 0.51 against 0.64 and 0.37 against 0.84 (2 threads, Zen 4).
// What bounds it: per row and block, 8 VPDPBUSD and the conversion, scaling and FMA of
// their sums share the same two pipes (~0.73 of VPDPBUSD's peak).
//
// A row holding a NaN, an infinity or a value above kLargest (where a product could
// overflow) takes the head's whole argmax (its first NaN, as argmax_rows). A block
// whose largest |v| is below kTiny is screened as zeros, its bound twice its largest
// possible product (what the head computes for it lies between 0 and that product). The weights are the Q8Weight layout's (q8_bf16.cpp): per tile and block, pair p's
// 32 bytes hold the 16 outputs' inputs 2p and 2p + 1; the 64 bytes of pairs 2s and 2s + 1
// become one VPDPBUSD operand (lane c: inputs 4s .. 4s + 3 of output c) by one word
// permutation, plus 128 each to make them the unsigned operand (qx is the signed one); the
// accumulator starts at -128 sum qx to take that off.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "tiled_layouts.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define TESSERA_Q8_SCREEN 1
#else
#define TESSERA_Q8_SCREEN 0
#endif

namespace tessera {

// The exact heads' tile of 16 columns for one row, as their kernels compute it at any row
// count: q8_bf16.cpp (x: the row rounded to bf16) and tiled_f32.cpp (x: float32).
void q8_bf16_tile_row(const uint16_t* x, int64_t K, const int8_t* qs, const uint16_t* d,
                      int64_t tile, float* y);
void q8_f32_tile_row(const float* x, int64_t K, const int8_t* qs, const uint16_t* d,
                     int64_t tile, float* y);
bool q8_bf16_available();
bool amx_in_use();
torch::Tensor q8_bf16_argmax(const torch::Tensor& x, const torch::Tensor& qs,
                             const torch::Tensor& d);
torch::Tensor q8_f32_argmax(const torch::Tensor& x, const torch::Tensor& qs,
                            const torch::Tensor& d);

namespace {

using tiled::kBlock;

#if TESSERA_Q8_SCREEN

constexpr int kScreenRows = 8;      // rows a micro-kernel holds: A and B, one zmm each
// eps above: beta's share of each block's amax, for K inputs in nb blocks
inline float screen_eps(int64_t K, int64_t nb) {
  return std::max(1e-4f, static_cast<float>(K / 2 + nb + 64) * 0x1p-22f);
}
constexpr float kLargest = 1e20f;   // larger |x| (or a NaN) takes the head's whole argmax
// A block whose largest |x| is below this is screened as zeros, its bound twice its product:
// the fast head's VDPBF16PS flushes denormal inputs to zero, so such a block's computed
// sum may be anything between 0 and its product (a larger block's denormals cost at most
// 2^-126 |w| each, far below eps amax_b |w|).
constexpr float kTiny = 0x1p-60f;

// A row's blocks quantised: qx int8 [K], and per block the scale, the bound's factor
// (delta + eps amax) and the accumulator's start (-128 sum qx).
struct Rows {
  int64_t T = 0, K = 0, nb = 0;
  std::vector<int8_t> qx;        // [T, K]
  std::vector<float> scale;      // [T, nb]
  std::vector<float> bound;      // [T, nb]
  std::vector<int32_t> start;    // [T, nb]
  std::vector<uint8_t> whole;    // [T]: 1 where the row takes the head's whole argmax
  float eps = 0.0f;              // screen_eps(K, nb)
};

// v: the row's values as the exact head multiplies them (float32).
void quantise_row(const float* v, Rows& rows, int64_t r) {
  const int64_t K = rows.K, nb = rows.nb;
  int8_t* qx = rows.qx.data() + r * K;
  for (int64_t b = 0; b < nb; ++b) {
    const float* vb = v + b * kBlock;
    const __m512 lo = _mm512_loadu_ps(vb), hi = _mm512_loadu_ps(vb + 16);
    const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
    const __m512 largest = _mm512_set1_ps(kLargest);  // not <= it: too large, or a NaN
    if (_mm512_cmp_ps_mask(alo, largest, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(ahi, largest, _CMP_NLE_UQ)) {
      rows.whole[r] = 1;
      return;
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi));
    if (amax < kTiny) {  // qx 0, and the block's whole product within the bound
      std::memset(qx + b * kBlock, 0, kBlock);
      rows.scale[r * nb + b] = 0.0f;
      rows.bound[r * nb + b] = 2.0f * amax;
      rows.start[r * nb + b] = 0;
      continue;
    }
    const float scale = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(127.0f / amax);
    const __m512 lim = _mm512_set1_ps(127.0f);
    // nearest integers, within -127 .. 127 (a clamp only widens delta, which is measured)
    const __m512 qlo = _mm512_roundscale_ps(
        _mm512_min_ps(lim, _mm512_max_ps(-lim, _mm512_mul_ps(lo, inv))), _MM_FROUND_TO_NEAREST_INT);
    const __m512 qhi = _mm512_roundscale_ps(
        _mm512_min_ps(lim, _mm512_max_ps(-lim, _mm512_mul_ps(hi, inv))), _MM_FROUND_TO_NEAREST_INT);
    const __m512 s = _mm512_set1_ps(scale);
    const __m512 err = _mm512_max_ps(_mm512_abs_ps(_mm512_sub_ps(_mm512_mul_ps(s, qlo), lo)),
                                     _mm512_abs_ps(_mm512_sub_ps(_mm512_mul_ps(s, qhi), hi)));
    const __m512i ilo = _mm512_cvtps_epi32(qlo), ihi = _mm512_cvtps_epi32(qhi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * kBlock), _mm512_cvtepi32_epi8(ilo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + b * kBlock + 16), _mm512_cvtepi32_epi8(ihi));
    rows.scale[r * nb + b] = scale;
    rows.bound[r * nb + b] = _mm512_reduce_max_ps(err) + rows.eps * amax;
    rows.start[r * nb + b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(ilo, ihi));
  }
}

// A row's survivors so far in one thread's range of tiles: the largest lower bound seen,
// and each tile whose largest upper bound reached the largest lower bound of its time.
struct Survivors {
  float floor = -std::numeric_limits<float>::infinity();
  std::vector<std::pair<float, int32_t>> tiles;  // (largest upper bound, tile)
};

// A tile's block b as 8 VPDPBUSD operands: operand s's lane c holds inputs 4s .. 4s + 3 of
// output c, plus 128 each (unsigned bytes).
inline void screen_operands(const int8_t* block, __m512i* w) {
  const __m512i words = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                         1, 16, 0);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int s = 0; s < 8; ++s)
    w[s] = _mm512_xor_si512(_mm512_permutexvar_epi16(words, _mm512_loadu_si512(block + s * 64)),
                            bias);
}

// R rows (from r0) through one tile, its operands w [nb][8] (or, with w nullptr, its q qt
// made into them in registers) and d: each row's A, and from its largest A and the tile's
// bound (bounds [T, tiles]) its survivors. Before each block, that block of the next tile.
template <int R>
inline void screen_tile(const Rows& rows, int64_t r0, const int8_t* qt, const __m512i* w,
                        const uint16_t* dt,
                        const float* bounds, int64_t tiles, int64_t tile,
                        Survivors* survivors, const tiled::NextTile& next) {
  const int64_t K = rows.K, nb = rows.nb;
  __m512 A[R];
  for (int r = 0; r < R; ++r) A[r] = _mm512_setzero_ps();
  const int8_t* x = rows.qx.data() + r0 * K;
  const int32_t* start = rows.start.data() + r0 * nb;
  const float* scale = rows.scale.data() + r0 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    next.block(b);
    __m512i ops[8];
    if (w != nullptr)
      for (int s = 0; s < 8; ++s) ops[s] = _mm512_load_si512(w + b * 8 + s);
    else
      screen_operands(qt + b * 512, ops);
    __m512i acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_set1_epi32(start[r * nb + b]);
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const __m512i ws = ops[s];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x + r * K + b * kBlock + 4 * s, sizeof four);
        acc[r] = _mm512_dpbusd_epi32(acc[r], ws, _mm512_set1_epi32(four));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + b * 16)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      A[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                             _mm512_mul_ps(d, _mm512_set1_ps(scale[r * nb + b])), A[r]);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    Survivors& s = survivors[row];
    const float top = _mm512_reduce_max_ps(A[r]), bound = bounds[row * tiles + tile];
    s.floor = std::max(s.floor, top - bound);
    if (top + bound >= s.floor) s.tiles.emplace_back(top + bound, static_cast<int32_t>(tile));
  }
}

template <int R = kScreenRows>
inline void screen_rows(int64_t count, const Rows& rows, int64_t r0, const int8_t* qt,
                        const __m512i* w, const uint16_t* dt, const float* bounds, int64_t tiles, int64_t tile,
                        Survivors* survivors, const tiled::NextTile& next) {
  if constexpr (R > 0) {
    if (count == R) return screen_tile<R>(rows, r0, qt, w, dt, bounds, tiles, tile, survivors, next);
    return screen_rows<R - 1>(count, rows, r0, qt, w, dt, bounds, tiles, tile, survivors, next);
  }
}

#endif

}  // namespace

bool q8_screen_available() { return TESSERA_Q8_SCREEN != 0; }

torch::Tensor q8_screen_l1(const torch::Tensor& qs, const torch::Tensor& d) {
  const tiled::Shape s = tiled::check_d("q8_screen_l1", d, 0);
  tiled::check_q8("q8_screen_l1", s, qs);
  // a bound from an infinite or NaN scale would bound nothing
  TORCH_CHECK(torch::isfinite(d).all().item<bool>(),
              "q8_screen_l1: d holds an infinite or NaN scale, which no screen can bound");
  // [tile, b, p, c, e] -> sum over p and e of |q|: [tile, b, c]; times |d|; the tile's largest
  const auto q = qs.view({s.tiles, s.nb, 16, 16, 2}).to(torch::kInt32).abs().sum({2, 4});
  return std::get<0>((q.to(torch::kFloat32) * d.to(torch::kFloat32).abs()).max(2)).contiguous();
}

torch::Tensor q8_screen_argmax(const torch::Tensor& x, const torch::Tensor& qs,
                               const torch::Tensor& d, const torch::Tensor& l1, bool exact) {
  const char* name = "q8_screen_argmax";
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == torch::kFloat32, name,
              ": x must be a float32 [T, K] CPU tensor");
  const tiled::Shape s = tiled::check_x_and_d(name, x, d);
  tiled::check_q8(name, s, qs);
  TORCH_CHECK(l1.scalar_type() == torch::kFloat32 && l1.is_contiguous() &&
                  l1.numel() == s.tiles * s.nb,
              name, ": l1 must be q8_screen_l1(qs, d), contiguous float32 [N / 16, K / 32]");
  TORCH_CHECK(s.N > 0, name, ": no outputs to take the argmax of");
  auto ids = torch::empty({s.T}, x.options().dtype(torch::kInt64));
  if (s.T == 0) return ids;  // no rows: nothing to screen, whichever path would run
#if TESSERA_Q8_SCREEN
  TORCH_CHECK(exact || (q8_bf16_available() && !amx_in_use()), name,
              ": the fast head's screen needs q8_bf16.cpp's AVX512_BF16 path without AMX");
  const int64_t T = s.T, K = s.K, nb = s.nb, tiles = s.tiles;
  if (T == 0) return ids;
  const auto xc = x.contiguous();
  // what the exact head multiplies: the fast head rounds x to bf16 as torch does
  const auto xb = exact ? torch::Tensor() : xc.to(torch::kBFloat16);
  const auto v = exact ? xc : xb.to(torch::kFloat32);
  Rows rows;
  rows.T = T, rows.K = K, rows.nb = nb, rows.eps = screen_eps(K, nb);
  rows.qx.resize(T * K);
  rows.scale.resize(T * nb);
  rows.bound.resize(T * nb);
  rows.start.resize(T * nb);
  rows.whole.assign(T, 0);
  const float* vp = v.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) quantise_row(vp + r * K, rows, r);
  });
  // a row that takes the head's whole argmax is screened anyway (its numbers are harmless:
  // its survivors are not read), so that every group of rows keeps its size
  const int8_t* qp = qs.data_ptr<int8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  // each row's bound for each tile: sum_b (delta_b + eps amax_b) * the tile's largest L1_jb
  const auto bound_of = torch::from_blob(rows.bound.data(), {T, nb}, torch::kFloat32);
  const auto bounds = torch::mm(bound_of, l1.t()).contiguous();  // [T, tiles]
  const float* bp = bounds.data_ptr<float>();
  std::mutex lock;
  std::vector<std::vector<Survivors>> ranges;  // each thread's range of tiles, in order
  std::vector<int64_t> range_first;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<Survivors> survivors(T);
    std::vector<__m512i> w(nb * 8);  // C++17: over-aligned allocation
    for (int64_t tile = begin; tile < end; ++tile) {
      const int8_t* qt = qp + tile * nb * 512;
      const uint16_t* dt = dp + tile * nb * 16;
      // one group of rows makes the operands in registers; more read them from L1
      const bool buffered = T > kScreenRows;
      if (buffered)
        for (int64_t b = 0; b < nb; ++b) screen_operands(qt + b * 512, w.data() + b * 8);
      tiled::NextTile next;  // the next tile's q and d, asked for by the first group of rows
      if (tile + 1 < end)
        next = {reinterpret_cast<const char*>(qt + nb * 512), 512, dt + nb * 16, dt + nb * 16};
      for (int64_t r0 = 0; r0 < T; r0 += kScreenRows)
        screen_rows(std::min<int64_t>(kScreenRows, T - r0), rows, r0, qt,
                    buffered ? w.data() : nullptr, dt, bp, tiles,
                    tile, survivors.data(), r0 == 0 ? next : tiled::NextTile{});
    }
    const std::lock_guard<std::mutex> hold(lock);
    ranges.push_back(std::move(survivors));
    range_first.push_back(begin);
  });
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return range_first[a] < range_first[b]; });
  int64_t* out = ids.data_ptr<int64_t>();
  const uint16_t* xbp = exact ? nullptr : reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const float* xp = xc.data_ptr<float>();
  std::vector<int64_t> whole;  // rows that take the head's whole argmax
  for (int64_t r = 0; r < T; ++r)
    if (rows.whole[r]) whole.push_back(r);
  at::parallel_for(0, T, 1, [&](int64_t first, int64_t last) {
    alignas(64) float y[16];
    for (int64_t r = first; r < last; ++r) {
      if (rows.whole[r]) continue;
      float floor = -std::numeric_limits<float>::infinity();
      for (const auto& range : ranges) floor = std::max(floor, range[r].floor);
      float best = 0.0f;
      int64_t column = -1;
      for (const size_t i : order)  // ranges in tile order, each's tiles in order
        for (const auto& [top, tile] : ranges[i][r].tiles) {
          if (top < floor) continue;
          if (exact)
            q8_f32_tile_row(xp + r * K, K, qp, dp, tile, y);
          else
            q8_bf16_tile_row(xbp + r * K, K, qp, dp, tile, y);
          for (int lane = 0; lane < 16; ++lane)
            if (column < 0 || y[lane] > best) best = y[lane], column = int64_t{tile} * 16 + lane;
        }
      TORCH_CHECK(column >= 0, "q8_screen_argmax: no tile survived the screen (a bug)");
      out[r] = column;
    }
  });
  if (!whole.empty()) {
    const auto index = torch::tensor(whole, torch::kInt64);
    const auto rest = exact ? q8_f32_argmax(xc.index_select(0, index), qs, d)
                            : q8_bf16_argmax(xc.index_select(0, index), qs, d);
    const int64_t* rp = rest.data_ptr<int64_t>();
    for (size_t i = 0; i < whole.size(); ++i) out[whole[i]] = rp[i];
  }
#else
  TORCH_CHECK(false, name, ": this build has no AVX512_VNNI screen (q8_screen_available())");
#endif
  return ids;
}

void register_q8_screen(pybind11::module& m) {
  namespace py = pybind11;
  m.def("q8_screen_available", &q8_screen_available,
        "whether this CPU build has the AVX512_VNNI screen of the Q8_0 heads' argmax");
  m.def("q8_screen_l1", &q8_screen_l1,
        "the screen's bound per tile and block of a Q8Weight: the largest |d| sum |q| of the "
        "tile's 16 outputs, float32 [N / 16, K / 32]",
        py::arg("qs"), py::arg("d"));
  m.def("q8_screen_argmax", &q8_screen_argmax,
        "each row's argmax of the exact (q8_f32_mm) or fast (q8_bf16_mm) head's float32 "
        "product, the same indices as q8_f32_argmax / q8_bf16_argmax, through an int8 screen "
        "and those heads' own sums for the tiles it keeps",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("l1"), py::arg("exact"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace tessera
