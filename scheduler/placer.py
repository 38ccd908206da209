"""The scheduler's request placement: a worker for each request, now or once one frees up.

A request goes to a ``HEALTHY`` worker of its role below its capacity, the one the
placement policy (``tessera.scheduler.placement``) chooses; a decode worker's request is
paired with the prefill worker it pulls the prompt's blocks from. When every worker is
full the request waits in the global queue (``AdmissionQueue``) until a place frees up
or its deadline passes; a full queue, a passed deadline or a role with no worker left is
a ``Refusal``. Each release (a stream ended, moved or was abandoned) places the queued
requests that now fit, oldest first.
"""

from __future__ import annotations

from tessera.scheduler.admission import AdmissionQueue
from tessera.scheduler.api import (
    DeadlineError,
    NoWorkerError,
    OverloadedError,
    Placement,
    Refusal,
    RequestIdInUseError,
    WorkerStatus,
)
from tessera.scheduler.config import SchedulerConfig
from tessera.scheduler.placement import Candidate, PlacementPolicy
from tessera.scheduler.registry import Registry, WorkerRecord
from tessera.workers.api import PrefillSource
from tessera.workers.process.protocol import DECODE, MIXED, PREFILL


class Placer:
    """The placement part of ``Scheduler`` (``tessera.scheduler.actor``), one of its
    bases: it reads and updates the scheduler's state declared here."""

    config: SchedulerConfig
    policy: PlacementPolicy
    registry: Registry
    queue: AdmissionQueue
    hash_keys: tuple[str, ...] | None
    _paired: dict[str, str]
    _lora_of: dict[str, str]  # request id -> its adapter's digest, while placed or queued
    _placed: int
    _refused: int
    _failovers: int

    async def place(
        self,
        request_id: str,
        block_hashes: list[bytes],
        role: str = "mixed",
        timeout_s: float | None = None,
        failover: bool = False,
        worker_request_ids: tuple[str, ...] = (),
        lora: str | None = None,
    ) -> Placement | Refusal:
        """A worker for the request, now or once one frees up; a ``Refusal`` when the
        queue is full, the deadline passes or no worker of ``role`` is left.
        ``block_hashes``: its prompt's full blocks, hashed by the front end as
        ``block_hashing`` says (empty: placement ignores the prefix caches).
        ``worker_request_ids``: the ids the front end will run it under on the worker
        (for ``abort``). Placing a request that is already placed (``failover``) moves it;
        a new request under the id of one placed or waiting is refused
        (``RequestIdInUseError``), so that one front end's request cannot move
        another's place. ``lora``: its adapter's digest (workers holding it score
        higher)."""
        if not failover and (
            request_id in self.registry.placements or self.queue.holds(request_id)
        ):
            self._refused += 1
            return Refusal(RequestIdInUseError, "another running request has this id")
        self.release(request_id)
        if lora is not None:
            self._lora_of[request_id] = lora
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
        self._lora_of.pop(request_id, None)
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
        lora = self._lora_of.get(request_id)

        def holds(w: WorkerRecord) -> bool:  # the request's adapter is in its slots
            return lora is not None and w.load is not None and lora in w.load.engine.loras

        candidates = [
            Candidate(
                worker_id=w.worker_id,
                ongoing=w.in_flight,
                capacity=capacity,
                kv_usage=w.load.engine.kv_usage if w.load else 0.0,
                matched_blocks=self.registry.index.matched(w.worker_id, hashes),
                holds_adapter=holds(w),
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
        return PrefillSource(best.worker_id, best.info.kv_address, best.info.hash_keys)

    def _dispatch(self) -> None:
        """Place queued requests, oldest first, while workers have room."""
        self.queue.dispatch(
            lambda w: self._try_place(w.request_id, w.role, w.hashes, w.worker_request_ids)
        )
