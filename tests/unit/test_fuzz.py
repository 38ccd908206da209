"""Property tests (hypothesis) for what a caller sends and what a caller can make the
model write: the request parsers, the tool-call parser and the SSE writer.

Random and adversarial inputs never raise anything but the documented validation
errors (``APIError`` 400, ``InvalidRequestError``), and each finishes well within the
deadline. Derandomized (a fixed seed), bounded examples and no example database, so
each run tries the same inputs in seconds."""

from __future__ import annotations

import asyncio
import json
import string

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.cluster import tools
from tessera.cluster.http_answers import AnswerWriter
from tessera.cluster.jobs import Job
from tessera.cluster.openai_chat import ChatCompletionRequest, TokenizeChatRequest
from tessera.cluster.openai_errors import APIError
from tessera.cluster.openai_parsing import parse_body
from tessera.cluster.openai_requests import CompletionRequest, DetokenizeRequest
from tessera.workers.api import InvalidRequestError, SamplingParams

#: Every property: the same examples each run, none stored, each within 2 s.
FUZZ = settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: What the validation may raise: a 400 naming the field, or the engine's own refusal.
DOCUMENTED = (APIError, InvalidRequestError)

# ------------------------------------------------------------------ strategies
#: Text with the pieces that matter to the parsers mixed in.
TEXT = st.lists(
    st.text(st.characters(codec="utf-8"), max_size=8)  # any text; lone surrogates are LEAF's
    | st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"', "\n", " ", "\\"]),
    max_size=5,
).map("".join)
LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
    | st.sampled_from(["\ud800", "a\udfffb"])  # lone surrogates, as JSON escapes send them
)
JSON = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
TOKEN_IDS = st.lists(st.integers(-5, 60_000), max_size=6)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])},
    optional={
        "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})),
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": TEXT,
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {"name": TEXT, "arguments": TEXT | JSON.map(json.dumps)}
                    ),
                }
            ),
            max_size=2,
        ),
        "tool_call_id": TEXT,
        "name": TEXT,
    },
)
SCHEMA = st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "integer", "array", "nonsense"])},
    optional={"properties": st.dictionaries(TEXT, JSON, max_size=3), "required": JSON},
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "function", "other"]),
        "function": st.fixed_dictionaries(
            {"name": st.text(string.ascii_letters + "_-", min_size=0, max_size=70)},
            optional={"parameters": SCHEMA | JSON, "description": TEXT, "strict": JSON},
        ),
    }
)
#: Per field, values that reach past the type checks; any field may also be any JSON.
FIELDS = {
    "prompt": TEXT | TOKEN_IDS | st.lists(TEXT | TOKEN_IDS, max_size=3),
    "messages": st.lists(MESSAGE, max_size=3),
    "tools": st.lists(TOOL, max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required", "any"])
    | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})}
    ),
    "max_tokens": st.integers(-2, 10**6),
    "max_completion_tokens": st.integers(-2, 10**6),
    "n": st.integers(-1, 100),
    "best_of": st.integers(-1, 100),
    "beam_width": st.integers(-1, 100),
    "use_beam_search": st.booleans(),
    "temperature": st.floats(allow_nan=True),
    "top_p": st.floats(allow_nan=True),
    "top_k": st.integers(-5, 10**6),
    "logprobs": st.integers(-1, 30) | st.booleans(),
    "top_logprobs": st.integers(-1, 30),
    "prompt_logprobs": st.integers(-1, 30),
    "stop": TEXT | st.lists(TEXT, max_size=20),
    "stop_token_ids": TOKEN_IDS,
    "logit_bias": st.dictionaries(st.integers(-5, 10**6).map(str) | TEXT, JSON, max_size=4),
    "priority": st.integers(-(2**40), 2**40),
    "cache_salt": TEXT,
    "seed": st.integers(-(2**70), 2**70),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": SCHEMA | JSON})},
    ),
    "structured_outputs": st.fixed_dictionaries(
        {},
        optional={
            "json": SCHEMA | TEXT,
            "regex": TEXT,
            "choice": st.lists(TEXT, max_size=3),
            "grammar": TEXT,
        },
    ),
    "speculative": st.dictionaries(st.sampled_from(["method", "num_tokens", "adaptive"]), JSON),
    "parallel_tokens": st.dictionaries(st.sampled_from(["threshold", "max_width", "mode"]), JSON),
    "chat_template_kwargs": st.dictionaries(TEXT, JSON, max_size=3),
    "continue_final_message": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "timeout": st.floats(allow_nan=True),
    "echo": st.booleans(),
    "tokens": TOKEN_IDS,
}


def _bodies(model) -> st.SearchStrategy[dict]:
    """Objects with ``model``'s required fields and some of its others, most values of
    their own kind (so that most bodies get past the types to the rules), some any
    JSON; now and then a field it does not have."""
    required = [name for name, info in model.model_fields.items() if info.is_required()]
    optional = sorted(set(model.model_fields) - set(required)) + ["bogus"]

    def value(name: str) -> st.SearchStrategy:
        own = FIELDS.get(name, JSON)
        return st.one_of(own, own, own, JSON)

    return st.lists(st.sampled_from(optional), max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries(
            {name: FIELDS.get(name, JSON) for name in required},
            optional={name: value(name) for name in keys},
        )
    )


def _raw(model) -> st.SearchStrategy[bytes]:
    """A request body's bytes: JSON text of a body (NaN and all, as Python writes it),
    any JSON, or any bytes."""
    body = _bodies(model).map(lambda body: json.dumps(body).encode())
    return st.one_of(
        body, body, body, body, JSON.map(lambda value: json.dumps(value).encode()), st.binary()
    )


# ------------------------------------------------------------------ request parsers
@FUZZ
@given(_raw(CompletionRequest))
def test_completion_bodies_parse_or_are_refused_by_name(raw):
    try:
        body = parse_body(raw, CompletionRequest)
        body.prompts()
        body.sampling_for(body.max_tokens if body.max_tokens is not None else 16)
    except DOCUMENTED:
        pass


@FUZZ
@given(_raw(ChatCompletionRequest), st.booleans())
def test_chat_bodies_parse_or_are_refused_by_name(raw, template_takes_tools):
    try:
        body = parse_body(raw, ChatCompletionRequest)
        body.template_kwargs()
        body.conversation(template_takes_tools)
        body.tool_schemas()
        body.offered_tools()
        body.sampling_for(body.requested_max_tokens or 16)
    except DOCUMENTED:
        pass


@FUZZ
@given(_raw(TokenizeChatRequest) | _raw(DetokenizeRequest))
def test_tokenize_bodies_parse_or_are_refused_by_name(raw):
    for model in (TokenizeChatRequest, DetokenizeRequest):
        try:
            body = parse_body(raw, model)
            if isinstance(body, TokenizeChatRequest):
                body.conversation()
        except DOCUMENTED:
            pass


# ------------------------------------------------------------------ tool-call parser
NAMES = {"get_weather", "get_time"}
CALL = st.builds(
    tools.call_text,
    st.sampled_from(sorted(NAMES) + ["unknown"]),
    st.dictionaries(TEXT, JSON, max_size=3),
)
#: Model output a caller can steer: calls, broken calls, tags and text, in any order.
ODD_CALL = st.builds(  # a call whose name or arguments are any JSON
    lambda name, arguments: tools.call_text(name, arguments).replace(" ", ""), JSON, JSON
)
OUTPUT = st.lists(
    CALL
    | ODD_CALL
    | TEXT
    | st.sampled_from(["<tool_call>", "</tool_call>", "<tool_call>\n{", "<|python_tag|>"])
    | st.integers(1, 3000).map(lambda n: " " * n),
    max_size=12,
).map("".join)


@FUZZ
@given(OUTPUT, st.sampled_from(["hermes", "llama3"]))
def test_the_tool_call_parser_takes_any_output(text, fmt):
    content, calls = tools.parse(text, fmt, NAMES)
    assert content is None or isinstance(content, str)
    for call in calls:
        assert call.name in NAMES
        assert isinstance(json.loads(call.arguments), dict)
    if not calls:
        assert content == text  # nothing taken out
    if fmt == "hermes" and calls:
        assert len(calls) <= text.count(tools.CALL_CLOSE)


PLAIN = st.text(string.ascii_letters + " .,\n", max_size=30)
ARGUMENTS = st.dictionaries(TEXT, JSON, max_size=3).filter(
    lambda arguments: tools.CALL_CLOSE not in json.dumps(arguments)  # it would end the block
)


@FUZZ
@given(
    st.lists(st.tuples(st.sampled_from(sorted(NAMES)), ARGUMENTS), max_size=4),
    st.lists(PLAIN, min_size=5, max_size=5),
)
def test_calls_between_plain_text_are_found_in_order(made, between):
    blocks = [tools.call_text(name, arguments) for name, arguments in made]
    text = "".join(piece for pair in zip(between, [*blocks, ""], strict=False) for piece in pair)
    content, calls = tools.parse(text, "hermes", NAMES)
    assert [call.name for call in calls] == [name for name, _ in made]
    assert [json.loads(call.arguments) for call in calls] == [
        json.loads(json.dumps(arguments)) for _, arguments in made
    ]
    if calls:
        assert content == ("".join(between[: len(blocks) + 1]).strip() or None)
    else:
        assert content == text


# ------------------------------------------------------------------ SSE writer
class _Gauge:
    def inc(self) -> None: ...
    def dec(self) -> None: ...


class _Metrics:
    in_flight = _Gauge()


class _Front:
    """What the SSE writer reads of a replica: its metrics."""

    metrics = _Metrics()

    def __init__(self) -> None:
        self.statuses: list[int] = []

    def finished(self, job, endpoint: str, status: int) -> None:
        self.statuses.append(status)


SAFE_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
CHUNK = st.dictionaries(
    TEXT,
    st.recursive(
        SAFE_LEAF,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
        max_leaves=8,
    ),
    max_size=4,
)
#: A stream's chunks, then how it ends: at its end, or with an error (a worker lost,
#: a deadline passed, a request refused).
FAILURES = st.sampled_from(
    [None, InvalidRequestError("stop", "bad"), TimeoutError(), RuntimeError("internal /path")]
)


@FUZZ
@given(st.lists(CHUNK, max_size=6), FAILURES)
def test_server_sent_events_are_one_json_line_each_and_end_with_done(chunks, failure):
    front = _Front()
    writer = AnswerWriter.__new__(AnswerWriter)
    writer.front = front
    job = Job("chat", "r", "m", [[1]], SamplingParams(), 60.0, 1e9, 0.0, False)

    async def produce():
        for chunk in chunks:
            yield chunk
        if failure is not None:
            raise failure

    async def read() -> bytes:
        response = writer.sse(job, produce(), "chat")
        return b"".join([piece async for piece in response.body_iterator])

    stream = asyncio.run(read())
    events = stream.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [event.removeprefix(b"data: ") for event in events[:-2]]
    assert all(event.startswith(b"data: ") for event in events[:-1])
    assert all(b"\n" not in payload for payload in payloads)  # one line per event
    sent = [orjson.loads(payload) for payload in payloads]
    assert sent[: len(chunks)] == [orjson.loads(orjson.dumps(chunk)) for chunk in chunks]
    if failure is None:
        assert len(sent) == len(chunks) and front.statuses == [200]
    else:
        (error,) = sent[len(chunks) :]
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert "/path" not in error["error"]["message"]  # no internals
        assert front.statuses == [
            {InvalidRequestError: 400, TimeoutError: 500}.get(type(failure), 500)
        ]


def test_the_fuzz_settings_are_fixed():
    """CI tries the same examples every run: derandomized, no stored examples."""
    assert FUZZ.derandomize and FUZZ.database is None and FUZZ.max_examples <= 200


@pytest.mark.parametrize("depth", [10, 500, 5000])
def test_nested_bodies_are_refused_or_taken_never_raised(depth):
    for raw in (
        b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
        b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
        + b'{"b": ' * depth
        + b"1"
        + b"}" * depth
        + b"}}",
    ):
        for model in (CompletionRequest, ChatCompletionRequest):
            try:
                parse_body(raw, model)
            except APIError as error:
                assert error.status == 400
