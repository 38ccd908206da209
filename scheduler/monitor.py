"""The scheduler's monitor: its workers' health, and the size of their pools.

Every ``report_interval_s`` a tick pulls a report from each worker (that is the health
check): a worker that does not answer within ``health_timeout_s`` is unhealthy until it
answers again, and one Ray gave up on (killed, or out of restarts) is replaced. A
report brings the worker's load, the requests running there (placements whose front end
is gone are released) and its prefix cache's changes (the prefix index follows them).
The same tick asks each pool's autoscaler whether to add workers or drain idle ones,
and stops drained workers that nothing needs any more.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from ray.exceptions import ActorDiedError, RayActorError

from tessera.scheduler.admission import AdmissionQueue
from tessera.scheduler.api import WorkerStatus
from tessera.scheduler.autoscaler import Autoscaler, PoolMember
from tessera.scheduler.config import SchedulerConfig
from tessera.scheduler.registry import Registry, WorkerRecord
from tessera.scheduler.worker_actors import MAX_START_FAILURES, STARTUP_TIMEOUT_S
from tessera.workers.process.protocol import PREFILL

logger = logging.getLogger(__name__)

#: A request placed this long ago and not running on its worker (by the worker's
#: report) is released: the front end that streamed it is gone.
ORPHAN_GRACE_S = 10.0


class WorkerMonitor:
    """The monitor's part of ``Scheduler`` (``tessera.scheduler.actor``), one of its
    bases: it reads and updates the scheduler's state declared here, and calls its
    ``register``, ``_add_worker``, ``_remove``, ``_dispatch`` and ``_event``."""

    config: SchedulerConfig
    registry: Registry
    queue: AdmissionQueue
    autoscalers: dict[str, Autoscaler]
    start_errors: list[str]
    _paired: dict[str, str]
    _up: bool

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
