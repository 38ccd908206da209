"""An in-process OTLP trace collector for tests: a real gRPC server on 127.0.0.1 with
OpenTelemetry's ``TraceService``, and a real HTTP server taking OTLP/HTTP's protobuf
bodies at ``/v1/traces``; both keep every span they receive."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass
class Received:
    """What a collector received: each span with its resource's attributes."""

    spans: list[tuple[dict, trace_pb2.Span]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(resource, span) for span in scope_spans.spans]

    def find(
        self, match: Callable[[trace_pb2.Span], bool], count: int = 1, timeout_s: float = 30.0
    ) -> list[trace_pb2.Span]:
        """The spans ``match`` takes once ``count`` have come, or all there are after
        ``timeout_s`` (the exporter sends batches on its own schedule)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = [span for _, span in self.spans if match(span)]
            if len(spans) >= count or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def trace(self, trace_id: bytes, count: int, timeout_s: float = 30.0) -> list[trace_pb2.Span]:
        """The spans of trace ``trace_id`` once ``count`` have come (``find``)."""
        return self.find(lambda span: span.trace_id == trace_id, count, timeout_s)


def attributes(pairs) -> dict:
    """OTLP ``KeyValue``s as a dict (arrays as lists)."""
    out = {}
    for pair in pairs:
        value = pair.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[pair.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[pair.key] = getattr(value, kind)
    return out


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request, context):  # noqa: N802 (the RPC's name)
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def grpc_collector() -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC collector: yields its endpoint (``http://127.0.0.1:PORT``) and what
    it received."""
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


@contextlib.contextmanager
def http_collector() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP collector: yields its base URL and what it received at /v1/traces."""
    received = Received()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            ok = self.path == "/v1/traces"
            if ok:
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.add(request)
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            if ok:
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
