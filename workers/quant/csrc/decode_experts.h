// A sparse layer's mixture of experts in the native decode stack (decode_layers.cpp), as
// workers/model/moe.py's SparseMoE computes it in the model's dtype T: the router's
// logits softmaxed in float32 and the top_k kept (torch's own softmax and topk, so ties
// go as they go there), renormalised where norm_topk_prob, rounded to T; each expert
// that some row chose multiplies those rows at once (gate/up, SwiGLU as the dense
// layers' swiglu_row, down); each output times its weight, rounded to T, is added into
// its row in expert order (0 + a + b ..., each sum rounded to T, as moe.py's index_add_);
// then a shared expert, where there is one, through the same ATen ops as moe.py.
// Included inside decode_layers.cpp's anonymous namespace, after decode_stack.h.
#pragma once

// x [R, hidden] in T, contiguous (the post-attention norm's rows) -> [R, hidden] in T
template <typename T>
torch::Tensor Experts::mix(const torch::Tensor& x) const {
  const int64_t R = x.size(0), H = x.size(1), E = static_cast<int64_t>(gate_up.size());
  const auto probs = at::softmax(router(x).to(at::kFloat), -1);
  TORCH_CHECK(probs.size(1) == E, "DecodeLayers: the router scores ", probs.size(1),
              " experts, the layer has ", E);
  auto top = at::topk(probs, top_k, -1);
  auto weights = std::get<0>(top);
  if (norm_topk_prob) weights = weights / weights.sum(-1, true);
  weights = weights.to(x.scalar_type()).contiguous();
  const auto chosen = std::get<1>(top).contiguous();
  const int64_t* id = chosen.data_ptr<int64_t>();
  const T* w = weights.data_ptr<T>();
  // each expert's (row, rank) pairs p = row * top_k + rank, in row order
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < R * top_k; ++p) pairs[id[p]].push_back(p);
  auto out = torch::zeros({R, H}, x.options());
  T* o = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& mine = pairs[e];
    const int64_t n = static_cast<int64_t>(mine.size());
    if (n == 0) continue;
    auto rows = torch::empty({n, H}, x.options());
    T* rp = rows.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(rp + i * H, xp + (mine[i] / top_k) * H, H * sizeof(T));
    const auto gu = gate_up[e](rows).contiguous();
    TORCH_CHECK(gu.size(1) == 2 * size, "DecodeLayers: expert ", e, "'s gate/up gives ",
                gu.size(1), " features, not ", 2 * size);
    auto act = torch::empty({n, size}, x.options());
    const T* g = gu.data_ptr<T>();
    T* a = act.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i)
      swiglu_row<T>(g + i * 2 * size, g + i * 2 * size + size, a + i * size, size);
    const auto y = down[e](act).contiguous();
    TORCH_CHECK(y.size(1) == H, "DecodeLayers: expert ", e, "'s down gives ", y.size(1),
                " features, not ", H);
    const T* yp = y.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      const float weight = f32(w[mine[i]]);
      T* row = o + (mine[i] / top_k) * H;
      const T* yi = yp + i * H;
      for (int64_t h = 0; h < H; ++h)
        row[h] = round_to<T>(f32(row[h]) + f32(round_to<T>(f32(yi[h]) * weight)));
    }
  }
  if (shared.empty()) return out;
  const auto gu = shared[0](x).contiguous();  // the shared expert: gate/up, down, its gate
  auto act = torch::empty({R, shared_size}, x.options());
  for (int64_t r = 0; r < R; ++r)
    swiglu_row<T>(gu.data_ptr<T>() + r * 2 * shared_size,
                  gu.data_ptr<T>() + r * 2 * shared_size + shared_size,
                  act.data_ptr<T>() + r * shared_size, shared_size);
  return out + at::sigmoid(shared[2](x)) * shared[1](act);
}
