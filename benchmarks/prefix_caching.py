"""Prefix caching: 32 requests sharing a 512-token system prompt, cache on vs off.

Each request is the same 512-token system prompt followed by its own short question
(10-20 tokens), decoded greedily for 16 tokens with EOS ignored; all are submitted at
once to one fresh engine. The peer is the same engine with ``enable_prefix_caching=False``
(every request prefills its whole prompt). Two scenarios:

* ``cold``: the cache starts empty. The requests admitted in the first step all compute
  the system prompt; those admitted later hit the blocks cached after that step.
* ``warm``: one request with the system prompt runs to completion first (on both sides),
  then the 32 are submitted; only those 32 are measured.

Time to first token is per request, from its submission to its first delta carrying
token ids; throughput is generated tokens over the wall time of the whole batch.
``prompt_tokens_computed`` counts the prompt tokens the model actually ran. Outputs must
be token-identical with the cache on and off.

    python benchmarks/prefix_caching.py --requests 32 --system-len 512 --new 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import DTYPES, load_model  # noqa: E402

SYSTEM_TEXT = (
    "You are a careful and friendly assistant working for a small public library. "
    "You help visitors find books, explain how to borrow and return them, and describe "
    "the opening hours, the reading rooms and the events held each month. When a visitor "
    "asks about a topic, suggest two or three books and say on which shelf they can be "
    "found. Answer in plain language, keep your answers short, and never invent titles "
    "that the library does not hold. If you do not know something, say so and point the "
    "visitor to the front desk, where a librarian can help them in person. "
)
SUBJECTS = ["rivers", "volcanoes", "bees", "old maps", "jazz", "chess", "bread", "comets"]
TEMPLATES = [
    "Which books would you suggest about {}?",
    "Do you have anything for children on {}?",
    "Where is the shelf with books on {}, please?",
    "Is there an event this month about {}?",
]


def system_prompt(tokenizer, length: int) -> list[int]:
    text = SYSTEM_TEXT
    while len(tokenizer(text).input_ids) < length:
        text += SYSTEM_TEXT
    return tokenizer(text).input_ids[:length]


def questions(tokenizer, count: int) -> list[list[int]]:
    texts = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    texts += [f"Question {i}: {texts[i % len(texts)]}" for i in range(len(texts), count)]
    return [tokenizer(" User: " + text + " Assistant:").input_ids for text in texts[:count]]


def run(
    loaded,
    args,
    cache: bool,
    prompts: list[list[int]],
    warm_prompt: list[int] | None,
    blocks: int,
) -> dict:
    engine = Engine(
        EngineConfig(dtype=args.dtype, num_kv_blocks=blocks, enable_prefix_caching=cache),
        loaded=loaded,
    )
    sampling = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    if warm_prompt is not None:
        engine.add_request("warm", warm_prompt, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_work():
            engine.step()
    before = engine.stats()
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
        submitted[f"r{i}"] = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            if out.token_ids:
                first.setdefault(out.request_id, time.perf_counter())
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
    wall = time.perf_counter() - start
    after = engine.stats()
    assert after.preemptions == 0, "the pool was too small: raise --num-kv-blocks"
    ttft = [first[rid] - submitted[rid] for rid in submitted]
    queries = after.prefix_cache.queries - before.prefix_cache.queries
    hits = after.prefix_cache.hits - before.prefix_cache.hits
    return {
        "mean_ttft_s": statistics.fmean(ttft),
        "p50_ttft_s": statistics.median(ttft),
        "throughput_tok_s": sum(len(t) for t in tokens.values()) / wall,
        "prompt_tokens_computed": after.prompt_tokens - before.prompt_tokens,
        "hit_rate": hits / queries if queries else 0.0,
        "wall_s": wall,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: enough")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.system_len, args.new = 6, 96, 3
    loaded = load_model(None, args.dtype)
    tok = loaded.tokenizer
    system = system_prompt(tok, args.system_len)
    prompts = [system + q for q in questions(tok, args.requests)]
    warm_prompt = system + tok(" User: Hello! Assistant:").input_ids
    longest = max(len(p) for p in prompts) + args.new
    blocks = args.num_kv_blocks or args.requests * -(-longest // 16) + 64
    # Warm up the runtime (first forward passes are slow) on a throwaway engine.
    engine = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=64), loaded=loaded)
    engine.add_request("w", prompts[0][:64], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_work():
        engine.step()
    del engine

    rows = []
    for scenario in ("cold", "warm"):
        warm = warm_prompt if scenario == "warm" else None
        off = run(loaded, args, False, prompts, warm, blocks)
        on = run(loaded, args, True, prompts, warm, blocks)
        same = on.pop("tokens") == off.pop("tokens")
        for cache, result in (("off", off), ("on", on)):
            rows.append(
                {
                    "scenario": scenario,
                    "cache": cache,
                    **result,
                    "ttft_speedup": off["mean_ttft_s"] / result["mean_ttft_s"],
                    "throughput_speedup": result["throughput_tok_s"] / off["throughput_tok_s"],
                    "same_outputs": same,
                }
            )
            print(rows[-1], flush=True)

    def plot(ax):
        xs = range(2)
        for offset, cache in ((-0.2, "off"), (0.2, "on")):
            values = [r["mean_ttft_s"] for r in rows if r["cache"] == cache]
            ax.bar([x + offset for x in xs], values, 0.4, label=f"prefix cache {cache}")
        ons = [r for r in rows if r["cache"] == "on"]
        offs = [r for r in rows if r["cache"] == "off"]
        for x, r, base in zip(xs, ons, offs, strict=True):
            label = f"on: TTFT {r['ttft_speedup']:.1f}x, tok/s {r['throughput_speedup']:.1f}x"
            top = max(r["mean_ttft_s"], base["mean_ttft_s"])
            ax.annotate(label, (x, top), ha="center", va="bottom", fontsize=9)
        ax.margins(y=0.25)
        ax.set_xticks(list(xs), ["cold cache", "warm cache (system prompt ran first)"])
        ax.set_ylabel(f"mean time to first token (s), {args.requests} requests")
        ax.legend()

    report(
        "prefix_caching" + ("_quick" if args.quick else ""),
        rows,
        {
            "peer": "the same engine with prefix caching off (every prompt fully prefilled)",
            "requests": args.requests,
            "system_prompt_tokens": len(system),
            "question_tokens": [len(p) - len(system) for p in prompts],
            "new_tokens": args.new,
            "num_kv_blocks": blocks,
            "max_num_batched_tokens": EngineConfig().max_num_batched_tokens,
            "dtype": args.dtype,
            "quick": args.quick,
        },
        plot,
    )


if __name__ == "__main__":
    main()
