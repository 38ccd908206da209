"""``quant_matmul`` on CUDA in Triton kernels: each program dequantises a tile of a
packed GGUF weight's blocks in registers and multiplies it with its rows of ``x`` (one
row per program up to ``GEMV_ROWS`` rows, ``tl.dot`` tiles above).

float32 in, float32 sums, float32 out, as the CPU's exact kernel: a weight element is
what ``gguf.dequantize`` gives (fp16 scales widened exactly; Q4_1's ``d * q + m`` kept
as two roundings, so the kernels are compiled without fused multiply-adds), and only
the order of the sums differs from ``x @ dequantised.T``. A step reads the weights as
the file stores them (SmolLM2: ~96 MB instead of 538 MB dense), with no dequantised
copy. For a few rows that is as fast as cuBLAS on dense float32 weights or faster;
at 64 rows it is slower (``DOT`` below has the figures): ``--no-packed-weights``
trades the memory for that speed.

Triton ships with CUDA builds of torch; without it ``available()`` is False and
``quant_matmul`` dequantises a chunk of rows at a time in torch before each product.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tessera.workers.quant.blocks import BLOCK_SIZE, PackedWeight


@dataclass(frozen=True, slots=True)
class Tiling:
    """How ``gguf_mm`` splits one product into programs."""

    kernel: Literal["dot", "gemv"]  # dot: 16-64 rows x tile_n outputs; gemv: one row
    kb: int  # blocks of 32 per loop step (a power of two)
    tile_n: int  # output features per program (a power of two; tl.dot: 16 or more)
    split: int  # programs that share each output's blocks (split-K), at most
    warps: int  # a power of two
    stages: int  # software pipelining depth (1: none)

    def __post_init__(self) -> None:
        if self.kernel not in ("dot", "gemv"):
            raise ValueError(f"kernel: must be 'dot' or 'gemv', got {self.kernel!r}")
        smallest_n = 16 if self.kernel == "dot" else 1
        for name, low in (("kb", 1), ("tile_n", smallest_n), ("warps", 1)):
            value = getattr(self, name)
            if value < low or value & (value - 1):
                raise ValueError(f"{name}: must be a power of two >= {low}, got {value}")
        for name in ("split", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


#: The tilings ``gguf_mm`` uses unless told: the best of ~150 variants swept on an H200.
#: ``benchmarks/cuda_quant_matmul.py`` (one SmolLM2 step's 121 matmuls in a CUDA graph),
#: the same machine: 0.74 / 1.06 / 1.22 / 2.01 ms at 1 / 4 / 16 / 64 rows, against cuBLAS
#: on dense float32 weights 0.81 / 1.20 / 1.24 / 1.49, and 1.61 / 1.64 / 3.27 ms at 1 / 16
#: / 64 rows for one tiling at every row count (tl.dot, 2 blocks per step, split 4, 4
#: warps, 3 stages). Up to 4 rows one row per program: tl.dot pads
#: x to 16 rows, so most of its work was on zero rows. Short programs, one warp, no
#: pipelining and a deep split win: this model's products have too few outputs to fill
#: the GPU otherwise.
GEMV = Tiling("gemv", kb=1, tile_n=16, split=16, warps=1, stages=1)
DOT = Tiling("dot", kb=1, tile_n=16, split=16, warps=1, stages=1)
#: Rows up to which ``GEMV`` is used.
GEMV_ROWS = 4
#: Rows up to which the blocks are split (measured there): more rows fill the GPU with
#: programs anyway, and the partial sums would take ``splits`` times the output's memory.
SPLIT_ROWS = 64
#: Programs (output tiles x row tiles) past which a product is not split, for the same
#: two reasons (SmolLM2's tied head: 3,072 tiles of 16 of its 49,152 outputs).
SPLIT_PROGRAMS = 1024
#: The most programs a CUDA grid's second axis holds (the gemv kernel's rows).
GRID_ROWS = 65535


def tiling(rows: int) -> Tiling:
    """The tiling ``gguf_mm`` uses for ``rows`` rows of x unless told."""
    return GEMV if rows <= GEMV_ROWS else DOT


@functools.cache
def _kernels() -> dict[str, Any] | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def weights(qs_ptr, d_ptr, m_ptr, cols, blk, j, ok, stride_q, stride_s, QTYPE: tl.constexpr):
        """Dequantised weights ``[cols, element j of block blk]``, as gguf gives them."""
        scale_at = cols[:, None] * stride_s + blk[None, :]
        d = tl.load(d_ptr + scale_at, ok, 0.0).to(tl.float32)
        if QTYPE == 8:  # QuantType.Q8_0: w = d * q
            q = tl.load(qs_ptr + cols[:, None] * stride_q + (blk * 32 + j)[None, :], ok, 0)
            w = d * q.to(tl.float32)
        else:  # Q4: element j in byte j's low nibble, element j + 16 in its high one
            q_at = qs_ptr + cols[:, None] * stride_q + (blk * 16 + j % 16)[None, :]
            byte = tl.load(q_at, ok, 0).to(tl.int32)
            q = ((byte >> ((j // 16) * 4)[None, :]) & 15).to(tl.float32)
            if QTYPE == 3:  # QuantType.Q4_1: w = d * q + m
                w = d * q + tl.load(m_ptr + scale_at, ok, 0.0).to(tl.float32)
            else:  # Q4_0: w = d * (q - 8)
                w = d * (q - 8.0)
        return w

    @triton.jit
    def gguf_dot(
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
            ok = col_ok & k_ok
            w = weights(qs_ptr, d_ptr, m_ptr, cols, blk, j, ok, stride_q, stride_s, QTYPE)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        split_at = tl.program_id(2).to(tl.int64) * stride_split  # past 2**31 elements
        y_at = y_ptr + split_at + rows[:, None] * stride_y + cols[None, :]
        tl.store(y_at, acc, row_ok & (cols[None, :] < N))

    @triton.jit
    def gguf_gemv(
        x_ptr, qs_ptr, d_ptr, m_ptr, y_ptr, M, N, NB, PER,
        stride_x, stride_q, stride_s, stride_y, stride_split,
        QTYPE: tl.constexpr, TILE_N: tl.constexpr, KB: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(1)  # one row of x: products lane by lane, one sum per output
        cols = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
        kk = tl.arange(0, 32 * KB)
        j, kb = kk % 32, kk // 32
        col_ok = cols[:, None] < N
        first = tl.program_id(2) * PER
        stop = tl.minimum(first + PER, NB)
        acc = tl.zeros((TILE_N, 32 * KB), dtype=tl.float32)
        for b in range(first, stop, KB):
            blk = b + kb
            k_ok = (blk < stop)[None, :]
            x = tl.load(x_ptr + row * stride_x + (blk * 32 + j)[None, :], k_ok, 0.0)
            ok = col_ok & k_ok
            w = weights(qs_ptr, d_ptr, m_ptr, cols, blk, j, ok, stride_q, stride_s, QTYPE)
            acc += w * x
        split_at = tl.program_id(2).to(tl.int64) * stride_split
        tl.store(y_ptr + split_at + row * stride_y + cols, tl.sum(acc, axis=1), cols < N)

    return {"dot": gguf_dot, "gemv": gguf_gemv}


def available() -> bool:
    """Whether the Triton kernels can run (Triton importable and a CUDA device)."""
    return torch.cuda.is_available() and _kernels() is not None


def gguf_mm(x: torch.Tensor, weight: PackedWeight, tile: Tiling | None = None) -> torch.Tensor:
    """``x [M, in]`` float32 (contiguous, on the weight's CUDA device) @ ``dequant(weight).T``
    -> ``[M, out]`` float32; the caller (``quant_matmul``) checks shapes and devices.
    ``tile``: how the work is split (default ``tiling(M)``). Up to ``SPLIT_ROWS`` rows and
    ``SPLIT_PROGRAMS`` programs, ``tile.split`` programs share each output's blocks, and
    their partial sums are added after in a fixed order (deterministic)."""
    rows, nb, out = x.shape[0], weight.in_features // BLOCK_SIZE, weight.out_features
    if tile is None:
        tile = tiling(rows)
    if tile.kernel == "gemv" and rows > GRID_ROWS:  # the grid's second axis: one per row
        raise ValueError(f"gguf_mm: the gemv kernel takes at most {GRID_ROWS} rows, got {rows}")
    tile_m = 1 if tile.kernel == "gemv" else min(64, max(16, 1 << (rows - 1).bit_length()))
    grid = (-(-out // tile.tile_n), -(-rows // tile_m))
    split = tile.split if rows <= SPLIT_ROWS and grid[0] * grid[1] <= SPLIT_PROGRAMS else 1
    per = -(-nb // split)
    per = -(-per // tile.kb) * tile.kb  # blocks per split, a multiple of kb
    splits = -(-nb // per)
    y = x.new_empty(splits, rows, out)
    if rows == 0:
        return y[0]
    # the kernels index rows by stride and mins by the scales' offsets
    qs, scales = weight.qs.contiguous(), weight.scales.contiguous()
    mins = scales if weight.mins is None else weight.mins.contiguous()  # read for Q4_1 only
    rows_per_program = {} if tile.kernel == "gemv" else {"TILE_M": tile_m}
    _kernels()[tile.kernel][(*grid, splits)](
        x, qs, scales, mins, y,
        rows, out, nb, per,
        x.stride(0), qs.stride(0), scales.stride(0), y.stride(1), y.stride(0),
        QTYPE=int(weight.qtype), TILE_N=tile.tile_n, KB=tile.kb, **rows_per_program,
        num_warps=tile.warps, num_stages=tile.stages, enable_fp_fusion=False,
    )  # fmt: skip
    return y[0] if splits == 1 else y.sum(0)
