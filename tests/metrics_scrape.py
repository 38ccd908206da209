"""A /metrics body with every series Tessera serves, made without Ray: a front-end
replica's ``Metrics`` after known requests, rendered with a ``ClusterStats`` whose
worker reports every figure. The metrics tests read its values; the chart's dashboard
test reads its names."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from tessera.cluster.metrics import Metrics
from tessera.cluster.request_run import Timings
from tessera.scheduler.api import ClusterStats, WorkerState, WorkerStatus
from tessera.workers.api import INTER_TOKEN_LATENCY_BUCKETS, SpeculativeStats
from tessera.workers.kv.prefix_cache import PrefixCacheStats
from tessera.workers.process.protocol import EngineLoad, TransferCounters, WorkerLoad

MODEL = "smol-metrics"
MAX_MODEL_LEN = 8192
WORKER = "mixed-0"
#: The worker's inter-token latencies: two sequence-steps of 20 ms (in the bucket up to
#: 25 ms) and one of 3 s (up to 5 s), as counts per bucket.
ITL_COUNTS = tuple(
    2 if bound == 0.025 else 1 if bound == 5.0 else 0
    for bound in (*INTER_TOKEN_LATENCY_BUCKETS, None)
)
ITL_SECONDS = 0.02 + 0.02 + 3.0


def engine_load() -> EngineLoad:
    return EngineLoad(
        running=3,
        waiting=2,
        free_blocks=192,
        total_blocks=256,
        kv_usage=0.25,
        step_time=0.02,
        preemptions=4,
        generated_tokens=120,
        prefix_cache=PrefixCacheStats(
            enabled=True, queries=96, hits=64, evictions=1, cached_blocks=8
        ),
        speculation=SpeculativeStats(proposed=30, accepted=12, steps=10, tokens=22),
        steps=50,
        step_seconds=1.0,
        host_seconds=0.25,
        decode_steps=40,
        decode_seconds=0.75,
        itl_counts=ITL_COUNTS,
        itl_seconds=ITL_SECONDS,
    )


def cluster_stats(queued: int = 5) -> ClusterStats:
    """One healthy worker with a report of every figure, ``queued`` requests queued."""
    load = WorkerLoad(
        incarnation="first",
        requests=3,
        engine=engine_load(),
        transfers=TransferCounters(pulls=1, fallbacks=Counter({"timeout": 1})),
        phases=(("decode", 1),),
    )
    worker = WorkerState(
        worker_id=WORKER,
        role="mixed",
        status=WorkerStatus.HEALTHY,
        incarnation="first",
        ongoing=3,
        capacity=16,
        placed=9,
        restarts=0,
        cached_hashes=8,
        load=load,
    )
    return ClusterStats(
        workers=(worker,), queued=queued, placed=9, refused=1, failovers=0, policy="x"
    )


def metrics(replica: str = "a") -> Metrics:
    return Metrics(replica, MODEL, MAX_MODEL_LEN)


def record_a_request(metrics: Metrics) -> None:
    """One request answered 200: arrival at 10 s, validated at 10.25, queued until 10.75,
    taken by the worker at 11, first token at the client at 12 and relayed at 12.125,
    done at 13; 5 prompt tokens, 3 generated (``length``), n 1, max_tokens 3."""
    timings = Timings(submitted=10.5, placed=10.75, accepted=11.0, first_token=12.0)
    metrics.finished(
        "completions", 200, 10.0, 12.125, 13.0, 5, 3, 3, 10.25, timings, ["length"], 1, 3
    )


def samples(body: bytes) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    ]


def exported_names() -> set[str]:
    """Every series name a /metrics body holds (``_total``, ``_bucket``, ``_sum``,
    ``_count`` included, as PromQL names them), with every family present."""
    front = metrics()
    record_a_request(front)
    return {name for name, _, _ in samples(front.render(cluster_stats()))}
