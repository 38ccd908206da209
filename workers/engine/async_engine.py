"""An asyncio front for ``Engine``: a background step loop and per-request streams.

The step loop runs on the engine's own thread, step after step while there is work, so
the event loop stays free to take new requests and aborts and the engine never waits
for it; outputs are routed to one queue per request.
Leaving a stream early (``break``, cancellation, a closed connection) aborts the
request, which frees its KV blocks on the next step. A request with ``n`` outputs
ends after ``n`` finished deltas.

**One thread does the engine's parallel work.** libgomp (torch's OpenMP) keeps a pool
of worker threads for every thread that has started a parallel region; once the
process holds more pool threads than CPUs, every pool stops spinning between regions
and sleeps after ~100 spins instead of ~300,000, so each of a step's many short
regions pays a futex wake-up. Measured on 2 cores: a bf16 decode step took 6.6 ms on
the thread that had loaded the model and 11.9 ms on any other thread. So every step
runs on one thread (``run``: also for other engine work), ``build`` constructs the
engine there too, and the step loop first releases the pool of the thread it was
started from (``release_openmp_pool``), which built the engine when ``build`` was
not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from tessera.workers.api import LoraRef, Request, RequestOutput, Resume, SamplingParams
from tessera.workers.engine.engine import Engine, EngineStats

logger = logging.getLogger(__name__)

T = TypeVar("T")


@functools.cache
def _openmp_pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` where torch loaded libgomp, else None."""
    try:
        return ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return None


def release_openmp_pool() -> None:
    """Free the calling thread's OpenMP worker pool (``omp_pause_hard``), so that the
    engine thread's pool is the process's only one; a later parallel region on this
    thread builds a new one. libgomp's pause joins only the caller's own pool threads,
    so a step running meanwhile on the engine thread is untouched. A no-op without
    libgomp."""
    pause = _openmp_pause()
    if pause is not None:
        pause(2)  # omp_pause_hard


class EngineClosedError(RuntimeError):
    """The ``AsyncEngine`` was closed: raised by a stream whose request was still in
    flight (it was aborted, its blocks freed), and by ``add_request`` and ``run`` after
    ``close``."""


class AsyncEngine:
    """The engine thread runs steps back to back while there is work, and hands each
    step's outputs to the event loop (``call_soon_threadsafe``); it never waits for the
    loop between steps. Handing every step through the loop (an executor future the
    loop had to see before it submitted the next step) left the engine idle between
    steps: 0.26 ms (median) at 1 running sequence, a 6.8 ms step, 0.34 at 16, 0.56 at
    64. ``run`` calls go to the same thread, between steps. The step loop ends when the
    engine has no work (a new request or abort starts it again), so the thread never
    outlives its work: an idle engine holds no thread, and a process can exit."""

    def __init__(self, engine: Engine, thread: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._thread = thread or ThreadPoolExecutor(1, thread_name_prefix="tessera-engine")
        self._released = False
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._open: dict[str, int] = {}  # request id -> outputs not finished yet
        self._lock = threading.Lock()  # guards _stepping and _loop against the step loop's end
        self._stepping = False  # the step loop runs (or is submitted) on the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None  # where outputs go
        self._work = threading.Event()  # set when a blocked step may go on
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()  # run() while stepping
        self._closing = False

    @classmethod
    def build(cls, factory: Callable[[], Engine]) -> AsyncEngine:
        """An ``AsyncEngine`` whose engine ``factory`` constructs on the engine thread."""
        thread = ThreadPoolExecutor(1, thread_name_prefix="tessera-engine")
        return cls(thread.submit(factory).result(), thread)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the engine thread (after the step running there, if any)."""
        if self._closing:
            raise EngineClosedError("the engine is closed: it runs no more calls")
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._stepping:
                future: asyncio.Future[T] = loop.create_future()
                self._calls.put(_Call(functools.partial(fn, *args), future, loop))
                self._work.set()
            else:
                future = loop.run_in_executor(self._thread, fn, *args)
        return await future

    def _start(self) -> None:
        """Start the step loop if it is not running; outputs go to this event loop."""
        loop = asyncio.get_running_loop()
        if not self._released:
            self._released = True
            release_openmp_pool()  # of the event loop's thread: see the module docstring
        with self._lock:
            self._loop = loop
            if not self._stepping and not self._closing:
                self._stepping = True
                self._thread.submit(self._step_loop)
        self._work.set()

    def _step_loop(self) -> None:
        """On the engine thread while there is work: queued calls, then a step, its
        outputs (or error) passed to the event loop."""
        ended = False  # by _next, which clears _stepping itself
        try:
            while True:
                if not self._next():
                    ended = True
                    break
                loop = self._loop
                assert loop is not None
                while not self._calls.empty():
                    self._calls.get().run()
                if not self.engine.has_work():
                    continue
                steps = self.engine.num_steps
                self._work.clear()
                try:
                    outputs = self.engine.step()
                except Exception as error:  # fail the requests in flight, not the loop
                    logger.exception("engine step failed; aborting the requests in flight")
                    failed = threading.Event()
                    if not _call_soon(loop, self._fail, error, failed):
                        break
                    while not failed.wait(1.0):  # their aborts are in before the next step
                        if loop.is_closed():
                            break
                    continue
                if outputs and not _call_soon(loop, self._deliver, outputs):
                    break  # the event loop closed: nobody to step for
                if self.engine.num_steps == steps and not outputs:
                    # nothing could run (no free blocks for the waiting): wait for a
                    # call or a request to change that rather than spin
                    self._work.wait(0.005)
        finally:
            if not ended:  # a break or an error: _stepping still stands, nobody restarted
                with self._lock:
                    self._stepping = False
                    left = []
                    while not self._calls.empty():
                        left.append(self._calls.get())
                for call in left:  # what waited, in order
                    call.run()

    def _next(self) -> bool:
        """Whether the step loop goes on; if not, it has ended (``_stepping`` is clear
        and no call waits), atomically with ``run`` and ``_start``."""
        with self._lock:
            if not self._closing and (not self._calls.empty() or self.engine.has_work()):
                return True
            self._stepping = False
            left = []  # calls queued before close: they still run, outside the lock
            while not self._calls.empty():
                left.append(self._calls.get())
        for call in left:
            call.run()
        return False

    def _fail(self, error: Exception, failed: threading.Event) -> None:
        try:
            for request_id, stream in list(self._streams.items()):
                stream.put_nowait(error)
                try:
                    self.engine.abort(request_id)
                except Exception:  # the step's own failure may have spoiled the engine
                    logger.exception("aborting %s after a failed step failed", request_id)
            self._streams.clear()
            self._open.clear()
        finally:
            failed.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
                if output.finished:
                    self._open[output.request_id] -= 1
                    if not self._open[output.request_id]:
                        del self._streams[output.request_id], self._open[output.request_id]

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        resume: Resume | None = None,
        lora: LoraRef | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate and start a request (errors raise here, before any output), then
        return an async iterator over its output deltas (of all ``n`` outputs)."""
        self._check_open(request_id)
        sampling = sampling or SamplingParams()
        grammar = await self._grammar(sampling, resume)
        await self.prepare_lora(lora)
        self._check_open(request_id)
        request = self.engine.add_request(
            request_id, prompt, sampling, priority, cache_salt, resume, grammar, lora
        )
        return self._open_stream(request)

    async def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """``add_request`` for a request built whole (``Engine.submit``)."""
        self._check_open(request.request_id)
        grammar = await self._grammar(request.sampling, request.resume)
        await self.prepare_lora(request.lora)
        self._check_open(request.request_id)
        return self._open_stream(self.engine.submit(request, grammar))

    async def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """``Engine.embed`` a forward at a time, each a ``run`` call between two steps:
        requests in flight go on generating while a long list of inputs is embedded.
        The job's blocks are freed however it ends, the caller's cancellation
        included."""
        engine = self.engine
        job = engine.start_embedding(inputs)
        try:
            while not job.finished:
                await self.run(engine.embedding_forward, job)
        finally:
            # shielded: a cancelled caller still waits for its blocks to be freed
            await asyncio.shield(self.run(engine.end_embedding, job))
        return job.result()

    async def prepare_lora(self, lora: LoraRef | None) -> None:
        """Read a request's adapter off the loop (its files: megabytes), once."""
        if lora is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.prepare_lora, lora)

    async def _grammar(self, sampling: SamplingParams, resume: Resume | None) -> object | None:
        """A structured request's matcher, built on the loop's default executor: beside
        the step loop (llguidance releases the GIL), not in it."""
        if sampling.structured is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.engine.grammar_matcher, sampling, resume)

    def _check_open(self, request_id: str) -> None:
        if self._closing:
            raise EngineClosedError(f"the engine is closed: request {request_id!r} not started")

    def _open_stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._open[request_id] = request.sampling.n
        self._start()
        return self._stream(request_id, request.sampling.n, queue)

    async def _stream(
        self, request_id: str, n: int, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        unfinished = n
        try:
            while unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                unfinished -= item.finished
                yield item
        finally:
            if unfinished:
                self._streams.pop(request_id, None)
                self._open.pop(request_id, None)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        with contextlib.suppress(RuntimeError):  # no running loop: the next request's steps
            self._start()  # a step applies the abort (frees its blocks)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def close(self) -> None:
        """Stop the step loop after the step running now (if any). A request still in
        flight is aborted (its blocks go back at once) and its stream raises
        ``EngineClosedError``; so do ``add_request`` and ``run`` from now on."""
        with self._lock:
            self._closing = True
        self._work.set()
        await asyncio.get_running_loop().run_in_executor(self._thread, lambda: None)  # drained
        # the last step's outputs were handed to this loop before the line above returned
        # (the same loop's callbacks, in order): what is open now gets no more
        try:
            for request_id, stream in list(self._streams.items()):
                try:
                    self.engine.abort(request_id)  # no step runs: freed now
                except Exception:  # the others still end
                    logger.exception("aborting %s as the engine closed failed", request_id)
                stream.put_nowait(
                    EngineClosedError(f"the engine closed with request {request_id!r} in flight")
                )
        finally:
            self._streams.clear()
            self._open.clear()
            self.engine.close()
            self._thread.shutdown(wait=False)


@dataclass(slots=True)
class _Call:
    """A ``run`` call waiting for the engine thread."""

    fn: Callable[[], object]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def run(self) -> None:
        if self.future.done():  # the caller gave up (cancelled) before it ran
            return
        try:
            result = self.fn()
        except BaseException as error:  # the caller's to handle
            _call_soon(self.loop, _settle, self.future, None, error)
        else:
            _call_soon(self.loop, _settle, self.future, result, None)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> bool:
    """``loop.call_soon_threadsafe(fn, *args)``; False if the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed
        return False
    return True


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
