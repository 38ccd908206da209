"""One request through the cluster, across failovers (``ClusterClient.submit``'s
``RequestRun``): its placement, the worker-side parts it runs as, and the deltas it
has delivered, from which a failover resumes it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError

from tessera.scheduler.api import DeadlineError, NoWorkerError, Placement, Refusal
from tessera.workers.api import Request, RequestOutput, Resume, SamplingParams, fork_seed
from tessera.workers.process.channel import END, StreamFailure
from tessera.workers.process.channel_reader import (
    ChannelGone,
    ChannelReader,
    cancel_and_wait,
    worker_result,
)
from tessera.workers.process.protocol import MIXED, Accepted

logger = logging.getLogger(__name__)

#: Worker losses one request survives before it fails with ``NoWorkerError``.
MAX_FAILOVERS = 8
#: How long a request without its own ``timeout_s`` waits for a scheduler that does not
#: answer (it restarts in seconds; Ray retries the call on its new incarnation).
SCHEDULER_WAIT_S = 60.0
#: How long closing a stream waits for the scheduler to note its release.
RELEASE_WAIT_S = 5.0


@dataclass(slots=True)
class Timings:
    """Where one request's time went before its first token, as its front end saw it
    (``time.monotonic``; the first attempt's: a failover does not move them)."""

    submitted: float
    placed: float | None = None  # the scheduler gave it a worker (after any queueing)
    accepted: float | None = None  # the worker took it (its engine has the request)
    first_token: float | None = None  # the first delta with tokens reached this client


@dataclass
class _Output:
    """What the caller has received of one output (index)."""

    token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    cumulative_logprob: float | None = None
    finished: bool = False


@dataclass
class _Part:
    """One worker-side request: the whole request, or one resumed output of it."""

    worker_request_id: str
    sampling: SamplingParams
    resume: Resume | None
    index: int | None  # the caller's output index, when the part is one resumed output
    channel: ChannelReader | None = None  # where its deltas come from, once started
    done: bool = False


class RequestRun:
    """One request through the cluster, across failovers."""

    def __init__(self, client: Any, request: Request, timeout_s: float | None) -> None:
        # ``client``: the ``ClusterClient`` that submitted it (its scheduler and channels)
        self.client = client
        self.request = request
        self.timeout_s = timeout_s
        self.outputs = {i: _Output() for i in range(request.sampling.n)}
        self.attempt = 0
        self.placement: Placement | None = None
        self.parts: list[_Part] = []
        self._deltas: asyncio.Queue[RequestOutput | Exception | None] = asyncio.Queue()
        self._incoming: asyncio.Queue[tuple[_Part, Any]] = asyncio.Queue()  # from channels
        self._task: asyncio.Task | None = None
        self._closed = False
        self.timings = Timings(time.monotonic())
        self.hashes: list[bytes] | None = None  # the prompt's block hashes, for placement

    # -- attempts
    def _plan(self) -> list[_Part]:
        request, params = self.request, self.request.sampling
        base = request.request_id if not self.attempt else f"{request.request_id}:{self.attempt}"
        delivered = any(out.token_ids for out in self.outputs.values())
        streams = params.beam_width == 1 and (params.best_of is None or params.best_of == params.n)
        if not delivered or not streams:
            return [_Part(base, params, None, None)]
        parts = []
        for index, out in self.outputs.items():
            if out.finished:
                continue
            seed = out.seed
            if seed is None and params.seed is not None:
                seed = fork_seed(params.seed, index)  # what the engine's fork gives
            sampling = dataclasses.replace(params, n=1, best_of=None, seed=seed)
            resume = None
            if out.token_ids:
                resume = Resume(tuple(out.token_ids), out.cumulative_logprob or 0.0)
            worker_request_id = base if params.n == 1 else f"{base}:{index}"
            parts.append(_Part(worker_request_id, sampling, resume, index))
        return parts

    async def start(self, failover: bool = False) -> None:
        """Place the request and start it; return once a worker has accepted it (a
        worker lost on the way is failed over like one lost mid-stream)."""
        while True:
            try:
                await self._attempt(failover)
                return
            except RayActorError as error:
                self._lost(error)
                failover = True

    async def _attempt(self, failover: bool) -> None:
        request = self.request
        parts = self._plan()
        if self.hashes is None:  # once per request, failovers included
            self.hashes = await self.client.block_hashes(request)
        # A restarting scheduler takes the call when it is back: wait for it within
        # the request's queue deadline (place answers by then itself once it runs).
        wait_s = (self.timeout_s or SCHEDULER_WAIT_S) + 5.0
        try:
            placement = await asyncio.wait_for(
                self.client.scheduler.place.remote(
                    request.request_id,
                    self.hashes,
                    MIXED,
                    self.timeout_s,
                    failover,
                    tuple(part.worker_request_id for part in parts),
                    None if request.lora is None else request.lora.digest,
                ),
                wait_s,
            )
        except TimeoutError:
            raise DeadlineError(
                f"the cluster's scheduler did not answer within {wait_s:g} s; retry"
            ) from None
        except RayActorError as error:  # the scheduler itself, not a worker
            logger.error("the scheduler is gone: %s", error)
            raise NoWorkerError("the cluster's scheduler is gone") from None
        if isinstance(placement, Refusal):
            raise placement.error(placement.message)
        self.placement, self.parts = placement, parts
        if self.timings.placed is None:
            self.timings.placed = time.monotonic()
        channel = await self.client._channel(placement)
        starts = []
        for part in parts:
            part.channel = channel
            channel.routes[part.worker_request_id] = functools.partial(self._deliver, part)
            worker_request = dataclasses.replace(
                request,
                request_id=part.worker_request_id,
                sampling=part.sampling,
                resume=part.resume,
                prefill=placement.prefill,  # disaggregated: pull the prompt's blocks there
            )
            starts.append(placement.worker.start.remote(channel.id, worker_request))
        for start in starts:
            accepted = await worker_result(start)
            assert isinstance(accepted, Accepted), accepted
        if self.timings.accepted is None:
            self.timings.accepted = time.monotonic()

    def _deliver(self, part: _Part, item: Any) -> None:
        """An item of ``part`` from its channel (``ChannelReader.routes``)."""
        self._incoming.put_nowait((part, item))

    def _lost(self, error: BaseException) -> None:
        """The worker went away: tell the scheduler, and count the attempt."""
        placement = self.placement
        if placement is not None:
            logger.warning(
                "request %s lost worker %s (%s); failing over",
                self.request.request_id,
                placement.worker_id,
                type(error).__name__,
            )
            self.client.scheduler.worker_failed.remote(placement.worker_id, placement.incarnation)
        self._cancel_parts()
        self.attempt += 1
        if self.attempt > MAX_FAILOVERS:
            raise NoWorkerError(
                f"request {self.request.request_id!r} lost {MAX_FAILOVERS} workers; giving up"
            ) from error

    # -- the stream
    def pump(self) -> None:
        """Read the request's deltas in the background, whether or not the caller reads
        yet, so the request's place in the cluster is released when the worker is done
        with it, not when the caller gets round to the last delta."""
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            while True:
                try:
                    async for part, delta in self._merged():
                        delta = self._record(part, delta)
                        if delta is not None:
                            self._deltas.put_nowait(delta)
                    break
                except RayActorError as error:
                    self._lost(error)
                    await self.start(failover=True)
        except Exception as error:  # the caller's stream raises it
            self._deltas.put_nowait(error)
        finally:
            self._deltas.put_nowait(None)
            await self.close()

    async def stream(self) -> AsyncIterator[RequestOutput]:
        try:
            while (item := await self._deltas.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            await self.stop()

    async def stop(self) -> None:
        """The caller left early: stop reading, which aborts the request on its worker.
        A pump cancelled before its first step never runs its ``finally``, so the
        request is closed here too (``close`` is idempotent)."""
        await cancel_and_wait(self._task)
        await self.close()

    async def _merged(self) -> AsyncIterator[tuple[_Part, RequestOutput]]:
        """The deltas of every live part, as their channels deliver them."""
        while any(not part.done for part in self.parts):
            part, item = await self._incoming.get()
            if part.done:  # ended, or a part of an earlier attempt
                continue
            if item is END:
                part.done = True
                self._unroute(part)
            elif isinstance(item, RequestOutput):
                yield part, item
            elif isinstance(item, ChannelGone):
                raise item.error
            else:
                assert isinstance(item, StreamFailure), item
                raise RuntimeError(item.message)

    def _record(self, part: _Part, delta: RequestOutput) -> RequestOutput | None:
        """Note what the caller gets; give the delta the caller's id and index. A
        restarted request's outputs that already finished are dropped."""
        index = delta.index if part.index is None else part.index
        out = self.outputs[index]
        if out.finished:
            return None
        if delta.token_ids and self.timings.first_token is None:
            self.timings.first_token = time.monotonic()
        out.token_ids += delta.token_ids
        out.seed = delta.seed if delta.seed is not None else out.seed
        if delta.cumulative_logprob is not None:
            out.cumulative_logprob = delta.cumulative_logprob
        out.finished = delta.finished
        return dataclasses.replace(delta, request_id=self.request.request_id, index=index)

    def _cancel_parts(self) -> None:
        """Stop listening to the parts still live (an abort by name stops them)."""
        for part in self.parts:
            if not part.done:
                part.done = True
                self._unroute(part)

    def _unroute(self, part: _Part) -> None:
        if part.channel is not None:
            part.channel.routes.pop(part.worker_request_id, None)

    async def abort(self) -> None:
        placement = self.placement
        if placement is not None:
            for part in self.parts:
                if not part.done:
                    placement.worker.abort.remote(part.worker_request_id)

    async def close(self) -> None:
        """Abort what still runs and free the request's place in the cluster (once)."""
        if self._closed:
            return
        self._closed = True
        placement = self.placement
        live = [part for part in self.parts if not part.done and part.channel is not None]
        self._cancel_parts()
        if placement is not None:
            for part in live:  # sent now, not awaited: nothing may hold up the release
                placement.worker.abort.remote(part.worker_request_id)
        self.client._runs.pop(self.request.request_id, None)
        release = self.client.scheduler.release.remote(self.request.request_id)
        with contextlib.suppress(RayActorError, TimeoutError):  # Ray retries it meanwhile
            await asyncio.wait_for(asyncio.shield(release), RELEASE_WAIT_S)
