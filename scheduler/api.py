"""The typed seam between the scheduler, its workers and the front ends.

Workers tell the scheduler who they are (``WorkerInfo``, again after every restart)
and how loaded they are (``WorkerLoad``, pulled by the scheduler's monitor loop, with
the prefix-cache hashes stored and evicted since the last report). Front ends ask the
scheduler for a ``Placement`` and then stream from the worker directly: the scheduler
is not on the per-token path. Refusals travel back as values, not exceptions, so a
front end can raise the right typed error without unwrapping Ray's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

#: The only worker role so far; ``prefill`` / ``decode`` arrive with disaggregation.
MIXED = "mixed"  # prefills and decodes its own requests
PREFILL = "prefill"  # computes prompts' KV blocks for decode workers (disaggregation)
DECODE = "decode"  # pulls a request's prompt blocks from a prefill worker, then decodes
ROLES = (MIXED, PREFILL, DECODE)


class WorkerStatus(str, enum.Enum):
    STARTING = "starting"  # created, engine loading, not registered yet
    HEALTHY = "healthy"  # registered and answering reports: placements go here
    UNHEALTHY = "unhealthy"  # missed reports or died; Ray may be restarting it
    DRAINING = "draining"  # no new placements; stopped once its requests finish


class ClusterError(RuntimeError):
    """A request the cluster could not serve. ``retriable``: the same request may
    succeed later (the cluster was full, or had no worker for a moment)."""

    retriable = False


class OverloadedError(ClusterError):
    """Refused at once: the global queue is full, or the request's queue deadline passed."""

    retriable = True


class DeadlineError(OverloadedError):
    """The request's deadline passed while it waited in the global queue."""


class NoWorkerError(ClusterError):
    """No healthy worker of the needed role is left to run (or resume) the request."""

    retriable = True


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker tells the scheduler when it (re)starts."""

    worker_id: str
    role: str
    incarnation: str  # new on every (re)start: the scheduler resets what it knew
    hash_keys: tuple[str, ...]  # model id and dtype: the extra keys of block hashes
    block_size: int
    total_blocks: int
    max_num_seqs: int
    max_model_len: int  # context length: prompt + max_tokens may not exceed it
    vocab_size: int
    node_id: str
    pid: int
    kv_address: str | None = None  # host:port of its KVTransfer server (prefill workers)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One report: the engine's load now and the prefix-cache changes since the last."""

    incarnation: str
    requests: int  # requests streaming from this worker
    running: int  # sequences in the batch
    waiting: int  # sequences queued in the engine (the batch or KV pool is full)
    free_blocks: int
    cached_blocks: int
    total_blocks: int
    kv_usage: float
    step_time: float  # seconds, recent moving average
    preemptions: int  # sequences preempted (KV pool full), ever
    prefix_queries: int  # prompt tokens looked up in the prefix cache, ever
    prefix_hits: int  # of them found cached
    generated_tokens: int
    # (stored?, block hash) in order; ``snapshot`` replaces the index instead.
    events: tuple[tuple[bool, bytes], ...] = ()
    snapshot: tuple[bytes, ...] | None = None
    # KV transfers (disaggregation), ever: pulled into this worker, and served from it
    kv_pulls: int = 0
    kv_blocks_received: int = 0
    kv_bytes_received: int = 0
    kv_transfer_seconds: float = 0.0
    kv_local_hits: int = 0  # disaggregated requests whose blocks were all here already
    kv_fallbacks: tuple[tuple[str, int], ...] = ()  # (reason, count): prefilled here instead
    kv_served: int = 0
    phases: tuple[tuple[str, int], ...] = ()  # disaggregated requests per phase, now
    # speculative decoding, ever: draft tokens proposed and accepted, verification steps
    # and the tokens they produced
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    spec_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs. ``worker`` is the worker actor's handle."""

    request_id: str
    worker_id: str
    incarnation: str
    worker: Any
    matched_blocks: int  # leading prompt blocks the worker holds (prefix affinity)
    prefill: Any = None  # disaggregated: the PrefillSource the worker pulls blocks from


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``place`` did not place; the front end raises ``error`` with ``message``."""

    error: type[ClusterError]
    message: str


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A worker as the scheduler sees it (a row of ``ClusterStats``)."""

    worker_id: str
    role: str
    status: WorkerStatus
    incarnation: str | None
    ongoing: int  # requests placed here and not released
    capacity: int  # most ongoing requests before new ones queue
    placed: int  # requests placed here since it (re)started
    restarts: int  # times it came back with a new incarnation
    cached_hashes: int  # block hashes in the scheduler's index for it
    load: WorkerLoad | None


@dataclass(frozen=True, slots=True)
class ClusterStats:
    workers: tuple[WorkerState, ...]
    queued: int  # requests waiting in the global queue
    placed: int
    refused: int
    failovers: int  # placements that resumed a request after its worker failed
    policy: str
    events: tuple[str, ...] = field(default=())  # recent scale-up/drain/restart events

    def worker(self, worker_id: str) -> WorkerState:
        return next(w for w in self.workers if w.worker_id == worker_id)
