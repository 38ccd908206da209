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
// Measured (Xeon with AMX, 2 threads, one 1536 x 576 Q4_1 product): 1 / 7 / 16 / 64 / 256
// rows in 18 / 22 / 35 / 125 / 455 us against the AVX path's 18 / 63 / 139 / 552 / 2222.
// Two blocks are in flight at a time (tiles 0-2 and 3-5); at up to 16 rows a tile's blocks
// are expanded 8 at a time just before use (they stay in L1), above that all of them once
// per pass of rows.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TESSERA_AMX 1
#else
#define TESSERA_AMX 0
#endif

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

// Tiles 0 / 3: C (rows x 16 float32), 1 / 4: A (rows x 32 bf16), 2 / 5: B (16 x 32 bf16).
// Set per call: a thread's configuration is its own, and oneDNN's GEMMs change it.
inline void configure_tiles(int rows) {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette_id = 1;
  for (int t = 0; t < 6; ++t) {
    config.rows[t] = t % 3 == 2 ? 16 : rows;
    config.colsb[t] = 64;
  }
  // without a use GCC drops the field stores before LDTILECFG (seen with -O3)
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

constexpr int64_t kAmxRows = 16;   // rows of x a C tile holds
constexpr int64_t kAmxChunk = 8;   // blocks expanded at a time for up to 16 rows (8 KB)
constexpr int64_t kTileElems = 512;  // bf16 of one expanded block (16 pairs x 16 outputs)
// x per pass over the tiles (in L2; each pass expands the tiles again): 4x the AVX path's
// kPassBytes, since a tile's expansion costs more than its TDPBF16PS here
constexpr int64_t kAmxPassBytes = 512 * 1024;

// Up to 16 rows (x: the group's first row, sx likewise) through output tile `tile`: acc
// += each block's scaled sums. R: the row count when known at compile time (16, full
// groups: the accumulators stay in registers), 0 for `rows`. kCorr: Q4's sum(x) term.
// `whole`: every block of the tile is expanded in `expanded` already; else they are
// expanded here, kAmxChunk at a time.
template <int R, bool kCorr, typename Expand, typename Scales>
__attribute__((always_inline)) inline void amx_group(
    const uint16_t* x, int64_t K, int64_t nb, const float* sx, int64_t tile, int rows,
    bool whole, uint16_t* expanded, float (*sums)[kAmxRows * 16], const Expand& expand,
    const Scales& scales, __m512* acc) {
  const int n = R ? R : rows;
  for (int64_t c0 = 0; c0 < nb; c0 += kAmxChunk) {
    const int64_t c1 = std::min(nb, c0 + kAmxChunk);
    // a chunk expanded here goes to the buffer's start: the same 8 KB stay in L1
    const uint16_t* blocks = whole ? expanded : expanded - c0 * kTileElems;
    if (!whole)
      for (int64_t b = c0; b < c1; ++b) expand(tile, b, expanded + (b - c0) * kTileElems);
    for (int64_t b = c0; b < c1; b += 2) {
      const bool two = b + 1 < c1;
      _tile_zero(0);
      _tile_loadd(1, x + b * kBlock, K * 2);
      _tile_loadd(2, blocks + b * kTileElems, 64);
      if (two) {
        _tile_zero(3);
        _tile_loadd(4, x + (b + 1) * kBlock, K * 2);
        _tile_loadd(5, blocks + (b + 1) * kTileElems, 64);
      }
      _tile_dpbf16ps(0, 1, 2);
      if (two) _tile_dpbf16ps(3, 4, 5);
      _tile_stored(0, sums[0], 64);
      if (two) _tile_stored(3, sums[1], 64);
      for (int h = 0; h < (two ? 2 : 1); ++h) {
        __m512 dq, corr = _mm512_setzero_ps();
        scales(tile, b + h, dq, corr);
        for (int r = 0; r < n; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_load_ps(sums[h] + r * 16), dq, acc[r]);
          if constexpr (kCorr)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r * nb + b + h]), corr, acc[r]);
        }
      }
    }
  }
}

// y [T, N] = x [T, K] (bf16 bits) @ W^T through AMX tiles. expand(tile, b, out) writes
// block b of output tile `tile` as 16 rows of 16 bf16 pairs (out: 512 uint16, 64-byte
// aligned); scales(tile, b, dq, corr) gives the block's 16 d and, with kCorr, the
// correction that multiplies the block's sum of x (sx [T, nb]).
template <bool kCorr, typename Y, typename Expand, typename Scales>
void amx_rows(const uint16_t* xp, int64_t T, int64_t K, const float* sx, int64_t tiles, Y* yp,
              const Expand& expand, const Scales& scales) {
  const int64_t nb = K / kBlock, N = tiles * 16;
  const int64_t pass = std::max<int64_t>(kAmxRows, kAmxPassBytes / (K * 2) / kAmxRows * kAmxRows);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // a tile's blocks, expanded (not zeroed: every block is written before it is read)
    const std::unique_ptr<__m512i[]> buffer(new __m512i[nb * kTileElems / 32]);
    uint16_t* expanded = reinterpret_cast<uint16_t*>(buffer.get());
    alignas(64) float sums[2][kAmxRows * 16];
    int configured = -1;
    for (int64_t first = 0; first < T; first += pass) {
      const int64_t last = std::min(T, first + pass);
      const bool whole = last - first > kAmxRows;  // several row groups share the blocks
      for (int64_t tile = begin; tile < end; ++tile) {
        if (whole)
          for (int64_t b = 0; b < nb; ++b) expand(tile, b, expanded + b * kTileElems);
        for (int64_t r0 = first; r0 < last; r0 += kAmxRows) {
          const int rows = static_cast<int>(std::min(kAmxRows, last - r0));
          if (rows != configured) configure_tiles(configured = rows);
          __m512 acc[kAmxRows];
          for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
          const uint16_t* x = xp + r0 * K;
          const float* s = kCorr ? sx + r0 * nb : nullptr;
          if (rows == kAmxRows)
            amx_group<kAmxRows, kCorr>(x, K, nb, s, tile, rows, whole, expanded, sums, expand,
                                       scales, acc);
          else
            amx_group<0, kCorr>(x, K, nb, s, tile, rows, whole, expanded, sums, expand, scales,
                                acc);
          for (int r = 0; r < rows; ++r) store16(yp + (r0 + r) * N + tile * 16, acc[r]);
        }
      }
    }
    _tile_release();
  });
}
#else
inline bool amx_on() { return false; }
#endif
