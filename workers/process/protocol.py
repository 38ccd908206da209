"""The typed seam between a worker and the scheduler.

A worker tells the scheduler who it is (``WorkerInfo``, again after every restart) and
how loaded it is (``WorkerLoad``, pulled by the scheduler's monitor loop, with the
prefix-cache hashes stored and evicted since the last report). A front end starts a
request on a worker (``WorkerActor.start`` answers ``Accepted``) and reads its deltas
from the worker's delta channel (``channel``: its wire, and the worker's end;
``channel_reader``: the caller's).

Everything here crosses a process boundary (Ray pickles it), so it is plain data, and
this module imports nothing heavy (no torch, no Ray): the front end and the scheduler
name a worker's types without loading the engine.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from tessera.workers.api import SpeculativeStats
from tessera.workers.kv.prefix_cache import PrefixCacheStats

# A worker's role: which part of a request's life it runs.
MIXED = "mixed"  # prefills and decodes its own requests
PREFILL = "prefill"  # computes prompts' KV blocks for decode workers (disaggregation)
DECODE = "decode"  # pulls a request's prompt blocks from a prefill worker, then decodes
ROLES = (MIXED, PREFILL, DECODE)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker tells the scheduler when it (re)starts."""

    worker_id: str
    role: str
    incarnation: str  # new on every (re)start: the scheduler resets what it knew
    hash_keys: tuple[str, ...]  # model id, precision (and bf16 kernel path): block hash keys
    block_size: int
    total_blocks: int
    max_num_seqs: int
    max_model_len: int  # context length: prompt + max_tokens may not exceed it
    vocab_size: int
    node_id: str
    pid: int
    kv_address: str | None = None  # host:port of its KVTransfer server (prefill workers)
    precision: str = "float32"  # LoadedModel.precision: "fast", or the dtype's name
    hidden_size: int | None = None  # the model's: the dimensions of its embeddings
    #: a tensor-parallel group's ranks, rank 0 first: each one's device and node IP
    ranks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's figures in a report: its batch and KV pool now, its counters ever."""

    running: int  # sequences in the batch
    waiting: int  # sequences queued in the engine (the batch or KV pool is full)
    free_blocks: int
    total_blocks: int
    kv_usage: float
    step_time: float  # seconds, recent moving average
    preemptions: int  # sequences preempted (KV pool full), ever
    generated_tokens: int
    prefix_cache: PrefixCacheStats  # prompt tokens looked up and found, cached blocks
    speculation: SpeculativeStats  # draft tokens proposed and accepted, verification steps
    # prompt tokens of its sequences not computed yet (waiting or partly prefilled): a
    # prefill worker's queue, which its pool scales by
    queued_prompt_tokens: int = 0
    loras: tuple[str, ...] = ()  # the digests of the LoRA adapters in its slots
    # counters (``EngineStats``): steps that ran a batch, ever; seconds in them; of
    # those, outside the forward; the steps of decodes only and their seconds. Over an
    # interval, seconds / steps is a mean step time
    steps: int = 0
    step_seconds: float = 0.0
    host_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    # inter-token latency (``EngineStats.itl_counts``, ``itl_seconds``): sequences per
    # bucket of ``INTER_TOKEN_LATENCY_BUCKETS`` and their seconds, ever
    itl_counts: tuple[int, ...] = ()
    itl_seconds: float = 0.0


@dataclass(slots=True)
class TransferCounters:
    """A worker's KV transfers so far (disaggregation; as receiver: pulls, as sender:
    served). The worker counts into one instance; a report carries a ``snapshot``."""

    pulls: int = 0  # transfers completed into this worker
    resumed_pulls: int = 0  # of them, for requests resumed after a failover
    blocks_received: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # total time of completed pulls
    local_hits: int = 0  # requests whose blocks were all here already (nothing pulled)
    fallbacks: Counter[str] = field(default_factory=Counter)  # reason -> count: prefilled here
    served: int = 0  # prefills served to other workers

    def snapshot(self) -> TransferCounters:
        """A copy that later counting does not change."""
        return dataclasses.replace(self, fallbacks=Counter(self.fallbacks))


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One report: the worker's load now and the prefix-cache changes since the last."""

    incarnation: str
    requests: int  # requests streaming from this worker
    engine: EngineLoad
    # the ids those requests run under here (a restarted scheduler recounts from them)
    request_ids: tuple[str, ...] = ()
    transfers: TransferCounters = field(default_factory=TransferCounters)
    phases: tuple[tuple[str, int], ...] = ()  # disaggregated requests per phase, now
    # seconds since the worker last had work of its own (a stream, a sequence in its
    # engine, a prefill it served); None while it has some. A prefill worker is never
    # placed on, so this is how the scheduler knows it is idle.
    idle_s: float | None = None
    # (stored?, block hash) in order; ``snapshot`` replaces the index instead.
    events: tuple[tuple[bool, bytes], ...] = ()
    snapshot: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class Accepted:
    """What ``start`` returns: the engine took the request (a bad request raises
    instead), so the caller knows where errors come from."""

    request_id: str
    incarnation: str
