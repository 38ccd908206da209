"""The scheduler's settings: what it needs to run the worker pools and admit requests.

The user-facing configuration (``ClusterConfig``) lives a layer above, in the cluster
layer, whose launcher builds this from it (``scheduler_config``), with the workers'
device resolved, when it starts the scheduler actor. Only the admission
limits change while the scheduler runs (``Scheduler.set_admission``), by replacing
the whole object.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from tessera.scheduler.autoscaler import PoolPolicy
from tessera.scheduler.placement import POLICIES
from tessera.workers.config import EngineConfig
from tessera.workers.process.protocol import DECODE, PREFILL, ROLES

if typing.TYPE_CHECKING:  # its module loads the engine (torch): the front ends never do
    from tessera.workers.process.disaggregation import KVTransferConfig


@dataclass(frozen=True, slots=True)
class WorkerPool:
    """The workers of one role: how many start with the cluster, and how many the
    autoscaler may run."""

    role: str
    workers: int
    autoscaling: PoolPolicy


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    pools: tuple[WorkerPool, ...]  # mixed workers, or prefill + decode workers
    # -- each worker actor
    engine: EngineConfig  # the device is resolved (cpu or cuda), never auto
    worker_num_gpus: float
    worker_num_cpus: float  # also the worker's torch threads (at least 1)
    worker_max_restarts: int  # -1: forever
    role_resources: bool  # a worker also asks Ray for one unit of 'tessera-<role>'
    kv_transfer: KVTransferConfig
    # -- placement and admission
    placement: str  # the policy's name (``placement.POLICIES``)
    max_ongoing_requests: int  # a worker's capacity; more requests wait in the queue
    max_queued_requests: int  # the global queue's length; beyond it, refused at once
    queue_timeout_s: float  # a request's default deadline to leave the queue
    # -- health
    report_interval_s: float
    health_timeout_s: float  # a worker that does not report in this long is unhealthy
    # -- Ray names: the workers find the scheduler by them, to register
    scheduler_name: str
    namespace: str
    # -- tensor-parallel groups: a group's ranks may span nodes (CPU groups); the prefill
    # workers' own group size (None: the engine's)
    tensor_parallel_spread: bool = False
    prefill_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        roles = [pool.role for pool in self.pools]
        if not roles or len(set(roles)) != len(roles) or not set(roles) <= set(ROLES):
            raise ValueError(f"pools: one pool per role of {ROLES}, got {roles}")
        if self.placement not in POLICIES:
            raise ValueError(
                f"placement: must be one of {sorted(POLICIES)}, got {self.placement!r}"
            )
        _check_int("max_ongoing_requests", self.max_ongoing_requests, 1)

        _check_int("max_queued_requests", self.max_queued_requests, 0)

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode workers: a request for "a worker" goes to a decode worker."""
        return any(pool.role == DECODE for pool in self.pools)

    def engine_for(self, role: str) -> EngineConfig:
        """The engine settings of a worker of ``role`` (prefill workers may be groups of
        another size)."""
        size = self.prefill_tensor_parallel_size
        if role != PREFILL or size is None or size == self.engine.tensor_parallel_size:
            return self.engine
        return dataclasses.replace(self.engine, tensor_parallel_size=size)

    @property
    def model(self) -> str | None:
        """The model every worker serves (a front end joining the cluster loads its
        tokenizer)."""
        return self.engine.model

    def with_admission(
        self, max_ongoing_requests: int | None, max_queued_requests: int | None
    ) -> SchedulerConfig:
        """The same settings with new admission limits (``None``: keep); raises
        ``ValueError`` naming the limit."""
        return dataclasses.replace(
            self,
            max_ongoing_requests=(
                self.max_ongoing_requests if max_ongoing_requests is None else max_ongoing_requests
            ),
            max_queued_requests=(
                self.max_queued_requests if max_queued_requests is None else max_queued_requests
            ),
        )


def _check_int(name: str, value: object, low: int) -> None:
    # In the cluster configuration's words (pydantic's): the same limits, the same errors.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: Input should be a valid integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name}: Input should be greater than or equal to {low}, got {value!r}")
