// The AMX path of the bf16 x Q4 and bf16 x Q8_0 kernels (q4_bf16.cpp, q8_bf16.cpp): the
// same numbers as their AVX512_BF16 path but for the order of the 32 products inside a
// block, on CPUs with AMX-BF16 (Sapphire Rapids and later). Included inside each file's
// anonymous namespace, after bf16_blocks.h.
//
// Per block b of 32 inputs, one TDPBF16PS multiplies up to 16 rows of x (the A tile, read
// from x in place) with the block's 16 outputs (the B tile: its 16 bf16 pairs for each
// output, which is exactly what the kernels' expand_pair gives, stored to an L1 buffer)
// into a zeroed C tile: the block's float32 sums for 16 rows x 16 outputs, the products
// exact (bf16 x (q + 128) or bf16 x int8). C is stored, and each row's sums are scaled
// into its accumulator as the AVX path does: acc += part * d (+ sum(x_b) * corr for Q4).
// So the weights stay the file's and the sums float32; only the hardware's summation
// order inside a block differs (relative differences ~1e-6 from the AVX path).
//
// Batch invariance: a C row depends on its own A row only, and every row count takes this
// path, so a row's result never depends on T. The AVX path sums in another order, so a
// process uses one path for every call: AMX wherever the CPU and the kernel allow it
// (Linux grants the tile state on request), unless `use_amx(false)` (tests, benchmarks).
//
// Pairs of blocks are pipelined: one pair's TDPBF16PS run (C tiles 0-1 or 2-3, in turns)
// while the pair before is scaled. At up to 16 rows a tile's blocks are expanded 8 at a
// time just before use, into the same 8 KB (they stay in L1); above that all of them
// once per pass of rows (512 KB of x, in L2), for every 16-row group of the pass.
// Measured (Xeon with AMX, 2 threads, one 1536 x 576 Q4_1 product): 1 / 7 / 16 / 64 / 256
// rows in 19 / 22 / 34 / 114 / 402 us against the AVX path's 18 / 78 / 171 / 690 / 2394
// (the same run; 18 / 25 / 35 / 139 / 516 while the accumulators were spilled, amx_group).
//
// What bounds it (benchmarks/probes/amx_overlap.cpp, one core, data in L1): the tile
// unit and the AVX-512 FMAs did not overlap on that Xeon, and a tile store waits for the
// product before it, so a block's work costs the sum of its parts: ~27 TSC ticks for the
// tile loads, TDPBF16PS and store, ~12 for the 32 FMAs that scale it. Folding d into the
// weights (d * q + m as two bf16 terms, C summed over all blocks, no store or scaling
// per block) measured ~30 ticks a block in 2 x 2 tiles: 1.3x at many rows, and far more
// work per block at few rows, where every row count must take the same path.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TESSERA_AMX 1
#else
#define TESSERA_AMX 0
#endif

constexpr int64_t kAmxRows = 16;  // rows of x a C tile holds

// A kernel's default: no argmax of its output (else a TileArgmax, tile_argmax.h).
struct NoArgmax {
  struct Range {};
};
inline NoArgmax::Range argmax_begin(NoArgmax*, int64_t) { return {}; }
template <typename Argmax>
typename Argmax::Range argmax_begin(Argmax* argmax, int64_t first_tile) {
  return argmax == nullptr ? typename Argmax::Range{} : argmax->begin(first_tile);
}

// Where row t's sum of block b of x is in the AMX path's layout of them: by group of 16
// rows, then block, then row (a block's 16 sums side by side, one per row of the group);
// amx_sums_size(T, nb) of them.
inline int64_t amx_sums_at(int64_t t, int64_t b, int64_t nb) {
  return ((t / kAmxRows) * nb + b) * kAmxRows + t % kAmxRows;
}
inline int64_t amx_sums_size(int64_t T, int64_t nb) {
  return (T + kAmxRows - 1) / kAmxRows * kAmxRows * nb;
}

#if TESSERA_AMX
inline bool amx_on() {
  return tiled::amx_wanted().load(std::memory_order_relaxed) && tiled::amx_granted();
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (rows x 16 float32; two pairs, see amx_group), 4 / 5: A (rows x 32 bf16),
// 6 / 7: B (16 x 32 bf16). Set per call: a thread's configuration is its own, and oneDNN's
// GEMMs change it.
inline void configure_tiles(int rows) {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t >= 6 ? 16 : rows;
    config.colsb[t] = 64;
  }
  // without a use GCC drops the field stores before LDTILECFG (seen with -O3)
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

constexpr int64_t kAmxChunk = 8;   // blocks expanded at a time for up to 16 rows (8 KB)
constexpr int64_t kTileElems = 512;  // bf16 of one expanded block (16 pairs x 16 outputs)
// x per pass over the tiles (in L2; each pass expands the tiles again): 4x the AVX path's
// kPassBytes, since a tile's expansion costs more than its TDPBF16PS here
constexpr int64_t kAmxPassBytes = 512 * 1024;

// Blocks b and b + 1 (if `two`) of up to 16 rows into C tiles C0 and C1: zeroed, then
// one TDPBF16PS each (A: x's rows in place, B: the expanded block). Macros: GCC's tile
// intrinsics paste their tile number into the instruction, so it must be a literal.
#define TESSERA_AMX_PAIR(C0, C1, x, K, blocks, b, two)         \
  do {                                                         \
    _tile_zero(C0);                                            \
    _tile_loadd(4, (x) + (b) * kBlock, (K) * 2);               \
    _tile_loadd(6, (blocks) + (b) * kTileElems, 64);           \
    _tile_dpbf16ps(C0, 4, 6);                                  \
    if (two) {                                                 \
      _tile_zero(C1);                                          \
      _tile_loadd(5, (x) + ((b) + 1) * kBlock, (K) * 2);       \
      _tile_loadd(7, (blocks) + ((b) + 1) * kTileElems, 64);   \
      _tile_dpbf16ps(C1, 5, 7);                                \
    }                                                          \
  } while (0)
#define TESSERA_AMX_STORE(C0, C1, sums, two)  \
  do {                                        \
    _tile_stored(C0, (sums)[0], 64);          \
    if (two) _tile_stored(C1, (sums)[1], 64); \
  } while (0)

// Up to 16 rows (x: the group's first row) through output tile `tile`: each block's
// scaled sums added in order, then the rows' 16 outputs stored to y (row stride N). R: the
// row count when known at compile time (16, full groups), 0 for `rows`. kCorr: Q4's
// sum(x) term; sx holds the group's block sums of x block by block, 16 a block (one per
// row; see amx_rows). `whole`: every block of the tile is expanded in `expanded` already;
// else they are expanded here, kAmxChunk at a time. Pipelined over pairs of blocks: pair
// i's products run (C tiles 0-1 or 2-3, in turns) while pair i - 1's sums, stored, are
// scaled.
//
// The accumulators are this function's own array, its loops unrolled, so that a full
// group's stay in registers: GCC's tile intrinsics are asm statements that clobber
// memory, and an array whose address a caller had was stored and reloaded
// around each of them, twice per row and block (2048 rows x 576 -> 3072 took 15 ms, 6.7
// with the scaling left out).
template <int R, bool kCorr, typename Y, typename Expand, typename Scales>
__attribute__((always_inline)) inline void amx_group(
    const uint16_t* x, int64_t K, int64_t nb, const float* sx, int64_t tile, int rows,
    bool whole, uint16_t* expanded, float (*sums)[kAmxRows * 16], Y* y, int64_t N,
    const Expand& expand, const Scales& scales) {
  const int n = R ? R : rows;
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  // block b's sums (part) scaled into acc; a macro, not a lambda: a capture of acc by
  // reference takes its address
#define TESSERA_AMX_SCALE(part, b)                                                     \
  do {                                                                                 \
    __m512 dq, corr = _mm512_setzero_ps();                                             \
    scales(tile, (b), dq, corr);                                                       \
    _Pragma("GCC unroll 16") for (int r = 0; r < n; ++r) {                             \
      acc[r] = _mm512_fmadd_ps(_mm512_load_ps((part) + r * 16), dq, acc[r]);           \
      if constexpr (kCorr)                                                             \
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[(b) * kAmxRows + r]), corr, acc[r]); \
    }                                                                                  \
  } while (0)
  const int64_t chunk = whole ? nb : kAmxChunk;
  for (int64_t c0 = 0; c0 < nb; c0 += chunk) {
    const int64_t c1 = std::min(nb, c0 + chunk);
    // a chunk expanded here goes to the buffer's start: the same 8 KB stay in L1
    const uint16_t* blocks = whole ? expanded : expanded - c0 * kTileElems;
    if (!whole)
      for (int64_t b = c0; b < c1; ++b) expand(tile, b, expanded + (b - c0) * kTileElems);
    const int64_t pairs = (c1 - c0 + 1) / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t b = c0 + 2 * i;
      const bool two = b + 1 < c1;  // only the last pair can hold one block
      float(*mine)[kAmxRows * 16] = sums + 2 * (i % 2);
      float(*before)[kAmxRows * 16] = sums + 2 * (1 - i % 2);
      if (i % 2 == 0)
        TESSERA_AMX_PAIR(0, 1, x, K, blocks, b, two);
      else
        TESSERA_AMX_PAIR(2, 3, x, K, blocks, b, two);
      if (i > 0) {
        TESSERA_AMX_SCALE(before[0], b - 2);
        TESSERA_AMX_SCALE(before[1], b - 1);
      }
      if (i % 2 == 0)
        TESSERA_AMX_STORE(0, 1, mine, two);
      else
        TESSERA_AMX_STORE(2, 3, mine, two);
    }
    const int64_t b = c0 + 2 * (pairs - 1);
    float(*last)[kAmxRows * 16] = sums + 2 * ((pairs - 1) % 2);
    TESSERA_AMX_SCALE(last[0], b);
    if (b + 1 < c1) TESSERA_AMX_SCALE(last[1], b + 1);
  }
#pragma GCC unroll 16
  for (int r = 0; r < n; ++r) store16(y + r * N, acc[r]);
#undef TESSERA_AMX_SCALE
}

// y [T, N] = x [T, K] (bf16 bits) @ W^T through AMX tiles. expand(tile, b, out) writes
// block b of output tile `tile` as 16 rows of 16 bf16 pairs (out: 512 uint16, 64-byte
// aligned); scales(tile, b, dq, corr) gives the block's 16 d and, with kCorr, the
// correction that multiplies the block's sum of x (sx: amx_sums_at's layout). An
// `argmax` (a TileArgmax, tile_argmax.h) scans each tile's rows as they are stored.
template <bool kCorr, typename Y, typename Expand, typename Scales, typename Argmax = NoArgmax>
void amx_rows(const uint16_t* xp, int64_t T, int64_t K, const float* sx, int64_t tiles, Y* yp,
              const Expand& expand, const Scales& scales, Argmax* argmax = nullptr) {
  constexpr bool kArgmax = !std::is_same_v<Argmax, NoArgmax>;
  const int64_t nb = K / kBlock, N = tiles * 16;
  // a multiple of 16: every group starts at a multiple of 16 (amx_sums_at's groups)
  const int64_t pass =
      std::max<int64_t>(kAmxRows, kAmxPassBytes / (K * 2) / kAmxRows * kAmxRows);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // a tile's blocks, expanded (not zeroed: every block is written before it is read)
    const std::unique_ptr<__m512i[]> buffer(new __m512i[nb * kTileElems / 32]);
    uint16_t* expanded = reinterpret_cast<uint16_t*>(buffer.get());
    alignas(64) float sums[4][kAmxRows * 16];
    int configured = -1;
    [[maybe_unused]] auto scanned = argmax_begin(argmax, begin);
    for (int64_t first = 0; first < T; first += pass) {
      const int64_t last = std::min(T, first + pass);
      const bool whole = last - first > kAmxRows;  // several row groups share the blocks
      for (int64_t tile = begin; tile < end; ++tile) {
        if (whole)
          for (int64_t b = 0; b < nb; ++b) expand(tile, b, expanded + b * kTileElems);
        for (int64_t r0 = first; r0 < last; r0 += kAmxRows) {
          const int rows = static_cast<int>(std::min(kAmxRows, last - r0));
          if (rows != configured) configure_tiles(configured = rows);
          const uint16_t* x = xp + r0 * K;
          const float* s = kCorr ? sx + amx_sums_at(r0, 0, nb) : nullptr;
          Y* y = yp + r0 * N + tile * 16;
          if (rows == kAmxRows)
            amx_group<kAmxRows, kCorr>(x, K, nb, s, tile, rows, whole, expanded, sums, y, N,
                                       expand, scales);
          else
            amx_group<0, kCorr>(x, K, nb, s, tile, rows, whole, expanded, sums, y, N, expand,
                                scales);
          if constexpr (kArgmax) argmax->scan(scanned, y, N, tile, r0, rows);
        }
      }
    }
    if constexpr (kArgmax) argmax->end(std::move(scanned));
    _tile_release();
  });
}
#else
// A build without AMX (-march=native on a CPU without it): never taken, but q4_rows and
// q8_rows name it.
inline bool amx_on() { return false; }
template <bool kCorr, typename Y, typename Expand, typename Scales, typename Argmax = NoArgmax>
void amx_rows(const uint16_t*, int64_t, int64_t, const float*, int64_t, Y*, const Expand&,
              const Scales&, Argmax* = nullptr) {}
#endif
