// The native decode stack's layer loop (DecodeLayers::run): each layer's input norm, the
// qkv projection, RoPE and the K/V cache writes, attention, the o projection and the
// residual, the post-attention norm, gate/up, SwiGLU, down and the residual; and the final
// norm of the rows whose logits the step wants. Included inside decode_layers.cpp's
// anonymous namespace, after decode_stack.h.
#pragma once

// float32 rows [S, H] through the final norm: [S, H] in T (rms_norm, as every layer's
// norm here)
template <typename T>
inline torch::Tensor DecodeLayers::final_norm(const torch::Tensor& rows,
                                              const torch::Tensor& norm) const {
  const int64_t S = rows.size(0), H = rows.size(1);
  auto out = torch::empty({S, H}, rows.options().dtype(norm.scalar_type()));
  const auto weight = norm.contiguous();
  rms_norm<T>(rows.data_ptr<float>(), weight.data_ptr<T>(), out.data_ptr<T>(), S, H, eps_);
  return out;
}

// rows [S] of x [B, F], gathered: [S, F]
inline torch::Tensor DecodeLayers::gather_rows(const torch::Tensor& x,
                                               const torch::Tensor& rows) {
  const int64_t S = rows.numel(), F = x.size(1);
  auto out = torch::empty({S, F}, x.options());
  const auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  const int64_t bytes = F * static_cast<int64_t>(x.element_size());
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) std::memcpy(dst + i * bytes, src + r[i] * bytes, bytes);
  return out;
}

// h[0..n) += y (a projection back to the residual stream, in T)
template <typename T>
inline void DecodeLayers::add_residual(float* h, const torch::Tensor& y, int64_t n) {
  TORCH_CHECK(y.numel() == n, "DecodeLayers: a projection back to the residual gives ",
              y.numel(), " values, not ", n);
  const auto yc = y.contiguous();
  const T* p = yc.data_ptr<T>();
  at::parallel_for(0, n, kRowGrain * 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) h[i] += f32(p[i]);
  });
}

// T: the model's dtype (activations between the matmuls); C: the KV cache's (T, or
// float16 under a float32 model: the fast mode). Updates hidden in place; with `rows`
// [S], the last layer goes on past its attention with those rows only (a prompt's
// other rows need only their K/V, written by then) and returns them, float32 [S, H].
// Every kernel's row is independent of the others, so the rows kept get the numbers
// they would have had with all rows, up to the kernels chosen by row count (the exact
// mode's GEMM above exact_row_limit rows, torch's int4 layout's dense copy).
template <typename T, typename C>
inline torch::Tensor DecodeLayers::run(
    torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
    const int64_t* slots, int64_t decodes, const int64_t* seq_lens, const int64_t* tables,
    int64_t width, const std::vector<Prompt>& prompts, const torch::Tensor& kv_cache,
    const torch::Tensor* rows, bool share, int64_t first_layer,
    const std::function<int64_t(int64_t, int64_t)>* keep, const LoraRows* lora) const {
  int64_t B = hidden.size(0);
  const int64_t H = hidden.size(1), D = head_dim_;
  const int64_t q_size = num_heads_ * D, kv_size = num_kv_heads_ * D;
  const int64_t block_size = kv_cache.size(3);
  const auto options = hidden.options().dtype(layers_[0].input_norm.scalar_type());
  torch::Tensor stream = hidden;  // the residual rows the layer goes on with
  float* h = hidden.data_ptr<float>();
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = sin.data_ptr<T>();
  auto normed = torch::empty({B, H}, options);
  auto attn = torch::empty({B, q_size}, options);
  auto swiglu = torch::empty({B, intermediate_}, options);
  std::vector<c10::optional<torch::Tensor>> masks;  // each prompt's, for every layer
  for (const Prompt& prompt : prompts) masks.push_back(causal_bias(prompt, options));
  const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
  C* cache = kv_cache.data_ptr<C>();
  // a share's thread alone (run_in_shares) fetches the next layer's K/V as it goes; its
  // queue is emptied however run() ends (it points into this step's cache)
  const bool prefetch = share && side::kv_prefetch_wanted().load();
  struct Emptied {
    bool on;
    ~Emptied() {
      if (on) side::queue().clear();
    }
  } emptied{prefetch};
  c10::optional<LoraRows> kept_lora;  // the adapters of the rows `keep` left
  for (int64_t l = first_layer; l < num_layers(); ++l) {
    if (keep != nullptr && l > first_layer) {  // single rows: the first n go on here
      const int64_t n = (*keep)(l, B);
      if (n < B) {
        if (lora != nullptr) {
          kept_lora = lora->narrowed(0, n);
          lora = &*kept_lora;
        }
        B = decodes = n;
        stream = hidden = hidden.narrow(0, 0, n);
        normed = normed.narrow(0, 0, n);
        attn = attn.narrow(0, 0, n);
        swiglu = swiglu.narrow(0, 0, n);  // the queue still fetches all: the same L3
      }
    }
    const Layer& layer = layers_[l];
    C* k_cache = cache + l * layer_stride;
    C* v_cache = k_cache + kv_stride;
    rms_norm<T>(h, layer.input_norm.data_ptr<T>(), normed.data_ptr<T>(), B, H, eps_);
    const torch::Tensor qkv =
        layer.qkv_lora.add<T>(normed, layer.qkv(normed), lora).contiguous();  // [B, q + 2 kv]
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "DecodeLayers: layer ", l,
                "'s qkv projection gives ", qkv.size(1), " features, not ", q_size + 2 * kv_size);
    T* qkv_p = qkv.data_ptr<T>();
    const int64_t row = qkv.size(1);
    at::parallel_for(0, B, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {  // each token its own cache row
        T* r = qkv_p + b * row;
        if (layer.q_norm.defined()) {  // Qwen3: each q and k head normed before RoPE
          head_norms<T>(r, num_heads_, D, layer.q_norm.data_ptr<T>(), eps_);
          head_norms<T>(r + q_size, num_kv_heads_, D, layer.k_norm.data_ptr<T>(), eps_);
        }
        rotate<T>(r, num_heads_ + num_kv_heads_, D, rotary_, cos_p + b * rotary_,
                  sin_p + b * rotary_);
        store_kv(r + q_size, k_cache + slots[b] * kv_size, kv_size);
        store_kv(r + q_size + kv_size, v_cache + slots[b] * kv_size, kv_size);
      }
    });
    attend<T, C>(qkv_p, row, k_cache, v_cache, seq_lens, tables, width, block_size, decodes,
                 attn.data_ptr<T>());
    if (prefetch)
      queue_next_kv(l, B, k_cache, v_cache, layer_stride, seq_lens, tables, width, block_size,
                    decodes, lora);
    for (size_t i = 0; i < prompts.size(); ++i)
      attend_prompt(qkv, kv_cache[l], prompts[i], masks[i], attn);
    int64_t R = B;  // rows past the attention
    c10::optional<LoraRows> lora_rows;  // their adapters, with `rows`
    if (rows != nullptr && l + 1 == num_layers()) {
      R = rows->numel();
      stream = gather_rows(hidden, *rows);
      h = stream.data_ptr<float>();
      attn = gather_rows(attn, *rows);
      normed = normed.narrow(0, 0, R);
      swiglu = swiglu.narrow(0, 0, R);
      if (lora != nullptr) {
        lora_rows = lora->gathered(*rows);
        lora = &*lora_rows;
      }
    }
    add_residual<T>(h, layer.o_lora.add<T>(attn, layer.o(attn), lora), R * H);
    rms_norm<T>(h, layer.post_norm.data_ptr<T>(), normed.data_ptr<T>(), R, H, eps_);
    if (layer.moe) {  // a sparse layer: its experts in place of the MLP
      add_residual<T>(h, layer.moe->template mix<T>(normed.narrow(0, 0, R)), R * H);
      continue;
    }
    const torch::Tensor gate_up =
        layer.gate_up_lora.add<T>(normed, layer.gate_up(normed), lora).contiguous();  // [B, 2 I]
    TORCH_CHECK(gate_up.size(1) == 2 * intermediate_, "DecodeLayers: layer ", l,
                "'s gate/up projection gives ", gate_up.size(1), " features, not ",
                2 * intermediate_);
    const T* gu = gate_up.data_ptr<T>();
    T* s = swiglu.data_ptr<T>();
    at::parallel_for(0, R, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const T* gate = gu + b * 2 * intermediate_;
        swiglu_row<T>(gate, gate + intermediate_, s + b * intermediate_, intermediate_);
      }
    });
    add_residual<T>(h, layer.down_lora.add<T>(swiglu, layer.down(swiglu), lora), R * H);
  }
  return stream;
}
