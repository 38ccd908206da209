#pragma once
// A thread's queue of byte ranges that the Q4 kernels (q4_bf16.cpp's tile_direct;
// tiled_f32.cpp's tile_f32 and pair_f32, the exact mode's) ask the caches for a few lines
// at a time, between their blocks, while they compute.
//
// What it is for: a decode step's attention reads every running sequence's K/V of a layer
// once (64 sequences of ~210 tokens: ~10 MB a layer in float16, ~310 MB a step), far more
// than the caches keep from one step to the next, so on its own it streams from memory
// with the cores' arithmetic idle (22% of a 64-row step on a Zen 4 EPYC). The layer's
// products (~80% of its time) are bound by arithmetic with memory mostly idle. When a
// thread runs its share of a step's rows through every layer alone (decode_layers.cpp's
// run_in_shares), it queues the next layer's K/V blocks of its rows as it leaves a
// layer's attention, and the products until the next attention (the rest of this
// layer's, the next layer's qkv) fetch them a few lines per block of weights: by then they
// sit in L2 / L3. (Not measured: a burst of them before the products would wait on
// memory as attention itself does; the point is that the fetches overlap arithmetic.)
//
// A prefetch never changes a number: the kernel's sums are the same with or without.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace tessera {
namespace side {

// Whether run_in_shares queues the next layer's K/V (use_kv_prefetch sets it; one flag
// for the process).
inline std::atomic<bool>& kv_prefetch_wanted() {
  static std::atomic<bool> wanted{true};
  return wanted;
}

// Lines asked for so far by every thread (kv_prefetched_lines reads it): a test's proof
// that the path ran.
inline std::atomic<int64_t>& lines_asked() {
  static std::atomic<int64_t> lines{0};
  return lines;
}

class Queue {
 public:
  // Drops what is left (a queue is only good for the layer it was filled for).
  void clear() {
    lines_asked().fetch_add(asked_, std::memory_order_relaxed);
    asked_ = 0;
    at_ = end_ = nullptr;
    next_ = 0;
    ranges_.clear();
  }
  // bytes from p, fetched after the ranges added before (one range with the last when
  // they touch).
  void add(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    if (!ranges_.empty() && ranges_.back().second == c) ranges_.back().second = c + bytes;
    else ranges_.emplace_back(c, c + bytes);
  }
  bool empty() const { return ranges_.empty(); }
  // Whether some() has asked for a line since the queue was filled: the kernels running
  // meanwhile drain it (the bf16 AMX path never does).
  bool draining() const { return asked_ > 0; }
  // Paces some() to ask for `lines` evenly over the next `calls` calls (in 1/256ths of a
  // line a call, at most 32 lines), so that the queue drains just as they end.
  void pace(int64_t lines, int64_t calls) {
    const int64_t each = (lines * 256 + calls - 1) / std::max<int64_t>(calls, 1);
    rate_ = static_cast<int>(std::clamp<int64_t>(each, 1, 32 * 256));
    credit_ = 0;
  }
  // The next few lines, into L2 (and below).
  inline void some() {
    credit_ += rate_;
    const int lines = credit_ >> 8;
    credit_ &= 255;
    for (int i = 0; i < lines; ++i) {
      if (at_ >= end_) {
        if (next_ >= ranges_.size()) return;
        at_ = ranges_[next_].first;
        end_ = ranges_[next_].second;
        ++next_;
      }
      __builtin_prefetch(at_, 0, 2);  // read, into L2 (T1)
      at_ += 64;
      ++asked_;
    }
  }

 private:
  const char* at_ = nullptr;
  const char* end_ = nullptr;
  size_t next_ = 0;
  int rate_ = 256;   // lines a call, x 256
  int credit_ = 0;   // lines owed, x 256
  int64_t asked_ = 0;
  std::vector<std::pair<const char*, const char*>> ranges_;
};

// This thread's queue.
inline Queue& queue() {
  static thread_local Queue q;
  return q;
}

}  // namespace side
}  // namespace tessera
