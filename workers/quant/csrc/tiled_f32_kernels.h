// The exact mode's float32 kernels of the tiled layouts (tiled_f32.cpp): a tile's 16
// outputs' weights, dequantised in registers as gguf does (Q4Tile, Q8Tile) or read from a
// buffer they were dequantised into (Buffered); the micro-kernels that multiply R rows of
// x with one tile (tile_f32) or with two buffered tiles (pair_f32); and tiled_rows, the
// loop over passes of rows and the tiles that torch's threads claim in pieces. Included
// inside tiled_f32.cpp's anonymous namespace where the build has the vector kernels
// (TESSERA_TILED_F32), after vec16.h's F and I, kBlock, kRowsF32, kPairRows,
// kPassBytesF32, loop_wanted() and its Loop names and tile_argmax.h.
#pragma once

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
// the same; each x[r, k] loaded feeds two FMAs, not one. On an Ice Lake Xeon
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
  // Above kRowsF32 rows, the loop use_tiled_loop chose: tiles dequantised in registers
  // for every kRowsF32 rows, or into a buffer, one tile or a pair (pair_f32) at a time.
  const int loop = T > kRowsF32 ? loop_wanted().load() : kRegisters;
  const int64_t span = loop == kPairs ? 2 : 1;
  const int64_t units = (tiles + span - 1) / span;
  const int64_t passes = (T + pass - 1) / pass;
  parallel_pieces_in_passes(passes, 0, units, 1, [&](int64_t p, int64_t begin, int64_t end) {
    const int64_t first = p * pass, last = std::min(T, first + pass);
    // a unit's tiles, dequantised (the buffered loops): [K, 16] or a pair's [K, 2, 16]
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
      if (loop == kRegisters) {  // the next tile is asked for in the first rows' pass
        for (int64_t tile = t0; tile < t1; ++tile) {
          const auto direct = make_tile(tile);
          for (int64_t r0 = first; r0 < last; r0 += kRowsF32) {
            const int64_t rows = std::min<int64_t>(kRowsF32, last - r0);
            float* y0 = at(tile, r0);
            tile_rows<kRowsF32>(xp + r0 * K, K, nb, direct, y0, stride(1), rows, sq,
                                r0 == first ? next_of(tile) : tiled::NextTile{});
            scan(y0, stride(1), tile, r0, rows);
          }
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
