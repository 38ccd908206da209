// What rows.cpp offers the other kernel files (the extension's own module binds the rest).
#pragma once

#include <cstdint>

namespace tessera {

// argmax_rows' answer for one row of n floats: its first maximum, or its first NaN.
int64_t argmax_row_of(const float* x, int64_t n);

}  // namespace tessera
