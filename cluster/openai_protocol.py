"""The OpenAI wire format: request bodies in, response objects and errors out.

Pure functions and pydantic models, no Ray and no HTTP, so each mapping is unit
tested alone. Request models are strict and forbid unknown fields (as OpenAI's API
answers "Unrecognized request argument supplied"); every error becomes an ``APIError``
that the HTTP app renders as ``{"error": {"message", "type", "param", "code"}}``.

Tessera's extras ride in the same body, as vLLM's do: ``best_of``, ``beam_width`` /
``use_beam_search``, ``length_penalty``, ``early_stopping``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``priority``,
``cache_salt``, ``speculative`` (``{"method", "num_tokens", "adaptive"}``) and
``parallel_tokens`` (``{"threshold", "max_width", "mode"}``). A choice of a request that
speculated carries ``speculative`` (its counters); one of a ``parallel_tokens`` request
carries ``parallel_tokens``, its sets in order. The body's sampling fields carry the
engine's names and map to ``SamplingParams`` by ``tessera.workers.decoding.sampling_fields``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from ray.exceptions import RayError

from tessera.cluster import tools as tool_calls
from tessera.scheduler.api import DeadlineError, NoWorkerError, OverloadedError
from tessera.workers.api import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    InvalidRequestError,
    ParallelSet,
    ParallelTokensParams,
    RequestOutput,
    SamplingParams,
    SpeculativeParams,
    SpeculativeStats,
    StructuredParams,
    TokenLogprob,
)
from tessera.workers.decoding import structured
from tessera.workers.decoding.sampling_fields import WIRE_NAMES, defaults, sampling_params

logger = logging.getLogger(__name__)

#: Most prompts one completions request may batch.
MAX_PROMPTS = 64
#: Seconds a client is told to wait before retrying an overloaded cluster.
RETRY_AFTER_S = 1
#: The fields beam search leaves at their defaults (it is deterministic; as vLLM's
#: ``use_beam_search``), and those only beam search reads.
_NOT_WITH_BEAMS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logprobs", "best_of")  # fmt: skip
_BEAMS_ONLY = ("length_penalty", "early_stopping")
#: The engine's defaults, which the bodies state (one declaration: ``SamplingParams``).
_DEFAULT = defaults(SamplingParams)
_SPECULATIVE = defaults(SpeculativeParams)
_PARALLEL = defaults(ParallelTokensParams)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a text of ``max_model_len`` tokens can have, so that longer
    ones are refused before they are tokenized: a token of a byte-level BPE or
    SentencePiece vocabulary covers at most as many characters as its vocabulary entry
    has (the longest bounds them all); twice that leaves room for normalizers that
    merge characters (NFKC)."""
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return max_model_len * longest * 2


class APIError(Exception):
    """An error response: HTTP ``status`` and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str | None, message: str) -> APIError:
    """A 400 for one field; the message starts with the field's name."""
    if param is not None and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value")


def api_error(error: BaseException) -> APIError:
    """The HTTP error for whatever ended a request (the gRPC API maps it to a status
    code)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return invalid(error.field, str(error))
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(error, DeadlineError):
        return APIError(408, str(error), type="timeout_error", code="timeout")
    if isinstance(error, OverloadedError):
        return APIError(429, str(error), type="overloaded_error", code="overloaded", headers=retry)
    if isinstance(error, NoWorkerError):
        return APIError(503, str(error), type="unavailable_error", code="no_worker", headers=retry)
    # Ray's errors name actors, processes and nodes: the log has them, the client not.
    logger.error("request failed: %s: %s", type(error).__name__, error)
    if isinstance(error, RayError):
        return APIError(
            503,
            "a part of the cluster failed while serving the request; retry",
            type="unavailable_error",
            code="unavailable",
            headers=retry,
        )
    return internal_error(error)


def internal_error(error: BaseException) -> APIError:
    """A 500 that names the error's type only (its text may carry internals)."""
    return APIError(
        500,
        f"internal error ({type(error).__name__}); the server's log has the details",
        "internal_error",
    )


# ------------------------------------------------------------------ requests
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SpeculativeBody(_Body):
    method: str = _SPECULATIVE["method"]
    num_tokens: int = _SPECULATIVE["num_tokens"]
    adaptive: bool = _SPECULATIVE["adaptive"]


class ParallelTokensBody(_Body):
    threshold: float = _PARALLEL["threshold"]
    max_width: int = _PARALLEL["max_width"]
    mode: str = _PARALLEL["mode"]


#: Engine fields the OpenAI bodies carry under other names: ``structured`` comes from
#: ``response_format`` (OpenAI's) or ``structured_outputs`` (vLLM's extra).
HTTP_NAMES = {"structured": ("response_format", "structured_outputs")}


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI's; ``schema`` is aliased: pydantic
    reserves the name)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """Tessera's structured outputs, named as vLLM's ``structured_outputs``: one of a
    JSON schema, a regex, a choice of strings or an EBNF / Lark grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = _DEFAULT["temperature"]
    top_p: float = _DEFAULT["top_p"]
    top_k: int = _DEFAULT["top_k"]
    min_p: float = _DEFAULT["min_p"]
    n: int = _DEFAULT["n"]
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = _DEFAULT["presence_penalty"]
    frequency_penalty: float = _DEFAULT["frequency_penalty"]
    repetition_penalty: float = _DEFAULT["repetition_penalty"]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Tessera's extras
    best_of: int | None = None
    beam_width: int | None = None
    use_beam_search: bool = False
    length_penalty: float = _DEFAULT["length_penalty"]
    early_stopping: bool | Literal["never"] = _DEFAULT["early_stopping"]
    min_tokens: int = _DEFAULT["min_tokens"]
    ignore_eos: bool = _DEFAULT["ignore_eos"]
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = _DEFAULT["skip_special_tokens"]
    priority: int = 0
    cache_salt: str | None = None
    timeout: float | None = None  # seconds; the server's request_timeout_s caps it
    speculative: SpeculativeBody | None = None
    parallel_tokens: ParallelTokensBody | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's logprob
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as text) -> bias

    def structured(self) -> tuple[dict[str, str], str] | None:
        """The engine's ``structured`` setting and the body's field it came from."""
        chosen = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            if fmt.type == "json_object":
                chosen.append(({"kind": "json", "spec": '{"type": "object"}'}, "response_format"))
            elif fmt.json_schema is None:
                raise invalid("response_format.json_schema", "is required with type json_schema")
            else:
                spec = json.dumps(fmt.json_schema.json_schema)
                chosen.append(({"kind": "json", "spec": spec}, "response_format.json_schema"))
        if self.structured_outputs is not None:
            body = self.structured_outputs
            given = {
                "json": body.json_ if not isinstance(body.json_, dict) else json.dumps(body.json_),
                "regex": body.regex,
                "choice": None if body.choice is None else json.dumps(body.choice),
                "grammar": body.grammar,
            }
            kinds = [(kind, spec) for kind, spec in given.items() if spec is not None]
            if len(kinds) != 1:
                raise invalid(
                    "structured_outputs",
                    f"give exactly one of json, regex, choice, grammar; got {len(kinds)}",
                )
            kind, spec = kinds[0]
            chosen.append(({"kind": kind, "spec": spec}, f"structured_outputs.{kind}"))
        if len(chosen) > 1:
            raise invalid("structured_outputs", "is not allowed together with response_format")
        return chosen[0] if chosen else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raise ``APIError`` naming the field."""
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "is only allowed when stream is true")
        if self.timeout is not None and not (0 < self.timeout < math.inf):
            raise invalid("timeout", f"must be a number of seconds > 0, got {self.timeout}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        beam_width = 1 if self.beam_width is None else self.beam_width
        if self.use_beam_search and self.beam_width is None:
            beam_width = max(self.best_of or self.n, 2)
        elif self.use_beam_search and beam_width < 2:
            raise invalid("beam_width", f"must be >= 2 with use_beam_search, got {beam_width}")
        # The body's names are the engine's (chat's renamed ones are resolved by now).
        values = self.model_dump(include=WIRE_NAMES)
        values |= {"max_tokens": max_tokens, "logprobs": logprobs, "stop": stop,
                   "beam_width": beam_width}  # fmt: skip
        structured_given = self.structured()
        if structured_given is not None:
            values["structured"], source = structured_given
            try:
                structured.check(StructuredParams(**values["structured"]))
            except InvalidRequestError as error:
                raise invalid(source, error.message) from None
        try:
            if beam_width == 1:  # ignored without beams, but still checked
                sampling_params({name: values[name] for name in _BEAMS_ONLY})
            for name in _BEAMS_ONLY if beam_width == 1 else _NOT_WITH_BEAMS:
                del values[name]  # unset: the engine's default
            return sampling_params(values)
        except InvalidRequestError as error:
            raise invalid(self.wire_name(error.field), error.message) from None

    def wire_name(self, field: str) -> str:
        """The body's name of an engine field (chat's ``max_completion_tokens``)."""
        if field.startswith("structured"):
            given = self.structured()
            return given[1] if given is not None else field
        return field


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: None = None  # accepted only when absent / null (no fill-in-the-middle)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (OpenAI's four forms)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts:
            raise invalid("prompt", "must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise invalid("prompt", f"at most {MAX_PROMPTS} prompts, got {len(prompts)}")
        if any(len(p) == 0 for p in prompts):
            raise invalid("prompt", "must not be empty")
        return prompts

    def sampling_for(self, max_tokens: int) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise invalid("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        sampling = self.sampling(max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            # the echoed prompt's tokens carry logprobs too: computed in the prefill
            sampling = dataclasses.replace(sampling, prompt_logprobs=self.logprobs)
        return sampling


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class _Conversation(_Body):
    """A conversation as a chat template renders it."""

    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def conversation(self, template_takes_tools: bool = True) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (developer is system). Earlier
        tool calls and results go to a template that takes tools as its messages
        (arguments parsed); to others as plain turns in the Hermes format."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            message: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:
                calls = [(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls]
                if template_takes_tools:
                    message["tool_calls"] = [
                        {"type": "function", "function": {"name": n, "arguments": a}}
                        for n, a in calls
                    ]
                else:
                    message["content"] = "\n".join(
                        filter(None, [m.text(), *(tool_calls.call_text(n, a) for n, a in calls)])
                    )
            if role == "tool":
                if template_takes_tools:
                    message["tool_call_id"] = m.tool_call_id
                else:
                    message = {
                        "role": "user",
                        "content": f"<tool_response>\n{m.text()}\n</tool_response>",
                    }
            out.append(message)
        return out


class ChatCompletionRequest(_Sampling, _Conversation):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's bookkeeping, which changes no token: taken and not used (like ``user``)
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    store: Literal[False] = False
    #: The model family's call format (``tools.tool_format``); the server sets it.
    _tool_format: str = PrivateAttr("hermes")

    def offered_tools(self) -> list[dict[str, Any]]:
        """The functions the model may call (none with ``tool_choice`` none)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise invalid("tool_choice", "needs tools")
            return []
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise invalid("tools", "function names must be unique")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid(
                "tool_choice.function.name",
                f"{choice.function.name!r} is not among the tools ({', '.join(names)})",
            )
        for i, tool in enumerate(self.tools):
            if tool.function.parameters is not None:
                spec = json.dumps(tool.function.parameters)
                try:
                    structured.check(StructuredParams("json", spec))
                except InvalidRequestError as error:
                    message = error.message.replace("is not a valid json", "is not a valid schema")
                    raise invalid(f"tools.{i}.function.parameters", message) from None
        if choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools]

    @property
    def calls_forced(self) -> bool:
        """``required`` or a named function: decoding follows the calls' grammar."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def structured(self) -> tuple[dict[str, str], str] | None:
        given = super().structured()
        if not (self.offered_tools() and self.calls_forced):
            return given
        if given is not None:
            raise invalid("tool_choice", f"is not allowed together with {given[1]}")
        choice = self.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        grammar = tool_calls.call_grammar(
            self.offered_tools(), name, self.parallel_tool_calls, self._tool_format
        )
        return {"kind": "grammar", "spec": grammar}, "tool_choice"

    def sampling_for(self, max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise invalid("top_logprobs", "requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise invalid(
                    "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
                )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(max_tokens, logprobs)

    def wire_name(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().wire_name(field)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Conversation):
    """``POST /tokenize`` with messages: the chat template's prompt (vLLM's shape)."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


def _arguments(text: str) -> Any:
    """An earlier call's arguments for a chat template: parsed when they are JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _check_unicode(value: Any, path: list[str]) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (JSON's ``"\\ud800"``): it is
    not Unicode text, and neither the tokenizer nor a UTF-8 response can carry it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise invalid(
                ".".join(path) or None,
                f"has a lone surrogate (U+{ord(value[error.start]):04X}) at character "
                f"{error.start}: not valid Unicode text",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_unicode(item, [*path, str(key)])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(item, [*path, str(index)])


def parse_body(raw: bytes, model: type[_Body]) -> Any:
    """The request body as ``model``; ``APIError`` 400 naming the field otherwise."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid(None, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise invalid(None, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise invalid(None, f"the body must be a JSON object, got {type(data).__name__}")
    _check_unicode(data, [])
    data = {key: value for key, value in data.items() if value is not None}  # null: default
    return validate_body(data, model)


def validate_body(data: dict[str, Any], model: type[_Body]) -> Any:
    """``data`` as ``model`` (a body the gRPC door builds, too); ``APIError`` 400
    naming the field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"]]
        # A union's branch name (e.g. 'str', 'list[int]') is not part of the path.
        param = ".".join(part for part in loc if not _is_type_name(part)) or None
        if first["type"] == "extra_forbidden":
            raise invalid(param, f"Unrecognized request argument supplied: {param}") from None
        if first["type"] == "missing":
            raise invalid(param, "is required") from None
        message = first["msg"]
        if param == "prompt":
            message = (
                "must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids"
            )
        elif param == "store":
            message = "must be false: this server keeps no completions to fetch later"
        elif param is not None and _MESSAGE_CONTENT.fullmatch(param):
            message = (
                "must be a string or a list of text parts ({'type': 'text', 'text': ...}): "
                "the model reads text only"
            )
        raise invalid(param, f"{message}, got {_short(first.get('input'))}") from None


#: A chat message's ``content``, whose errors pydantic words as a bad string's.
_MESSAGE_CONTENT = re.compile(r"messages\.\d+\.content")


def _is_type_name(part: str) -> bool:
    return (
        part in {"str", "int", "bool", "float", "none"} or "[" in part or part.startswith("literal")
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------ responses
def finish_reason(output: RequestOutput) -> str | None:
    if not output.finished or output.finish_reason is None:
        return None
    if output.finish_reason is FinishReason.ABORT:
        return "abort"
    return output.finish_reason.value


def parallel_sets(sets: Sequence[ParallelSet]) -> list[dict[str, Any]]:
    """A choice's ``parallel_tokens``: each set's position, token ids, token texts and
    probabilities."""
    return [
        {
            "position": s.position,
            "token_ids": list(s.token_ids),
            "tokens": list(s.tokens),
            "probs": list(s.probs),
        }
        for s in sets
    ]


def speculative_stats(stats: SpeculativeStats) -> dict[str, Any]:
    """A choice's ``speculative``: its draft tokens proposed and accepted, and steps."""
    return {
        "proposed": stats.proposed,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "steps": stats.steps,
        "tokens": stats.tokens,
        "mean_tokens_per_step": stats.mean_tokens_per_step,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class LogprobFormatter:
    """Token logprobs in both endpoints' shapes; token strings decoded one by one."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(
        self,
        logprobs: Sequence[TokenLogprob | None],
        offset: int,
        out: dict[str, list] | None = None,
    ) -> tuple[dict[str, list], int]:
        """``choices[i].logprobs`` of the completions API (appended to ``out``, e.g. the
        echoed prompt's); returns it and the text offset after it. A ``None`` entry is
        the prompt's first token: ``prompt_token_id`` names it, with no logprob."""
        if out is None:
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in logprobs:
            text = self.token(entry.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(entry.logprob)
            top = {self.token(t): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def prompt(
        self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], offset: int = 0
    ) -> tuple[dict[str, list], int]:
        """The echoed prompt's part of ``choices[i].logprobs``: its first token has
        none (OpenAI's null)."""
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        first = self.token(prompt_ids[0])
        out["tokens"].append(first)
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        out["text_offset"].append(offset)
        return self.completion([e for e in logprobs[1:] if e is not None], offset + len(first), out)

    def prompt_logprobs(self, logprobs: Sequence[TokenLogprob | None]) -> list[Any]:
        """vLLM's ``prompt_logprobs``: None for the first token, then per token a map
        of token id to its logprob and text (the chosen one and the top ones)."""
        out: list[Any] = []
        for entry in logprobs:
            if entry is None:
                out.append(None)
                continue
            ranked = {entry.token_id: entry.logprob, **dict(entry.top)}
            out.append(
                {
                    str(t): {"logprob": lp, "decoded_token": self.token(t)}
                    for t, lp in ranked.items()
                }
            )
        return out

    def chat(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """``choices[i].logprobs.content`` of the chat API."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [
            {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
            for e in logprobs
        ]
