"""Packed GGUF matmuls on CUDA: the 121 matmuls of one SmolLM2-135M step, each way
``quant_matmul`` can run them there, against cuBLAS on the dense weights (the peer).

Per layer (30, each its own weights so that a step reads them from memory, not L2):
qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576 (Q4_1); then the tied head
576->49152 (Q8_0). The packed weights are random bytes (any bytes are valid blocks) at
these shapes; the dense peer is their exact dequantisation. For T rows of x (1 = one
decoding stream, 16 / 64 = a batch), one step's matmuls are captured in a CUDA graph
(as the engine's decode steps are) and replayed; the time is the median replay.

* ``dense``: ``torch.mm`` with the dequantised weight pre-transposed ``[in, out]``
  (``--no-packed-weights``: 538 MB read per step).
* ``torch``: ``quant_matmul(backend="torch")``: each weight dequantised in row chunks,
  then ``torch.mm`` (~96 MB of packed weights, written and read again in float32).
* ``triton``: ``triton_mm.gguf_mm`` as the engine calls it, one kernel per matmul
  (the tiling ``triton_mm.tiling`` picks for the row count; ``tiling`` in the table, its
  split the most programs per output: a product of 18 blocks splits 9 ways, the head,
  past ``SPLIT_PROGRAMS``, none), and ``triton, tl.dot tiles at every row count``, an
  earlier fixed tiling (``BEFORE``: 2 blocks of 32 per loop step, 16 outputs per
  program, split-K 4, 4 warps, 3 stages; through today's ``gguf_mm``, which leaves the
  head unsplit where that tiling's own code split it: on an H200 this measured 1.60 /
  1.64 / 3.22 ms at 1 / 16 / 64 rows, its own code 1.61 / 1.64 / 3.27).

Every variant's products are checked against the dense ones (float32 rounding).

    python benchmarks/cuda_quant_matmul.py
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import report  # noqa: E402
from tessera.workers.quant import PackedWeight, QuantType, quant_matmul, triton_mm  # noqa: E402

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in]
HEAD_SHAPE = (49152, 576)
BEFORE = triton_mm.Tiling("dot", kb=2, tile_n=16, split=4, warps=4, stages=3)


def random_weight(qtype: QuantType, shape: tuple[int, int], gen: torch.Generator) -> PackedWeight:
    out, nb = shape[0], shape[1] // 32
    qs = torch.randint(0, 256, (out, nb * qtype.quant_bytes), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(out, nb, generator=gen) * 0.02).half()
    mins = (torch.rand(out, nb, generator=gen) * -0.1).half() if qtype is QuantType.Q4_1 else None
    if qtype is QuantType.Q8_0:
        qs = qs.view(torch.int8)
    return PackedWeight(qtype, qs, scales, mins).to("cuda")


def one_step(
    name: str,
    tile: triton_mm.Tiling | None,
    x: dict[int, torch.Tensor],
    packed: list[PackedWeight],
    dense: list[torch.Tensor],
) -> list[torch.Tensor]:
    """One step's 121 products, the way ``name`` computes them."""
    if name == "dense":
        return [torch.mm(x[d.shape[0]], d) for d in dense]
    if name == "torch":
        return [quant_matmul(x[w.in_features], w, backend="torch") for w in packed]
    return [triton_mm.gguf_mm(x[w.in_features], w, tile) for w in packed]


def graph_time(step: Callable[[], object], repeat: int) -> float:
    """Median ms of ``step`` replayed from a CUDA graph."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        step()  # warm-up: Triton compiles, cuBLAS workspaces
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_quant_matmul: needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    packed = [random_weight(QuantType.Q4_1, s, gen) for _ in range(30) for s in LAYER_SHAPES]
    packed.append(random_weight(QuantType.Q8_0, HEAD_SHAPE, gen))
    dense = [w.dequantize().t().contiguous() for w in packed]  # [in, out], as Linear keeps it
    ways = {
        "dense": None,
        "torch": None,
        "triton": None,
        "triton, tl.dot tiles at every row count": BEFORE,
    }
    rows_out = []
    for rows in args.rows:
        x = {
            576: torch.randn(rows, 576, device="cuda"),
            1536: torch.randn(rows, 1536, device="cuda"),
        }
        want = [torch.mm(x[d.shape[0]], d) for d in dense]
        row = {"rows": rows}
        for name, tile in ways.items():
            step = functools.partial(one_step, name, tile, x, packed, dense)
            for got, expected in zip(step(), want, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
            row[name] = graph_time(step, args.repeat)
        tile = triton_mm.tiling(rows)
        row["tiling"] = (
            f"{tile.kernel} kb={tile.kb} n={tile.tile_n} split<={tile.split} "
            f"warps={tile.warps} stages={tile.stages}"
        )
        row["triton_vs_dense"] = row["dense"] / row["triton"]
        row["triton_vs_all_dot_tiles"] = (
            row["triton, tl.dot tiles at every row count"] / row["triton"]
        )
        row["torch_vs_dense"] = row["dense"] / row["torch"]
        rows_out.append(row)
        print(row, flush=True)

    def plot(ax) -> None:
        labels = [str(r["rows"]) for r in rows_out]
        width = 0.8 / len(ways)
        for i, name in enumerate(ways):
            ax.bar(
                [j + i * width for j in range(len(labels))],
                [r[name] for r in rows_out],
                width,
                label=name,
            )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
        ax.set_xlabel("rows of x")
        ax.set_ylabel("ms per step's 121 matmuls (CUDA graph)")
        ax.legend(fontsize=6)

    report(
        "cuda_quant_matmul",
        rows_out,
        {
            "peer": "cuBLAS torch.mm on the dequantised (dense) weights",
            "device": torch.cuda.get_device_name(),
        },
        plot,
    )


if __name__ == "__main__":
    main()
