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

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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

namespace {

constexpr int64_t kDense = 0;  // weight [in, out] in T
constexpr int64_t kGguf = 1;   // packed GGUF blocks, float32 activations (gguf_mm)
constexpr int64_t kInt4 = 2;   // torch's int4 layout up to int4_rows rows, else dense
constexpr int64_t kQ4 = 3;     // q4_bf16_mm's layout (int4: nibbles, int4_scales_zeros: d,
                               // mins: m) up to int4_rows rows, else dense
constexpr int64_t kQ4Exact = 4;  // that layout in float32 (q4_f32_mm) up to int4_rows
                                 // rows, else dequantised (q4_f32_dense) for dense_f32_mm

// Rows of the stack's row-wise steps (norms, RoPE and the cache writes, SwiGLU; residual
// adds: this many thousand values) a thread takes at least: a step's few rows run inline,
// a prompt's thousands in parallel (serial, they left the other thread idle for an
// eighth of a 2048-token step). A row's numbers never depend on the split.
constexpr int64_t kRowGrain = 16;

// Rows of a step of decodes each thread takes at least to run its share of the rows
// through every layer alone (DecodeLayers::run_in_shares), 0: never; use_row_shares sets
// it (one number for the process). The same numbers either way. On a Zen 4 EPYC (2
// threads, the next layer's K/V fetched, stop 65), steps in shares of 4 / 3 / 2 / 1 rows
// against every product shared: 8 decodes 16.9 / 21.3 ms (exact) and 10.8 / 12.9
// (fast); 6 decodes 13.6 / 14.8 and 12.5 / 12.9; 4 decodes 10.5 / 10.7 and 6.8 / 6.4; 2
// decodes 9.1 / 8.5 and 6.1 / 5.4 (each share reads every weight).
std::atomic<int64_t>& share_rows() {
  static std::atomic<int64_t> rows{4};
  return rows;
}

// Whether a share of a decode step hands half its rows to a thread done with its own
// (DecodeLayers::run_in_shares), how many times one has, and whether the second thread
// waits to claim a share until the first has claimed them all (tests: so that it hands
// rows over).
std::atomic<bool>& share_handover() {
  static std::atomic<bool> on{true};
  return on;
}
std::atomic<int64_t>& share_handovers() {
  static std::atomic<int64_t> count{0};
  return count;
}
std::atomic<bool>& hold_second_thread() {
  static std::atomic<bool> on{false};
  return on;
}

// A spinning thread's hint to the core (x86's PAUSE).
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// What splitting attention between threads counts for a row besides its context tokens
// (its query heads' setup and output), in tokens.
constexpr int64_t kRowCost = 8;

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

  torch::Tensor operator()(const torch::Tensor& x) const {
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
};

// A causal chunk of a sequence's tokens (a prompt, or a piece of one): rows first ..
// first + rows - 1 of the step, the last at cache index seq_len - 1; its block table.
struct Prompt {
  int64_t first, rows, seq_len;
  const int64_t* table;
};

// ------------------------------------------------------------------ small helpers

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

#if TESSERA_DECODE_VEC
using vec16::F;

template <typename T>
inline F load16(const T* p);

template <>
inline F load16<float>(const float* p) {
  return vec16::load(p);
}

template <>
inline F load16<c10::BFloat16>(const c10::BFloat16* p) {
  return vec16::load_bf16(reinterpret_cast<const uint16_t*>(p));
}

template <>
inline F load16<c10::Half>(const c10::Half* p) {
  return vec16::load_half(reinterpret_cast<const uint16_t*>(p));
}

// Whether round16 and store16 take T: float32 and bf16 (float16 stays on scalar loops).
template <typename T>
constexpr bool kVecRound = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// 16 values rounded to T as round_to<T> rounds them, as float32.
template <typename T>
inline F round16(F v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return vec16::round_bf16(v);
  return v;
}

// 16 values rounded to T as round_to<T> rounds them, stored.
template <typename T>
inline void store16(T* p, F v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    vec16::store_bf16(reinterpret_cast<uint16_t*>(p), v);
  else
    vec16::store(p, v);
}
#endif

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

// out = to_T(to_T(silu(gate)) * up), n elements
template <typename T>
void swiglu_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if TESSERA_DECODE_VEC
  for (; i + 16 <= n; i += 16) {
    const F g = load16<T>(gate + i);
    const F e = vec16::exp(vec16::sub(vec16::zero(), g));
    const F silu = vec16::div(g, vec16::add(vec16::set1(1.f), e));
    if constexpr (kVecRound<T>) {
      store16<T>(out + i, vec16::mul(round16<T>(silu), load16<T>(up + i)));
    } else {
      float lanes[16];
      vec16::store(lanes, silu);
      for (int j = 0; j < 16; ++j)
        out[i + j] = round_to<T>(f32(round_to<T>(lanes[j])) * f32(up[i + j]));
    }
  }
#endif
  for (; i < n; ++i) {
    const float g = f32(gate[i]);
    const T s = round_to<T>(g / (1.f + std::exp(-g)));
    out[i] = round_to<T>(f32(s) * f32(up[i]));
  }
}

// sum of squares of x[0..n), in float32 lanes
inline float sum_squares(const float* x, int64_t n) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j] * x[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// y[r] = weight * to_T(x[r] / sqrt(mean(x[r]^2) + eps)), rows of `hidden` floats
template <typename T>
void rms_norm(const float* x, const T* weight, T* y, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * hidden;
      T* yr = y + r * hidden;
      const float mean = sum_squares(xr, hidden) / static_cast<float>(hidden);
      const float inv = 1.f / std::sqrt(mean + eps);
      int64_t i = 0;
#if TESSERA_DECODE_VEC
      if constexpr (kVecRound<T>)
        for (; i + 16 <= hidden; i += 16)
          store16<T>(yr + i, vec16::mul(load16<T>(weight + i),
                                        round16<T>(vec16::mul(vec16::load(xr + i),
                                                              vec16::set1(inv)))));
#endif
      for (; i < hidden; ++i) {
        const T normed = round_to<T>(xr[i] * inv);
        yr[i] = round_to<T>(f32(weight[i]) * f32(normed));
      }
    }
  });
}

// x [heads, D] rotated in place by cos/sin [D] (rotate-half layout)
template <typename T>
void rotate(T* x, int64_t heads, int64_t head_dim, const T* cos, const T* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * head_dim;
    int64_t i = 0;
#if TESSERA_DECODE_VEC
    if constexpr (kVecRound<T>)
      for (; i + 16 <= half; i += 16) {
        const F x1 = load16<T>(xh + i), x2 = load16<T>(xh + i + half);
        const F a1 = round16<T>(vec16::mul(x1, load16<T>(cos + i)));
        const F b1 = round16<T>(vec16::mul(vec16::neg(x2), load16<T>(sin + i)));
        const F a2 = round16<T>(vec16::mul(x2, load16<T>(cos + i + half)));
        const F b2 = round16<T>(vec16::mul(x1, load16<T>(sin + i + half)));
        store16<T>(xh + i, vec16::add(a1, b1));
        store16<T>(xh + i + half, vec16::add(a2, b2));
      }
#endif
    for (; i < half; ++i) {
      const float x1 = f32(xh[i]), x2 = f32(xh[i + half]);
      const T a1 = round_to<T>(x1 * f32(cos[i]));
      const T b1 = round_to<T>(-x2 * f32(sin[i]));
      const T a2 = round_to<T>(x2 * f32(cos[i + half]));
      const T b2 = round_to<T>(x1 * f32(sin[i + half]));
      xh[i] = round_to<T>(f32(a1) + f32(b1));
      xh[i + half] = round_to<T>(f32(a2) + f32(b2));
    }
  }
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if TESSERA_DECODE_VEC
  for (; i + 16 <= n; i += 16) vec16::store(dst + i, load16<T>(src + i));
#endif
  for (; i < n; ++i) dst[i] = f32(src[i]);
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

// Calls row(p, t) for each token t = 0 .. n-1 of a sequence in a paged cache, p its
// `values` elements of this head: `cache` points at this head's first element of block
// 0, block j of the sequence is table[j], and a token's row is kv_size apart from the
// next in its block. Each token's row of the next block is fetched a block ahead: a
// block's rows are too few for the hardware prefetcher to follow the jump to the next
// (scattered) block.
template <typename C, typename Row>
inline void for_each_row(const C* cache, const int64_t* table, int64_t n, int64_t block_size,
                         int64_t kv_size, int64_t values, const Row& row) {
  const int64_t block_stride = block_size * kv_size;
  const int64_t blocks = (n + block_size - 1) / block_size;
  const int64_t bytes = values * static_cast<int64_t>(sizeof(C));
  for (int64_t j = 0, t = 0; t < n; ++j) {
    const C* p = cache + table[j] * block_stride;
    const char* ahead = reinterpret_cast<const char*>(
        j + 1 < blocks ? cache + table[j + 1] * block_stride : p);
    for (const int64_t stop = std::min(n, t + block_size); t < stop;
         ++t, p += kv_size, ahead += kv_size * sizeof(C)) {
      for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(ahead + byte);
      row(p, t);
    }
  }
}

#if TESSERA_DECODE_VEC
// G query heads q [G, D] (float32, D == 16 * NV) sharing one KV head attend over a
// sequence's n cached tokens (in the cache's dtype C); out [G, D] in T. k_cache / v_cache
// point at this KV head's first element of block 0; a token's row is kv_size apart from
// the next in its block. Each K and V row is read once for the G heads and kept in NV
// registers; each head's V accumulator stays in registers over the whole sequence.
// Scores (q . k * scale, into scores [G, n]) go 16 tokens at a time: each token's NV
// products are one vector of 16 partial sums, and vec16::lane_sums folds 16 tokens' vectors
// at once. A row's numbers depend only on its own q and cache, never on the batch.
template <typename T, typename C, int NV, int G>
void attend_heads(const float* q, const C* k_cache, const C* v_cache, const int64_t* table,
                  int64_t n, int64_t block_size, int64_t kv_size, float scale, float* scores,
                  T* out) {
  constexpr int64_t D = 16 * NV;
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
  for_each_row(k_cache, table, n, block_size, kv_size, D, [&](const C* k, int64_t) {
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
  for_each_row(v_cache, table, n, block_size, kv_size, D, [&](const C* v, int64_t t) {
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
// heads q [group, D] (float32) sharing this KV head attend over the sequence's n cached
// tokens (in the cache's dtype C); out [group, D] in T. Laid out as attend_heads above;
// scores go to scores [group, n], acc [group, D] and buf [D + group] are scratch.
template <typename T, typename C>
void attend_task(const float* q, int64_t group, int64_t D, const C* k_cache, const C* v_cache,
                 const int64_t* table, int64_t n, int64_t block_size, int64_t kv_size,
                 float scale, float* scores, float* acc, float* buf, T* out) {
  float* sums = buf + D;  // [group] after the D floats of row scratch
  for_each_row(k_cache, table, n, block_size, kv_size, D, [&](const C* k, int64_t t) {
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
  for_each_row(v_cache, table, n, block_size, kv_size, D, [&](const C* v, int64_t t) {
    to_float<C>(v, buf, D);
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + t], buf, acc + g * D, D);
  });
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / sums[g];
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = round_to<T>(acc[g * D + i] * inv);
  }
}

// ------------------------------------------------------------------ the stack

class DecodeLayers {
 public:
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double eps, double scale)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        intermediate_(intermediate),
        eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "DecodeLayers: heads must group over KV heads");
    TORCH_CHECK(head_dim % 2 == 0, "DecodeLayers: head_dim must be even");
  }

  void add_layer(const torch::Tensor& input_norm, const Linear& qkv, const Linear& o,
                 const torch::Tensor& post_norm, const Linear& gate_up, const Linear& down) {
    TORCH_CHECK(input_norm.dim() == 1 && post_norm.sizes() == input_norm.sizes() &&
                    (layers_.empty() || input_norm.numel() == layers_[0].input_norm.numel()),
                "DecodeLayers: every layer's norms must be [hidden]");
    layers_.push_back(Layer{input_norm.contiguous(), post_norm.contiguous(), qkv, o, gate_up, down});
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
                        const c10::optional<torch::Tensor>& prompt_tables) const {
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
    TORCH_CHECK(cos.sizes() == torch::IntArrayRef({B, head_dim_}) && cos.is_contiguous() &&
                    sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                    cos.scalar_type() == dtype && sin.scalar_type() == dtype,
                "DecodeLayers: cos/sin must be contiguous [B, head_dim] in the model's dtype");
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
    const int64_t shares = row_shares(decodes, B, slot_p, len_p, table_p, width, block_size,
                                      rows ? &picked : nullptr, &linked);
#define TESSERA_RUN(T, C)                                                                      \
  last = shares == 1   ? run<T, C>(hidden, cos, sin, slot_p, decodes, len_p, table_p, width,   \
                                   chunks, kv_cache, rows ? &picked : nullptr)                 \
         : chunks.empty() ? run_in_shares<T, C>(shares, hidden, cos, sin, slot_p, len_p,       \
                                                table_p, width, kv_cache,                      \
                                                rows ? &picked : nullptr, !linked)             \
                          : run_split<T, C>(shares, hidden, cos, sin, slot_p, decodes, len_p,  \
                                            table_p, width, chunks, kv_cache,                  \
                                            rows ? &picked : nullptr, !linked)
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

 private:
  // float32 rows [S, H] through the final norm: [S, H] in T (rms_norm, as every layer's
  // norm here)
  template <typename T>
  torch::Tensor final_norm(const torch::Tensor& rows, const torch::Tensor& norm) const {
    const int64_t S = rows.size(0), H = rows.size(1);
    auto out = torch::empty({S, H}, rows.options().dtype(norm.scalar_type()));
    const auto weight = norm.contiguous();
    rms_norm<T>(rows.data_ptr<float>(), weight.data_ptr<T>(), out.data_ptr<T>(), S, H, eps_);
    return out;
  }

  // How many threads run a step's D single rows (decodes; the B - D rows after them are
  // prompt chunks, run_split) in shares (run_in_shares), each its rows through every
  // layer alone: at least share_rows() rows a share, whose products all take the tiled
  // Q4 layout at this many rows (q4_bf16_mm, q4_f32_mm, whose rows never depend on T: a
  // row's numbers are the ones it has in the whole batch), with the rows wanted (`rows`)
  // in order, and no decode row reading a block another share's rows or a chunk's write
  // (a short prompt's rows, which read each other's K/V from the cache, stay in one
  // run). 1: the threads share each product. On a Zen 4
  // EPYC, steps in shares and not in turn within one run (fast mode, 2 threads): 64
  // decodes 71.5 / 85.6 ms against 76.9 / 90.9, 32 decodes 53.1 against 57.1, 16 decodes
  // 22.5 / 29.8 against 23.6 / 31.1; the bfloat16 mode's 77.9 against 82.2 at 64. The
  // exact mode's float32 kernel (q4_f32_mm, whose rows never depend on T either) too:
  // above 8 rows it dequantises each tile once for all of a call's rows, which each share
  // does again, so in shares alone it measured no gain (stop 59); with the next layer's
  // K/V fetched (twice the fast mode's bytes) 16 decodes took 32.3 ms against 37.1 in
  // shares without and 40.3 shared, 64 decodes 119.7 against 126.0 and 130.3 (stop 65).
  //
  // `linked`: whether some decode row reads a block another decode row writes (of its
  // share: a short prompt's or a target's drafts' tokens, each its own row), so that no
  // share may be cut (run_in_shares' handover).
  int64_t row_shares(int64_t D, int64_t B, const int64_t* slots, const int64_t* seq_lens,
                     const int64_t* tables, int64_t width, int64_t block_size,
                     const torch::Tensor* rows, bool* linked) const {
    // Two threads, one share each: measured there only. With more threads a step's few
    // rows would leave threads idle (each share runs on one), and each share of ~8 rows
    // would read every weight again.
    const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    const int64_t least = share_rows().load();
    if (threads != 2 || least <= 0 || D < 2 * least) return 1;
    const int64_t shares = 2;
    for (const Layer& layer : layers_)
      for (const Linear* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
        if ((linear->kind != kQ4 && linear->kind != kQ4Exact) || linear->int4_rows < D)
          return 1;
    if (rows != nullptr) {
      const int64_t* r = rows->data_ptr<int64_t>();
      if (!std::is_sorted(r, r + rows->numel())) return 1;
    }
    // (block written, row), sorted; then every decode row's context blocks looked up in it
    std::vector<std::pair<int64_t, int64_t>> written(B);
    for (int64_t b = 0; b < B; ++b) written[b] = {slots[b] / block_size, b};
    std::sort(written.begin(), written.end());
    const auto share_of = [D, shares](int64_t b) { return b < D ? b * shares / D : shares; };
    for (int64_t b = 0; b < D; ++b) {
      for (int64_t j = 0; j < (seq_lens[b] + block_size - 1) / block_size; ++j) {
        auto at = std::lower_bound(written.begin(), written.end(),
                                   std::pair<int64_t, int64_t>{tables[b * width + j], 0});
        for (; at != written.end() && at->first == tables[b * width + j]; ++at) {
          if (share_of(at->second) != share_of(b)) return 1;
          if (at->second != b) *linked = true;
        }
      }
    }
    return shares;
  }

  // run() over `shares` consecutive ranges of a step's B decode rows, one per thread, each
  // range's rows through every layer on that thread alone (the kernels' own parallel
  // loops run inline there): one barrier a step instead of a dozen a layer, where a
  // thread taken off its core by another process held the other at each. With
  // `handover` (no decode row reads K/V another decode row writes: row_shares' `linked`,
  // since the rows of one short prompt or of a target's drafts read each other's K/V of
  // the same layer), a thread done with its rows takes the last half of the other's as
  // that one starts a layer (at least share_rows() / 2 rows each, two layers left at
  // least), and goes on with them from there: a thread taken off its core then holds the
  // step back by about half the time it lost. Beside a process busy 0.4 ms every 3 ms (stop 71, alternate steps),
  // 64 decodes 59.2-68.6 ms against 62.2-71.6 without the handover (16 decodes 17.7-19.3
  // against 18.4-19.9); quiet, the same. Same numbers as run() over all rows (row_shares
  // says when; an unlinked row's numbers never depend on its thread or the rows beside
  // it); with `rows`, the rows each range kept, in order.
  template <typename T, typename C>
  torch::Tensor run_in_shares(int64_t shares, torch::Tensor& hidden, const torch::Tensor& cos,
                              const torch::Tensor& sin, const int64_t* slots,
                              const int64_t* seq_lens, const int64_t* tables, int64_t width,
                              const torch::Tensor& kv_cache, const torch::Tensor* rows,
                              bool handover) const {
    const int64_t B = hidden.size(0);
    // Rows [b0, b0 + n) from layer `layer` on; `wanted`: their rows kept at the last layer
    // (with `rows`), counted from b0.
    struct Work {
      int64_t b0, n, layer;
      torch::Tensor wanted;
    };
    const auto wanted_of = [rows](int64_t b0, int64_t n) {
      if (rows == nullptr) return torch::Tensor();
      const int64_t* r = rows->data_ptr<int64_t>();
      const int64_t* from = std::lower_bound(r, r + rows->numel(), b0);
      const int64_t* to = std::lower_bound(from, r + rows->numel(), b0 + n);
      auto wanted = torch::empty({to - from}, rows->options());
      for (int64_t j = 0; j < to - from; ++j) wanted.data_ptr<int64_t>()[j] = from[j] - b0;
      return wanted;
    };
    // Each thread claims a share (`next`); one done with its rows waits (`waiting`), and
    // one still at work hands it the last half of its rows as it starts its next layer
    // (`mail`), so a thread taken off its core holds the step back by about half the time
    // it lost, not all of it. `active`: threads with rows (a claim counts itself first, a
    // handover before it is posted), so a waiter leaves only when no rows are left.
    std::atomic<int64_t> next{0};
    std::atomic<int> active{0}, waiting{0};
    std::atomic<bool> posted{false}, failed{false};
    Work mail{};
    std::mutex kept_mutex;
    std::vector<std::pair<int64_t, torch::Tensor>> kept;
    const int64_t least = std::max<int64_t>(1, share_rows().load() / 2);
    const auto claim = [&](Work& work) {
      active.fetch_add(1);
      const int64_t i = next.fetch_add(1);
      if (i >= shares) {
        active.fetch_sub(1);
        return false;
      }
      // rows b0 .. b0 + n - 1: those with b * shares / B == i (row_shares' share of b)
      const int64_t b0 = (B * i + shares - 1) / shares;
      const int64_t n = (B * (i + 1) + shares - 1) / shares - b0;
      work = Work{b0, n, 0, wanted_of(b0, n)};
      return true;
    };
    at::parallel_for(0, shares, 1, [&](int64_t, int64_t) {
      if (hold_second_thread().load() && at::get_thread_num() == 1)
        while (next.load() < shares && !failed.load()) spin_pause();
      Work work;
      bool have = claim(work);
      while (true) {
        if (!have) {
          // no rows can come: wait at the region's end, as libgomp waits
          if (!handover || !share_handover().load()) return;
          waiting.store(1);
          while (!have) {  // another share's rows, or the end
            if (posted.load(std::memory_order_acquire)) {
              posted.store(false);
              work = mail;
              have = true;
              break;
            }
            // no rows left: a thread that could hand some over counts itself in `active`
            if (failed.load() || active.load() == 0) return;
            spin_pause();
          }
        }
        const std::function<int64_t(int64_t, int64_t)> keep = [&](int64_t l, int64_t n) {
          if (!handover || n < 2 * least || num_layers() - l < 2 || waiting.load() == 0 ||
              !share_handover().load())
            return n;
          active.fetch_add(1);
          int expected = 1;
          if (!waiting.compare_exchange_strong(expected, 0)) {
            active.fetch_sub(1);
            return n;
          }
          const int64_t kept_rows = n / 2;
          mail = Work{work.b0 + kept_rows, n - kept_rows, l, torch::Tensor()};
          if (rows != nullptr) {
            const int64_t* w = work.wanted.template data_ptr<int64_t>();
            const int64_t split = std::lower_bound(w, w + work.wanted.numel(), kept_rows) - w;
            mail.wanted = work.wanted.narrow(0, split, work.wanted.numel() - split) - kept_rows;
            work.wanted = work.wanted.narrow(0, 0, split);
          }
          posted.store(true, std::memory_order_release);
          share_handovers().fetch_add(1);
          return kept_rows;
        };
        const int64_t b = work.b0;
        torch::Tensor part = hidden.narrow(0, b, work.n);
        torch::Tensor out;
        try {
          out = run<T, C>(part, cos.narrow(0, b, work.n), sin.narrow(0, b, work.n), slots + b,
                          work.n, seq_lens + b, tables + b * width, width, {}, kv_cache,
                          rows != nullptr ? &work.wanted : nullptr, /*share=*/true, work.layer,
                          &keep);
        } catch (...) {  // a waiting thread must not wait for these rows
          failed.store(true);
          throw;
        }
        if (rows != nullptr) {
          std::lock_guard<std::mutex> lock(kept_mutex);
          kept.emplace_back(b, out);
        }
        active.fetch_sub(1);
        have = claim(work);
      }
    });
    if (rows == nullptr) return hidden;
    std::sort(kept.begin(), kept.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<torch::Tensor> parts;
    for (auto& [b, t] : kept) parts.push_back(t);
    return at::cat(parts);
  }

  // A step of D decode rows and prompt chunks after them: the decode rows in `shares`
  // shares (run_in_shares), then the chunks' rows on their own (run, the threads sharing
  // each product). No decode row reads K/V a chunk's row writes (row_shares checked it);
  // a chunk's row that read a decode row's K/V would find it written either way (the
  // decode rows run first, and their K/V never depends on the chunks); and every
  // kernel's row is independent of the others, so each row gets the numbers
  // it would have in one run, up to the kernels chosen by row count. With `rows` (sorted:
  // row_shares), the decode rows' kept rows, then the chunks'. Where a stream of requests
  // keeps arriving, most steps carry a new prompt, and before this none of them ran its
  // decodes in shares (nor fetched their K/V ahead). Stop 65 (Zen 4, fast mode,
  // serve_load.py's 64-stream schedule): in process no change (mixed steps of < 100
  // prompt tokens 106.6 / 105.7 ms against 105.2 / 106.1: the chunks' run reads every
  // weight again); over HTTP, a fresh server each, two pairs, 379.1 / 380.1 tok/s at 64
  // streams against 359.2 / 373.6, at 16 346.9 / 320.9 against 323.0 / 339.1.
  template <typename T, typename C>
  torch::Tensor run_split(int64_t shares, torch::Tensor& hidden, const torch::Tensor& cos,
                          const torch::Tensor& sin, const int64_t* slots, int64_t D,
                          const int64_t* seq_lens, const int64_t* tables, int64_t width,
                          const std::vector<Prompt>& prompts, const torch::Tensor& kv_cache,
                          const torch::Tensor* rows, bool handover) const {
    const int64_t B = hidden.size(0);
    torch::Tensor decode_rows = hidden.narrow(0, 0, D), prompt_rows = hidden.narrow(0, D, B - D);
    torch::Tensor decode_kept, prompt_kept;
    if (rows != nullptr) {
      const int64_t* r = rows->data_ptr<int64_t>();
      const int64_t n = rows->numel(), split = std::lower_bound(r, r + n, D) - r;
      decode_kept = rows->narrow(0, 0, split);
      prompt_kept = rows->narrow(0, split, n - split) - D;
    }
    std::vector<Prompt> moved(prompts);  // their rows counted from the first chunk's
    for (Prompt& prompt : moved) prompt.first -= D;
    torch::Tensor decoded =
        run_in_shares<T, C>(shares, decode_rows, cos.narrow(0, 0, D), sin.narrow(0, 0, D), slots,
                            seq_lens, tables, width, kv_cache, rows ? &decode_kept : nullptr,
                            handover);
    torch::Tensor prompted =
        run<T, C>(prompt_rows, cos.narrow(0, D, B - D), sin.narrow(0, D, B - D), slots + D, 0,
                  seq_lens, tables, width, moved, kv_cache, rows ? &prompt_kept : nullptr);
    return rows != nullptr ? at::cat({decoded, prompted}) : hidden;
  }

  // rows [S] of x [B, F], gathered: [S, F]
  static torch::Tensor gather_rows(const torch::Tensor& x, const torch::Tensor& rows) {
    const int64_t S = rows.numel(), F = x.size(1);
    auto out = torch::empty({S, F}, x.options());
    const auto* src = static_cast<const char*>(x.data_ptr());
    auto* dst = static_cast<char*>(out.data_ptr());
    const int64_t bytes = F * static_cast<int64_t>(x.element_size());
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < S; ++i) std::memcpy(dst + i * bytes, src + r[i] * bytes, bytes);
    return out;
  }

  // Queues, on this thread (side_prefetch.h), layer l + 1's K/V blocks of the B decode rows
  // (each row's K blocks, then its V blocks: the order attend_all reads them), paced to
  // drain evenly over the products left before that layer's attention: layer l's o,
  // gate_up and down and layer l + 1's qkv, each micro-kernel of tiled::kBf16Rows rows calling
  // some() once a block of 32 inputs (drained by the end of down instead, or at 0.85x /
  // 1.15x the even pace, 64-row steps measured no faster). A row's new token is fetched
  // before it is written: a line too many, no error.
  template <typename C>
  void queue_next_kv(int64_t l, int64_t B, const C* k_cache, const C* v_cache,
                     int64_t layer_stride, const int64_t* seq_lens, const int64_t* tables,
                     int64_t width, int64_t block_size, int64_t decodes) const {
    side::Queue& queue = side::queue();
    queue.clear();
    if (l + 1 >= num_layers()) return;
    const int64_t kv_size = num_kv_heads_ * head_dim_, H = layers_[0].input_norm.numel();
    const int64_t block_bytes = block_size * kv_size * static_cast<int64_t>(sizeof(C));
    int64_t lines = 0;
    for (int64_t b = 0; b < decodes; ++b)
      for (const C* cache : {k_cache + layer_stride, v_cache + layer_stride})
        for (int64_t j = 0; j < (seq_lens[b] + block_size - 1) / block_size; ++j) {
          queue.add(cache + tables[b * width + j] * block_size * kv_size, block_bytes);
          lines += block_bytes / 64;
        }
    const int64_t q_size = num_heads_ * head_dim_, I = intermediate_;
    const auto calls = [B](const Linear& w, int64_t N, int64_t K) {  // of one product of B rows
      if (w.kind == kQ4Exact) return q4_f32_queue_calls(B, N / 16, K / tiled::kBlock);
      return (B + tiled::kBf16Rows - 1) / tiled::kBf16Rows * (N / 16) * (K / tiled::kBlock);
    };
    const Layer &layer = layers_[l], &next = layers_[l + 1];
    queue.pace(lines, calls(layer.o, H, q_size) + calls(layer.gate_up, 2 * I, H) +
                          calls(layer.down, H, I) + calls(next.qkv, q_size + 2 * kv_size, H));
  }

  // T: the model's dtype (activations between the matmuls); C: the KV cache's (T, or
  // float16 under a float32 model: the fast mode). Updates hidden in place; with `rows`
  // [S], the last layer goes on past its attention with those rows only (a prompt's
  // other rows need only their K/V, written by then) and returns them, float32 [S, H].
  // Every kernel's row is independent of the others, so the rows kept get the numbers
  // they would have had with all rows, up to the kernels chosen by row count (the exact
  // mode's GEMM above exact_row_limit rows, torch's int4 layout's dense copy).
  template <typename T, typename C>
  torch::Tensor run(torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                    const int64_t* slots, int64_t decodes, const int64_t* seq_lens,
                    const int64_t* tables, int64_t width, const std::vector<Prompt>& prompts,
                    const torch::Tensor& kv_cache, const torch::Tensor* rows,
                    bool share = false, int64_t first_layer = 0,
                    const std::function<int64_t(int64_t, int64_t)>* keep = nullptr) const {
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
    for (int64_t l = first_layer; l < num_layers(); ++l) {
      if (keep != nullptr && l > first_layer) {  // single rows: the first n go on here
        const int64_t n = (*keep)(l, B);
        if (n < B) {
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
      const torch::Tensor qkv = layer.qkv(normed).contiguous();  // [B, q + 2 kv]
      TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "DecodeLayers: layer ", l,
                  "'s qkv projection gives ", qkv.size(1), " features, not ", q_size + 2 * kv_size);
      T* qkv_p = qkv.data_ptr<T>();
      const int64_t row = qkv.size(1);
      at::parallel_for(0, B, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {  // each token its own cache row
          T* r = qkv_p + b * row;
          rotate<T>(r, num_heads_ + num_kv_heads_, D, cos_p + b * D, sin_p + b * D);
          store_kv(r + q_size, k_cache + slots[b] * kv_size, kv_size);
          store_kv(r + q_size + kv_size, v_cache + slots[b] * kv_size, kv_size);
        }
      });
      attend<T, C>(qkv_p, row, k_cache, v_cache, seq_lens, tables, width, block_size, decodes,
                   attn.data_ptr<T>());
      if (prefetch)
        queue_next_kv(l, B, k_cache, v_cache, layer_stride, seq_lens, tables, width, block_size,
                      decodes);
      for (size_t i = 0; i < prompts.size(); ++i)
        attend_prompt(qkv, kv_cache[l], prompts[i], masks[i], attn);
      int64_t R = B;  // rows past the attention
      if (rows != nullptr && l + 1 == num_layers()) {
        R = rows->numel();
        stream = gather_rows(hidden, *rows);
        h = stream.data_ptr<float>();
        attn = gather_rows(attn, *rows);
        normed = normed.narrow(0, 0, R);
        swiglu = swiglu.narrow(0, 0, R);
      }
      add_residual<T>(h, layer.o(attn), R * H);
      rms_norm<T>(h, layer.post_norm.data_ptr<T>(), normed.data_ptr<T>(), R, H, eps_);
      const torch::Tensor gate_up = layer.gate_up(normed).contiguous();  // [B, 2 I]
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
      add_residual<T>(h, layer.down(swiglu), R * H);
    }
    return stream;
  }

  // A prompt's causal mask as an additive bias [rows, seq_len] (0 where a row may look,
  // -inf after its own index), as tessera/workers/attention/paged.py builds it; none
  // when the chunk is the whole sequence (the kernel's own causal flag).
  static c10::optional<torch::Tensor> causal_bias(const Prompt& prompt,
                                                  const torch::TensorOptions& options) {
    if (prompt.rows == prompt.seq_len) return c10::nullopt;
    const auto after = torch::ones({prompt.rows, prompt.seq_len}, options.dtype(torch::kBool))
                           .triu(prompt.seq_len - prompt.rows + 1);
    return torch::zeros({prompt.rows, prompt.seq_len}, options).masked_fill_(after, -INFINITY);
  }

  // One prompt's attention, every row over the cache up to itself, through torch's CPU
  // flash kernel as workers/attention/paged.py calls it (the same op on the same q, K/V
  // and mask): its K/V gathered from the layer's cache [2, blocks, block_size, H_kv, D]
  // and repeated per query head. Its queries are qkv's rows, already rotated.
  void attend_prompt(const torch::Tensor& qkv, const torch::Tensor& cache, const Prompt& prompt,
                     const c10::optional<torch::Tensor>& mask, torch::Tensor& attn) const {
    const int64_t D = head_dim_, group = num_heads_ / num_kv_heads_;
    const int64_t block_size = cache.size(2);
    const int64_t blocks = (prompt.seq_len + block_size - 1) / block_size;
    const auto ids = torch::from_blob(const_cast<int64_t*>(prompt.table), {blocks}, torch::kInt64);
    const auto rows = qkv.narrow(0, prompt.first, prompt.rows);
    const auto q = rows.narrow(1, 0, num_heads_ * D).view({prompt.rows, num_heads_, D});
    const auto gather = [&](int64_t which) {  // [1, H, seq_len, D] in q's dtype
      return cache[which]
          .index_select(0, ids)
          .view({-1, num_kv_heads_, D})
          .narrow(0, 0, prompt.seq_len)
          .transpose(0, 1)
          .to(q.scalar_type())
          .repeat_interleave(group, 0)
          .unsqueeze(0);
    };
    const auto out = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1).unsqueeze(0), gather(0), gather(1), 0.0,
        prompt.rows == prompt.seq_len, mask, static_cast<double>(scale_)));
    attn.narrow(0, prompt.first, prompt.rows)
        .view({prompt.rows, num_heads_, D})
        .copy_(out[0].transpose(0, 1));
  }

  template <typename T>
  static void add_residual(float* h, const torch::Tensor& y, int64_t n) {
    TORCH_CHECK(y.numel() == n, "DecodeLayers: a projection back to the residual gives ",
                y.numel(), " values, not ", n);
    const auto yc = y.contiguous();
    const T* p = yc.data_ptr<T>();
    at::parallel_for(0, n, kRowGrain * 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) h[i] += f32(p[i]);
    });
  }

  // out[b, head] = softmax(q . K^T * scale) V over the sequence's seq_len cached tokens,
  // one (sequence, KV head) pair per task: its `group` query heads share each K/V row.
  // src [n] in T -> dst in C (T itself, or float to float16, rounded to nearest)
  template <typename T, typename C>
  static void store_kv(const T* src, C* dst, int64_t n) {
    if constexpr (std::is_same_v<T, C>) {
      std::memcpy(dst, src, n * sizeof(T));
      return;
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(f32(src[i]));
  }

  template <typename T, typename C>
  void attend(const T* qkv, int64_t row, const C* k_cache, const C* v_cache,
              const int64_t* seq_lens, const int64_t* tables, int64_t width, int64_t block_size,
              int64_t B, T* out) const {
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
  void attend_all(const T* qkv, int64_t row, const C* k_cache, const C* v_cache,
                  const int64_t* seq_lens, const int64_t* tables, int64_t width,
                  int64_t block_size, int64_t B, T* out) const {
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
    for (int64_t b = 0; b < B; ++b) total += seq_lens[b] + kRowCost;
    for (int64_t b = 0, part = 1, sum = 0; b < B && part < parts; ++b) {
      sum += seq_lens[b] + kRowCost;
      if (sum * parts >= total * part) bounds[part++] = b + 1;
    }
    parallel_pieces(0, parts, 1, [&](int64_t first_part, int64_t last_part) {
      std::vector<float> q(group * D), acc(group * D), buf(D + group), scores;
      const int64_t begin = bounds[first_part] * num_kv_heads_;
      const int64_t end = bounds[last_part] * num_kv_heads_;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / num_kv_heads_, kvh = task % num_kv_heads_;
        const int64_t n = seq_lens[b];
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
    attend_heads<T, C, NV, G>(qg, k, v, table, n, block_size, kv_size, scale_, scores.data(), \
                              o + g * D);                                                       \
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
        attend_task<T, C>(q.data(), group, D, k, v, tables + b * width, n, block_size, kv_size,
                          scale_, scores.data(), acc.data(), buf.data(), o);
      }
    });
  }

  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_;
  float eps_, scale_;
  std::vector<Layer> layers_;
};

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
                  kind == kQ4Exact,
              "make_linear: kind ", kind);
  if (weight) linear.weight = *weight;
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
  TORCH_CHECK(kind == kGguf || kind == kQ4Exact || weight || int4_rows > 0,
              "make_linear: no dense weight");
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
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate_size"),
           py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DecodeLayers::add_layer)
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward, py::arg("hidden"), py::arg("cos"), py::arg("sin"),
           py::arg("slots"), py::arg("seq_lens"), py::arg("block_tables"), py::arg("kv_cache"),
           py::arg("norm") = py::none(), py::arg("rows") = py::none(),
           py::arg("prompts") = py::none(), py::arg("prompt_tables") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace tessera
