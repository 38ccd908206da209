"""``Q8Weight``: a GGUF Q8_0 matrix (the tied LM head) in the native kernels' tiled layout,
multiplied in float32 (the exact mode) or with its inputs rounded to bf16 (the fast and
bfloat16 modes); a greedy step's argmax taken without writing the logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.workers.quant.blocks import BLOCK_SIZE, PackedWeight, QuantType
from tessera.workers.quant.kernels import native_kernels, remember_argmax


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """A Q8_0 matrix ``[out, in]`` in the native kernels' layout (described in
    ``csrc/q8_bf16.cpp``): ``qs`` int8 ``[out / 16, in / 32, 16, 16, 2]`` (per output
    tile and block, each pair of inputs for the tile's 16 outputs), the file's fp16 ``d``
    as ``[out / 16, in / 32, 16]``. A tied LM head.

    ``exact``: the exact mode's head, multiplied in float32 (``csrc/tiled_f32.cpp``, needs
    AVX-512 or AVX2); else the fast and bfloat16 modes', its inputs rounded to bf16
    (``csrc/q8_bf16.cpp``, needs AVX512_BF16)."""

    qs: torch.Tensor
    d: torch.Tensor
    out_features: int
    in_features: int
    exact: bool = False
    #: ``q8_screen_l1(qs, d)`` where this CPU build has the int8 screen of the argmax
    #: (``csrc/q8_screen.cpp``, AVX512_VNNI) and every scale is finite, else None
    screen: torch.Tensor | None = None

    @staticmethod
    def supports(weight: PackedWeight, exact: bool = False) -> bool:
        """Q8_0 with whole tiles of 16 outputs, on the CPU, and the kernel built for this
        CPU."""
        kernels = native_kernels() if weight.device.type == "cpu" else None
        if weight.qtype is not QuantType.Q8_0 or weight.out_features % 16 or kernels is None:
            return False
        return kernels.tiled_f32_available() if exact else kernels.q8_bf16_available()

    @classmethod
    def from_packed(cls, weight: PackedWeight, exact: bool = False) -> Q8Weight:
        if not cls.supports(weight, exact):
            raise ValueError(
                f"Q8Weight: {weight.qtype.name} [{weight.out_features}, {weight.in_features}] "
                "needs Q8_0, out_features % 16 == 0, the CPU and the "
                + ("AVX-512 or AVX2 float32 kernel" if exact else "AVX512_BF16 kernel")
            )
        out, in_features = weight.shape
        nb = in_features // BLOCK_SIZE
        # [tile, c, b, p, e] -> [tile, b, p, c, e]: output 16 tile + c, input 2p + e of block b
        q = weight.qs.view(out // 16, 16, nb, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
        d = weight.scales.view(out // 16, 16, nb).permute(0, 2, 1).contiguous()
        kernels = native_kernels()
        # (an infinite or NaN scale: no bound, and the head's own argmax gives its first NaN)
        screened = kernels.q8_screen_available() and bool(torch.isfinite(d).all())
        screen = kernels.q8_screen_l1(q.view(-1), d) if screened else None
        return cls(q.view(-1), d, out, in_features, exact, screen)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]``. Exact: float32 in and out. Else bf16 ``x`` gives
        bf16; float32 ``x`` is rounded to bf16 inside the kernel and gives the float32
        sums. Float32 outputs come with their rows' argmax, taken as the kernel wrote them
        (``remember_argmax``: a greedy step's tokens without reading the logits again)."""
        kernels = native_kernels()
        if x.dtype != torch.float32 and not self.exact:
            return kernels.q8_bf16_mm(x, self.qs, self.d)
        product = kernels.q8_f32_mm_argmax if self.exact else kernels.q8_bf16_mm_argmax
        y, indices = product(x, self.qs, self.d)
        remember_argmax(y, indices)
        return y

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of ``matmul(x)`` for float32 ``x [T, in]`` (int64 ``[T]``,
        ``argmax_rows``' answer: the first maximum, a row's first NaN), taken without
        writing the logits: a greedy decode step's [64, 49152] are 12.6 MB, and their
        stores and the scan of them took ~1.4 ms of the fast head's ~12. With ``screen``
        (and not the fast head on AMX, whose sums the screen does not repeat) through
        ``q8_screen_argmax``: an int8 screen, then the head's own sums for the tiles
        that can hold the maximum, the same indices (64 rows ~8 ms against ~10 fast and
        ~40 exact)."""
        kernels = native_kernels()
        if self.screen is not None and (self.exact or not kernels.amx_in_use()):
            return kernels.q8_screen_argmax(x, self.qs, self.d, self.screen, self.exact)
        product = kernels.q8_f32_argmax if self.exact else kernels.q8_bf16_argmax
        return product(x, self.qs, self.d)
