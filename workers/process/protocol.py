"""The typed seam between a worker and those above it: the scheduler and the front end.

A worker tells the scheduler who it is (``WorkerInfo``, again after every restart) and
how loaded it is (``WorkerLoad``, pulled by the scheduler's monitor loop, with the
prefix-cache hashes stored and evicted since the last report). A decode worker is told
where to pull a request's prompt blocks from (``PrefillSource``). A front end opens
one delta channel per worker and starts requests on it (``WorkerActor.start`` answers
``Accepted``); the channel carries the deltas of all its requests together, in
batches of ``(request id, item)`` (one every ``stream_interval`` engine steps, or at
once for a request's first or last delta, its end or a failure): a ``RequestOutput``,
a ``StreamFailure``, or ``END``. A front end on the worker's own node reads the
batches from the worker's Unix socket (``ChannelSocket``, ``read_frame``), any other
as a Ray stream (``WorkerActor.deltas``).

Everything here crosses a process boundary (Ray pickles it, and so does a channel
socket), so it is plain data, and this module imports nothing heavy (no torch, no
Ray): the front end and the scheduler name a worker's types without loading the
engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import socket
import struct
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
    # counters (``EngineStats``): steps that ran a batch, ever; seconds in them; of
    # those, outside the forward; the steps of decodes only and their seconds. Over an
    # interval, seconds / steps is a mean step time
    steps: int = 0
    step_seconds: float = 0.0
    host_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0


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


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """A request's stream failed on its worker after it started (an engine step
    raised): the last item of that request on its channel."""

    message: str


#: The item that ends one request's deltas on a channel (all its outputs finished).
END = None
#: A worker closes a channel its caller has not touched for this long (Ray does not end
#: a stream whose caller died), which aborts the requests on it; callers touch their
#: channels three times as often.
CHANNEL_KEEPALIVE_S = 30.0


@dataclass(frozen=True, slots=True)
class ChannelSocket:
    """Where a front end on the worker's node opens channels without Ray
    (``WorkerActor.channel_socket``): a Unix socket in Linux's abstract namespace (no
    file; gone with the worker's process). The caller checks that the process it
    reached is ``pid`` (``peer_credentials``), then writes one line, the JSON of
    ``{"channel": id, "keepalive_s": s, "token": token}``; the worker, having checked
    that the caller runs as its own user, answers with the channel's batches, each a
    ``frame``, the first one empty (the channel is open). Either side closing the
    connection ends the channel. A Ray stream item costs each side 1.3-1.6 ms of CPU,
    an asyncio TCP stream's message 0.2-0.4 ms (stop 72's micro-benchmark)."""

    node_id: str  # Ray's node id: other nodes use the Ray stream
    path: str
    pid: int  # the worker's process
    token: str = field(repr=False)  # the worker's secret: a caller learns it through Ray


#: A frame's header: the byte length of the pickled batch that follows.
FRAME_HEADER = 4


def frame(batch: list) -> bytes:
    """One batch as a frame: its pickle's length (4 bytes, big-endian), then the pickle."""
    data = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(FRAME_HEADER, "big") + data


def peer_credentials(sock) -> tuple[int, int, int]:
    """The (pid, uid, gid) of the process at the other end of a Unix socket."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    pid, uid, gid = struct.unpack("iII", credentials)  # struct ucred: pid_t, uid_t, gid_t
    return pid, uid, gid


async def read_frame(reader: asyncio.StreamReader) -> list:
    """The next batch; ``asyncio.IncompleteReadError`` once the worker has closed."""
    size = int.from_bytes(await reader.readexactly(FRAME_HEADER), "big")
    return pickle.loads(await reader.readexactly(size))
