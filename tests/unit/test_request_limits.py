"""What a request may make a replica or a worker do: every step whose cost grows with
the request is bounded by a size checked before it, the front end's heavy steps run on
its thread pool, and a refusal names the field, the limit and what was given."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tessera.cluster.front_end import MAX_CACHE_SALT_CHARS, FrontEnd, salt_key
from tessera.cluster.openai_chat import MAX_TOOLS, ChatCompletionRequest
from tessera.cluster.openai_errors import APIError
from tessera.cluster.openai_parsing import parse_body
from tessera.cluster.serve_config import ServeConfig
from tessera.workers import validation
from tessera.workers.api import (
    PRIORITY_LIMIT,
    InvalidRequestError,
    Request,
    SamplingParams,
    StructuredParams,
)
from tessera.workers.decoding import sampling_fields, structured
from tessera.workers.params import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

VOCAB = 1000
CONTEXT = 64


class _Client:
    """Records what the front end submits."""

    def __init__(self) -> None:
        self.submitted: list[dict] = []

    async def submit(self, request_id, prompt, sampling, **options):
        self.submitted.append({"request_id": request_id, **options})
        return object()


def _front(**settings) -> FrontEnd:
    """A replica's front end without a cluster: its config, limits and thread pool."""
    front = FrontEnd.__new__(FrontEnd)
    front.config = ServeConfig.create(**settings)
    front._cpu = ThreadPoolExecutor(2, thread_name_prefix="tessera-cpu")
    front.max_model_len, front.vocab_size, front.model_name = CONTEXT, VOCAB, "m"
    front.client = _Client()
    return front


def _refusal(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


# ------------------------------------------------------------------ priority, salt
def test_priority_is_bounded_at_the_door_and_in_the_request():
    front = _front()
    front.check_request(PRIORITY_LIMIT, None)
    front.check_request(-PRIORITY_LIMIT, None)
    for priority in (PRIORITY_LIMIT + 1, -(10**30)):
        error = _refusal(lambda p=priority: front.check_request(p, None))
        assert error.param == "priority"
        assert error.message == f"priority: must be in [-1000, 1000], got {priority}"
    error = _refusal(lambda: front.check_request(10**30, None, "sampling."))
    assert error.param == "sampling.priority"
    with pytest.raises(InvalidRequestError, match=r"priority: must be in \[-1000, 1000\]"):
        Request("r", (1,), priority=10**30)


def test_a_long_cache_salt_is_refused_and_a_salt_is_hashed_once_per_request():
    front = _front()
    front.check_request(0, "s" * MAX_CACHE_SALT_CHARS)
    error = _refusal(lambda: front.check_request(0, "s" * (MAX_CACHE_SALT_CHARS + 1)))
    assert error.param == "cache_salt"
    assert error.message == "cache_salt: is 1025 characters, over the limit of 1024"
    # The cluster hashes every block with the salt's digest: 64 characters, whatever
    # the salt, equal on every replica, different for different salts.
    job = front.job("completion", "r", [[1, 2, 3]], SamplingParams(), time.monotonic())
    asyncio.run(front.start(job, 0, "tenant-a"))
    (submitted,) = front.client.submitted
    assert submitted["cache_salt"] == salt_key("tenant-a") and len(salt_key("x" * 1024)) == 64
    assert salt_key("tenant-a") != salt_key("tenant-b")


# ------------------------------------------------------------------ grammars
def test_a_grammar_over_the_limit_is_refused_before_it_is_compiled(monkeypatch):
    front = _front(max_grammar_bytes="1KiB")
    monkeypatch.setattr(structured, "check", lambda params: pytest.fail("compiled"))
    big = StructuredParams("regex", "a" * 1025)
    with pytest.raises(APIError) as caught:
        asyncio.run(front.check_structured(big, "structured_outputs.regex"))
    assert caught.value.message == (
        "structured_outputs.regex: the grammar is 1025 bytes, over the limit of 1024 bytes "
        "(max_grammar_bytes)"
    )
    wide = StructuredParams("regex", "é" * 600)  # 1,200 bytes in UTF-8
    with pytest.raises(APIError, match="the grammar is 1200 bytes"):
        asyncio.run(front.check_structured(wide, "structured_outputs.regex"))


def test_grammars_compile_off_the_event_loop_and_refusals_are_cached(monkeypatch):
    front = _front()
    threads, compiled = [], []
    real = structured.grammar_text

    def grammar_text(params):
        threads.append(threading.current_thread().name)
        compiled.append(params.spec)
        return real(params)

    monkeypatch.setattr(structured, "grammar_text", grammar_text)
    bad = StructuredParams("regex", "(unclosed" + "x" * 37)  # not in any earlier cache
    for _ in range(3):
        with pytest.raises(APIError, match=r"^structured_outputs.regex: is not a valid regex"):
            asyncio.run(front.check_structured(bad, "structured_outputs.regex"))
    good = StructuredParams("regex", "[ab]{3}" + "c" * 41)
    asyncio.run(front.check_structured(good, "structured_outputs.regex"))
    asyncio.run(front.check_structured(good, "structured_outputs.regex"))
    assert compiled == [bad.spec, good.spec]  # each once: the refusal came from the cache
    assert all(name.startswith("tessera-cpu") for name in threads)


def test_the_grammar_cache_is_bounded_by_characters_least_recently_used_first(monkeypatch):
    """Compiled grammars and refusals are held up to ``GRAMMAR_CACHE_CHARS`` characters
    (specs and grammars), not a count: many large grammars cannot grow a replica's
    memory past it; the least recently used go first, and a spec asked for again stays."""
    monkeypatch.setattr(structured, "GRAMMAR_CACHE_CHARS", 40_000)
    compiled = []
    real = structured.grammar_text

    def grammar_text(params):
        compiled.append(params.spec)
        return real(params)

    monkeypatch.setattr(structured, "grammar_text", grammar_text)
    specs = [f"(k{i})" + "a" * 5000 for i in range(8)]  # each ~10,000 characters held
    for spec in specs:
        structured.check(StructuredParams("regex", spec))
        structured.check(StructuredParams("regex", specs[0]))  # kept in use
    assert structured._held[0] <= 40_000
    held = {spec for kind, spec in structured._grammars}
    assert specs[0] in held and specs[-1] in held and specs[1] not in held
    compiled.clear()
    structured.check(StructuredParams("regex", specs[0]))
    structured.check(StructuredParams("regex", specs[1]))  # evicted: compiled again
    assert compiled == [specs[1]]


def test_deeply_nested_json_schemas_are_refused_not_raised():
    deep = '{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000
    for kind, spec in (("json", deep), ("choice", "[" * 100_000)):
        with pytest.raises(InvalidRequestError, match=f"is not a valid {kind}"):
            structured.check(StructuredParams(kind, spec))


# ------------------------------------------------------------------ token ids
def test_token_ids_are_counted_before_their_range_is_checked():
    ids = list(range(10**6))  # a 4 MiB body's worth
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError) as caught:
        validation.check_prompt_ids(ids, VOCAB, "prompt", max_len=CONTEXT)
    assert time.perf_counter() - start < 0.05  # the count alone: no loop over the ids
    assert caught.value.message == ("1000000 token ids, more than the model's context of 64 tokens")
    for bad, message in (
        ([5, -1, 7], "token id -1 is out of the vocabulary [0, 1000)"),
        ([5, 1000], "token id 1000 is out of the vocabulary [0, 1000)"),
        ([5, True], "token ids must be integers, got True"),
        ([5, 2.0], "token ids must be integers, got 2.0"),
    ):
        with pytest.raises(InvalidRequestError, match=f"^prompt: {re.escape(message)}"):
            validation.check_prompt_ids(bad, VOCAB, max_len=CONTEXT)
    with pytest.raises(APIError, match="^tokens: 65 token ids, more than the model's context"):
        asyncio.run(_front().token_ids(list(range(65)), "tokens"))


def test_stop_strings_and_stop_token_ids_are_bounded():
    SamplingParams(stop=("x" * MAX_STOP_CHARS,))
    with pytest.raises(
        InvalidRequestError, match="^stop: stop strings are at most 1024 characters, got 1025"
    ):
        SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),))
    with pytest.raises(InvalidRequestError, match="^stop: at most 16 stop strings, got 100000"):
        SamplingParams(stop=(1,) * 100_000)  # counted before any is looked at
    too_many = tuple(range(MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(
        InvalidRequestError, match="^stop_token_ids: at most 1024 token ids, got 1025"
    ):
        SamplingParams(stop_token_ids=too_many)


def test_logit_bias_is_counted_before_its_keys_are_read():
    bias = {f"not-an-id-{i}": 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(InvalidRequestError, match="^logit_bias: at most 300 tokens, got 301"):
        sampling_fields.sampling_params({"logit_bias": bias})


def test_sampling_ids_out_of_the_vocabulary_are_named():
    sampling = SamplingParams(stop_token_ids=(3, VOCAB + 5), logit_bias=((2, 1.0),))
    with pytest.raises(InvalidRequestError, match="^stop_token_ids: token id 1005 is out"):
        validation.check_sampling_ids(sampling, VOCAB)


def test_at_most_128_tools_are_offered():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool] * (MAX_TOOLS + 1)}
    with pytest.raises(APIError, match="^tools: List should have at most 128 items") as caught:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert caught.value.param == "tools"
    body["tools"] = [tool] * MAX_TOOLS
    assert len(parse_body(json.dumps(body).encode(), ChatCompletionRequest).tool_schemas()) == 128
