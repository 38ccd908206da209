"""Cluster overhead: a one-worker Ray cluster vs the same engine called in-process.

The peer is ``AsyncEngine(Engine(...))`` in this process (the worker actor runs the very
same ``AsyncEngine``); ours is a one-worker cluster with the same engine settings
(float32, ``--num-kv-blocks``, ``--max-num-seqs``), reached through ``Cluster.submit``:
tokens go prompt -> scheduler (placement) -> worker actor -> its channel (a Unix socket,
the worker being on this node) -> the client's background reader -> the caller. Both
sides get the same torch thread count (``--threads``, default 2 = this machine's
cores): the Ray worker gets ``worker_num_cpus=threads`` (it sets its torch threads to
that) and this process calls ``torch.set_num_threads(threads)``. Only one side runs at
a time (the other is idle).

Two scenarios, both greedy with EOS ignored and ``--new`` tokens per request: one
stream (a 128-token prompt), and ``--streams`` (16) concurrent streams (prompts of
32..256 tokens), submitted at once. Time to first token is per request, from the
submit call to its first delta carrying token ids (the cluster's includes placement
and the worker's acceptance; ``cluster_submit_ms`` is that part alone); throughput is
generated tokens over the wall time of the scenario. Both sides first run every
scenario once unmeasured (warm-up). This machine's speed drifts over minutes, so the
sides alternate (which one goes first flips every repeat) for ``--repeats`` repeats;
the table gives each side's medians, their ratio (cluster / in-process), and the
median of the per-repeat ratios (``_paired``: the two runs of a repeat are adjacent in
time, so drift mostly cancels). Each repeat salts its prompts (``cache_salt``) so no
run hits blocks an earlier one cached. Outputs must be token-identical on both sides.

    python benchmarks/cluster_overhead.py --threads 2 --new 64 --streams 16 --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from benchmarks.common import mixed_workload, paired_panel, report, run_on_local_ray, side_panels  # noqa: E402
from tessera.cluster.config import ClusterConfig  # noqa: E402
from tessera.cluster.launch import Cluster  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.async_engine import AsyncEngine  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import load_model  # noqa: E402

NAMESPACE = "tessera-bench-overhead"
DTYPE = "float32"
SIDES = ("cluster", "in_process")  # ours, the peer


async def run_streams(submit, prompts: list[list[int]], params, tag: str, salt: str) -> dict:
    """Submit every prompt at once through ``submit``; time each stream."""
    ttft: dict[int, float] = {}
    accepted: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}

    async def one(i: int, prompt: list[int]) -> None:
        start = time.perf_counter()
        stream = await submit(f"{tag}-{i}", prompt, params, salt)
        accepted[i] = time.perf_counter() - start
        out = tokens[i] = []
        async for delta in stream:
            if delta.token_ids and i not in ttft:
                ttft[i] = time.perf_counter() - start
            out.extend(delta.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    assert generated == len(prompts) * params.max_tokens, "a stream came back short"
    return {
        "ttft_s": statistics.fmean(ttft.values()),
        "tok_s": generated / wall,
        "submit_s": statistics.fmean(accepted.values()),
        "wall_s": wall,
        "tokens": [tokens[i] for i in range(len(prompts))],
    }


async def bench(args) -> None:
    loaded = load_model(None, DTYPE)
    tokenizer = loaded.tokenizer
    engine_config = EngineConfig(
        dtype=DTYPE, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs
    )
    engine = AsyncEngine(Engine(engine_config, loaded=loaded))
    config = ClusterConfig.create(
        workers=1,
        device="cpu",
        dtype=DTYPE,
        worker_num_cpus=float(args.threads),
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_ongoing_requests=args.max_num_seqs,
        namespace=NAMESPACE,
        scheduler_name="bench-overhead",
    )
    assert config.engine_config("cpu") == engine_config, "the two sides must run one engine"
    started = time.perf_counter()
    cluster = await Cluster.start(config)
    print(f"cluster up in {time.perf_counter() - started:.1f} s", flush=True)
    try:

        async def cluster_submit(request_id, prompt, params, salt):
            return await cluster.submit(request_id, prompt, params, cache_salt=salt)

        async def engine_submit(request_id, prompt, params, salt):
            return await engine.add_request(request_id, prompt, params, cache_salt=salt)

        submit = {"cluster": cluster_submit, "in_process": engine_submit}
        params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
        scenarios = {
            1: [
                ids
                for ids, _ in mixed_workload(
                    tokenizer, 1, seed=1, min_prompt=128, max_prompt=128, min_new=1, max_new=1
                )
            ],
            args.streams: [
                ids for ids, _ in mixed_workload(tokenizer, args.streams, seed=16, min_new=1)
            ],
        }
        # Warm up both sides' runtime on every scenario's shapes (the first forward
        # passes of a shape are slow), under a salt of its own.
        short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for n, prompts in scenarios.items():
            for side in SIDES:
                await run_streams(submit[side], prompts, short, f"warm-{side}-{n}", "warm-up")

        results = {(side, n): [] for side in SIDES for n in scenarios}
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            for n, prompts in scenarios.items():
                for side in order:
                    await asyncio.sleep(0.5)  # let the other side's stragglers settle
                    result = await run_streams(
                        submit[side], prompts, params, f"{side}-{n}-{repeat}", f"r{repeat}"
                    )
                    results[side, n].append(result)
                    print(
                        f"#{repeat} {side:10} x{n:<3} TTFT {result['ttft_s'] * 1e3:7.1f} ms, "
                        f"{result['tok_s']:6.1f} tok/s, submit {result['submit_s'] * 1e3:.1f} ms",
                        flush=True,
                    )
    finally:
        await cluster.shutdown()
        await engine.close()

    rows = []
    for n in scenarios:
        reference = results["in_process", n][0]["tokens"]
        same = all(r["tokens"] == reference for side in SIDES for r in results[side, n])
        med = {
            (side, key): statistics.median(r[key] for r in results[side, n])
            for side in SIDES
            for key in ("ttft_s", "tok_s", "submit_s")
        }
        # Each repeat's two runs are adjacent in time: their ratio cancels most drift.
        paired = {
            key: statistics.median(
                ours[key] / peer[key]
                for ours, peer in zip(results["cluster", n], results["in_process", n], strict=True)
            )
            for key in ("ttft_s", "tok_s")
        }
        rows.append(
            {
                "streams": n,
                "cluster_ttft_s": med["cluster", "ttft_s"],
                "in_process_ttft_s": med["in_process", "ttft_s"],
                "ttft_ratio": med["cluster", "ttft_s"] / med["in_process", "ttft_s"],
                "ttft_ratio_paired": paired["ttft_s"],
                "cluster_tok_s": med["cluster", "tok_s"],
                "in_process_tok_s": med["in_process", "tok_s"],
                "tok_s_ratio": med["cluster", "tok_s"] / med["in_process", "tok_s"],
                "tok_s_ratio_paired": paired["tok_s"],
                "cluster_submit_ms": 1e3 * med["cluster", "submit_s"],
                "same_outputs": same,
            }
        )

    def plot(ax):
        ax.figure.set_size_inches(10, 4)
        labels = [f"{r['streams']} stream" + ("s" if r["streams"] > 1 else "") for r in rows]
        names = ("1-worker cluster", "in-process AsyncEngine")
        for panel, key, scale, ylabel in zip(
            side_panels(ax, [1, 1]),
            ("ttft", "tok_s"),
            (1e3, 1),
            ("mean time to first token (ms)", "generated tokens / s"),
            strict=True,
        ):
            suffix = "_s" if key == "ttft" else ""
            paired_panel(
                panel,
                labels,
                [scale * r[f"cluster_{key}{suffix}"] for r in rows],
                [scale * r[f"in_process_{key}{suffix}"] for r in rows],
                names,
                [r[f"{key}_ratio"] for r in rows],
                ylabel,
                legend=key == "ttft",
            )
        fig = ax.figure
        fig.suptitle(
            f"{args.threads} torch threads each side, {args.new} new tokens, "
            f"medians of {args.repeats} alternating repeats; ratios: cluster / in-process",
            fontsize=9,
        )

    report(
        "cluster_overhead" + ("_quick" if args.quick else ""),
        rows,
        {
            "peer": "the same engine in-process (tessera.workers.engine.async_engine.AsyncEngine), "
            "same torch threads, same engine settings",
            "threads": args.threads,
            "worker_num_cpus": float(args.threads),
            "new_tokens": args.new,
            "prompt_tokens": {str(n): [len(p) for p in ps] for n, ps in scenarios.items()},
            "num_kv_blocks": args.num_kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "dtype": DTYPE,
            "repeats": args.repeats,
            "quick": args.quick,
            "runs": {
                f"{side}_x{n}": [
                    {k: v for k, v in r.items() if k != "tokens"} for r in results[side, n]
                ]
                for side in SIDES
                for n in scenarios
            },
        },
        plot,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads, each side")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16, help="the concurrent scenario")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.new, args.streams, args.repeats = 4, 4, 2
    torch.set_num_threads(args.threads)
    run_on_local_ray(bench(args), num_cpus=args.threads, namespace=NAMESPACE)


if __name__ == "__main__":
    main()
