"""Tensor parallelism on one machine: the engine with its model split over 2 ranks (1
torch thread each, two processes joined through shared memory) against the same engine
unsplit with 2 threads, in the same run, on the same file.

On a 2-core CPU the split buys nothing (the two ranks share the machine the unsplit
engine uses whole); what it measures is what the group costs: each step's message to
the other rank, two all-reduces per layer, the embedding's and the vocab gather.

Each row is one stream or ``--concurrency`` streams of ``--max-tokens`` greedy tokens
(EOS ignored) after a ``--prompt-tokens`` prompt, best of ``--repeats``; a step's time
is split into the time rank 0 spent in collectives (waiting for the other rank
included) and the rest.
Targets: the group at least 0.8x the unsplit engine at one stream and 0.9x at 16.

The peer runs as the engine runs by default (``native_decode``: every layer in one
native call); the group runs its layers op by op, so a third row shows the unsplit
engine op by op too (what the split itself costs, apart from the native stack).

    python benchmarks/tensor_parallel.py --model /tmp/big/llama1b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import paired_bars, report  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402

TARGETS = {1: 0.8, 16: 0.9}


def run(engine: Engine, streams: int, prompt_tokens: int, max_tokens: int, seed: int) -> dict:
    """One batch of ``streams`` requests to the end: tokens/s of the decode steps (the
    prompts' steps excluded) and the mean decode step split into its parts."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(streams):
        prompt = torch.randint(10, vocab - 10, (prompt_tokens,), generator=generator).tolist()
        engine.add_request(f"s{seed}-{i}", prompt, params)
    shard = engine.loaded.model.tp
    tp = engine.group
    steps = tokens = 0
    decode_s = forward_s = collective_s = 0.0
    moved = 0
    while engine.has_work():
        decoding = bool(engine.groups) and all(
            seq.num_computed_tokens >= len(group.request.prompt_token_ids)
            for group in engine.groups.values()
            for seq in group.seqs
        )
        before = (shard.collective_s, shard.collective_bytes) if shard is not None else (0.0, 0)
        sent = tp.sent_bytes if tp is not None else 0
        started = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - started
        if not decoding:  # a step with prompt rows
            continue
        steps += 1
        tokens += sum(len(out.token_ids) for out in outputs)
        decode_s += took
        forward_s += engine.runner.forward_time
        if shard is not None:
            collective_s += shard.collective_s - before[0]
            moved += shard.collective_bytes - before[1]
        if tp is not None:
            moved += tp.sent_bytes - sent
    return {
        "tok_s": tokens / decode_s,
        "step_ms": 1000 * decode_s / steps,
        "compute_ms": 1000 * (forward_s - collective_s) / steps,
        "collective_ms": 1000 * collective_s / steps,
        "bytes_per_step": moved // max(steps, 1),
    }


def measure(config: EngineConfig, threads: int, args, label: str) -> list[dict]:
    torch.set_num_threads(threads)
    engine = Engine(config, rank_resources={"CPU": 1.0})
    rows = []
    try:
        run(engine, 1, args.prompt_tokens, 8, seed=0)  # warm-up
        for streams in (1, args.concurrency):
            best = None
            for repeat in range(args.repeats):
                found = run(engine, streams, args.prompt_tokens, args.max_tokens, 1 + repeat)
                if best is None or found["tok_s"] > best["tok_s"]:
                    best = found
            rows.append({"engine": label, "streams": streams, **best})
            print(rows[-1], flush=True)
    finally:
        engine.close()
        del engine
        gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or HF directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    common = dict(model=args.model, dtype=args.dtype, num_kv_blocks=1024)
    try:
        rows = measure(EngineConfig(**common), 2, args, "unsplit, 2 threads")
        rows += measure(
            EngineConfig(**common, native_decode=False), 2, args, "unsplit op by op, 2 threads"
        )
        rows += measure(
            EngineConfig(**common, tensor_parallel_size=2), 1, args, "2 ranks, 1 thread each"
        )
    finally:
        ray.shutdown()
    base = {r["streams"]: r["tok_s"] for r in rows if r["engine"] == "unsplit, 2 threads"}
    for row in rows:
        row["ratio"] = row["tok_s"] / base[row["streams"]]
    targets = []
    for streams, goal in TARGETS.items():
        found = [r for r in rows if r["engine"].startswith("2 ranks") and r["streams"] == streams]
        ratio = found[0]["ratio"] if found else None
        targets.append(
            {
                "target": f"2 ranks >= {goal}x the unsplit engine at {streams} stream(s)",
                "ratio": ratio,
                "status": "not measured" if ratio is None else "met" if ratio >= goal else "missed",
            }
        )
    meta = {
        "peer": "the same engine unsplit (tensor_parallel_size 1), 2 torch threads, same run",
        "model": args.model,
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "targets": targets,
    }

    def plot(ax) -> None:
        labels = [f"{r['streams']} stream(s)" for r in rows if r["engine"].startswith("2 ranks")]
        ours = [r["tok_s"] for r in rows if r["engine"].startswith("2 ranks")]
        peer = [r["tok_s"] for r in rows if r["engine"] == "unsplit, 2 threads"]
        ratios = [r["ratio"] for r in rows if r["engine"].startswith("2 ranks")]
        paired_bars(ax, labels, ours, peer, ("2 ranks x 1 thread", "unsplit, 2 threads"), ratios)
        ax.set_ylabel("decode tokens/s")

    torch.set_num_threads(2)  # the machine's record: the unsplit engine's threads
    report("tensor_parallel", rows, meta, plot)


if __name__ == "__main__":
    main()
