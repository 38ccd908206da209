// The native decode stack's model (decode_layers.cpp): a layer's projections as
// workers/model/llama.py holds them (Linear, through ATen or this extension's packed GGUF
// kernels), its norms (Layer), a step's prompt chunks (Prompt), and the DecodeLayers class
// that runs every layer of a step in one call. Its members are defined, by concern, in
// decode_layers.cpp (the entry point), decode_shares.h, decode_layer_loop.h and
// decode_attention.h. Included inside decode_layers.cpp's anonymous namespace, after the
// declarations of the kernels Linear calls.
#pragma once

constexpr int64_t kDense = 0;  // weight [in, out] in T
constexpr int64_t kGguf = 1;   // packed GGUF blocks, float32 activations (gguf_mm)
constexpr int64_t kInt4 = 2;   // torch's int4 layout up to int4_rows rows, else dense
constexpr int64_t kQ4 = 3;     // q4_bf16_mm's layout (int4: nibbles, int4_scales_zeros: d,
                               // mins: m) up to int4_rows rows, else dense
constexpr int64_t kQ4Exact = 4;  // that layout in float32 (q4_f32_mm) up to int4_rows
                                 // rows, else dequantised (q4_f32_dense) for dense_f32_mm
constexpr int64_t kKQuant = 5;   // packed K-quant super-blocks (qs: the file's bytes),
                                 // float32 activations (kquant_mm)
constexpr int64_t kParts = 6;    // row groups of other kinds (parts), outputs side by side
constexpr int64_t kKQuantInt8 = 7;  // those super-blocks times x quantised to int8 per 256
                                    // (kquant_q8_mm: the int8 mode)

// One projection, as workers/model/llama.py's Linear holds it.
struct Linear {
  int64_t kind = kDense;
  torch::Tensor weight;  // dense [in, out]; for kInt4 / kQ4 the weight above int4_rows rows
  torch::Tensor qs, scales;
  c10::optional<torch::Tensor> mins;
  int64_t qtype = 0;
  torch::Tensor int4, int4_scales_zeros;
  int64_t int4_rows = 0;
  c10::optional<torch::Tensor> bias;
  std::vector<Linear> parts;  // kParts: each a group of output rows (a Q4_K_M's q/k, v)

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == kParts) {
      std::vector<torch::Tensor> ys;
      for (const Linear& part : parts) ys.push_back(part(x));
      auto y = at::cat(ys, 1);
      return bias ? y.add_(*bias) : y;
    }
    if (kind == kKQuant || kind == kKQuantInt8) {
      auto y = kind == kKQuant ? kquant_mm(x, qs, qtype, -1) : kquant_q8_mm(x, qs, qtype);
      return bias ? y.add_(*bias) : y;
    }
    if (kind == kGguf) {
      auto y = gguf_mm(x, qs, scales, mins, qtype);
      return bias ? y.add_(*bias) : y;
    }
    if (kind == kQ4 && x.size(0) <= int4_rows) {
      auto y = q4_bf16_mm(x, int4, int4_scales_zeros, mins, qtype);
      return bias ? y.add_(*bias) : y;
    }
    if (kind == kQ4Exact && x.size(0) <= int4_rows) {
      auto y = q4_f32_mm(x, int4, int4_scales_zeros, mins, qtype);
      return bias ? y.add_(*bias) : y;
    }
    if (kind == kQ4Exact)  // more rows: the same weights dequantised for a dense GEMM
      return dense_f32_mm(x, q4_f32_dense(int4, int4_scales_zeros, mins, qtype), bias);
    if (kind == kInt4 && x.size(0) <= int4_rows) {
      auto y = at::_weight_int4pack_mm_for_cpu(x, int4, 32, int4_scales_zeros);
      return bias ? y.add_(*bias) : y;
    }
    return bias ? at::addmm(*bias, x, weight) : at::mm(x, weight);
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;  // [hidden] in T
  Linear qkv, o, gate_up, down;
  torch::Tensor q_norm, k_norm;  // [head_dim] in T (Qwen3's per-head norms), or undefined
};

// A causal chunk of a sequence's tokens (a prompt, or a piece of one): rows first ..
// first + rows - 1 of the step, the last at cache index seq_len - 1; its block table.
struct Prompt {
  int64_t first, rows, seq_len;
  const int64_t* table;
};

// DecodeLayers::row_shares' answer where a step's rows run as one: the threads share each
// product.
constexpr int64_t kOneRun = 1;

class DecodeLayers {
 public:
  // window: every layer's sliding window (a row attends to its last `window` cache
  // indices, its own included), 0 for none; rotary_dim: the leading dimensions of each
  // head that RoPE rotates (partial rotary), 0 for all of them
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double eps, double scale, int64_t window, int64_t rotary_dim)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        intermediate_(intermediate),
        window_(window),
        rotary_(rotary_dim ? rotary_dim : head_dim),
        eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "DecodeLayers: heads must group over KV heads");
    TORCH_CHECK(head_dim % 2 == 0, "DecodeLayers: head_dim must be even");
    TORCH_CHECK(window >= 0, "DecodeLayers: window must be >= 0");
    TORCH_CHECK(rotary_ % 2 == 0 && rotary_ <= head_dim,
                "DecodeLayers: rotary_dim must be even and at most head_dim");
  }

  // q_norm / k_norm: each q and k head RMS-normed by these [head_dim] weights before
  // RoPE (Qwen3), or none
  void add_layer(const torch::Tensor& input_norm, const Linear& qkv, const Linear& o,
                 const torch::Tensor& post_norm, const Linear& gate_up, const Linear& down,
                 const c10::optional<torch::Tensor>& q_norm,
                 const c10::optional<torch::Tensor>& k_norm) {
    TORCH_CHECK(input_norm.dim() == 1 && post_norm.sizes() == input_norm.sizes() &&
                    (layers_.empty() || input_norm.numel() == layers_[0].input_norm.numel()),
                "DecodeLayers: every layer's norms must be [hidden]");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value() &&
                    (!q_norm.has_value() || (q_norm->numel() == head_dim_ &&
                                             k_norm->numel() == head_dim_ &&
                                             q_norm->scalar_type() == input_norm.scalar_type())),
                "DecodeLayers: q/k norms must both be [head_dim] in the model's dtype");
    layers_.push_back(Layer{input_norm.contiguous(), post_norm.contiguous(), qkv, o, gate_up,
                            down, q_norm ? q_norm->contiguous() : torch::Tensor(),
                            k_norm ? k_norm->contiguous() : torch::Tensor()});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden: float32 [B, hidden] (the embedded tokens; updated in place and returned, or
  // with `rows`, rows [S] of it through the final norm `norm` [hidden] (in T): [S, hidden]
  // in T, what the LM head takes; then the last layer goes on past its attention with
  // those rows only, and hidden is left as that layer's attention found it);
  // cos/sin [B, D] in T; slots [B] (cache row each token's K/V goes to);
  // kv_cache [layers, 2, blocks, block_size, H_kv, D] in T (or float16 under a float32
  // model: the fast mode). The first Dn rows are decodes: seq_lens [Dn] (tokens each
  // attends to, its new one included), block_tables [Dn, W]. `prompts` [P, 3] (first
  // row, rows, seq_len: a causal chunk, its rows consecutive, the last at cache index
  // seq_len - 1) with `prompt_tables` [P, W'] cover the rest, in order.
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slots, const torch::Tensor& seq_lens,
                        const torch::Tensor& block_tables, const torch::Tensor& kv_cache,
                        const c10::optional<torch::Tensor>& norm,
                        const c10::optional<torch::Tensor>& rows,
                        const c10::optional<torch::Tensor>& prompts,
                        const c10::optional<torch::Tensor>& prompt_tables) const;

 private:
  // ---- the layer loop (decode_layer_loop.h)
  template <typename T>
  torch::Tensor final_norm(const torch::Tensor& rows, const torch::Tensor& norm) const;
  template <typename T, typename C>
  torch::Tensor run(torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                    const int64_t* slots, int64_t decodes, const int64_t* seq_lens,
                    const int64_t* tables, int64_t width, const std::vector<Prompt>& prompts,
                    const torch::Tensor& kv_cache, const torch::Tensor* rows,
                    bool share = false, int64_t first_layer = 0,
                    const std::function<int64_t(int64_t, int64_t)>* keep = nullptr) const;
  static torch::Tensor gather_rows(const torch::Tensor& x, const torch::Tensor& rows);
  template <typename T>
  static void add_residual(float* h, const torch::Tensor& y, int64_t n);

  // ---- a step's decodes in shares of rows, one per thread (decode_shares.h)
  int64_t row_shares(int64_t D, int64_t B, const int64_t* slots, const int64_t* seq_lens,
                     const int64_t* tables, int64_t width, int64_t block_size,
                     const torch::Tensor* rows, bool* linked) const;
  template <typename T, typename C>
  torch::Tensor run_in_shares(int64_t shares, torch::Tensor& hidden, const torch::Tensor& cos,
                              const torch::Tensor& sin, const int64_t* slots,
                              const int64_t* seq_lens, const int64_t* tables, int64_t width,
                              const torch::Tensor& kv_cache, const torch::Tensor* rows,
                              bool handover) const;
  template <typename T, typename C>
  torch::Tensor run_split(int64_t shares, torch::Tensor& hidden, const torch::Tensor& cos,
                          const torch::Tensor& sin, const int64_t* slots, int64_t D,
                          const int64_t* seq_lens, const int64_t* tables, int64_t width,
                          const std::vector<Prompt>& prompts, const torch::Tensor& kv_cache,
                          const torch::Tensor* rows, bool handover) const;
  template <typename C>
  void queue_next_kv(int64_t l, int64_t B, const C* k_cache, const C* v_cache,
                     int64_t layer_stride, const int64_t* seq_lens, const int64_t* tables,
                     int64_t width, int64_t block_size, int64_t decodes) const;

  // ---- the paged cache and attention (decode_attention.h)
  template <typename T, typename C>
  static void store_kv(const T* src, C* dst, int64_t n);
  template <typename T, typename C>
  void attend(const T* qkv, int64_t row, const C* k_cache, const C* v_cache,
              const int64_t* seq_lens, const int64_t* tables, int64_t width, int64_t block_size,
              int64_t B, T* out) const;
  template <typename T, typename C, int NV>
  void attend_all(const T* qkv, int64_t row, const C* k_cache, const C* v_cache,
                  const int64_t* seq_lens, const int64_t* tables, int64_t width,
                  int64_t block_size, int64_t B, T* out) const;
  // a decode row of seq_len tokens attends from this cache index on (its window's start)
  int64_t skipped(int64_t seq_len) const {
    return window_ ? std::max<int64_t>(0, seq_len - window_) : 0;
  }
  int64_t prompt_skip(const Prompt& prompt) const;
  c10::optional<torch::Tensor> causal_bias(const Prompt& prompt,
                                           const torch::TensorOptions& options) const;
  void attend_prompt(const torch::Tensor& qkv, const torch::Tensor& cache, const Prompt& prompt,
                     const c10::optional<torch::Tensor>& mask, torch::Tensor& attn) const;

  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_, window_, rotary_;
  float eps_, scale_;
  std::vector<Layer> layers_;
};
