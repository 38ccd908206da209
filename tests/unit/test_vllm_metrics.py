"""/metrics serves vLLM's names beside Tessera's own: each with vLLM's type, labels and
buckets, from one source (the front-end replicas or the workers' reports), so that
summed over ``replica`` and ``engine`` nothing counts twice; the counts move by exactly
what the requests were. ``tests/cluster/test_serve.py`` checks the same names on a
real ``tessera serve``."""

from __future__ import annotations

import collections

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.cluster.vllm_metrics import QUEUE_ENGINE, finished_reason
from tests.metrics_scrape import (
    ITL_SECONDS,
    MAX_MODEL_LEN,
    MODEL,
    WORKER,
    cluster_stats,
    engine_load,
    metrics,
    record_a_request,
    samples,
)

#: vLLM's "v1 Metrics" list, as its design doc gives it (name, type):
#: https://github.com/vllm-project/vllm/blob/0328b592a3d35f9b4dc5549d2a3fb8d1531c8e5f/docs/design/metrics.md
VLLM_DESIGN_DOC = (
    ("vllm:num_requests_running", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"),
    ("vllm:prompt_tokens_total", "counter"),
    ("vllm:generation_tokens_total", "counter"),
    ("vllm:request_success_total", "counter"),
    ("vllm:request_prompt_tokens", "histogram"),
    ("vllm:request_generation_tokens", "histogram"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"),
)
#: The rest of what Tessera serves, as vLLM's ``PrometheusStatLogger`` and
#: ``SpecDecodingProm`` declare them (vllm/v1/metrics/loggers.py,
#: vllm/v1/spec_decode/metrics.py) and as the design doc's dashboard section names them.
VLLM_LOGGERS = (
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:num_preemptions", "counter"),
    ("vllm:request_queue_time_seconds", "histogram"),
    ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"),
    ("vllm:request_max_num_generation_tokens", "histogram"),
    ("vllm:request_params_n", "histogram"),
    ("vllm:request_params_max_tokens", "histogram"),
    ("vllm:spec_decode_num_drafts", "counter"),
    ("vllm:spec_decode_num_draft_tokens", "counter"),
    ("vllm:spec_decode_num_accepted_tokens", "counter"),
)
#: Bucket bounds, from vllm/v1/metrics/buckets.py at
#: https://github.com/vllm-project/vllm/blob/139b1c3f17720f4bb6865309f365e6b1f1607a45/vllm/v1/metrics/buckets.py
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
VLLM_TTFT += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5)
VLLM_ITL += (10.0, 20.0, 40.0, 80.0)
VLLM_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
VLLM_LATENCY += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# build_1_2_5_buckets(max_model_len): token counts
VLLM_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # up to 8192
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": VLLM_TTFT,
    "vllm:inter_token_latency_seconds": VLLM_ITL,
    "vllm:request_time_per_output_token_seconds": VLLM_ITL,
    "vllm:e2e_request_latency_seconds": VLLM_LATENCY,
    "vllm:request_queue_time_seconds": VLLM_LATENCY,
    "vllm:request_prefill_time_seconds": VLLM_LATENCY,
    "vllm:request_decode_time_seconds": VLLM_LATENCY,
    "vllm:request_inference_time_seconds": VLLM_LATENCY,
    "vllm:request_prompt_tokens": VLLM_TOKENS,
    "vllm:request_generation_tokens": VLLM_TOKENS,
    "vllm:request_max_num_generation_tokens": VLLM_TOKENS,
    "vllm:request_params_max_tokens": VLLM_TOKENS,
    "vllm:request_params_n": (1, 2, 5, 10, 20),
}
#: Served per worker from the scheduler's stats; the rest per front-end replica.
ENGINE_FAMILIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:generation_tokens",
    "vllm:inter_token_latency_seconds",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
}
SERVED = VLLM_DESIGN_DOC + VLLM_LOGGERS


def family_name(name: str, kind: str) -> str:
    """The family a listed name is: a counter's without ``_total`` (the parser's)."""
    return name.removesuffix("_total") if kind == "counter" else name


def test_served_beside_tessera_names_with_vllm_types_labels_and_buckets():
    assert MAX_MODEL_LEN == 8192  # VLLM_TOKENS is build_1_2_5_buckets(8192)
    front = metrics("a")
    record_a_request(front)
    body = front.render(cluster_stats()).decode()
    families = {family.name: family for family in text_string_to_metric_families(body)}
    served = {name for name in families if name.startswith("vllm:")}
    assert served == {family_name(name, kind) for name, kind in SERVED}
    assert "tessera_time_to_first_token_seconds" in families  # Tessera's own stay
    for name, kind in SERVED:
        family = families[family_name(name, kind)]
        assert family.type == kind, name
        assert family.samples, name
        engine = family.name in ENGINE_FAMILIES
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            # per worker: its id as vLLM's engine, once; per replica: its name
            assert labels.pop("engine" if engine else "replica") in (
                (WORKER, QUEUE_ENGINE) if engine else ("a",)
            ), sample
            labels.pop("le", None)
            if family.name == "vllm:request_success":
                assert labels.pop("finished_reason") in ("stop", "length", "abort", "error")
            assert labels == {}, sample
        if kind == "histogram":
            bounds = [
                float(s.labels["le"])
                for s in family.samples
                if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
            ]
            assert bounds == list(map(float, VLLM_BUCKETS[family.name])), family.name


def _values(body: bytes) -> collections.Counter:
    """Each series summed over ``replica`` (the front end's whole) and kept per engine."""
    out = collections.Counter()
    for name, labels, value in samples(body):
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "replica"))
        out[(name, key)] += value
    return out


def test_the_counts_are_what_the_requests_were_each_counted_once():
    a, b = metrics("a"), metrics("b")
    record_a_request(a)
    record_a_request(b)
    # b: n 2, both outputs of 4 tokens, one cut by max_tokens
    b.finished("chat", 200, 0.0, 0.5, 2.0, 7, 8, 4, None, None, ["stop", "length"], 2, 4)
    b.finished("chat", 499, 0.0, 0.5, 1.0, 6, 0, 0)  # the client left after its first token
    b.finished("chat", 429, 0.0, None, 0.1, 0, 0, 0)  # refused before any worker saw it
    values = _values(a.render(cluster_stats(queued=5), {"b": b.snapshot()}))

    def value(name: str, **labels: str) -> float:
        key = tuple(sorted({"model_name": MODEL, **labels}.items()))
        return values[(name, key)]

    # the front end: each replica's requests, once each
    assert value("vllm:prompt_tokens_total") == 5 + 5 + 7 + 6  # the 429 had no first token
    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:request_success_total", finished_reason="abort") == 1
    assert value("vllm:request_success_total", finished_reason="stop") == 0
    assert value("vllm:request_success_total", finished_reason="error") == 0
    assert value("vllm:e2e_request_latency_seconds_count") == 3  # the 200s
    assert value("vllm:e2e_request_latency_seconds_sum") == 3.0 + 3.0 + 2.0
    assert value("vllm:request_generation_tokens_sum") == 3 + 3 + 8
    assert value("vllm:request_max_num_generation_tokens_sum") == 3 + 3 + 4
    assert value("vllm:request_params_n_sum") == 1 + 1 + 2
    assert value("vllm:request_params_max_tokens_sum") == 3 + 3 + 4
    assert value("vllm:request_prompt_tokens_sum") == 5 + 5 + 7
    assert value("vllm:request_prompt_tokens_bucket", le="5.0") == 2
    assert value("vllm:time_to_first_token_seconds_sum") == 2.125 + 2.125 + 0.5
    # per token after the first: (13 - 12.125) / 2 twice, (2 - 0.5) / 3 once
    assert value("vllm:request_time_per_output_token_seconds_sum") == 0.4375 * 2 + 0.5
    # the phases, of the requests with timings: queue 10.5 -> 10.75, prefill 11 -> 12,
    # decode 12 -> 13, inference 11 -> 13
    assert value("vllm:request_queue_time_seconds_sum") == 0.25 * 2
    assert value("vllm:request_prefill_time_seconds_sum") == 1.0 * 2
    assert value("vllm:request_decode_time_seconds_sum") == 1.0 * 2
    assert value("vllm:request_inference_time_seconds_sum") == 2.0 * 2
    assert value("vllm:request_queue_time_seconds_count") == 2
    # the workers: their report, once however many replicas there are
    load = engine_load()
    engine = {"engine": WORKER}
    assert value("vllm:generation_tokens_total", **engine) == load.generated_tokens
    assert value("vllm:num_requests_running", **engine) == load.running
    assert value("vllm:num_requests_waiting", **engine) == load.waiting
    assert value("vllm:num_requests_waiting", engine=QUEUE_ENGINE) == 5
    assert value("vllm:kv_cache_usage_perc", **engine) == 0.25
    assert value("vllm:num_preemptions_total", **engine) == 4
    assert value("vllm:prefix_cache_queries_total", **engine) == 96
    assert value("vllm:prefix_cache_hits_total", **engine) == 64
    assert value("vllm:spec_decode_num_drafts_total", **engine) == 10
    assert value("vllm:spec_decode_num_draft_tokens_total", **engine) == 30
    assert value("vllm:spec_decode_num_accepted_tokens_total", **engine) == 12
    # 20 ms, 20 ms and 3 s: cumulative buckets
    assert value("vllm:inter_token_latency_seconds_count", **engine) == 3
    assert value("vllm:inter_token_latency_seconds_sum", **engine) == ITL_SECONDS
    itl = "vllm:inter_token_latency_seconds_bucket"
    assert value(itl, le="0.01", **engine) == 0
    assert value(itl, le="0.025", **engine) == 2
    assert value(itl, le="2.5", **engine) == 2
    assert value(itl, le="5.0", **engine) == 3
    assert value(itl, le="+Inf", **engine) == 3
    # Tessera's own request series are as they were
    assert values[("tessera_prompt_tokens_total", ())] == 5 + 5 + 7
    assert values[("tessera_generation_tokens_total", ())] == 3 + 3 + 8


def test_engine_series_come_once_and_only_with_stats():
    solo = metrics("solo")
    names = {name for name, _, _ in samples(solo.render(None))}
    assert "vllm:num_requests_running" not in names  # no stats: no engine series
    assert "vllm:request_success_total" in names  # every reason from 0
    two = samples(solo.render(cluster_stats(), {"other": metrics("other").snapshot()}))
    running = [labels for name, labels, _ in two if name == "vllm:num_requests_running"]
    assert running == [{"model_name": MODEL, "engine": WORKER}]


@pytest.mark.parametrize(
    ("status", "reasons", "expected"),
    [
        (200, ["stop"], "stop"),
        (200, ["stop", "length"], "length"),  # n > 1: the most severe
        (200, ["abort", "length"], "abort"),
        (200, [], None),  # nothing known to count
        (499, [], "abort"),  # the client went away
        (408, ["stop"], "abort"),  # the deadline passed
        (500, [], "error"),
        (400, [], "error"),
    ],
)
def test_finished_reason(status, reasons, expected):
    assert finished_reason(status, reasons) == expected
