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

namespace tessera {

// Pieces per thread: enough that the last ones are short, few enough that each still
// holds several tiles of a step's smallest projection. Users: the tiled float32 kernel's
// decode products (tiled_f32.cpp) and the native stack's decode attention, whose rows
// are cut into this many parts of equal cost per thread (decode_layers.cpp).
constexpr int64_t kPiecesPerThread = 8;

// f(piece_begin, piece_end) over consecutive pieces covering [begin, end), each at least
// `grain` long, in increasing order within a thread (not across threads).
template <typename Fn>
void parallel_pieces(int64_t begin, int64_t end, int64_t grain, const Fn& f) {
  if (end <= begin) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t piece =
      std::max<int64_t>(grain, (end - begin + threads * kPiecesPerThread - 1) /
                                   (threads * kPiecesPerThread));
  if (threads == 1 || end - begin <= piece) return f(begin, end);
  std::atomic<int64_t> next{begin};
  const int64_t pieces = (end - begin + piece - 1) / piece;
  at::parallel_for(0, std::min(threads, pieces), 1, [&](int64_t, int64_t) {
    for (int64_t first = next.fetch_add(piece, std::memory_order_relaxed); first < end;
         first = next.fetch_add(piece, std::memory_order_relaxed)) {
      f(first, std::min(end, first + piece));
    }
  });
}

}  // namespace tessera
