"""Schemathesis against the app's own OpenAPI schema on a real `tessera serve`.

The schema is the server's ``/openapi.json``, read with the API key, with the request
bodies its routes parse added (``benchmarks/openapi_fuzz.py`` says what it adds and
why). Each operation gets ``EXAMPLES`` cases that fit the schema (positive) and, for
the routes with a body, ``EXAMPLES`` that do not (negative), derandomized so that CI
sends the same cases every run. Every response must pass ``openapi_fuzz.problems``: no
5xx but the documented ones, a refusal within 2 s as OpenAI's error object, a clean
answer or stream, a refusal for a negative case. Afterwards the server is healthy,
answers a normal completion, and holds no KV block.
"""

from __future__ import annotations

import collections
import json
import time

import httpx
import pytest
import ray
import schemathesis

from benchmarks.openapi_fuzz import BODIES, fuzz_schema, generate, operations, problems
from tessera.workers.model.loader import load_tokenizer
from tests.cluster.serve_process import Server, serve_process

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "fuzz-key-51c9"
MODEL = "fuzz"
NAMESPACE = "fuzz-test"
#: Cases per operation and generation mode.
EXAMPLES = 25
#: Every operation the schema has; negative cases for those with a body.
OPERATIONS = [
    ("GET", "/health", "positive"),
    ("GET", "/metrics", "positive"),
    ("GET", "/v1/models", "positive"),
    ("GET", "/v1/models/{model}", "positive"),
    ("GET", "/v1/responses/{response_id}", "positive"),
    ("DELETE", "/v1/responses/{response_id}", "positive"),
    *(("POST", path, mode) for path in BODIES for mode in ("positive", "negative")),
]
#: Per operation and mode: cases sent, responses by status, failures (printed at the end).
TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory) -> Server:
    settings = (
        f"served_model_name: {MODEL}\n"
        "workers: 1\n"
        "num_kv_blocks: 64\n"
        "max_model_len: 512\n"
        "enable_lora: true\n"
        "allow_runtime_lora_updating: true\n"  # paths the fuzzer makes up: 400s
        "device: cpu\n"
        "report_interval_s: 0.1\n"
    )
    with serve_process(tmp_path_factory.mktemp("fuzz"), settings, API_KEY, NAMESPACE) as server:
        yield server


@pytest.fixture(scope="module")
def schemas(server) -> dict[str, schemathesis.BaseSchema]:
    """The server's schema with its bodies, per generation mode."""
    assert httpx.get(f"{server.url}/openapi.json", timeout=30).status_code == 401
    response = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30)
    assert response.status_code == 200
    vocab_size = len(load_tokenizer(None))
    return {
        mode: schemathesis.openapi.from_dict(
            fuzz_schema(response.json(), MODEL, vocab_size, positive=mode == "positive")
        )
        for mode in ("positive", "negative")
    }


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS)
def test_operation_answers_every_case_cleanly(server, schemas, method, path, mode):
    cases = generate(schemas[mode], method, path, mode, EXAMPLES)
    tally = TALLY[f"{method} {path} {mode}"]
    failures = []
    for case in cases:
        start = time.monotonic()
        response = case.call(base_url=server.url, headers=server.headers, timeout=60)
        seconds = time.monotonic() - start
        tally["cases"] += 1
        tally[f"HTTP {response.status_code}"] += 1
        content_type = (response.headers.get("content-type") or [""])[0]
        found = problems(
            response.status_code,
            content_type,
            response.content,
            seconds,
            mode,
            response.stream_cut_short,
        )
        tally["failures"] += len(found)
        command = case.as_curl_command(headers=server.headers)
        failures.extend(f"{problem}\n    {command}" for problem in found)
    without_parameters = method == "GET" and "{" not in path
    assert len(cases) >= (1 if without_parameters else EXAMPLES // 2), len(cases)
    assert not failures, "\n".join(failures[:20])


def test_every_operation_is_fuzzed(schemas):
    assert set(operations(schemas["positive"])) == {(m, p) for m, p, _ in OPERATIONS}


def test_healthy_after_and_nothing_held(server):
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    completion = server.client().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text and completion.usage.completion_tokens > 0
    deadline = time.monotonic() + 60
    while True:
        workers = ray.get(server.scheduler().stats.remote()).workers
        held = {
            w.worker_id: (w.ongoing, w.load.engine.total_blocks - w.load.engine.free_blocks)
            for w in workers
            if w.load is not None
        }
        if held and not any(ongoing or blocks for ongoing, blocks in held.values()):
            break
        assert time.monotonic() < deadline, f"still held after the fuzzing: {held}"
        time.sleep(0.5)
    print(json.dumps({name: dict(counts) for name, counts in sorted(TALLY.items())}, indent=1))
    print("cases sent:", sum(c["cases"] for c in TALLY.values()))
    print("failures:", sum(c["failures"] for c in TALLY.values()))
