"""``tessera cluster``: a cluster up (scheduler and workers on Ray), then each prompt
through it, or its workers' load every ``--stats-interval`` seconds until Ctrl-C. The
command line imports this module only to run the command: it loads Ray."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from tessera.cluster import exit_status
from tessera.cluster.cluster_config import ClusterConfig
from tessera.cluster.launch import Cluster
from tessera.workers.api import SamplingParams


async def run_cluster(
    config: ClusterConfig, sampling: SamplingParams, args: argparse.Namespace
) -> int:
    """Start the cluster, run the prompts (or stay up); the exit status."""
    print("starting the cluster ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    cluster = await Cluster.start(config)
    try:
        stats = await cluster.stats()
        print(
            f"cluster ready in {time.perf_counter() - start:.1f} s: "
            f"{len(stats.workers)} workers, placement {stats.policy}, "
            f"{config.precision_text(cluster.worker_num_cpus, cluster.precision, cluster.device)}",
            file=sys.stderr,
            flush=True,
        )
        if not args.prompt:
            while True:
                await asyncio.sleep(args.stats_interval)
                _print_load(await cluster.stats())
        prompts = args.prompt
        if args.chat:
            template = cluster.client.tokenizer.apply_chat_template
            prompts = [
                template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]

        async def complete(i: int, prompt: str) -> str:
            stream = await cluster.submit(f"cli-{i}", prompt, sampling)
            return "".join([delta.text async for delta in stream])

        texts = await asyncio.gather(*(complete(i, p) for i, p in enumerate(prompts)))
        for i, text in enumerate(texts):
            if len(texts) > 1:
                print(f"--- prompt {i} ---")
            print(text)
        _print_load(await cluster.stats())
        return exit_status.OK
    finally:
        await cluster.shutdown()


def _print_load(stats) -> None:
    """Each worker's status and load, then the scheduler's counters (on stderr)."""
    for worker in stats.workers:
        line = f"{worker.worker_id} {worker.status.value}: {worker.placed} placed"
        if worker.load is not None:
            engine = worker.load.engine
            cache = engine.prefix_cache
            line += (
                f", {worker.ongoing} ongoing, {engine.running} running, {engine.waiting} "
                f"waiting, KV {engine.kv_usage:.0%}, prefix hits {cache.hits}/{cache.queries} "
                f"tokens, step {engine.step_time * 1000:.0f} ms"
            )
        print(line, file=sys.stderr)
    print(
        f"queued {stats.queued}, placed {stats.placed}, refused {stats.refused}, "
        f"failovers {stats.failovers}",
        file=sys.stderr,
        flush=True,
    )
