"""Tessera over several Ray nodes on this machine, against the same cluster on one node.

Ray here is one head node and two added nodes (``benchmarks/ray_nodes.py``: real
raylets with their own CPUs and custom resources). The same closed-loop load of greedy
requests (``--requests`` prompts, ``--concurrency`` in flight, ``--max-tokens`` each)
runs through the cluster client on:

1. ``one node`` (the peer): three mixed workers, all on the head node (each asks for
   ``tessera-mixed``, which only the head offers);
2. ``three nodes``: three mixed workers spread over the three nodes (``SPREAD``);
3. ``three nodes, one lost``: the same, and the node of one worker is killed (its
   raylet and object store, at once) when half the requests have finished;
4. ``P/D across nodes``: a prefill worker on one added node and a decode worker on the
   other, KV blocks over gRPC between them; its peer is ``P/D on one node`` (both
   workers on the head).

Every output must equal the in-process engine's (greedy, float32), also across the lost
node. Reported per run: output tokens per second, requests finished, failovers, KV
pulls and their mean seconds, where the workers ran; the ratios are over the one-node
peer. On one machine the nodes share its cores, so the ratios show what the node
boundary and a node's loss cost, not what more machines would give.

    python benchmarks/multi_node.py --requests 24 --concurrency 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import ray

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: `benchmarks` is then importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402
from benchmarks.ray_nodes import RayNodes, head_node_id  # noqa: E402
from benchmarks.soak import PROMPTS, references  # noqa: E402


async def run_load(
    cluster, prompts: list[str], max_tokens: int, concurrency: int, on_half=None
) -> tuple[dict[str, list[int]], float]:
    """Submit every prompt, ``concurrency`` at a time; their tokens, and the wall time."""
    from tessera.workers.api import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        async with gate:
            out: list[int] = []
            stream = await cluster.submit(f"b{i}-{time.monotonic_ns()}", prompts[i], params)
            async for delta in stream:
                out.extend(delta.token_ids)
            tokens[str(i)] = out
            done += 1
            if on_half is not None and done == len(prompts) // 2:
                on_half()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return tokens, time.perf_counter() - start


async def measure(name: str, fields: dict[str, Any], args, expected, nodes, lose: bool):
    from tessera.cluster.config import ClusterConfig
    from tessera.cluster.launch import Cluster

    config = ClusterConfig.create(
        namespace="multi-node-bench",
        device="cpu",
        num_kv_blocks=256,
        block_size=16,
        report_interval_s=0.25,
        worker_num_cpus=1,
        **fields,
    )
    cluster = await Cluster.start(config)
    try:
        stats = await cluster.stats()
        placed_on = {w.worker_id: w.node_id for w in stats.workers}
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.requests)]
        await run_load(cluster, prompts[:2], 4, 2)  # warm-up: each worker's first steps
        on_half = None
        if lose:
            victim = next(n for n in nodes.ids if n in placed_on.values())

            def on_half() -> None:
                nodes.remove(victim)

        tokens, wall = await run_load(cluster, prompts, args.max_tokens, args.concurrency, on_half)
        await asyncio.sleep(1.0)  # the workers' last reports
        stats = await cluster.stats()
    finally:
        await cluster.shutdown()
    exact = sum(tokens[str(i)] == expected[str(i)] for i in range(args.requests))
    transfers = [w.load.transfers for w in stats.workers if w.load and w.load.transfers.pulls]
    pulls = sum(t.pulls for t in transfers)
    nodes_used = len(set(placed_on.values()))
    return {
        "run": name,
        "tok_s": sum(len(t) for t in tokens.values()) / wall,
        "requests": len(tokens),
        "exact": exact,
        "failovers": stats.failovers,
        "nodes": nodes_used,
        "kv_pulls": pulls,
        "kv_pull_s": sum(t.seconds for t in transfers) / pulls if pulls else None,
        "wall_s": wall,
        "placed_on": {w: (n == head_node_id() and "head") or n[:8] for w, n in placed_on.items()},
    }


async def bench(args) -> list[dict[str, Any]]:
    print("references from the in-process engine ...", flush=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.requests)]
    expected = {
        str(i): tokens
        for i, (_, tokens) in enumerate(
            references(prompts, args.max_tokens, ignore_eos=True).values()
        )
    }
    nodes = RayNodes()
    pd = {"prefill_workers": 1, "decode_workers": 1, "role_resources": True}
    # (run, the added nodes' custom resources, cluster fields, lose a node)
    runs = [
        ("one node", [{}, {}], {"workers": 3, "role_resources": True}, False),
        ("three nodes", [{}, {}], {"workers": 3}, False),
        ("three nodes, one lost", [{}, {}], {"workers": 3}, True),
        ("P/D across nodes", [{"tessera-prefill": 1}, {"tessera-decode": 1}], pd, False),
        ("P/D on one node", [{"tessera-prefill": 1, "tessera-decode": 1}], pd, False),
    ]
    rows = []
    try:
        for name, offers, fields, lose in runs:
            nodes.remove_all()  # fresh nodes for each run (one may have been lost)
            for offer in offers:
                nodes.add(2 if len(offers) == 1 else 1, offer)
            print(f"{name} ...", flush=True)
            rows.append(await measure(name, fields, args, expected, nodes, lose))
            print(f"  {rows[-1]}", flush=True)
        return rows
    finally:
        nodes.remove_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    # the head offers 3 CPUs and 'tessera-mixed' for the one-node run's three workers
    ray.init(
        num_cpus=3,
        resources={"tessera-mixed": 3},
        namespace="multi-node-bench",
        include_dashboard=False,
        object_store_memory=150 * 2**20,
        log_to_driver=False,
    )
    try:
        rows = asyncio.run(bench(args))
    finally:
        ray.shutdown()
    by_name = {r["run"]: r for r in rows}
    for row in rows:
        peer = by_name["P/D on one node" if row["run"].startswith("P/D") else "one node"]
        row["ratio"] = row["tok_s"] / peer["tok_s"]
    table = [
        {
            "run": r["run"],
            "nodes": r["nodes"],
            "tok/s": round(r["tok_s"], 1),
            "ratio": f"{r['ratio']:.2f}x",
            "exact": f"{r['exact']}/{args.requests}",
            "failovers": r["failovers"],
            "KV pulls": r["kv_pulls"],
            "s/pull": round(r["kv_pull_s"], 4) if r["kv_pull_s"] else "-",
        }
        for r in rows
    ]

    def plot(ax) -> None:
        ax.barh([r["run"] for r in rows], [r["tok_s"] for r in rows])
        ax.set_xlabel("output tokens / s (closed loop, greedy)")
        ax.invert_yaxis()

    report("multi_node", table, {"args": vars(args), "runs": rows}, plot)


if __name__ == "__main__":
    main()
