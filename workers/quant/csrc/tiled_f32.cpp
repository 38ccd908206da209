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
// more rows go in passes of ~512 KB of x over the tiles (a pass's rows stay in L2), and
// one of three loops takes each pass, whichever int4.py's tiled_loop measured fastest on
// this CPU (use_tiled_loop; all three give the same bits):
//   registers  each tile dequantised in registers again for every kRowsF32 rows (the
//              tile's packed bytes stay in L1);
//   buffered   each tile dequantised once per pass into a buffer [K, 16] that every
//              kRowsF32 rows read;
//   pairs      under AVX-512, each pair of tiles into a buffer [K, 2, 16] that every
//              kPairRows rows read (pair_f32: one broadcast of x[r, k] feeds both tiles'
//              FMAs).
// On a Sapphire Rapids Xeon (one thread, SmolLM2's gate/up 3072 x 576) registers took
// 16 / 24 / 64 rows in 0.50 / 0.69 / 1.9 ms, buffered 0.65 / 0.94 / 2.2, pairs 0.91 / - /
// 3.3: a buffer [K, 2, 16] of 72 KB leaves L1, where the tile's 4.6 KB of nibbles do not.
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
//
// The kernels (a tile's weights, the micro-kernels, the loop over tiles and passes) are
// in tiled_f32_kernels.h; here the entry points, their checks and the bindings.

#include <torch/extension.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
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
// Rows of x one micro-kernel holds, 2 accumulators each: 12 in AVX-512's 32 zmm (24
// accumulators, the rest the weights' nibbles, scale, min and x[r, k]: no spills; at 9-12
// rows one pass of 12 costs ~8% more a row than 8, where two passes of 8 took 35% more),
// 3 in AVX2's 16 ymm (12 of them accumulators: a 16-lane vector is two ymm there).
constexpr int kRowsF32 = TESSERA_VEC16 == 512 ? 12 : 3;
// Rows of x the buffered micro-kernel of two tiles holds (pair_f32): 6 x 2 tiles x 2
// chains = 24 of AVX-512's zmm; 0 (one tile at a time) under AVX2, whose 16 ymm hold
// one such row.
constexpr int kPairRows = TESSERA_VEC16 == 512 ? 6 : 0;
// The loop that takes more than kRowsF32 rows (use_tiled_loop sets it; one for the
// process). All give the same bits, so only speed decides, and that is the CPU's: on an
// Ice Lake Xeon (two full-width FMA units) one step's 121 products at 16 / 64 / 256 rows
// took 44 / 124 / 494 ms in pairs against 49 / 179 / 664 buffered one tile at a time; on a
// Zen 4 EPYC (512-bit FMAs in two halves) 39-40 / 109-111 / 425-454 against 32-34 /
// 105-110 / 427-442. int4.py's tiled_loop times them at load.
enum Loop : int { kRegisters = 0, kBuffered = 1, kPairs = 2 };
std::atomic<int>& loop_wanted() {
  static std::atomic<int> wanted{kPairRows > 0 ? kPairs : kBuffered};
  return wanted;
}
constexpr int64_t kPassBytesF32 = 512 * 1024;

#if TESSERA_TILED_F32

using vec16::F;
using vec16::I;

#include "tile_argmax.h"

#include "tiled_f32_kernels.h"
#endif

}  // namespace

bool tiled_f32_available() { return TESSERA_TILED_F32 != 0; }

int64_t q4_f32_queue_calls(int64_t T, int64_t tiles, int64_t nb) {
  const int loop = loop_wanted().load();
  if (T <= kRowsF32) return tiles * nb;  // one micro-kernel's rows through every tile
  if (loop == kPairs) return (T + kPairRows - 1) / kPairRows * ((tiles + 1) / 2) * nb;
  return (T + kRowsF32 - 1) / kRowsF32 * tiles * nb;
}

namespace {
constexpr const char* kLoopNames[] = {"registers", "buffered", "pairs"};
}  // namespace

std::string tiled_loop_in_use() { return kLoopNames[loop_wanted().load()]; }

std::string use_tiled_loop(const std::string& name) {
  int loop = -1;
  for (int i = 0; i < 3; ++i)
    if (name == kLoopNames[i]) loop = i;
  TORCH_CHECK(loop >= 0, "use_tiled_loop: the loops are registers, buffered and pairs, not '",
              name, "'");
  if (loop == kPairs && kPairRows == 0) loop = kBuffered;  // AVX2: no pair loop
  loop_wanted().store(loop);
  return tiled_loop_in_use();
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
  m.def("tiled_loop_in_use", &tiled_loop_in_use,
        "the float32 kernels' loop for more rows than one micro-kernel holds (12 under "
        "AVX-512, 3 under AVX2) now (use_tiled_loop): registers, "
        "buffered or pairs");
  m.def("use_tiled_loop", &use_tiled_loop,
        "let the float32 kernels take more rows than one micro-kernel holds by dequantising "
        "each tile in registers again for each micro-kernel's rows ('registers'), once "
        "into a buffer ('buffered') "
        "or two tiles at a time into one ('pairs', AVX-512 builds; 'buffered' elsewhere): "
        "the same bits every way; returns the loop now in use",
        py::arg("name"));
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
