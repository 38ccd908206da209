"""The scheduler: a named Ray actor that owns the worker pool and places requests.

It is the control plane only. A front end asks ``place`` for a worker, streams the
request's deltas from that worker itself, and calls ``release`` when the stream ends;
the scheduler never sees a token.

What it holds:

- **the registry** (``tessera.scheduler.registry``): every worker it started, with role,
  status, incarnation, last load report and the requests placed on it, and the prefix
  index: per worker, the block hashes its prefix cache holds (fed by the reports),
  which prefix-affinity placement matches against the prompt's block hashes;
- **global admission**: a worker takes at most ``capacity`` ongoing requests; more
  wait in one FIFO queue of at most ``max_queued_requests``, each until its deadline;
  beyond the limit a request is refused at once (``OverloadedError``).

A monitor loop pulls a report from each worker every ``report_interval_s`` (that is
the health check), restarts or replaces dead workers, and runs the autoscaler.

The actor is one class written in parts: this module holds its lifecycle, its workers'
registration and its operators' calls; ``placer`` places requests (``Placer``),
``monitor`` checks the workers and sizes their pools (``WorkerMonitor``), ``loras``
keeps the cluster's LoRA adapters (``LoraRegistry``), and ``worker_actors`` names and
starts the worker actors.

**Restarts.** Workers are detached named actors (``worker_actor_name``), so they do
not share the scheduler's fate, and the cluster layer creates the scheduler with
``max_restarts``. A restarted scheduler (Ray runs ``__init__`` again) finds its live
workers by name, asks each for a full report (its prefix-cache snapshot and the ids of
the requests running there, counted as in flight until they end), and resumes
placement; its worker ids go on from the highest found. Calls that arrive meanwhile
are retried by Ray on the new incarnation (``max_task_retries``); the front ends bound
them by their deadlines. Streams never notice: tokens do not pass through here.
Invariant: a request is placed only on a ``HEALTHY`` worker of its role below its
capacity (the registry states its own).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time

import ray

from tessera.scheduler.admission import AdmissionQueue
from tessera.scheduler.api import ClusterStats, NoWorkerError, Refusal, WorkerStatus
from tessera.scheduler.autoscaler import Autoscaler
from tessera.scheduler.config import SchedulerConfig
from tessera.scheduler.loras import LoraRegistry
from tessera.scheduler.monitor import WorkerMonitor
from tessera.scheduler.placement import make_policy
from tessera.scheduler.placer import Placer
from tessera.scheduler.registry import Registry, WorkerRecord
from tessera.scheduler.worker_actors import (
    MAX_START_FAILURES,
    STARTUP_TIMEOUT_S,
    start_worker,
    stop_group,
    worker_actors,
)
from tessera.workers.process.protocol import WorkerInfo

logger = logging.getLogger(__name__)


class Scheduler(WorkerMonitor, Placer, LoraRegistry):
    """Use ``scheduler_actor_class()`` for the Ray actor. The cluster layer starts it,
    with a ``SchedulerConfig`` it builds from the cluster's configuration."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.restarted = _reconstructed()
        self.policy = make_policy(config.placement)
        self.registry = Registry()
        self.queue = AdmissionQueue(config.max_queued_requests)
        self.autoscalers = {pool.role: Autoscaler(pool.autoscaling) for pool in config.pools}
        self.hash_keys: tuple[str, ...] | None = None  # from the first worker to register
        self.events: collections.deque[str] = collections.deque(maxlen=200)
        self.start_errors: list[str] = []
        self._ids = itertools.count()
        self._monitor: asyncio.Task | None = None
        self._placed = self._refused = self._failovers = 0
        # request id -> its prefill source's worker id, while the request is placed
        self._paired: dict[str, str] = {}
        self._lora_of: dict[str, str] = {}
        self._init_loras()
        # True once every pool has had its starting workers healthy (or, restarted, the
        # cluster it takes back was up): until then no idle worker is drained, since a
        # pool that waits for its last workers to load is not idle, and ``wait_ready``
        # waits for every starting worker.
        self._up = False
        if self.restarted:  # nobody calls start() on a restarted actor: resume at once
            self._resuming = asyncio.get_running_loop().create_task(self.start())

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the configured workers and the monitor loop (once)."""
        if self._monitor is not None:
            return
        # A restarted scheduler that finds no worker (its last incarnation died before
        # it started any, or every one is gone) starts the pools as a new one does.
        if self.restarted and self._recover():
            self._up = True
        else:
            for pool in self.config.pools:
                for _ in range(pool.workers):
                    self._add_worker(pool.role)
        self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())

    def _recover(self) -> int:
        """After a restart: take back the live workers (their first report, a full one,
        makes them healthy and says which requests still run on them); how many."""
        found = worker_actors(self.config.scheduler_name, self.config.namespace)
        numbers = [-1]
        for worker_id, handle in found:
            role, _, number = worker_id.rpartition("-")
            numbers += [int(number)] if number.isdigit() else []
            record = WorkerRecord(worker_id, role, handle, resync=True, recovered=set())
            self.registry.add(record)
        self._ids = itertools.count(max(numbers) + 1)
        self._event(f"scheduler restarted: took back {len(found)} live workers")
        return len(found)

    async def wait_ready(
        self, timeout_s: float = STARTUP_TIMEOUT_S, any_healthy: bool = False
    ) -> ClusterStats:
        """Wait until every pool has its starting workers healthy (``any_healthy``: one
        healthy worker per pool, for a front end joining a running cluster that may have
        scaled down); raise if they cannot start (the first start error says why). Once
        the cluster has been up, one healthy worker per pool will do: the monitor tick that
        finds the last starting worker healthy may drain a worker idle since it loaded,
        before this loop looks again."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.start_errors and len(self.start_errors) >= MAX_START_FAILURES:
                raise RuntimeError(f"workers failed to start: {self.start_errors[0]}")
            if self._pools_ready(any_healthy or self._up):
                return self.stats()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {timeout_s} s: {self.stats()}")
            await asyncio.sleep(0.1)

    def _pools_ready(self, any_healthy: bool = False) -> bool:
        """Whether every pool has its starting number of workers healthy (one each with
        ``any_healthy``)."""
        return all(
            sum(w.role == pool.role and w.status is WorkerStatus.HEALTHY for w in self.registry)
            >= (1 if any_healthy else pool.workers)
            for pool in self.config.pools
        )

    async def shutdown(self) -> None:
        """Stop the monitor and every worker this scheduler started."""
        if self._monitor is not None:
            self._monitor.cancel()
        for worker in self.registry:
            self._remove(worker, kill=True)
        self.queue.cancel_all(Refusal(NoWorkerError, "the cluster is shutting down"))

    # ------------------------------------------------------------------ workers
    def _add_worker(self, role: str, worker_id: str | None = None) -> None:
        worker_id = worker_id or f"{role}-{next(self._ids)}"
        handle = start_worker(self.config, role, worker_id)
        self.registry.add(WorkerRecord(worker_id, role, handle))
        self._event(f"started worker {worker_id} ({role})")

    def register(self, info: WorkerInfo) -> None:
        """A worker (re)started: forget what its last incarnation held and ran."""
        worker = self.registry.get(info.worker_id)
        if worker is None:
            return
        if worker.incarnation == info.incarnation:
            worker.info = info  # what may change while it runs (its KV-transfer address)
            return
        if worker.info is not None:
            self._event(f"worker {worker.worker_id} restarted as {info.incarnation}")
        self.registry.reincarnate(worker, info)
        if self.hash_keys is not None and info.hash_keys != self.hash_keys:
            # e.g. dtype "auto" resolved on nodes that differ in AVX512_BF16: the front
            # ends hash prompts with the first worker's keys, and P/D pairs refuse blocks
            # the worker that set the keys may be this one, restarted with other keys
            first = next(
                (w for w in self.registry if w.info and w.info.hash_keys == self.hash_keys),
                None,
            )
            others = f"worker {first.worker_id}" if first else "the cluster's first worker"
            self._event(
                f"worker {worker.worker_id} hashes KV blocks with {info.hash_keys}, "
                f"{others} with {self.hash_keys} (model path, precision, bf16 kernel "
                "path): prefix affinity and KV handoffs between them are off; give every "
                "node the same model path, --dtype and CPU kind (AMX or not)",
                logging.WARNING,
            )
        self.hash_keys = self.hash_keys or info.hash_keys
        self.start_errors.clear()
        if worker.status is not WorkerStatus.DRAINING:
            worker.status = WorkerStatus.HEALTHY
        self._dispatch()

    def worker_failed(self, worker_id: str, incarnation: str | None) -> None:
        """A front end lost a stream from this worker: place nothing there until it
        answers a report again."""
        worker = self.registry.get(worker_id)
        if worker is None or worker.incarnation != incarnation:
            return
        if worker.status is WorkerStatus.HEALTHY:
            worker.status = WorkerStatus.UNHEALTHY
            worker.resync = True
            self._event(f"worker {worker_id} reported failed by a front end")

    def _remove(self, worker: WorkerRecord, kill: bool) -> None:
        self.registry.remove(worker)
        if kill:
            ray.kill(worker.handle, no_restart=True)
        # a group's placement group goes with its worker (a replacement makes its own)
        stop_group(self.config.scheduler_name, worker.worker_id)

    def set_placement(self, name: str) -> None:
        """Switch the placement policy of a running cluster (to compare policies)."""
        self.policy = make_policy(name)
        self._event(f"placement policy is now {name}")

    def set_admission(
        self, max_ongoing_requests: int | None, max_queued_requests: int | None = None
    ) -> None:
        """Change the admission limits of a running cluster (``None``: keep): ongoing
        requests per worker and the global queue's length. Raises ``ValueError`` naming
        the limit."""
        self.config = self.config.with_admission(max_ongoing_requests, max_queued_requests)
        self.queue.limit = self.config.max_queued_requests
        self._event(
            f"admission: {self.config.max_ongoing_requests} ongoing per worker, "
            f"{self.queue.limit} queued"
        )
        self._dispatch()

    def pid(self) -> int:
        """The scheduler's process id (operators, and the chaos tests, kill it)."""
        return os.getpid()

    def worker_handle(self, worker_id: str):
        """The actor handle of ``worker_id`` (operators and tests reach a worker with it)."""
        return self.registry.workers[worker_id].handle

    def drain(self, worker_id: str) -> None:
        """Stop placing on ``worker_id``; it stops once its requests finish."""
        self.registry.workers[worker_id].status = WorkerStatus.DRAINING
        self._event(f"draining worker {worker_id} (asked)")

    # ------------------------------------------------------------------ stats
    def get_config(self) -> SchedulerConfig:
        return self.config

    def model_info(self) -> WorkerInfo | None:
        """A registered worker's identity: the model's limits the front ends check
        requests against (every worker serves the same model); None before any has
        registered."""
        return next((w.info for w in self.registry if w.info is not None), None)

    def _event(self, text: str, level: int = logging.INFO) -> None:
        logger.log(level, "%s", text)
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def stats(self) -> ClusterStats:
        return ClusterStats(
            workers=self.registry.states(self.config.max_ongoing_requests),
            queued=len(self.queue),
            placed=self._placed,
            refused=self._refused,
            failovers=self._failovers,
            policy=self.policy.name,
            events=tuple(self.events),
        )


def _reconstructed() -> bool:
    """Whether this is a restarted actor (False outside an actor)."""
    try:
        return ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # no Ray, or not in an actor
        return False


#: Restarts of the scheduler actor Ray makes (each time it dies), and retries of the
#: calls it was given meanwhile.
SCHEDULER_ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1}


def scheduler_actor_class():
    """The Ray remote class (made on demand, so importing this module needs no Ray)."""
    return ray.remote(**SCHEDULER_ACTOR_OPTIONS)(Scheduler)
