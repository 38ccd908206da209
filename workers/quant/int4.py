"""The fast mode's weights: GGUF Q4_0 / Q4_1 matrices in torch's int4 layout, with
bf16 activations, and the row count from which a dense bf16 matmul wins.

torch's ``_weight_int4pack_mm_for_cpu`` is vectorised for bf16 activations and computes,
per group of 32 inputs, ``w = (q - 8) * scale + zero``. GGUF's blocks map onto that
exactly in form:

    Q4_0  w = d * (q - 8)    scale = d, zero = 0
    Q4_1  w = d * q + m      scale = d, zero = m + 8 d

but torch keeps ``scale`` and ``zero`` in bf16, so the fast mode's weights differ from
the file's by bf16 rounding of those two numbers (its quality contract is tested against
the exact mode, ``tests/engine/test_fast_mode.py``).

One row of activations reads the packed ~0.5 byte per weight; many rows are faster as a
dense bf16 GEMM (the int4 kernel dequantises per row block). ``int4_row_limit`` measures
where the two cross on this CPU, once per weight shape and process.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from tessera.workers.quant.blocks import BLOCK_SIZE, PackedWeight, QuantType

logger = logging.getLogger(__name__)

#: torch's int4 layout packs this many inner K tiles (2, 4 or 8; 2 fits every K % 32).
INNER_K_TILES = 2
#: Row counts at which ``int4_row_limit`` compares the two kernels.
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A Q4 matrix ``[out, in]`` in torch's int4 CPU layout."""

    packed: torch.Tensor  # uint8, torch's layout
    scales_and_zeros: torch.Tensor  # bf16 [in / 32, out, 2]
    out_features: int
    in_features: int

    @staticmethod
    def supports(weight: PackedWeight) -> bool:
        return weight.qtype in (QuantType.Q4_0, QuantType.Q4_1)

    @classmethod
    def from_packed(cls, weight: PackedWeight) -> Int4Weight:
        if not cls.supports(weight):
            raise ValueError(f"Int4Weight: {weight.qtype.name} is not a 4-bit type")
        out, in_features = weight.shape
        blocks = weight.qs.view(out, in_features // BLOCK_SIZE, BLOCK_SIZE // 2)
        # element j of a block in the low nibble of byte j, element j + 16 in the high one
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(out, in_features)
        d = weight.scales.float()  # [out, in / 32]
        if weight.qtype is QuantType.Q4_1:
            zero = weight.mins.float() + 8.0 * d
        else:
            zero = torch.zeros_like(d)
        scales_and_zeros = torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), INNER_K_TILES
        )
        return cls(packed, scales_and_zeros.to(torch.bfloat16), out, in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` bf16 -> ``[T, out]`` bf16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, BLOCK_SIZE, self.scales_and_zeros
        )


@functools.cache
def int4_row_limit(out_features: int, in_features: int) -> int:
    """The most rows for which the int4 kernel beats a dense bf16 GEMM on this CPU
    (0: never), timed on a matrix of the given shape. Measured once per shape and
    process (~0.2 s each; SmolLM2 has five shapes)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(
        0, 16, (out_features, in_features // 2), dtype=torch.uint8, generator=generator
    )
    scales = torch.full((out_features, in_features // BLOCK_SIZE), 0.01, dtype=torch.float16)
    weight = Int4Weight.from_packed(PackedWeight(QuantType.Q4_0, q, scales, None))
    dense = torch.randn(in_features, out_features, generator=generator).to(torch.bfloat16)
    limit = 0
    table = []
    for rows in PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        int4 = _best_time(lambda x=x: weight.matmul(x))
        gemm = _best_time(lambda x=x: torch.mm(x, dense))
        table.append(f"{rows}: int4 {int4 * 1e6:.0f} us, bf16 {gemm * 1e6:.0f} us")
        if int4 < gemm:
            limit = rows
        else:
            break
    logger.info("int4 vs dense bf16 (%dx%d): %s; int4 up to %d rows",
                out_features, in_features, "; ".join(table), limit)  # fmt: skip
    return limit


def _best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
