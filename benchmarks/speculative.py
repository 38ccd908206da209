"""Speculative decoding vs plain decoding of the same engine, on SmolLM2.

The peer is plain (non-speculative) decoding: the same engine, the same process, the
same prompts. Every run submits a batch of ``--batch`` chat-template prompts at once to
a fresh engine and decodes them greedily (temperature 0, EOS ignored) for
``--max-tokens`` tokens each. Two workloads:

* ``copy-heavy``: fix the typos in a given paragraph, or repeat it word for word (the
  output mostly copies the prompt: prompt lookup's best case);
* ``open chat``: open-ended questions (little to copy).

Configurations, set on the engine (``EngineConfig.speculative_method``, proposing up to
``--num-tokens`` drafts a step, adaptively):

* ``plain``: no speculation (the peer);
* ``ngram``: prompt lookup;
* ``draft=target``: the target as its own draft, so every draft is accepted: the most
  tokens a verification step can give, at the cost of ``k`` full draft passes a step
  (the overhead ceiling);
* ``draft=target:K``: the target's first K (``--draft-layers``) layers as the draft
  (self-speculative, sharing the weights).

tokens/s is generated tokens over the wall time of the whole batch (best of
``--repeats``); ``speedup`` is that over plain's on the same workload. Acceptance rate
and mean tokens per verification step come from the engine's ``stats()``;
``identical`` says whether every request's greedy tokens equal plain's. Each
configuration is warmed up once on a throwaway engine before timing.

    python benchmarks/speculative.py --max-tokens 128 --batch 1 4 --num-tokens 4

Batch 1 is the latency-bound case speculation is for; at batch 4 a step already
carries several sequences, and a step waits for its slowest one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.common as common  # noqa: E402
from benchmarks.common import CHAT_QUESTIONS, chat_prompts, report  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import DTYPES, load_model  # noqa: E402

PARAGRAPHS = [
    "The village of Elmbrook sits at the foot of a low hill, where the river bends twice "
    "before it reaches the sea. Every spring the farmers plant barley and oats in the "
    "long feilds beside the water, and every autum they bring the harvest to the old mill "
    "that stands neer the bridge.",
    "Our library opens at nine in the morning and closes at six in the evening from "
    "Monday to Saturday. Visitors may borow up to five books at a time for three weeks, "
    "and they can renew them twice by phone or online. Please return all books to the "
    "front desk or to the box beside the main enterance.",
    "To bake a simple loaf of bread, mix flour, water, salt and yeast in a large bowl "
    "untill the dough is smooth. Leave it to rise in a warm place for about an hour, then "
    "shape it and put it in a tin. Bake it in a hot oven for thirty minuets, until the "
    "crust is golden and the loaf sounds hollow.",
    "The comet was first seen by an amateur astronomer who was looking at the sky from "
    "her garden late one night. Over the next few weeks it grew brighter, and its long "
    "tail could be seen without a telescope. Sceintists say it will not return for "
    "another three thousand years, so most people were glad to have seen it.",
]
TEMPLATES = [
    "Fix the typos in the following paragraph and write it out in full, changing "
    "nothing else:\n\n{}",
    "Repeat the following passage exactly, word for word:\n\n{}",
]
# Distinct copy prompts, alternating the two instructions over the four paragraphs.
COPY_TASKS = [TEMPLATES[(i + i // 4) % 2].format(PARAGRAPHS[i % 4]) for i in range(8)]
WORKLOADS = {"copy-heavy": COPY_TASKS, "open chat": CHAT_QUESTIONS}
#: The seed note's claim (seeds/002-flash-speculative-batching-notes.md).
CLAIM = (2.0, 3.0)


def configs(args) -> dict[str, dict]:
    """Each configuration's EngineConfig settings."""
    spec = {"speculative_num_tokens": args.num_tokens}
    return {
        "plain": {},
        "ngram": {"speculative_method": "ngram", **spec},
        "draft=target": {"speculative_method": "draft", "draft_model": "target", **spec},
        f"draft=target:{args.draft_layers}": {
            "speculative_method": "draft",
            "draft_model": f"target:{args.draft_layers}",
            **spec,
        },
    }


def run(loaded, args, settings: dict, prompts: list[list[int]], blocks: int) -> dict:
    """One batch on a fresh engine: tokens per request, wall time, speculation counters."""
    engine = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=blocks, **settings), loaded=loaded)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    wall = time.perf_counter() - start
    stats = engine.stats()
    assert stats.preemptions == 0, "the pool was too small"
    return {"tokens": tokens, "wall": wall, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Writes <out>/speculative.json and .png (speculative_<dtype> for other "
        "dtypes than float32) and prints a table.",
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and KV")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1, 4],
        help="prompts per run, all at once; one run per value (default: 1 4)",
    )
    parser.add_argument("--num-tokens", type=int, default=4, help="most drafts per step")
    parser.add_argument(
        "--draft-layers", type=int, default=8, help="K of the self-speculative target:K draft"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per config, best kept")
    parser.add_argument("--out", type=Path, default=common.RESULTS, help="results folder")
    args = parser.parse_args()
    common.RESULTS = args.out  # report() writes there
    loaded = load_model(None, args.dtype)
    tok = loaded.tokenizer
    most = max(args.batch)
    prompts = {name: chat_prompts(tok, texts, most) for name, texts in WORKLOADS.items()}
    longest = max(len(p) for ps in prompts.values() for p in ps)
    blocks = most * -(-(longest + args.max_tokens + args.num_tokens + 1) // 16) + 16
    settings = configs(args)

    # Warm up every configuration once (first passes are slow) on throwaway engines.
    warm_args = argparse.Namespace(**{**vars(args), "max_tokens": 8})
    for config in settings.values():
        run(loaded, warm_args, config, prompts["open chat"][:1], blocks)

    rows = []
    groups = [(workload, size) for size in args.batch for workload in WORKLOADS]
    for workload, size in groups:
        batch = prompts[workload][:size]
        plain = None
        for name, config in settings.items():
            best = None
            for _ in range(args.repeats):
                result = run(loaded, args, config, batch, blocks)
                if best is None or result["wall"] < best["wall"]:
                    best = result
            stats = best["stats"]
            generated = sum(len(t) for t in best["tokens"].values())
            tok_s = generated / best["wall"]
            if plain is None:  # the first configuration, no speculation
                plain = {**best, "tok_s": tok_s}
            speculates = bool(config)
            rows.append(
                {
                    "workload": workload,
                    "batch": size,
                    "config": name,
                    "generated_tokens": generated,
                    "steps": stats.steps,
                    "wall_s": best["wall"],
                    "tok_s": tok_s,
                    "speedup": tok_s / plain["tok_s"],
                    "acceptance_rate": stats.spec_acceptance_rate if speculates else None,
                    "tokens_per_verify_step": stats.spec_tokens_per_step if speculates else None,
                    "spec_proposed": stats.spec_proposed,
                    "spec_accepted": stats.spec_accepted,
                    "identical": best["tokens"] == plain["tokens"],
                }
            )
            print(rows[-1], flush=True)

    names = list(settings)

    def plot(ax):
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [g + (j - (len(names) - 1) / 2) * width for g in range(len(groups))]
            values = [
                next(
                    r for r in rows if (r["workload"], r["batch"]) == group and r["config"] == name
                )
                for group in groups
            ]
            ax.bar(xs, [r["tok_s"] for r in values], width, label=name)
            for x, r in zip(xs, values, strict=True):
                ax.annotate(
                    f"{r['speedup']:.2f}x", (x, r["tok_s"]), ha="center", va="bottom", fontsize=8
                )
        ax.margins(y=0.12)
        ax.set_xticks(range(len(groups)), [f"{w}\nbatch {b}" for w, b in groups])
        ax.set_ylabel(f"tokens/s, {args.max_tokens} tokens each")
        ax.legend(fontsize=8)

    report(
        "speculative" + ("" if args.dtype == "float32" else f"_{args.dtype}"),
        rows,
        {
            "peer": "plain (non-speculative) greedy decoding of the same engine, same prompts",
            "note": note(rows, args),
            "model": "SmolLM2-135M-Instruct (built-in)",
            "target_layers": loaded.config.num_layers,
            "dtype": args.dtype,
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "num_tokens": args.num_tokens,
            "adaptive": True,
            "repeats": args.repeats,
            "prompt_tokens": {w: [len(p) for p in ps] for w, ps in prompts.items()},
            "num_kv_blocks": blocks,
        },
        plot,
    )


def note(rows: list[dict], args) -> str:
    """One line: what was measured here against the seed note's 2-3x claim."""
    spec = [r for r in rows if r["config"] != "plain"]
    best = max(spec, key=lambda r: r["speedup"])
    low, high = CLAIM
    where = "below" if best["speedup"] < low else "within" if best["speedup"] <= high else "above"

    def speedups(config: str) -> str:
        return "/".join(f"{r['speedup']:.2f}x" for r in rows if r["config"] == config)

    self_draft = f"draft=target:{args.draft_layers}"
    rates = "/".join(f"{r['acceptance_rate']:.0%}" for r in rows if r["config"] == self_draft)
    return (
        f"seed 002 claims {low:g}-{high:g}x for well-matched draft/target pairs; here "
        f"(SmolLM2-135M {args.dtype}, batches {args.batch}, {args.max_tokens} tokens, "
        f"k={args.num_tokens}) the best speculative run is {best['speedup']:.2f}x "
        f"({best['config']}, {best['workload']}, batch {best['batch']}), {where} that range; "
        "speedups "
        f"(copy-heavy/open chat per batch size): ngram {speedups('ngram')}, {self_draft} "
        f"{speedups(self_draft)} at {rates} acceptance, draft=target {speedups('draft=target')} "
        f"(every draft accepted: the overhead ceiling); greedy outputs identical to plain: "
        f"{all(r['identical'] for r in rows)}"
    )


if __name__ == "__main__":
    main()
