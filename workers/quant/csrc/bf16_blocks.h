// What the bf16 x Q4 and bf16 x Q8_0 kernels (q4_bf16.cpp, q8_bf16.cpp) share: the rows
// of x a micro-kernel holds, the passes of rows over the tiles, and the sums of one block
// of 32 inputs, whose order makes every row count give the same bits. Included inside
// each file's anonymous namespace where the CPU has AVX512_BF16, after <immintrin.h> and
// the file's kBlock (32 inputs per GGUF block).

constexpr int kRows = tiled::kBf16Rows;  // rows of x one micro-kernel holds: 3 zmm each
constexpr int64_t kDirectRows = kRows;  // Q8_0: up to this many rows, no expanded buffer
constexpr int64_t kPassBytes = 128 * 1024;  // x per pass over the tiles (see rows_per_pass)

// Rows of x per pass over a chunk of tiles: a pass's rows (bf16) stay in L2 while each
// tile, read (Q8_0: expanded) again for every pass, goes through them. One pass over all
// rows streamed x from L3 once per tile: at 2048 rows (a prompt chunk) the kernels ran
// ~15% slower.
inline int64_t rows_per_pass(int64_t K) {
  return std::max<int64_t>(kRows, kPassBytes / (K * 2) / kRows * kRows);
}

// f(std::integral_constant<int, R>{}) for R == rows (1 <= rows <= kRows): a group's row
// count as the compile-time constant the micro-kernels' templates take.
template <int R = kRows, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R > 0) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    return with_rows<R - 1>(rows, f);
  }
}

inline __m512bh x_pair(const uint16_t* x) {  // inputs x[0], x[1] broadcast as one bf16 pair
  int32_t xx;
  std::memcpy(&xx, x, sizeof xx);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(xx));
}

// 16 outputs of a row: rounded to bf16 (bf16 x) or as summed (float32 x).
inline void store16(uint16_t* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

// part[r] = block b's products for R rows of x [R, K] (bf16 bits) with a tile's 16
// outputs. pair(p), p = 0..15: the block's inputs 2p and 2p + 1 for the 16 outputs, as 16
// bf16 pairs (expanded in registers, or loaded from a tile's buffer). The 16 pairs are
// summed as four chains of 4 (one chain of 16 waited on VDPBF16PS's latency at one row),
// then the chains in order; the R rows' chains advance together (one pair serves R
// products, and R chains hide the latency). Every caller makes these sums, so a row's
// result never depends on how many rows came with it.
template <int R, typename Pair>
inline void block_sums(const uint16_t* x, int64_t K, int64_t b, const Pair& pair,
                       __m512* part) {
  for (int s = 0; s < 4; ++s) {
    __m512 step[R];
    for (int r = 0; r < R; ++r) step[r] = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const int p = 4 * s + i;
      const __m512bh w = reinterpret_cast<__m512bh>(pair(p));
      for (int r = 0; r < R; ++r)
        step[r] = _mm512_dpbf16_ps(step[r], x_pair(x + r * K + b * kBlock + 2 * p), w);
    }
    for (int r = 0; r < R; ++r) part[r] = s == 0 ? step[r] : _mm512_add_ps(part[r], step[r]);
  }
}
