// A row-wise argmax taken while a kernel writes its float32 output [T, N] tile by tile
// (16 columns at a time): the LM head's logits, whose argmax is a greedy step's token. The
// same answer as argmax_rows (rows.cpp) over the finished output, without reading it back
// from memory: a 64-row step's [64, 49152] logits are 12.6 MB, and that read took
// ~0.6 ms of the step.
//
// Each call of the kernel's parallel loop covers a contiguous range of tiles, in
// increasing order, for a contiguous range of rows (all of them, or one pass's). Its
// `Range` keeps, per row and lane, the largest value seen and the tile it first came in (a
// strict comparison keeps the first of equals), updated right after each tile's values
// are stored (still in L1). `result` merges, for each row, the ranges holding it in column
// order: the row's maximum at its smallest column, as argmax_rows gives it. A row holding
// a NaN is read again whole by argmax_row (its first NaN), as argmax_rows does. Included
// inside a kernel file's anonymous namespace, where vec16.h's types are compiled in
// (TESSERA_VEC16); the file includes <algorithm>, <limits>, <mutex>, <vector>, rows.h
// (argmax_row_of) and vec16.h.

class TileArgmax {
 public:
  struct Range {
    int64_t first_tile = 0;
    int64_t first_row = 0;       // its rows: first_row .. first_row + best.size() - 1
    std::vector<vec16::F> best;  // [rows]: each lane's largest value
    std::vector<vec16::I> tile;  // [rows]: the tile (int32 lanes) that value first came in
    std::vector<uint8_t> nan;   // [rows]: whether the row held a NaN
  };

  explicit TileArgmax(int64_t rows) : rows_(rows) {}

  // A range from tile first_tile on, over `rows` rows from first_row (-1: to the last).
  Range begin(int64_t first_tile, int64_t first_row = 0, int64_t rows = -1) const {
    if (rows < 0) rows = rows_ - first_row;
    Range range;
    range.first_tile = first_tile;
    range.first_row = first_row;
    range.best.assign(rows, vec16::set1(-std::numeric_limits<float>::infinity()));
    range.tile.assign(rows, vec16::set1_i(static_cast<int32_t>(first_tile)));
    range.nan.assign(rows, 0);
    return range;
  }

  // Rows r0 .. r0 + rows - 1 of tile `tile`, just stored at y (row r0's first column of
  // the tile; row stride N).
  void scan(Range& range, const float* y, int64_t N, int64_t tile, int64_t r0,
            int64_t rows) const {
    const vec16::I here = vec16::set1_i(static_cast<int32_t>(tile));
    for (int64_t r = 0, i = r0 - range.first_row; r < rows; ++r, ++i) {
      const vec16::F v = vec16::load(y + r * N);
      vec16::F& best = range.best[i];
      const vec16::Mask above = vec16::greater(v, best);
      best = vec16::select(above, best, v);
      range.tile[i] = vec16::select(above, range.tile[i], here);
      range.nan[i] |= vec16::any_nan(v);
    }
  }

  void end(Range&& range) {
    const std::lock_guard<std::mutex> hold(lock_);
    ranges_.push_back(std::move(range));
  }

  // Whether a row held a NaN (result then reads it again from y), once every range ended.
  bool any_nan() const {
    for (const Range& range : ranges_)
      for (const uint8_t nan : range.nan)
        if (nan) return true;
    return false;
  }

  // Each row's argmax of y [T, N] (int64 [T]), once every range has ended. y is read only
  // for a row that held a NaN (any_nan), and may be nullptr where none did.
  void result(const float* y, int64_t N, int64_t* out) {
    std::sort(ranges_.begin(), ranges_.end(),
              [](const Range& a, const Range& b) { return a.first_tile < b.first_tile; });
    float values[16];
    int32_t tiles[16];
    for (int64_t r = 0; r < rows_; ++r) {
      bool nan = false;
      float best = 0.0f;
      int64_t column = -1;
      for (const Range& range : ranges_) {
        const int64_t i = r - range.first_row;
        if (i < 0 || i >= static_cast<int64_t>(range.best.size())) continue;  // not its rows
        nan |= range.nan[i] != 0;
        vec16::store(values, range.best[i]);
        vec16::store_i(tiles, range.tile[i]);
        const float top = vec16::reduce_max(range.best[i]);
        if (column >= 0 && !(top > best)) continue;  // an earlier range holds it first
        int64_t first = -1;
        for (int lane = 0; lane < 16; ++lane) {
          const int64_t at = int64_t{tiles[lane]} * 16 + lane;
          if (values[lane] == top && (first < 0 || at < first)) first = at;
        }
        best = top;
        column = first;
      }
      out[r] = nan ? argmax_row_of(y + r * N, N) : column;
    }
  }

 private:
  int64_t rows_;
  std::mutex lock_;
  std::vector<Range> ranges_;
};
