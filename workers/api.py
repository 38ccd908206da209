"""The seam between a worker's engine and whoever drives it (CLI, Ray actor, front ends).

Everything a caller hands the engine or gets back from it is defined here, validated
at construction, and free of engine internals.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

#: The most top-N logprobs a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


class InvalidRequestError(ValueError):
    """A request parameter is out of range. ``field`` names the parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # abort(request_id) or the caller went away


class Phase(str, enum.Enum):
    """Where a sequence is in its life; observable through ``Engine.stats``."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


def _check_number(name: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise InvalidRequestError(name, f"must be {kind}, got {value!r}")
    if not integer and math.isnan(value):
        raise InvalidRequestError(name, "must not be NaN")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k`` of -1 or 0 disables top-k. With no
    ``seed`` the engine draws one, so every request's randomness is keyed by
    (seed, token index) and reproducible across batch mixes, preemption and failover.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0 or math.isinf(self.temperature):
            raise InvalidRequestError(
                "temperature", f"must be between 0 and 100, got {self.temperature}"
            )
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}"
            )
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**63:
                raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", f"must be a tuple of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        for token_id in self.stop_token_ids:
            _check_number("stop_token_ids", token_id, integer=True)
            if token_id < 0:
                raise InvalidRequestError(
                    "stop_token_ids", f"token ids must be >= 0, got {token_id}"
                )
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    "logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's logprob and, if asked, the top-N alternatives.

    Logprobs are those of the model's raw distribution (log-softmax of the logits
    before temperature, penalties and truncation), as vLLM and OpenAI report them.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One delta of a request's output stream.

    ``text`` and ``token_ids`` hold only what is new since the previous delta. The
    last delta has ``finished`` set, a ``finish_reason`` and the usage counts.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass(frozen=True, slots=True)
class Request:
    """A generation request: a prompt (text or token ids), sampling, and a priority.

    Lower ``priority`` values are scheduled first and preempted last (as in vLLM).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if len(self.prompt_token_ids) == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        _check_number("priority", self.priority, integer=True)
