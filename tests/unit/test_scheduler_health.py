"""The scheduler's health checks against a worker handle that never answers (Ray holds
calls to an actor while it restarts): which timeouts mark a worker unhealthy."""

from __future__ import annotations

import asyncio

from tessera.cluster.config import ClusterConfig
from tessera.cluster.launch import scheduler_config
from tessera.scheduler.actor import Scheduler
from tessera.scheduler.api import WorkerStatus
from tessera.scheduler.registry import WorkerRecord
from tessera.workers.process.protocol import WorkerInfo


class _Silent:
    """A worker actor handle whose reports never come back."""

    class report:
        @staticmethod
        def remote(resync: bool) -> asyncio.Future:
            return asyncio.get_running_loop().create_future()


def _info(incarnation: str, worker_id: str = "mixed-0", precision: str = "float32") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role="mixed",
        incarnation=incarnation,
        hash_keys=("model", precision),
        block_size=16,
        total_blocks=64,
        max_num_seqs=8,
        max_model_len=512,
        vocab_size=100,
        node_id="node",
        pid=1,
        precision=precision,
    )


def _events(scheduler: Scheduler) -> list[str]:
    return [event.split(" ", 1)[1] for event in scheduler.events]  # without the time


async def test_a_poll_of_the_previous_incarnation_does_not_fail_the_restarted_worker():
    config = scheduler_config(ClusterConfig.create(health_timeout_s=0.2), "cpu", 0, 1)
    scheduler = Scheduler(config)
    worker = WorkerRecord("mixed-0", "mixed", _Silent())
    scheduler.registry.add(worker)
    scheduler.register(_info("first"))
    assert worker.status is WorkerStatus.HEALTHY

    # The poll asks the first incarnation; the restarted actor registers before it times out.
    poll = asyncio.create_task(scheduler._poll(worker))
    await asyncio.sleep(0.05)
    scheduler.register(_info("second"))
    await poll
    assert worker.status is WorkerStatus.HEALTHY
    assert worker.restarts == 1
    assert "worker mixed-0 restarted as second" in _events(scheduler)
    assert not any("unhealthy" in event for event in _events(scheduler))

    # A poll of the current incarnation that times out does mark it unhealthy.
    await scheduler._poll(worker)
    assert worker.status is WorkerStatus.UNHEALTHY
    assert worker.resync
    assert _events(scheduler)[-1] == "worker mixed-0 unhealthy: TimeoutError"


def test_a_placement_no_longer_running_on_its_worker_is_released_after_the_grace():
    """A front end that died with its streams never releases them: the worker's reports
    show them gone, and past the grace the scheduler frees their places."""
    from tessera.scheduler.registry import Registry

    registry = Registry()
    worker = WorkerRecord("mixed-0", "mixed", handle=None)
    registry.add(worker)
    registry.place(worker, "lost", ("lost",), [])
    registry.place(worker, "parts", ("parts:0", "parts:1"), [])
    registry.place(worker, "running", ("running",), [])
    placed = registry.placed_at["lost"]

    # within the grace nothing is an orphan, running or not
    assert registry.orphans(worker, ("running",), before=placed) == []
    # past it: those of which no id runs ("parts" runs while one of its parts does)
    later = placed + 1
    assert registry.orphans(worker, ("running", "parts:1"), before=later) == ["lost"]
    assert sorted(registry.orphans(worker, ("running",), before=later)) == ["lost", "parts"]
    registry.release("lost")
    assert worker.ongoing == {"parts", "running"} and "lost" not in registry.placed_at


async def test_a_scheduler_restarted_before_it_started_any_worker_starts_the_pools(monkeypatch):
    """Its last incarnation died during start-up (on a node that went away): there is
    nothing to take back, so it starts every pool's workers, as a new one does, or the
    front end waiting for them would wait for ever."""
    import tessera.scheduler.actor as actor

    class _Recording(Scheduler):
        def _add_worker(self, role: str, worker_id: str | None = None) -> None:
            self.added.append(role)  # as a started worker, without Ray
            worker_id = worker_id or f"{role}-{next(self._ids)}"
            self.registry.add(WorkerRecord(worker_id, role, _Silent()))

    def restarted_scheduler(found):
        monkeypatch.setattr(actor, "worker_actors", lambda name, namespace: found)
        monkeypatch.setattr(actor, "_reconstructed", lambda: True)
        config = ClusterConfig.create(prefill_workers=2, decode_workers=1, min_prefill_workers=1)
        scheduler = _Recording.__new__(_Recording)
        scheduler.added = []
        Scheduler.__init__(scheduler, scheduler_config(config, "cpu", 0, 1))
        return scheduler

    scheduler = restarted_scheduler([])
    await scheduler._resuming
    assert sorted(scheduler.added) == ["decode", "prefill", "prefill"]
    assert scheduler.events[-1].endswith("scheduler restarted: took back 0 live workers")
    scheduler._monitor.cancel()

    # one of each is left (the pools' minimum): take them back, start none
    scheduler = restarted_scheduler([("prefill-0", _Silent()), ("decode-2", _Silent())])
    await scheduler._resuming
    assert scheduler.added == []
    assert list(scheduler.registry.workers) == ["prefill-0", "decode-2"]
    scheduler._monitor.cancel()


def test_a_worker_whose_block_hash_keys_differ_from_the_clusters_is_named():
    """dtype "auto" resolves per node: a worker on a node without AVX512_BF16 computes in
    float32 while the others run the fast mode. Its blocks never match the front ends'
    hashes, so the scheduler says so, naming both workers and their keys."""
    config = scheduler_config(ClusterConfig.create(), "cpu", 0, 1)
    scheduler = Scheduler(config)
    for worker_id in ("mixed-0", "mixed-1"):
        scheduler.registry.add(WorkerRecord(worker_id, "mixed", _Silent()))
    scheduler.register(_info("a", "mixed-0", "fast"))
    scheduler.register(_info("b", "mixed-1", "float32"))
    assert scheduler.hash_keys == ("model", "fast")  # the front ends keep the first's
    assert _events(scheduler)[-1] == (
        "worker mixed-1 hashes KV blocks with ('model', 'float32'), worker mixed-0 with "
        "('model', 'fast') (model path, precision, bf16 kernel path): prefix affinity and "
        "KV handoffs between them are off; give every node the same model path, --dtype and "
        "CPU kind (AMX or not)"
    )
    scheduler.register(_info("c", "mixed-0", "fast"))  # a restart with the same keys: quiet
    assert _events(scheduler)[-1] == "worker mixed-0 restarted as c"


def test_the_only_worker_with_the_first_keys_restarting_with_others_is_named():
    config = scheduler_config(ClusterConfig.create(), "cpu", 0, 1)
    scheduler = Scheduler(config)
    scheduler.registry.add(WorkerRecord("mixed-0", "mixed", _Silent()))
    scheduler.register(_info("a", "mixed-0", "fast"))
    scheduler.register(_info("b", "mixed-0", "float32"))  # restarted on another node
    assert _events(scheduler)[-1] == (
        "worker mixed-0 hashes KV blocks with ('model', 'float32'), the cluster's first "
        "worker with ('model', 'fast') (model path, precision, bf16 kernel path): prefix "
        "affinity and KV handoffs between them are off; give every node the same model path, "
        "--dtype and CPU kind (AMX or not)"
    )
