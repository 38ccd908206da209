// What every kernel reading the tiled layouts shares (Q4Weight and Q8Weight in
// tessera/workers/quant/int4.py; the layouts are described in q4_bf16.cpp and
// q8_bf16.cpp): q4_bf16.cpp, q8_bf16.cpp and tiled_f32.cpp. Their checks (each kernel
// checks its own x dtype first; messages start with the kernel's name), the prefetch of
// the next tile (NextTile), and the AMX switch.

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

// The next tile's weights, asked for a block at a time while the kernel goes through this
// tile: before its block b (in its first group of rows; the buffered kernels, as they
// expand or dequantise block b), a kernel calls next.block(b), which prefetches block b's
// bytes of the next tile and its scales (and mins). Each block's few lines then arrive
// while blocks compute. Asking for the whole next tile as a tile starts (from 5 rows up;
// below that the hardware's prefetcher alone) was slower at every row count, a thread's
// share of a decode step above all: the bf16 x Q4 kernel on 30 distinct layers' weights
// (huge pages, a Zen 4 EPYC), one thread, 1 / 8 / 16 / 32 / 64 rows: 3.02 / 9.9 / 19.3 /
// 37.5 / 75.4 ms against 3.93 / 12.4 / 22.2 / 41.0 / 81.0 (docs/architecture.md).
struct NextTile {
  const char* bytes = nullptr;  // the next tile's block 0; nullptr: no next tile
  int64_t block_bytes = 0;      // its weight bytes a block
  const uint16_t* d = nullptr;  // its scales, 16 fp16 a block
  const uint16_t* m = nullptr;  // its mins (Q4_1), else its scales again: never nullptr

  // No branch on m here: GCC 12 at -O2 and -O3 dropped every prefetch of this function
  // (the loop's too) when the mins' prefetch sat under `if (m != nullptr)`, or behind
  // `m ? m : d`, after the check on bytes.
  inline void block(int64_t b) const {
    if (bytes == nullptr) return;
    const char* at = bytes + b * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(at + line, 0, 3);
    __builtin_prefetch(d + b * 16, 0, 3);
    __builtin_prefetch(m + b * 16, 0, 3);
  }
};

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
