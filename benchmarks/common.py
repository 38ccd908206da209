"""Shared pieces of the benchmarks: timing, workloads, the report (table + JSON + PNG)."""

from __future__ import annotations

import datetime
import json
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"

#: Open-ended chat questions (little to copy from the prompt).
CHAT_QUESTIONS = [
    "What are some good ways to stay focused while studying?",
    "Why do cats purr?",
    "Give me three ideas for a rainy weekend.",
    "How does a bicycle stay upright when it moves?",
    "What should I pack for a week-long hiking trip?",
    "Explain what a black hole is to a ten-year-old.",
    "Suggest a simple recipe for dinner tonight.",
    "What is the difference between weather and climate?",
]


#: CPU features that decide which kernels can run fast (machines differ).
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_features() -> dict[str, Any]:
    """The CPU's model name, family and model numbers (AMD's Zen 4 EPYC is family 25, Zen
    5 26), the features in ``CPU_FEATURES`` (present or not), and all flags."""
    from tessera.workers.quant.kernels import _cpu_flags

    parts = dict(p.partition("=")[::2] for p in _cpu_flags().split("|")[1:])
    flags = set(parts.get("flags", parts.get("Features", "")).split())
    return {
        "model": parts.get("model name"),
        "family": parts.get("cpu family"),
        "model_number": parts.get("model"),
        **{f: f in flags for f in CPU_FEATURES},
        "flags": " ".join(sorted(flags)),
    }


def machine() -> dict[str, Any]:
    """Where a benchmark ran; every report records it, CPU features included."""
    from tessera.workers.quant.kernels import bf16_kernel_path

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_features": cpu_features(),
        "bf16_kernels": bf16_kernel_path(),  # "amx", "avx512_bf16" or "" (none built)
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def mixed_workload(
    tokenizer,
    count: int,
    seed: int = 0,
    min_prompt: int = 32,
    max_prompt: int = 256,
    min_new: int = 32,
    max_new: int = 256,
) -> list[tuple[list[int], int]]:
    """``count`` (prompt token ids, max new tokens) pairs with lengths drawn uniformly."""
    rng = random.Random(seed)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "his",
        "her",
        "an",
        "were",
        "are",
        "which",
        "this",
        "be",
        "or",
        "has",
        "had",
        "not",
        "but",
        "what",
        "all",
        "when",
        "can",
        "there",
        "been",
        "one",
        "who",
        "so",
        "time",
        "people",
        "river",
        "mountain",
        "history",
        "science",
        "music",
        "garden",
        "letter",
    ]
    out = []
    for _ in range(count):
        target = rng.randint(min_prompt, max_prompt)
        text = " ".join(rng.choice(words) for _ in range(target * 2))
        ids = tokenizer(text).input_ids[:target]
        out.append((ids, rng.randint(min_new, max_new)))
    return out


def command_line() -> str:
    """How this benchmark was run: ``python``, the script from the repository's root, and
    its arguments (a benchmark's own ``command`` in ``meta`` wins)."""
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parents[1]
    where = script.relative_to(root) if script.is_relative_to(root) else script
    return shlex.join(["python", str(where), *sys.argv[1:]])


def report(
    name: str, rows: list[dict[str, Any]], meta: dict[str, Any], plot: Callable[[Any], None]
) -> Path:
    """Print a table, write ``results/<name>.json`` and ``results/<name>.png``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0])
    widths = [max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r[k]).ljust(w) for k, w in zip(keys, widths, strict=True)))
    path = RESULTS / f"{name}.json"
    path.write_text(
        json.dumps(
            {
                "benchmark": name,
                "date": datetime.date.today().isoformat(),
                "machine": machine(),
                "command": command_line(),
                **meta,
                "rows": rows,
            },
            indent=2,
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    plot(ax)
    ax.set_title(name.replace("_", " "))
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    plt.close(fig)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def side_panels(ax, width_ratios: list[float]) -> list:
    """Split a report's axes into side-by-side panels (the first is ``ax`` itself)."""
    fig = ax.figure
    grid = ax.get_subplotspec().subgridspec(1, len(width_ratios), width_ratios=width_ratios)
    ax.set_subplotspec(grid[0])
    return [ax] + [fig.add_subplot(grid[i]) for i in range(1, len(width_ratios))]


def paired_panel(
    ax,
    labels: list[str],
    ours: list[float],
    peer: list[float],
    names: tuple[str, str],
    ratios: list[float],
    ylabel: str,
    legend: bool = False,
) -> None:
    """One panel of ``paired_bars`` with its y label; the legend only where asked."""
    paired_bars(ax, labels, ours, peer, names, ratios)
    ax.set_ylabel(ylabel)
    if not legend:
        ax.get_legend().remove()


def paired_bars(
    ax,
    labels: list[str],
    ours: list[float],
    peer: list[float],
    names: tuple[str, str],
    ratios: list[float] | None = None,
) -> None:
    """Two bars per label (ours left, the peer right), each pair annotated with its ratio."""
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label=names[0])
    ax.bar([x + 0.2 for x in xs], peer, 0.4, label=names[1])
    for x, a, b, ratio in zip(xs, ours, peer, ratios or [None] * len(labels), strict=True):
        if ratio is not None:
            ax.annotate(f"{ratio:.2f}x", (x, max(a, b)), ha="center", va="bottom")
    ax.margins(y=0.12)
    ax.set_xticks(list(xs), labels)
    ax.legend()


def run_on_local_ray(main: Coroutine[Any, Any, Any], num_cpus: int, namespace: str) -> None:
    """Start a local Ray cluster for a benchmark, run ``main`` on it, and stop that
    cluster (only it) afterwards."""
    import asyncio

    import ray

    ray.init(
        num_cpus=num_cpus,
        namespace=namespace,
        include_dashboard=False,
        object_store_memory=150 * 2**20,
        log_to_driver=False,
    )
    try:
        asyncio.run(main)
    finally:
        ray.shutdown()


def chat_prompts(tokenizer, texts: list[str], count: int) -> list[list[int]]:
    """``count`` prompts through the chat template (cycling ``texts`` past its length)."""
    prompts = []
    for i in range(count):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": texts[i % len(texts)]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def start_decodes(engine, count: int, rng: random.Random, prompt_tokens: int = 150) -> None:
    """Add ``count`` greedy sequences (random ``prompt_tokens``-token prompts from ``rng``,
    no end) to an in-process ``Engine`` and step it until each is decoding, one row a
    step: the running batch the probes in ``benchmarks/probes`` time."""
    from tessera.workers.api import SamplingParams

    running = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    for i in range(count):
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        engine.add_request(f"d{i}", prompt, running)
    while engine.stats().running < count or engine.stats().last_num_tokens != count:
        engine.step()
