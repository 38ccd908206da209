"""Parallel-token steps (TEMPO) vs ordinary greedy steps, on SmolLM2: cost and tokens.

The peer is plain greedy decoding of the same prompts on the same engine. Every run
submits ``--batch`` chat-template questions at once to a fresh engine, temperature 0,
EOS ignored, ``--max-tokens`` tokens each (a parallel set's members all count). The
parallel runs set ``ParallelTokensParams(threshold, --max-width, mode)`` for each
threshold (default 0.05, 0.1, 0.2) and mode (``isolated``: each member sees the context
and itself; ``visible``: it also sees the rest of its set).

Per setting: generated tokens, engine steps (``stats().steps`` before/after), tokens
per step (generated / steps; plain gives ``--batch``), the mean wall seconds of a decode
step (every step but those that prefill a prompt), ``step_cost_ratio`` (that over
plain's) and the sets' mean width (``len(ParallelSet.token_ids)`` over every set in
``RequestOutput.parallel_sets``, width-1 sets included) with the share of sets of two
or more. Each setting is warmed up once on a throwaway engine before timing.

    python benchmarks/parallel_tokens.py --max-tokens 128 --batch 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.common as common  # noqa: E402
from benchmarks.common import CHAT_QUESTIONS, chat_prompts, report, side_panels  # noqa: E402
from tessera.workers.api import PARALLEL_MODES, ParallelTokensParams, SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import DTYPES, load_model  # noqa: E402


def run(
    loaded,
    args,
    parallel: ParallelTokensParams | None,
    prompts: list[list[int]],
    blocks: int,
    max_tokens: int,
) -> dict:
    """One batch on a fresh engine: tokens, steps, decode-step times and set widths."""
    engine = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=blocks), loaded=loaded)
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, parallel_tokens=parallel
    )
    before = engine.stats().steps
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    generated = 0
    widths: list[int] = []
    started: set[str] = set()
    decode_times: list[float] = []
    start = time.perf_counter()
    while engine.has_work():
        step_start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - step_start
        prefilled = False
        for out in outputs:
            if out.token_ids and out.request_id not in started:
                started.add(out.request_id)
                prefilled = True  # this step computed the request's prompt
            generated += len(out.token_ids)
            widths += [len(s.token_ids) for s in out.parallel_sets or ()]
        if not prefilled:
            decode_times.append(elapsed)
    wall = time.perf_counter() - start
    stats = engine.stats()
    assert stats.preemptions == 0, "the pool was too small"
    if parallel is not None:
        assert sum(widths) == generated, "the sets do not account for every token"
    return {
        "generated": generated,
        "steps": stats.steps - before,
        "wall": wall,
        "decode_step_s": statistics.fmean(decode_times) if decode_times else 0.0,
        "decode_steps": len(decode_times),
        "widths": widths,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Writes <out>/parallel_tokens.json and .png (parallel_tokens_<dtype> for "
        "other dtypes than float32) and prints a table.",
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and KV")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--batch", type=int, default=4, help="prompts per run, all at once")
    parser.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        default=[0.05, 0.1, 0.2],
        help="set thresholds (probability)",
    )
    parser.add_argument(
        "--modes", nargs="+", default=list(PARALLEL_MODES), choices=PARALLEL_MODES, help="set modes"
    )
    parser.add_argument("--max-width", type=int, default=4, help="most tokens in one set")
    parser.add_argument("--out", type=Path, default=common.RESULTS, help="results folder")
    args = parser.parse_args()
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 (one prefill step, one decode step)")
    common.RESULTS = args.out  # report() writes there
    loaded = load_model(None, args.dtype)
    prompts = chat_prompts(loaded.tokenizer, CHAT_QUESTIONS, args.batch)
    blocks = args.batch * -(-(max(len(p) for p in prompts) + args.max_tokens) // 16) + 16
    settings: list[tuple[str, float | None, ParallelTokensParams | None]] = [("plain", None, None)]
    for mode in args.modes:
        for threshold in args.thresholds:
            params = ParallelTokensParams(threshold, args.max_width, mode)
            settings.append((mode, threshold, params))

    # Warm up every setting once (first passes are slow) on throwaway engines.
    for _, _, params in settings:
        run(loaded, args, params, prompts[:1], blocks, 8)

    rows = []
    plain = None
    for mode, threshold, params in settings:
        result = run(loaded, args, params, prompts, blocks, args.max_tokens)
        plain = plain or result
        widths = result["widths"]
        rows.append(
            {
                "mode": mode,
                "threshold": threshold,
                "generated_tokens": result["generated"],
                "steps": result["steps"],
                "tokens_per_step": result["generated"] / result["steps"],
                "mean_step_s": result["decode_step_s"],
                "step_cost_ratio": result["decode_step_s"] / plain["decode_step_s"],
                "mean_set_width": statistics.fmean(widths) if widths else None,
                "wide_set_share": sum(w > 1 for w in widths) / len(widths) if widths else None,
                "wall_s": result["wall"],
            }
        )
        print(rows[-1], flush=True)

    def plot(ax):
        left, right = side_panels(ax, [1, 1])
        base = rows[0]
        for panel, key, label in (
            (left, "tokens_per_step", "tokens per step"),
            (right, "step_cost_ratio", "decode step cost vs plain (x)"),
        ):
            for mode in args.modes:
                these = [r for r in rows if r["mode"] == mode]
                xs = [r["threshold"] for r in these]
                panel.plot(xs, [r[key] for r in these], "o-", label=mode)
            panel.axhline(base[key], color="grey", linestyle="--", label="plain")
            panel.set_xlabel(f"threshold (max width {args.max_width})")
            panel.set_ylabel(label)
            panel.legend(fontsize=8)

    report(
        "parallel_tokens" + ("" if args.dtype == "float32" else f"_{args.dtype}"),
        rows,
        {
            "peer": "plain greedy decoding of the same prompts on the same engine",
            "model": "SmolLM2-135M-Instruct (built-in)",
            "dtype": args.dtype,
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "max_width": args.max_width,
            "step_time": "mean_step_s: mean wall seconds of a decode step (prefill steps excluded)",
            "prompt_tokens": [len(p) for p in prompts],
            "num_kv_blocks": blocks,
        },
        plot,
    )


if __name__ == "__main__":
    main()
