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

// A step's LoRA adapters by row (workers/model/lora.py's LoraBatch): coef [R, S] holds a
// row's adapter's scaling in its slot's column, 0 elsewhere; `slots` and `scale` each
// row's slot (-1: none) and scaling, and `present` the slots some row has, read once.
struct LoraRows {
  torch::Tensor coef;
  std::vector<int64_t> slots, present;
  std::vector<float> scale;

  explicit LoraRows(torch::Tensor c) : coef(std::move(c)) {
    const auto f = coef.to(torch::kFloat).contiguous();
    const float* p = f.data_ptr<float>();
    const int64_t R = coef.size(0), S = coef.size(1);
    std::vector<bool> seen(S, false);
    for (int64_t r = 0; r < R; ++r) {
      int64_t slot = -1;
      for (int64_t s = 0; s < S && slot < 0; ++s)
        if (p[r * S + s] != 0.0f) slot = s;
      slots.push_back(slot);
      scale.push_back(slot < 0 ? 0.0f : p[r * S + slot]);
      if (slot >= 0 && !seen[slot]) seen[slot] = true, present.push_back(slot);
    }
  }

  // The same adapters for rows `rows` [S'] of these.
  LoraRows gathered(const torch::Tensor& rows) const {
    return LoraRows(coef.index_select(0, rows));
  }

  // The same adapters for rows [first, first + n) of these.
  LoraRows narrowed(int64_t first, int64_t n) const { return LoraRows(coef.narrow(0, first, n)); }
};

// Asks the cache for the `bytes` from p, a line at a time (a hint: never faults).
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(c + line, 0, 3);
}

// A step of at least this many rows (a prompt's) multiplies each adapter's rows by its
// slot's A and B as GEMMs; fewer rows (decodes) go one by one through their own slot's
// (LoraSlots::add_rows): each present adapter's weights are read once, no other slot's.
constexpr int64_t kLoraGemmRows = 64;

#if TESSERA_DECODE_VEC
// Whether LoraSlots::add_rows takes x and y in T, its slots in U, 16 at a time.
template <typename T, typename U>
constexpr bool kVecLora = kVecRound<T> && (std::is_same_v<U, float> ||
                                           std::is_same_v<U, c10::BFloat16>);
#endif

// A projection's LoRA slots (workers/model/lora.py): a [S * W, in] (each slot's W rows:
// its P parts' lora_A, as PEFT stores them, W / P rows each), b [S * W, out] in T (or
// bfloat16: the fast mode's), or
// undefined (no adapter takes it); ranks [S, P] int64: the rows of each part in use (its
// adapter's rank, 0 where it leaves the part alone); cols [S, P, 2] int64: the output
// columns [start, end) each part's B rows write (zeros elsewhere). Unused rows are zeros.
struct LoraSlots {
  torch::Tensor a, b, ranks, cols;

  // whether slot's adapter leaves this projection alone
  bool idle(int64_t slot) const {
    const int64_t P = ranks.size(1);
    const int64_t* rank = ranks.data_ptr<int64_t>() + slot * P;
    for (int64_t p = 0; p < P; ++p)
      if (rank[p]) return false;
    return true;
  }

  // Queues (side_prefetch.h) the lines add_rows reads for `lora`'s rows: each present
  // slot's A rows in use, then their B rows' columns; returns how many lines.
  int64_t queue_lines(const LoraRows& lora, side::Queue& queue) const {
    if (!a.defined()) return 0;
    const int64_t P = ranks.size(1), W = a.size(0) / lora.coef.size(1), K = a.size(1),
                  N = b.size(1), size = a.element_size();
    const char* ap = static_cast<const char*>(a.data_ptr());
    const char* bp = static_cast<const char*>(b.data_ptr());
    const int64_t* rank_p = ranks.data_ptr<int64_t>();
    const int64_t* col_p = cols.data_ptr<int64_t>();
    int64_t bytes = 0;
    for (const int64_t slot : lora.present)
      for (int64_t p = 0; p < P; ++p) {
        const int64_t first = slot * W + p * (W / P), rank = rank_p[slot * P + p];
        if (rank == 0) continue;
        queue.add(ap + first * K * size, rank * K * size);
        bytes += rank * K * size;
      }
    for (const int64_t slot : lora.present)
      for (int64_t p = 0; p < P; ++p) {
        const int64_t first = slot * W + p * (W / P), rank = rank_p[slot * P + p];
        const int64_t* range = col_p + (slot * P + p) * 2;
        for (int64_t w = first; w < first + rank; ++w) {
          queue.add(bp + (w * N + range[0]) * size, (range[1] - range[0]) * size);
          bytes += (range[1] - range[0]) * size;
        }
      }
    return bytes / 64;
  }

  // y (the projection of x [R, in]) plus each row's adapter's share, scaling * B (A x)
  template <typename T>
  torch::Tensor add(const torch::Tensor& x, torch::Tensor y, const LoraRows* lora) const {
    if (lora == nullptr || !a.defined() || lora->present.empty()) return y;
    const int64_t R = x.size(0), W = a.size(0) / lora->coef.size(1);
    if (R < kLoraGemmRows) {
      if (a.scalar_type() == at::kBFloat16 && !std::is_same<T, c10::BFloat16>::value)
        return add_rows<T, c10::BFloat16>(x.contiguous(), y.contiguous(), *lora, W);
      return add_rows<T, T>(x.contiguous(), y.contiguous(), *lora, W);
    }
    for (const int64_t slot : lora->present) {
      if (idle(slot)) continue;
      std::vector<int64_t> rows;
      for (int64_t r = 0; r < R; ++r)
        if (lora->slots[r] == slot) rows.push_back(r);
      const auto scale = lora->coef.select(1, slot).narrow(0, rows[0], 1).to(a.scalar_type());
      const auto a_s = a.narrow(0, slot * W, W).t(), b_s = b.narrow(0, slot * W, W);
      const int64_t n = static_cast<int64_t>(rows.size());
      const auto delta = [&](const torch::Tensor& xs) {  // in y's dtype
        return at::mm(at::mm(xs.to(a.scalar_type()), a_s).mul_(scale), b_s).to(y.scalar_type());
      };
      if (n == rows.back() - rows[0] + 1) {  // one run of rows (a prompt's)
        y.narrow(0, rows[0], n).add_(delta(x.narrow(0, rows[0], n)));
      } else {
        const auto index = torch::tensor(rows, torch::kInt64);
        y.index_add_(0, index, delta(x.index_select(0, index)));
      }
    }
    return y;
  }

  // add's rows one by one: xa = scale * A_slot x over the rows in use (dot products over
  // `in` in four chains of 16 lanes), then each part's output columns
  // y[n] += sum_w xa[w] B_slot[w, n] over its B rows in use, 16 columns at a time summed
  // in registers; T: x's and y's dtype, U: the slots' (T, or bf16 in the fast mode),
  // summed in float32. A row's numbers never depend on the rows beside it.
  template <typename T, typename U>
  torch::Tensor add_rows(const torch::Tensor& x, torch::Tensor y, const LoraRows& lora,
                         int64_t W) const {
    const int64_t R = x.size(0), K = x.size(1), N = y.size(1), P = ranks.size(1);
    const T* xp = x.data_ptr<T>();
    const U* ap = a.data_ptr<U>();
    const U* bp = b.data_ptr<U>();
    const int64_t* rank_p = ranks.data_ptr<int64_t>();
    const int64_t* col_p = cols.data_ptr<int64_t>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xa(W);
      // a share of a step's rows has these lines asked for ahead (queue_lines) where the
      // kernels drain its queue; otherwise each A row asks for the next while it is
      // read: rows of a few KiB each, short streams that the CPU's prefetcher barely
      // starts on
      const side::Queue& queue = side::queue();
      const bool by_row = queue.empty() || !queue.draining();
      for (int64_t r = begin; r < end; ++r) {
        const int64_t slot = lora.slots[r];
        if (slot < 0 || idle(slot)) continue;
        const T* xr = xp + r * K;
        for (int64_t p = 0; p < P; ++p)
          for (int64_t w = p * (W / P); w < p * (W / P) + rank_p[slot * P + p]; ++w) {
            if (by_row) prefetch_lines(ap + (slot * W + w + 1) * K, K * sizeof(U));
            xa[w] = dot(xr, ap + (slot * W + w) * K, K) * lora.scale[r];
          }
        T* out = yp + r * N;
        for (int64_t p = 0; p < P; ++p) {
          const int64_t first = p * (W / P), last = first + rank_p[slot * P + p];
          const int64_t* range = col_p + (slot * P + p) * 2;  // the part's columns
          int64_t n = range[0];
#if TESSERA_DECODE_VEC
          if constexpr (kVecLora<T, U>) {
            for (; n + 16 <= range[1]; n += 16) {
              F sum = vec16::zero();
              for (int64_t w = first; w < last; ++w)
                sum = vec16::add(sum, vec16::mul(vec16::set1(xa[w]),
                                                 load16<U>(bp + (slot * W + w) * N + n)));
              store16<T>(out + n, vec16::add(load16<T>(out + n), sum));
            }
          }
#endif
          for (; n + 16 <= range[1]; n += 16) {
            float sum[16] = {};
            for (int64_t w = first; w < last; ++w) {
              const U* br = bp + (slot * W + w) * N + n;
              const float c = xa[w];
              for (int j = 0; j < 16; ++j) sum[j] += c * f32(br[j]);
            }
            for (int j = 0; j < 16; ++j) out[n + j] = round_to<T>(f32(out[n + j]) + sum[j]);
          }
          for (; n < range[1]; ++n) {
            float sum = 0.0f;
            for (int64_t w = first; w < last; ++w) sum += xa[w] * f32(bp[(slot * W + w) * N + n]);
            out[n] = round_to<T>(f32(out[n]) + sum);
          }
        }
      }
    });
    return y;
  }

  // sum_k x[k] a[k] in float32: four chains of 16 lanes, added in a fixed order
  template <typename T, typename U>
  static float dot(const T* x, const U* a, int64_t K) {
    float lanes[4][16] = {};
    int64_t k = 0;
#if TESSERA_DECODE_VEC
    if constexpr (kVecLora<T, U>) {
      F chains[4] = {vec16::zero(), vec16::zero(), vec16::zero(), vec16::zero()};
      for (; k + 64 <= K; k += 64)
        for (int c = 0; c < 4; ++c)
          chains[c] = vec16::add(chains[c], vec16::mul(load16<T>(x + k + 16 * c),
                                                       load16<U>(a + k + 16 * c)));
      for (int c = 0; c < 4; ++c) vec16::store(lanes[c], chains[c]);
    }
#endif
    for (; k + 64 <= K; k += 64)
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 16; ++j) lanes[c][j] += f32(x[k + 16 * c + j]) * f32(a[k + 16 * c + j]);
    for (; k + 16 <= K; k += 16)
      for (int j = 0; j < 16; ++j) lanes[0][j] += f32(x[k + j]) * f32(a[k + j]);
    float sum = 0.0f;
    for (int j = 0; j < 16; ++j) sum += (lanes[0][j] + lanes[1][j]) + (lanes[2][j] + lanes[3][j]);
    for (; k < K; ++k) sum += f32(x[k]) * f32(a[k]);
    return sum;
  }
};

// A sparse layer's mixture of experts (workers/model/moe.py's SparseMoE), run by mix()
// (decode_experts.h).
struct Experts {
  Linear router;                      // hidden -> one logit per expert
  std::vector<Linear> gate_up, down;  // each expert's hidden -> 2 size (gate, up), size -> hidden
  int64_t top_k = 1, size = 0;
  bool norm_topk_prob = false;
  std::vector<Linear> shared;  // none, or the shared expert's gate/up, down and gate (-> 1)
  int64_t shared_size = 0;

  // x [R, hidden] in T, contiguous -> the experts' weighted sum [R, hidden] in T
  template <typename T>
  torch::Tensor mix(const torch::Tensor& x) const;
};

struct Layer {
  torch::Tensor input_norm, post_norm;  // [hidden] in T
  Linear qkv, o, gate_up, down;  // gate_up and down unused where `moe`
  torch::Tensor q_norm, k_norm;  // [head_dim] in T (Qwen3's per-head norms), or undefined
  LoraSlots qkv_lora, o_lora, gate_up_lora, down_lora;
  std::shared_ptr<const Experts> moe;  // a sparse layer's experts in place of its MLP
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

  // The next layer, sparse: its MLP is `moe`'s experts (the router, each expert's gate/up
  // and down, and a shared expert's gate/up, down and gate, or none).
  void add_moe_layer(const torch::Tensor& input_norm, const Linear& qkv, const Linear& o,
                     const torch::Tensor& post_norm, const Linear& router,
                     const std::vector<Linear>& gate_up, const std::vector<Linear>& down,
                     int64_t top_k, bool norm_topk_prob, int64_t size,
                     const std::vector<Linear>& shared, int64_t shared_size,
                     const c10::optional<torch::Tensor>& q_norm,
                     const c10::optional<torch::Tensor>& k_norm) {
    const int64_t E = static_cast<int64_t>(gate_up.size());
    TORCH_CHECK(E > 0 && down.size() == gate_up.size() && top_k >= 1 && top_k <= E && size > 0,
                "DecodeLayers: a sparse layer needs gate/up and down for each of its experts, "
                "1 <= top_k <= experts and their size");
    TORCH_CHECK(shared.empty() || (shared.size() == 3 && shared_size > 0),
                "DecodeLayers: a shared expert is its gate/up, down and gate, and its size");
    add_layer(input_norm, qkv, o, post_norm, Linear(), Linear(), q_norm, k_norm);
    layers_.back().moe = std::make_shared<const Experts>(
        Experts{router, gate_up, down, top_k, size, norm_topk_prob, shared, shared_size});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // layer l's LoRA slots (workers/model/lora.py's LoraSlots: each projection's a, b,
  // ranks and cols, sharing their storage), in the order qkv, o, gate_up, down
  void set_lora(int64_t l, const std::vector<torch::Tensor>& slots) {
    TORCH_CHECK(l >= 0 && l < num_layers() && slots.size() == 16,
                "DecodeLayers: set_lora takes a layer and 4 (a, b, ranks, cols) sets");
    Layer& layer = layers_[l];
    LoraSlots* all[] = {&layer.qkv_lora, &layer.o_lora, &layer.gate_up_lora, &layer.down_lora};
    for (int i = 0; i < 4; ++i) {
      const auto& a = slots[4 * i];
      const auto& b = slots[4 * i + 1];
      const auto& ranks = slots[4 * i + 2];
      const auto& cols = slots[4 * i + 3];
      TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) && a.is_contiguous() &&
                      b.is_contiguous() && b.scalar_type() == a.scalar_type() &&
                      (a.scalar_type() == layer.input_norm.scalar_type() ||
                       a.scalar_type() == at::kBFloat16),
                  "DecodeLayers: LoRA slots must be contiguous [n, in] and [n, out] in the "
                  "model's dtype or bfloat16");
      TORCH_CHECK(ranks.dim() == 2 && ranks.is_contiguous() &&
                      ranks.scalar_type() == torch::kInt64 && a.size(0) % ranks.numel() == 0,
                  "DecodeLayers: LoRA ranks must be contiguous int64 [slots, parts]");
      TORCH_CHECK(cols.dim() == 3 && cols.is_contiguous() && cols.scalar_type() == torch::kInt64 &&
                      cols.size(0) == ranks.size(0) && cols.size(1) == ranks.size(1) &&
                      cols.size(2) == 2,
                  "DecodeLayers: LoRA cols must be contiguous int64 [slots, parts, 2]");
      *all[i] = LoraSlots{a, b, ranks, cols};
    }
  }

  // hidden: float32 [B, hidden] (the embedded tokens; updated in place and returned, or
  // with `rows`, rows [S] of it through the final norm `norm` [hidden] (in T): [S, hidden]
  // in T, what the LM head takes; then the last layer goes on past its attention with
  // those rows only, and hidden is left as that layer's attention found it);
  // cos/sin [B, D] in T; slots [B] (cache row each token's K/V goes to);
  // kv_cache [layers, 2, blocks, block_size, H_kv, D] in T (or float16 under a float32
  // model: the fast mode). The first Dn rows are decodes: seq_lens [Dn] (tokens each
  // attends to, its new one included), block_tables [Dn, W]. `prompts` [P, 3] (first
  // row, rows, seq_len: a causal chunk, its rows consecutive, the last at cache index
  // seq_len - 1) with `prompt_tables` [P, W'] cover the rest, in order. `lora_coef`
  // [B, S] in T: each row's LoRA adapter's scaling in its slot's column (set_lora's
  // slots), 0 elsewhere; a share of the rows (run_in_shares) takes its rows' adapters.
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& slots, const torch::Tensor& seq_lens,
                        const torch::Tensor& block_tables, const torch::Tensor& kv_cache,
                        const c10::optional<torch::Tensor>& norm,
                        const c10::optional<torch::Tensor>& rows,
                        const c10::optional<torch::Tensor>& prompts,
                        const c10::optional<torch::Tensor>& prompt_tables,
                        const c10::optional<torch::Tensor>& lora_coef) const;

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
                    const std::function<int64_t(int64_t, int64_t)>* keep = nullptr,
                    const LoraRows* lora = nullptr) const;
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
                              bool handover, const LoraRows* lora) const;
  template <typename T, typename C>
  torch::Tensor run_split(int64_t shares, torch::Tensor& hidden, const torch::Tensor& cos,
                          const torch::Tensor& sin, const int64_t* slots, int64_t D,
                          const int64_t* seq_lens, const int64_t* tables, int64_t width,
                          const std::vector<Prompt>& prompts, const torch::Tensor& kv_cache,
                          const torch::Tensor* rows, bool handover,
                          const LoraRows* lora) const;
  template <typename C>
  void queue_next_kv(int64_t l, int64_t B, const C* k_cache, const C* v_cache,
                     int64_t layer_stride, const int64_t* seq_lens, const int64_t* tables,
                     int64_t width, int64_t block_size, int64_t decodes,
                     const LoraRows* lora) const;

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
