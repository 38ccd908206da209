"""One mixture-of-experts layer's step, its experts packed as a GGUF file stores them
against the same experts dense in float32.

The layer is Qwen-MoE-shaped (defaults: hidden 2048, 16 experts of 1408, top-2; no
shared expert): ``SparseMoE`` with a random router and random experts, gate and up as
Q4_K super-blocks (random valid blocks, as the tests write them) and down as Q8_0
(llama.cpp's fallback from Q6_K for rows of 1408, not a multiple of 256). For T rows:

* ``dense_fp32``: the dequantised experts as dense stacks (``--no-packed-weights``),
  ``torch.mm`` per expert;
* ``packed_fp32``: the packed experts, ``quant_matmul`` per expert and projection (what a
  float32 model loads from the file).

Both compute the same numbers up to the order of float32 sums. Times are the best (on a
shared machine other work only adds time) and the median of ``--repeat`` steps, each step a
fresh batch of random rows (the routing differs from step to step) that both layers take
in turn.

    python benchmarks/moe_experts.py --rows 16 64 --repeat 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import paired_bars, report  # noqa: E402
from tessera.workers.model.config import ModelConfig  # noqa: E402
from tessera.workers.model.llama import Linear  # noqa: E402
from tessera.workers.model.moe import SparseMoE  # noqa: E402
from tessera.workers.quant import PackedWeight, QuantType  # noqa: E402


def _q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid Q4_K super-blocks ``[rows, cols / 256 * 144]`` (small finite d, dmin)."""
    data = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for offset in (0, 2):
        f16 = rng.uniform(1e-3, 1e-2, (rows, cols // 256)).astype(np.float16)
        data[:, :, offset : offset + 2] = f16.view(np.uint8).reshape(rows, cols // 256, 2)
    return data.reshape(rows, -1)


def _q8_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks ``[rows, cols / 32 * 34]``."""
    data = rng.integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    f16 = rng.uniform(1e-3, 1e-2, (rows, cols // 32)).astype(np.float16)
    data[:, :, 0:2] = f16.view(np.uint8).reshape(rows, cols // 32, 2)
    return data.reshape(rows, -1)


def build(hidden: int, experts: int, size: int, top_k: int) -> tuple[SparseMoE, SparseMoE]:
    """(packed, dense) layers holding the same experts and router."""
    config = ModelConfig.from_hf(
        dict(
            model_type="qwen3_moe",
            vocab_size=128,
            hidden_size=hidden,
            intermediate_size=size,
            num_hidden_layers=1,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=size,
            norm_topk_prob=True,
        )
    )
    rng = np.random.default_rng(0)

    def weights(make, kind: QuantType, out: int, in_: int) -> list[PackedWeight]:
        return [
            PackedWeight.from_raw(make(out, in_, rng), kind, (out, in_)) for _ in range(experts)
        ]

    gate = weights(_q4_k, QuantType.Q4_K, size, hidden)
    up = weights(_q4_k, QuantType.Q4_K, size, hidden)
    down = weights(_q8_0, QuantType.Q8_0, hidden, size)
    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(1))
    layers = []
    for packed in (True, False):
        layer = SparseMoE(config, Linear)
        layer.gate.load_weight([router], "router")
        if packed:
            layer.load_experts(gate, up, down, "experts")
        else:
            stacks = [torch.stack([w.dequantize() for w in ws]) for ws in (gate, up, down)]
            layer.load_experts(*stacks, "experts")
        layers.append(layer)
    return layers[0], layers[1]


@torch.inference_mode()
def step_ms(layers: dict[str, SparseMoE], rows: int, hidden: int, repeat: int) -> dict:
    """Each layer's (best, median) ms a step over ``repeat`` batches, the layers taking
    each batch in turn (interleaved: a neighbour's load falls on both)."""
    generator = torch.Generator().manual_seed(rows)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for i in range(repeat + 3):
        x = torch.randn(rows, hidden, generator=generator)
        for name, layer in layers.items():
            start = time.perf_counter()
            layer(x)
            if i >= 3:  # the first steps warm up
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-size", type=int, default=1408)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch's (default: its own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    packed, dense = build(args.hidden, args.experts, args.expert_size, args.top_k)
    x = torch.randn(64, args.hidden)
    with torch.inference_mode():
        ours, theirs = packed(x), dense(x)
    scale = theirs.abs().max().item()
    print(f"max |packed - dense| / max |dense| = {(ours - theirs).abs().max().item() / scale:.2e}")
    packed_mb = (
        sum(w.nbytes for ws in (*packed.packed_gate_up, (*packed.packed_down,)) for w in ws) / 2**20
    )
    dense_mb = (dense.gate_up.numel() + dense.down.numel()) * 4 / 2**20
    threads = torch.get_num_threads()
    print(f"experts: packed {packed_mb:.0f} MiB, dense {dense_mb:.0f} MiB; {threads} threads")
    rows = []
    for count in args.rows:
        ms = step_ms({"dense": dense, "packed": packed}, count, args.hidden, args.repeat)
        (db, dm), (pb, pm) = ms["dense"], ms["packed"]
        rows.append(
            {
                "rows": count,
                "dense_fp32_ms": db,
                "dense_fp32_median_ms": dm,
                "packed_fp32_ms": pb,
                "packed_fp32_median_ms": pm,
                "speedup": db / pb,
            }
        )

    def plot(ax) -> None:
        labels = [str(r["rows"]) for r in rows]
        paired_bars(
            ax,
            labels,
            [r["packed_fp32_ms"] for r in rows],
            [r["dense_fp32_ms"] for r in rows],
            ("packed (the file's blocks)", "dense float32"),
            [r["speedup"] for r in rows],
        )
        ax.set_ylabel("ms a layer step (best)")
        ax.set_xlabel("rows in the step")

    report(
        "moe_experts",
        rows,
        {
            "peer": "the same experts dense in float32 (--no-packed-weights)",
            "layer": {
                "hidden": args.hidden,
                "experts": args.experts,
                "expert_size": args.expert_size,
                "top_k": args.top_k,
                "types": "gate/up Q4_K, down Q8_0",
            },
            "experts_mib": {"packed": packed_mb, "dense": dense_mb},
            "max_diff_over_max": (ours - theirs).abs().max().item() / scale,
            "repeat": args.repeat,
        },
        plot,
    )


if __name__ == "__main__":
    main()
