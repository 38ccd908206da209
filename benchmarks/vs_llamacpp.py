"""Single-stream prompt eval and decode of the engine vs llama.cpp, same GGUF file, same run.

One request: the same 128-token prompt as ``vs_vllm.py`` at concurrency 1 (token ids, so
both sides see the same ones), 128 new tokens, greedy, EOS ignored (both sides generate
exactly 128), 2 threads. After a warm-up run of each contender, ``--repeats`` rounds run
each once, interleaved (llama.cpp's process stays up between its runs; the order rotates
every round), so that other work on a shared machine falls on all of them alike. The
best run is the headline (such work only ever adds time), the median is kept beside it.

* prompt eval tok/s = prompt tokens / time to the first token (prefill + first sample);
* decode tok/s = (generated tokens - 1) / time from the first token to the last.

Tessera runs in this process, ``Engine.add_request`` / ``step`` (prefix caching off, so
every run computes its whole prompt), once per mode in ``MODES``: ``exact`` (float32,
packed GGUF weights), ``dense-fp32`` (``packed_weights=False``: every weight
dequantised at load, the old path), ``fast`` (``dtype="auto"``, ``tessera serve``'s
default: float32 with bf16 inputs to the Q4 matmuls and the Q8_0 head, an fp16 KV cache)
``bfloat16`` (bf16 activations and KV as well) and, asked for with ``--modes``, ``int8``
(a K-quant file's matmuls on int8-quantised inputs, its own contract). llama.cpp runs
through llama-cpp-python in a subprocess with its own venv's python, two ways, both
timed per run:

* ``eval loop`` (the baseline the ratios use, unless ``--llama-bench`` is given):
  ``Llama.eval(prompt)``, argmax, then ``Llama.eval([token])`` per token, timed with the
  wall clock, as Tessera is;
* ``create_completion``: ``create_completion(prompt_ids, max_tokens=128, temperature=0)``
  with the end-of-generation tokens biased to -inf, timed by llama.cpp's own perf
  counters (``llama_perf_context``: decode calls only, no Python around them).

Building the peer (llama-cpp-python 0.3.36 from source, ~4-6 min on 2 cores; on a CPU
with AMX build with -DGGML_NATIVE=OFF and the AMX flags OFF, where older ggml's native
build crashed in its AMX tile set-up):

    python3 -m venv /work/peers/llama
    /work/peers/llama/bin/pip install numpy typing-extensions diskcache jinja2
    cd /tmp && CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        /work/peers/llama/bin/pip wheel --no-deps llama-cpp-python==0.3.36 -w /tmp/llamawheel
    /work/peers/llama/bin/pip install --no-deps /tmp/llamawheel/*.whl

Then:

    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp-python /work/peers/llama/bin/python

With ``--llama-bench PATH`` (llama.cpp's own ``llama-bench``, built from the same sdist's
``vendor/llama.cpp``: ``cmake --build build --target llama-bench``) it joins the rounds as
``llama-bench`` (``-p``/``-n`` as above, one repetition a round, its own timing) and becomes
the baseline the ratios divide by. ``--memory`` loads each mode again in a fresh process
and reports its peak resident memory against the file plus the KV pool (the target:
``RSS_TARGET`` times, over what ``import torch`` and Tessera's modules hold before any
load). A ``--model`` other than the built-in one writes ``results/vs_llamacpp_<stem>``:

    .venv/bin/python benchmarks/vs_llamacpp.py --model llama1b-Q4_K_M.gguf \\
        --llama-bench llama.cpp/build/bin/llama-bench --memory --modes exact int8

Files of real shapes, with random weights: a transformers model of the shape (say
``LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
num_attention_heads=32, num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=True)``
for Llama-3.2-1B, or a ``Qwen3MoeConfig`` with 16 experts, top 2, expert width 1024), its
matrices drawn from N(0, 0.02), saved in bf16 with SmolLM2's tokenizer; then the sdist's
``vendor/llama.cpp/convert_hf_to_gguf.py --outtype f16`` and ``llama-quantize ... Q4_K_M``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAME = "vs_llamacpp"
LLAMACPP_PYTHON = "/work/peers/llama/bin/python"
PEER = "llama.cpp"
BASELINE = "eval loop"  # the llama.cpp measurement the ratios divide by
PEER_METHODS = (BASELINE, "create_completion")
KV_BLOCKS = 64  # 1024 tokens: one request of prompt + new tokens fits with room to spare


@dataclass(frozen=True, slots=True)
class Mode:
    """One Tessera configuration: ``EngineConfig`` fields, and which target it is held to."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    target: str | None = None  # "exact" or "fast": the decode target it is held to


#: Tessera's configurations, one line each; ``--modes`` picks (default: all).
MODES = (
    Mode("exact", {"dtype": "float32"}, target="exact"),  # packed GGUF weights
    Mode("dense-fp32", {"dtype": "float32", "packed_weights": False}),
    # the fast mode: float32, bf16 inputs to the GGUF matmuls (tessera serve's default)
    Mode("fast", {"dtype": "auto"}, target="fast"),
    Mode("bfloat16", {"dtype": "bfloat16"}),  # bf16 activations and KV too
    # K-quant matmuls on int8-quantised inputs (a K-quant file's fast path, its own contract)
    Mode("int8", {"dtype": "int8"}, target="int8"),
)
MODES_BY_NAME = {m.name: m for m in MODES}
DEFAULT_MODES = ("exact", "dense-fp32", "fast", "bfloat16")  # int8: for K-quant files

#: Tessera's targets: Tessera / llama.cpp (the baseline), best runs.
DECODE_TARGETS = {"fast": 1.0, "exact": 0.7, "int8": 1.0}
PROMPT_EVAL_TARGET = 1.5
#: Peak resident memory at most this many times the file plus the KV pool (``--memory``).
RSS_TARGET = 1.25
LLAMA_BENCH = "llama-bench"

# Loads one mode in a fresh process, runs one request, and prints its peak resident
# memory (the kernel's VmHWM of this process image: ru_maxrss keeps the parent's across
# fork and exec), the same before the load, and the KV pool's bytes, as JSON.
MEMORY_CHILD = r"""
import json, sys
import torch
from tessera.workers.api import SamplingParams
from tessera.workers.config import EngineConfig
from tessera.workers.engine.engine import Engine


def peak_bytes():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


job = json.loads(sys.argv[1])
torch.set_num_threads(job["threads"])
before = peak_bytes()
engine = Engine(EngineConfig(model=job["model"], num_kv_blocks=job["kv_blocks"], **job["settings"]))
engine.add_request("m", job["prompt"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
while engine.has_work():
    engine.step()
kv = engine.runner.kv_cache
print(json.dumps({
    "peak_rss_bytes": peak_bytes(),
    "before_load_bytes": before,
    "kv_pool_bytes": kv.numel() * kv.element_size(),
}))
"""


# Runs under llama-cpp-python's python, one JSON object per line both ways. Reads the job
# ({"model", "prompt", "new_tokens", "threads", "n_ctx"}), loads the model and answers
# {"version", "system_info", "load_s", "eog_tokens"}; then each line naming a method
# ("eval loop" or "create_completion") runs it once and answers its sample; end of input
# ends it. fd 1 points at stderr while llama.cpp runs (it may print); answers go to the
# saved original.
CHILD = r"""
import json
import os
import sys
import time

answers = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
job = json.loads(sys.stdin.readline())
import numpy as np
import llama_cpp
from llama_cpp import Llama

start = time.perf_counter()
llm = Llama(
    model_path=job["model"],
    n_threads=job["threads"],
    n_threads_batch=job["threads"],
    n_ctx=job["n_ctx"],
    n_batch=job["n_ctx"],
    seed=0,
    verbose=False,
    no_perf=False,
)
load_s = time.perf_counter() - start
prompt, new = job["prompt"], job["new_tokens"]
ctx = llm._ctx.ctx
n_vocab = llm.n_vocab()


def is_eog(token):
    vocab = getattr(llm._model, "vocab", None)
    if vocab is not None and hasattr(llama_cpp, "llama_vocab_is_eog"):
        return llama_cpp.llama_vocab_is_eog(vocab, token)
    return llama_cpp.llama_token_is_eog(llm._model.model, token)


eog = [t for t in range(n_vocab) if is_eog(t)]


def argmax_last():
    # Llama.eval keeps no logits unless logits_all: read the last output's from the context
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    return int(np.argmax(logits))


def eval_loop():
    llm.reset()  # no prefix reuse: the whole prompt is evaluated
    t0 = time.perf_counter()
    llm.eval(prompt)
    tokens = [argmax_last()]
    t1 = time.perf_counter()
    while len(tokens) < new:
        llm.eval(tokens[-1:])
        tokens.append(argmax_last())
    t2 = time.perf_counter()
    return {
        "prompt_eval_tok_s": len(prompt) / (t1 - t0),
        "decode_tok_s": (new - 1) / (t2 - t1),
        "tokens": tokens,
    }


def completion():
    llm.reset()
    llama_cpp.llama_perf_context_reset(ctx)
    start = time.perf_counter()
    out = llm.create_completion(
        prompt, max_tokens=new, temperature=0.0, logit_bias={t: float("-inf") for t in eog}
    )
    wall = time.perf_counter() - start
    perf = llama_cpp.llama_perf_context(ctx)
    generated = out["usage"]["completion_tokens"]
    if generated != new:
        raise RuntimeError(f"create_completion generated {generated} tokens, expected {new}")
    if perf.n_p_eval != len(prompt) or perf.t_eval_ms <= 0:
        raise RuntimeError(f"perf counters: n_p_eval {perf.n_p_eval}, n_eval {perf.n_eval}")
    return {
        "prompt_eval_tok_s": perf.n_p_eval / perf.t_p_eval_ms * 1e3,
        "decode_tok_s": perf.n_eval / perf.t_eval_ms * 1e3,
        "n_p_eval": perf.n_p_eval,
        "n_eval": perf.n_eval,
        "wall_s": wall,
    }


info = {
    "version": llama_cpp.__version__,
    "system_info": llama_cpp.llama_print_system_info().decode(),
    "load_s": load_s,
    "eog_tokens": eog,
}
print(json.dumps(info), file=answers)
methods = {"eval loop": eval_loop, "create_completion": completion}
for line in sys.stdin:
    print(json.dumps(methods[json.loads(line)]()), file=answers)
"""


class LlamaCpp:
    """The ``CHILD`` process under llama-cpp-python's python: one run per ``run`` call, so
    that its runs interleave with Tessera's. Its log passes through to our stderr."""

    def __init__(self, python: str, job: dict[str, Any]) -> None:
        if not Path(python).exists():
            raise SystemExit(f"{python} not found: build llama-cpp-python first (see --help)")
        self.proc = subprocess.Popen(
            [python, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=tempfile.gettempdir(),  # not the repository root: keep it off sys.path
            env={**os.environ, "OMP_NUM_THREADS": str(job["threads"])},
        )
        self.info = self._ask(job)

    def run(self, method: str) -> dict[str, Any]:
        return self._ask(method)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()

    def _ask(self, message: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise SystemExit(f"llama.cpp subprocess failed (exit {code}); see its log above")
        return json.loads(line)


def llama_bench_once(
    binary: str, model: Path, threads: int, prompt_tokens: int, new_tokens: int
) -> dict[str, Any]:
    """One ``llama-bench`` repetition of prompt eval (``-p``) and decode (``-n``), as
    llama.cpp times them (its own prompt of that length; EOS plays no part)."""
    command = [binary, "-m", str(model), "-t", str(threads), "-p", str(prompt_tokens)]
    command += ["-n", str(new_tokens), "-r", "1", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-bench failed (exit {done.returncode}): {done.stderr[-2000:]}")
    entries = json.loads(done.stdout)
    prompt = next(e for e in entries if e["n_prompt"] and not e["n_gen"])
    decode = next(e for e in entries if e["n_gen"] and not e["n_prompt"])
    return {
        "prompt_eval_tok_s": prompt["avg_ts"],
        "decode_tok_s": decode["avg_ts"],
        "build": f"{decode.get('build_commit', '')} ({decode.get('build_number', '')})",
    }


def peak_memory(mode: Mode, model: Path, prompt: list[int], threads: int) -> dict[str, Any]:
    """``MEMORY_CHILD`` for ``mode``: its peak RSS against the file plus the KV pool."""
    job = {
        "model": str(model),
        "settings": mode.settings,
        "prompt": prompt,
        "threads": threads,
        "kv_blocks": KV_BLOCKS,
    }
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, json.dumps(job)],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    if done.returncode:
        raise SystemExit(f"the memory run of {mode.name} failed: {done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    file_bytes = model.stat().st_size
    loaded = got["peak_rss_bytes"] - got["before_load_bytes"]
    budget = file_bytes + got["kv_pool_bytes"]
    return {
        "mode": mode.name,
        "file_bytes": file_bytes,
        **got,
        "rss_over_file_and_kv": loaded / budget,
        "peak_rss_over_file_and_kv": got["peak_rss_bytes"] / budget,
        "target": RSS_TARGET,
        "status": "met" if loaded / budget <= RSS_TARGET else "missed",
    }


def run_tessera_once(engine, request_id: str, prompt: list[int], new: int) -> dict[str, Any]:
    """One greedy request through ``add_request`` / ``step``, timed like the peer."""
    from tessera.workers.api import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    tokens: list[int] = []
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first = None
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            if first is None and tokens:
                first = time.perf_counter()
    end = time.perf_counter()
    if len(tokens) != new or first is None:
        raise RuntimeError(f"{request_id}: generated {len(tokens)} tokens, expected {new}")
    return {
        "prompt_eval_tok_s": len(prompt) / (first - start),
        "decode_tok_s": (new - 1) / (end - first),
        "tokens": tokens,
    }


def tessera_engine(mode: Mode, model: Path) -> tuple[Any, float]:
    """The mode's engine (prefix caching off: every run computes its whole prompt) and
    its load time in seconds."""
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    start = time.perf_counter()
    config = EngineConfig(
        model=str(model), enable_prefix_caching=False, num_kv_blocks=KV_BLOCKS, **mode.settings
    )
    engine = Engine(config)
    return engine, time.perf_counter() - start


def interleaved(
    contenders: dict[tuple[str, str], Callable[[], dict[str, Any]]], repeats: int
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """A warm-up run of each, then ``repeats`` rounds of one run each, the order rotated
    every round: load from other work on the machine falls on all of them alike."""
    names = list(contenders)
    for name in names:
        contenders[name]()
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            samples[name].append(contenders[name]())
        rates = ", ".join(f"{' '.join(n)} {samples[n][-1]['decode_tok_s']:.1f}" for n in names)
        print(f"round {i + 1}/{repeats}: decode tok/s {rates}", file=sys.stderr, flush=True)
    return samples


def summary(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Best and median of each rate over the runs."""
    out = {}
    for key in ("prompt_eval_tok_s", "decode_tok_s"):
        values = [s[key] for s in samples]
        out[key] = max(values)
        out[key.replace("_tok_s", "_median")] = statistics.median(values)
    return out


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy outputs share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def targets(rows: list[dict[str, Any]], modes: list[Mode]) -> list[dict[str, Any]]:
    """The targets, each met, missed or not measured (no such mode was run)."""
    by_target = {m.target: m.name for m in modes if m.target}
    ratio = {r["mode"]: r for r in rows if r["peer"] == "tessera"}
    out = []
    checks = [(t, "decode_ratio", goal) for t, goal in DECODE_TARGETS.items()]
    checks += [(t, "prompt_eval_ratio", PROMPT_EVAL_TARGET) for t in DECODE_TARGETS]
    for target, key, goal in checks:
        mode = by_target.get(target)
        what = "decode" if key == "decode_ratio" else "prompt eval"
        entry = {"target": f"{target} mode {what} >= {goal:.1f}x llama.cpp", "goal": goal}
        if mode is None:
            entry.update(mode=None, ratio=None, status="not measured (no such mode run)")
        else:
            got = ratio[mode][key]
            entry.update(mode=mode, ratio=got, status="met" if got >= goal else "missed")
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--llamacpp-python",
        default=LLAMACPP_PYTHON,
        help="python of the venv with llama-cpp-python (default: %(default)s)",
    )
    parser.add_argument("--model", help="GGUF file (default: the built-in SmolLM2 Q4_1)")
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES_BY_NAME)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after a warm-up")
    parser.add_argument(
        "--llama-bench", metavar="PATH", help="llama.cpp's llama-bench: run it, the baseline"
    )
    parser.add_argument(
        "--memory", action="store_true", help="each mode's peak RSS in a fresh process"
    )
    args = parser.parse_args()

    import torch

    from benchmarks.common import mixed_workload, paired_panel, report, side_panels
    from tessera.workers.config import EngineConfig
    from tessera.workers.model.loader import builtin_model_path, load_tokenizer
    from tessera.workers.quant.kernels import native_kernels

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else builtin_model_path()
    modes = [MODES_BY_NAME[name] for name in args.modes]
    [(prompt, new)] = mixed_workload(
        load_tokenizer(model),
        1,
        min_prompt=args.prompt_tokens,
        max_prompt=args.prompt_tokens,
        min_new=args.new_tokens,
        max_new=args.new_tokens,
    )

    load_at_start = os.getloadavg()
    peer = LlamaCpp(
        args.llamacpp_python,
        {
            "model": str(model),
            "prompt": prompt,
            "new_tokens": new,
            "threads": args.threads,
            "n_ctx": 2 ** (len(prompt) + new).bit_length(),
        },
    )
    engines = {m.name: tessera_engine(m, model) for m in modes}
    request_ids = itertools.count()
    contenders = {(PEER, method): functools.partial(peer.run, method) for method in PEER_METHODS}
    baseline = (PEER, BASELINE)
    if args.llama_bench:
        baseline = (PEER, LLAMA_BENCH)
        contenders[baseline] = functools.partial(
            llama_bench_once, args.llama_bench, model, args.threads, len(prompt), new
        )
    for mode in modes:
        contenders["tessera", mode.name] = lambda engine=engines[mode.name][0]: run_tessera_once(
            engine, f"r{next(request_ids)}", prompt, new
        )
    try:
        samples = interleaved(contenders, args.repeats)
    finally:
        peer.close()
    load_at_end = os.getloadavg()

    memory = [peak_memory(m, model, prompt, args.threads) for m in modes] if args.memory else []
    base = summary(samples[baseline])
    peer_tokens = samples[PEER, BASELINE][0]["tokens"]
    rows = []
    for (who, mode), runs in samples.items():
        row = {"peer": who, "mode": mode, **summary(runs)}
        row["prompt_eval_ratio"] = row["prompt_eval_tok_s"] / base["prompt_eval_tok_s"]
        row["decode_ratio"] = row["decode_tok_s"] / base["decode_tok_s"]
        tokens = runs[0].get("tokens")  # create_completion's are not kept
        row["tokens_as_peer"] = None if tokens is None else leading_agreement(tokens, peer_tokens)
        rows.append(row)

    goals = targets(rows, modes)
    for m in memory:
        goals.append(
            {
                "target": f"{m['mode']} peak RSS <= {RSS_TARGET}x the file plus the KV pool",
                "goal": RSS_TARGET,
                "mode": m["mode"],
                "ratio": m["rss_over_file_and_kv"],
                "status": m["status"],
            }
        )

    def plot(ax) -> None:
        left, right = side_panels(ax, [1, 1])
        tessera = [r for r in rows if r["peer"] == "tessera"]
        labels = [r["mode"] for r in tessera]
        for panel, key, ylabel in (
            (left, "prompt_eval", "prompt eval tok/s"),
            (right, "decode", "decode tok/s"),
        ):
            paired_panel(
                panel,
                labels,
                [r[f"{key}_tok_s"] for r in tessera],
                [base[f"{key}_tok_s"]] * len(tessera),
                ("tessera", f"llama.cpp ({baseline[1]})"),
                [r[f"{key}_ratio"] for r in tessera],
                ylabel,
                legend=panel is left,
            )
        left.legend(loc="lower center", fontsize="small")
        for goal in sorted(set(DECODE_TARGETS.values())):
            level = goal * base["decode_tok_s"]
            right.axhline(level, ls=":", c="grey", lw=1)
            right.annotate(
                f"{goal:g}x",
                (right.get_xlim()[0], level),
                ha="left",
                va="bottom",
                fontsize="small",
                color="grey",
            )

    builtin = args.model is None or model == builtin_model_path()
    report(
        NAME if builtin else f"{NAME}_{model.stem}",
        rows,
        {
            "peer": (
                f"llama.cpp's llama-bench (build {samples[baseline][0]['build']}) and "
                if args.llama_bench
                else "llama.cpp "
            )
            + f"via llama-cpp-python {peer.info['version']}, same GGUF, {args.threads} threads",
            "model": str(model),
            "prompt_tokens": len(prompt),
            "new_tokens": new,
            "threads": args.threads,
            "repeats": args.repeats,
            "headline": "best run; *_median: the median run (runs interleaved, see samples)",
            "baseline": f"{' '.join(baseline)} (ratios divide by its best run)",
            "memory": memory,
            "targets": goals,
            "tessera_modes": {
                m.name: {
                    **m.settings,
                    "precision": engines[m.name][0].loaded.precision,
                    "target": m.target,
                    "load_s": engines[m.name][1],
                }
                for m in modes
            },
            "engine_config_fields": sorted(EngineConfig.__dataclass_fields__),
            "native_kernel": native_kernels() is not None,
            "llamacpp_system_info": peer.info["system_info"],
            "llamacpp_load_s": peer.info["load_s"],
            "llamacpp_eog_tokens": peer.info["eog_tokens"],
            "load_average": {"start": load_at_start, "end": load_at_end},
            "samples": {f"{who} {mode}": _rates(runs) for (who, mode), runs in samples.items()},
        },
        plot,
    )
    for t in goals:
        ratio = "" if t["ratio"] is None else f" ({t['ratio']:.2f}x)"
        print(f"target {t['target']}: {t['status']}{ratio}")


def _rates(samples: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The per-run rates, without the token ids."""
    return [{k: v for k, v in s.items() if k != "tokens"} for s in samples]


if __name__ == "__main__":
    main()
