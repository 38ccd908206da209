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
from ray.exceptions import ActorDiedError, RayActorError

from tessera.scheduler.admission import AdmissionQueue
from tessera.scheduler.api import (
    ClusterStats,
    DeadlineError,
    NoWorkerError,
    OverloadedError,
    Placement,
    Refusal,
    WorkerStatus,
)
from tessera.scheduler.autoscaler import Autoscaler, PoolMember
from tessera.scheduler.config import SchedulerConfig
from tessera.scheduler.placement import Candidate, make_policy
from tessera.scheduler.registry import Registry, WorkerRecord
from tessera.workers.process.actor import worker_actor_class
from tessera.workers.process.protocol import DECODE, MIXED, PREFILL, PrefillSource, WorkerInfo

logger = logging.getLogger(__name__)

#: A starting worker (loading its model) may take this long to answer its first report.
STARTUP_TIMEOUT_S = 600.0
#: Workers that die before registering, in a row, before the scheduler stops replacing them.
MAX_START_FAILURES = 3
#: A request placed this long ago and not running on its worker (by the worker's
#: report) is released: the front end that streamed it is gone.
ORPHAN_GRACE_S = 10.0


class Scheduler:
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
        handle = (
            worker_actor_class()
            .options(
                # detached and named: a restarted scheduler finds it (see the module doc)
                name=worker_actor_name(self.config.scheduler_name, worker_id),
                namespace=self.config.namespace,
                lifetime="detached",
                scheduling_strategy="SPREAD",  # over the Ray nodes: a lost node costs least
                num_cpus=self.config.worker_num_cpus,
                num_gpus=self.config.worker_num_gpus,
                resources={f"tessera-{role}": 1} if self.config.role_resources else None,
                max_restarts=self.config.worker_max_restarts,
                max_task_retries=0,  # a broken stream fails over from the front end
            )
            .remote(
                worker_id,
                role,
                self.config.engine,
                self.config.scheduler_name,
                self.config.namespace,
                max(1, int(self.config.worker_num_cpus)),
                self.config.kv_transfer,
            )
        )
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

    def _on_dead(self, worker: WorkerRecord, error: BaseException) -> None:
        """Ray gave up on the actor (killed, or out of restarts): replace it."""
        if self.registry.get(worker.worker_id) is not worker:
            return
        self._remove(worker, kill=False)
        if worker.status is WorkerStatus.DRAINING:
            return
        if worker.info is None:
            self.start_errors.append(str(error).strip().splitlines()[-1] if str(error) else "")
            if len(self.start_errors) >= MAX_START_FAILURES:
                self._event(f"worker {worker.worker_id} failed to start; not replacing it")
                return
        self._event(f"worker {worker.worker_id} died; starting a replacement")
        self._add_worker(worker.role, worker.worker_id)

    async def _poll(self, worker: WorkerRecord) -> None:
        timeout = (
            STARTUP_TIMEOUT_S
            if worker.status is WorkerStatus.STARTING
            else self.config.health_timeout_s
        )
        asked, asked_at = worker.incarnation, time.monotonic()
        try:
            info, load = await asyncio.wait_for(worker.handle.report.remote(worker.resync), timeout)
        except ActorDiedError as error:
            self._on_dead(worker, error)
            return
        except (TimeoutError, RayActorError) as error:
            if worker.incarnation != asked:
                # Asked of an earlier incarnation: the restarted worker registered
                # meanwhile (it does at start), and answers the next poll.
                return
            if worker.status is WorkerStatus.HEALTHY:
                self._event(f"worker {worker.worker_id} unhealthy: {type(error).__name__}")
                worker.status = WorkerStatus.UNHEALTHY
            worker.resync = True
            return
        if self.registry.get(worker.worker_id) is not worker:
            return
        self.register(info)
        if worker.recovered is not None and not worker.recovered and worker.load is None:
            worker.recovered.update(load.request_ids)  # its first report since the restart
        worker.recount(load.request_ids)
        orphans = self.registry.orphans(worker, load.request_ids, asked_at - ORPHAN_GRACE_S)
        for request_id in orphans:
            self.registry.release(request_id)
        if orphans:
            self._event(f"released {len(orphans)} request(s) gone from {worker.worker_id}")
            self._dispatch()
        if load.snapshot is not None:
            self.registry.index.reset(worker.worker_id, load.snapshot)
        else:
            self.registry.index.apply(worker.worker_id, load.events)
        worker.load = load
        worker.resync = False
        if worker.status is WorkerStatus.UNHEALTHY:
            worker.status = WorkerStatus.HEALTHY
            self._event(f"worker {worker.worker_id} healthy again")
            self._dispatch()

    async def _monitor_loop(self) -> None:
        while True:
            try:
                for worker in self.registry:
                    if worker.poll is None or worker.poll.done():
                        worker.poll = asyncio.get_running_loop().create_task(self._poll(worker))
                self._autoscale()
            except Exception:  # the monitor must outlive any one bad tick
                logger.exception("scheduler monitor tick failed")
            await asyncio.sleep(self.config.report_interval_s)

    def _autoscale(self) -> None:
        now = time.monotonic()
        self._up = self._up or self._pools_ready()
        paired = self._paired_counts()
        for role, autoscaler in self.autoscalers.items():
            pool = [w for w in self.registry if w.role == role]
            members = [self._member(w, now, paired) for w in pool]
            for member in members:  # drained: nothing needs it any more
                if member.stoppable:
                    self._remove(self.registry.workers[member.worker_id], kill=True)
                    self._event(f"stopped drained worker {member.worker_id}")
            if len(self.start_errors) >= MAX_START_FAILURES:
                continue  # do not spin up workers that cannot start
            decision = autoscaler.decide(now, members, self.queue.waiting(role))
            for _ in range(decision.add):
                self._add_worker(role)
                self._event(f"scaled {role} up to {len(pool) + 1} workers")
            for worker_id in decision.drain if self._up else ():
                self.registry.workers[worker_id].status = WorkerStatus.DRAINING
                self._event(f"draining idle worker {worker_id}")

    def _member(self, worker: WorkerRecord, now: float, paired: dict[str, int]) -> PoolMember:
        """The autoscaler's view of a worker. A prefill worker is never placed on: its
        ongoing requests are those placed with it as their prefill source, and its
        idleness is what it reports (``WorkerLoad.idle_s``)."""
        load = worker.load
        engine = load.engine if load is not None else None
        if worker.role == PREFILL:
            ongoing = paired.get(worker.worker_id, 0)
            idle = load is not None and load.idle_s is not None
            idle_since = now - load.idle_s if idle else None
        else:
            ongoing = worker.in_flight
            idle_since = worker.idle_since if not worker.in_flight else None
        return PoolMember(
            worker_id=worker.worker_id,
            starting=worker.status is WorkerStatus.STARTING,
            draining=worker.status is WorkerStatus.DRAINING,
            ongoing=ongoing,
            waiting=engine.waiting if engine else 0,
            kv_usage=engine.kv_usage if engine else 0.0,
            idle_since=idle_since,
            running=engine.running if engine else 0,
            queued_prompt_tokens=engine.queued_prompt_tokens if engine else 0,
        )

    def _paired_counts(self) -> dict[str, int]:
        """Per prefill worker, the placed requests it is the prefill source of (their
        decode workers may still pull from it); pairs of requests no longer placed (their
        decode worker died, or they were released) are forgotten here."""
        placements = self.registry.placements
        for request_id in [r for r in self._paired if r not in placements]:
            del self._paired[request_id]
        return collections.Counter(self._paired.values())

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

    # ------------------------------------------------------------------ placement
    async def place(
        self,
        request_id: str,
        block_hashes: list[bytes],
        role: str = "mixed",
        timeout_s: float | None = None,
        failover: bool = False,
        worker_request_ids: tuple[str, ...] = (),
    ) -> Placement | Refusal:
        """A worker for the request, now or once one frees up; a ``Refusal`` when the
        queue is full, the deadline passes or no worker of ``role`` is left.
        ``block_hashes``: its prompt's full blocks, hashed by the front end as
        ``block_hashing`` says (empty: placement ignores the prefix caches).
        ``worker_request_ids``: the ids the front end will run it under on the worker
        (for ``abort``). Placing a request that is already placed (``failover``) moves it."""
        self.release(request_id)
        if failover:
            self._failovers += 1
        hashes = list(block_hashes)
        ids = worker_request_ids or (request_id,)
        if self.config.disaggregated and role == MIXED:  # the front end asks for "a worker"
            role = DECODE
        placement = self._try_place(request_id, role, hashes, ids)
        if placement is not None:
            return placement
        if not any(w.role == role for w in self.registry):
            self._refused += 1
            return Refusal(NoWorkerError, f"no {role} worker is left in the cluster")
        if self.queue.full:
            self._refused += 1
            return Refusal(
                OverloadedError,
                f"overloaded: every worker is at capacity and the global queue is full "
                f"({len(self.queue)} waiting, max_queued_requests={self.queue.limit}); "
                "retry later",
            )
        timeout_s = timeout_s if timeout_s is not None else self.config.queue_timeout_s
        outcome = await self.queue.wait(request_id, role, hashes, ids, timeout_s)
        if outcome is None:
            self._refused += 1
            return Refusal(
                DeadlineError,
                f"overloaded: no worker could take the request within its deadline "
                f"({timeout_s} s in the global queue)",
            )
        return outcome

    def release(self, request_id: str) -> None:
        """The request's stream ended (or moved), or its caller left while it waited:
        free its place on its worker, or in the queue."""
        self.queue.cancel(request_id, Refusal(OverloadedError, "withdrawn from the queue"))
        self._paired.pop(request_id, None)
        if self.registry.release(request_id) is not None:
            self._dispatch()

    def abort(self, request_id: str) -> bool:
        """Abort a placed request on its worker (from any front end); False if unknown."""
        placed = self.registry.placed_on(request_id)
        if placed is None:  # placed before a restart: by the ids its parts run under
            placed = self.registry.recovered_on(request_id)
        if placed is None:
            return False
        worker, ids = placed
        for worker_request_id in ids:
            worker.handle.abort.remote(worker_request_id)
        return True

    def block_hashing(self) -> tuple[int, tuple[str, ...] | None] | None:
        """How a front end hashes a prompt's blocks as the workers' prefix caches do,
        once per request (the scheduler never rehashes): the block size and the
        model's extra hash keys (None until a worker has registered), followed by the
        request's cache salt. None when prefix caching is off."""
        engine = self.config.engine
        if not engine.enable_prefix_caching:
            return None
        return engine.block_size, self.hash_keys

    def _try_place(
        self, request_id: str, role: str, hashes: list[bytes], worker_request_ids: tuple[str, ...]
    ) -> Placement | None:
        capacity = self.config.max_ongoing_requests
        candidates = [
            Candidate(
                worker_id=w.worker_id,
                ongoing=w.in_flight,
                capacity=capacity,
                kv_usage=w.load.engine.kv_usage if w.load else 0.0,
                matched_blocks=self.registry.index.matched(w.worker_id, hashes),
            )
            for w in self.registry
            if w.role == role and w.status is WorkerStatus.HEALTHY and w.in_flight < capacity
        ]
        if not candidates:
            return None
        chosen = self.policy.choose(candidates, len(hashes))
        worker = self.registry.workers[chosen.worker_id]
        self.registry.place(worker, request_id, worker_request_ids, hashes)
        self._placed += 1
        prefill = self._prefill_source(hashes) if role == DECODE else None
        if prefill is not None:  # a draining prefill worker stops only once it is unpaired
            self._paired[request_id] = prefill.worker_id
        return Placement(
            request_id=request_id,
            worker_id=worker.worker_id,
            incarnation=worker.incarnation,
            worker=worker.handle,
            matched_blocks=chosen.matched_blocks,
            prefill=prefill,
        )

    def _prefill_source(self, hashes: list[bytes]) -> PrefillSource | None:
        """The prefill worker a decode worker pulls from: the one holding most of the
        prompt's leading blocks (it computes less; after a failover, the one that
        prefilled it), then the least busy. Only a ``HEALTHY`` one: never a draining
        one (it is to stop) or one that is not answering. None when none is up: the
        decode worker then prefills itself."""
        ready = [
            w
            for w in self.registry
            if w.role == PREFILL
            and w.status is WorkerStatus.HEALTHY
            and w.info is not None
            and w.info.kv_address is not None
        ]
        if not ready:
            return None
        best = max(
            ready,
            key=lambda w: (
                self.registry.index.matched(w.worker_id, hashes),
                -(w.load.requests + w.load.engine.running if w.load else 0),
            ),
        )
        return PrefillSource(best.worker_id, best.info.kv_address)

    def _dispatch(self) -> None:
        """Place queued requests, oldest first, while workers have room."""
        self.queue.dispatch(
            lambda w: self._try_place(w.request_id, w.role, w.hashes, w.worker_request_ids)
        )

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


def worker_actor_name(scheduler_name: str, worker_id: str) -> str:
    """The Ray name of a worker actor: ``<scheduler name>/<worker id>``."""
    return f"{scheduler_name}/{worker_id}"


def worker_actors(scheduler_name: str, namespace: str) -> list[tuple[str, object]]:
    """(worker id, handle) of each live worker actor of that scheduler."""
    prefix = worker_actor_name(scheduler_name, "")
    found = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == namespace and actor["name"].startswith(prefix):
            try:
                handle = ray.get_actor(actor["name"], namespace=namespace)
            except ValueError:  # gone since it was listed
                continue
            found.append((actor["name"].removeprefix(prefix), handle))
    return found


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
