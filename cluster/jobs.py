"""A request's generation as the front end tracks it: a ``Job`` of prompts whose
streams merge into ``Choice``s, and the errors that end one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from tessera.cluster.openai_protocol import APIError, invalid
from tessera.workers.api import (
    EngineTimes,
    InvalidRequestError,
    LoraRef,
    RequestOutput,
    SamplingParams,
    SpeculativeStats,
)


@dataclass
class Choice:
    """What one output (index) has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    started: bool = False  # a streamed chat choice has sent its role
    offset: int = 0  # completions logprobs: text offset of the next token
    parallel_sets: list | None = None  # parallel_tokens requests: the sets so far
    speculative: SpeculativeStats | None = None  # the latest counters of a speculating one


@dataclass
class Job:
    """One request's generation: its prompts, their streams, and timings."""

    kind: str  # "completion", "chat" or "generate" (gRPC)
    request_id: str
    model: str
    prompts: list[list[int]]
    sampling: SamplingParams
    timeout: float  # seconds from arrival to the deadline
    deadline: float  # time.monotonic() when the request is aborted
    arrival: float
    include_usage: bool = False  # streaming: every chunk has "usage", the last one its value
    lora: LoraRef | None = None  # the adapter it runs with (``model`` is then its name)
    streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    choices: dict[int, Choice] = field(default_factory=dict)
    first_token: float | None = None
    started: float | None = None  # validated: its first prompt is being submitted
    tool_names: frozenset[str] = frozenset()  # chat with tools offered: parse calls
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)  # by prompt
    created: int = field(default_factory=lambda: int(time.time()))
    # Traced (``otlp_traces_endpoint``): the W3C trace context the request brought (empty
    # when none), and the engine's phase times from its first prompt's finished deltas.
    trace: dict[str, str] | None = None
    engine_times: EngineTimes | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())

    def choice_index(self, prompt: int, delta: RequestOutput) -> int:
        return prompt * self.sampling.n + delta.index


def deadline_error(job: Job) -> APIError:
    return APIError(
        408,
        f"the request passed its deadline of {job.timeout:g} s and was aborted",
        type="timeout_error",
        code="timeout",
    )


async def close_streams(streams: list[AsyncIterator[RequestOutput]]) -> None:
    """Close the streams: each aborts its request on its worker, freeing its blocks."""
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


@contextlib.contextmanager
def invalid_as(prefix: str) -> Iterator[None]:
    """A request rule's ``InvalidRequestError`` as the door's 400, its field prefixed."""
    try:
        yield
    except InvalidRequestError as error:
        raise invalid(prefix + error.field, error.message) from None
