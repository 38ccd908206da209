// What bounds the AMX path of the bf16 kernels (workers/quant/csrc/amx_tiles.h) from 64
// rows up: a probe of the tile unit beside AVX-512, one core, data in L1.
//
//     g++ -O2 -march=native -o /tmp/amx_overlap benchmarks/probes/amx_overlap.cpp
//     /tmp/amx_overlap
//
// Each line is the TSC ticks per iteration of a loop body (best of 5 runs). The kernel's
// work per block of 32 inputs and 16 rows x 16 outputs is one line below: load the A and B
// tiles, one TDPBF16PS into a zeroed C, store C, then scale the 16 rows' sums into their
// accumulators (32 FMAs, half with a broadcast operand). On a Xeon with AMX
// (2 vCPUs, AMX-BF16, TSC 2.6 GHz) the parts did not overlap: the FMAs cost as much beside
// a TDPBF16PS as alone, and a tile store waits for the product before it, so a block
// costs about the sum of its parts (~39 ticks; the kernel, with x in L2 and the
// expansions, about twice that). The other form of the product (the weights' d * q + m
// as two bf16 terms, C summed over every block, no store or scaling per block: the last
// line, 4 blocks of 16 rows x 16 outputs per iteration, two TDPBF16PS each) ran ~30
// ticks per block: ~1.3x on prompt rows, at the price of far more expansion work per
// block at few rows. (A plain loop in main, without lambdas, measured the same:
// TDPBF16PS + 32 FMAs ~26 ticks, the FMAs alone ~12.)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

alignas(64) uint16_t a_tiles[2][16 * 32];  // x: 16 rows of one block (bf16)
alignas(64) uint16_t b_tiles[4][16 * 32];  // expanded blocks: 16 pairs x 16 outputs
alignas(64) float sums[4][256];
alignas(64) float sx[16];

template <typename Body>
void measure(const char* name, Body body) {
  constexpr int kIterations = 200000;
  uint64_t best = UINT64_MAX;
  for (int run = 0; run < 5; ++run) {
    const uint64_t start = __rdtsc();
    for (int i = 0; i < kIterations; ++i) body();
    const uint64_t ticks = __rdtsc() - start;
    if (ticks < best) best = ticks;
  }
  std::printf("%-58s %6.1f\n", name, static_cast<double>(best) / kIterations);
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    std::puts("no AMX tile state granted here");
    return 1;
  }
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
  for (auto& tile : a_tiles)
    for (auto& v : tile) v = 0x3f80;  // 1.0
  for (auto& tile : b_tiles)
    for (auto& v : tile) v = 0x3c00;  // 2^-7: the sums stay finite
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const __m512 d = _mm512_set1_ps(0.5f), corr = _mm512_set1_ps(-1e-3f);
  // a macro: a lambda capturing acc by reference would keep it in memory
#define SCALE(part)                                                          \
  _Pragma("GCC unroll 16") for (int r = 0; r < 16; ++r) {                    \
    acc[r] = _mm512_fmadd_ps(_mm512_load_ps((part) + 16 * r), d, acc[r]);    \
    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r]), corr, acc[r]);           \
  }
  std::printf("%-58s %6s\n", "loop body", "ticks");
  measure("TDPBF16PS into one C (a chain)", [] { _tile_dpbf16ps(0, 4, 6); });
  measure("32 FMAs (the scaling of one block)", [&] { SCALE(sums[1]); });
  measure("TDPBF16PS + the 32 FMAs", [&] {
    _tile_dpbf16ps(0, 4, 6);
    SCALE(sums[1]);
  });
  measure("load A, load B, TDPBF16PS, store C", [] {
    _tile_loadd(4, a_tiles[0], 64);
    _tile_loadd(6, b_tiles[0], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, sums[0], 64);
  });
  measure("zero C, load A, load B, TDPBF16PS, store C, 32 FMAs", [&] {
    _tile_zero(0);
    _tile_loadd(4, a_tiles[0], 64);
    _tile_loadd(6, b_tiles[0], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, sums[0], 64);
    SCALE(sums[1]);
  });
  measure("hi and lo B tiles, 2 x 2 C tiles, no store (4 blocks)", [] {
    _tile_loadd(4, a_tiles[0], 64);
    _tile_loadd(5, a_tiles[1], 64);
    for (int half = 0; half < 2; ++half) {
      _tile_loadd(6, b_tiles[2 * half], 64);
      _tile_loadd(7, b_tiles[2 * half + 1], 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  });
  _tile_release();
  float total = 0;
  for (auto& v : acc) total += _mm512_reduce_add_ps(v);
  std::printf("(checksum %g)\n", total);
  return 0;
}
