"""Worker-pool autoscaling: when to add a worker, which idle one to drain, and when a
draining one may stop.

Pure decisions over snapshots, so they can be tested without Ray; the scheduler
actor carries them out. Per role (one ``Autoscaler`` per pool):

- **Scale up** by one when *pressure* has lasted ``upscale_delay_s``: requests wait
  in the global queue, an engine has sequences it cannot batch, or a pool-wide mean
  is above its target. Each role watches the load it carries (``PoolPolicy.for_role``):

  ========  ===========================================================
  mixed     ongoing requests (Ray Serve's knob), KV usage
  decode    ongoing requests, running sequences, KV usage
  prefill   prompt tokens queued and not computed yet (a prefill worker
            is never placed on: decode workers pull from it)
  ========  ===========================================================

  A target of ``inf`` is no signal. While a worker is starting no other is added (it
  will take its share of the load), and the pressure clock restarts after each
  decision, so one burst adds one worker at a time.
- **Scale down** by draining one worker that has had no work of its own for
  ``downscale_delay_s``, while more than ``min_workers`` are active. A draining worker
  takes no new placements (a draining prefill worker is no request's prefill source)
  and is stopped only once ``PoolMember.stoppable``: nothing ongoing needs it any more,
  and it is idle. Never by killing work in progress.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera.workers.process.protocol import DECODE, MIXED, PREFILL, ROLES

#: A target that is never exceeded: the signal is not watched.
UNWATCHED = math.inf


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    """One pool's bounds, delays and pressure targets (pool-wide means per worker)."""

    min_workers: int
    max_workers: int
    upscale_delay_s: float
    downscale_delay_s: float
    target_kv_usage: float = UNWATCHED
    target_ongoing_requests: float = UNWATCHED
    target_running_sequences: float = UNWATCHED
    target_queued_prompt_tokens: float = UNWATCHED

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"min_workers: must be between 0 and max_workers ({self.max_workers}), "
                f"got {self.min_workers}"
            )
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @classmethod
    def for_role(
        cls,
        role: str,
        *,
        min_workers: int,
        max_workers: int,
        upscale_delay_s: float,
        downscale_delay_s: float,
        target_kv_usage: float,
        target_ongoing_requests: float,
        target_prefill_queue_tokens: float,
    ) -> PoolPolicy:
        """The policy of ``role``'s pool: the cluster's targets, those its load shows
        (see the module doc); the others are not watched."""
        if role == PREFILL:
            targets = {"target_queued_prompt_tokens": target_prefill_queue_tokens}
        elif role == DECODE:
            targets = {
                "target_kv_usage": target_kv_usage,
                "target_ongoing_requests": target_ongoing_requests,
                "target_running_sequences": target_ongoing_requests,
            }
        elif role == MIXED:
            targets = {
                "target_kv_usage": target_kv_usage,
                "target_ongoing_requests": target_ongoing_requests,
            }
        else:
            raise ValueError(f"role: must be one of {ROLES}, got {role!r}")
        return cls(min_workers, max_workers, upscale_delay_s, downscale_delay_s, **targets)


@dataclass(frozen=True, slots=True)
class PoolMember:
    worker_id: str
    starting: bool  # not registered yet
    draining: bool
    # requests that may still need it: placed on it (mixed, decode), or placed with it
    # as their prefill source (prefill: their decode worker may still pull from it)
    ongoing: int
    waiting: int  # engine-queued sequences
    kv_usage: float
    idle_since: float | None  # when it last had work of its own; None while it has any
    running: int = 0  # sequences in its engine's batch
    queued_prompt_tokens: int = 0  # prompt tokens in its engine not computed yet

    @property
    def stoppable(self) -> bool:
        """A draining worker with nothing left to finish: no ongoing request needs it
        and it is idle (a prefill worker reports that itself)."""
        return self.draining and not self.ongoing and self.idle_since is not None


@dataclass(frozen=True, slots=True)
class Decision:
    add: int = 0
    drain: tuple[str, ...] = ()


@dataclass(slots=True)
class Autoscaler:
    policy: PoolPolicy
    _pressure_since: float | None = field(default=None)

    def decide(self, now: float, members: Sequence[PoolMember], queued: int) -> Decision:
        active = [m for m in members if not m.draining]
        if len(active) < self.policy.min_workers:  # a worker died for good: replace it
            self._pressure_since = None
            return Decision(add=self.policy.min_workers - len(active))
        running = [m for m in active if not m.starting]
        pressure = self.pressure(running, queued)
        if not pressure or len(running) < len(active):  # none while one is starting
            self._pressure_since = None
        elif self._pressure_since is None:
            self._pressure_since = now
        if (
            self._pressure_since is not None
            and now - self._pressure_since >= self.policy.upscale_delay_s
            and len(active) < self.policy.max_workers
        ):
            self._pressure_since = None
            return Decision(add=1)
        if pressure or len(active) <= self.policy.min_workers:
            return Decision()
        idle = [
            m
            for m in running
            if m.idle_since is not None and now - m.idle_since >= self.policy.downscale_delay_s
        ]
        if not idle:
            return Decision()
        # The longest idle goes first; ties: the highest id (the most recently added).
        victim = max(idle, key=lambda m: (now - m.idle_since, m.worker_id))
        return Decision(drain=(victim.worker_id,))

    def pressure(self, running: Sequence[PoolMember], queued: int) -> bool:
        """Whether the pool's running (registered, not draining) members are short of
        room: anything queued for the role or in an engine's queue, or a mean above
        its target."""
        if queued > 0 or any(m.waiting > 0 for m in running):
            return True
        if not running:
            return False
        policy, count = self.policy, len(running)
        means = (
            (sum(m.kv_usage for m in running), policy.target_kv_usage),
            (sum(m.ongoing for m in running), policy.target_ongoing_requests),
            (sum(m.running for m in running), policy.target_running_sequences),
            (sum(m.queued_prompt_tokens for m in running), policy.target_queued_prompt_tokens),
        )
        return any(total / count > target for total, target in means)
