"""The OpenAPI fuzzer's cases and checks: schemathesis over the server's own schema.

Shared by the CI fuzzing (``tests/cluster/test_fuzz_openapi.py``) and the hostile
neighbour of the soak (``benchmarks/soak.py --hostile``).

**The schema.** The server's ``/openapi.json`` names no request bodies: its routes read
them themselves (``parse_body``). ``fuzz_schema`` adds each POST route's body from the
pydantic models the route parses it with, and says what the server holds and the
models do not: the served model's name, token ids within the vocabulary, and ``null``
for any top-level field (``parse_body`` reads it as the default). A route whose schema
already has a body keeps it. Cases that fit it (*positive*) draw the sampling fields
from ``RANGES``, the ranges the server accepts, which the models do not declare either;
cases that do not fit (*negative*) come from the schema without them.

**The bounds.** Generation is kept short (``MAX_TOKENS``, ``MAX_WIDTH``): the fuzzer is
after the doors and the checks, not the model.

**The checks** (``problems``): no 5xx but the documented ones (503 overloaded or
unavailable); a refusal (4xx) within ``REFUSAL_WITHIN_S`` as OpenAI's error object; an
answer within ``ANSWER_WITHIN_S``, a stream of JSON events with no internal error that
ends in ``data: [DONE]`` (a Responses API stream: in its last event); and a negative
case refused.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tessera.cluster.openai_chat import ChatCompletionRequest, TokenizeChatRequest
from tessera.cluster.openai_embeddings import EmbeddingRequest
from tessera.cluster.openai_loras import LoadLoraRequest, UnloadLoraRequest
from tessera.cluster.openai_requests import (
    CompletionRequest,
    DetokenizeRequest,
    TokenizeCompletionRequest,
)
from tessera.cluster.openai_responses_api import ResponsesRequest

#: Each POST route's body: the models its handler parses it with.
BODIES = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
    "/v1/responses": (ResponsesRequest,),
    "/v1/embeddings": (EmbeddingRequest,),
    "/v1/load_lora_adapter": (LoadLoraRequest,),
    "/v1/unload_lora_adapter": (UnloadLoraRequest,),
}
#: The routes that generate, whose cases are bounded.
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
#: Body fields that hold token ids.
TOKEN_FIELDS = ("prompt", "tokens", "stop_token_ids", "input")
#: The most tokens, and outputs (n, best_of, beam_width), one case may ask for.
MAX_TOKENS = 4
MAX_WIDTH = 2
#: The ranges positive cases draw these numeric fields from (wherever a body has them).
RANGES: dict[str, dict[str, float]] = {
    "max_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "max_completion_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "max_output_tokens": {"minimum": 1, "maximum": MAX_TOKENS},
    "min_tokens": {"minimum": 0, "maximum": 1},
    "n": {"minimum": 1, "maximum": MAX_WIDTH},
    "best_of": {"minimum": 1, "maximum": MAX_WIDTH},
    "beam_width": {"minimum": 1, "maximum": MAX_WIDTH},
    "temperature": {"minimum": 0, "maximum": 2},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": 100},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "length_penalty": {"minimum": -2, "maximum": 2},
    "priority": {"minimum": -1000, "maximum": 1000},
    "seed": {"minimum": 0, "maximum": 2**63 - 1},
    "timeout": {"minimum": 30, "maximum": 600},  # a shorter deadline is a 408, not a bug
    "prompt_logprobs": {"minimum": 0, "maximum": 20},
    "logprobs": {"minimum": 0, "maximum": 20},
    "top_logprobs": {"minimum": 0, "maximum": 20},
    "num_tokens": {"minimum": 0, "maximum": 16},  # speculative
    "threshold": {"exclusiveMinimum": 0, "maximum": 1},  # parallel_tokens
    "max_width": {"minimum": 1, "maximum": 4},  # parallel_tokens
}
REFUSAL_WITHIN_S = 2.0
ANSWER_WITHIN_S = 20.0
#: The 5xx the server documents (``serve_app``'s docstring), with their error types.
DOCUMENTED_5XX = {503: ("overloaded_error", "unavailable_error")}
#: Error events a stream may end with that are not the server's fault: by type, and by
#: code (the Responses API's ``error`` events have no type).
CLEAN_STREAM_ERRORS = ("timeout_error", "overloaded_error", "unavailable_error")
CLEAN_STREAM_CODES = ("timeout", "overloaded", "no_worker", "unavailable")
#: The events a Responses API stream ends with (it sends no ``[DONE]``).
RESPONSES_LAST = ("response.completed", "response.incomplete", "response.failed", "error")


def _numbers(node: Any, bounds: dict[str, float]) -> None:
    """Every integer or number schema under ``node`` gets ``bounds``."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            node.update(bounds)
        for value in node.values():
            _numbers(value, bounds)
    elif isinstance(node, list):
        for value in node:
            _numbers(value, bounds)


def _narrow(components: dict[str, Any]) -> None:
    """``RANGES`` on every object's properties of those names."""
    for schema in components.values():
        for name, prop in schema.get("properties", {}).items():
            if name in RANGES:
                _numbers(prop, RANGES[name])


def fuzz_schema(
    served: dict[str, Any], model: str, vocab_size: int, positive: bool
) -> dict[str, Any]:
    """The server's schema with each POST route's body (see the module's docstring);
    ``RANGES`` applied where ``positive``."""
    schema = copy.deepcopy(served)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    added = {}
    for path, models in BODIES.items():
        operation = schema["paths"][path]["post"]
        if "requestBody" in operation:
            continue
        refs = []
        for body_model in models:
            body = body_model.model_json_schema(ref_template="#/components/schemas/{model}")
            added.update(body.pop("$defs", {}))
            properties = body["properties"]
            for name, prop in properties.items():  # null reads as the default
                if name not in body.get("required", ()):
                    properties[name] = {"anyOf": [prop, {"type": "null"}]}
            properties["model"] = {"anyOf": [{"enum": [model]}, {"type": "null"}]}
            for name in TOKEN_FIELDS:
                if name in properties:
                    _numbers(properties[name], {"minimum": 0, "maximum": vocab_size - 1})
            added[body_model.__name__] = body
            refs.append({"$ref": f"#/components/schemas/{body_model.__name__}"})
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
            },
        }
    if positive:
        _narrow(added)
    components.update(added)
    return schema


def _whole_to_int(value: Any) -> Any:
    """JSON Schema's ``integer`` admits ``2.0``, and schemathesis sends such spellings;
    the server (as OpenAI) takes only ``2``. Positive cases spell them as integers."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _whole_to_int(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_to_int(item) for item in value]
    return value


def bounded(case: schemathesis.Case, positive: bool) -> schemathesis.Case:
    """``case`` with its generation within ``MAX_TOKENS`` and ``MAX_WIDTH`` (a chat body
    without a limit would run to the end of the context)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if positive:
        body = case.body = _whole_to_int(body)
    if case.path not in GENERATING:
        return case
    limits = dict.fromkeys(("max_tokens", "max_completion_tokens", "max_output_tokens"), MAX_TOKENS)
    limits.update(dict.fromkeys(("n", "best_of", "beam_width"), MAX_WIDTH))
    for name, limit in limits.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            body[name] = limit
    if case.path == "/v1/responses":
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    return case


def operations(schema: schemathesis.BaseSchema) -> Iterator[tuple[str, str]]:
    """(METHOD, path) of every operation in ``schema``."""
    for result in schema.get_all_operations():
        operation = result.ok()
        yield operation.method.upper(), operation.path


def generate(
    schema: schemathesis.BaseSchema, method: str, path: str, mode: str, count: int
) -> list[schemathesis.Case]:
    """Up to ``count`` cases for one operation, the same ones every time (derandomized);
    fewer where the schema has fewer (a GET without parameters has one)."""
    positive = mode == "positive"
    strategy = schema[path][method].as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    cases: list[schemathesis.Case] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy.map(lambda case: bounded(case, positive)))
    def collect(case: schemathesis.Case) -> None:
        cases.append(case)

    collect()
    return cases


def error_type(content: bytes) -> str | None:
    """The ``type`` of OpenAI's error object in ``content`` (None if it is not one)."""
    try:
        error = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error.get("type") or ""
    return None


def stream_problems(content: bytes, cut_short: bool = False) -> list[str]:
    """What is wrong with a server-sent event stream (nothing, for a good one)."""
    events = [
        line[len("data: ") :]
        for line in content.decode("utf-8", "replace").splitlines()
        if line.startswith("data: ")
    ]
    found = []
    for event in events:
        if event == "[DONE]":
            continue
        try:
            parsed = json.loads(event)
        except ValueError:
            found.append(f"an event that is not JSON: {event[:200]!r}")
            continue
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict) and error.get("type") not in CLEAN_STREAM_ERRORS:
            found.append(f"an error event: {event[:300]}")
        if _typed(event, "error") and parsed.get("code") not in CLEAN_STREAM_CODES:
            found.append(f"an error event: {event[:300]}")
    ended = events and (events[-1] == "[DONE]" or _typed(events[-1], *RESPONSES_LAST))
    if not ended and not cut_short:
        found.append("a stream that does not end with data: [DONE] or a Responses API end")
    return found


def _typed(event: str, *types: str) -> bool:
    """Whether ``event`` is a JSON object whose ``type`` is one of ``types``."""
    try:
        parsed = json.loads(event)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("type") in types


def problems(
    status: int,
    content_type: str,
    content: bytes,
    seconds: float,
    mode: str,
    cut_short: bool = False,
) -> list[str]:
    """What is wrong with one response (nothing, for a good one)."""
    found = []
    if status >= 500:
        if error_type(content) not in DOCUMENTED_5XX.get(status, ()):
            found.append(f"HTTP {status} (not a documented 5xx): {content[:300]!r}")
    elif status >= 400:
        if seconds > REFUSAL_WITHIN_S:
            found.append(f"HTTP {status} after {seconds:.2f} s (> {REFUSAL_WITHIN_S} s)")
        if error_type(content) is None:
            found.append(f"HTTP {status} without OpenAI's error object: {content[:300]!r}")
    else:
        if seconds > ANSWER_WITHIN_S:
            found.append(f"HTTP {status} after {seconds:.2f} s (> {ANSWER_WITHIN_S} s)")
        if content_type.startswith("text/event-stream"):
            found.extend(stream_problems(content, cut_short))
        if mode == "negative":
            found.append(f"HTTP {status} for a body outside the schema")
    return found
