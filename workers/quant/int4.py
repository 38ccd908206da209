"""GGUF matrices for bf16 products: Q4_0 / Q4_1 kept at 4 bits (the tied Q8_0 head,
``Q8Weight``, is in ``q8_weight``), and the row count from which a dense bf16 matmul wins.

The fast mode (a float32 model) multiplies through ``Q4Weight`` and ``Q8Weight`` only,
its float32 inputs rounded to bf16 inside the kernels. The bfloat16 mode (bf16
activations) takes two Q4 layouts; ``bf16_q4_weight`` picks the first this CPU and shape
can run:

- ``Q4Weight``: the native AVX512_BF16 kernel (``csrc/q4_bf16.cpp``). It keeps the
  file's fp16 ``d`` and ``m`` and sums each block in float32, so its weights are the
  file's; about twice torch's int4 kernel at 16-64 rows (2 cores: a 16 x 576 -> 3072
  product in 176 us vs 342 us). On a CPU with AMX-BF16 it multiplies on AMX tiles
  (``csrc/amx_tiles.h``: the same weights and block sums, 3.5-6x faster from 7 rows up;
  the extension's ``use_amx(False)`` turns it off), and so does ``Q8Weight``.
- ``Int4Weight``: torch's ``_weight_int4pack_mm_for_cpu`` (any CPU; vectorised for bf16
  activations). It computes, per group of 32 inputs, ``w = (q - 8) * scale + zero``;
  GGUF's blocks map onto that exactly in form:

      Q4_0  w = d * (q - 8)    scale = d, zero = 0
      Q4_1  w = d * q + m      scale = d, zero = m + 8 d

  but torch keeps ``scale`` and ``zero`` in bf16, so these weights differ from the
  file's by bf16 rounding of those two numbers.

Both modes' quality contracts are tested against the exact mode
(``tests/engine/test_fast_mode.py``). One row of activations reads the packed ~0.5 byte
per weight; many rows can be faster as a dense bf16 GEMM. ``int4_row_limit`` measures
where the two cross on this CPU, once per weight shape and process.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.workers.quant.blocks import BLOCK_SIZE, PackedWeight, QuantType
from tessera.workers.quant.kernels import native_kernels
from tessera.workers.quant.q8_weight import Q8Weight as Q8Weight  # callers import it here too

logger = logging.getLogger(__name__)

#: torch's int4 layout packs this many inner K tiles (2, 4 or 8; 2 fits every K % 32).
INNER_K_TILES = 2
#: Row counts at which ``int4_row_limit`` compares the two kernels.
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
#: ``int4_row_limit`` (and ``Linear.int4_rows``) where a 4-bit kernel takes any number of
#: rows.
ALL_ROWS = 2**62


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A Q4 matrix ``[out, in]`` in torch's int4 CPU layout."""

    packed: torch.Tensor  # uint8, torch's layout
    scales_and_zeros: torch.Tensor  # bf16 [in / 32, out, 2]
    out_features: int
    in_features: int

    @staticmethod
    def supports(weight: PackedWeight) -> bool:
        """A 4-bit type with whole tiles of 16 outputs (torch's layout needs them)."""
        return weight.qtype in (QuantType.Q4_0, QuantType.Q4_1) and weight.out_features % 16 == 0

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


@dataclass(frozen=True, slots=True)
class Q4Weight:
    """A Q4 matrix ``[out, in]`` in the native kernels' layout (described in
    ``csrc/q4_bf16.cpp``): 4-bit ``nibbles`` arranged per 16 outputs, the file's fp16
    ``d`` and ``m`` as ``[out / 16, in / 32, 16]``.

    ``exact``: the exact mode's weight, multiplied in float32 (``csrc/tiled_f32.cpp``: each
    weight dequantised as gguf does, needs AVX-512 or AVX2); else the fast and bfloat16 modes',
    its inputs rounded to bf16 (``csrc/q4_bf16.cpp``, needs AVX512_BF16)."""

    nibbles: torch.Tensor  # uint8 [out / 16 * in / 32 * 256]
    d: torch.Tensor  # fp16 [out / 16, in / 32, 16]
    m: torch.Tensor | None  # fp16, like d, for Q4_1
    qtype: QuantType
    out_features: int
    in_features: int
    exact: bool = False

    @staticmethod
    def supports(weight: PackedWeight, exact: bool = False) -> bool:
        """What ``Int4Weight`` takes, on the CPU, and the kernel built for this CPU."""
        kernels = native_kernels() if weight.device.type == "cpu" else None
        if not Int4Weight.supports(weight) or kernels is None:
            return False
        return kernels.tiled_f32_available() if exact else kernels.q4_bf16_available()

    @classmethod
    def from_packed(cls, weight: PackedWeight, exact: bool = False) -> Q4Weight:
        if not cls.supports(weight, exact):
            raise ValueError(
                f"Q4Weight: {weight.qtype.name} [{weight.out_features}, {weight.in_features}] "
                "needs a 4-bit type, out_features % 16 == 0, the CPU and the "
                + ("AVX-512 or AVX2 float32 kernel" if exact else "AVX512_BF16 kernel")
            )
        out, in_features = weight.shape
        nb = in_features // BLOCK_SIZE
        blocks = weight.qs.view(out, nb, BLOCK_SIZE // 2)
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).to(torch.int32)  # [out, nb, 32]
        # [tile, c, b, s, p, e] -> [tile, b, s, c, p, e]: input 8s + 2p + e of block b
        q = q.view(out // 16, 16, nb, 4, 4, 2).permute(0, 2, 3, 1, 4, 5)
        words = (q << _NIBBLE_SHIFTS).sum((-1, -2), dtype=torch.int32).contiguous()

        def tiled(t: torch.Tensor) -> torch.Tensor:  # [out, nb] -> [out / 16, nb, 16]
            return t.view(out // 16, 16, nb).permute(0, 2, 1).contiguous()

        mins = None if weight.mins is None else tiled(weight.mins)
        return cls(
            words.view(torch.uint8).reshape(-1),
            tiled(weight.scales),
            mins,
            weight.qtype,
            out,
            in_features,
            exact,
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]``. Exact: float32 in and out. Else bf16 ``x`` gives
        bf16; float32 ``x`` is rounded to bf16 inside the kernel and gives the float32
        sums."""
        kernel = native_kernels().q4_f32_mm if self.exact else native_kernels().q4_bf16_mm
        return kernel(x, self.nibbles, self.d, self.m, int(self.qtype))

    def dense(self) -> torch.Tensor:
        """The exact mode's weights as a dense float32 ``[in, out]`` tensor, dequantised
        by the native kernel (the numbers ``matmul`` multiplies with; SmolLM2's largest
        matrix in ~1 ms): for a GEMM of many rows (``exact_row_limit``)."""
        return native_kernels().q4_f32_dense(self.nibbles, self.d, self.m, int(self.qtype))

    def dense_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ dense() (+ bias)`` through the float32 GEMM ``onednn_gemm`` chose for this
        CPU (``dense_f32_mm``: oneDNN's or MKL's), as the native stack computes it: the
        exact mode's products of more than ``exact_row_limit`` rows."""
        return native_kernels().dense_f32_mm(x, self.dense(), bias)

    def dequantize(self) -> torch.Tensor:
        """The dense float32 ``[out, in]`` weights, as ``gguf`` dequantises the file's."""
        out, nb = self.out_features, self.in_features // BLOCK_SIZE
        words = self.nibbles.view(torch.int32).view(out // 16, nb, 4, 16, 1, 1)
        q = (words >> _NIBBLE_SHIFTS) & 0x0F  # [tile, b, s, c, p, e]
        q = q.permute(0, 3, 1, 2, 4, 5).reshape(out, nb, BLOCK_SIZE).float()

        def untiled(t: torch.Tensor) -> torch.Tensor:  # [out / 16, nb, 16] -> [out, nb, 1]
            return t.permute(0, 2, 1).reshape(out, nb, 1).float()

        d = untiled(self.d)
        # two roundings (a product, then a sum), as gguf's numpy
        w = d * (q - 8) if self.m is None else d * q + untiled(self.m)
        return w.reshape(out, self.in_features)


#: ``Q4Weight``'s packing: input 8s + 2p + e of a block sits at bit 4p + 16e of its word.
_NIBBLE_SHIFTS = torch.tensor([[4 * p + 16 * e for e in range(2)] for p in range(4)]).to(
    torch.int32
)


def bf16_q4_weight(weight: PackedWeight) -> Q4Weight | Int4Weight | None:
    """The bfloat16 mode's 4-bit form of ``weight``: ``Q4Weight`` where this CPU and shape
    run it, else torch's ``Int4Weight``; ``None`` where neither holds it (Q8_0, or
    outputs not a multiple of 16): the caller keeps a dense weight."""
    if Q4Weight.supports(weight):
        return Q4Weight.from_packed(weight)
    if Int4Weight.supports(weight):
        return Int4Weight.from_packed(weight)
    return None


@functools.cache
def int4_row_limit(out_features: int, in_features: int) -> int:
    """The most rows for which torch's int4 kernel (``Int4Weight``) beats a dense bf16
    GEMM on this CPU (0: never), timed on a matrix of the given shape; ``ALL_ROWS`` where
    it wins at every probed count (its time grows with the rows, so no crossover is
    assumed past the last: on an AVX2 CPU without native bf16, torch's bf16 GEMM ran
    40x slower than int4 at every count from 1 to 512 rows, and a 453-token prompt took
    68 s through it). Measured once per shape and process (~0.2 s each; SmolLM2 has five
    shapes). The bf16 ``Q4Weight`` needs no limit: it takes every row count (the exact
    one has ``exact_row_limit``)."""
    generator = torch.Generator().manual_seed(0)
    weight = Int4Weight.from_packed(_random_q4(QuantType.Q4_0, out_features, in_features))
    dense = torch.randn(in_features, out_features, generator=generator).to(torch.bfloat16)
    return _row_limit(
        "int4 vs dense bf16", weight, lambda x: torch.mm(x, dense), PROBE_ROWS, 0, torch.bfloat16
    )


#: Row counts at which ``exact_row_limit`` compares the tiled kernel with a dense GEMM.
EXACT_PROBE_ROWS = (128, 256, 512, 1024)
#: Rows that always take the exact mode's tiled kernel: a decode step's, up to the default
#: ``max_num_seqs`` (its rows' numbers then never depend on how many share the step).
EXACT_MIN_ROWS = 64


#: The product ``onednn_gemm`` times both GEMMs on: SmolLM2's down projection, 1,024 rows.
GEMM_PROBE_SHAPE = (1024, 1536, 576)


@functools.cache
def onednn_gemm() -> bool:
    """Whether the exact mode's GEMM of many rows (``dense_f32_mm``, Python's and the native
    stack's) goes through oneDNN rather than MKL's ``at::mm`` in this process: the faster of
    the two on one ``GEMM_PROBE_SHAPE`` product (best of a few, taken in turn), where this
    torch has oneDNN. MKL picks its kernels by CPU vendor: on a 2-core AMD EPYC with AVX-512
    its float32 GEMM ran at 167-187 GFLOP/s where oneDNN's ran at 378-407 (256-2,048 rows of
    SmolLM2's shapes). Both are float32 sums of the same weights in their own order. Decided
    once per process (~0.15 s, oneDNN's first call included), before ``exact_row_limit``
    measures against it."""
    native = native_kernels()
    if native is None or not native.onednn_gemm_available():
        return False
    rows, in_features, out_features = GEMM_PROBE_SHAPE
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(rows, in_features, generator=generator)
    w = torch.randn(in_features, out_features, generator=generator)

    def through(onednn: bool) -> Callable[[], object]:
        return lambda: (native.use_onednn_gemm(onednn), native.dense_f32_mm(x, w))

    mkl, onednn = _best_times(through(False), through(True))
    chosen = native.use_onednn_gemm(onednn < mkl)
    logger.info("float32 GEMM (%dx%dx%d): MKL %.0f us, oneDNN %.0f us: %s",
                rows, in_features, out_features, mkl * 1e6, onednn * 1e6,
                "oneDNN" if chosen else "MKL")  # fmt: skip
    return chosen


#: The product ``tiled_loop`` times the loops on: SmolLM2's gate and up projections
#: (out, in), at each of ``LOOP_PROBE_ROWS`` rows (16, 24 and 64 concurrent decodes).
LOOP_PROBE_SHAPE = (3072, 576)
LOOP_PROBE_ROWS = (16, 24, 64)
#: The exact mode's loops for more rows than one micro-kernel holds
#: (``csrc/tiled_f32.cpp``), in the order ``tiled_loop`` times them.
TILED_LOOPS = ("registers", "buffered", "pairs")


@functools.cache
def tiled_loop() -> str | None:
    """The loop by which the exact mode's tiled kernel takes more rows than one
    micro-kernel holds (12 under AVX-512, 3 under AVX2) in this process
    (``csrc/tiled_f32.cpp``): each tile dequantised in registers again for each
    micro-kernel's rows, once into a buffer, or two tiles at a time into one (AVX-512
    builds), whichever
    ran ``LOOP_PROBE_SHAPE`` fastest at ``LOOP_PROBE_ROWS`` rows together (best of a few
    each, taken in turn); None without the kernel. All give the same bits, so only speed
    decides, and that is the CPU's: on a Sapphire Rapids Xeon registers took 16 and 64
    rows in 0.50 and 1.9 ms against 0.65 and 2.2 buffered and 0.91 and 3.3 in pairs (one
    thread); pairs took one step's
    products at 64 rows in 124 ms against 179 one tile at a time on an Ice Lake Xeon, and at
    16 rows in 39-40 against 32-34 on a Zen 4 EPYC, whose 512-bit FMAs run in two halves.
    Decided once per process (~0.2 s), before ``exact_row_limit`` times the kernel."""
    native = native_kernels()
    if native is None or not native.tiled_f32_available():
        return None
    loops = [name for name in TILED_LOOPS if native.use_tiled_loop(name) == name]
    weight = Q4Weight.from_packed(_random_q4(QuantType.Q4_1, *LOOP_PROBE_SHAPE), exact=True)
    generator = torch.Generator().manual_seed(3)
    xs = [torch.randn(rows, LOOP_PROBE_SHAPE[1], generator=generator) for rows in LOOP_PROBE_ROWS]

    def run(x: torch.Tensor, loop: str) -> Callable[[], object]:
        return lambda: (native.use_tiled_loop(loop), weight.matmul(x))

    totals = dict.fromkeys(loops, 0.0)
    for x in xs:
        times = _best_times(*(run(x, loop) for loop in loops))
        for loop, seconds in zip(loops, times, strict=True):
            totals[loop] += seconds
    chosen = native.use_tiled_loop(min(loops, key=totals.__getitem__))
    logger.info("float32 tiled kernel (%dx%d, %s rows): %s: %s",
                *LOOP_PROBE_SHAPE, " + ".join(map(str, LOOP_PROBE_ROWS)),
                ", ".join(f"{loop} {totals[loop] * 1e6:.0f} us" for loop in loops),
                chosen)  # fmt: skip
    return chosen


@functools.cache
def exact_row_limit(out_features: int, in_features: int) -> int:
    """The most rows for which the exact mode's tiled kernel (``Q4Weight.matmul``, exact)
    beats dequantising the matrix for the float32 GEMM ``onednn_gemm`` chose
    (``Q4Weight.dense_matmul``) on this CPU, timed on a Q4_1 matrix of the given shape: at
    least ``EXACT_MIN_ROWS``, and ``ALL_ROWS`` where the kernel wins at every probed count.
    On the AVX2 EPYC, one thread, the kernel ran at ~26 GMAC/s against MKL's ~35 on 2,048
    rows (a prompt step); at 64 rows the two were level. Both products are float32 sums of
    the same float32 weights; only their order differs. Measured once per shape and
    process."""
    onednn_gemm()
    tiled_loop()
    weight = Q4Weight.from_packed(_random_q4(QuantType.Q4_1, out_features, in_features), exact=True)
    return _row_limit(
        "tiled float32 vs dequantised + dense float32",
        weight,
        weight.dense_matmul,
        EXACT_PROBE_ROWS,
        EXACT_MIN_ROWS,
        torch.float32,
    )


def _random_q4(qtype: QuantType, out_features: int, in_features: int) -> PackedWeight:
    """A Q4 matrix of random nibbles and small scales (and mins, Q4_1), for timing."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(
        0, 16, (out_features, in_features // 2), dtype=torch.uint8, generator=generator
    )
    scales = torch.full((out_features, in_features // BLOCK_SIZE), 0.01, dtype=torch.float16)
    mins = None if qtype is QuantType.Q4_0 else -8 * scales
    return PackedWeight(qtype, q, scales, mins)


def _row_limit(
    what: str,
    weight: Int4Weight | Q4Weight,
    gemm: Callable[[torch.Tensor], torch.Tensor],
    probe_rows: tuple[int, ...],
    floor: int,
    dtype: torch.dtype,
) -> int:
    """The largest of ``probe_rows`` up to which ``weight.matmul(x)`` beats ``gemm(x)`` at
    every probed count (``floor`` where it loses at the first; ``ALL_ROWS`` where it never
    loses), each timed at its best of a few runs on random ``x``, the two in turn
    (``_best_times``); logged as a table."""
    out_features, in_features = weight.out_features, weight.in_features
    generator = torch.Generator().manual_seed(1)
    limit = floor
    table = []
    for rows in probe_rows:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        ours, theirs = _best_times(lambda x=x: weight.matmul(x), lambda x=x: gemm(x))
        table.append(f"{rows}: {ours * 1e6:.0f} vs {theirs * 1e6:.0f} us")
        if ours >= theirs:
            break
        limit = rows
    else:
        limit = ALL_ROWS
    logger.info("%s (%dx%d): %s; the first up to %s rows",
                what, out_features, in_features, "; ".join(table),
                "any number of" if limit == ALL_ROWS else limit)  # fmt: skip
    return limit


def _best_times(*fns: Callable[[], object], repeats: int = 5) -> list[float]:
    """Each of ``fns``' best time of ``repeats`` runs after one warm-up, the runs taken in
    turn (one of each, then again), so that a slow spell of a shared machine falls on all
    of them alike (on a 2-core Zen 3 EPYC one GEMM ran at 36 GMAC/s and then at 80 a second
    later)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best
