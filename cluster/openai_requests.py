"""The OpenAI request bodies both endpoints share, and the completions endpoint's.

Request models are strict and forbid unknown fields (as OpenAI's API answers
"Unrecognized request argument supplied"; ``openai_parsing`` drops them instead with
``ignore_unknown_fields``). The sampling fields carry the engine's names
and map to ``SamplingParams`` by ``tessera.workers.decoding.sampling_fields``; their
defaults are the engine's (one declaration). The chat endpoint's bodies are in
``openai_chat``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tessera.cluster.openai_errors import invalid
from tessera.workers.api import (
    MAX_TOP_LOGPROBS,
    InvalidRequestError,
    ParallelTokensParams,
    SamplingParams,
    SpeculativeParams,
)
from tessera.workers.decoding.sampling_fields import WIRE_NAMES, defaults, sampling_params

#: Most prompts one completions request may batch.
MAX_PROMPTS = 64
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


class Body(BaseModel):
    """Every request body: strict types, and no field it does not declare."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    include_usage: bool = False
    #: OpenAI pads its streamed chunks with an ``obfuscation`` field unless this is
    #: false; these streams carry none either way.
    include_obfuscation: bool = True


class SpeculativeBody(Body):
    method: str = _SPECULATIVE["method"]
    num_tokens: int = _SPECULATIVE["num_tokens"]
    adaptive: bool = _SPECULATIVE["adaptive"]


class ParallelTokensBody(Body):
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


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(Body):
    """Tessera's structured outputs, named as vLLM's ``structured_outputs``: one of a
    JSON schema, a regex, a choice of strings or an EBNF / Lark grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingBody(Body):
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
        if structured_given is not None:  # its grammar: FrontEnd.check_structured
            values["structured"], _ = structured_given
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


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: None = None  # only absent or null: no fill-in-the-middle (openai_parsing says so)

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


class TokenizeCompletionRequest(Body):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]
