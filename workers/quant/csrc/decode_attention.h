// Attention in the native decode stack (decode_layers.cpp): the K/V cache writes, each
// decode row's attention over the paged cache read in place (no gather), and a prompt
// chunk's through torch's CPU flash kernel. Scores, max, exp and sums in float32, the
// output rounded to T. Only the order of float sums and the last bits of exp (a ~2 ulp
// polynomial, as torch's CPU kernels use vectorised approximations) differ from the
// Python path. Included inside decode_layers.cpp's anonymous namespace, after
// decode_stack.h.
#pragma once

// What splitting attention between threads counts for a row besides its context tokens
// (its query heads' setup and output), in tokens.
constexpr int64_t kRowCost = 8;

// x[i] = e^(x[i] - shift) for i < n; returns their sum
inline float exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if TESSERA_DECODE_VEC
  const F s = vec16::set1(shift);
  F acc = vec16::zero();
  for (; i + 16 <= n; i += 16) {
    const F e = vec16::exp(vec16::sub(vec16::load(x + i), s));
    vec16::store(x + i, e);
    acc = vec16::add(acc, e);
  }
  if (i < n) {  // the last n - i values through a 16-lane buffer, its other lanes unused
    const int rest = static_cast<int>(n - i);
    float tail[16] = {0};
    std::copy(x + i, x + n, tail);
    const F e = vec16::exp(vec16::sub(vec16::load(tail), s));
    vec16::store(tail, e);
    std::copy(tail, tail + rest, x + i);
    acc = vec16::add(acc, vec16::select(vec16::first(rest), vec16::zero(), e));
    i = n;
  }
  sum = vec16::reduce_add(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// acc[0..n) += p * v[0..n)
inline void axpy(float p, const float* v, float* acc, int64_t n) {
  int64_t i = 0;
#if TESSERA_DECODE_VEC
  const F pv = vec16::set1(p);
  for (; i + 16 <= n; i += 16)
    vec16::store(acc + i, vec16::fmadd(pv, vec16::load(v + i), vec16::load(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * v[i];
}

// Calls row(p, t - skip) for each token t = skip .. n-1 of a sequence in a paged cache (a
// sliding window skips the tokens before it), p its `values` elements of this head:
// `cache` points at this head's first element of block 0, block j of the sequence is
// table[j], and a token's row is kv_size apart from the next in its block. Each token's
// row of the next block is fetched a block ahead: a block's rows are too few for the
// hardware prefetcher to follow the jump to the next (scattered) block.
template <typename C, typename Row>
inline void for_each_row(const C* cache, const int64_t* table, int64_t skip, int64_t n,
                         int64_t block_size, int64_t kv_size, int64_t values, const Row& row) {
  const int64_t block_stride = block_size * kv_size;
  const int64_t blocks = (n + block_size - 1) / block_size;
  const int64_t bytes = values * static_cast<int64_t>(sizeof(C));
  for (int64_t j = skip / block_size, t = skip; t < n; ++j) {
    const int64_t offset = (t - j * block_size) * kv_size;  // 0 past the first block
    const C* p = cache + table[j] * block_stride + offset;
    const char* ahead = reinterpret_cast<const char*>(
        j + 1 < blocks ? cache + table[j + 1] * block_stride + offset : p);
    for (const int64_t stop = std::min(n, (j + 1) * block_size); t < stop;
         ++t, p += kv_size, ahead += kv_size * sizeof(C)) {
      for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(ahead + byte);
      row(p, t - skip);
    }
  }
}

#if TESSERA_DECODE_VEC
// G query heads q [G, D] (float32, D == 16 * NV) sharing one KV head attend over a
// sequence's cached tokens skip .. n-1 (in the cache's dtype C); out [G, D] in T. k_cache / v_cache
// point at this KV head's first element of block 0; a token's row is kv_size apart from
// the next in its block. Each K and V row is read once for the G heads and kept in NV
// registers; each head's V accumulator stays in registers over the whole sequence.
// Scores (q . k * scale, into scores [G, n - skip]) go 16 tokens at a time: each token's NV
// products are one vector of 16 partial sums, and vec16::lane_sums folds 16 tokens' vectors
// at once. A row's numbers depend only on its own q and cache, never on the batch.
template <typename T, typename C, int NV, int G>
void attend_heads(const float* q, const C* k_cache, const C* v_cache, const int64_t* table,
                  int64_t skip, int64_t end, int64_t block_size, int64_t kv_size, float scale,
                  float* scores, T* out) {
  constexpr int64_t D = 16 * NV;
  const int64_t n = end - skip;  // tokens attended to
  F part[G][16];
  int64_t first = 0;  // the token of part[.][0]
  int filled = 0;
  const auto flush = [&]() {
    for (int g = 0; g < G; ++g) {
      for (int j = filled; j < 16; ++j) part[g][j] = vec16::zero();
      const F s = vec16::mul(vec16::lane_sums(part[g]), vec16::set1(scale));
      if (filled == 16) {
        vec16::store(scores + g * n + first, s);
      } else {
        float lanes[16];
        vec16::store(lanes, s);
        std::copy(lanes, lanes + filled, scores + g * n + first);
      }
    }
    first += filled;
    filled = 0;
  };
  for_each_row(k_cache, table, skip, end, block_size, kv_size, D, [&](const C* k, int64_t) {
    F kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = load16<C>(k + 16 * i);
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      F a = vec16::mul(vec16::load(qg), kv[0]);
      for (int i = 1; i < NV; ++i) a = vec16::fmadd(vec16::load(qg + 16 * i), kv[i], a);
      part[g][filled] = a;
    }
    if (++filled == 16) flush();
  });
  if (filled) flush();
  float sums[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float mx = sg[0];
    int64_t t = 0;
    if (n >= 16) {
      F m = vec16::load(sg);
      for (t = 16; t + 16 <= n; t += 16) m = vec16::max(m, vec16::load(sg + t));
      mx = vec16::reduce_max(m);
    }
    for (; t < n; ++t) mx = std::max(mx, sg[t]);
    sums[g] = exp_shifted(sg, n, mx);
  }
  F acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = vec16::zero();
  for_each_row(v_cache, table, skip, end, block_size, kv_size, D, [&](const C* v, int64_t t) {
    F vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16<C>(v + 16 * i);
    for (int g = 0; g < G; ++g) {
      const F p = vec16::set1(scores[g * n + t]);
      for (int i = 0; i < NV; ++i) acc[g][i] = vec16::fmadd(p, vv[i], acc[g][i]);
    }
  });
  for (int g = 0; g < G; ++g) {
    const F inv = vec16::set1(1.f / sums[g]);
    T* o = out + g * D;
    for (int i = 0; i < NV; ++i) {
      const F r = vec16::mul(acc[g][i], inv);
      if constexpr (std::is_same_v<T, float>) {
        vec16::store(o + 16 * i, r);
      } else {
        float lanes[16];
        vec16::store(lanes, r);
        for (int e = 0; e < 16; ++e) o[16 * i + e] = round_to<T>(lanes[e]);
      }
    }
  }
}

// Query heads attend_heads takes at once: their V accumulators (G * NV vectors) stay in
// registers. AVX-512: G * NV <= 16, half of the 32 zmm. AVX2: G * NV <= 8, i.e. all 16
// ymm (a 16-lane vector is two), so the K/V row and the weight spill. One head at a time
// at head_dim 64 (no spill, each K/V row read three times for SmolLM2's 3 heads per KV
// head) measured the same on a Zen 3 EPYC: attention 14.9% of a 64-row decode step's
// cycles against 15.1% (perf).
constexpr int heads_at_once(int nv) {
  return TESSERA_VEC16 == 512 ? (nv <= 4 ? 4 : nv <= 8 ? 2 : 1) : (nv <= 2 ? 4 : nv <= 4 ? 2 : 1);
}
#endif

// One (sequence, KV head) attention task on any CPU and head_dim D: the `group` query
// heads q [group, D] (float32) sharing this KV head attend over the sequence's cached
// tokens skip .. end-1 (in the cache's dtype C); out [group, D] in T. Laid out as
// attend_heads above; scores go to scores [group, end - skip], acc [group, D] and
// buf [D + group] are scratch.
template <typename T, typename C>
void attend_task(const float* q, int64_t group, int64_t D, const C* k_cache, const C* v_cache,
                 const int64_t* table, int64_t skip, int64_t end, int64_t block_size,
                 int64_t kv_size, float scale, float* scores, float* acc, float* buf, T* out) {
  float* sums = buf + D;  // [group] after the D floats of row scratch
  const int64_t n = end - skip;
  for_each_row(k_cache, table, skip, end, block_size, kv_size, D, [&](const C* k, int64_t t) {
    for (int64_t g = 0; g < group; ++g) {
      float sum = 0.f;
      for (int64_t i = 0; i < D; ++i) sum += q[g * D + i] * f32(k[i]);
      scores[g * n + t] = sum * scale;
    }
  });
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float mx = sg[0];
    for (int64_t t = 1; t < n; ++t) mx = std::max(mx, sg[t]);
    sums[g] = exp_shifted(sg, n, mx);
  }
  for_each_row(v_cache, table, skip, end, block_size, kv_size, D, [&](const C* v, int64_t t) {
    to_float<C>(v, buf, D);
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + t], buf, acc + g * D, D);
  });
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / sums[g];
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = round_to<T>(acc[g * D + i] * inv);
  }
}

// ------------------------------------------------------------------ DecodeLayers' part

// src [n] in T -> dst in C (T itself, or float to float16, rounded to nearest)
template <typename T, typename C>
inline void DecodeLayers::store_kv(const T* src, C* dst, int64_t n) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, n * sizeof(T));
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(f32(src[i]));
}

// out[b, head] = softmax(q . K^T * scale) V over the sequence's seq_len cached tokens (its
// last `window_` where the layers have a window), one (sequence, KV head) pair per task:
// its `group` query heads share each K/V row.
template <typename T, typename C>
inline void DecodeLayers::attend(const T* qkv, int64_t row, const C* k_cache, const C* v_cache,
                                 const int64_t* seq_lens, const int64_t* tables, int64_t width,
                                 int64_t block_size, int64_t B, T* out) const {
#define TESSERA_ATTEND(NV) \
  return attend_all<T, C, NV>(qkv, row, k_cache, v_cache, seq_lens, tables, width, block_size, B, out)
  switch (head_dim_) {  // the vector kernel keeps a row in head_dim / 16 vectors
    case 16: TESSERA_ATTEND(1);
    case 32: TESSERA_ATTEND(2);
    case 64: TESSERA_ATTEND(4);
    case 96: TESSERA_ATTEND(6);
    case 128: TESSERA_ATTEND(8);
    case 256: TESSERA_ATTEND(16);
    default: TESSERA_ATTEND(0);
  }
#undef TESSERA_ATTEND
}

template <typename T, typename C, int NV>
inline void DecodeLayers::attend_all(const T* qkv, int64_t row, const C* k_cache,
                                     const C* v_cache, const int64_t* seq_lens,
                                     const int64_t* tables, int64_t width, int64_t block_size,
                                     int64_t B, T* out) const {
  const int64_t D = head_dim_, group = num_heads_ / num_kv_heads_;
  const int64_t kv_size = num_kv_heads_ * D;
  // Rows split by their cost (a row's context, plus a fixed share) into parts of equal
  // cost, kPiecesPerThread per thread, which the threads claim one at a time
  // (pieces.h). Split evenly by count, a prompt's rows (contexts 1 .. n, in order) left
  // the thread with the first half idle for most of the region; split into one part per
  // thread, a thread that another process took off its core held up the whole step.
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads * kPiecesPerThread, B));
  std::vector<int64_t> bounds(parts + 1, B);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += seq_lens[b] - skipped(seq_lens[b]) + kRowCost;
  for (int64_t b = 0, part = 1, sum = 0; b < B && part < parts; ++b) {
    sum += seq_lens[b] - skipped(seq_lens[b]) + kRowCost;
    if (sum * parts >= total * part) bounds[part++] = b + 1;
  }
  parallel_pieces(0, parts, 1, [&](int64_t first_part, int64_t last_part) {
    std::vector<float> q(group * D), acc(group * D), buf(D + group), scores;
    const int64_t begin = bounds[first_part] * num_kv_heads_;
    const int64_t end = bounds[last_part] * num_kv_heads_;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads_, kvh = task % num_kv_heads_;
      const int64_t n = seq_lens[b], skip = skipped(n);
      to_float<T>(qkv + b * row + kvh * group * D, q.data(), group * D);
      if (static_cast<int64_t>(scores.size()) < group * n) scores.resize(group * n);
      const C* k = k_cache + kvh * D;
      const C* v = v_cache + kvh * D;
      T* o = out + b * num_heads_ * D + kvh * group * D;
#if TESSERA_DECODE_VEC
      if constexpr (NV > 0) {
        for (int64_t g = 0; g < group; g += heads_at_once(NV)) {
          const float* qg = q.data() + g * D;
          const int64_t* table = tables + b * width;
          switch (std::min<int64_t>(heads_at_once(NV), group - g)) {
#define TESSERA_HEADS(G)                                                                        \
  case G:                                                                                       \
    attend_heads<T, C, NV, G>(qg, k, v, table, skip, n, block_size, kv_size, scale_,            \
                              scores.data(), o + g * D);                                        \
    break;
            TESSERA_HEADS(1)
            TESSERA_HEADS(2)
            TESSERA_HEADS(3)
            TESSERA_HEADS(4)
#undef TESSERA_HEADS
          }
        }
        continue;
      }
#endif
      attend_task<T, C>(q.data(), group, D, k, v, tables + b * width, skip, n, block_size,
                        kv_size, scale_, scores.data(), acc.data(), buf.data(), o);
    }
  });
}

// The cache indices a prompt chunk's rows attend from: 0, or with a window, the first
// index its first row's window reaches (the indices before are not gathered).
inline int64_t DecodeLayers::prompt_skip(const Prompt& prompt) const {
  return window_ ? std::max<int64_t>(0, prompt.seq_len - prompt.rows - window_ + 1) : 0;
}

// A prompt's causal mask (and window) over its gathered indices prompt_skip ..
// seq_len - 1, as an additive bias [rows, seq_len - skip] (0 where a row may look, -inf
// after its own index and before its window), as tessera/workers/attention/paged.py
// builds it; none when the chunk is the whole sequence and no window cuts it (the
// kernel's own causal flag).
inline c10::optional<torch::Tensor> DecodeLayers::causal_bias(
    const Prompt& prompt, const torch::TensorOptions& options) const {
  const bool windowed = window_ && prompt.seq_len > window_;
  if (prompt.rows == prompt.seq_len && !windowed) return c10::nullopt;
  const int64_t skip = prompt_skip(prompt);
  const auto index = torch::TensorOptions().dtype(torch::kInt64);
  const auto keys = torch::arange(skip, prompt.seq_len, index).unsqueeze(0);
  const auto rows = torch::arange(prompt.rows, index).unsqueeze(1) + (prompt.seq_len - prompt.rows);
  auto masked = keys > rows;
  if (windowed) masked = masked.logical_or_(keys <= rows - window_);
  return torch::zeros({prompt.rows, prompt.seq_len - skip}, options).masked_fill_(masked, -INFINITY);
}

// One prompt's attention, every row over the cache up to itself (from its window on),
// through torch's CPU flash kernel as workers/attention/paged.py calls it (the same op on
// the same q, K/V and mask): its K/V gathered from the layer's cache [2, blocks,
// block_size, H_kv, D] and repeated per query head. Its queries are qkv's rows, already
// rotated.
inline void DecodeLayers::attend_prompt(const torch::Tensor& qkv, const torch::Tensor& cache,
                                        const Prompt& prompt,
                                        const c10::optional<torch::Tensor>& mask,
                                        torch::Tensor& attn) const {
  const int64_t D = head_dim_, group = num_heads_ / num_kv_heads_;
  const int64_t block_size = cache.size(2);
  const int64_t skip = prompt_skip(prompt), first_block = skip / block_size;
  const int64_t blocks = (prompt.seq_len + block_size - 1) / block_size - first_block;
  const auto ids = torch::from_blob(const_cast<int64_t*>(prompt.table + first_block), {blocks},
                                    torch::kInt64);
  const auto rows = qkv.narrow(0, prompt.first, prompt.rows);
  const auto q = rows.narrow(1, 0, num_heads_ * D).view({prompt.rows, num_heads_, D});
  const auto gather = [&](int64_t which) {  // [1, H, seq_len - skip, D] in q's dtype
    return cache[which]
        .index_select(0, ids)
        .view({-1, num_kv_heads_, D})
        .narrow(0, skip - first_block * block_size, prompt.seq_len - skip)
        .transpose(0, 1)
        .to(q.scalar_type())
        .repeat_interleave(group, 0)
        .unsqueeze(0);
  };
  const auto out = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
      q.transpose(0, 1).unsqueeze(0), gather(0), gather(1), 0.0, !mask.has_value(), mask,
      static_cast<double>(scale_)));
  attn.narrow(0, prompt.first, prompt.rows)
      .view({prompt.rows, num_heads_, D})
      .copy_(out[0].transpose(0, 1));
}
