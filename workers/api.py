"""The seam between a worker's engine and whoever drives it (CLI, Ray actor, front ends).

Everything a caller hands the engine or gets back from it is defined here, validated
at construction, and free of engine internals.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tessera.workers.params import (
    MAX_SPECULATIVE_TOKENS,
    MAX_TOP_LOGPROBS,
    PARALLEL_MODES,
    SPECULATIVE_METHODS,
    InvalidRequestError,
    ParallelTokensParams,
    SamplingParams,
    SpeculativeParams,
    StructuredParams,
    _check_number,
    fork_seed,
)

#: ``priority`` is within +-PRIORITY_LIMIT (vLLM leaves it unbounded): callers order
#: their requests, but none can set one that no other caller could match.
PRIORITY_LIMIT = 1000
#: Upper bounds (seconds) of the buckets of an engine's inter-token latency histogram
#: (``EngineStats.itl_counts``): vLLM's (``vllm/v1/metrics/buckets.py``), so that
#: /metrics serves it under vLLM's name with the bounds that dashboards and alerts
#: written for vLLM expect.
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

__all__ = [
    "EmbeddingCapacityError",
    "EngineTimes",
    "INTER_TOKEN_LATENCY_BUCKETS",
    "MAX_SPECULATIVE_TOKENS",
    "MAX_TOP_LOGPROBS",
    "PARALLEL_MODES",
    "PRIORITY_LIMIT",
    "SPECULATIVE_METHODS",
    "FinishReason",
    "InvalidRequestError",
    "LoraRef",
    "ParallelSet",
    "ParallelTokensParams",
    "Phase",
    "PrefillSource",
    "Request",
    "RequestOutput",
    "Resume",
    "SamplingParams",
    "SpeculativeParams",
    "SpeculativeStats",
    "StructuredParams",
    "TokenLogprob",
    "fork_seed",
]


class EmbeddingCapacityError(RuntimeError):
    """The KV pool has too few free blocks for one embedding input, even alone."""


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A LoRA adapter a request runs with: the name requests call it by (their
    ``model``), its folder (PEFT's files, readable by every worker) and the SHA-256 of
    those files (``model.lora.adapter_digest``): what workers check the files against
    and the prefix cache keys its blocks on."""

    name: str
    path: str
    digest: str


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
class ParallelSet:
    """The tokens one step of a ``parallel_tokens`` request appended, at one position."""

    position: int  # their shared logical (RoPE) position
    token_ids: tuple[int, ...]  # the sampled token first, then the others by probability
    tokens: tuple[str, ...]  # each token's own text
    probs: tuple[float, ...]  # each token's probability in the distribution of that step


@dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """A request's speculation so far: draft tokens ``proposed`` and ``accepted``, the
    verification ``steps`` and the ``tokens`` those steps produced (accepted + 1 each)."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class EngineTimes:
    """When the engine took a traced request (``Request.traced``) through its phases,
    in wall-clock nanoseconds (``time.time_ns``), so that a front end on another
    process or host can place them in its trace: queued from ``arrived_ns``, first
    scheduled (its prefill begins) at ``scheduled_ns``, its first output token sampled
    (the prefill ends, decoding begins) at ``first_token_ns``, its output's last delta
    built at ``finished_ns``. None: the request ended before that point (an abort)."""

    arrived_ns: int
    scheduled_ns: int | None
    first_token_ns: int | None
    finished_ns: int


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request's output stream.

    ``text`` and ``token_ids`` hold only what is new since the previous delta. The
    last delta of each output has ``finished`` set, a ``finish_reason`` and the usage
    counts; a request with ``n`` outputs is over after ``n`` finished deltas (one per
    ``index``). Beam search and ``best_of`` send each output whole, in one delta.

    Read-only by contract, not frozen: the engine builds one per sequence and step, and
    a frozen one took 1.4 us to build against 0.2 (as vLLM's, a delta is not hashable).
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
    index: int = 0  # which of the request's n outputs (sample or beam) this delta is for
    cumulative_logprob: float | None = None  # n > 1 and beam search: sum of token logprobs
    score: float | None = None  # beam search: cumulative_logprob / length ** length_penalty
    seed: int | None = None  # the seed this output sampled with (None for beam search)
    parallel_sets: tuple[ParallelSet, ...] | None = None  # parallel_tokens: this delta's sets
    speculative: SpeculativeStats | None = None  # speculation so far (when it speculates)
    # prompt_logprobs (in the first delta only): one per prompt token, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    times: EngineTimes | None = None  # a traced request's finished deltas: its phases


@dataclass(frozen=True, slots=True)
class Request:
    """A generation request: prompt token ids, sampling, a priority, and where it
    stands. The front end builds it (``ClusterClient.submit``), the worker actor
    passes it on, and the engine takes it as it is (``Engine.submit``), checking it once
    against the model and the pool (``workers.validation``).

    Lower ``priority`` values are scheduled first and preempted last (as in vLLM).
    ``cache_salt`` joins the prefix-cache hash of every block: only requests with the
    same salt share cached blocks (a tenant boundary); so does ``lora``'s digest
    (``cache_key``: an adapter changes every block's K/V).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    arrival_time: float = 0.0  # the engine's clock (``time.monotonic``) when it took it
    cache_salt: str | None = None
    resume: Resume | None = None  # what a worker that died had generated (failover)
    prefill: PrefillSource | None = None  # a decode worker pulls the prompt's blocks here
    lora: LoraRef | None = None  # the LoRA adapter it runs with (None: the base model)
    traced: bool = False  # its finished deltas carry the engine's ``EngineTimes``

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if "#" in self.request_id:
            raise InvalidRequestError(
                "request_id",
                f"must not contain '#' (it names the forks of n > 1 and beam search), "
                f"got {self.request_id!r}",
            )
        if len(self.prompt_token_ids) == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        check_priority(self.priority)
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise InvalidRequestError(
                "cache_salt", f"must be a non-empty string or None, got {self.cache_salt!r}"
            )

    @property
    def cache_key(self) -> str | None:
        """What its blocks' hashes take besides their tokens and the engine's keys: the
        salt, and the adapter's digest (None: neither)."""
        return cache_key(self.cache_salt, self.lora)


def cache_key(cache_salt: str | None, lora: LoraRef | None) -> str | None:
    """``Request.cache_key`` of a salt and an adapter."""
    if lora is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora.digest}"


def check_priority(priority: object) -> None:
    """``priority``: an integer within +-``PRIORITY_LIMIT``."""
    _check_number("priority", priority, integer=True)
    if not -PRIORITY_LIMIT <= priority <= PRIORITY_LIMIT:
        raise InvalidRequestError(
            "priority", f"must be in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {priority}"
        )


@dataclass(frozen=True, slots=True)
class Resume:
    """What a request already generated on a worker that died (failover).

    The engine appends ``token_ids`` to the prompt, recomputes their KV, and goes on as
    if it had sampled them itself: the sampler's token index, ``max_tokens``,
    penalties, the detokenizer and stop strings all count them, and no text is sent
    again. Only a request with one output (``n == 1``, no ``best_of``, no beams) can
    be resumed.
    """

    token_ids: tuple[int, ...]
    cumulative_logprob: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise InvalidRequestError("resume", "must hold at least one generated token")
        for token_id in self.token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(
                    "resume", f"token ids must be non-negative integers, got {token_id!r}"
                )


@dataclass(frozen=True, slots=True)
class PrefillSource:
    """Where a decode worker pulls a request's prompt blocks from."""

    worker_id: str
    address: str  # host:port of its KVTransfer server
    #: its engine's block hash keys (``Engine.hash_keys``; None: unknown): a decode
    #: worker whose keys differ (another model, precision or tensor-parallel size)
    #: computes the prompt itself rather than pull blocks it could not use
    hash_keys: tuple[str, ...] | None = None
