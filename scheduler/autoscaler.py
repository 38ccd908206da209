"""Worker-pool autoscaling: when to add a worker, and which idle one to drain.

Pure decisions over snapshots, so they can be tested without Ray; the scheduler
actor carries them out. Per role:

- **Scale up** by one when *pressure* has lasted ``upscale_delay_s``: requests wait
  in the global queue, an engine has sequences it cannot batch, the mean number of
  ongoing requests per worker is above ``target_ongoing_requests`` (Ray Serve's knob),
  or the mean KV usage is above ``target_kv_usage``. While a worker is starting no
  other is added (it will take its share of the load), and the pressure clock restarts
  after each decision, so one burst adds one worker at a time.
- **Scale down** by draining one worker that has had no request for
  ``downscale_delay_s``, while more than ``min_workers`` are active. A draining worker
  takes no new placements and is stopped only once its last request has finished:
  never by killing work in progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    min_workers: int
    max_workers: int
    upscale_delay_s: float
    downscale_delay_s: float
    target_kv_usage: float
    target_ongoing_requests: float = float("inf")


@dataclass(frozen=True, slots=True)
class PoolMember:
    worker_id: str
    starting: bool  # not registered yet
    draining: bool
    ongoing: int
    waiting: int  # engine-queued sequences
    kv_usage: float
    idle_since: float | None  # when its last request ended; None while it has any


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
        mean_kv = sum(m.kv_usage for m in running) / len(running) if running else 0.0
        mean_ongoing = sum(m.ongoing for m in running) / len(running) if running else 0.0
        pressure = (
            queued > 0
            or any(m.waiting > 0 for m in running)
            or mean_kv > self.policy.target_kv_usage
            or mean_ongoing > self.policy.target_ongoing_requests
        )
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
