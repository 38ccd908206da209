"""The typed seam between the scheduler and the front ends.

Front ends ask the scheduler for a ``Placement`` and then stream from the worker
directly: the scheduler is not on the per-token path. Refusals travel back as values,
not exceptions, so a front end can raise the right typed error without unwrapping
Ray's. ``ClusterStats`` shows each worker as the scheduler sees it, with its last load
report. What the workers themselves tell the scheduler (``WorkerInfo``, ``WorkerLoad``,
the roles) is the worker's seam, ``tessera.workers.process.protocol``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tessera.workers.api import PrefillSource
from tessera.workers.process.protocol import WorkerLoad


class WorkerStatus(str, enum.Enum):
    STARTING = "starting"  # created, engine loading, not registered yet
    HEALTHY = "healthy"  # registered and answering reports: placements go here
    UNHEALTHY = "unhealthy"  # missed reports or died; Ray may be restarting it
    DRAINING = "draining"  # no new placements; stopped once its requests finish


class ClusterError(RuntimeError):
    """A request the cluster could not serve. ``retriable``: the same request may
    succeed later (the cluster was full, or had no worker for a moment)."""

    retriable = False


class OverloadedError(ClusterError):
    """Refused at once: the global queue is full, or the request's queue deadline passed."""

    retriable = True


class DeadlineError(OverloadedError):
    """The request's deadline passed while it waited in the global queue."""


class NoWorkerError(ClusterError):
    """No healthy worker of the needed role is left to run (or resume) the request."""

    retriable = True


class RequestIdInUseError(ClusterError):
    """Another request placed (or waiting) under this id, and this is no failover: two
    front ends were given one id (placing it again would move the first's place)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs. ``worker`` is the worker actor's handle."""

    request_id: str
    worker_id: str
    incarnation: str
    worker: Any
    matched_blocks: int  # leading prompt blocks the worker holds (prefix affinity)
    prefill: PrefillSource | None = None  # disaggregated: where the worker pulls blocks from


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``place`` did not place; the front end raises ``error`` with ``message``."""

    error: type[ClusterError]
    message: str


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A worker as the scheduler sees it (a row of ``ClusterStats``)."""

    worker_id: str
    role: str
    status: WorkerStatus
    incarnation: str | None
    ongoing: int  # requests placed here and not released
    capacity: int  # most ongoing requests before new ones queue
    placed: int  # requests placed here since it (re)started
    restarts: int  # times it came back with a new incarnation
    cached_hashes: int  # block hashes in the scheduler's index for it
    load: WorkerLoad | None
    node_id: str | None = None  # the Ray node it runs on (None until it registers)
    ranks: tuple[str, ...] = ()  # a tensor-parallel group's: each rank's device and node


@dataclass(frozen=True, slots=True)
class ClusterStats:
    workers: tuple[WorkerState, ...]
    queued: int  # requests waiting in the global queue
    placed: int
    refused: int
    failovers: int  # placements that resumed a request after its worker failed
    policy: str
    events: tuple[str, ...] = field(default=())  # recent scale-up/drain/restart events

    def worker(self, worker_id: str) -> WorkerState:
        return next(w for w in self.workers if w.worker_id == worker_id)
