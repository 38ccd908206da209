// What every kernel reading the tiled layouts shares (Q4Weight and Q8Weight in
// tessera/workers/quant/int4.py; the layouts are described in q4_bf16.cpp and
// q8_bf16.cpp): q4_bf16.cpp, q8_bf16.cpp and tiled_f32.cpp. Their checks (each kernel
// checks its own x dtype first; messages start with the kernel's name), the prefetch of
// the next tile, and the AMX switch.

#pragma once

#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace tessera::tiled {

constexpr int64_t kBlock = 32;  // inputs per GGUF block
// Rows of x one micro-kernel of the bf16 x Q4 / Q8_0 kernels holds (bf16_blocks.h's
// kRows; decode_layers.cpp paces its K/V queue by it, side_prefetch.h)
constexpr int kBf16Rows = 8;
constexpr int kQ4_0 = 2;        // GGML type ids (gguf.GGMLQuantizationType)
constexpr int kQ4_1 = 3;

// A tile's weights, asked for before their turn: the kernels over these layouts, given
// more than kPrefetchRows rows, prefetch the next tile's bytes as they start on one.
// Decode steps of the built-in model (2 threads, Zen 5, weights from memory, with and
// without in alternate steps) at 8 / 16 / 64 sequences: the fast mode's 1.12-1.16x /
// 1.09-1.11x / 1.02x faster, the exact mode's 1.03x / 1.00-1.02x / 1.00-1.02x (its
// float32 kernel waits on its FMAs more than on memory). Through 1-4 rows (a tile gone
// through quickly, the hardware's prefetcher following) it measured no gain.
constexpr int64_t kPrefetchRows = 4;
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* at = static_cast<const char*>(p);
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(at + line, 0, 3);
}

// Whether the bf16 x Q4 / Q8_0 kernels take their AMX path where the CPU has one
// (amx_tiles.h); set by use_amx(). One flag for the process (an inline function's static).
inline std::atomic<bool>& amx_wanted() {
  static std::atomic<bool> wanted{true};
  return wanted;
}

// Whether Linux lets this process use AMX tiles (asked once): ARCH_REQ_XCOMP_PERM (0x1023)
// for XFEATURE_XTILEDATA (18). Without the grant a tile instruction kills the process;
// the grant covers every thread of the process.
inline bool amx_granted() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

struct Shape {
  int64_t tiles, nb, K, N, T;  // N = 16 tiles outputs, K = 32 nb inputs, T rows of x
};

// d fp16 [N / 16, K / 32, 16], for T rows of x.
inline Shape check_d(const char* name, const torch::Tensor& d, int64_t T) {
  TORCH_CHECK(d.dim() == 3 && d.size(2) == 16 && d.scalar_type() == torch::kHalf &&
                  d.is_contiguous(),
              name, ": d must be a contiguous fp16 [N / 16, K / 32, 16] tensor");
  return Shape{d.size(0), d.size(1), d.size(1) * kBlock, d.size(0) * 16, T};
}

// x [T, K] (2-D, on the CPU) against d fp16 [N / 16, K / 32, 16].
inline Shape check_x_and_d(const char* name, const torch::Tensor& x, const torch::Tensor& d) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), name, ": x must be a [T, K] CPU tensor");
  const Shape s = check_d(name, d, x.size(0));
  TORCH_CHECK(x.size(1) == s.K, name, ": x has ", x.size(1), " features, the weight takes ",
              s.K);
  return s;
}

// Q4Weight's type, nibbles (256 bytes a tile and block) and m (Q4_1 only, shaped like d).
inline void check_q4(const char* name, const Shape& s, const torch::Tensor& nibbles,
                     const torch::Tensor& d, const c10::optional<torch::Tensor>& m,
                     int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1, name, ": qtype ", qtype, " is not Q4_0/Q4_1");
  TORCH_CHECK(nibbles.scalar_type() == torch::kUInt8 && nibbles.is_contiguous() &&
                  nibbles.numel() == s.tiles * s.nb * 256,
              name, ": nibbles must be contiguous uint8 with ", s.tiles * s.nb * 256, " bytes");
  TORCH_CHECK((qtype == kQ4_1) == m.has_value(), name, ": mins go with Q4_1 only");
  if (m)
    TORCH_CHECK(m->sizes() == d.sizes() && m->scalar_type() == torch::kHalf && m->is_contiguous(),
                name, ": m must be shaped like d");
}

// Q8Weight's qs (512 int8 a tile and block).
inline void check_q8(const char* name, const Shape& s, const torch::Tensor& qs) {
  TORCH_CHECK(qs.scalar_type() == torch::kInt8 && qs.is_contiguous() &&
                  qs.numel() == s.tiles * s.nb * 512,
              name, ": qs must be contiguous int8 with ", s.tiles * s.nb * 512, " bytes");
}

}  // namespace tessera::tiled
