"""`tessera serve` as users meet it: a real server process on 127.0.0.1 (joining the
session's Ray), called with the official `openai` client and with httpx.

Outputs are compared with the in-process engine on the same weights; errors are
checked for their status, OpenAI's error object and the field they name, and the
server must answer a valid request right after each.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from tessera.cluster.cli import main as cli_main
from tessera.workers.api import ParallelTokensParams, SamplingParams
from tests.cluster.serve_process import Server, serve_process
from tests.helpers import run_engine, text_of, tokens_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "test-key-7f3a"
MODEL = "smol-test"
NAMESPACE = "serve-test"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory) -> Server:
    """`tessera serve` with settings from a YAML file and flags, joined to the session's
    Ray; stopped with SIGINT (Ctrl-C) at the end, which must exit cleanly."""
    settings = (
        f"served_model_name: {MODEL}\n"
        "num_kv_blocks: 256\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
        "max_ongoing_requests: 16\n"
        "max_queued_requests: 64\n"
        "draft_model: target:8\n"  # the first 8 layers draft for speculative method draft
        "body_timeout_s: 3\n"
        "port: 1\n"  # overridden by --port: flags win over the file
    )
    with serve_process(tmp_path_factory.mktemp("serve"), settings, API_KEY, NAMESPACE) as server:
        yield server


def engine_text(make_engine, prompt, **sampling) -> tuple[str, list[int]]:
    engine = make_engine()
    engine.add_request("ref", prompt, SamplingParams(**sampling))
    deltas = run_engine(engine)["ref"]
    return text_of(deltas), tokens_of(deltas)


def chat_prompt(make_engine, messages) -> str:
    return make_engine().tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


# ------------------------------------------------------------------ outputs
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = server.client().models.retrieve(MODEL)
    assert (card.id, card.owned_by) == (MODEL, "tessera")
    with pytest.raises(openai.NotFoundError, match="model: 'gpt-4' is not served here"):
        server.client().models.retrieve("gpt-4")
    health = httpx.get(f"{server.url}/health")  # no API key needed
    assert health.status_code == 200 and health.json()["healthy_workers"] == 1


def test_completion_greedy_equals_the_engine(server, make_engine):
    expected, expected_ids = engine_text(make_engine, PROMPT, max_tokens=12, temperature=0)
    client = server.client()
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.created > 0 and done.model == MODEL
    prompt_ids = make_engine().tokenizer(PROMPT).input_ids
    assert done.usage.prompt_tokens == len(prompt_ids)
    assert done.usage.completion_tokens == len(expected_ids) == 12
    assert done.usage.total_tokens == len(prompt_ids) + 12

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"

    by_ids = client.completions.create(prompt=prompt_ids, max_tokens=12, temperature=0, model=MODEL)
    assert by_ids.choices[0].text == expected


def test_speculative_decoding_over_http_equals_the_engine(server, make_engine):
    expected, _ = engine_text(make_engine, PROMPT, max_tokens=16, temperature=0)
    client = server.client()
    before = _samples(server)
    proposed = 0
    for spec in ({"method": "ngram", "num_tokens": 3}, {"method": "draft", "num_tokens": 3}):
        done = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"speculative": spec},
        )
        assert done.choices[0].text == expected, spec
        stats = done.choices[0].model_extra["speculative"]
        assert stats["steps"] > 0 and stats["proposed"] >= stats["accepted"] >= 0
        assert stats["tokens"] == stats["accepted"] + stats["steps"]
        proposed += stats["proposed"]
    assert proposed > 0
    key = ("tessera_worker_spec_proposed_tokens_total", (("worker", "mixed-0"),))
    deadline = time.monotonic() + 10  # the worker's counters arrive with its next report
    while _samples(server).get(key, 0) - before.get(key, 0) < proposed:
        assert time.monotonic() < deadline, "the worker's speculative counters did not move"
        time.sleep(0.2)


def test_parallel_tokens_over_http_carry_their_sets(server, make_engine):
    parallel = {"threshold": 0.05, "max_width": 3, "mode": "visible"}
    engine = make_engine()
    engine.add_request(
        "ref",
        PROMPT,
        SamplingParams(
            max_tokens=12, temperature=0, parallel_tokens=ParallelTokensParams(**parallel)
        ),
    )
    deltas = run_engine(engine)["ref"]
    expected_sets = [s for d in deltas for s in d.parallel_sets]
    client = server.client()
    done = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"parallel_tokens": parallel},
    )
    assert done.choices[0].text == text_of(deltas)
    sets = done.choices[0].model_extra["parallel_tokens"]
    assert [s["token_ids"] for s in sets] == [list(s.token_ids) for s in expected_sets]
    assert [s["position"] for s in sets] == [s.position for s in expected_sets]
    assert all(set(s) == {"position", "token_ids", "tokens", "probs"} for s in sets)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"parallel_tokens": parallel},
        )
    )
    streamed = [
        s for c in chunks if c.choices for s in c.choices[0].model_extra.get("parallel_tokens", [])
    ]
    assert sum(len(s["token_ids"]) for s in streamed) == chunks[-1].usage.completion_tokens > 0


def test_completion_batch_of_prompts_and_echo(server, make_engine):
    prompts = [PROMPT, "def fibonacci(n):"]
    done = server.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, echo=True
    )
    assert [c.index for c in done.choices] == [0, 1]
    for choice, prompt in zip(done.choices, prompts, strict=True):
        expected, _ = engine_text(make_engine, prompt, max_tokens=6, temperature=0)
        assert choice.text == prompt + expected
    tokenizer = make_engine().tokenizer
    assert done.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in prompts)
    assert done.usage.completion_tokens == 12


def test_chat_greedy_equals_the_engine(server, make_engine):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    expected, ids = engine_text(
        make_engine, chat_prompt(make_engine, messages), max_tokens=16, temperature=0
    )
    client = server.client()
    done = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected
    assert done.usage.completion_tokens == len(ids)
    assert done.choices[0].finish_reason == ("length" if len(ids) == 16 else "stop")

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage asked


def test_n3_with_a_seed_gives_three_reproducible_samples(server, make_engine):
    client = server.client()

    def sample():
        done = client.completions.create(
            model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=7, max_tokens=10
        )
        return [c.text for c in sorted(done.choices, key=lambda c: c.index)]

    first = sample()
    assert len(set(first)) == 3
    assert sample() == first
    for i, text in enumerate(first):  # child i samples as a lone request with seed + i
        expected, _ = engine_text(
            make_engine, "Once upon a time", max_tokens=10, temperature=1.0, seed=7 + i
        )
        assert text == expected


def test_stop_and_max_tokens_set_the_finish_reason(server, make_engine):
    full, _ = engine_text(make_engine, PROMPT, max_tokens=12, temperature=0)
    stop = full.strip().split()[1]  # a word in the middle of the greedy completion
    client = server.client()
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].text == full[: full.index(stop)]
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_logprobs_are_consistent_with_the_tokens(server):
    client = server.client()
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert "".join(logprobs.tokens) == done.choices[0].text
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy takes the best
        assert len(top) == 3
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:
        assert [t.token for t in entry.top_logprobs][0] == entry.token  # greedy: the best
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())


def _wait_until(server, condition, timeout_s: float = 30) -> None:
    """Poll the scheduler's stats until ``condition(stats)`` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition(stats := ray.get(server.scheduler().stats.remote())):
        assert time.monotonic() < deadline, f"still not there after {timeout_s} s: {stats}"
        time.sleep(0.1)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("port: 70000\n", "error: port: Input should be less than or equal to 65535"),
        ("colour: blue\n", "error: colour: not a setting"),
        ("- 1\n", "must hold a mapping of settings, got list"),
        ("workers: [\n", "is not valid YAML"),
        ("min_replicas: 3\n", "error: min_replicas: 3 is above max_replicas (1)"),
        ("kv_cache_memory: lots\n", "error: kv_cache_memory: must be a size such as 512MiB"),
    ],
)
def test_bad_settings_fail_at_start_naming_the_field(tmp_path, capsys, setup, message):
    config = tmp_path / "bad.yaml"
    config.write_text(setup)
    assert cli_main(["serve", "--config", str(config)]) == 2
    assert message in capsys.readouterr().err


def test_a_port_in_use_fails_at_start(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert cli_main(["serve", "--port", str(port)]) == 2
    assert f"error: port: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


ERRORS = [
    # (path, body, status, param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object, got list"),
    ("/v1/completions", b"[" * 100_000, 400, None, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus", "Unrecognized"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt", "must be a string"),
    ("/v1/completions", {"prompt": [10**8]}, 400, "prompt", "out of the vocabulary"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "between 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "[1, 64]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 9000}, 400, "max_tokens", "8192"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 20}, 400, "stop", "at most 16"),
    ("/v1/completions", {"prompt": "x", "logprobs": 30}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias", "vocab"),
    (
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"5": 200}},
        400,
        "logit_bias",
        "[-100, 100]",
    ),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "2**63"),
    ("/v1/completions", {"prompt": "x", "stream_options": {}}, 400, "stream_options", "stream"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "not served"),
    ("/v1/completions", {"prompt": "Hi \ud800 there"}, 400, "prompt", "lone surrogate (U+D800)"),
    ("/v1/completions", {"prompt": "x", "beam_width": 0}, 400, "beam_width", "[1, 64], got 0"),
    ("/v1/completions", {"prompt": "x", "length_penalty": math.nan}, 400, "length_penalty", "NaN"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids", "vocab"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
        400,
        "messages.0.content.0.text",
        "lone surrogate (U+DC00) at character 1",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        ">= 1, got 0",
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages", "required"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages.0.role",
        "'user'",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8200},
        400,
        "max_completion_tokens",
        "context length of 8192",
    ),
    # bounded before any work (hostile input)
    ("/v1/completions", {"prompt": "x", "priority": 10**30}, 400, "priority", "[-1000, 1000]"),
    ("/v1/completions", {"prompt": "x", "cache_salt": "s" * 1025}, 400, "cache_salt", "1024"),
    ("/v1/completions", {"prompt": "x", "stop": ["a" * 1025]}, 400, "stop", "at most 1024"),
    ("/v1/completions", {"prompt": list(range(8193))}, 400, "prompt", "context of 8192"),
    ("/detokenize", {"tokens": [1] * 8193}, 400, "tokens", "8193 token ids"),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": "a" * (128 * 2**10 + 1)}},
        400,
        "structured_outputs.regex",
        "over the limit of 131072 bytes (max_grammar_bytes)",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"description": "d" * 2**17}},
                }
            ],
        },
        400,
        "tools.0.function.parameters",
        "(max_grammar_bytes)",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), ERRORS)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(
    server, path, body, status, param, words
):
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_tokenize_and_detokenize_as_vllm_shapes_them(server, make_engine):
    tokenizer = make_engine().tokenizer
    text = "The lighthouse keeper climbed the stairs."
    done = server.post("/tokenize", {"prompt": text, "return_token_strs": True})
    assert done.status_code == 200, done.text
    ids = tokenizer(text).input_ids
    assert done.json() == {
        "count": len(ids),
        "max_model_len": 8192,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    messages = [{"role": "user", "content": "Hi there"}]
    chat = server.post("/tokenize", {"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert chat["token_strs"] is None
    back = server.post("/detokenize", {"tokens": ids})
    assert back.json() == {"prompt": tokenizer.decode(ids)}
    bad = server.post("/detokenize", {"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = server.post("/tokenize", {"prompt": "x", "model": "gpt-9"})
    assert unknown.status_code == 404
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401


def test_logit_bias_forces_a_token(server):
    done = server.post(
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "logit_bias": {"1234": 100}},
    ).json()
    token = server.post("/detokenize", {"tokens": [1234]}).json()["prompt"]
    assert done["choices"][0]["text"] == token * 3


def test_extension_fields_appear_only_when_asked(server):
    plain = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert set(plain.json()["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    chat = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    assert set(chat.json()["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}


SCHEMAS = [  # of increasing difficulty; closed objects and bounded strings
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}},
        "required": ["colour"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["x"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}$"},
            "population": {"type": "integer", "minimum": 1, "maximum": 10000000},
            "kind": {"enum": ["town", "city"]},
        },
        "required": ["city", "population", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "maxLength": 8}]
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "age": {"type": "integer"},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["owner"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["points"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
            "value": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5}]},
            "kind": {"enum": ["a", "b", "c"]},
            "nested": {
                "type": "object",
                "properties": {
                    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
                },
                "required": ["flags"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "value", "kind", "nested"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_five_seeded_samples_of_each_json_schema_validate(server, schema):
    """n = 5 seeded samples at temperature 1 (forks, each with its own matcher)."""
    import jsonschema

    done = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=160,
        temperature=1.0,
        seed=7,
        n=5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    assert len(done.choices) == 5
    for choice in done.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_the_sdks_parse_and_tessera_structured_outputs(server):
    from pydantic import BaseModel

    class Lighthouse(BaseModel):
        name: str
        height_m: int

    client = server.client()
    parsed = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a lighthouse."}],
        response_format=Lighthouse,
        max_tokens=80,
        temperature=0,
    )
    assert isinstance(parsed.choices[0].message.parsed, Lighthouse)
    choice = client.completions.create(
        model=MODEL,
        prompt="The best colour is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert choice.choices[0].text in ("red", "green", "blue")
    bad = server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}},
        },
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "response_format.json_schema"
    for body, param in (
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
    ):
        bad = server.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body}
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == param, bad.text


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


def test_required_and_named_tool_calls_validate_and_stream_in_pieces(server):
    import jsonschema

    client = server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    done = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    parameters = WEATHER_TOOL["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or ():
            entry = calls.setdefault(piece.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = piece.id or entry["id"]
            entry["name"] += (piece.function.name or "") if piece.function else ""
            entry["arguments"] += (piece.function.arguments or "") if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[calls[0]["name"]]
    jsonschema.validate(
        json.loads(calls[0]["arguments"]), tool["function"]["parameters"] or {"type": "object"}
    )


def test_a_conversation_with_tool_results_renders_and_bad_tool_choices_are_named(server):
    client = server.client()
    done = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=8,
        temperature=0,
    )
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for body, param in (
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice.function.name",
        ),
    ):
        bad = server.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body}
        )
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == param


def test_legacy_functions_answer_as_the_same_tools_request_does(server):
    """``functions`` / ``function_call`` (deprecated) decode as ``tools`` /
    ``tool_choice`` do, and answer OpenAI's legacy shape: ``message.function_call`` and
    finish reason ``function_call``, whole and streamed; a legacy conversation renders."""
    client = server.client()
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
           "max_tokens": 80, "temperature": 0}  # fmt: skip
    tools = client.chat.completions.create(
        **ask, tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = tools.choices[0].message.tool_calls
    functions = [WEATHER_TOOL["function"], TIME_TOOL["function"]]
    legacy = client.chat.completions.create(
        **ask, functions=functions, function_call={"name": "get_weather"}
    )
    (choice,) = legacy.choices
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None and choice.message.content is None
    assert choice.message.function_call.model_dump() == call.function.model_dump()
    assert legacy.usage == tools.usage
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(
        **ask, functions=functions, function_call={"name": "get_weather"}, stream=True
    ):
        delta = chunk.choices[0].delta
        assert delta.tool_calls is None
        if delta.function_call is not None:
            name += delta.function_call.name or ""
            arguments += delta.function_call.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, arguments, finish) == ("get_weather", call.function.arguments, "function_call")
    conversation = [
        *ask["messages"],
        {"role": "assistant", "content": None, "function_call": call.function.model_dump()},
        {"role": "function", "name": "get_weather", "content": '{"temp": 21}'},
    ]
    answered = client.chat.completions.create(
        **{**ask, "messages": conversation, "max_tokens": 4}, functions=functions
    )
    assert answered.usage.prompt_tokens > legacy.usage.prompt_tokens


def test_documented_fields_that_change_no_token_are_taken(server):
    """OpenAI's fields with no effect on this server's tokens are taken through the
    openai client, and the answer is the plain request's."""
    client = server.client()
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
           "max_tokens": 6, "temperature": 0}  # fmt: skip
    plain = client.chat.completions.create(**ask)
    taken = client.chat.completions.create(
        **ask,
        reasoning_effort="low",  # SmolLM2's template has no thinking switch
        verbosity="low",
        prediction={"type": "content", "content": "Blue."},
        modalities=["text"],
        service_tier="fast",
        prompt_cache_retention="24h",
        prompt_cache_key="colours",
        audio=None,
        web_search_options=None,
    )
    assert taken.choices[0].message == plain.choices[0].message
    assert taken.usage == plain.usage


def test_documented_fields_this_server_cannot_serve_and_unknown_ones_are_refused(server):
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for given, param, message in (
        (
            {"modalities": ["audio"]},
            "modalities",
            "modalities: must be [\"text\"]: this server writes text only, got ['audio']",
        ),
        (
            {"reasoning_effort": "maximal"},
            "reasoning_effort",
            "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium', 'high', "
            "'xhigh' or 'max', got 'maximal'",
        ),
        (
            {"functions": [TIME_TOOL["function"]], "tools": [TIME_TOOL]},
            "functions",
            "functions: is not allowed together with tools: give tools and tool_choice, or the "
            "deprecated functions and function_call",
        ),
        (  # ignore_unknown_fields is off: OpenAI's answer
            {"reasoning": {"effort": "low"}},
            "reasoning",
            "reasoning: Unrecognized request argument supplied: reasoning",
        ),
    ):
        refused = server.post("/v1/chat/completions", {**ask, **given})
        assert refused.status_code == 400, refused.text
        assert refused.json() == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_value",
            }
        }
    assert server.post("/v1/chat/completions", ask).status_code == 200


def test_echo_with_logprobs_and_prompt_logprobs_match_transformers(server, hf_reference):
    import torch

    prompt = "The capital of France is Paris, and the capital of Italy is"
    done = server.post(
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2},
    ).json()
    choice = done["choices"][0]
    logprobs = choice["logprobs"]
    prompt_tokens = done["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == prompt_tokens + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert choice["text"].startswith(prompt)
    chat = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    listed = chat["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == chat["usage"]["prompt_tokens"]
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    with torch.no_grad():
        logits = hf_reference.model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(logprobs["token_logprobs"][1:prompt_tokens])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def _stalled_upload(server: Server) -> socket.socket:
    """A connection that sends a completion's headers and never its 4096-byte body."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 4096\r\n"
        + f"Authorization: Bearer {server.api_key}\r\n\r\n".encode()
    )
    return sock


def _response(sock: socket.socket) -> bytes:
    """One response: its head and its ``content-length`` body (HAProxy keeps the client's
    side open until the unsent body's ``timeout client``, Serve's proxy closes it)."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536) or _closed(received)
    head, _, body = received.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length, head
    while len(body) < int(length[1]):
        body += sock.recv(65536) or _closed(received)
    return head + b"\r\n\r\n" + body


def _closed(received: bytes) -> bytes:
    raise AssertionError(f"the server closed the connection mid-response: {received!r}")


def test_stalled_uploads_get_503_past_the_cap_and_408(server):
    """70 uploads that never send their bodies (the replica waits for at most 64 slow
    bodies at once, body_timeout_s is 3 here): the 6 past the cap get 503 at once,
    /health and real requests are served meanwhile, and each stalled one gets 408."""
    socks = [_stalled_upload(server) for _ in range(70)]
    try:
        time.sleep(1.0)
        started = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and time.monotonic() - started < 2
        ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200, ok.text
        answers = [_response(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    statuses = sorted(answer.split(b" ", 2)[1].decode() for answer in answers)
    assert statuses.count("503") >= 6 and set(statuses) == {"408", "503"}, statuses
    timed_out = next(a for a in answers if a.startswith(b"HTTP/1.1 408"))
    assert b"did not arrive within 3 s (body_timeout_s): 0 of 4096 bytes came" in timed_out
    busy = next(a for a in answers if a.startswith(b"HTTP/1.1 503"))
    assert b"max_pending_bodies" in busy


def test_a_huge_prompt_is_refused_before_tokenizing_while_streams_go_on(server):
    """A 3.9 MB prompt is over any context by its size alone: 400 at once, and a
    stream running meanwhile never stalls."""
    client = server.client()
    stream = client.completions.create(
        model=MODEL, prompt="Count: one, two,", max_tokens=40, temperature=0, stream=True
    )
    next(iter(stream))
    started = time.monotonic()
    response = server.post("/v1/completions", {"prompt": "word " * 780_000, "max_tokens": 4})
    assert time.monotonic() - started < 3
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert "the text is 3900000 characters, more than any 8192-token context" in error["message"]
    gaps, last = [], time.monotonic()
    for _ in stream:
        gaps.append(time.monotonic() - last)
        last = time.monotonic()
    assert gaps and max(gaps) < 2


def test_context_length_error_names_both_numbers_and_the_limit(server):
    response = server.post("/v1/completions", {"prompt": [1] * 8000, "max_tokens": 500})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "8000" in message and "500" in message and "8192" in message


def test_unknown_route_and_huge_body(server):
    response = httpx.get(f"{server.url}/v1/nothing", headers=server.headers)
    assert response.status_code == 404 and "error" in response.json()
    huge = json.dumps({"prompt": "x" * (5 * 2**20)})
    response = server.post("/v1/completions", huge)
    assert response.status_code == 413
    assert "4194304 bytes" in response.json()["error"]["message"]


def test_api_key_is_required_except_for_health(server):
    body = {"prompt": "Hi", "max_tokens": 2}
    missing = httpx.post(f"{server.url}/v1/completions", json=body)
    assert missing.status_code == 401 and "Authorization" in missing.json()["error"]["message"]
    wrong = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200
    for path in ("/metrics", "/docs", "/openapi.json"):  # behind the key too
        refused = httpx.get(f"{server.url}{path}")
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}{path}", headers=server.headers).status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json", headers=server.headers).json()
    assert "/v1/chat/completions" in schema["paths"] and "/docs" not in schema["paths"]
    docs = httpx.get(f"{server.url}/docs", headers=server.headers).text
    assert "swagger-ui" in docs and '"/v1/chat/completions"' in docs  # the schema inline


def test_only_json_bodies_are_read(server):
    """A cross-site form or text/plain POST (no preflight) is never read as a request."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        response = server.post("/v1/completions", body, headers={"Content-Type": content_type})
        assert response.status_code == 415, response.text
        assert response.json()["error"]["param"] == "Content-Type"
        assert content_type in response.json()["error"]["message"]
    ok = server.post("/v1/completions", body, headers={"Content-Type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_overload_gets_429_with_retry_after(server):
    scheduler = server.scheduler()
    ray.get(scheduler.set_admission.remote(1, 0))  # one request at a time, no queue
    long = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=long, headers=server.headers, timeout=60
        ) as running:
            lines = running.iter_lines()  # kept: dropping it would close the connection
            next(lines)
            _wait_until(server, lambda stats: stats.workers[0].ongoing == 1)
            refused = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "1"
            assert "overloaded" in refused.json()["error"]["message"]
            with pytest.raises(openai.RateLimitError):
                server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    finally:
        ray.get(scheduler.set_admission.remote(16, 64))
    ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_refused_prompt_of_a_batch_aborts_the_ones_already_started(server):
    scheduler = server.scheduler()
    _wait_idle(server)
    ray.get(scheduler.set_admission.remote(2, 0))  # two places, no queue: prompt 3 is refused
    try:
        body = {"prompt": ["One", "Two", "Three"], "max_tokens": 2000, "ignore_eos": True}
        refused = server.post("/v1/completions", body)
        assert refused.status_code == 429, refused.text
        # The two started prompts (2000 tokens: minutes) were aborted, not left running,
        # and their places in the cluster were freed.
        _wait_until(server, lambda stats: stats.workers[0].ongoing == 0, timeout_s=15)
        _wait_idle(server, timeout_s=15)
    finally:
        ray.get(scheduler.set_admission.remote(16, 64))


def test_null_fields_take_their_defaults(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": None, "n": None, "stop": None}
    done = server.post("/v1/completions", body)
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 3


def test_deadline_408_and_a_stream_that_fails_ends_with_an_error_event(server):
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "timeout": 1.0}
    late = server.post("/v1/completions", body)
    assert late.status_code == 408 and "deadline of 1 s" in late.json()["error"]["message"]

    lines = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={**body, "stream": True},
        headers=server.headers,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "timeout"
    assert len(lines) > 3  # tokens streamed before the deadline cut it
    ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


# ------------------------------------------------------------------ load, disconnects, metrics
def _wait_idle(server, timeout_s: float = 30) -> None:
    def idle(stats) -> bool:
        load = stats.workers[0].load
        return load.requests == 0 and load.engine.running == 0 and load.engine.waiting == 0

    _wait_until(server, idle, timeout_s)


def test_32_concurrent_streaming_clients_all_complete(server, make_engine):
    prompts = [f"Write a sentence about the number {i}." for i in range(32)]

    async def one(client, prompt):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert all(reason in ("stop", "length") for _, reason in results)
    for i in (0, 17, 31):  # batching does not change greedy outputs
        expected, _ = engine_text(make_engine, prompts[i], max_tokens=12, temperature=0)
        assert results[i][0] == expected
    _wait_idle(server)


def test_bench_serve_drives_the_server_and_writes_json_and_png(server, tmp_path):
    """`tessera bench serve` as a user runs it, its key from $OPENAI_API_KEY: every
    request completes with exactly its max_tokens (ignore_eos)."""
    command = [
        *(sys.executable, "-m", "tessera.cluster.cli", "bench", "serve"),
        *("--base-url", server.url, "--num-prompts", "6", "--max-concurrency", "3"),
        *("--random-input-len", "16", "--random-output-len", "8", "--ignore-eos"),
        *("--goodput", "ttft:60000", "tpot:60000", "--num-warmups", "1"),
        *("--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json"),
    ]
    env = {**os.environ, "OPENAI_API_KEY": API_KEY}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["failed"], result["model_id"]) == (6, 0, MODEL)
    assert result["total_output_tokens"] == 6 * 8
    assert result["total_input_tokens"] == 6 * 16  # token-id prompts: exact lengths
    assert result["request_goodput"] == result["request_throughput"]
    assert (tmp_path / "run.png").stat().st_size > 0
    assert "Total generated tokens:                  48" in done.stdout
    _wait_idle(server)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    _wait_idle(server)
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
    ) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        # The scheduler sees the worker's load as of its last report (polled).
        _wait_until(server, lambda stats: stats.workers[0].load.engine.running == 1, 10)
    # 4000 tokens would take minutes: it ends at once only because it was aborted.
    _wait_idle(server, timeout_s=15)
    after = ray.get(server.scheduler().stats.remote()).workers[0].load.engine
    assert after.free_blocks == after.total_blocks  # every block is back (some cached)


def _samples(server) -> dict[tuple[str, tuple], float]:
    """/metrics, summed over the front-end replicas (the ``replica`` label)."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    samples = collections.Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))
            samples[(s.name, labels)] += s.value
    return samples


def test_metrics_parse_and_move(server):
    before = _samples(server)
    done = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0
    )
    after = _samples(server)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("tessera_requests_total", endpoint="completions", status="200") == 1
    assert moved("tessera_generation_tokens_total") == 5
    assert moved("tessera_prompt_tokens_total") == done.usage.prompt_tokens
    assert moved("tessera_time_to_first_token_seconds_count") == 1
    assert moved("tessera_e2e_request_latency_seconds_count") == 1
    assert moved("tessera_time_per_output_token_seconds_count") == 1
    for phase in ("validate", "placement", "start", "engine_first_token", "relay"):
        assert moved("tessera_request_phase_seconds_count", phase=phase) == 1, phase
    deadline = time.monotonic() + 10  # the worker's counters arrive with its next report
    while moved("tessera_worker_generated_tokens_total", worker="mixed-0") < 5:
        assert time.monotonic() < deadline, "the worker's generated tokens did not move"
        time.sleep(0.2)
        after = _samples(server)
    # a prefill step and four decode steps at least (other tests' requests may add more)
    steps = moved("tessera_worker_engine_steps_total", worker="mixed-0")
    step_s = moved("tessera_worker_engine_step_seconds_total", worker="mixed-0")
    host_s = moved("tessera_worker_engine_host_seconds_total", worker="mixed-0")
    assert steps >= 5 and 0 < host_s < step_s, (steps, host_s, step_s)
    decode_steps = moved("tessera_worker_engine_decode_steps_total", worker="mixed-0")
    decode_s = moved("tessera_worker_engine_decode_seconds_total", worker="mixed-0")
    assert 4 <= decode_steps < steps and 0 < decode_s < step_s, (decode_steps, decode_s)
    assert after[("tessera_worker_status", (("status", "healthy"), ("worker", "mixed-0")))] == 1
    assert after[("tessera_worker_total_kv_blocks", (("worker", "mixed-0"),))] == 256
    assert ("tessera_worker_kv_usage_ratio", (("worker", "mixed-0"),)) in after
    assert ("tessera_worker_prefix_cache_hit_rate", (("worker", "mixed-0"),)) in after
    assert ("tessera_queued_requests", ()) in after


def test_vllm_metrics_are_served_and_move_by_exactly_the_request(server):
    """vLLM's names (the list taken from its design doc, ``tests/unit/test_vllm_metrics``)
    on a real server: vLLM's types, ``model_name`` the served name, the workers' series
    per ``engine``; one request of a known prompt and 7 tokens (``ignore_eos``) moves
    each count by exactly its figures."""
    from tests.unit.test_vllm_metrics import SERVED, family_name

    _wait_idle(server)
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name, kind in SERVED:
        family = families[family_name(name, kind)]
        assert family.type == kind and family.samples, name
        assert {s.labels["model_name"] for s in family.samples} == {MODEL}, name
    before = _samples(server)
    done = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == 7
    prompt_tokens = done.usage.prompt_tokens
    engine = {"engine": "mixed-0"}

    def key(name, **labels):
        return name, tuple(sorted({"model_name": MODEL, **labels}.items()))

    def moved(name, **labels):
        return after.get(key(name, **labels), 0) - before.get(key(name, **labels), 0)

    after = _samples(server)
    deadline = time.monotonic() + 10  # the worker's counters arrive with its next report
    while moved("vllm:generation_tokens_total", **engine) < 7:
        assert time.monotonic() < deadline, "the worker's generated tokens did not move"
        time.sleep(0.2)
        after = _samples(server)
    # the worker's, as it generated them: the first token from the prompt's step, then
    # one interval per token after it
    assert moved("vllm:generation_tokens_total", **engine) == 7
    assert moved("vllm:inter_token_latency_seconds_count", **engine) == 6
    assert moved("vllm:prefix_cache_queries_total", **engine) == prompt_tokens
    # the front end's, summed over its replicas
    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:request_success_total", finished_reason="stop") == 0
    assert moved("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert moved("vllm:request_generation_tokens_sum") == 7
    assert moved("vllm:request_params_max_tokens_sum") == 7
    assert moved("vllm:request_params_n_sum") == 1
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
    ):
        assert moved(f"{name}_count") == 1, name
    assert 0 <= after[key("vllm:kv_cache_usage_perc", **engine)] <= 1
    assert key("vllm:num_requests_waiting", engine="queue") in after  # the global queue


# ------------------------------------------------------------------ embeddings
def test_embeddings_match_transformers_through_the_openai_client(server, hf_reference):
    """Texts and token ids of different lengths batched in one request: transformers'
    last token's final hidden state, L2-normalised (the defaults); base64 decodes to
    the same floats; no KV block is held afterwards."""
    import base64

    import numpy as np
    import torch

    texts = ["Hello there.", "The lighthouse keeper climbed the stairs at dusk " * 3]
    client = server.client()
    done = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ids = [1, 2, 3, 500, 42, 7]
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:2]], encoding_format="float")
    # (the openai client decodes base64 where it chose the format, not where asked)
    default = client.embeddings.create(model=MODEL, input=texts)
    assert done.object == "list" and done.model == MODEL
    assert [d.index for d in done.data] == [0, 1]
    hf = hf_reference.model
    tokens = [server_tokens(server, text) for text in texts]
    assert done.usage.prompt_tokens == done.usage.total_tokens == sum(map(len, tokens))
    for response, inputs in ((done, tokens), (by_ids, [ids, ids[:2]])):
        for item, prompt in zip(response.data, inputs, strict=True):
            with torch.no_grad():
                states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            expected = torch.nn.functional.normalize(states[-1][0, -1].float(), dim=0)
            got = torch.tensor(item.embedding)
            assert got.shape == (hf.config.hidden_size,)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    raw = server.post("/v1/embeddings", {"input": texts, "encoding_format": "base64"}).json()
    for item, floats in zip(raw["data"], done.data, strict=True):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert decoded.tolist() == floats.embedding
    assert [d.embedding for d in default.data] == [d.embedding for d in done.data]

    def all_free(stats) -> bool:  # (as of the worker's next report: they are polled)
        engine = stats.workers[0].load.engine
        return engine.free_blocks == engine.total_blocks

    _wait_until(server, all_free, 10)


def server_tokens(server, text: str) -> list[int]:
    return server.post("/tokenize", {"prompt": text}).json()["tokens"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "input: must not be empty"),
        ({"input": ""}, "input", "input: must not be empty"),
        ({"input": ["a", ""]}, "input[1]", "input[1]: must not be empty"),
        ({"input": ["a"] * 2049}, "input", "input: at most 2048 inputs, got 2049"),
        ({"input": [[1] * 8193]}, "input[0]", "more than the model's context of 8192"),
        ({"input": [[1] * 5000]}, "input[0]", "5000 tokens, more than the KV pool's"),
        ({"input": [5, 10**7]}, "input", "token id 10000000 is out of the vocabulary"),
        ({"input": "a", "dimensions": 3}, "dimensions", "have 576 dimensions; truncation"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", ""),
    ],
)
def test_embeddings_bad_requests_name_the_field(server, body, param, words):
    response = server.post("/v1/embeddings", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert server.post("/v1/embeddings", {"input": "a", "dimensions": 576}).status_code == 200
