"""The Ray actor that runs one worker: an engine, its step loop, and its streams.

The actor is asynchronous: ``AsyncEngine`` runs the step loop in the background (on
the engine's own thread, step after step), while the actor's event loop takes new
requests, aborts, load reports and health checks. The scheduler only decides where
requests go; deltas go straight from here to the front end that started the request.

**Channels.** A front end opens one channel to each worker it uses and starts requests
on it (``start``): over the worker's Unix socket when it runs on the worker's node
(``channel_socket``), else as a Ray streaming generator (``deltas``). Every item of the
channel is a batch: the ``(request id, item)`` pairs that came since the last one, sent
every ``stream_interval`` engine steps or at once for a request's first delta, last
delta or failure (``_Channel``), whatever the number of requests (one Ray stream item
costs a millisecond or more of CPU on each side, a socket's frame a fraction; one
per token per request was most of the front end's cost). A channel that ends (its
caller closed or cancelled it, or stopped touching it: Ray does not end a stream whose
caller died) aborts every request it still carries: their blocks go back at once.
``abort`` ends one request.

The actor is created with ``max_restarts``: after a crash Ray starts it again with the
same arguments, and it registers with the scheduler under a new incarnation (its
engine, cache and requests are new; callers of the old one fail over).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator

import ray
import torch

from tessera.workers.api import Request, RequestOutput, SpeculativeStats
from tessera.workers.config import EngineConfig
from tessera.workers.decoding.outputs import aborted_outputs
from tessera.workers.engine.async_engine import AsyncEngine
from tessera.workers.engine.engine import Engine, EngineStats
from tessera.workers.process.disaggregation import (
    DecodeOrchestrator,
    KVTransferConfig,
    PhaseManager,
    PrefillOrchestrator,
)
from tessera.workers.process.kv_transfer import KVTransferClient, KVTransferServer
from tessera.workers.process.protocol import (
    CHANNEL_KEEPALIVE_S,
    END,
    PREFILL,
    Accepted,
    ChannelSocket,
    EngineLoad,
    StreamFailure,
    TransferCounters,
    WorkerInfo,
    WorkerLoad,
    frame,
    peer_credentials,
)

logger = logging.getLogger(__name__)

#: Unreported prefix-cache events kept before the worker sends a snapshot instead.
MAX_PENDING_EVENTS = 100_000

#: Seconds a channel holds items while no new item comes for it (its requests' engine
#: not stepping, waiting for free blocks say) before it sends them anyway.
HOLD_S = 0.5
#: Seconds a caller of the channel socket has to send its line.
SOCKET_HELLO_S = 10.0
#: Seconds between two warnings of refused channel-socket callers (the rest are counted).
REFUSAL_WARNING_S = 60.0


class ChannelClosedError(RuntimeError):
    """``start`` named a channel this worker does not have open (never opened, or
    ended: cancelled, or not touched for its keepalive). The request fails at once,
    with this message, and nothing of it runs; the caller's reader sees the channel
    end, and its next request opens a new one."""


class _Refusals:
    """The log of a worker's refused channel-socket callers: a warning at most once every
    ``REFUSAL_WARNING_S``, which counts those refused since the last one; the others at
    debug level. So a local caller that connects over and over cannot flood the log.
    ``reason`` is a %-format literal (never a caller's text); its values go in ``args``."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.warned = -REFUSAL_WARNING_S  # when the last warning was logged (monotonic)
        self.unwarned = 0  # refusals since then

    def __call__(self, reason: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.warned < REFUSAL_WARNING_S:
            self.unwarned += 1
            logger.debug(
                "worker %s refused a channel socket caller " + reason, self.worker_id, *args
            )
            return
        since = f" ({self.unwarned} more refused since the last warning)" if self.unwarned else ""
        logger.warning(
            "worker %s refused a channel socket caller " + reason + since, self.worker_id, *args
        )
        self.warned, self.unwarned = now, 0


class _Channel:
    """One caller's open channel: the items not yet sent, and the requests on it.

    Items wait for a batch until one of them is urgent (a request's first delta, a
    finished one, its end or its failure: put at once) or ``interval`` engine steps have
    passed since the last batch (``stream_interval``; a step of a request with several
    outputs, parallel tokens or drafts carries several of its tokens). So every
    request's tokens of those steps travel together, in one batch for all of them
    rather than one at each request's own turn: a batch (a Ray item, or a socket's
    frame) costs each side a fixed amount of CPU."""

    def __init__(self, keepalive_s: float, interval: int = 1) -> None:
        self.pending: list[tuple[str, RequestOutput | StreamFailure | None]] = []
        self.urgent = False
        self.ready = asyncio.Event()
        self.forwards: dict[str, asyncio.Task] = {}  # request id -> its forwarding task
        self.keepalive_s = keepalive_s
        self.interval = interval
        self.sent_step = 0  # the engine's step count at the last batch
        self.touched = time.monotonic()

    def put(
        self, request_id: str, *items: RequestOutput | StreamFailure | None, urgent: bool = True
    ) -> None:
        self.pending.extend((request_id, item) for item in items)
        self.urgent |= urgent
        self.ready.set()

    def due(self, step: int) -> bool:
        """Whether a batch goes now, the engine having run ``step`` steps so far (with
        ``interval`` 1, whenever anything is held)."""
        return bool(self.pending) and (
            self.urgent or self.interval <= 1 or step - self.sent_step >= self.interval
        )

    def take(self, step: int) -> list[tuple[str, RequestOutput | StreamFailure | None]]:
        """What is held, as a batch sent at the engine's ``step``."""
        batch, self.pending = self.pending, []
        self.urgent = False
        self.sent_step = step
        self.ready.clear()
        return batch


class WorkerActor:
    """One engine as a Ray actor. Use ``worker_actor_class()`` to get the remote class."""

    def __init__(
        self,
        worker_id: str,
        role: str,
        engine_config: EngineConfig,
        scheduler_name: str | None = None,
        namespace: str | None = None,
        num_threads: int | None = None,
        kv_transfer: KVTransferConfig | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.worker_id = worker_id
        self.role = role
        self.incarnation = uuid.uuid4().hex[:12]
        # built on the engine's own thread, where its steps run (see async_engine)
        self.engine = AsyncEngine.build(lambda: Engine(engine_config))
        self.engine.engine.kv.pool.record_events()
        self._live: set[str] = set()  # ids of the requests streaming from here
        self._channels: dict[str, _Channel] = {}  # open channels by the caller's id
        self._socket: asyncio.Future[ChannelSocket | None] | None = None  # channel_socket
        self._socket_server: asyncio.AbstractServer | None = None
        self._refused = _Refusals(worker_id)  # logs the socket's refused callers
        self._last_active = time.monotonic()  # when a stream last ended, or a report saw work
        self.kv_config = kv_transfer or KVTransferConfig()
        self.transfers = TransferCounters()
        self.phases = PhaseManager(worker_id)
        self._pulls: dict[str, asyncio.Task] = {}  # decode worker: KV pulls under way
        self._aborted_pulls: set[str] = set()  # aborted before they reached the engine
        self.prefill = PrefillOrchestrator(self.engine, self.transfers)
        self.decode = DecodeOrchestrator(
            self.engine,
            KVTransferClient(self.kv_config.tls),
            self.transfers,
            self.phases,
            self.kv_config.timeout_s,
        )
        self.kv_server: KVTransferServer | None = None  # prefill workers, started on demand
        logger.info("worker %s (%s) up as %s", worker_id, role, self.incarnation)
        if scheduler_name is not None:  # tell the scheduler at once (it also polls)
            try:
                scheduler = ray.get_actor(scheduler_name, namespace=namespace)
            except ValueError:  # it is restarting: its new incarnation polls this worker
                return
            scheduler.register.remote(self.info())

    def info(self) -> WorkerInfo:
        engine = self.engine.engine
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            incarnation=self.incarnation,
            hash_keys=engine.hash_keys,
            block_size=engine.config.block_size,
            total_blocks=engine.kv.pool.num_blocks,
            max_num_seqs=engine.config.max_num_seqs,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            kv_address=self._kv_address(),
            precision=engine.loaded.precision,
        )

    def _kv_address(self) -> str | None:
        """Where decode workers reach this worker's KV-transfer server: bound to every
        interface (in a pod), it is reached at this node's IP."""
        if self.kv_server is None:
            return None
        host, port = self.kv_server.address.rsplit(":", 1)
        if host in ("0.0.0.0", "[::]"):
            host = ray.util.get_node_ip_address()
        return f"{host}:{port}"

    async def _ensure_kv_server(self) -> None:
        """A prefill worker serves ``KVTransfer`` (started in the actor's event loop, at
        its first report; the address reaches the scheduler with that report)."""
        if self.role == PREFILL and self.kv_server is None:
            host = self.kv_config.host or ray.util.get_node_ip_address()
            server = KVTransferServer(
                self.prefill.handle, host, self.kv_config.port, self.kv_config.tls
            )
            await server.start()
            self.kv_server = server
            logger.info("worker %s serves KV transfers on %s", self.worker_id, self._kv_address())

    async def deltas(
        self, channel_id: str, keepalive_s: float = CHANNEL_KEEPALIVE_S
    ) -> AsyncIterator[list]:
        """Open channel ``channel_id`` as a Ray stream of its batches (``_batches``)."""
        async with contextlib.aclosing(self._batches(channel_id, keepalive_s)) as batches:
            async for batch in batches:
                yield batch

    async def channel_socket(self) -> ChannelSocket | None:
        """Where a caller on this worker's node opens channels without Ray (a Unix
        socket, started at the first call); None where there is none (not Linux, or
        the worker is shutting down)."""
        if self._socket is None:
            self._socket = asyncio.ensure_future(self._start_socket())
        return await asyncio.shield(self._socket)

    async def _start_socket(self) -> ChannelSocket | None:
        if sys.platform != "linux":  # abstract Unix sockets are Linux's
            return None
        path = f"\0tessera-{self.incarnation}-{secrets.token_hex(4)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            node_id = ray.get_runtime_context().get_node_id()
            sock.bind(path)  # bound here: uvloop refuses an abstract socket's path
            self._socket_server = await asyncio.start_unix_server(self._serve_socket, sock=sock)
        except Exception as error:  # the Ray stream still works
            sock.close()
            logger.warning("worker %s: no channel socket (%r): Ray streams", self.worker_id, error)
            return None
        return ChannelSocket(node_id, path, os.getpid(), secrets.token_hex(16))

    async def _serve_socket(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One channel on this worker's socket (``ChannelSocket``): the caller's line,
        then the channel's batches as frames, until either side closes it. A caller
        of another user, without the token, or with a bad line, is hung up on (and
        logged, ``_Refusals``); one that stops reading for ``keepalive_s`` is gone."""
        tasks: list[asyncio.Future] = []
        pid = None  # the caller's process, once known
        try:
            address = await asyncio.shield(self._socket)
            if address is None:  # shutting down
                return
            pid, uid, _ = peer_credentials(writer.get_extra_info("socket"))
            if uid != os.getuid():
                self._refused("of another user (uid %d, process %d)", uid, pid)
                return
            hello = json.loads(await asyncio.wait_for(reader.readline(), SOCKET_HELLO_S))
            if not hmac.compare_digest(str(hello["token"]), address.token):
                self._refused("with a wrong token (process %d)", pid)
                return
            channel_id, keepalive_s = str(hello["channel"]), float(hello["keepalive_s"])
            batches = self._batches(channel_id, keepalive_s)

            async def send() -> None:
                async with contextlib.aclosing(batches):
                    async for batch in batches:
                        writer.write(frame(batch))
                        await asyncio.wait_for(writer.drain(), keepalive_s)

            tasks = [asyncio.ensure_future(send()), asyncio.ensure_future(reader.read(1))]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # b"": it closed
            sent = tasks[0]
            if sent.done() and not sent.cancelled() and sent.exception() is not None:
                error = sent.exception()
                level = logging.DEBUG if isinstance(error, ConnectionError) else logging.WARNING
                logger.log(level, "worker %s: channel %s: %r", self.worker_id, channel_id, error)
        except Exception as error:  # a bad or broken hello: nothing was opened
            self._refused("whose line failed or never came (process %s): %r", pid, error)
        finally:
            for task in tasks:
                task.cancel()  # ends the channel: its requests are aborted
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.transport.abort()  # at once, whatever is unsent

    async def _batches(self, channel_id: str, keepalive_s: float) -> AsyncIterator[list]:
        """Open channel ``channel_id``: yield an empty batch at once (it is open), then
        the batches of ``(request id, item)`` its requests produce (``_Channel``: at
        once for an urgent item, else every ``stream_interval`` engine steps, or once
        no new item has come for ``HOLD_S``), until the caller closes it, or stops
        calling ``touch`` for ``keepalive_s``; that aborts the requests still on it."""
        if channel_id in self._channels:
            raise ValueError(f"channel {channel_id!r} is already open")
        engine = self.engine.engine
        channel = _Channel(keepalive_s, engine.config.stream_interval)
        channel.sent_step = engine.num_steps
        self._channels[channel_id] = channel
        try:
            yield []
            while True:
                with contextlib.suppress(TimeoutError):
                    wait = HOLD_S if channel.pending else keepalive_s
                    await asyncio.wait_for(channel.ready.wait(), wait)
                if time.monotonic() - channel.touched > keepalive_s:
                    logger.warning(
                        "channel %s was not touched for %g s: its caller is gone; aborting "
                        "its %d requests",
                        channel_id,
                        keepalive_s,
                        len(channel.forwards),
                    )
                    return
                stalled = not channel.ready.is_set()  # no item came for HOLD_S
                step = engine.num_steps
                if channel.due(step) or (channel.pending and stalled):
                    yield channel.take(step)
                else:
                    channel.ready.clear()
        finally:
            del self._channels[channel_id]
            for forward in list(channel.forwards.values()):
                forward.cancel()  # closes the request's stream, which aborts it

    async def touch(self, channel_id: str) -> bool:
        """The caller of channel ``channel_id`` is alive; False if it is not open."""
        channel = self._channels.get(channel_id)
        if channel is not None:
            channel.touched = time.monotonic()
        return channel is not None

    async def start(self, channel_id: str, request: Request) -> Accepted:
        """Start ``request`` (its prompt as token ids, built by the front end) with its
        deltas going out on channel ``channel_id`` (then ``END``); return once the engine
        has it. ``InvalidRequestError`` raises instead, and ``ChannelClosedError`` if the
        channel is not open."""
        channel = self._channels.get(channel_id)
        if channel is None:
            raise ChannelClosedError(f"channel {channel_id!r} is not open on this worker")
        request_id = request.request_id
        stream = self._generate(request)
        try:
            accepted = await anext(stream)
        except BaseException:
            await stream.aclose()
            raise
        if self._channels.get(channel_id) is not channel:  # it ended meanwhile
            await stream.aclose()
            raise ChannelClosedError(f"channel {channel_id!r} closed")
        channel.forwards[request_id] = asyncio.get_running_loop().create_task(
            self._forward(stream, channel, request_id)
        )
        return accepted

    @staticmethod
    async def _forward(
        stream: AsyncIterator[RequestOutput], channel: _Channel, request_id: str
    ) -> None:
        """Put the request's deltas on its channel, then ``END``: its first delta, a
        finished one, the end and a failure as urgent (they go at once, with what the
        channel holds), the rest to wait for the channel's next batch."""
        sent = False
        try:
            async for delta in stream:
                channel.put(request_id, delta, urgent=not sent or delta.finished)
                sent = True
            channel.put(request_id, END)
        except Exception as error:  # an engine step failed: the caller's stream raises
            channel.put(request_id, StreamFailure(f"{type(error).__name__}: {error}"))
        finally:
            await stream.aclose()  # aborts the request if it is not over (cancelled)
            channel.forwards.pop(request_id, None)

    async def _generate(self, request: Request) -> AsyncIterator[Accepted | RequestOutput]:
        """Yield ``Accepted``, then the request's deltas until all its outputs finish.
        ``InvalidRequestError`` raises before ``Accepted``. With ``prefill`` (a decode
        worker), the prompt's blocks are pulled from that prefill worker first, also
        for a request resumed after a failover (``resume``): it then recomputes only
        what the pulled blocks do not cover (the prompt's tail and the tokens it had
        generated), and its output is the same."""
        request_id, sampling, prefill = request.request_id, request.sampling, request.prefill
        self._live.add(request_id)
        stream = None
        # A structured request prefills here (its first token is masked here), and so
        # does one that asks for prompt logprobs (they come from the prefill).
        disaggregated = (
            prefill is not None and sampling.structured is None and sampling.prompt_logprobs is None
        )
        try:
            if disaggregated:
                token_ids = request.prompt_token_ids
                self.engine.engine.validate(token_ids, sampling, request.resume)
                self.phases.enter(request_id, "waiting")
                resumed = request.resume is not None
                pull = asyncio.ensure_future(
                    self.decode.pull(
                        request_id, token_ids, sampling, request.cache_salt, prefill, resumed
                    )
                )
                self._pulls[request_id] = pull
                try:
                    await pull
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # the caller went away, not an abort
                finally:
                    self._pulls.pop(request_id, None)
                if request_id in self._aborted_pulls:  # a cancelled pull gave its blocks back
                    self._aborted_pulls.discard(request_id)
                    yield Accepted(request_id, self.incarnation)
                    for delta in aborted_outputs(request):
                        yield delta
                    return
            stream = await self.engine.submit(request)
            yield Accepted(request_id, self.incarnation)
            async for delta in stream:
                yield delta
        finally:
            self._live.discard(request_id)
            self._last_active = time.monotonic()
            self._aborted_pulls.discard(request_id)
            if disaggregated and request_id in self.phases.phases:
                self.phases.enter(request_id, "finished")
            if stream is not None:
                await stream.aclose()  # aborts the request if it is not over

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with ``finish_reason`` abort (also while its
        KV blocks are still being pulled: the pull is cancelled)."""
        pull = self._pulls.get(request_id)
        if pull is not None:
            self._aborted_pulls.add(request_id)
            pull.cancel()
        self.engine.abort(request_id)

    async def report(self, resync: bool = False) -> tuple[WorkerInfo, WorkerLoad]:
        """Who this worker is and its load now, with the prefix-cache events since the
        last report. ``resync`` (the scheduler lost a report), or too many unreported
        events, sends the whole index as a snapshot instead."""
        await self._ensure_kv_server()
        engine = self.engine.engine
        pool = engine.kv.pool
        stats = engine.stats()
        snapshot = None
        events = tuple(pool.drain_events())
        if resync or len(events) > MAX_PENDING_EVENTS:
            snapshot, events = tuple(pool.cached), ()
        load = WorkerLoad(
            incarnation=self.incarnation,
            requests=len(self._live),
            request_ids=tuple(sorted(self._live)),
            engine=engine_load(stats, uncomputed_prompt_tokens(engine)),
            transfers=self.transfers.snapshot(),
            phases=tuple(sorted(self.phases.counts().items())),
            idle_s=self._idle_s(stats),
            events=events,
            snapshot=snapshot,
        )
        return self.info(), load

    def _idle_s(self, stats: EngineStats) -> float | None:
        """Seconds since this worker last had work (streams, engine sequences, pulls it
        serves); None while it has some."""
        now = time.monotonic()
        if self._live or stats.running or stats.waiting or self.prefill.active:
            self._last_active = now
            return None
        return now - max(self._last_active, self.prefill.last_active)

    async def health(self) -> str:
        return self.incarnation

    async def engine_stats(self):
        return self.engine.stats()

    async def has_request(self, request_id: str) -> bool:
        return request_id in self.engine.engine.groups

    async def check_integrity(self) -> None:
        await self.engine.run(self.engine.engine.check_integrity)  # between two steps

    async def inject_kv_fault(self, kind: str, count: int = 1) -> None:
        """Test hook: spoil this prefill worker's next ``count`` transfers (``corrupt``
        a chunk, ``cut`` the stream, ``stall`` past the deadline)."""
        await self._ensure_kv_server()
        self.kv_server.inject_fault(kind, count)

    async def shutdown(self) -> None:
        starting, self._socket = self._socket, asyncio.get_running_loop().create_future()
        self._socket.set_result(None)  # no new socket channels here
        if starting is not None:  # a socket still starting is closed below, once it is up
            await asyncio.wait([starting])  # (never cancels it: channel_socket awaits it too)
        if self._socket_server is not None:
            self._socket_server.close()
        if self.kv_server is not None:
            await self.kv_server.stop(grace=None)
        await self.decode.client.close()
        await self.engine.close()


def uncomputed_prompt_tokens(engine: Engine) -> int:
    """Prompt tokens of the engine's sequences not computed yet: per sequence, not per
    token (``list`` copies under the GIL, as ``Engine.stats`` reads while a step runs)."""
    seqs = (seq for group in list(engine.groups.values()) for seq in list(group.seqs))
    return sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in seqs)


def engine_load(stats: EngineStats, queued_prompt_tokens: int = 0) -> EngineLoad:
    """The part of the engine's stats a load report carries, with its prompt tokens not
    computed yet (``queued_prompt_tokens``)."""
    return EngineLoad(
        running=stats.running,
        waiting=stats.waiting,
        free_blocks=stats.free_blocks,
        total_blocks=stats.total_blocks,
        kv_usage=stats.kv_usage,
        step_time=stats.recent_step_time,
        preemptions=stats.preemptions,
        generated_tokens=stats.generated_tokens,
        prefix_cache=stats.prefix_cache,
        speculation=SpeculativeStats(
            stats.spec_proposed, stats.spec_accepted, stats.spec_steps, stats.spec_tokens
        ),
        queued_prompt_tokens=queued_prompt_tokens,
        steps=stats.steps,
        step_seconds=stats.step_seconds,
        host_seconds=stats.host_seconds,
        decode_steps=stats.decode_steps,
        decode_seconds=stats.decode_seconds,
    )


def worker_actor_class():
    """The Ray remote class (made on demand, so importing this module needs no Ray)."""
    return ray.remote(WorkerActor)
