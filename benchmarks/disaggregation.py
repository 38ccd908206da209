"""Prefill/decode interference: colocated (2 mixed workers) vs disaggregated (1 prefill
+ 1 decode worker), the same two workers' worth of CPU.

``--decoders`` requests with short prompts decode ``--decode-tokens`` tokens each (EOS
ignored); once they all stream, ``--long`` requests with ``--long-len``-token prompts
arrive one every ``--gap`` seconds and generate ``--long-new`` tokens. Measured: the
decoders' time per output token (every gap between two of a stream's deltas while the
long prompts arrive; p50 and p99), the long requests' time to first token (p50, max),
and the wall time. Colocated, a long prompt's prefill chunks share a worker's steps
with the decoders there; disaggregated, the prefill worker computes them and the decode
worker only pulls the blocks. Outputs must be token-identical between the two (greedy).
The peer is colocated serving; the ratio is disaggregated / colocated.

    python benchmarks/disaggregation.py --decoders 16 --long 6 --long-len 512
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report, run_on_local_ray  # noqa: E402
from tessera.cluster.config import ClusterConfig  # noqa: E402
from tessera.cluster.launch import Cluster  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402

NAMESPACE = "bench-disaggregation"
TEXT = (
    "The harbour master kept a ledger of every ship that came in, with its cargo, its "
    "crew and the weather on the day it arrived. "
)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def run_mode(mode: str, args) -> tuple[dict, dict[str, list[int]]]:
    roles = {"workers": 2} if mode == "colocated" else {"prefill_workers": 1, "decode_workers": 1}
    config = ClusterConfig.create(
        **roles,
        namespace=NAMESPACE,
        device="cpu",
        num_kv_blocks=args.kv_blocks,
        max_num_seqs=32,
        placement="least_loaded",
        report_interval_s=0.2,
    )
    cluster = await Cluster.start(config)
    tokenizer = cluster.client.tokenizer
    long_text = TEXT * (args.long_len // 20 + 2)
    long_prompts = [tokenizer(f"Ledger {i}. " + long_text).input_ids[: args.long_len]
                    for i in range(args.long)]  # fmt: skip
    outputs: dict[str, list[int]] = {}
    gaps: list[tuple[float, float]] = []  # (when, seconds per token)
    ttft: list[float] = []
    window = [float("inf"), float("-inf")]  # when the long prompts arrive and finish

    async def decoder(i: int, started: asyncio.Event, count: list[int]) -> None:
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        stream = await cluster.submit(f"d{i}", f"Ship {i} carried", params)
        last, tokens = None, []
        async for delta in stream:
            now = time.perf_counter()
            tokens += delta.token_ids
            if last is None:
                count[0] += 1
                if count[0] == args.decoders:
                    started.set()
            else:  # kept if it falls in the window, known at the end
                gaps.append((now, (now - last) / max(len(delta.token_ids), 1)))
            last = now
        outputs[f"d{i}"] = tokens

    async def long_request(i: int) -> None:
        params = SamplingParams(max_tokens=args.long_new, temperature=0, ignore_eos=True)
        sent = time.perf_counter()
        stream = await cluster.submit(f"l{i}", long_prompts[i], params)
        tokens = []
        async for delta in stream:
            if not tokens and delta.token_ids:
                ttft.append(time.perf_counter() - sent)
            tokens += delta.token_ids
        outputs[f"l{i}"] = tokens

    try:
        warm = SamplingParams(max_tokens=2, temperature=0)
        for i in range(2):  # each worker's torch runtime, before timing
            _ = [d async for d in await cluster.submit(f"warm{i}", "Hello there", warm)]
        started, count = asyncio.Event(), [0]
        begin = time.perf_counter()
        decoders = [asyncio.ensure_future(decoder(i, started, count)) for i in range(args.decoders)]
        await started.wait()
        window[0] = time.perf_counter()
        longs = []
        for i in range(args.long):
            longs.append(asyncio.ensure_future(long_request(i)))
            await asyncio.sleep(args.gap)
        await asyncio.gather(*longs)
        window[1] = time.perf_counter()
        await asyncio.gather(*decoders)
        wall = time.perf_counter() - begin
        during = [gap for when, gap in gaps if window[0] <= when <= window[1]]
        stats = await cluster.stats()
        moved = sum(w.load.transfers.bytes_received for w in stats.workers if w.load)
        fallbacks = sum(sum(w.load.transfers.fallbacks.values()) for w in stats.workers if w.load)
    finally:
        await cluster.shutdown()
    row = {
        "mode": mode,
        "tpot_p50_ms": statistics.median(during) * 1e3,
        "tpot_p99_ms": percentile(during, 0.99) * 1e3,
        "decoder_deltas_in_window": len(during),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "wall_s": wall,
        "kv_mbytes_moved": moved / 1e6,
        "fallbacks": fallbacks,
    }
    return row, outputs


async def main(args) -> None:
    colocated, expected = await run_mode("colocated", args)
    disaggregated, got = await run_mode("disaggregated", args)
    if got != expected:
        raise SystemExit("outputs differ between colocated and disaggregated serving")
    ratio = {"mode": "disaggregated / colocated"}
    for key in ("tpot_p50_ms", "tpot_p99_ms", "ttft_p50_s", "ttft_max_s", "wall_s"):
        ratio[key] = disaggregated[key] / colocated[key]
    ratio |= {"decoder_deltas_in_window": 0, "kv_mbytes_moved": 0.0, "fallbacks": 0}
    rows = [colocated, disaggregated, ratio]

    def plot(ax) -> None:
        keys = ["tpot_p50_ms", "tpot_p99_ms"]
        xs = range(len(keys))
        width = 0.38
        ax.bar([x - width / 2 for x in xs], [colocated[k] for k in keys], width,
               label="colocated (2 mixed)")  # fmt: skip
        ax.bar([x + width / 2 for x in xs], [disaggregated[k] for k in keys], width,
               label="1 prefill + 1 decode")  # fmt: skip
        ax.set_xticks(list(xs), ["decoders' TPOT p50", "TPOT p99"])
        ax.set_ylabel("ms per output token while long prompts arrive")
        ax.legend()

    meta = {"peer": "colocated serving (2 mixed workers)", **vars(args)}
    report("disaggregation", rows, meta, plot)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--long", type=int, default=6)
    parser.add_argument("--long-len", type=int, default=512)
    parser.add_argument("--long-new", type=int, default=8)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    args = parser.parse_args()
    run_on_local_ray(main(args), num_cpus=2, namespace=NAMESPACE)
