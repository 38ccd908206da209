// Row-wise reductions the sampler runs over a step's logits [rows, vocab].
//
// torch's argmax over the last dimension of a [64, 49152] float32 tensor took 1.35 ms on
// 2 AVX-512 cores (amax: 0.07 ms); at 64 running sequences that was a third of a step's
// host time. Both passes (the maximum, then its first index) run 16 floats at a time
// (vec16.h: AVX-512 or AVX2): 0.35 ms at 64 rows on AVX-512 against 0.74 with a scalar
// second pass (one pass keeping each lane's maximum and first index measured the same:
// the rows' reads set the time). argmax_rows gives the same answer as
// torch.argmax(x, dim=1): the first index
// of each row's maximum, or of the row's first NaN where it has one. Also bf16_rounded,
// which lets the tests check the native decode stack's bf16 rounding (vec16.h).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "rows.h"
#include "vec16.h"

namespace tessera {

namespace {

int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if TESSERA_VEC16
  vec16::F m = vec16::set1(best);
  uint32_t unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const vec16::F v = vec16::load(x + i);
    unordered |= vec16::bits(vec16::unordered(v));
    m = vec16::max(m, v);
  }
  best = vec16::reduce_max(m);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i]))
      nan = true;
    else if (x[i] > best)
      best = x[i];
  }
  int64_t j = 0;
#if TESSERA_VEC16
  // the first index holding the maximum (or a NaN), 16 at a time
  const vec16::F target = vec16::set1(best);
  for (; j + 16 <= n; j += 16) {
    const vec16::F v = vec16::load(x + j);
    const uint32_t hit = vec16::bits(nan ? vec16::unordered(v) : vec16::equal(v, target));
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < n; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == best) return j;
  return {};  // not reached: some element equals the maximum
}

}  // namespace

int64_t argmax_row_of(const float* x, int64_t n) { return argmax_row(x, n); }

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  x.size(1) > 0 && x.device().is_cpu(),
              "argmax_rows: x must be a contiguous float32 CPU tensor [rows, n > 0]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * n, n);
  });
  return out;
}

// x rounded to bf16 as the native decode stack rounds its row-wise steps' values
// (vec16::store_bf16, and vec16::round_bf16 back to float32), 16 at a time; the rest
// through c10::BFloat16. For tests: both must be x.to(torch.bfloat16)'s bits.
std::tuple<torch::Tensor, torch::Tensor> bf16_rounded(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  x.device().is_cpu(),
              "bf16_rounded: x must be a contiguous float32 CPU tensor [n]");
  const int64_t n = x.size(0);
  auto stored = torch::empty({n}, x.options().dtype(torch::kBFloat16));
  auto rounded = torch::empty({n}, x.options());
  const float* p = x.data_ptr<float>();
  auto* s = stored.data_ptr<at::BFloat16>();
  float* r = rounded.data_ptr<float>();
  int64_t i = 0;
#if TESSERA_VEC16
  for (; i + 16 <= n; i += 16) {
    const vec16::F v = vec16::load(p + i);
    vec16::store_bf16(reinterpret_cast<uint16_t*>(s + i), v);
    vec16::store(r + i, vec16::round_bf16(v));
  }
#endif
  for (; i < n; ++i) {
    s[i] = static_cast<at::BFloat16>(p[i]);
    r[i] = static_cast<float>(s[i]);
  }
  return {stored, rounded};
}

void register_rows(pybind11::module& m) {
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=1) of a float32 [rows, n] tensor",
        pybind11::arg("x"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("bf16_rounded", &bf16_rounded,
        "x rounded to bf16 as the native decode stack rounds (stored as bf16, and as float32)",
        pybind11::arg("x"));
}

}  // namespace tessera
