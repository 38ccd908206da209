"""The global admission queue: requests waiting for a worker, oldest first.

It holds at most ``limit`` requests (the scheduler refuses one beyond that at once),
and each waits at most its own deadline. A waiter leaves in one of three ways: a
worker takes it (``dispatch``), its deadline passes (``wait`` returns None), or it is
withdrawn (``cancel``: its caller went away, or the cluster is shutting down).
Cancelled waiters are dropped lazily when they reach the head, so every operation is
O(1) amortised; ``len`` counts only live ones.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class Waiter:
    request_id: str
    role: str
    hashes: list[bytes]  # the prompt's block hashes, for placement
    worker_request_ids: tuple[str, ...]
    future: asyncio.Future
    cancelled: bool = False


class AdmissionQueue:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queue: collections.deque[Waiter] = collections.deque()
        self._live: dict[str, Waiter] = {}  # request id -> its waiter, while it waits

    def __len__(self) -> int:
        return len(self._live)

    @property
    def full(self) -> bool:
        return len(self._live) >= self.limit

    def holds(self, request_id: str) -> bool:
        """Whether the request waits here now."""
        return request_id in self._live

    def waiting(self, role: str) -> int:
        return sum(waiter.role == role for waiter in self._live.values())

    async def wait(
        self,
        request_id: str,
        role: str,
        hashes: list[bytes],
        worker_request_ids: tuple[str, ...],
        timeout_s: float,
    ) -> Any:
        """Queue the request; return what ``dispatch`` or ``cancel`` gave it, or None
        when ``timeout_s`` passes first."""
        future = asyncio.get_running_loop().create_future()
        waiter = Waiter(request_id, role, hashes, worker_request_ids, future)
        self._queue.append(waiter)
        self._live[request_id] = waiter
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            if future.done():  # dispatched just as the deadline passed
                return future.result()
            self._withdraw(waiter)
            return None

    def cancel(self, request_id: str, outcome: Any) -> None:
        """Withdraw a waiting request; its ``wait`` returns ``outcome``."""
        waiter = self._live.get(request_id)
        if waiter is not None:
            self._withdraw(waiter)
            waiter.future.set_result(outcome)

    def cancel_all(self, outcome: Any) -> None:
        for request_id in list(self._live):
            self.cancel(request_id, outcome)

    def dispatch(self, place: Callable[[Waiter], Any | None]) -> None:
        """Offer waiters to ``place``, oldest first, until it returns None (no worker
        has room); each one placed gets the result from its ``wait``."""
        while self._queue:
            waiter = self._queue[0]
            if waiter.cancelled:
                self._queue.popleft()
                continue
            placement = place(waiter)
            if placement is None:
                return
            self._queue.popleft()
            del self._live[waiter.request_id]
            waiter.future.set_result(placement)

    def _withdraw(self, waiter: Waiter) -> None:
        waiter.cancelled = True
        if self._live.get(waiter.request_id) is waiter:
            del self._live[waiter.request_id]
