// A kernel's parallel loop whose work torch's threads claim piece by piece.
//
// at::parallel_for gives each thread one fixed share and ends at a barrier: when another
// process takes a thread's core for a while (a server's front end on the same cores does
// so ~1,000 times a second), the other thread finishes its share and waits. Here each
// thread takes the next unclaimed piece until none is left, so a thread that was off its
// core delays only the piece it held. Which thread computes a piece never changes what
// the piece computes: the results are the same as with at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tessera {

// Pieces per thread: enough that the last ones are short, few enough that each still
// holds several tiles of a step's smallest projection. Users: the tiled float32 kernel's
// decode products (tiled_f32.cpp) and the native stack's decode attention, whose rows
// are cut into this many parts of equal cost per thread (decode_layers.cpp).
constexpr int64_t kPiecesPerThread = 8;

// f(pass, piece_begin, piece_end) for each pass 0 .. passes - 1 over consecutive pieces
// covering [begin, end), each at least `grain` long: every thread takes the passes in
// order and in each the next unclaimed piece until none is left, then goes on to the next
// pass without waiting for the others (so the threads work on one pass or two adjacent
// ones at a time). Within a thread, pieces come in increasing order within a pass.
template <typename Fn>
void parallel_pieces_in_passes(int64_t passes, int64_t begin, int64_t end, int64_t grain,
                               const Fn& f) {
  if (end <= begin || passes <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t piece =
      std::max<int64_t>(grain, (end - begin + threads * kPiecesPerThread - 1) /
                                   (threads * kPiecesPerThread));
  if (threads == 1 || end - begin <= piece) {
    for (int64_t p = 0; p < passes; ++p) f(p, begin, end);
    return;
  }
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[passes]);
  for (int64_t p = 0; p < passes; ++p) next[p].store(begin, std::memory_order_relaxed);
  const int64_t pieces = (end - begin + piece - 1) / piece;
  at::parallel_for(0, std::min(threads, pieces), 1, [&](int64_t, int64_t) {
    for (int64_t p = 0; p < passes; ++p) {
      for (int64_t first = next[p].fetch_add(piece, std::memory_order_relaxed); first < end;
           first = next[p].fetch_add(piece, std::memory_order_relaxed)) {
        f(p, first, std::min(end, first + piece));
      }
    }
  });
}

// f(piece_begin, piece_end) over consecutive pieces covering [begin, end), each at least
// `grain` long, in increasing order within a thread (not across threads): one pass.
template <typename Fn>
void parallel_pieces(int64_t begin, int64_t end, int64_t grain, const Fn& f) {
  parallel_pieces_in_passes(1, begin, end, grain,
                            [&](int64_t, int64_t first, int64_t last) { f(first, last); });
}

}  // namespace tessera
