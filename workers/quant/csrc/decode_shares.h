// A step's decode rows in shares, one per thread, each share's rows through every layer
// on that thread alone (DecodeLayers::run_in_shares), rather than both threads on each
// product: where a thread is off its core, the other is held once a step, not at each of
// a layer's dozen parallel loops. A share also fetches the next layer's K/V while its
// products run (queue_next_kv, side_prefetch.h). Included inside decode_layers.cpp's
// anonymous namespace, after decode_stack.h.
#pragma once

// Rows of a step of decodes each thread takes at least to run its share of the rows
// through every layer alone (DecodeLayers::run_in_shares), 0: never; use_row_shares sets
// it (one number for the process). The same numbers either way. On a Zen 4 EPYC (2
// threads, the next layer's K/V fetched), steps in shares of 4 / 3 / 2 / 1 rows
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

// How many threads run a step's D single rows (decodes; the B - D rows after them are
// prompt chunks, run_split) in shares (run_in_shares), each its rows through every
// layer alone: at least share_rows() rows a share, whose products all take the tiled
// Q4 layout at this many rows (q4_bf16_mm, q4_f32_mm, whose rows never depend on T: a
// row's numbers are the ones it has in the whole batch), with the rows wanted (`rows`)
// in order, and no decode row reading a block another share's rows or a chunk's write
// (a short prompt's rows, which read each other's K/V from the cache, stay in one
// run). kOneRun: the threads share each product. On a Zen 4 EPYC, steps in shares
// and not in turn within one run (fast mode, 2 threads): 64 decodes 71.5 / 85.6 ms
// against 76.9 / 90.9, 32 decodes 53.1 against 57.1, 16 decodes 22.5 / 29.8 against
// 23.6 / 31.1; the bfloat16 mode's 77.9 against 82.2 at 64. The exact mode's float32
// kernel (q4_f32_mm, whose rows never depend on T either) too: above 8 rows it
// dequantises each tile once for all of a call's rows, which each share does again, so
// in shares alone it measured no gain; with the next layer's K/V fetched (twice the fast
// mode's bytes) 16 decodes took 32.3 ms against 37.1 in shares without and 40.3 shared,
// 64 decodes 119.7 against 126.0 and 130.3.
//
// `linked`: whether some decode row reads a block another decode row writes (of its
// share: a short prompt's or a target's drafts' tokens, each its own row), so that no
// share may be cut (run_in_shares' handover).
inline int64_t DecodeLayers::row_shares(int64_t D, int64_t B, const int64_t* slots,
                                        const int64_t* seq_lens, const int64_t* tables,
                                        int64_t width, int64_t block_size,
                                        const torch::Tensor* rows, bool* linked) const {
  // Two threads, one share each: measured there only. With more threads a step's few
  // rows would leave threads idle (each share runs on one), and each share of ~8 rows
  // would read every weight again.
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t least = share_rows().load();
  if (threads != 2 || least <= 0 || D < 2 * least) return kOneRun;
  const int64_t shares = 2;
  for (const Layer& layer : layers_) {
    if (layer.moe) return kOneRun;  // its experts' products take other kernels
    for (const Linear* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      if ((linear->kind != kQ4 && linear->kind != kQ4Exact) || linear->int4_rows < D)
        return kOneRun;
  }
  if (rows != nullptr) {
    const int64_t* r = rows->data_ptr<int64_t>();
    if (!std::is_sorted(r, r + rows->numel())) return kOneRun;
  }
  // (block written, row), sorted; then every decode row's context blocks looked up in it
  std::vector<std::pair<int64_t, int64_t>> written(B);
  for (int64_t b = 0; b < B; ++b) written[b] = {slots[b] / block_size, b};
  std::sort(written.begin(), written.end());
  const auto share_of = [D, shares](int64_t b) { return b < D ? b * shares / D : shares; };
  for (int64_t b = 0; b < D; ++b) {
    for (int64_t j = skipped(seq_lens[b]) / block_size;
         j < (seq_lens[b] + block_size - 1) / block_size; ++j) {
      auto at = std::lower_bound(written.begin(), written.end(),
                                 std::pair<int64_t, int64_t>{tables[b * width + j], 0});
      for (; at != written.end() && at->first == tables[b * width + j]; ++at) {
        if (share_of(at->second) != share_of(b)) return kOneRun;
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
// step back by about half the time it lost. Beside a process busy 0.4 ms every 3 ms
// (alternate steps), 64 decodes 59.2-68.6 ms against 62.2-71.6 without the handover (16
// decodes 17.7-19.3 against 18.4-19.9); quiet, the same. Same numbers as run() over
// all rows (row_shares says when; an unlinked row's numbers never depend on its thread
// or the rows beside it); with `rows`, the rows each range kept, in order.
template <typename T, typename C>
inline torch::Tensor DecodeLayers::run_in_shares(
    int64_t shares, torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
    const int64_t* slots, const int64_t* seq_lens, const int64_t* tables, int64_t width,
    const torch::Tensor& kv_cache, const torch::Tensor* rows, bool handover,
    const LoraRows* lora) const {
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
        const c10::optional<LoraRows> adapters =
            lora != nullptr ? c10::optional<LoraRows>(lora->narrowed(b, work.n)) : c10::nullopt;
        out = run<T, C>(part, cos.narrow(0, b, work.n), sin.narrow(0, b, work.n), slots + b,
                        work.n, seq_lens + b, tables + b * width, width, {}, kv_cache,
                        rows != nullptr ? &work.wanted : nullptr, /*share=*/true, work.layer,
                        &keep, adapters ? &*adapters : nullptr);
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
// keeps arriving, most steps carry a new prompt: run as one, none of them would run its
// decodes in shares (nor fetch their K/V ahead). On a Zen 4 EPYC (fast mode,
// serve_load.py's 64-stream schedule): in process no change (mixed steps of < 100
// prompt tokens 106.6 / 105.7 ms against 105.2 / 106.1: the chunks' run reads every
// weight again); over HTTP, a fresh server each, two pairs, 379.1 / 380.1 tok/s at 64
// streams against 359.2 / 373.6, at 16 346.9 / 320.9 against 323.0 / 339.1.
template <typename T, typename C>
inline torch::Tensor DecodeLayers::run_split(
    int64_t shares, torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
    const int64_t* slots, int64_t D, const int64_t* seq_lens, const int64_t* tables,
    int64_t width, const std::vector<Prompt>& prompts, const torch::Tensor& kv_cache,
    const torch::Tensor* rows, bool handover, const LoraRows* lora) const {
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
  c10::optional<LoraRows> decode_lora, prompt_lora;  // the two runs' rows' adapters
  if (lora != nullptr) {
    decode_lora = lora->narrowed(0, D);
    prompt_lora = lora->narrowed(D, B - D);
  }
  torch::Tensor decoded =
      run_in_shares<T, C>(shares, decode_rows, cos.narrow(0, 0, D), sin.narrow(0, 0, D), slots,
                          seq_lens, tables, width, kv_cache, rows ? &decode_kept : nullptr,
                          handover, decode_lora ? &*decode_lora : nullptr);
  torch::Tensor prompted =
      run<T, C>(prompt_rows, cos.narrow(0, D, B - D), sin.narrow(0, D, B - D), slots + D, 0,
                seq_lens, tables, width, moved, kv_cache, rows ? &prompt_kept : nullptr, false,
                0, nullptr, prompt_lora ? &*prompt_lora : nullptr);
  return rows != nullptr ? at::cat({decoded, prompted}) : hidden;
}

// Queues, on this thread (side_prefetch.h), layer l + 1's K/V blocks of the B decode rows
// (each row's K blocks, then its V blocks: the order attend_all reads them), paced to
// drain evenly over the products left before that layer's attention: layer l's o,
// gate_up and down and layer l + 1's qkv, each micro-kernel of tiled::kBf16Rows rows calling
// some() once a block of 32 inputs (drained by the end of down instead, or at 0.85x /
// 1.15x the even pace, 64-row steps measured no faster). A row's new token is fetched
// before it is written: a line too many, no error. With `lora`, the rows' adapter
// weights (LoraSlots::queue_lines) of layer l's o, gate_up and down before the K/V, and
// of layer l + 1's qkv after it: each in the queue about where the product before its
// add drains it.
template <typename C>
inline void DecodeLayers::queue_next_kv(int64_t l, int64_t B, const C* k_cache,
                                        const C* v_cache, int64_t layer_stride,
                                        const int64_t* seq_lens, const int64_t* tables,
                                        int64_t width, int64_t block_size,
                                        int64_t decodes, const LoraRows* lora) const {
  side::Queue& queue = side::queue();
  queue.clear();
  if (l + 1 >= num_layers()) return;
  const int64_t kv_size = num_kv_heads_ * head_dim_, H = layers_[0].input_norm.numel();
  const int64_t block_bytes = block_size * kv_size * static_cast<int64_t>(sizeof(C));
  const Layer &layer = layers_[l], &next = layers_[l + 1];
  int64_t lines = 0;
  // the rows' LoRA weights of this layer's products to come, each before its product's
  // (LoraSlots::add_rows reads them right after it), then the next layer's K/V, then the
  // LoRA weights of its qkv product
  if (lora != nullptr)
    for (const LoraSlots* slots : {&layer.o_lora, &layer.gate_up_lora, &layer.down_lora})
      lines += slots->queue_lines(*lora, queue);
  for (int64_t b = 0; b < decodes; ++b)
    for (const C* cache : {k_cache + layer_stride, v_cache + layer_stride})
      for (int64_t j = skipped(seq_lens[b]) / block_size;
           j < (seq_lens[b] + block_size - 1) / block_size; ++j) {
        queue.add(cache + tables[b * width + j] * block_size * kv_size, block_bytes);
        lines += block_bytes / 64;
      }
  if (lora != nullptr) lines += next.qkv_lora.queue_lines(*lora, queue);
  const int64_t q_size = num_heads_ * head_dim_, I = intermediate_;
  const auto calls = [B](const Linear& w, int64_t N, int64_t K) {  // of one product of B rows
    if (w.kind == kQ4Exact) return q4_f32_queue_calls(B, N / 16, K / tiled::kBlock);
    return (B + tiled::kBf16Rows - 1) / tiled::kBf16Rows * (N / 16) * (K / tiled::kBlock);
  };
  queue.pace(lines, calls(layer.o, H, q_size) + calls(layer.gate_up, 2 * I, H) +
                        calls(layer.down, H, I) + calls(next.qkv, q_size + 2 * kv_size, H));
}
