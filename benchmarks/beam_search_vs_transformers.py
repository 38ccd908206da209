"""Beam search (width 4) tokens/s of the engine vs transformers ``generate`` on SmolLM2.

The peer is ``generate(num_beams=4, num_return_sequences=4, do_sample=False,
length_penalty=1.0, early_stopping=...)`` on the same GGUF weights in the same dtype,
with the model's end tokens. Chat-style prompts run one request at a time on both sides;
the extra row submits all prompts at once to one engine (continuous batching of several
beam groups) against one left-padded ``generate`` call over all prompts. tokens/s is the
same formula on both sides: the tokens of all returned beams (up to and including the
end token) over wall time. ``same_beams`` says whether every returned beam is
token-identical to transformers'; ``max_score_diff`` compares the beams' scores. Each
side keeps its best of ``--repeats`` alternating runs (this machine's speed drifts); the
engine is fresh for every run, so prompts are never cached from an earlier one.

    python benchmarks/beam_search_vs_transformers.py --dtype float32 --new 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import paired_bars, report  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import DTYPES, builtin_model_path, load_model  # noqa: E402

WIDTH = 4
QUESTIONS = [
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between rivers and glaciers as agents of erosion?",
    "Describe a good morning routine for a student preparing for exams.",
]

Beams = list[tuple[list[int], float]]  # per prompt: (token ids, score), best first


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for question in QUESTIONS[:count]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def make_engine(loaded, dtype: str) -> Engine:
    return Engine(EngineConfig(dtype=dtype, num_kv_blocks=512, max_num_seqs=64), loaded=loaded)


def run_ours(
    engine: Engine, prompts: list[list[int]], sampling: SamplingParams, together: bool
) -> tuple[list[Beams], float]:
    """Beams per prompt and the wall time; one request at a time unless ``together``."""
    results: dict[str, dict[int, tuple[list[int], float]]] = {}

    def drain() -> None:
        while engine.has_work():
            for out in engine.step():
                beams = results.setdefault(out.request_id, {})
                beams.setdefault(out.index, ([], out.score))[0].extend(out.token_ids)

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, sampling)
        if not together:
            drain()
    drain()
    elapsed = time.perf_counter() - start
    beams = [[results[f"p{i}"][k] for k in sorted(results[f"p{i}"])] for i in range(len(prompts))]
    return beams, elapsed


def run_transformers(
    model, prompts: list[list[int]], eos: tuple[int, ...], new: int, early_stopping, together: bool
) -> tuple[list[Beams], float]:
    """Beams per prompt and the wall time; ``together``: one left-padded batch."""
    batches = [prompts] if together else [[p] for p in prompts]
    beams: list[Beams] = []
    start = time.perf_counter()
    for batch in batches:
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), eos[0])
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=mask,
                num_beams=WIDTH,
                num_return_sequences=WIDTH,
                max_new_tokens=new,
                do_sample=False,
                early_stopping=early_stopping,
                length_penalty=1.0,
                eos_token_id=list(eos),
                pad_token_id=eos[0],
                return_dict_in_generate=True,
                output_scores=True,  # for sequences_scores; keeps references, no copies
            )
        for p in range(len(batch)):
            group = []
            for row in range(p * WIDTH, (p + 1) * WIDTH):
                tokens = out.sequences[row, width:].tolist()
                end = next((i for i, t in enumerate(tokens) if t in eos), None)
                tokens = tokens if end is None else tokens[: end + 1]
                group.append((tokens, float(out.sequences_scores[row])))
            beams.append(group)
    return beams, time.perf_counter() - start


def count_tokens(beams: list[Beams]) -> int:
    return sum(len(tokens) for group in beams for tokens, _ in group)


def compare(ours: list[Beams], theirs: list[Beams]) -> tuple[bool, float]:
    same = [[t for t, _ in g] for g in ours] == [[t for t, _ in g] for g in theirs]
    diffs = [
        abs(a[1] - b[1])
        for ga, gb in zip(ours, theirs, strict=True)
        for a, b in zip(ga, gb, strict=True)
    ]
    return same, max(diffs, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new", type=int, default=32, help="max new tokens per beam")
    parser.add_argument("--prompts", type=int, default=4, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--early-stopping", default="false", choices=["false", "true", "never"])
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs, best kept")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.new, args.prompts, args.repeats = 4, 2, 1
    early_stopping = {"false": False, "true": True, "never": "never"}[args.early_stopping]
    from transformers import AutoModelForCausalLM

    path = builtin_model_path()
    loaded = load_model(path, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=DTYPES[args.dtype]
    ).eval()
    eos = tuple(loaded.config.eos_token_ids)
    prompts = chat_prompts(loaded.tokenizer, args.prompts)
    sampling = SamplingParams(
        beam_width=WIDTH,
        n=WIDTH,
        max_tokens=args.new,
        length_penalty=1.0,
        early_stopping=early_stopping,
    )
    warm = SamplingParams(beam_width=WIDTH, n=WIDTH, max_tokens=2)  # warm-up both sides
    run_ours(make_engine(loaded, args.dtype), prompts[:1], warm, False)
    run_transformers(hf, prompts[:1], eos, 2, early_stopping, False)

    rows = []
    for mode, together in (("one at a time", False), ("all prompts at once", True)):
        best_ours, best_theirs = float("inf"), float("inf")
        for _ in range(args.repeats):
            ours, t_ours = run_ours(make_engine(loaded, args.dtype), prompts, sampling, together)
            theirs, t_theirs = run_transformers(
                hf, prompts, eos, args.new, early_stopping, together
            )
            best_ours, best_theirs = min(best_ours, t_ours), min(best_theirs, t_theirs)
        same, score_diff = compare(ours, theirs)
        ours_tok_s = count_tokens(ours) / best_ours
        theirs_tok_s = count_tokens(theirs) / best_theirs
        rows.append(
            {
                "mode": mode,
                "prompts": len(prompts),
                "tessera_tok_s": ours_tok_s,
                "transformers_tok_s": theirs_tok_s,
                "speedup": ours_tok_s / theirs_tok_s,
                "tessera_s": best_ours,
                "transformers_s": best_theirs,
                "beam_tokens": count_tokens(ours),
                "same_beams": same,
                "max_score_diff": score_diff,
            }
        )
        print(rows[-1], flush=True)

    def plot(ax):
        paired_bars(
            ax,
            [r["mode"] for r in rows],
            [r["tessera_tok_s"] for r in rows],
            [r["transformers_tok_s"] for r in rows],
            ("tessera", "transformers generate"),
            [r["speedup"] for r in rows],
        )
        ax.set_ylabel(f"returned beam tokens / s (width {WIDTH})")

    report(
        f"beam_search_vs_transformers_{args.dtype}" + ("_quick" if args.quick else ""),
        rows,
        {
            "peer": f"transformers generate(num_beams={WIDTH}, num_return_sequences={WIDTH}), "
            "same GGUF weights and dtype; all-at-once row: one left-padded batch",
            "beam_width": WIDTH,
            "max_new_tokens": args.new,
            "early_stopping": early_stopping,
            "length_penalty": 1.0,
            "repeats": args.repeats,
            "dtype": args.dtype,
            "questions": QUESTIONS[: len(prompts)],
            "quick": args.quick,
        },
        plot,
    )


if __name__ == "__main__":
    main()
