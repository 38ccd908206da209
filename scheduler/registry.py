"""The scheduler's registry: its workers, and which requests are placed on which.

Plain bookkeeping, no Ray calls: the scheduler actor decides, the registry records.
Invariants:

- ``placements`` and the workers' ``ongoing`` sets hold the same requests, each on
  exactly one worker (requests placed before a scheduler restart are counted in
  ``recovered`` instead, by the ids the worker reports);
- the prefix index has entries only for workers in the registry, and what it holds
  for a worker was reported (or expected) by the worker's current incarnation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tessera.scheduler.api import WorkerState, WorkerStatus
from tessera.scheduler.prefix_index import PrefixIndex
from tessera.workers.process.protocol import WorkerInfo, WorkerLoad


@dataclass(eq=False)
class WorkerRecord:
    worker_id: str
    role: str
    handle: Any  # the worker actor's handle
    status: WorkerStatus = WorkerStatus.STARTING
    info: WorkerInfo | None = None  # from its current incarnation's registration
    load: WorkerLoad | None = None  # its last report
    ongoing: set[str] = field(default_factory=set)  # request ids placed here
    # Ids that requests run under here that an earlier incarnation of the scheduler
    # placed (learnt from the worker's reports after a scheduler restart; None: none
    # to learn). They count as in flight until the worker reports them gone.
    recovered: set[str] | None = None
    placed: int = 0
    restarts: int = 0
    idle_since: float | None = None  # when its last request ended
    resync: bool = False  # a report was lost: ask for a full prefix snapshot
    poll: asyncio.Task | None = None  # the report call in flight

    @property
    def incarnation(self) -> str | None:
        return self.info.incarnation if self.info else None

    @property
    def in_flight(self) -> int:
        """Requests running here: those placed, and those recovered after a restart."""
        return len(self.ongoing) + len(self.recovered or ())

    def recount(self, running: tuple[str, ...]) -> None:
        """A report's running ids: the recovered ones still running stay counted."""
        if self.recovered is not None:
            self.recovered.intersection_update(running)


class Registry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        # request id -> (worker id, the ids its parts run under on that worker)
        self.placements: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.placed_at: dict[str, float] = {}  # request id -> when (monotonic)
        self.index = PrefixIndex()

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self.workers.values()))

    def get(self, worker_id: str | None) -> WorkerRecord | None:
        return self.workers.get(worker_id) if worker_id is not None else None

    def add(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record

    def remove(self, record: WorkerRecord) -> None:
        self.drop_placements(record)
        self.workers.pop(record.worker_id, None)
        self.index.remove(record.worker_id)
        if record.poll is not None:
            record.poll.cancel()

    def reincarnate(self, record: WorkerRecord, info: WorkerInfo) -> None:
        """The worker (re)started as ``info.incarnation``: its cache and requests are new."""
        if record.info is not None:
            record.restarts += 1
            record.recovered = None  # what ran there before is gone with it
        record.info = info
        self.index.reset(record.worker_id)
        self.drop_placements(record)
        record.idle_since = time.monotonic()

    def drop_placements(self, record: WorkerRecord) -> None:
        for request_id in record.ongoing:
            self.placements.pop(request_id, None)
            self.placed_at.pop(request_id, None)
        record.ongoing.clear()

    def place(
        self,
        record: WorkerRecord,
        request_id: str,
        worker_request_ids: tuple[str, ...],
        hashes: list[bytes],
    ) -> None:
        record.ongoing.add(request_id)
        record.placed += 1
        record.idle_since = None
        self.placements[request_id] = (record.worker_id, worker_request_ids)
        self.placed_at[request_id] = time.monotonic()
        self.index.expect(record.worker_id, hashes)

    def release(self, request_id: str) -> WorkerRecord | None:
        """Forget where the request ran; return that worker (None if unknown). A
        request placed before a scheduler restart is found by the ids it runs under
        (the request id, or ``<id>:<suffix>`` for its parts)."""
        worker_id, _ = self.placements.pop(request_id, (None, ()))
        self.placed_at.pop(request_id, None)
        if worker_id is None:
            found = self.recovered_on(request_id)
            if found is not None:
                record, ids = found
                record.recovered.difference_update(ids)
                return record
            return None
        record = self.get(worker_id)
        if record is not None:
            record.ongoing.discard(request_id)
            if not record.in_flight:
                record.idle_since = time.monotonic()
        return record

    def orphans(self, record: WorkerRecord, running: tuple[str, ...], before: float) -> list[str]:
        """Requests placed on ``record`` before ``before`` (monotonic) of which no id
        runs there (``running``: a report's ids): their front end is gone (a replica
        died with its streams) or never released them. The caller releases them."""
        live = set(running)
        return [
            request_id
            for request_id in record.ongoing
            if self.placed_at.get(request_id, before) < before
            and live.isdisjoint(self.placements.get(request_id, ("", (request_id,)))[1])
        ]

    def recovered_on(self, request_id: str) -> tuple[WorkerRecord, tuple[str, ...]] | None:
        """The worker and ids of a request placed before a scheduler restart."""
        for record in self.workers.values():
            ids = tuple(i for i in record.recovered or () if i.split(":", 1)[0] == request_id)
            if ids:
                return record, ids
        return None

    def placed_on(self, request_id: str) -> tuple[WorkerRecord, tuple[str, ...]] | None:
        worker_id, ids = self.placements.get(request_id, (None, ()))
        record = self.get(worker_id)
        return (record, ids) if record is not None else None

    def states(self, capacity: int) -> tuple[WorkerState, ...]:
        return tuple(
            WorkerState(
                worker_id=r.worker_id,
                role=r.role,
                status=r.status,
                incarnation=r.incarnation,
                ongoing=r.in_flight,
                capacity=capacity,
                placed=r.placed,
                restarts=r.restarts,
                cached_hashes=self.index.size(r.worker_id),
                load=r.load,
                node_id=r.info.node_id if r.info else None,
                ranks=r.info.ranks if r.info else (),
            )
            for r in sorted(self.workers.values(), key=lambda r: r.worker_id)
        )
