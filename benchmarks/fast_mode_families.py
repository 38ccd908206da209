"""The fast mode's quality per model family: agreement, KL and perplexity against the
exact mode, each family's Q4_0 GGUF file read both ways in the same run.

For each family, a tiny random model (peaked logits) is written by llama.cpp's own
converter and its matrices re-quantised to Q4_0 (``convert_families.py``); Tessera loads
the file in the exact mode (``float32``: equal to transformers on the file's weights) and
in the fast mode (``auto`` where the CPU has the AVX512_BF16 kernels: bf16 inputs to the
Q4 matmuls and the Q8_0 head, a float16 KV cache). Teacher-forced over random token
sequences, every position's next-token distribution of the fast mode is compared with the
exact mode's, as ``tests/engine/test_fast_mode.py`` holds SmolLM2 to its contract:

* agreement: the share of positions whose argmax is the same (``decisive``: of the
  positions whose exact top-2 logit gap is at least ``--decisive-gap``; a random model has
  many near-ties, where either token is right);
* mean KL(exact || fast) per position, in nats;
* perplexity of the sequences under each mode (their ratio).

A family meets the contract where decisive agreement >= 99%, mean KL <= 2e-4 nats and the
perplexities are within 1%; ``auto`` picks the fast mode only for the families that do
(``FAST_MODE_FAMILIES`` in ``workers/model/config.py``).

    .venv/bin/python benchmarks/convert_families.py --llama-cpp LLAMA_CPP \\
        --out /tmp/families --outtype q4_0
    .venv/bin/python benchmarks/fast_mode_families.py --models /tmp/families
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import report  # noqa: E402
from tessera.workers.engine.flat_batch import Chunk  # noqa: E402
from tessera.workers.engine.model_runner import ModelRunner  # noqa: E402
from tessera.workers.kv.kv_cache import allocate_kv_cache  # noqa: E402
from tessera.workers.kv.manager import KVCacheManager  # noqa: E402
from tessera.workers.model.loader import LoadedModel, fast_mode_available, load_model  # noqa: E402

BLOCK_SIZE = 16
#: The contract (``tests/engine/test_fast_mode.py``'s for SmolLM2).
MIN_AGREEMENT, MAX_MEAN_KL, MAX_PERPLEXITY_CHANGE = 0.99, 2e-4, 0.01


def teacher_forced(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """float32 log-probabilities of the next token at every position, one prefill."""
    blocks = -(-len(tokens) // BLOCK_SIZE)
    kv = KVCacheManager(blocks, BLOCK_SIZE)
    cache = allocate_kv_cache(
        loaded.config, blocks, BLOCK_SIZE, loaded.kv_dtype, torch.device("cpu")
    )
    assert kv.allocate("s", len(tokens))
    runner = ModelRunner(loaded.model, kv, cache)
    chunk = Chunk("s", tokens, 0, logits_rows=range(len(tokens)))
    return runner.execute([chunk]).float().log_softmax(-1)


def measure(path: Path, sequences: int, length: int, decisive_gap: float) -> dict[str, Any]:
    exact = load_model(path, "float32")
    fast = load_model(path, "auto")
    generator = torch.Generator().manual_seed(0)
    vocab = exact.config.vocab_size
    length = min(length, exact.config.max_position_embeddings)  # (a file's own context)
    agree = decisive = decisive_agree = positions = 0
    kl = nll_exact = nll_fast = 0.0
    for _ in range(sequences):
        tokens = torch.randint(3, vocab, (length,), generator=generator).tolist()
        a, b = teacher_forced(exact, tokens), teacher_forced(fast, tokens)
        same = a.argmax(-1) == b.argmax(-1)
        top2 = a.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) >= decisive_gap
        agree += int(same.sum())
        decisive += int(clear.sum())
        decisive_agree += int((same & clear).sum())
        positions += length
        kl += float((a.exp() * (a - b)).sum())
        targets = torch.tensor(tokens[1:])[:, None]
        nll_exact -= float(a[:-1].gather(1, targets).sum())
        nll_fast -= float(b[:-1].gather(1, targets).sum())
    targets_total = sequences * (length - 1)
    perplexity_ratio = float(torch.tensor((nll_fast - nll_exact) / targets_total).exp())
    row = {
        "family": exact.config.architecture,
        "file": path.name,
        "fast_precision": fast.precision,
        "length": length,
        "positions": positions,
        "agreement": agree / positions,
        "decisive_positions": decisive,
        "decisive_agreement": decisive_agree / max(decisive, 1),
        "mean_kl": kl / positions,
        "perplexity_ratio": perplexity_ratio,
    }
    row["meets_contract"] = (
        fast.precision == "fast"
        and row["decisive_agreement"] >= MIN_AGREEMENT
        and row["mean_kl"] <= MAX_MEAN_KL
        and abs(perplexity_ratio - 1) <= MAX_PERPLEXITY_CHANGE
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=Path, required=True, help="convert_families.py's --out")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--decisive-gap", type=float, default=0.05)
    args = parser.parse_args()
    if not fast_mode_available():
        sys.exit("the fast mode needs the AVX512_BF16 kernels, which this CPU lacks")
    files = sorted(args.models.glob("*q4_0.gguf"))
    if not files:
        sys.exit(f"no *q4_0.gguf files in {args.models} (run convert_families.py --outtype q4_0)")
    rows = [measure(f, args.sequences, args.length, args.decisive_gap) for f in files]

    def plot(ax) -> None:
        names = [r["family"] for r in rows]
        ax.bar(
            names,
            [r["mean_kl"] for r in rows],
            color=["tab:green" if r["meets_contract"] else "tab:red" for r in rows],
        )
        ax.axhline(MAX_MEAN_KL, color="black", linestyle="--", label="contract: mean KL")
        ax.set_ylabel("mean KL(exact || fast), nats")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()

    report(
        "fast_mode_families",
        rows,
        {
            "peer": "the exact mode (float32, equal to transformers)",
            "command": "python benchmarks/fast_mode_families.py --models DIR",
            "sequences": args.sequences,
            "length": args.length,
            "decisive_gap": args.decisive_gap,
        },
        plot,
    )


if __name__ == "__main__":
    main()
