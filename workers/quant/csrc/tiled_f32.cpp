// y[T, N] = x[T, K] @ W^T in float32 for GGUF Q4_0 / Q4_1 / Q8_0 weights W [N, K] in
// the tiled layouts of the bf16 kernels (Q4Weight: csrc/q4_bf16.cpp; Q8Weight:
// csrc/q8_bf16.cpp): the exact mode's matmuls on CPUs with AVX-512 or AVX2 (vec16.h: a
// 16-lane vector is one zmm or two ymm; each lane's arithmetic is the same on both).
//
// Each weight is dequantised exactly as gguf does, w = d * q + m (Q4_1), d * (q - 8)
// (Q4_0) or d * q (Q8_0), a product and a sum rounded separately (the build's
// -ffp-contract=off), and multiplied with float32 x in float32: only the order of the
// sums differs from x @ gguf.dequantize(W).T. In these layouts one vector lane is one
// output, so for each input k a tile's 16 weights are one vector (a shift or two, a
// conversion and the scale make them), with no transpose (gguf_mm, on the file's layout,
// transposes 16 dequantised rows into a buffer per tile above 4 rows of x), and every row
// of x then takes them with one FMA, x[r, k] broadcast. Up to kRowsF32 rows run at once;
// more rows go in passes of ~512 KB of x over the tiles (a pass's rows stay in L2), each
// tile dequantised once per pass into a buffer [K, 16] that every kRowsF32 rows read, or
// under AVX-512 each pair of tiles into a buffer [K, 2, 16] that every kPairRows rows
// read (pair_f32: one broadcast of x[r, k] feeds both tiles' FMAs), where int4.py's
// tile_pairs measured that faster on this CPU (use_tile_pairs).
// One step's 120 Q4 projections of SmolLM2 (2 cores, AVX-512), against gguf_mm at 1 / 8 /
// 16 / 64 / 512 rows: 4.4 / 11.4 / 21-24 / 72-76 / 561 ms against 6.2-7.6 / 20.9-24.0 /
// 28-35 / 74-86 / 517-549 (passes of 128 KB took 582 ms at 512 rows). On AVX2 (Zen 3
// EPYC, one thread) the 3-row micro-kernel runs at ~40-43 GMAC/s, near the core's FMA
// peak; two half tiles (8 lanes) of 6 rows each from a buffer [2, K, 8], the same sums
// with half the weight loads per FMA, ran 8-26% slower, and a buffer cut in K chunks
// that stay in L1 was slower too.
// Each row sums its products in two chains, even and odd inputs, added at the end: the
// same for every row count and both paths, so a row's result never depends on T. Torch's
// threads claim the tiles in pieces (pieces.h). q4_f32_dense writes a Q4 matrix's
// weights, the same numbers, as a dense [K, N] tensor for a float32 GEMM (dense_f32_mm:
// MKL's or oneDNN's, whichever use_onednn_gemm chose): products of more rows than int4.py's
// exact_row_limit, where that GEMM measured faster.

#include <torch/extension.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include "pieces.h"
#include "rows.h"
#include "side_prefetch.h"
#include "tiled_layouts.h"
#include "vec16.h"

#define TESSERA_TILED_F32 (TESSERA_VEC16 != 0)

namespace tessera {

namespace {

using tiled::kBlock;
// Rows of x one micro-kernel holds, 2 accumulators each: 8 in AVX-512's 32 zmm, 3 in
// AVX2's 16 ymm (12 of them accumulators: a 16-lane vector is two ymm there).
constexpr int kRowsF32 = TESSERA_VEC16 == 512 ? 8 : 3;
// Rows of x the buffered micro-kernel of two tiles holds (pair_f32): 6 x 2 tiles x 2
// chains = 24 of AVX-512's zmm; 0 (one tile at a time) under AVX2, whose 16 ymm hold
// one such row.
constexpr int kPairRows = TESSERA_VEC16 == 512 ? 6 : 0;
// Whether the buffered loop takes its tiles in pairs (use_tile_pairs sets it; one flag for
// the process). Both loops give the same bits, so only speed decides, and that is the
// CPU's: on an Ice Lake Xeon (two full-width FMA units) one step's 121 products at 16 /
// 64 / 256 rows took 44 / 124 / 494 ms in pairs against 49 / 179 / 664 one tile at a
// time; on a Zen 4 EPYC (512-bit FMAs in two halves) 39-40 / 109-111 / 425-454 against
// 32-34 / 105-110 / 427-442. int4.py's tile_pairs times both at load.
std::atomic<bool>& pairs_wanted() {
  static std::atomic<bool> wanted{kPairRows > 0};
  return wanted;
}
constexpr int64_t kPassBytesF32 = 512 * 1024;

#if TESSERA_TILED_F32

using vec16::F;
using vec16::I;

#include "tile_argmax.h"

// A Q4 tile's weights, dequantised in registers as they are used (Q41: Q4_1, else Q4_0).
// Block b's nibbles are 4 vectors, step s holding inputs 8s .. 8s + 7: lane c is output c,
// input 8s + 2p at bits 4p.. and input 8s + 2p + 1 at bits 16 + 4p...
template <bool Q41>
struct Q4Tile {
  const uint8_t* nibbles;  // the tile's
  const uint16_t* d;
  const uint16_t* m;
  Q4Tile(const uint8_t* np, const uint16_t* dp, const uint16_t* mp, int64_t tile, int64_t nb)
      : nibbles(np + tile * nb * 256),
        d(dp + tile * nb * 16),
        m(Q41 ? mp + tile * nb * 16 : nullptr) {}

  tiled::NextTile fetch() const {  // this tile, asked for a block at a time
    return {reinterpret_cast<const char*>(nibbles), 256, d, Q41 ? m : d};
  }

  static inline F weights(I v, int shift, F dq, F mq) {
    const I q = vec16::and_i(vec16::srli(v, shift), vec16::set1_i(0xF));
    if constexpr (Q41) return vec16::add(vec16::mul(dq, vec16::to_float(q)), mq);
    return vec16::mul(dq, vec16::to_float(vec16::sub_i(q, vec16::set1_i(8))));
  }

  template <typename Use>
  inline void operator()(int64_t b, const Use& f) const {
    const F dq = vec16::load_half(d + b * 16);
    const F mq = Q41 ? vec16::load_half(m + b * 16) : vec16::zero();
    for (int s = 0; s < 4; ++s) {
      const I v = vec16::load_i(nibbles + b * 256 + s * 64);
      for (int p = 0; p < 4; ++p) {
        f(8 * s + 2 * p, weights(v, 4 * p, dq, mq));
        f(8 * s + 2 * p + 1, weights(v, 16 + 4 * p, dq, mq));
      }
    }
  }
};

// A Q8_0 tile's weights, dequantised in registers as they are used. Block b's pair p is
// 32 bytes, output c's inputs 2p and 2p + 1 at bytes 2c and 2c + 1.
struct Q8Tile {
  const int8_t* qs;  // the tile's
  const uint16_t* d;
  Q8Tile(const int8_t* qp, const uint16_t* dp, int64_t tile, int64_t nb)
      : qs(qp + tile * nb * 512), d(dp + tile * nb * 16) {}

  tiled::NextTile fetch() const {  // this tile, asked for a block at a time
    return {reinterpret_cast<const char*>(qs), 512, d, d};
  }

  template <typename Use>
  inline void operator()(int64_t b, const Use& f) const {
    const F dq = vec16::load_half(d + b * 16);
    for (int p = 0; p < 16; ++p) {
      // 32 int16, lane c of the 32-bit view: input 2p in its low half, 2p + 1 in its high
      const I v = vec16::widen_s8(qs + (b * 16 + p) * 32);
      const I even = vec16::srai(vec16::slli(v, 16), 16);
      const I odd = vec16::srai(v, 16);
      f(2 * p, vec16::mul(dq, vec16::to_float(even)));
      f(2 * p + 1, vec16::mul(dq, vec16::to_float(odd)));
    }
  }
};

// A tile's weights from a buffer [K, 16] it was dequantised into (the same numbers).
struct Buffered {
  const float* buf;
  template <typename Use>
  inline void operator()(int64_t b, const Use& f) const {
    for (int k = 0; k < kBlock; ++k) f(k, vec16::load(buf + (b * kBlock + k) * 16));
  }
};

// R rows of x through one tile of 16 outputs; weights(b, f) calls f(k, w) with the tile's
// 16 weights of each input k of block b, in order.
// Before each block, a few lines of the thread's queue sq (side_prefetch.h: the K/V its
// next attention reads), if it has one, and that block of the next tile.
template <int R, typename Weights>
inline void tile_f32(const float* x, int64_t K, int64_t nb, const Weights& weights, float* y,
                     int64_t N, side::Queue* sq, const tiled::NextTile& next) {
  F even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = vec16::zero();
  for (int64_t b = 0; b < nb; ++b) {
    if (sq) sq->some();
    next.block(b);
    const float* xb = x + b * kBlock;
    weights(b, [&](int k, F w) {
      for (int r = 0; r < R; ++r) {
        const F xk = vec16::set1(xb[r * K + k]);
        if (k % 2 == 0)
          even[r] = vec16::fmadd(w, xk, even[r]);
        else
          odd[r] = vec16::fmadd(w, xk, odd[r]);
      }
    });
  }
  for (int r = 0; r < R; ++r) vec16::store(y + r * N, vec16::add(even[r], odd[r]));
}

// rows (1..R) of x through one tile (tile_f32<rows>).
template <int R, typename Weights>
void tile_rows(const float* x, int64_t K, int64_t nb, const Weights& weights, float* y, int64_t N,
               int64_t rows, side::Queue* sq, const tiled::NextTile& next = {}) {
  if constexpr (R > 0) {
    if (rows == R) return tile_f32<R>(x, K, nb, weights, y, N, sq, next);
    return tile_rows<R - 1>(x, K, nb, weights, y, N, rows, sq, next);
  }
}

// R rows of x through two tiles (32 outputs) whose weights were dequantised into a buffer
// [K, 2, 16] (input k: tile 0's 16 weights, then tile 1's). Each output's products are
// summed as tile_f32 sums them, even and odd inputs in two chains, so the numbers are
// the same; each x[r, k] loaded feeds two FMAs, not one. On the Ice Lake Xeon of stop 58
// (one thread, 64 rows, SmolLM2's shapes) 80-89 GFLOP/s against tile_f32<8>'s 52-63 from
// a buffer of one tile.
// Before each block of inputs, a few lines of sq's K/V (tile_f32).
template <int R>
inline void pair_f32(const float* x, int64_t K, const float* buf, float* y, int64_t N,
                     side::Queue* sq) {
  F even0[R], odd0[R], even1[R], odd1[R];
  for (int r = 0; r < R; ++r) even0[r] = odd0[r] = even1[r] = odd1[r] = vec16::zero();
  for (int64_t k = 0; k < K; k += 2) {  // K is a multiple of kBlock, so even
    if (sq && k % kBlock == 0) sq->some();
    const float* w = buf + k * 32;
    const F w0e = vec16::load(w), w1e = vec16::load(w + 16);
    const F w0o = vec16::load(w + 32), w1o = vec16::load(w + 48);
    for (int r = 0; r < R; ++r) {
      const F xe = vec16::set1(x[r * K + k]);
      even0[r] = vec16::fmadd(w0e, xe, even0[r]);
      even1[r] = vec16::fmadd(w1e, xe, even1[r]);
      const F xo = vec16::set1(x[r * K + k + 1]);
      odd0[r] = vec16::fmadd(w0o, xo, odd0[r]);
      odd1[r] = vec16::fmadd(w1o, xo, odd1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    vec16::store(y + r * N, vec16::add(even0[r], odd0[r]));
    vec16::store(y + r * N + 16, vec16::add(even1[r], odd1[r]));
  }
}

// rows (1..R) of x through two buffered tiles (pair_f32<rows>).
template <int R>
void pair_rows(const float* x, int64_t K, const float* buf, float* y, int64_t N, int64_t rows,
               side::Queue* sq) {
  if constexpr (R > 0) {
    if (rows == R) return pair_f32<R>(x, K, buf, y, N, sq);
    return pair_rows<R - 1>(x, K, buf, y, N, rows, sq);
  }
}

// y [T, N] = x [T, K] @ W^T (float32), make_tile(t) giving tile t's weights (Q4Tile,
// Q8Tile); `argmax`: each row's argmax of y taken as it is written. With y undefined (and
// argmax) the argmax alone: each tile's rows go to a scratch in L1, scanned there, and
// nothing to y (q8_bf16.cpp's q8_rows does the same, and says what it saves).
template <typename MakeTile>
void tiled_rows(const torch::Tensor& x, const tiled::Shape& s, torch::Tensor& y,
                const MakeTile& make_tile, TileArgmax* argmax = nullptr) {
  if (s.T == 0) return;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const bool kept = y.defined();
  TORCH_CHECK(kept || argmax != nullptr, "tiled_rows: no y to write");
  float* yp = kept ? y.data_ptr<float>() : nullptr;
  const int64_t T = s.T, K = s.K, nb = s.nb, N = s.N, tiles = s.tiles;
  // Passes of at most ~kPassBytesF32 of x, as equal as multiples of kRowsF32 rows allow (a
  // short last pass would dequantise every tile again for a few rows).
  const int64_t most =
      std::max<int64_t>(kRowsF32, kPassBytesF32 / (K * 4) / kRowsF32 * kRowsF32);
  const int64_t fewest = (T + most - 1) / most;        // passes of at most `most` rows
  const int64_t even = (T + fewest - 1) / fewest;       // rows a pass if they were equal
  const int64_t pass = (even + kRowsF32 - 1) / kRowsF32 * kRowsF32;  // <= most
  // The rows go pass by pass, and in each pass torch's threads claim the tiles in pieces
  // (pieces.h: parallel_pieces_in_passes), so that a thread the OS preempted, or one on a
  // slower core, delays only the piece it holds; each piece's tiles read that pass of x
  // from L2 in turn. (Pieces that each took every pass, each reading all of x again, ran
  // 2,048 rows in 4.3 s a step against 3.1 s in one share per thread.)
  // Above kRowsF32 rows the tiles go in pairs (pair_f32), where the build has them and
  // use_tile_pairs chose them.
  const int64_t span = kPairRows > 0 && T > kRowsF32 && pairs_wanted().load() ? 2 : 1;
  const int64_t units = (tiles + span - 1) / span;
  const int64_t passes = (T + pass - 1) / pass;
  parallel_pieces_in_passes(passes, 0, units, 1, [&](int64_t p, int64_t begin, int64_t end) {
    const int64_t first = p * pass, last = std::min(T, first + pass);
    // a unit's tiles, dequantised (more than kRowsF32 rows): [K, 16] or a pair's [K, 2, 16]
    thread_local std::vector<float> buf;
    side::Queue* sq = &side::queue();  // the K/V a share of a decode step will attend over
    if (sq->empty()) sq = nullptr;
    TileArgmax::Range range = argmax != nullptr ? argmax->begin(begin * span, first, last - first)
                                                : TileArgmax::Range{};
    // where rows r0.. of tiles t0 (.. t0 + width - 1) go, and their row stride: y, or the
    // scratch (up to a micro-kernel's rows of a pair of tiles)
    alignas(64) float scratch[std::max(kRowsF32, std::max<int>(kPairRows, 1)) * 32];
    const auto at = [&](int64_t t0, int64_t r0) {
      return kept ? yp + t0 * 16 + r0 * N : scratch;
    };
    const auto stride = [&](int64_t width) { return kept ? N : 16 * width; };
    const auto scan = [&](const float* y0, int64_t stride, int64_t tile, int64_t r0,
                          int64_t rows) {
      if (argmax != nullptr) argmax->scan(range, y0, stride, tile, r0, rows);
    };
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t t0 = unit * span, t1 = std::min(tiles, t0 + span);
      // tile t + span's bytes, asked for while tile t goes through (tiled::NextTile): the
      // next unit's tiles (a piece's first unit is not asked for ahead)
      const auto next_of = [&](int64_t t) {
        return t + span < std::min(tiles, end * span) ? make_tile(t + span).fetch()
                                                       : tiled::NextTile{};
      };
      if (last - first <= kRowsF32) {
        for (int64_t tile = t0; tile < t1; ++tile) {
          float* y0 = at(tile, first);
          tile_rows<kRowsF32>(xp + first * K, K, nb, make_tile(tile), y0, stride(1),
                              last - first, sq, next_of(tile));
          scan(y0, stride(1), tile, first, last - first);
        }
        continue;
      }
      // more rows than one micro-kernel holds: dequantise the unit once for all of them
      const int64_t width = t1 - t0;
      buf.resize(K * 16 * width);
      for (int64_t h = 0; h < width; ++h) {
        const auto direct = make_tile(t0 + h);
        const tiled::NextTile next = next_of(t0 + h);
        for (int64_t b = 0; b < nb; ++b) {
          next.block(b);
          direct(b, [&](int k, F w) {
            vec16::store(buf.data() + ((b * kBlock + k) * width + h) * 16, w);
          });
        }
      }
      if (width == 2) {
        for (int64_t r0 = first; r0 < last; r0 += kPairRows) {
          const int64_t rows = std::min<int64_t>(kPairRows, last - r0);
          float* y0 = at(t0, r0);
          pair_rows<kPairRows>(xp + r0 * K, K, buf.data(), y0, stride(2), rows, sq);
          scan(y0, stride(2), t0, r0, rows);
          scan(y0 + 16, stride(2), t0 + 1, r0, rows);
        }
        continue;
      }
      const Buffered buffered{buf.data()};
      for (int64_t r0 = first; r0 < last; r0 += kRowsF32) {
        const int64_t rows = std::min<int64_t>(kRowsF32, last - r0);
        float* y0 = at(t0, r0);
        tile_rows<kRowsF32>(xp + r0 * K, K, nb, buffered, y0, stride(1), rows, sq);
        scan(y0, stride(1), t0, r0, rows);
      }
    }
    if (argmax != nullptr) argmax->end(std::move(range));
  });
}
#endif

}  // namespace

bool tiled_f32_available() { return TESSERA_TILED_F32 != 0; }

int64_t q4_f32_queue_calls(int64_t T, int64_t tiles, int64_t nb) {
  if (T <= kRowsF32) return tiles * nb;  // one micro-kernel's rows through every tile
  if (kPairRows > 0 && pairs_wanted().load())
    return (T + kPairRows - 1) / kPairRows * ((tiles + 1) / 2) * nb;
  return (T + kRowsF32 - 1) / kRowsF32 * tiles * nb;
}

bool tile_pairs_in_use() { return pairs_wanted().load(); }

bool use_tile_pairs(bool wanted) {
  pairs_wanted().store(wanted && kPairRows > 0);
  return pairs_wanted().load();
}

torch::Tensor q4_f32_mm(const torch::Tensor& x, const torch::Tensor& nibbles,
                        const torch::Tensor& d, const c10::optional<torch::Tensor>& m,
                        int64_t qtype) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32,
              "q4_f32_mm: x must be a float32 [T, K] CPU tensor");
  const tiled::Shape s = tiled::check_x_and_d("q4_f32_mm", x, d);
  tiled::check_q4("q4_f32_mm", s, nibbles, d, m, qtype);
  auto y = torch::empty({s.T, s.N}, x.options());
#if TESSERA_TILED_F32
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const int64_t nb = s.nb;
  if (m) {
    const uint16_t* mp = reinterpret_cast<const uint16_t*>(m->data_ptr<at::Half>());
    tiled_rows(x, s, y, [=](int64_t tile) { return Q4Tile<true>(np, dp, mp, tile, nb); });
  } else {
    tiled_rows(x, s, y,
               [=](int64_t tile) { return Q4Tile<false>(np, dp, nullptr, tile, nb); });
  }
#else
  TORCH_CHECK(false,
              "q4_f32_mm: this build has no AVX-512 or AVX2 kernel (tiled_f32_available())");
#endif
  return y;
}

torch::Tensor q4_f32_dense(const torch::Tensor& nibbles, const torch::Tensor& d,
                           const c10::optional<torch::Tensor>& m, int64_t qtype) {
  const tiled::Shape s = tiled::check_d("q4_f32_dense", d, 0);
  tiled::check_q4("q4_f32_dense", s, nibbles, d, m, qtype);
  auto w = torch::empty({s.K, s.N}, torch::kFloat32);
#if TESSERA_TILED_F32
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = m ? reinterpret_cast<const uint16_t*>(m->data_ptr<at::Half>()) : nullptr;
  float* wp = w.data_ptr<float>();
  const int64_t nb = s.nb, N = s.N;
  const auto store = [&](const auto& tile, int64_t t) {
    for (int64_t b = 0; b < nb; ++b)
      tile(b, [&](int k, F v) { vec16::store(wp + (b * kBlock + k) * N + t * 16, v); });
  };
  at::parallel_for(0, s.tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (mp != nullptr) store(Q4Tile<true>(np, dp, mp, t, nb), t);
      else store(Q4Tile<false>(np, dp, nullptr, t, nb), t);
    }
  });
#else
  TORCH_CHECK(false,
              "q4_f32_dense: this build has no AVX-512 or AVX2 kernel (tiled_f32_available())");
#endif
  return w;
}

namespace {

// oneDNN's float32 linear (y = x @ w^T + bias, w [N, K]), the op torch registers for
// Inductor's CPU kernels: absent from builds without oneDNN. Called boxed, so its C++
// signature need not be named here.
const c10::OperatorHandle* onednn_linear_op() {
  static const c10::OperatorHandle* op = []() -> const c10::OperatorHandle* {
    if (!at::hasMKLDNN()) return nullptr;
    static const auto found =
        c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    return found ? &*found : nullptr;
  }();
  return op;
}

std::atomic<bool>& onednn_wanted() {  // set by use_onednn_gemm(); one flag for the process
  static std::atomic<bool> wanted{false};
  return wanted;
}

}  // namespace

bool onednn_gemm_available() { return onednn_linear_op() != nullptr; }

bool onednn_gemm_in_use() { return onednn_wanted().load(); }

bool use_onednn_gemm(bool wanted) {
  onednn_wanted().store(wanted && onednn_gemm_available());
  return onednn_wanted().load();
}

torch::Tensor dense_f32_mm(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(0),
              "dense_f32_mm: x [T, K] and w [K, N] expected, got ", x.sizes(), " and ",
              w.sizes());
  const auto f32_cpu = [](const torch::Tensor& t) {
    return t.scalar_type() == torch::kFloat32 && t.device().is_cpu();
  };
  TORCH_CHECK(f32_cpu(x) && f32_cpu(w) && (!bias || f32_cpu(*bias)),
              "dense_f32_mm: x, w and bias must be float32 CPU tensors, got ",
              x.scalar_type(), ", ", w.scalar_type(),
              bias ? std::string(", ") + c10::toString(bias->scalar_type()) : std::string());
  if (!onednn_wanted().load()) return bias ? at::addmm(*bias, x, w) : at::mm(x, w);
  torch::jit::Stack stack;
  stack.emplace_back(x.contiguous());
  stack.emplace_back(w.t());  // [N, K], a view: oneDNN takes the strides as they are
  stack.emplace_back(bias ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
  stack.emplace_back(c10::IValue());
  onednn_linear_op()->callBoxed(&stack);
  return stack.back().toTensor();
}

namespace {

// y, and with `ids` each row's argmax of y into it.
torch::Tensor q8_f32_product(const char* name, const torch::Tensor& x, const torch::Tensor& qs,
                             const torch::Tensor& d, torch::Tensor* ids,
                             [[maybe_unused]] bool keep_y = true) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, ": x must be a float32 [T, K] CPU tensor");
  const tiled::Shape s = tiled::check_x_and_d(name, x, d);
  tiled::check_q8(name, s, qs);
  torch::Tensor y;
#if TESSERA_TILED_F32
  const int8_t* qp = qs.data_ptr<int8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const int64_t nb = s.nb;
  const auto make_tile = [=](int64_t tile) { return Q8Tile(qp, dp, tile, nb); };
  if (ids != nullptr) {
    TORCH_CHECK(s.N > 0, name, ": no outputs to take the argmax of");
    TileArgmax argmax(s.T);
    if (keep_y) y = torch::empty({s.T, s.N}, x.options());
    tiled_rows(x, s, y, make_tile, &argmax);
    if (!y.defined() && argmax.any_nan()) {  // its rows are read again (argmax_rows' first NaN)
      y = torch::empty({s.T, s.N}, x.options());
      tiled_rows(x, s, y, make_tile);
    }
    *ids = torch::empty({s.T}, x.options().dtype(torch::kInt64));
    if (s.T > 0)
      argmax.result(y.defined() ? y.data_ptr<float>() : nullptr, s.N, ids->data_ptr<int64_t>());
  } else {
    y = torch::empty({s.T, s.N}, x.options());
    tiled_rows(x, s, y, make_tile);
  }
#else
  TORCH_CHECK(false, name, ": this build has no AVX-512 or AVX2 kernel (tiled_f32_available())");
#endif
  return y;
}

}  // namespace

void q8_f32_tile_row(const float* x, int64_t K, const int8_t* qs, const uint16_t* d,
                     int64_t tile, float* y) {
#if TESSERA_TILED_F32
  const int64_t nb = K / kBlock;
  tile_f32<1>(x, K, nb, Q8Tile(qs, d, tile, nb), y, 16, nullptr, tiled::NextTile{});
#else
  TORCH_CHECK(false, "q8_f32_tile_row: this build has no AVX-512 or AVX2 kernel");
#endif
}

torch::Tensor q8_f32_mm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d) {
  return q8_f32_product("q8_f32_mm", x, qs, d, nullptr);
}

std::tuple<torch::Tensor, torch::Tensor> q8_f32_mm_argmax(const torch::Tensor& x,
                                                          const torch::Tensor& qs,
                                                          const torch::Tensor& d) {
  torch::Tensor ids;
  torch::Tensor y = q8_f32_product("q8_f32_mm_argmax", x, qs, d, &ids);
  return {y, ids};
}

torch::Tensor q8_f32_argmax(const torch::Tensor& x, const torch::Tensor& qs,
                            const torch::Tensor& d) {
  torch::Tensor ids;
  q8_f32_product("q8_f32_argmax", x, qs, d, &ids, /*keep_y=*/false);
  return ids;
}

void register_tiled_f32(pybind11::module& m) {
  namespace py = pybind11;
  m.def("tiled_f32_available", &tiled_f32_available,
        "whether this CPU build has the AVX-512 or AVX2 float32 kernels of the tiled layouts");
  m.def("tile_pairs_in_use", &tile_pairs_in_use,
        "whether the float32 kernels' buffered loop takes tiles in pairs now (use_tile_pairs)");
  m.def("use_tile_pairs", &use_tile_pairs,
        "let the float32 kernels' buffered loop (more than 8 rows) take tiles in pairs, where "
        "the build has that loop (AVX-512), or one at a time: the same bits either way; "
        "returns whether it now takes pairs",
        py::arg("wanted"));
  m.def("q4_f32_mm", &q4_f32_mm,
        "y = x @ W^T in float32 for Q4_0/Q4_1 weights in the Q4Weight layout, each weight "
        "dequantised exactly as gguf does",
        py::arg("x"), py::arg("nibbles"), py::arg("d"), py::arg("m"), py::arg("qtype"),
        py::call_guard<py::gil_scoped_release>());
  m.def("q4_f32_dense", &q4_f32_dense,
        "W^T as a dense float32 [K, N] tensor for Q4_0/Q4_1 weights in the Q4Weight layout, "
        "each weight dequantised as q4_f32_mm does (for a GEMM of many rows)",
        py::arg("nibbles"), py::arg("d"), py::arg("m"), py::arg("qtype"),
        py::call_guard<py::gil_scoped_release>());
  m.def("onednn_gemm_available", &onednn_gemm_available,
        "whether this torch build has oneDNN's float32 linear (dense_f32_mm can use it)");
  m.def("onednn_gemm_in_use", &onednn_gemm_in_use,
        "whether dense_f32_mm goes through oneDNN now (use_onednn_gemm sets it)");
  m.def("use_onednn_gemm", &use_onednn_gemm,
        "let dense_f32_mm go through oneDNN (where available) or MKL's at::mm; returns "
        "whether it now uses oneDNN",
        py::arg("wanted"));
  m.def("dense_f32_mm", &dense_f32_mm,
        "y = x @ w (+ bias) for dense float32 w [K, N]: the exact mode's GEMM of many rows, "
        "through oneDNN or MKL as use_onednn_gemm chose",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("q8_f32_mm", &q8_f32_mm,
        "y = x @ W^T in float32 for Q8_0 weights in the Q8Weight layout, each weight "
        "dequantised exactly as gguf does",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::call_guard<py::gil_scoped_release>());
  m.def("q8_f32_mm_argmax", &q8_f32_mm_argmax,
        "q8_f32_mm, and each row's argmax of y (argmax_rows' answer) taken as y is written",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::call_guard<py::gil_scoped_release>());
  m.def("q8_f32_argmax", &q8_f32_argmax,
        "each row's argmax of q8_f32_mm(x) (argmax_rows' answer, int64 [T]), without "
        "writing the products to memory",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace tessera
