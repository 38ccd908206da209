"""Host overhead of an engine step: the time outside the model's forward, at 1, 16 and 64
running sequences, beside the forward itself (the peer: the same step's forward).

Each point runs ``N`` greedy requests (128-token prompts) until all decode, then times
``--steps`` decode steps; ``engine.stats()`` gives the moving averages
(``recent_step_time``, ``recent_host_time``) and the per-step figures are measured here
as well. Host time is scheduling, building the flattened batch, sampling, detokenizing
and the outputs; the target is <= 1 ms at 64 sequences.

On the CPU each point then times as many steps again whose forward only hands back the
last real step's output (``host_warm_ms``): the same host work, without a forward
streaming the weights (~100 MB a step for SmolLM2's packed GGUF) through the caches
first. The gap between ``host_ms`` and ``host_warm_ms`` is what the host part pays for
finding its code and each sequence's objects evicted.

    python benchmarks/step_overhead.py                       # exact mode (float32)
    python benchmarks/step_overhead.py --dtype auto          # fast mode (where it runs)
    python benchmarks/step_overhead.py --dtype bfloat16      # bf16 activations and KV
    python benchmarks/step_overhead.py --device cuda         # on a GPU (CUDA graphs)
    python benchmarks/step_overhead.py --device cuda --no-cuda-graphs
    python benchmarks/step_overhead.py --device cuda --no-packed-weights   # dense weights
    python benchmarks/step_overhead.py --no-native-decode    # CPU decodes op by op (before)

On CUDA the forward is timed up to a device synchronisation, so that host time is not
hidden in (or counted as) queued kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import load_model  # noqa: E402
from tessera.workers.quant.kernels import remember_argmax, taken_argmax  # noqa: E402

TARGET_HOST_MS_AT_64 = 1.0


def measure(loaded, args: argparse.Namespace, running: int) -> dict:
    dtype, steps = args.dtype, args.steps
    config = EngineConfig(
        dtype=dtype,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        native_decode=args.native_decode,
        packed_weights=args.packed_weights,
        num_kv_blocks=running * 24 + 16,
    )
    engine = Engine(config, loaded=loaded)
    prompt = loaded.tokenizer("The history of the Roman empire is long. " * 14).input_ids[:128]
    greedy = SamplingParams(max_tokens=2 * steps + 40, temperature=0, ignore_eos=True)
    for index in range(running):
        engine.add_request(f"r{index}", prompt[index % 7 :], greedy)
    while engine.stats().running < running or engine.stats().last_num_tokens != running:
        engine.step()  # prefills, until every sequence decodes
    step_ms, host_ms = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        step_ms.append(total * 1e3)
        host_ms.append((total - engine.runner.forward_time) * 1e3)
    stats = engine.stats()
    return {
        "running": running,
        "step_ms": statistics.median(step_ms),
        "forward_ms": statistics.median(s - h for s, h in zip(step_ms, host_ms, strict=True)),
        "host_ms": statistics.median(host_ms),
        "host_share": statistics.median(host_ms) / statistics.median(step_ms),
        "stats_host_ms": stats.recent_host_time * 1e3,
        "host_warm_ms": warm_host_ms(engine, steps) if args.device == "cpu" else None,
        "tok_s": running / statistics.median(step_ms) * 1e3,
    }


class _Replay:
    """The model, except that a call hands back the first call's output without running
    anything: its logits (and, where the LM head took their argmax, that argmax), or for
    a step of greedy decodes (``argmax_only``) the rows' argmax alone."""

    def __init__(self, model) -> None:
        self.model = model
        self.logits: torch.Tensor | None = None
        self.argmax: torch.Tensor | None = None

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.logits is None:
            self.logits = self.model(*args, **kwargs)
            self.argmax = taken_argmax(self.logits)
        if self.argmax is not None:
            remember_argmax(self.logits, self.argmax)
        return self.logits


def warm_host_ms(engine: Engine, steps: int) -> float:
    """The median host time of ``steps`` more decode steps whose forward replays the
    last one's logits (``_Replay``): every sequence samples the same token again, and
    the engine is spent."""
    runner = engine.runner
    model, runner.model = runner.model, _Replay(runner.model)
    try:
        engine.step()  # the replayed logits' own step
        host_ms = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            host_ms.append((time.perf_counter() - start - runner.forward_time) * 1e3)
    finally:
        runner.model = model
    return statistics.median(host_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--running", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per point")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, replay decode steps from CUDA graphs (the engine's default)",
    )
    parser.add_argument(
        "--native-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the CPU, run steps of decodes through the native layer stack (the default)",
    )
    parser.add_argument(
        "--packed-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the GGUF's matrices packed (the engine's default); off: dense weights",
    )
    args = parser.parse_args()
    loaded = load_model(None, args.dtype, args.device, args.packed_weights)
    on_gpu = torch.device(args.device).type == "cuda"
    weights_mib = torch.cuda.memory_allocated() / 2**20 if on_gpu else None
    rows = [measure(loaded, args, n) for n in args.running]
    at_64 = next((r["host_ms"] for r in rows if r["running"] == 64), None)

    def plot(ax) -> None:
        labels = [str(r["running"]) for r in rows]
        ax.bar(labels, [r["forward_ms"] for r in rows], label="model forward")
        ax.bar(
            labels,
            [r["host_ms"] for r in rows],
            bottom=[r["forward_ms"] for r in rows],
            label="host overhead",
        )
        ax.set_xlabel("running sequences (decode)")
        ax.set_ylabel("ms per step (median)")
        ax.legend()

    report(
        f"step_overhead_{args.dtype}"
        + ("" if args.device == "cpu" else f"_{args.device}")
        + ("" if args.device == "cpu" or args.cuda_graphs else "_eager")
        + ("" if args.device != "cpu" or args.native_decode else "_op_by_op")
        + ("" if args.packed_weights else "_dense"),
        rows,
        {
            "peer": "the same step's model forward (host / step is the ratio)",
            "dtype": args.dtype,
            "precision": loaded.precision,
            "device": args.device,
            "cuda_graphs": args.device != "cpu" and args.cuda_graphs,
            "native_decode": args.device == "cpu" and args.native_decode,
            "packed_weights": args.packed_weights,
            "cuda_weights_mib": weights_mib,  # GPU memory the loaded model holds
            "steps": args.steps,
            "target": f"host overhead <= {TARGET_HOST_MS_AT_64} ms at 64 running sequences",
            "target_met": None if at_64 is None else at_64 <= TARGET_HOST_MS_AT_64,
        },
        plot,
    )


if __name__ == "__main__":
    main()
