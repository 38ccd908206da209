"""Request tracing's parts without a cluster: the endpoint and protocol checks, the
W3C trace context a request brings, monotonic timings as wall-clock time, a request's
phases as spans, and a ``Tracer`` exporting one request's trace to an in-process OTLP
collector over gRPC and over HTTP."""

from __future__ import annotations

import itertools
import time

import pytest

from tessera.cluster.cluster_config import ConfigError
from tessera.cluster.jobs import Choice, Job
from tessera.cluster.request_run import Timings
from tessera.cluster.serve_config import ServeConfig
from tessera.cluster.tracing import (
    Phase,
    Tracer,
    WallClock,
    check_endpoint,
    exporter_endpoint,
    exporter_protocol,
    phases,
    trace_headers,
)
from tessera.workers.api import EngineTimes, SamplingParams
from tests.otlp_collector import attributes, grpc_collector, http_collector

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
MS = 1_000_000  # ns


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    "url",
    ["http://localhost:4317", "https://otel.example:4317", "grpc://collector", "http://[::1]:4318"],
)
def test_collector_urls_are_taken(url):
    assert check_endpoint(url) == url
    assert ServeConfig.create(otlp_traces_endpoint=url).otlp_traces_endpoint == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("localhost:4317", "must be the collector's URL with a scheme (http, https, grpc)"),
        ("ftp://collector:4317", "must be the collector's URL with a scheme"),
        ("http://:4317", "and a host"),
        ("http://localhost:99999", "is not a valid URL (Port out of range 0-65535)"),
        ("http://localhost:port", "is not a valid URL"),
    ],
)
def test_a_bad_endpoint_is_refused_naming_the_setting_and_the_value(url, says):
    with pytest.raises(ConfigError) as caught:
        ServeConfig.create(otlp_traces_endpoint=url)
    message = str(caught.value)
    assert message.startswith("otlp_traces_endpoint: ") and says in message
    assert message.endswith(f"got {url!r}")


def test_tracing_is_off_by_default():
    assert ServeConfig.create().otlp_traces_endpoint is None


def test_the_protocol_comes_from_the_environment_traces_variable_first(monkeypatch):
    assert exporter_protocol({}) == "grpc"
    assert exporter_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    both = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "x"}
    assert exporter_protocol(both) == "grpc"
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: 'http/json' is not"):
        exporter_protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: 'http/json'"):
        ServeConfig.create(otlp_traces_endpoint="http://localhost:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with pytest.raises(ConfigError, match="is a gRPC URL, and the protocol is http/protobuf"):
        ServeConfig.create(otlp_traces_endpoint="grpc://localhost:4317")


def test_otlp_http_gets_the_traces_path_when_the_url_has_none():
    assert exporter_endpoint("http://c:4318", "http/protobuf") == "http://c:4318/v1/traces"
    assert exporter_endpoint("http://c:4318/", "http/protobuf") == "http://c:4318/v1/traces"
    assert exporter_endpoint("http://c:4318/otlp/v1/traces", "http/protobuf").endswith(
        "/otlp/v1/traces"
    )
    assert exporter_endpoint("http://c:4317", "grpc") == "http://c:4317"


def test_the_trace_context_is_picked_from_headers_and_grpc_metadata():
    headers = {"Traceparent": TRACEPARENT, "tracestate": "a=1", "authorization": "Bearer k"}
    assert trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "a=1"}
    metadata = (("traceparent", TRACEPARENT), ("user-agent", "grpc-python"))
    assert trace_headers(metadata) == {"traceparent": TRACEPARENT}
    assert trace_headers({}) == {}


# ------------------------------------------------------------------ spans
def test_monotonic_readings_become_wall_clock_nanoseconds():
    clock = WallClock(wall_ns=10_000 * MS, monotonic=50.0)
    assert clock(50.0) == 10_000 * MS
    assert clock(49.75) == 9_750 * MS
    live = WallClock()
    assert abs(live(time.monotonic()) - time.time_ns()) < 50 * MS


def _timings(start: float) -> Timings:
    return Timings(submitted=start + 0.002, placed=start + 0.005, accepted=start + 0.006)


def test_every_phase_reached_is_a_span_in_time_order():
    clock = WallClock(wall_ns=1_000 * MS, monotonic=100.0)
    arrival = clock(99.0)  # 1 s ago
    times = EngineTimes(arrival + 6 * MS, arrival + 9 * MS, arrival + 30 * MS, arrival + 90 * MS)
    spans = phases(arrival, _timings(99.0), times, clock)
    assert spans == [
        Phase("preprocess", arrival, arrival + 2 * MS),
        Phase("placement", arrival + 2 * MS, arrival + 5 * MS),
        Phase("queue", arrival + 6 * MS, arrival + 9 * MS),
        Phase("prefill", arrival + 9 * MS, arrival + 30 * MS),
        Phase("decode", arrival + 30 * MS, arrival + 90 * MS),
    ]


def test_a_phase_cut_short_ends_where_it_got_to_and_later_ones_are_left_out():
    clock = WallClock(wall_ns=1_000 * MS, monotonic=100.0)
    arrival = clock(99.0)
    queued = EngineTimes(arrival + 6 * MS, None, None, arrival + 20 * MS)  # aborted waiting
    names = [(p.name, p.end_ns - arrival) for p in phases(arrival, _timings(99.0), queued, clock)]
    assert names == [("preprocess", 2 * MS), ("placement", 5 * MS), ("queue", 20 * MS)]
    refused = Timings(submitted=99.002)  # the scheduler refused it: never placed
    assert [p.name for p in phases(arrival, refused, None, clock)] == ["preprocess"]
    assert phases(arrival, None, None, clock) == []


def _job(arrival: float) -> Job:
    sampling = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3)
    job = Job("chat", "chatcmpl-1", "smol", [[1, 2, 3, 4]], sampling, 60.0, arrival + 60, arrival)
    job.choices[0] = Choice(completion_tokens=7, finish_reason="length")
    job.first_token = arrival + 0.03
    return job


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_tracer_exports_one_request_as_one_trace_under_the_callers_span(protocol):
    collector = grpc_collector if protocol == "grpc" else http_collector
    with collector() as (endpoint, received):
        environ = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
        tracer = Tracer(endpoint, environ)
        arrival = time.monotonic() - 0.1
        job = _job(arrival)
        job.trace = {"traceparent": TRACEPARENT}
        wall_arrival = WallClock()(arrival)
        job.engine_times = EngineTimes(
            wall_arrival + 6 * MS,
            wall_arrival + 9 * MS,
            wall_arrival + 30 * MS,
            wall_arrival + 90 * MS,
        )
        tracer.record(job, "chat", 200, _timings(arrival), "worker-0")
        tracer.close()  # flushes
        spans = received.trace(bytes.fromhex(TRACE_ID), 6, timeout_s=5)
    by_name = {span.name: span for span in spans}
    assert sorted(by_name) == [
        "decode",
        "llm_request",
        "placement",
        "prefill",
        "preprocess",
        "queue",
    ]
    root = by_name["llm_request"]
    assert root.parent_span_id == bytes.fromhex(PARENT_ID)
    assert root.kind == root.SPAN_KIND_SERVER
    children = [by_name[n] for n in ("preprocess", "placement", "queue", "prefill", "decode")]
    assert all(child.parent_span_id == root.span_id for child in children)
    for before, after in itertools.pairwise(children):
        assert before.end_time_unix_nano <= after.start_time_unix_nano
    assert root.start_time_unix_nano == children[0].start_time_unix_nano
    assert children[-1].end_time_unix_nano <= root.end_time_unix_nano
    assert (
        by_name["prefill"].end_time_unix_nano - by_name["prefill"].start_time_unix_nano == 21 * MS
    )
    attrs = attributes(root.attributes)
    assert attrs["gen_ai.usage.input_tokens"] == 4 and attrs["gen_ai.usage.output_tokens"] == 7
    assert attrs["gen_ai.request.model"] == "smol" and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 7 and attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.request.seed"] == 3 and attrs["gen_ai.response.finish_reasons"] == [
        "length"
    ]
    assert attrs["gen_ai.request.id"] == "chatcmpl-1" and attrs["tessera.worker.id"] == "worker-0"
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(0.003)
    assert "error.type" not in attrs
    resource = next(r for r, span in received.spans if span.name == "llm_request")
    assert resource["service.name"] == "tessera"


def test_a_request_without_a_traceparent_starts_its_own_trace_and_a_5xx_is_an_error():
    with grpc_collector() as (endpoint, received):
        tracer = Tracer(endpoint, {})
        job = _job(time.monotonic() - 0.05)
        job.trace = {}
        tracer.record(job, "chat", 503, None)
        tracer.close()
    (root,) = [span for _, span in received.spans]
    assert root.name == "llm_request" and not root.parent_span_id
    assert root.status.code == root.status.STATUS_CODE_ERROR
    assert attributes(root.attributes)["error.type"] == "503"
