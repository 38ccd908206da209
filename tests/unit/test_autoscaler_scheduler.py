"""The scheduler's side of prefill/decode autoscaling (scheduler/actor.py), without Ray:
the pools' policies built from the cluster config, a prefill worker's load and idleness
taken from its own report, a draining prefill worker never chosen as a prefill source,
and stopped only once no placed request is paired with it and it reports idle."""

from __future__ import annotations

import asyncio
import math

from tessera.cluster.config import ClusterConfig
from tessera.cluster.launch import scheduler_config
from tessera.scheduler.actor import Scheduler
from tessera.scheduler.api import WorkerStatus
from tessera.scheduler.registry import WorkerRecord
from tessera.workers.api import SpeculativeStats
from tessera.workers.kv.prefix_cache import PrefixCacheStats, extend_block_hashes
from tessera.workers.process.protocol import EngineLoad, WorkerInfo, WorkerLoad


class _Scheduler(Scheduler):
    """Records the workers it stops instead of asking Ray to kill them."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.stopped: list[str] = []

    def _remove(self, worker: WorkerRecord, kill: bool) -> None:
        self.registry.remove(worker)
        self.stopped.append(worker.worker_id)


def _config(**fields) -> ClusterConfig:
    fields = {"prefill_workers": 2, "decode_workers": 1, "min_prefill_workers": 1} | fields
    return ClusterConfig.create(upscale_delay_s=100.0, downscale_delay_s=5.0, **fields)


def _scheduler(**fields) -> _Scheduler:
    scheduler = _Scheduler(scheduler_config(_config(**fields), "cpu", 0, 1))
    for worker_id in ("prefill-0", "prefill-1", "decode-2"):
        role = worker_id.split("-")[0]
        scheduler.registry.add(WorkerRecord(worker_id, role, handle=None))
        scheduler.register(
            WorkerInfo(
                worker_id=worker_id,
                role=role,
                incarnation="first",
                hash_keys=("model", "float32"),
                block_size=4,
                total_blocks=64,
                max_num_seqs=8,
                max_model_len=512,
                vocab_size=100,
                node_id="node",
                pid=1,
                kv_address=f"{worker_id}:1" if role == "prefill" else None,
            )
        )
    return scheduler


def _report(scheduler, worker_id, idle_s=None, queued_prompt_tokens=0, running=0) -> None:
    scheduler.registry.workers[worker_id].load = WorkerLoad(
        incarnation="first",
        requests=0,
        engine=EngineLoad(
            running=running,
            waiting=0,
            free_blocks=64,
            total_blocks=64,
            kv_usage=0.0,
            step_time=0.0,
            preemptions=0,
            generated_tokens=0,
            prefix_cache=PrefixCacheStats(True, 0, 0, 0, 0),
            speculation=SpeculativeStats(),
            queued_prompt_tokens=queued_prompt_tokens,
        ),
        idle_s=idle_s,
    )


def test_each_pool_gets_its_roles_policy_and_bounds():
    config = scheduler_config(
        _config(max_decode_workers=3, target_prefill_queue_tokens=500), "cpu", 0, 1
    )
    prefill, decode = (pool.autoscaling for pool in config.pools)
    assert (prefill.min_workers, prefill.max_workers) == (1, 2)
    assert (decode.min_workers, decode.max_workers) == (1, 3)
    assert prefill.target_queued_prompt_tokens == 500
    assert prefill.target_kv_usage == prefill.target_ongoing_requests == math.inf
    assert decode.target_running_sequences == decode.target_ongoing_requests == 32  # 64 / 2
    assert decode.target_kv_usage == 0.8 and decode.target_queued_prompt_tokens == math.inf


def test_a_prefill_worker_is_measured_by_its_own_report():
    scheduler = _scheduler()
    _report(scheduler, "prefill-0", idle_s=None, queued_prompt_tokens=700, running=2)
    _report(scheduler, "prefill-1", idle_s=3.0)
    busy = scheduler._member(scheduler.registry.workers["prefill-0"], 100.0, {})
    idle = scheduler._member(scheduler.registry.workers["prefill-1"], 100.0, {})
    assert (busy.queued_prompt_tokens, busy.running, busy.idle_since) == (700, 2, None)
    assert idle.idle_since == 97.0  # never placed on: idle by what it reports
    assert (busy.ongoing, idle.ongoing) == (0, 0)


def test_a_draining_prefill_worker_is_no_requests_prefill_source():
    scheduler = _scheduler()
    prompt = list(range(17))  # 4 full blocks of 4
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, 4, (*scheduler.hash_keys, ""))
    scheduler.registry.index.apply("prefill-1", [(True, h) for h in hashes])  # holds it all
    assert scheduler._prefill_source(hashes).worker_id == "prefill-1"
    scheduler.drain("prefill-1")
    assert scheduler._prefill_source(hashes).worker_id == "prefill-0"
    scheduler.drain("prefill-0")
    assert scheduler._prefill_source(hashes) is None  # the decode worker prefills itself


def test_a_drained_prefill_worker_stops_only_once_unpaired_and_idle():
    scheduler = _scheduler()
    for worker_id in ("prefill-0", "prefill-1", "decode-2"):
        _report(scheduler, worker_id, idle_s=60.0)
    placement = scheduler._try_place("r1", "decode", [], ("r1",))
    paired = placement.prefill.worker_id
    other = "prefill-1" if paired == "prefill-0" else "prefill-0"
    _report(scheduler, other, idle_s=None, running=1)  # the other one is busy
    # paired is idle by its report (past downscale_delay_s): it is drained, not stopped
    scheduler._autoscale()
    assert scheduler.registry.workers[paired].status is WorkerStatus.DRAINING
    assert scheduler.stopped == []
    assert scheduler._member(scheduler.registry.workers[paired], 0.0, {paired: 1}).ongoing == 1
    scheduler._autoscale()
    assert scheduler.stopped == []  # r1 is placed with it as its source: it may still pull
    scheduler.release("r1")
    _report(scheduler, paired, idle_s=None, running=1)  # a late pull it still serves
    scheduler._autoscale()
    assert scheduler.stopped == []
    _report(scheduler, paired, idle_s=0.2)
    scheduler._autoscale()
    assert scheduler.stopped == [paired]
    assert f"stopped drained worker {paired}" in scheduler.events[-1]
    assert scheduler.registry.workers[other].status is WorkerStatus.HEALTHY  # min_workers


def test_a_pairing_ends_with_its_placement():
    scheduler = _scheduler()
    for worker_id in ("prefill-0", "prefill-1", "decode-2"):
        _report(scheduler, worker_id, idle_s=0.0)
    placement = scheduler._try_place("r1", "decode", [], ("r1",))
    assert scheduler._paired_counts() == {placement.prefill.worker_id: 1}
    # its decode worker is gone (removed): nothing will pull for r1 any more
    scheduler.registry.remove(scheduler.registry.workers["decode-2"])
    assert scheduler._paired_counts() == {}


def test_nothing_is_drained_until_every_starting_worker_is_healthy():
    scheduler = _scheduler()
    scheduler.registry.workers["decode-2"].status = WorkerStatus.STARTING  # still loading
    for worker_id in ("prefill-0", "prefill-1"):
        _report(scheduler, worker_id, idle_s=60.0)  # idle past downscale_delay_s
    scheduler._autoscale()
    assert [w.status for w in scheduler.registry] == [WorkerStatus.HEALTHY] * 2 + [
        WorkerStatus.STARTING
    ]
    assert not any("draining" in event for event in scheduler.events)
    scheduler.registry.workers["decode-2"].status = WorkerStatus.HEALTHY  # it registered
    scheduler._autoscale()
    assert "draining idle worker prefill-1" in scheduler.events[-1]


def test_once_up_a_worker_starting_again_holds_no_drain_back():
    scheduler = _scheduler()
    scheduler._autoscale()  # every starting worker healthy: the cluster is up
    scheduler.registry.workers["decode-2"].status = WorkerStatus.STARTING  # e.g. restarting
    for worker_id in ("prefill-0", "prefill-1"):
        _report(scheduler, worker_id, idle_s=60.0)
    scheduler._autoscale()
    assert "draining idle worker prefill-1" in scheduler.events[-1]


def test_wait_ready_returns_when_the_tick_that_finds_the_cluster_up_drains_a_worker():
    """The last starting worker registers; the same monitor tick finds the cluster up and
    drains a prefill worker idle since it loaded (past downscale_delay_s). ``wait_ready``
    then sees one healthy prefill worker of the two it started with, and must not wait
    for the other (a cluster test once waited its whole 600 s for it)."""
    scheduler = _scheduler()
    scheduler.registry.workers["decode-2"].status = WorkerStatus.STARTING
    for worker_id in ("prefill-0", "prefill-1"):
        _report(scheduler, worker_id, idle_s=60.0)
    scheduler._autoscale()
    scheduler.registry.workers["decode-2"].status = WorkerStatus.HEALTHY  # it registered
    scheduler._autoscale()
    assert "draining idle worker prefill-1" in scheduler.events[-1]
    stats = asyncio.run(scheduler.wait_ready(timeout_s=1.0))
    assert sorted((w.worker_id, w.status) for w in stats.workers) == [
        ("decode-2", WorkerStatus.HEALTHY),
        ("prefill-0", WorkerStatus.HEALTHY),
        ("prefill-1", WorkerStatus.DRAINING),
    ]
