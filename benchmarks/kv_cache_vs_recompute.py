"""KV cache vs recomputing the whole sequence every step, on SmolLM2.

The peer is the same model with no cache: each new token re-runs the forward pass over
prompt + everything generated so far (what seeds/004-kv-cache-notes.md measured, 13x on
a toy model). Both decode greedily and must produce the same tokens.

    python benchmarks/kv_cache_vs_recompute.py --dtype bfloat16 --prompt-len 128 --new 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import mixed_workload, report, timed  # noqa: E402
from tessera.workers.api import Request, SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.engine.model_runner import ModelRunner  # noqa: E402
from tessera.workers.engine.sequence import Sequence  # noqa: E402
from tessera.workers.kv.kv_cache import allocate_kv_cache  # noqa: E402
from tessera.workers.kv.manager import KVCacheManager  # noqa: E402
from tessera.workers.model.loader import DTYPES, load_model  # noqa: E402


def with_cache(engine: Engine, prompt: list[int], new: int) -> list[int]:
    engine.add_request("c", prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.token_ids)
    return tokens


def recompute(loaded, prompt: list[int], new: int, dtype: torch.dtype) -> list[int]:
    """No KV reuse: every step prefills the whole sequence into fresh blocks."""
    total = len(prompt) + new
    kv = KVCacheManager(num_blocks=-(-total // 16), block_size=16)
    cache = allocate_kv_cache(loaded.config, kv.pool.num_blocks, 16, dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, kv, cache)
    tokens = list(prompt)
    for _ in range(new):
        seq = Sequence(Request("r", tuple(prompt)), 0, list(tokens), None, None)
        kv.allocate("r", len(tokens))
        logits = runner.execute([seq.chunk(len(tokens))])
        kv.free("r")
        tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt) :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, nargs="+", default=[32, 64, 128])
    args = parser.parse_args()
    loaded = load_model(None, args.dtype)
    engine = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=64), loaded=loaded)
    prompt = mixed_workload(
        loaded.tokenizer, 1, min_prompt=args.prompt_len, max_prompt=args.prompt_len
    )[0][0]
    with_cache(engine, prompt, 4)  # warm-up
    rows = []
    for new in args.new:
        cached, t_cache = timed(lambda n=new: with_cache(engine, prompt, n))
        plain, t_plain = timed(lambda n=new: recompute(loaded, prompt, n, DTYPES[args.dtype]))
        rows.append(
            {
                "new_tokens": new,
                "kv_cache_tok_s": new / t_cache,
                "recompute_tok_s": new / t_plain,
                "speedup": t_plain / t_cache,
                "same_tokens": cached == plain,
            }
        )

    def plot(ax):
        ax.plot([r["new_tokens"] for r in rows], [r["speedup"] for r in rows], "o-")
        ax.set_xlabel(f"new tokens (prompt {args.prompt_len})")
        ax.set_ylabel("speedup of KV cache over recompute (x)")

    report(
        f"kv_cache_vs_recompute_{args.dtype}",
        rows,
        {
            "peer": "same model, no KV cache (full recompute per token)",
            "prompt_len": args.prompt_len,
            "dtype": args.dtype,
        },
        plot,
    )


if __name__ == "__main__":
    main()
