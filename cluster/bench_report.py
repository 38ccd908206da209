"""``tessera bench serve``'s report: the summary as vLLM's bench serve prints it, the
JSON result and a PNG beside it."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tessera.cluster.bench import Outcome, Request, metric_samples

logger = logging.getLogger(__name__)

WIDTH = 50
HEADERS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _line(label: str, value: Any, digits: int = 2) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = "inf" if math.isinf(value) else f"{value:.{digits}f}"
    else:
        shown = str(value)
    return f"{label:<40} {shown}"


def summary_text(
    result: dict[str, Any], metrics: Sequence[str], percentiles: Sequence[float]
) -> str:
    """The summary block; ``result`` holds ``bench.summary``'s numbers and the run's
    settings (``max_concurrency``, ``request_rate``)."""
    lines = [f"{' Serving Benchmark Result ':=^{WIDTH}}"]
    lines.append(_line("Successful requests:", result["completed"]))
    lines.append(_line("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    lines.append(_line("Request rate configured (RPS):", float(result["request_rate"])))
    lines.append(_line("Benchmark duration (s):", result["duration"]))
    lines.append(_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_line("Request throughput (req/s):", result["request_throughput"]))
    if result["request_goodput"] is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
    lines.append(_line("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(_line("Total token throughput (tok/s):", result["total_token_throughput"]))
    for metric in metrics:
        header, short = HEADERS[metric]
        lines.append(f"{' ' + header + ' ':-^{WIDTH}}")
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{metric}_ms"]))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{metric}_ms"]))
        for q in percentiles:
            lines.append(_line(f"P{q:g} {short} (ms):", result[f"p{q:g}_{metric}_ms"]))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def detailed(requests: Sequence[Request], outcomes: Sequence[Outcome]) -> dict[str, list]:
    """Per request, in the schedule's order (vLLM's --save-detailed fields)."""
    return {
        "input_lens": [
            q.known_prompt_tokens if o.prompt_tokens is None else o.prompt_tokens
            for q, o in zip(requests, outcomes, strict=True)
        ],
        "output_lens": [o.completion_tokens for o in outcomes],
        "ttfts": [o.ttft_s for o in outcomes],
        "e2els": [o.e2e_s for o in outcomes],
        "itls": [o.itls_s for o in outcomes],
        "errors": [o.error or "" for o in outcomes],
    }


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def write_png(
    path: Path, requests: Sequence[Request], outcomes: Sequence[Outcome], title: str
) -> bool:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL) and TTFT/E2EL by arrival time; False, with
    a log line saying why, when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("no PNG: matplotlib is not installed (pip install 'tessera[bench]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 20, not 2 x 10^1

    fig, (cdf, timeline) = plt.subplots(1, 2, figsize=(12, 4.5))
    for metric, values in metric_samples(outcomes).items():
        if values:
            ordered = sorted(v * 1e3 for v in values)
            share = [(i + 1) / len(ordered) for i in range(len(ordered))]
            cdf.step(ordered, share, where="post", label=HEADERS[metric][1])
    cdf.set_xscale("log")
    cdf.xaxis.set_major_formatter(plain)
    cdf.xaxis.set_minor_formatter(plain)
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("share of samples at or below")
    cdf.legend(fontsize=8)
    done = [(q.arrival_s, o) for q, o in zip(requests, outcomes, strict=True) if o.ok]
    arrivals = [a for a, _ in done]
    timeline.plot(arrivals, [o.ttft_s * 1e3 for _, o in done], "o", ms=3, label="TTFT")
    timeline.plot(arrivals, [o.e2e_s * 1e3 for _, o in done], "x", ms=3, label="E2EL")
    timeline.set_yscale("log")
    timeline.yaxis.set_major_formatter(plain)
    timeline.yaxis.set_minor_formatter(plain)
    timeline.set_xlabel("scheduled send time (s)")
    timeline.set_ylabel("ms")
    timeline.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
