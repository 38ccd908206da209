// Every decoder layer of a step in one call, and the final norm of the rows whose logits
// the step wants: first rows of one token each (a sequence's new token; in bf16 also a
// short prompt's tokens, each its own row: every row's K/V is written before any row of
// the layer attends, so the rows of one prompt see each other causally through the
// cache), then causal chunks of several rows (prompts), whose attention goes through
// torch's CPU flash kernel as the Python path's does; everything else of theirs is the
// same loops and matmuls as the single rows'.
//
// With two threads a step of single rows (decodes) runs in shares of rows, each
// thread its own rows through every layer (run_in_shares), rather than both threads on
// each product: where a thread is off its core, the other is held once a step, not at
// each of a layer's dozen parallel loops.
//
// The Python layer loop spends most of a small-batch decode step dispatching ~40 eager
// ops per layer (norms, RoPE, the K/V scatter, the attention tiles, SwiGLU, residuals);
// here those are plain loops, and only the four matmuls of a layer go through ATen
// (or through gguf_mm, q4_f32_mm and q4_bf16_mm, this extension's packed GGUF kernels).
//
// Numerics follow tessera/workers/model/llama.py step for step, in the model's dtype T
// (float32: the exact and fast modes; bfloat16), with the residual stream float32 and
// the KV cache in T (the fast mode's in float16, each K/V value rounded once on write):
//   RMSNorm   float32 x * 1/sqrt(mean(x^2) + eps), rounded to T, times the weight in T
//   RoPE      x * cos + rotate_half(x) * sin, each product and the sum rounded to T
//   SwiGLU    silu(gate) rounded to T, times up, rounded to T
// Attention reads the paged cache in place (no gather): scores, max, exp and sums in
// float32, the output rounded to T. Only the order of float sums and the last bits of
// exp (a ~2 ulp polynomial, as torch's CPU kernels use vectorised approximations)
// differ from the Python path; the exactness contract holds.
// Built with -ffp-contract=off, so no product and sum are fused behind our back. The
// row-wise steps take 16 values at a time in float32 and bf16 (round16 / store16: bf16
// rounded as c10::BFloat16 rounds, NaN and denormals included, so the same bits as the
// scalar loops, which float16 keeps): at 16 decodes in bf16 the scalar roundings ran on
// the calling thread for ~7% of a step while the other thread waited.
//
// The stack's parts are headers included inside this file's anonymous namespace, so that
// the layer loop and every row-wise step it calls are one translation unit, inlined into
// each other as the compiler sees fit:
//   decode_values.h      the model dtype's values: float32 and back, 16 at a time
//   decode_norm_rope.h   RMSNorm, RoPE
//   decode_swiglu.h      SwiGLU
//   decode_stack.h       the projections (Linear), the layers, the DecodeLayers class
//   decode_experts.h     a sparse layer's mixture of experts
//   decode_attention.h   the K/V cache writes and attention
//   decode_shares.h      a step's decodes in shares of rows, one per thread
//   decode_layer_loop.h  the layer loop
// Here: the entry point (DecodeLayers::forward: its checks, the choice of dtypes) and the
// Python bindings.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "pieces.h"
#include "side_prefetch.h"
#include "tiled_layouts.h"
#include "vec16.h"

// The vector paths (AVX-512 or AVX2: vec16.h); the loops after each take the rest.
#define TESSERA_DECODE_VEC (TESSERA_VEC16 != 0)

namespace tessera {

torch::Tensor gguf_mm(const torch::Tensor& x, const torch::Tensor& qs,
                      const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                      int64_t qtype);
torch::Tensor q4_bf16_mm(const torch::Tensor& x, const torch::Tensor& nibbles,
                         const torch::Tensor& d, const c10::optional<torch::Tensor>& m,
                         int64_t qtype);
torch::Tensor q4_f32_mm(const torch::Tensor& x, const torch::Tensor& nibbles,
                        const torch::Tensor& d, const c10::optional<torch::Tensor>& m,
                        int64_t qtype);
torch::Tensor q4_f32_dense(const torch::Tensor& nibbles, const torch::Tensor& d,
                           const c10::optional<torch::Tensor>& m, int64_t qtype);
// some() calls of the thread's K/V queue (side_prefetch.h) that q4_f32_mm makes for T rows
// through `tiles` tiles of nb blocks (tiled_f32.cpp)
int64_t q4_f32_queue_calls(int64_t T, int64_t tiles, int64_t nb);
torch::Tensor dense_f32_mm(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& bias);
torch::Tensor kquant_mm(const torch::Tensor& x, const torch::Tensor& raw, int64_t qtype,
                        int64_t register_rows);
torch::Tensor kquant_q8_mm(const torch::Tensor& x, const torch::Tensor& raw, int64_t qtype);

namespace {

#include "decode_values.h"
#include "decode_norm_rope.h"
#include "decode_swiglu.h"
#include "decode_stack.h"
#include "decode_experts.h"

// The step's arguments (described where forward is declared, decode_stack.h), every index
// checked once; then the layers, in the model's dtype and the cache's.
inline torch::Tensor DecodeLayers::forward(
    torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
    const torch::Tensor& slots, const torch::Tensor& seq_lens, const torch::Tensor& block_tables,
    const torch::Tensor& kv_cache, const c10::optional<torch::Tensor>& norm,
    const c10::optional<torch::Tensor>& rows, const c10::optional<torch::Tensor>& prompts,
    const c10::optional<torch::Tensor>& prompt_tables,
    const c10::optional<torch::Tensor>& lora_coef) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32 &&
                  hidden.is_contiguous(),
              "DecodeLayers: hidden must be a contiguous float32 [B, hidden] tensor");
  const int64_t B = hidden.size(0);
  TORCH_CHECK(num_layers() > 0 && hidden.size(1) == layers_[0].input_norm.numel(),
              "DecodeLayers: hidden has ", hidden.size(1), " features, the layers take ",
              num_layers() > 0 ? layers_[0].input_norm.numel() : 0);
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() &&
                  kv_cache.size(0) >= num_layers() && kv_cache.size(4) == num_kv_heads_ &&
                  kv_cache.size(5) == head_dim_,
              "DecodeLayers: kv_cache must be a contiguous [layers, 2, blocks, block_size, ",
              num_kv_heads_, ", ", head_dim_, "] tensor");
  const auto dtype = layers_[0].input_norm.scalar_type();  // the model's
  TORCH_CHECK(cos.sizes() == torch::IntArrayRef({B, rotary_}) && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "DecodeLayers: cos/sin must be contiguous [B, rotary_dim] in the model's dtype");
  const int64_t decodes = seq_lens.numel();
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64 &&
                  block_tables.scalar_type() == torch::kInt64 && slots.numel() == B &&
                  decodes <= B && block_tables.dim() == 2 && block_tables.size(0) == decodes,
              "DecodeLayers: slots [B], seq_lens [Dn <= B] and block_tables [Dn, W] must be "
              "int64");
  const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  const auto st = slots.contiguous(), sl = seq_lens.contiguous(), bt = block_tables.contiguous();
  const int64_t* slot_p = st.data_ptr<int64_t>();
  const int64_t* len_p = sl.data_ptr<int64_t>();
  const int64_t* table_p = bt.data_ptr<int64_t>();
  const int64_t width = bt.size(1);
  // every index the loops below follow, checked once
  const auto check_table = [&](const int64_t* table, int64_t n, int64_t w, const char* what,
                               int64_t index) {
    TORCH_CHECK(n >= 1 && n <= w * block_size, "DecodeLayers: seq_len ", n, " of ", what, " ",
                index, " does not fit ", w, " blocks");
    for (int64_t j = 0; j < (n + block_size - 1) / block_size; ++j)
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "DecodeLayers: block ", table[j],
                  " of ", what, " ", index, " is outside the cache");
  };
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot_p[b] >= 0 && slot_p[b] < num_blocks * block_size,
                "DecodeLayers: slot ", slot_p[b], " of row ", b, " is outside the cache");
  for (int64_t b = 0; b < decodes; ++b) check_table(table_p + b * width, len_p[b], width, "row", b);
  TORCH_CHECK(prompts.has_value() == prompt_tables.has_value(),
              "DecodeLayers: prompts and prompt_tables go together");
  std::vector<Prompt> chunks;
  torch::Tensor chunk_tables;
  if (prompts) {
    const auto pr = prompts->contiguous();
    chunk_tables = prompt_tables->contiguous();
    TORCH_CHECK(pr.scalar_type() == torch::kInt64 && pr.dim() == 2 && pr.size(1) == 3 &&
                    chunk_tables.scalar_type() == torch::kInt64 && chunk_tables.dim() == 2 &&
                    chunk_tables.size(0) == pr.size(0),
                "DecodeLayers: prompts [P, 3] and prompt_tables [P, W] must be int64");
    const int64_t* p = pr.data_ptr<int64_t>();
    const int64_t* tables = chunk_tables.data_ptr<int64_t>();
    int64_t next = decodes;
    for (int64_t i = 0; i < pr.size(0); ++i) {
      const Prompt chunk{p[3 * i], p[3 * i + 1], p[3 * i + 2],
                         tables + i * chunk_tables.size(1)};
      TORCH_CHECK(chunk.first == next, "DecodeLayers: prompt ", i, " starts at row ",
                  chunk.first, ", not at row ", next, " (after the decodes and prompts before)");
      TORCH_CHECK(chunk.rows >= 1 && chunk.rows <= chunk.seq_len, "DecodeLayers: prompt ", i,
                  " has ", chunk.rows, " rows, not 1 .. its seq_len ", chunk.seq_len);
      check_table(chunk.table, chunk.seq_len, chunk_tables.size(1), "prompt", i);
      next += chunk.rows;
      chunks.push_back(chunk);
    }
    TORCH_CHECK(next == B, "DecodeLayers: the decodes and prompts cover ", next, " rows of ", B);
  } else {
    TORCH_CHECK(decodes == B, "DecodeLayers: ", B - decodes, " rows are neither decodes nor "
                "prompts");
  }
  TORCH_CHECK(rows.has_value() == norm.has_value() &&
                  (!rows || (norm->sizes() == layers_[0].input_norm.sizes() &&
                             norm->scalar_type() == dtype && rows->dim() == 1 &&
                             rows->scalar_type() == torch::kInt64)),
              "DecodeLayers: rows must be int64 [S], with the final norm [hidden] in the "
              "model's dtype");
  const auto picked = rows ? rows->contiguous() : torch::Tensor();
  for (int64_t i = 0; rows && i < picked.numel(); ++i)
    TORCH_CHECK(picked.data_ptr<int64_t>()[i] >= 0 && picked.data_ptr<int64_t>()[i] < B,
                "DecodeLayers: row ", picked.data_ptr<int64_t>()[i], " is not one of the ", B);
  const auto cache = kv_cache.scalar_type();
  // with `rows`, the last layer's rows past its attention (the o projection, the residual,
  // the MLP) are only those rows, gathered in their order: no other row's output is read
  torch::Tensor last;
  bool linked = false;  // some decode row reads K/V another decode row writes
  // LoRA coefficients [B, S] (workers/model/lora.py's LoraBatch)
  TORCH_CHECK(!lora_coef || (lora_coef->dim() == 2 && lora_coef->size(0) == B &&
                              lora_coef->scalar_type() == dtype),
              "DecodeLayers: lora_coef must be [B, slots] in the model's dtype");
  const c10::optional<LoraRows> lora =
      lora_coef ? c10::optional<LoraRows>(LoraRows(lora_coef->contiguous())) : c10::nullopt;
  const int64_t shares = row_shares(decodes, B, slot_p, len_p, table_p, width, block_size,
                                    rows ? &picked : nullptr, &linked);
#define TESSERA_RUN(T, C)                                                                      \
  last = shares == kOneRun                                                                     \
             ? run<T, C>(hidden, cos, sin, slot_p, decodes, len_p, table_p, width, chunks,     \
                         kv_cache, rows ? &picked : nullptr, false, 0, nullptr,                \
                         lora ? &*lora : nullptr)                                              \
         : chunks.empty() ? run_in_shares<T, C>(shares, hidden, cos, sin, slot_p, len_p,       \
                                                table_p, width, kv_cache,                      \
                                                rows ? &picked : nullptr, !linked,             \
                                                lora ? &*lora : nullptr)                       \
                          : run_split<T, C>(shares, hidden, cos, sin, slot_p, decodes, len_p,  \
                                            table_p, width, chunks, kv_cache,                  \
                                            rows ? &picked : nullptr, !linked,                 \
                                            lora ? &*lora : nullptr)
  if (dtype == at::kFloat && cache == at::kFloat) TESSERA_RUN(float, float);
  else if (dtype == at::kFloat && cache == at::kHalf) TESSERA_RUN(float, c10::Half);
  else if (dtype == at::kBFloat16 && cache == at::kBFloat16) TESSERA_RUN(c10::BFloat16, c10::BFloat16);
  else if (dtype == at::kHalf && cache == at::kHalf) TESSERA_RUN(c10::Half, c10::Half);
  else TORCH_CHECK(false, "DecodeLayers: no kernel for a ", dtype, " model with a ", cache, " cache");
#undef TESSERA_RUN
  if (!rows) return hidden;
  if (dtype == at::kFloat) return final_norm<float>(last, *norm);
  if (dtype == at::kBFloat16) return final_norm<c10::BFloat16>(last, *norm);
  return final_norm<c10::Half>(last, *norm);
}

// The other members' definitions come after forward's, in this order: GCC's inliner breaks
// ties between equally good call sites by the order in which it meets the functions, and
// this order gives the inlining the stack is timed with (which cases of attend's head_dim
// switch run inlines whole, which through a call).
#include "decode_shares.h"
#include "decode_layer_loop.h"
#include "decode_attention.h"

Linear make_linear(int64_t kind, const c10::optional<torch::Tensor>& weight,
                   const c10::optional<torch::Tensor>& qs,
                   const c10::optional<torch::Tensor>& scales,
                   const c10::optional<torch::Tensor>& mins, int64_t qtype,
                   const c10::optional<torch::Tensor>& int4,
                   const c10::optional<torch::Tensor>& int4_scales_zeros, int64_t int4_rows,
                   const c10::optional<torch::Tensor>& bias) {
  Linear linear;
  linear.kind = kind;
  TORCH_CHECK(kind == kDense || kind == kGguf || kind == kInt4 || kind == kQ4 ||
                  kind == kQ4Exact || kind == kKQuant || kind == kKQuantInt8,
              "make_linear: kind ", kind);
  if (weight) linear.weight = *weight;
  if (kind == kKQuant || kind == kKQuantInt8) {
    TORCH_CHECK(qs && qs->scalar_type() == torch::kUInt8 && qs->dim() == 2,
                "make_linear: a K-quant weight needs its super-blocks, uint8 [out, bytes]");
    linear.qs = *qs;
    linear.qtype = qtype;
  }
  if (kind == kGguf) {
    TORCH_CHECK(qs && scales, "make_linear: a GGUF weight needs qs and scales");
    linear.qs = *qs;
    linear.scales = *scales;
    linear.mins = mins;
    linear.qtype = qtype;
  }
  const bool q4 = kind == kQ4 || kind == kQ4Exact;
  if (kind == kInt4 || q4) {
    TORCH_CHECK(int4 && int4_scales_zeros, "make_linear: a 4-bit weight needs its tensors");
    linear.int4 = *int4;
    linear.int4_scales_zeros = *int4_scales_zeros;
    linear.int4_rows = int4_rows;
  }
  if (q4) {
    linear.mins = mins;
    linear.qtype = qtype;
  }
  TORCH_CHECK(kind == kGguf || kind == kQ4Exact || kind == kKQuant || kind == kKQuantInt8 ||
                  weight || int4_rows > 0,
              "make_linear: no dense weight");
  linear.bias = bias;
  return linear;
}

// Row groups of one projection, each its own Linear (without a bias), multiplied one by
// one and their outputs set side by side: a fused projection whose parts have different
// GGUF types (a Q4_K_M's Q4_K q and k, Q6_K v).
Linear make_parts(const std::vector<Linear>& parts, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!parts.empty(), "make_parts: no parts");
  for (const Linear& part : parts)
    TORCH_CHECK(part.kind != kParts && !part.bias, "make_parts: a part is plain, without bias");
  Linear linear;
  linear.kind = kParts;
  linear.parts = parts;
  linear.bias = bias;
  return linear;
}

}  // namespace

int64_t use_row_shares(int64_t rows) {
  TORCH_CHECK(rows >= 0, "use_row_shares: rows must be >= 0 (0: never), got ", rows);
  share_rows().store(rows);
  return rows;
}

bool use_kv_prefetch(bool wanted) {
  side::kv_prefetch_wanted().store(wanted);
  return wanted;
}

int64_t kv_prefetched_lines() { return side::lines_asked().load(); }

bool use_share_handover(bool wanted) {
  share_handover().store(wanted);
  return wanted;
}

int64_t share_handovers_so_far() { return share_handovers().load(); }

bool hold_second_share(bool wanted) {
  hold_second_thread().store(wanted);
  return wanted;
}

void register_decode_layers(pybind11::module& m) {
  namespace py = pybind11;
  m.def("use_kv_prefetch", &use_kv_prefetch,
        "let a share of a decode step fetch the next layer's K/V while its products run "
        "(side_prefetch.h; the default) or not: the same numbers; returns wanted",
        py::arg("wanted"));
  m.def("kv_prefetched_lines", &kv_prefetched_lines,
        "cache lines of K/V the decode steps' shares have asked for so far (every thread)");
  m.def("use_share_handover", &use_share_handover,
        "let a share of a decode step hand half its rows, at its next layer, to a thread "
        "done with its own (the default) or not: the same numbers; returns wanted",
        py::arg("wanted"));
  m.def("share_handovers", &share_handovers_so_far,
        "how many times a share of a decode step has handed rows to the other thread");
  m.def("hold_second_share", &hold_second_share,
        "for tests: the second thread of a step in shares claims one only once the first has "
        "claimed them all, so the first hands it rows; off by default; returns wanted",
        py::arg("wanted"));
  m.def("use_row_shares", &use_row_shares,
        "let steps of decodes run in shares of at least `rows` rows (default 4), one per "
        "thread, each through every layer alone, or (0) every product shared by the threads: "
        "the same numbers; returns rows",
        py::arg("rows"));
  py::class_<Linear>(m, "Linear");
  m.def("make_linear", &make_linear, py::arg("kind"), py::arg("weight"), py::arg("qs"),
        py::arg("scales"), py::arg("mins"), py::arg("qtype"), py::arg("int4"),
        py::arg("int4_scales_zeros"), py::arg("int4_rows"), py::arg("bias"));
  m.def("make_parts", &make_parts, py::arg("parts"), py::arg("bias"));
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, int64_t, int64_t>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate_size"), py::arg("eps"), py::arg("scale"), py::arg("window") = 0,
           py::arg("rotary_dim") = 0)
      .def("add_layer", &DecodeLayers::add_layer, py::arg("input_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("post_norm"), py::arg("gate_up"), py::arg("down"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none())
      .def("add_moe_layer", &DecodeLayers::add_moe_layer, py::arg("input_norm"),
           py::arg("qkv"), py::arg("o"), py::arg("post_norm"), py::arg("router"),
           py::arg("gate_up"), py::arg("down"), py::arg("top_k"), py::arg("norm_topk_prob"),
           py::arg("size"), py::arg("shared"), py::arg("shared_size"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none())
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward, py::arg("hidden"), py::arg("cos"), py::arg("sin"),
           py::arg("slots"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("kv_cache"),
           py::arg("norm") = py::none(), py::arg("rows") = py::none(),
           py::arg("prompts") = py::none(), py::arg("prompt_tables") = py::none(),
           py::arg("lora_coef") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("set_lora", &DecodeLayers::set_lora, py::arg("layer"), py::arg("slots"));
}

}  // namespace tessera
