"""Long prompts at a real size: Tessera's exact mode against transformers on the same GGUF.

    python benchmarks/long_context.py --model llama1b-Q4_K_M.gguf --lengths 4096 8192

For each prompt length (random token ids, fixed seed): Tessera's engine (float32, the
file's packed weights, chunked prefill at ``--chunk`` tokens a step) runs the prompt and
``--new-tokens`` greedy tokens; transformers (the reference) loads the same file
(``gguf`` dequantises it to float32) and runs the same prompt in one forward, then
decodes greedily with its cache. Reported per length: prompt tok/s (Tessera's time to the
first token; the reference's forward, for scale), the KV pool's bytes for the prompt
(Tessera's float32 paged cache: the blocks the request held), the largest difference
of the first token's logits over their largest magnitude, and whether the greedy tokens
agree (the exactness contract: equal, or first differing where the reference's top-2
gap is below ``NEAR_TIE_GAP``).

The peer is transformers, not a faster server: this checks that long context works and
is exact at a real size; ``vs_llamacpp.py`` and ``vs_vllm.py`` measure speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAME = "long_context"
#: The reference's top-2 gap under which a greedy token may differ (the design's clause).
NEAR_TIE_GAP = 1e-4


def tessera_run(engine, prompt: list[int], new: int) -> dict[str, Any]:
    """One greedy request through the engine (its chunked prefill): its tokens, the time
    to its first token, and the KV blocks it held."""
    from tessera.workers.api import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("long", prompt, params)
    tokens: list[int] = []
    first = None
    held = 0
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            if first is None and tokens:
                first = time.perf_counter()
        held = max(held, len(engine.kv.tables.get("long", ())))
    kv = engine.runner.kv_cache
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    return {
        "tokens": tokens,
        "prompt_tok_s": len(prompt) / (first - start),
        "kv_blocks": held,
        "kv_bytes": held * block_bytes,
    }


def reference_run(model, prompt: list[int], new: int) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        elapsed = time.perf_counter() - start
        logits = out.logits[0, -1].float()
        tokens, gaps = [], []
        cache, step = out.past_key_values, logits
        for _ in range(new):
            top2 = step.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            token = int(step.argmax())
            tokens.append(token)
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, step = out.past_key_values, out.logits[0, -1].float()
    return {"logits": logits, "tokens": tokens, "gaps": gaps, "prompt_s": elapsed}


def first_logits(loaded, prompt: list[int], chunk: int):
    """Tessera's next-token logits after the prompt, prefilled ``chunk`` tokens a step
    through the paged cache (the model layer and the runner, as the engine runs them)."""
    import torch

    from tessera.workers.api import Request
    from tessera.workers.engine.model_runner import ModelRunner
    from tessera.workers.engine.sequence import Sequence
    from tessera.workers.kv.kv_cache import allocate_kv_cache
    from tessera.workers.kv.manager import KVCacheManager

    block_size = 16
    num_blocks = -(-len(prompt) // block_size)
    kv = KVCacheManager(num_blocks, block_size)
    cache = allocate_kv_cache(
        loaded.config, num_blocks, block_size, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(loaded.model, kv, cache)
    seq = Sequence(
        Request("s", tuple(prompt)), seed=0, token_ids=list(prompt), detokenizer=None,
        stop_matcher=None,
    )  # fmt: skip
    assert kv.allocate("s", len(prompt))
    logits = None
    while seq.num_computed_tokens < len(prompt):
        n = min(chunk, len(prompt) - seq.num_computed_tokens)
        logits = runner.execute([seq.chunk(n)])
        seq.num_computed_tokens += n
    return logits[-1]


def agreement(ours: list[int], theirs: list[int], gaps: list[float]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            return f"near tie at {i}" if gaps[i] < NEAR_TIE_GAP else f"differs at {i}"
    return "equal"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="prompt tokens a step")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch
    import transformers

    from benchmarks.common import report
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine
    from tessera.workers.model.loader import load_model

    torch.set_num_threads(args.threads)
    model = Path(args.model)
    loaded = load_model(model, "float32")
    longest = max(args.lengths) + args.new_tokens
    engine = Engine(
        EngineConfig(
            num_kv_blocks=-(-longest // 16) + 4,
            max_num_batched_tokens=args.chunk,
            enable_prefix_caching=False,
            max_model_len=longest,
        ),
        loaded=loaded,
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model.parent, gguf_file=model.name, dtype=torch.float32
    ).eval()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        prompt = torch.randint(100, loaded.config.vocab_size, (length,), generator=generator)
        prompt = prompt.tolist()
        ours = tessera_run(engine, prompt, args.new_tokens)
        logits = first_logits(loaded, prompt, args.chunk)
        theirs = reference_run(reference, prompt, args.new_tokens)
        scale = float(theirs["logits"].abs().max())
        rows.append(
            {
                "prompt_tokens": length,
                "prompt_tok_s": ours["prompt_tok_s"],
                "reference_prompt_tok_s": length / theirs["prompt_s"],
                "kv_blocks": ours["kv_blocks"],
                "kv_mib": ours["kv_bytes"] / 2**20,
                "max_logit_diff_over_max": float((logits - theirs["logits"]).abs().max()) / scale,
                "greedy": agreement(ours["tokens"], theirs["tokens"], theirs["gaps"]),
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)

    def plot(ax) -> None:
        ax.bar([str(r["prompt_tokens"]) for r in rows], [r["prompt_tok_s"] for r in rows])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prompt tok/s (Tessera, exact)")
        for i, r in enumerate(rows):
            ax.annotate(r["greedy"], (i, r["prompt_tok_s"]), ha="center", va="bottom")

    report(
        f"{NAME}_{model.stem}",
        rows,
        {
            "peer": "transformers (float32, the same GGUF dequantised by gguf)",
            "model": str(model),
            "new_tokens": args.new_tokens,
            "chunk": args.chunk,
            "threads": args.threads,
            "near_tie_gap": NEAR_TIE_GAP,
        },
        plot,
    )


if __name__ == "__main__":
    main()
