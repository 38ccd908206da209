"""Continuous (iteration-level) vs static batching on a mixed-length workload.

64 requests, prompts of 32..256 tokens, outputs of 16..256 tokens (greedy, EOS
ignored), batch size 16 for both. Static batching admits 16 requests and admits the
next 16 only when all of them have finished, so short requests leave their slots idle
while the longest one runs; continuous batching refills a slot the step it frees.
Both run on the same engine and model in the same process (the static peer even skips
padding, so the ratio understates the gap to a padded static batcher).
seeds/002-flash-speculative-batching-notes.md claims 2-5x.

    python benchmarks/continuous_vs_static.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import mixed_workload, report  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import DTYPES, load_model  # noqa: E402


def run(engine: Engine, workload, batch: int, static: bool) -> dict[str, float]:
    pending = list(enumerate(workload))
    start = time.perf_counter()
    finished_at: list[float] = []
    generated = 0
    while pending or engine.has_work():
        room = batch - len(engine.groups)
        if static and engine.groups:
            room = 0  # static: wait until the whole batch is done
        for _ in range(min(room, len(pending))):
            i, (ids, new) = pending.pop(0)
            engine.add_request(
                f"r{i}", ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            )
        for out in engine.step():
            generated += len(out.token_ids)
            if out.finished:
                finished_at.append(time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    finished_at.sort()
    return {
        "tok_s": generated / elapsed,
        "seconds": elapsed,
        "p50_latency_s": finished_at[len(finished_at) // 2],
        "mean_batch": engine.stats().mean_batch_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    loaded = load_model(None, args.dtype)
    workload = mixed_workload(loaded.tokenizer, args.requests, seed=7, min_new=16, max_new=256)
    rows = []
    for mode in ("static", "continuous"):
        engine = Engine(
            EngineConfig(dtype=args.dtype, num_kv_blocks=1024, max_num_seqs=args.batch),
            loaded=loaded,
        )
        result = run(engine, workload, args.batch, static=mode == "static")
        rows.append({"mode": mode, **result})
    speedup = rows[1]["tok_s"] / rows[0]["tok_s"]
    for row in rows:
        row["speedup_vs_static"] = row["tok_s"] / rows[0]["tok_s"]
    print(f"continuous / static throughput: {speedup:.2f}x")

    def plot(ax):
        ax.bar([r["mode"] for r in rows], [r["tok_s"] for r in rows])
        ax.set_ylabel("generated tokens / s")

    report(
        f"continuous_vs_static_{args.dtype}",
        rows,
        {
            "peer": "static batching on the same engine",
            "requests": args.requests,
            "batch": args.batch,
            "dtype": args.dtype,
        },
        plot,
    )


if __name__ == "__main__":
    main()
