"""OpenTelemetry tracing of requests (``otlp_traces_endpoint``): one trace per request.

A front-end replica owns the tracer and its OTLP exporter; the scheduler and the
workers export nothing. A traced request (``Request.traced``) gets the engine's phase
times back on its finished deltas (``EngineTimes``, wall-clock), and the front end
records the whole request when it ends, every span with its own start and end::

    llm_request          arrival at the door ........................ answer sent
      preprocess         arrival .. submitted (parse, tokenize, chat template, checks)
      placement                     submitted .. placed (the scheduler, its queue)
      queue                                        engine took it .. first scheduled
      prefill                                                 scheduled .. first token
      decode                                                       first token .. last

The root span (a SERVER span, named as vLLM names it) joins the caller's trace when the
request brings a W3C ``traceparent`` (HTTP header or gRPC metadata), and holds the
GenAI semantic conventions' attributes (model, sampling, token usage, finish reasons)
and vLLM's ``gen_ai.latency.*`` ones. Spans go out in batches from a background thread
(``BatchSpanProcessor``: the ``OTEL_BSP_*`` variables apply), over OTLP/gRPC or, with
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, OTLP/HTTP; the exporters' own
``OTEL_EXPORTER_OTLP_TRACES_*`` variables (headers, TLS, timeout, compression) apply,
and ``OTEL_SERVICE_NAME`` names the service (default ``tessera``).

This module imports nothing of OpenTelemetry until a ``Tracer`` is built: a replica
without tracing (and ``tessera --help``) never loads it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from tessera.cluster.jobs import Job
    from tessera.cluster.request_run import Timings
    from tessera.workers.api import EngineTimes

logger = logging.getLogger(__name__)

#: The service name spans carry unless ``OTEL_SERVICE_NAME`` gives one.
SERVICE_NAME = "tessera"
#: The root span's name (vLLM's).
ROOT_SPAN = "llm_request"
#: The W3C trace context a request may bring (lower case, as HTTP/2 and gRPC send them).
TRACE_HEADERS = ("traceparent", "tracestate")
#: Schemes ``otlp_traces_endpoint`` takes: ``http`` (plain), ``https`` (TLS), and
#: ``grpc`` (OTLP/gRPC only; TLS unless ``OTEL_EXPORTER_OTLP_TRACES_INSECURE=true``).
ENDPOINT_SCHEMES = ("http", "https", "grpc")
#: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (else ``OTEL_EXPORTER_OTLP_PROTOCOL``) values.
PROTOCOLS = ("grpc", "http/protobuf")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
#: Where OTLP/HTTP takes traces, appended to an endpoint given without a path.
HTTP_TRACES_PATH = "/v1/traces"
#: The GenAI operation of each kind of job.
OPERATIONS = {"chat": "chat", "completion": "text_completion", "generate": "text_completion"}


def check_endpoint(url: str) -> str:
    """``url`` if it names an OTLP collector (scheme, host, a valid port if any);
    ``ValueError`` saying what is wrong otherwise."""
    example = "e.g. http://localhost:4317"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as error:
        raise ValueError(f"is not a valid URL ({error}); give the collector's, {example}") from None
    if parts.scheme not in ENDPOINT_SCHEMES or not parts.hostname:
        raise ValueError(
            f"must be the collector's URL with a scheme ({', '.join(ENDPOINT_SCHEMES)}) and "
            f"a host, {example}"
        )
    return url


def exporter_protocol(environ: Mapping[str, str] = os.environ) -> str:
    """The OTLP protocol the environment asks for (default ``grpc``); ``ValueError``
    naming the variable for one this server does not speak."""
    for name in PROTOCOL_VARIABLES:
        value = environ.get(name)
        if value:
            if value not in PROTOCOLS:
                raise ValueError(
                    f"{name}: {value!r} is not an OTLP protocol for traces here; "
                    f"give one of {', '.join(PROTOCOLS)}"
                )
            return value
    return "grpc"


def exporter_endpoint(url: str, protocol: str) -> str:
    """What the exporter of ``protocol`` takes for ``url``: OTLP/HTTP's traces path
    when ``url`` has none (the collector's base URL), else ``url`` as it is."""
    if protocol == "http/protobuf" and urlsplit(url).path in ("", "/"):
        return url.rstrip("/") + HTTP_TRACES_PATH
    return url


def trace_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    """The W3C trace context among a request's headers or gRPC metadata (empty when
    it brings none: the request starts a trace of its own)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return {name.lower(): value for name, value in pairs if name.lower() in TRACE_HEADERS}


class WallClock:
    """``time.monotonic`` readings as wall-clock nanoseconds (``time.time_ns``), through
    one pair of readings taken together: a span's timestamps are wall-clock, the
    front end's timings monotonic (a wall clock stepped by NTP must not bend them)."""

    def __init__(self, wall_ns: int | None = None, monotonic: float | None = None) -> None:
        self.wall_ns = time.time_ns() if wall_ns is None else wall_ns
        self.monotonic = time.monotonic() if monotonic is None else monotonic

    def __call__(self, reading: float) -> int:
        return self.wall_ns - round((self.monotonic - reading) * 1e9)


@dataclass(frozen=True, slots=True)
class Phase:
    """One child span of a request: a name and its wall-clock bounds (ns)."""

    name: str
    start_ns: int
    end_ns: int


def phases(
    arrival_ns: int, timings: Timings | None, times: EngineTimes | None, clock: WallClock
) -> list[Phase]:
    """The request's child spans, in time order: each phase it reached (one cut short,
    by an abort or a failure, ends where it got to; one never reached is left out)."""
    spans = []
    if timings is not None:
        submitted = clock(timings.submitted)
        spans.append(Phase("preprocess", arrival_ns, submitted))
        if timings.placed is not None:
            spans.append(Phase("placement", submitted, clock(timings.placed)))
    if times is not None:
        bounds = [times.arrived_ns, times.scheduled_ns, times.first_token_ns]
        reached = [t for t in bounds if t is not None] + [times.finished_ns]
        # the phases reached: each ends where the next begins, the last at the end
        names = ("queue", "prefill", "decode")
        for name, start, end in zip(names, reached, reached[1:], strict=False):
            spans.append(Phase(name, start, end))
    return spans


def attributes(job: Job, endpoint: str, status: int, clock: WallClock) -> dict[str, Any]:
    """The root span's attributes: the GenAI semantic conventions' for the request
    and its usage, vLLM's names beside them, and ``gen_ai.latency.*`` in seconds."""
    sampling = job.sampling
    reasons = [c.finish_reason for c in job.choices.values() if c.finish_reason is not None]
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": OPERATIONS.get(job.kind, job.kind),
        "gen_ai.request.model": job.model,
        "gen_ai.response.model": job.model,
        "gen_ai.request.id": job.request_id,
        "gen_ai.response.id": job.request_id,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.choice.count": sampling.n,
        "gen_ai.request.n": sampling.n,
        "gen_ai.usage.input_tokens": job.prompt_tokens,
        "gen_ai.usage.output_tokens": job.completion_tokens,
        "gen_ai.usage.prompt_tokens": job.prompt_tokens,
        "gen_ai.usage.completion_tokens": job.completion_tokens,
        "gen_ai.response.finish_reasons": reasons,
        "http.response.status_code": status,
        "tessera.endpoint": endpoint,
        "gen_ai.latency.e2e": (clock.wall_ns - clock(job.arrival)) / 1e9,
    }
    if sampling.top_k > 0:
        attrs["gen_ai.request.top_k"] = sampling.top_k
    if sampling.seed is not None:
        attrs["gen_ai.request.seed"] = sampling.seed
    if job.first_token is not None:
        attrs["gen_ai.latency.time_to_first_token"] = job.first_token - job.arrival
    times = job.engine_times
    if times is not None and times.scheduled_ns is not None:
        attrs["gen_ai.latency.time_in_queue"] = (times.scheduled_ns - times.arrived_ns) / 1e9
        if times.first_token_ns is not None:
            prefill = times.first_token_ns - times.scheduled_ns
            attrs["gen_ai.latency.time_in_model_prefill"] = prefill / 1e9
            attrs["gen_ai.latency.time_in_model_decode"] = (
                times.finished_ns - times.first_token_ns
            ) / 1e9
    if status >= 400:
        attrs["error.type"] = str(status)
    return attrs


class Tracer:
    """One replica's tracer: its OTLP exporter to ``endpoint`` and the spans of the
    requests it traces. ``record`` when a request ends; ``close`` flushes what is left."""

    def __init__(self, endpoint: str, environ: Mapping[str, str] = os.environ) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        protocol = exporter_protocol(environ)
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if resource.attributes.get("service.name", "").startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=exporter_endpoint(endpoint, protocol))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tessera.cluster")
        self.propagator = TraceContextTextMapPropagator()
        logger.info("tracing requests to %s over OTLP (%s)", endpoint, protocol)

    def record(
        self,
        job: Job,
        endpoint: str,
        status: int,
        timings: Timings | None,
        worker_id: str | None = None,
    ) -> None:
        """The spans of a request that ended with ``status`` (HTTP's numbers)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        clock = WallClock()
        parent = self.propagator.extract(job.trace or {})
        arrival_ns = clock(job.arrival)
        attrs = attributes(job, endpoint, status, clock)
        if worker_id is not None:
            attrs["tessera.worker.id"] = worker_id
        root = self.tracer.start_span(
            ROOT_SPAN, context=parent, kind=SpanKind.SERVER, attributes=attrs, start_time=arrival_ns
        )
        inside = trace.set_span_in_context(root)
        for phase in phases(arrival_ns, timings, job.engine_times, clock):
            span = self.tracer.start_span(phase.name, context=inside, start_time=phase.start_ns)
            span.end(end_time=phase.end_ns)
        if status >= 500:  # a server span's error (a 4xx is the caller's: error.type only)
            root.set_status(Status(StatusCode.ERROR, f"HTTP status {status}"))
        root.end(end_time=clock.wall_ns)

    def close(self) -> None:
        """Export the spans still batched, then stop the exporter."""
        self.provider.shutdown()
