"""Probe: what prompt rows add to a step of running decodes, in process.

Keeps ``--decodes`` greedy sequences decoding (150-token prompts of random ids), then,
in rounds, adds prompts of the given shapes to one step each and times that step
(``engine.step()``, and the forward alone) against a step of the decodes alone; each
prompt asks for one token, so it is gone before the next shape. Medians over
``--rounds``. No peer and no JSON: docs/performance.md draws on its output.

    python benchmarks/probes/mixed_step.py --dtype auto
    python benchmarks/probes/mixed_step.py --shapes 300 150,150 75,75,75,75
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import start_decodes  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=60, help="running sequences")
    parser.add_argument("--warm-steps", type=int, default=30, help="decode steps before timing")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["300", "150,150", "75,75,75,75", "150"],
        help="prompt lengths added to one step, comma-separated (all in one step: the "
        "decodes plus these must fit max_num_seqs, 64)",
    )
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = {"decodes alone": []} | {s: [int(n) for n in s.split(",")] for s in args.shapes}
    engine = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=args.decodes * 30 + 400))
    rng = random.Random(1)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(length)]

    start_decodes(engine, args.decodes, rng)
    for _ in range(args.warm_steps):
        engine.step()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in shapes}
    added = 0
    for _ in range(args.rounds):
        for name, lengths in shapes.items():
            for length in lengths:
                engine.add_request(f"p{added}", prompt(length), SamplingParams(max_tokens=1))
                added += 1
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            rows = engine.stats().last_num_tokens
            if rows != args.decodes + sum(lengths):
                raise SystemExit(f"{name}: the step took {rows} rows, not all of them")
            times[name].append((elapsed * 1e3, engine.runner.forward_time * 1e3))
            while engine.stats().running > args.decodes:
                engine.step()
    for name, lengths in shapes.items():
        step = statistics.median(t for t, _ in times[name])
        forward = statistics.median(f for _, f in times[name])
        rows = args.decodes + sum(lengths)
        print(f"{name:>14}: {rows:4d} rows, step {step:7.1f} ms, forward {forward:7.1f} ms")


if __name__ == "__main__":
    main()
