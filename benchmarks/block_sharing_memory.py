"""Peak KV blocks of beam search and n > 1 sampling, with block sharing on vs off.

Forks (the n children of a sampled request, the beams of a beam search) point at their
parent's blocks and copy only the block they write into. The peer is the same engine with
``enable_block_sharing=False`` and ``enable_prefix_caching=False``: every fork gets a
private copy of all its parent's blocks. Both runs must return the same tokens; the
figure is the most KV blocks in use at any step (``EngineStats.peak_used_blocks``).

    python benchmarks/block_sharing_memory.py --prompt-len 200 --new 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import mixed_workload, paired_bars, report, timed  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import DTYPES, load_model  # noqa: E402

BLOCK_SIZE = 16


def workloads(new: int) -> dict[str, SamplingParams]:
    return {
        "beam x4": SamplingParams(beam_width=4, n=4, max_tokens=new, early_stopping="never"),
        "beam x8": SamplingParams(beam_width=8, n=8, max_tokens=new, early_stopping="never"),
        "sample n=8": SamplingParams(
            n=8, max_tokens=new, temperature=1.0, seed=1234, ignore_eos=True
        ),
    }


def run(
    loaded, dtype: str, blocks: int, prompt: list[int], sampling: SamplingParams, share: bool
) -> tuple[int, dict[int, list[int]]]:
    """(peak KV blocks in use, token ids of each returned output by index)."""
    engine = Engine(
        EngineConfig(
            dtype=dtype,
            num_kv_blocks=blocks,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=share,
            enable_block_sharing=share,
        ),
        loaded=loaded,
    )
    engine.add_request("r", prompt, sampling)
    tokens: dict[int, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.index, []).extend(out.token_ids)
    stats = engine.stats()
    assert stats.preemptions == 0, "the pool was too small: raise --num-kv-blocks"
    return stats.peak_used_blocks, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.prompt_len, args.new = 40, 4
    loaded = load_model(None, args.dtype)
    prompt = mixed_workload(
        loaded.tokenizer, 1, seed=7, min_prompt=args.prompt_len, max_prompt=args.prompt_len
    )[0][0]
    rows = []
    for name, sampling in workloads(args.new).items():
        (shared, ours), t_on = timed(
            lambda s=sampling: run(loaded, args.dtype, args.num_kv_blocks, prompt, s, True)
        )
        (unshared, theirs), t_off = timed(
            lambda s=sampling: run(loaded, args.dtype, args.num_kv_blocks, prompt, s, False)
        )
        rows.append(
            {
                "workload": name,
                "blocks_shared": shared,
                "blocks_unshared": unshared,
                "saving_x": unshared / shared,
                "same_outputs": ours == theirs,
                "outputs": len(ours),
                "seconds_shared": t_on,
                "seconds_unshared": t_off,
            }
        )
        print(rows[-1], flush=True)

    def plot(ax):
        paired_bars(
            ax,
            [r["workload"] for r in rows],
            [r["blocks_shared"] for r in rows],
            [r["blocks_unshared"] for r in rows],
            ("sharing", "no sharing (forks copy)"),
            [r["saving_x"] for r in rows],
        )
        ax.set_ylabel(f"peak KV blocks ({BLOCK_SIZE} tokens each)")
        ax.set_xlabel(f"prompt {len(prompt)} tokens, {args.new} new")

    report(
        "block_sharing_memory" + ("_quick" if args.quick else ""),
        rows,
        {
            "peer": "the same engine with block sharing and prefix caching off "
            "(every fork copies its parent's blocks)",
            "prompt_len": len(prompt),
            "new_tokens": args.new,
            "block_size": BLOCK_SIZE,
            "dtype": args.dtype,
            "quick": args.quick,
        },
        plot,
    )


if __name__ == "__main__":
    main()
