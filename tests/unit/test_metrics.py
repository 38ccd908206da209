"""/metrics with several front-end replicas: each replica's request series carry its
name in the ``replica`` label, the cluster-wide ones come once."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tessera.cluster.metrics import Metrics
from tessera.scheduler.api import ClusterStats


def _samples(body: bytes) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    ]


def test_every_replicas_request_series_are_labelled_and_the_cluster_ones_come_once():
    a, b = Metrics("a", "m", 64), Metrics("b", "m", 64)
    a.finished("completions", 200, 0.0, 0.5, 2.0, 7, 4, 4)
    b.finished("completions", 200, 0.0, 0.25, 1.0, 3, 2, 2)
    b.finished("chat", 429, 0.0, None, 0.0, 0, 0, 0)
    b.in_flight.inc()
    stats = ClusterStats(workers=(), queued=3, placed=9, refused=1, failovers=2, policy="x")

    samples = _samples(a.render(stats, {"b": b.snapshot()}))

    def values(name: str, **labels: str) -> dict[str | None, float]:
        return {
            s_labels.get("replica"): value
            for s_name, s_labels, value in samples
            if s_name == name and {k: v for k, v in s_labels.items() if k != "replica"} == labels
        }

    assert values("tessera_requests_total", endpoint="completions", status="200") == {
        "a": 1.0,
        "b": 1.0,
    }
    assert values("tessera_requests_total", endpoint="chat", status="429") == {"b": 1.0}
    assert values("tessera_generation_tokens_total") == {"a": 4.0, "b": 2.0}
    assert values("tessera_prompt_tokens_total") == {"a": 7.0, "b": 3.0}
    assert values("tessera_requests_in_flight") == {"a": 0.0, "b": 1.0}
    assert values("tessera_time_to_first_token_seconds_count") == {"a": 1.0, "b": 1.0}
    assert values("tessera_time_to_first_token_seconds_bucket", le="0.25") == {"a": 0.0, "b": 1.0}
    # cluster-wide: exactly one sample each, without a replica label
    assert values("tessera_queued_requests") == {None: 3.0}
    assert values("tessera_failovers_total") == {None: 2.0}
    assert values("tessera_placed_requests_total") == {None: 9.0}


def test_a_replica_alone_shows_its_own_series():
    metrics = Metrics("solo", "m", 64)
    metrics.finished("completions", 200, 0.0, 0.1, 0.2, 1, 1, 1)
    names = {(name, labels.get("replica")) for name, labels, _ in _samples(metrics.render(None))}
    assert ("tessera_requests_total", "solo") in names
    assert not any(name.startswith("tessera_queued") for name, _ in names)  # no stats: none


def test_the_time_to_first_token_is_split_into_phases():
    from tessera.cluster.client import Timings

    metrics = Metrics("a", "m", 64)
    timings = Timings(submitted=10.5, placed=10.75, accepted=11.0, first_token=12.0)
    # arrival 10, validated at 10.25, the app handed the first token on at 12.125
    metrics.finished("completions", 200, 10.0, 12.125, 13.0, 5, 3, 3, 10.25, timings)
    metrics.finished("completions", 429, 10.0, None, 10.1, 0, 0, 0, 10.05, None)  # refused
    sums = {
        s.labels["phase"]: s.value
        for name, s in (
            (s.name, s)
            for family in text_string_to_metric_families(metrics.render(None).decode())
            for s in family.samples
        )
        if name == "tessera_request_phase_seconds_sum"
    }
    assert sums == {
        "validate": 0.25,
        "placement": 0.25,
        "start": 0.25,
        "engine_first_token": 1.0,
        "relay": 0.125,
    }
    # the phases do not stand in for the request's own end: e2e 13 - 10, TPOT (13 - 12.125) / 2
    samples = {s[0]: s[2] for s in _samples(metrics.render(None)) if s[0].endswith("_sum")}
    assert samples["tessera_e2e_request_latency_seconds_sum"] == 3.0
    assert samples["tessera_time_to_first_token_seconds_sum"] == 2.125
    assert samples["tessera_time_per_output_token_seconds_sum"] == 0.4375
