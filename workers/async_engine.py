"""An asyncio front for ``Engine``: a background step loop and per-request streams.

The step loop runs each ``Engine.step`` on the engine's own thread so the event loop
stays free to take new requests and aborts; outputs are routed to one queue per request.
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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tessera.workers.api import RequestOutput, Resume, SamplingParams
from tessera.workers.engine import Engine, EngineStats

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


class AsyncEngine:
    def __init__(self, engine: Engine, thread: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._thread = thread or ThreadPoolExecutor(1, thread_name_prefix="tessera-engine")
        self._released = False
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._open: dict[str, int] = {}  # request id -> outputs not finished yet
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, factory: Callable[[], Engine]) -> AsyncEngine:
        """An ``AsyncEngine`` whose engine ``factory`` constructs on the engine thread."""
        thread = ThreadPoolExecutor(1, thread_name_prefix="tessera-engine")
        return cls(thread.submit(factory).result(), thread)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the engine thread (after the step running there, if any)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        if not self._released:
            self._released = True
            release_openmp_pool()  # of the event loop's thread: see the module docstring
        while True:
            if not self.engine.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                outputs = await self.run(self.engine.step)
            except Exception as error:  # fail the requests in flight, not the loop
                logger.exception("engine step failed; aborting the requests in flight")
                for request_id, queue in list(self._streams.items()):
                    queue.put_nowait(error)
                    self.engine.abort(request_id)
                self._streams.clear()
                self._open.clear()
                continue
            for output in outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
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
    ) -> AsyncIterator[RequestOutput]:
        """Validate and start a request (errors raise here, before any output), then
        return an async iterator over its output deltas (of all ``n`` outputs)."""
        request = self.engine.add_request(
            request_id, prompt, sampling, priority, cache_salt, resume
        )
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._open[request_id] = request.sampling.n
        self._ensure_loop()
        self._wakeup.set()
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
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._thread.shutdown(wait=False)
