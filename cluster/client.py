"""The front ends' way into the cluster: ``submit``, ``abort``, ``stats``.

``submit`` tokenizes the prompt, asks the scheduler for a placement, starts the
request on that worker and returns an async stream of ``RequestOutput`` deltas that
come straight from the worker. It returns once the worker has accepted the request,
so a bad request, a full queue (``OverloadedError``) or an empty cluster
(``NoWorkerError``) raise from ``submit`` itself.

**Channels.** The client keeps one delta channel per worker it uses (a
``ChannelReader``, opened at its first request there): the deltas of all this
client's requests on that worker arrive together, one batch every ``stream_interval``
engine steps (or at once for a request's first or last delta), over the worker's Unix
socket where it runs on this client's node, else as a Ray stream, and are routed here
to their requests. A channel that fails (the worker died) fails over every request
on it.

**Failover.** If the worker dies mid-stream, the stream asks the scheduler for a new
worker and goes on there from the tokens already delivered: a request with one
output resumes (``Resume``: the new worker recomputes prompt + delivered tokens and
samples on, keyed by (seed, token index)); a request with ``n`` streamed outputs
resumes each unfinished output as its own one-output request with that output's
seed; beam search and ``best_of`` (whose outputs arrive whole at the end) start
again. The caller sees no duplicated and no missing text. After a failover a
resumed ``n > 1`` output reports no ``cumulative_logprob``.

**Abort.** Leaving the stream (``aclose``, cancellation, or ``break`` once the
generator is closed) aborts the request on its worker, which frees its blocks at
once; ``abort(request_id)`` ends it with ``finish_reason`` abort.

A request's deltas are read from its channel in the background from ``submit`` on,
so its place in the cluster is released as soon as the worker has finished it,
however late the caller reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import ray

from tessera.cluster.request_run import RELEASE_WAIT_S, RequestRun, Timings
from tessera.scheduler.api import ClusterStats, OverloadedError, Placement, Refusal
from tessera.workers.api import (
    EmbeddingCapacityError,
    InvalidRequestError,
    LoraRef,
    Request,
    RequestOutput,
    SamplingParams,
)
from tessera.workers.kv.prefix_cache import extend_block_hashes
from tessera.workers.process.channel_reader import (
    ChannelReader,
)
from tessera.workers.process.protocol import MIXED

logger = logging.getLogger(__name__)

_UNKNOWN = object()


def _sampling(sampling: SamplingParams | None) -> SamplingParams:
    if sampling is None:
        return SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(
            "sampling", f"must be a SamplingParams, got {type(sampling).__name__}"
        )
    return sampling


class RequestStream:
    """One request's deltas (``async for``). ``aclose()`` aborts the request on its
    worker and frees its place, whether or not any delta was read (an async generator
    never started would skip its ``finally``)."""

    def __init__(self, run: RequestRun) -> None:
        self._run = run
        self._deltas = run.stream()

    def __aiter__(self) -> RequestStream:
        return self

    @property
    def timings(self) -> Timings:
        """When it was submitted, placed, accepted and its first token came."""
        return self._run.timings

    @property
    def placement(self) -> Placement | None:
        """Where it runs, or last ran (None before it was placed)."""
        return self._run.placement

    async def __anext__(self) -> RequestOutput:
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        await self._deltas.aclose()
        await self._run.stop()


class ClusterClient:
    """Submit requests to a running cluster. Use ``Cluster.start`` or ``connect``."""

    def __init__(self, scheduler, tokenizer, channel_sockets: bool = True) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        #: read channels from the sockets of workers on this node (else Ray streams)
        self.channel_sockets = channel_sockets
        self._runs: dict[str, RequestRun] = {}
        self.id = uuid.uuid4().hex[:12]  # names this client's channels on the workers
        self._channels: dict[tuple[str, str], ChannelReader] = {}  # by (worker id, incarnation)
        # the scheduler's block_hashing(): unknown until asked, then kept once the
        # hash keys are known (or prefix caching is off)
        self._hashing: tuple[int, tuple[str, ...] | None] | None | object = _UNKNOWN

    @classmethod
    def connect(
        cls, scheduler_name: str = "tessera-scheduler", namespace: str = "tessera"
    ) -> ClusterClient:
        """A client for a cluster already running in this Ray cluster."""
        from tessera.workers.model.loader import load_tokenizer

        scheduler = ray.get_actor(scheduler_name, namespace=namespace)
        config = ray.get(scheduler.get_config.remote())
        engine = config.engine  # the model, its revision, tokenizer and chat template
        tokenizer = load_tokenizer(
            engine.model,
            engine.revision,
            tokenizer=engine.tokenizer,
            chat_template=engine.chat_template,
        )
        return cls(scheduler, tokenizer)

    async def submit(
        self,
        request: str | Request,
        prompt: str | Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        lora: LoraRef | None = None,
        traced: bool = False,
    ) -> RequestStream:
        """Start a request; return its stream of deltas (all ``n`` outputs).

        Pass a request id, the prompt (text or token ids) and its sampling parameters,
        or a whole ``tessera.workers.api.Request``. ``timeout_s`` is how long it may wait in the
        global queue for a worker (default: the cluster's ``queue_timeout_s``). ``lora``:
        the adapter it runs with (``lora``/``load_lora`` give one). Raises
        ``InvalidRequestError``, ``OverloadedError`` or ``NoWorkerError`` before any
        output. ``traced``: its finished deltas carry the engine's phase times
        (``RequestOutput.times``).
        """
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
        ):
            raise InvalidRequestError("timeout_s", f"must be a number > 0, got {timeout_s!r}")
        if not isinstance(request, Request):
            request = Request(
                request,
                self._token_ids(prompt),
                _sampling(sampling),
                priority,
                0.0,
                cache_salt,
                lora=lora,
                traced=traced,
            )
        request_id = request.request_id
        if request_id in self._runs:
            raise InvalidRequestError("request_id", "another running request has this id")
        run = RequestRun(self, request, timeout_s)
        self._runs[request_id] = run
        try:
            await run.start()
        except BaseException:
            await run.close()
            raise
        run.pump()
        return RequestStream(run)

    async def lora(self, name: str) -> LoraRef | None:
        """The cluster's adapter called ``name`` (None: there is none)."""
        return await self.scheduler.lora.remote(name)

    async def loras(self) -> list[LoraRef]:
        """Every adapter the cluster serves."""
        return await self.scheduler.lora_list.remote()

    async def load_lora(self, name: str, path: str) -> LoraRef:
        """Serve the PEFT adapter in folder ``path`` (read by every worker) as ``name``;
        ``InvalidRequestError`` on ``lora_path`` saying what is wrong with it."""
        return await self.scheduler.load_lora.remote(name, path)

    async def unload_lora(self, name: str) -> bool:
        """Stop serving adapter ``name`` (requests running with it finish); False if
        there is none."""
        return await self.scheduler.unload_lora.remote(name)

    async def block_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the prompt's full blocks, as the workers' prefix caches compute
        them: computed here, once per request (the scheduler places by them and does
        not rehash); empty when prefix caching is off or no worker has registered yet."""
        hashing = self._hashing
        if hashing is _UNKNOWN or (hashing is not None and hashing[1] is None):
            hashing = self._hashing = await self.scheduler.block_hashing.remote()
        if hashing is None or hashing[1] is None:
            return []
        block_size, keys = hashing
        hashes: list[bytes] = []
        key = request.cache_key or ""
        extend_block_hashes(hashes, request.prompt_token_ids, block_size, (*keys, key))
        return hashes

    async def _channel(self, placement: Placement) -> ChannelReader:
        """The open channel to the placement's worker (opened now if need be)."""
        key = (placement.worker_id, placement.incarnation)
        channel = self._channels.get(key)
        if channel is None:
            channel_id = f"{self.id}:{uuid.uuid4().hex[:8]}"
            channel = self._channels[key] = ChannelReader(
                placement.worker, key, channel_id, self.channel_sockets, self._forget
            )
        await asyncio.shield(channel.opened)
        return channel

    def _forget(self, channel: ChannelReader) -> None:
        """A channel closed: the next request to its worker opens a new one."""
        if self._channels.get(channel.key) is channel:
            del self._channels[channel.key]

    def _token_ids(self, prompt: str | Sequence[int] | None) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return tuple(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                "prompt", f"must be text or a list of token ids, got {type(prompt).__name__}"
            )
        return tuple(prompt)

    async def embed(
        self, request_id: str, inputs: list[list[int]], timeout_s: float | None = None
    ) -> Any:
        """Each input's embedding (float32 numpy ``[len(inputs), hidden]``) from one
        worker the scheduler places the request on (as any request: its admission
        queue and placement policy; no prefix affinity); its place is released at the
        end. Raises ``submit``'s errors, ``InvalidRequestError`` naming the input, and
        ``OverloadedError`` (retriable) where the worker's KV pool, held by running
        requests, has no room for an input now."""
        placement = await self.scheduler.place.remote(
            request_id, [], MIXED, timeout_s, False, (request_id,)
        )
        if isinstance(placement, Refusal):
            raise placement.error(placement.message)
        try:
            return await placement.worker.embed.remote(inputs)
        except EmbeddingCapacityError as error:  # Ray's error is also the worker's
            cause = getattr(error, "cause", error)
            raise OverloadedError(
                f"the worker's KV pool is held by running requests: {cause}"
            ) from None
        finally:
            release = self.scheduler.release.remote(request_id)
            with contextlib.suppress(TimeoutError):  # the scheduler notes it when it can
                await asyncio.wait_for(asyncio.shield(release), RELEASE_WAIT_S)

    async def abort(self, request_id: str) -> bool:
        """End a request with ``finish_reason`` abort; False if no worker has it."""
        run = self._runs.get(request_id)
        if run is not None:
            await run.abort()
            return True
        return await self.scheduler.abort.remote(request_id)

    def placement(self, request_id: str) -> Placement | None:
        """Where a request of this client runs now (None once it has ended)."""
        run = self._runs.get(request_id)
        return run.placement if run is not None else None

    async def stats(self) -> ClusterStats:
        """The cluster's stats; ``TimeoutError`` while the scheduler does not answer."""
        return await asyncio.wait_for(self.scheduler.stats.remote(), RELEASE_WAIT_S)

    async def close(self) -> None:
        """Stop every request of this client (each is aborted on its worker and
        released) and close its channels, waiting for their background tasks. Call it
        before ``ray.shutdown``: a task that calls into Ray after that ends the process
        at once, with exit status 1 and no message."""
        for run in list(self._runs.values()):
            await run.stop()
        for channel in list(self._channels.values()):
            await channel.aclose()
