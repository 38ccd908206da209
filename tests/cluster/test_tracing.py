"""Request tracing on a real `tessera serve --otlp-traces-endpoint`, exporting to an
in-process OTLP/gRPC collector: a chat completion sent by the official `openai` client
with a W3C `traceparent` becomes one trace under the caller's span, with the front
end's, the scheduler's and the worker's phases as child spans in time order inside the
root, and the response's exact usage on the root; a streamed completion without one
starts its own trace; the gRPC door joins a traceparent sent as metadata."""

from __future__ import annotations

import itertools
import secrets

import grpc
import pytest

from tessera.cluster.grpc_client import generate_request
from tessera.protos.tessera.v1 import generation_pb2_grpc
from tests.cluster.serve_process import Server, serve_process
from tests.otlp_collector import Received, attributes, grpc_collector

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "tracing-key-71c4"
MODEL = "smol-traced"
NAMESPACE = "tracing-test"
CHILDREN = ("preprocess", "placement", "queue", "prefill", "decode")
#: How long a span may take to reach the collector: the exporter sends a batch every
#: 5 s (the SDK's default ``OTEL_BSP_SCHEDULE_DELAY``).
EXPORT_WAIT_S = 30.0


@pytest.fixture(scope="module")
def collector():
    with grpc_collector() as collector:
        yield collector


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory, collector) -> Server:
    endpoint, _ = collector
    settings = (
        f"served_model_name: {MODEL}\n"
        "workers: 1\n"
        "num_kv_blocks: 256\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
        f"otlp_traces_endpoint: {endpoint}\n"
    )
    root = tmp_path_factory.mktemp("tracing")
    with serve_process(root, settings, API_KEY, NAMESPACE, grpc=True) as server:
        yield server


def _traceparent() -> tuple[bytes, bytes, str]:
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    return trace_id, span_id, f"00-{trace_id.hex()}-{span_id.hex()}-01"


def _request_trace(received: Received, trace_id: bytes) -> tuple[object, dict[str, object]]:
    """The root span of trace ``trace_id`` and its children by name, checked to be one
    trace: every child under the root, in time order, inside it."""
    spans = received.trace(trace_id, 1 + len(CHILDREN), EXPORT_WAIT_S)
    (root,) = [span for span in spans if span.name == "llm_request"]
    children = {span.name: span for span in spans if span is not root}
    assert sorted(children) == sorted(CHILDREN) and len(spans) == 1 + len(CHILDREN)
    ordered = [children[name] for name in CHILDREN]
    assert all(child.parent_span_id == root.span_id for child in ordered)
    assert root.start_time_unix_nano <= ordered[0].start_time_unix_nano
    for before, after in itertools.pairwise(ordered):
        assert before.start_time_unix_nano <= before.end_time_unix_nano
        assert before.end_time_unix_nano <= after.start_time_unix_nano, (before.name, after.name)
    assert ordered[-1].end_time_unix_nano <= root.end_time_unix_nano
    return root, children


def test_a_chat_completion_is_one_trace_under_the_callers_span(server, collector):
    _, received = collector
    trace_id, parent_id, traceparent = _traceparent()
    done = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        extra_headers={"traceparent": traceparent},
    )
    root, children = _request_trace(received, trace_id)
    assert root.parent_span_id == parent_id and root.kind == root.SPAN_KIND_SERVER
    attrs = attributes(root.attributes)
    assert attrs["gen_ai.request.id"] == done.id
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.usage.input_tokens"] == done.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == done.usage.completion_tokens
    assert attrs["gen_ai.request.max_tokens"] == 12 and attrs["gen_ai.request.temperature"] == 0
    assert attrs["gen_ai.response.finish_reasons"] == [done.choices[0].finish_reason]
    assert attrs["http.response.status_code"] == 200 and attrs["tessera.worker.id"]
    # a decode of n tokens after the first: it takes time, and the prefill too
    assert children["decode"].end_time_unix_nano > children["decode"].start_time_unix_nano
    assert children["prefill"].end_time_unix_nano > children["prefill"].start_time_unix_nano
    resource = next(r for r, span in received.spans if span.span_id == root.span_id)
    assert resource["service.name"] == "tessera"


def test_a_streamed_completion_without_a_traceparent_starts_its_own_trace(server, collector):
    _, received = collector
    stream = server.client().completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    request_id, usage = chunks[0].id, chunks[-1].usage

    def ours(span) -> bool:
        return span.name == "llm_request" and any(
            pair.key == "gen_ai.request.id" and pair.value.string_value == request_id
            for pair in span.attributes
        )

    (root,) = received.find(ours, 1, EXPORT_WAIT_S)
    assert not root.parent_span_id
    root, _ = _request_trace(received, root.trace_id)
    attrs = attributes(root.attributes)
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6


def test_the_grpc_door_joins_a_traceparent_sent_as_metadata(server, collector):
    _, received = collector
    trace_id, parent_id, traceparent = _traceparent()
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {API_KEY}"), ("traceparent", traceparent))
        request = generate_request(
            "The capital of France is", max_tokens=5, temperature=0, ignore_eos=True
        )
        answers = list(stub.Generate(request, metadata=metadata, timeout=120))
    root, _ = _request_trace(received, trace_id)
    assert root.parent_span_id == parent_id
    attrs = attributes(root.attributes)
    assert attrs["tessera.endpoint"] == "grpc_generate"
    assert attrs["gen_ai.usage.output_tokens"] == answers[-1].usage.completion_tokens == 5
