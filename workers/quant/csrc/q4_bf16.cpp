// y[T, N] = x[T, K] @ W^T for GGUF Q4_0 / Q4_1 weights W [N, K], on CPUs with
// AVX512_BF16: the fast mode's matmul (float32 x rounded to bf16 at entry, float32 y: the
// sums unrounded) and the bfloat16 mode's (bf16 x, y rounded to bf16).
//
// The file's numbers are kept: per block b of 32 inputs, W = d * q + m (Q4_1) or
// d * (q - 8) (Q4_0) with d, m fp16, and
//     y = sum_b  d_b * (x_b . (q_b + 128))  +  (m_b - 128 d_b) * sum(x_b)      (Q4_1)
//     y = sum_b  d_b * (x_b . (q_b + 128))  -  136 d_b * sum(x_b)              (Q4_0)
// in float32. q + 128 is a bf16 whose bits are 0x4300 | q, so a nibble becomes a bf16
// with one AND and one OR, and VDPBF16PS multiplies 32 of them with x at a time
// (products exact, float32 sums). torch's int4 kernel instead rounds d and m to bf16.
// The +128 offset costs ~7 bits of the float32 block sums (error ~2^-17 of sum |x q|),
// far below the bf16 rounding of x that the fast mode accepts.
//
// Layout (built by tessera/workers/quant/int4.py, `Q4Weight.from_packed`), N % 16 == 0:
//   nibbles uint8 [N / 16, K / 32, 4, 16, 4]: for output tile t, block b and step s
//           (inputs 8s .. 8s + 7 of the block), one zmm: 32-bit lane c is output
//           16t + c and holds input 8s + 2p in bits 4p..4p+3 and input 8s + 2p + 1 in
//           bits 16 + 4p .. 16 + 4p + 3 (p = 0..3), so (lane >> 4p) & 0x000F000F is the
//           pair (8s + 2p, 8s + 2p + 1) as two 16-bit integers.
//   d, m    fp16 [N / 16, K / 32, 16] (m empty for Q4_0).
// Each block is expanded in registers and used at once by up to kRows rows of x (a
// nibble pair is one AND-OR away from bf16, cheaper than a round trip through a buffer),
// in passes of ~128 KB of x over the tiles (a pass's rows stay in L2; its first group of
// rows on a tile asks for the next tile's bytes block by block, tiled::NextTile). An expanded-tile
// buffer that every group of rows ran through (above 4 rows) measured slower at every
// row count: one step's 120 projections of SmolLM2, 2 threads, 8 / 16 / 64 / 256 rows:
// 6.3-6.6 / 11.2-11.8 / 38.8-39.8 / 148-150 ms against 9.3-10.8 / 13.9-18.3 / 41.4-45.5 /
// 163-173 (3 alternating runs each). All sums go through block_sums (bf16_blocks.h,
// shared with the Q8_0 kernel), so a row's result never depends on T.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "side_prefetch.h"
#include "tiled_layouts.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TESSERA_Q4_BF16 1
#else
#define TESSERA_Q4_BF16 0
#endif

namespace tessera {

namespace {

using tiled::kBlock;
using tiled::kQ4_0;
using tiled::kQ4_1;

#if TESSERA_Q4_BF16
#include "bf16_blocks.h"
#include "amx_tiles.h"

// Pair p (0..3) of a zmm of nibbles, as bf16 (q + 128) pairs: (v >> 4p) & low | bias.
inline __m512i expand_pair(__m512i v, int p) {
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 4 * p), _mm512_set1_epi32(0x000F000F),
                                   _mm512_set1_epi32(0x43004300), 0xEA);
}

// A block's 16 outputs' d, and the correction that takes the +128 off: m - 128 d (Q4_1)
// or -8 d - 128 d (Q4_0, m == nullptr). d, m: 16 fp16.
inline void block_scales(const uint16_t* d, const uint16_t* m, __m512& dq, __m512& corr) {
  dq = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
  corr = m ? _mm512_fnmadd_ps(_mm512_set1_ps(128.f), dq,
                              _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(m))))
           : _mm512_mul_ps(_mm512_set1_ps(-136.f), dq);
}

// R <= kRows rows through one tile, each block's pairs expanded in registers and
// used at once; before each block, a few lines of the thread's queue sq (side_prefetch.h:
// the K/V its next attention reads), if it has one, and that block of the next tile.
template <int R, typename Y>
inline void tile_direct(const uint16_t* x, int64_t K, const float* sx, int64_t nb,
                        const uint8_t* nibbles, const uint16_t* d, const uint16_t* m, Y* y,
                        int64_t N, side::Queue* sq, const tiled::NextTile& next) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (sq) sq->some();  // a few lines of it between blocks (side_prefetch.h)
    next.block(b);
    __m512 part[R];
    const uint8_t* block = nibbles + b * 4 * 64;
    block_sums<R>(x, K, b, [block](int p) {  // pair p: step p / 4's zmm, nibble pair p % 4
      return expand_pair(_mm512_loadu_si512(block + (p / 4) * 64), p % 4);
    }, part);
    __m512 dq, corr;
    block_scales(d + b * 16, m ? m + b * 16 : nullptr, dq, corr);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(part[r], dq, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r * nb + b]), corr, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + r * N, acc[r]);
}

// y [T, N] = x [T, K] (bf16 bits) @ W^T, y bf16 (uint16_t) or float32. With xf (float32
// x [T, K]), xp is a buffer that each row of xf is rounded into first (nearest even, as
// torch's conversion, in the pass that sums the blocks of x: a separate torch conversion
// cost prompt steps ~4% of their time; only denormal inputs differ from it, to zero).
template <typename Y>
void q4_rows(const float* xf, uint16_t* xp, int64_t T, int64_t K, const uint8_t* np,
             const uint16_t* dp, const uint16_t* mp, int64_t tiles, Y* yp) {
  const int64_t nb = K / kBlock, N = tiles * 16;
  // block sums of x, float32: [T, nb], or in the AMX path's layout (amx_sums_at)
  const bool amx = amx_on();
  std::vector<float> sx(amx ? amx_sums_size(T, nb) : T * nb);
  // 16 rows a thread at least: a decode step's 64 rows split (whole, they ran on one
  // thread while the other waited, ~50 us a layer), a single row does not fork
  at::parallel_for(0, T, 16, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      if (xf)  // K is a whole number of 32-input blocks
        for (int64_t k = 0; k < K; k += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(xp + t * K + k),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(
                                  _mm512_loadu_ps(xf + t * K + k))));
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(xp + t * K + b * kBlock))), 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(xp + t * K + b * kBlock + 16))), 16));
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        sx[amx ? amx_sums_at(t, b, nb) : t * nb + b] = sum;
      }
    }
  });
  if (amx) {
    const auto expand = [np, nb](int64_t tile, int64_t b, uint16_t* out) {
      const uint8_t* block = np + (tile * nb + b) * 256;
      for (int s = 0; s < 4; ++s) {
        const __m512i v = _mm512_loadu_si512(block + s * 64);
        for (int p = 0; p < 4; ++p) _mm512_store_si512(out + (4 * s + p) * 32, expand_pair(v, p));
      }
    };
    const auto scales = [dp, mp, nb](int64_t tile, int64_t b, __m512& dq, __m512& corr) {
      const int64_t at = (tile * nb + b) * 16;
      block_scales(dp + at, mp ? mp + at : nullptr, dq, corr);
    };
    return amx_rows<true>(xp, T, K, sx.data(), tiles, yp, expand, scales);
  }
  // Passes of rows over the tiles: a pass's rows of x stay in L2 while the tiles go
  // through them, kRows rows at a time.
  const int64_t pass = rows_per_pass(K);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    side::Queue* sq = &side::queue();  // the K/V a share of a decode step will attend over
    if (sq->empty()) sq = nullptr;
    for (int64_t first = 0; first < T; first += pass) {
      const int64_t last = std::min(T, first + pass);
      for (int64_t tile = begin; tile < end; ++tile) {
        const uint8_t* nt = np + tile * nb * 256;
        const uint16_t* dt = dp + tile * nb * 16;
        const uint16_t* mt = mp ? mp + tile * nb * 16 : nullptr;
        tiled::NextTile next;  // the next tile's nibbles, d, m, fetched by the first group
        if (tile + 1 < end)
          next = {reinterpret_cast<const char*>(nt + nb * 256), 256, dt + nb * 16,
                  (mt ? mt : dt) + nb * 16};
        for (int64_t r0 = first; r0 < last; r0 += kRows)
          with_rows(std::min<int64_t>(kRows, last - r0), [&](auto r) {
            tile_direct<decltype(r)::value>(xp + r0 * K, K, sx.data() + r0 * nb, nb, nt, dt,
                                            mt, yp + r0 * N + tile * 16, N, sq,
                                            r0 == first ? next : tiled::NextTile{});
          });
      }
    }
  });
}
#endif

}  // namespace

bool q4_bf16_available() { return TESSERA_Q4_BF16 != 0; }

bool amx_available() {
#if TESSERA_Q4_BF16
  return TESSERA_AMX && tiled::amx_granted();
#else
  return false;
#endif
}

bool amx_in_use() { return amx_available() && tiled::amx_wanted().load(); }

bool use_amx(bool wanted) {
  tiled::amx_wanted().store(wanted);
  return amx_in_use();
}

torch::Tensor q4_bf16_mm(const torch::Tensor& x, const torch::Tensor& nibbles,
                         const torch::Tensor& d, const c10::optional<torch::Tensor>& m,
                         int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "q4_bf16_mm: x must be a bfloat16 or float32 [T, K] CPU tensor");
  const tiled::Shape s = tiled::check_x_and_d("q4_bf16_mm", x, d);
  tiled::check_q4("q4_bf16_mm", s, nibbles, d, m, qtype);
  [[maybe_unused]] const int64_t tiles = s.tiles, K = s.K, N = s.N, T = s.T;
  auto y = torch::empty({T, N}, x.options());
#if TESSERA_Q4_BF16
  // float32 x is rounded to bf16 (nearest even) once, in q4_rows; its y keeps the float32
  // sums.
  const auto xc = x.contiguous();
  const bool f32 = xc.scalar_type() == torch::kFloat32;
  const auto xb = f32 ? torch::empty({T, K}, xc.options().dtype(torch::kBFloat16)) : xc;
  uint16_t* xp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  const float* xf = f32 ? xc.data_ptr<float>() : nullptr;
  const uint8_t* np = nibbles.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = m ? reinterpret_cast<const uint16_t*>(m->data_ptr<at::Half>()) : nullptr;
  if (y.scalar_type() == torch::kFloat32)
    q4_rows(xf, xp, T, K, np, dp, mp, tiles, y.data_ptr<float>());
  else
    q4_rows(xf, xp, T, K, np, dp, mp, tiles,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
#else
  TORCH_CHECK(false, "q4_bf16_mm: this build has no AVX512_BF16 kernel (q4_bf16_available())");
#endif
  return y;
}

void register_q4_bf16(pybind11::module& m) {
  namespace py = pybind11;
  m.def("q4_bf16_available", &q4_bf16_available,
        "whether this CPU build has the AVX512_BF16 Q4 kernel");
  m.def("amx_available", &amx_available,
        "whether the bf16 x Q4 / Q8_0 kernels can take their AMX path here (amx_tiles.h)");
  m.def("amx_in_use", &amx_in_use,
        "whether the bf16 x Q4 / Q8_0 kernels take their AMX path now (use_amx sets it)");
  m.def("use_amx", &use_amx,
        "let the bf16 x Q4 / Q8_0 kernels take their AMX path (the default) or not; returns "
        "whether they now do",
        py::arg("wanted"));
  m.def("q4_bf16_mm", &q4_bf16_mm,
        "y = x @ W^T for Q4_0/Q4_1 weights in the Q4Weight layout: bf16 x gives bf16 y; "
        "float32 x is rounded to bf16 and gives the float32 sums",
        py::arg("x"), py::arg("nibbles"), py::arg("d"), py::arg("m"), py::arg("qtype"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace tessera
