"""The Ray actor that runs one worker: an engine, its step loop, and its streams.

The actor is asynchronous: ``AsyncEngine`` runs the step loop in the background (on
the engine's own thread, step after step), while the actor's event loop takes new
requests, aborts, load reports and health checks. The scheduler only decides where
requests go; deltas go straight from here to the front end that started the request.

**Channels.** A front end opens one delta channel to each worker it uses and starts
requests on it (``start``); the worker's end of the channels, over a Unix socket or a
Ray stream, is ``channel.DeltaChannels``, which this class inherits. ``abort`` ends one
request.

The actor is created with ``max_restarts``: after a crash Ray starts it again with the
same arguments, and it registers with the scheduler under a new incarnation (its
engine, cache and requests are new; callers of the old one fail over).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
import ray
import torch

from tessera.workers.api import (
    InvalidRequestError,
    LoraRef,
    Request,
    RequestOutput,
    SpeculativeStats,
)
from tessera.workers.config import EngineConfig
from tessera.workers.decoding.outputs import aborted_outputs
from tessera.workers.engine.async_engine import AsyncEngine
from tessera.workers.engine.engine import Engine, EngineStats
from tessera.workers.model.lora import LoraError, adapter_digest
from tessera.workers.process.channel import (
    ChannelClosedError,
    ChannelSocket,
    DeltaChannels,
    Outbox,
    Refusals,
)
from tessera.workers.process.disaggregation import (
    DecodeOrchestrator,
    KVTransferConfig,
    PhaseManager,
    PrefillOrchestrator,
)
from tessera.workers.process.kv_transfer import (
    KVTransferClient,
    KVTransferServer,
    PullGate,
    PullLimits,
)
from tessera.workers.process.protocol import (
    PREFILL,
    Accepted,
    EngineLoad,
    TransferCounters,
    WorkerInfo,
    WorkerLoad,
)

logger = logging.getLogger(__name__)

#: Unreported prefix-cache events kept before the worker sends a snapshot instead.
MAX_PENDING_EVENTS = 100_000


class WorkerActor(DeltaChannels):
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
        if self.engine.engine.group is not None:  # a rank lost: restart, streams fail over
            self.engine.engine.group.exit_on_failure = True
        self.engine.engine.kv.pool.record_events()
        self.engine.engine.grammars.prepare()
        self._live: set[str] = set()  # ids of the requests streaming from here
        self._channels: dict[str, Outbox] = {}  # open channels by the caller's id
        self._socket: asyncio.Future[ChannelSocket | None] | None = None  # channel_socket
        self._socket_server: asyncio.AbstractServer | None = None
        self._refused = Refusals(worker_id)  # logs the socket's refused callers
        self._last_active = time.monotonic()  # when a stream last ended, or a report saw work
        self.kv_config = kv_transfer or KVTransferConfig()
        self.transfers = TransferCounters()
        self.phases = PhaseManager(worker_id)
        self._pulls: dict[str, asyncio.Task] = {}  # decode worker: KV pulls under way
        self._aborted_pulls: set[str] = set()  # aborted before they reached the engine
        self.prefill = PrefillOrchestrator(self.engine, self.transfers)
        client = KVTransferClient(
            self.kv_config.tls,
            secret=self.kv_config.secret,
            tls_server_name=self.kv_config.tls_server_name,
        )
        self.decode = DecodeOrchestrator(
            self.engine,
            client,
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

    def tensor_parallel_ranks(self) -> list:
        """The Ray actors of its group's ranks 1..N-1 (none unless it is a group)."""
        group = self.engine.engine.group
        return [] if group is None else list(group.ranks)

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
            hidden_size=engine.model_config.hidden_size,
            ranks=() if engine.group is None else engine.group.places,
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
            config, engine = self.kv_config, self.engine.engine
            host = config.host or ray.util.get_node_ip_address()
            secret = config.secret
            limits = PullLimits(
                max_concurrent_pulls=config.max_concurrent_pulls,
                # no prompt this engine takes has more
                max_blocks_per_pull=-(-engine.max_model_len // engine.config.block_size),
                timeout_s=config.timeout_s,
            )
            server = KVTransferServer(
                self.prefill.handle,
                host,
                config.port,
                config.tls,
                gate=None if secret is None else PullGate(self.worker_id, secret),
                limits=limits,
            )
            await server.start()
            self.kv_server = server
            logger.info("worker %s serves KV transfers on %s", self.worker_id, self._kv_address())

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
                await self.engine.prepare_lora(request.lora)
                self.phases.enter(request_id, "waiting")
                resumed = request.resume is not None
                pull = asyncio.ensure_future(
                    self.decode.pull(
                        request_id,
                        token_ids,
                        sampling,
                        request.cache_salt,
                        prefill,
                        resumed,
                        request.lora,
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

    async def read_lora(self, name: str, path: str) -> LoraRef:
        """Read and check the adapter in folder ``path`` (kept for the requests that
        will use it); its ``LoraRef``, or ``InvalidRequestError`` saying what is wrong."""

        def read() -> LoraRef:
            try:
                digest = adapter_digest(path)
            except LoraError as error:
                raise InvalidRequestError("lora_path", str(error)) from None
            ref = LoraRef(name, os.path.abspath(path), digest)
            self.engine.engine.prepare_lora(ref)
            return ref

        return await asyncio.get_running_loop().run_in_executor(None, read)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Each input's embedding (``Engine.embed``), float32 numpy ``[len(inputs),
        hidden]``: a forward at a time on the engine thread, each between two steps
        (``AsyncEngine.embed``); ``InvalidRequestError`` naming the input at fault."""
        self._last_active = time.monotonic()
        vectors = await self.engine.embed(inputs)
        return vectors.numpy()

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
        loras=stats.loras,
        steps=stats.steps,
        step_seconds=stats.step_seconds,
        host_seconds=stats.host_seconds,
        decode_steps=stats.decode_steps,
        decode_seconds=stats.decode_seconds,
        itl_counts=stats.itl_counts,
        itl_seconds=stats.itl_seconds,
    )


def worker_actor_class():
    """The Ray remote class (made on demand, so importing this module needs no Ray)."""
    return ray.remote(WorkerActor)
