"""``quant_matmul`` on CUDA in one Triton kernel: each program dequantises a tile of a
packed GGUF weight's blocks in registers and multiplies it with its rows of ``x``.

float32 in, float32 sums, float32 out, as the CPU's exact kernel: a weight element is
what ``gguf.dequantize`` gives (fp16 scales widened exactly; Q4_1's ``d * q + m`` kept
as two roundings, so the kernel is compiled without fused multiply-adds), and only the
order of the sums differs from ``x @ dequantised.T``. A step reads the weights as the
file stores them (SmolLM2: ~96 MB instead of 538 MB dense), with no dequantised copy.
It is not as fast as cuBLAS on dense float32 weights for a model this small, whose
products are too small to fill the GPU (``KB`` below has the figures):
``--no-packed-weights`` trades the memory for that speed.

Triton ships with CUDA builds of torch; without it ``available()`` is False and
``quant_matmul`` dequantises a chunk of rows at a time in torch before each product.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tessera.workers.quant.blocks import BLOCK_SIZE, PackedWeight

#: The tiling ``gguf_mm`` uses unless told: 2 blocks of 32 per loop step, 16 output
#: features per program, each output's blocks shared by up to 4 programs. The best of the
#: variants ``benchmarks/cuda_quant_matmul.py`` times, at 1, 16 and 64 rows alike (an
#: H100, one SmolLM2 step's 121 matmuls: 1.61 / 1.65 / 3.27 ms, against 2.60 / 2.62 /
#: 4.78 with 1 block, 32 features and no split, and 3.66 / 4.72 / 4.94 for the torch
#: path; cuBLAS on dense float32 weights 0.82 / 1.24 / 1.51 ms).
KB, TILE_N, SPLIT = 2, 16, 4
#: Rows up to which the blocks are split (measured there): more rows fill the GPU with
#: programs anyway, and the partial sums would take ``splits`` times the output's memory.
SPLIT_ROWS = 64


@functools.cache
def _kernel() -> Any | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gguf_mm(
        x_ptr, qs_ptr, d_ptr, m_ptr, y_ptr, M, N, NB, PER,
        stride_x, stride_q, stride_s, stride_y, stride_split,
        QTYPE: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr, KB: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(1) * TILE_M + tl.arange(0, TILE_M)
        cols = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
        kk = tl.arange(0, 32 * KB)  # KB blocks of 32 per loop step
        j, kb = kk % 32, kk // 32  # element within its block, block within the step
        row_ok = rows[:, None] < M
        col_ok = cols[:, None] < N
        first = tl.program_id(2) * PER  # this program's share of the blocks (split-K)
        stop = tl.minimum(first + PER, NB)
        acc = tl.zeros((TILE_M, TILE_N), dtype=tl.float32)
        for b in range(first, stop, KB):
            blk = b + kb
            k_ok = (blk < stop)[None, :]
            x_at = x_ptr + rows[:, None] * stride_x + (blk * 32 + j)[None, :]
            x = tl.load(x_at, row_ok & k_ok, 0.0)
            w_ok = col_ok & k_ok
            scale_at = cols[:, None] * stride_s + blk[None, :]
            d = tl.load(d_ptr + scale_at, w_ok, 0.0).to(tl.float32)
            if QTYPE == 8:  # QuantType.Q8_0: w = d * q
                q = tl.load(qs_ptr + cols[:, None] * stride_q + (blk * 32 + j)[None, :], w_ok, 0)
                w = d * q.to(tl.float32)
            else:  # Q4: element j in byte j's low nibble, element j + 16 in its high one
                q_at = qs_ptr + cols[:, None] * stride_q + (blk * 16 + j % 16)[None, :]
                byte = tl.load(q_at, w_ok, 0).to(tl.int32)
                q = ((byte >> ((j // 16) * 4)[None, :]) & 15).to(tl.float32)
                if QTYPE == 3:  # QuantType.Q4_1: w = d * q + m
                    w = d * q + tl.load(m_ptr + scale_at, w_ok, 0.0).to(tl.float32)
                else:  # Q4_0: w = d * (q - 8)
                    w = d * (q - 8.0)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        split_at = tl.program_id(2).to(tl.int64) * stride_split  # past 2**31 elements
        y_at = y_ptr + split_at + rows[:, None] * stride_y + cols[None, :]
        tl.store(y_at, acc, row_ok & (cols[None, :] < N))

    return gguf_mm


def available() -> bool:
    """Whether the Triton kernel can run (Triton importable and a CUDA device)."""
    return torch.cuda.is_available() and _kernel() is not None


def gguf_mm(
    x: torch.Tensor, weight: PackedWeight, kb: int = KB, tile_n: int = TILE_N, split: int = SPLIT
) -> torch.Tensor:
    """``x [M, in]`` float32 (contiguous, on the weight's CUDA device) @ ``dequant(weight).T``
    -> ``[M, out]`` float32; the caller (``quant_matmul``) checks shapes and devices.
    ``kb``: blocks of 32 per loop step; ``split``: programs sharing each output's blocks
    (split-K, up to ``SPLIT_ROWS`` rows), their partial sums added after in a fixed order
    (deterministic)."""
    rows, nb, out = x.shape[0], weight.in_features // BLOCK_SIZE, weight.out_features
    per = -(-nb // (split if rows <= SPLIT_ROWS else 1))
    per = -(-per // kb) * kb  # blocks per split, a multiple of kb
    splits = -(-nb // per)
    y = x.new_empty(splits, rows, out)
    if rows == 0:
        return y[0]
    tile_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    grid = (-(-out // tile_n), -(-rows // tile_m), splits)
    # the kernel indexes rows by stride and mins by the scales' offsets
    qs, scales = weight.qs.contiguous(), weight.scales.contiguous()
    mins = scales if weight.mins is None else weight.mins.contiguous()  # read for Q4_1 only
    _kernel()[grid](
        x, qs, scales, mins, y,
        rows, out, nb, per,
        x.stride(0), qs.stride(0), scales.stride(0), y.stride(1), y.stride(0),
        QTYPE=int(weight.qtype), TILE_M=tile_m, TILE_N=tile_n, KB=kb,
        enable_fp_fusion=False,
    )  # fmt: skip
    return y[0] if splits == 1 else y.sum(0)
