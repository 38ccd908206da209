"""vLLM's metric names, served on /metrics beside Tessera's own.

Grafana dashboards, KEDA rules and the Kubernetes Gateway API inference extension read
vLLM's series (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ...). Each one Tessera can fill is declared once
below, with vLLM's name, type, labels and buckets (vLLM's ``docs/design/metrics.md`` and
``vllm/v1/metrics/loggers.py``), beside the Tessera measurement it is made of. Every
series carries ``model_name``, the served model name. Each has exactly one source:

- ``REQUEST_SERIES``: measured by each front-end replica where the user feels them, as
  Tessera's own request series are; published with them (``ReplicaBoard``), so served
  labelled ``replica`` as well: sum over it for the whole front end.
- ``ENGINE_SERIES``: one sample per worker, labelled ``engine`` (the worker id), read
  from the scheduler's stats at scrape time, once, without ``replica``.

So nothing is counted twice: the prompt tokens are the front end's (a request's whole
prompt once its first token came, as vLLM counts them), the generated tokens the
engines' (as they are generated, so a rate is live).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from tessera.scheduler.api import ClusterStats
from tessera.workers.api import INTER_TOKEN_LATENCY_BUCKETS
from tessera.workers.process.protocol import EngineLoad

#: vLLM's bucket bounds (``vllm/v1/metrics/buckets.py``), so that an alert or a panel
#: on ``le="0.5"`` means what it means on vLLM.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
#: ``vllm:request_success``'s ``finished_reason`` values Tessera gives, mildest first:
#: a request with several outputs counts once, with its outputs' most severe reason.
FINISHED_REASONS = ("stop", "length", "abort", "error")
#: HTTP statuses of requests that ended because they were aborted: the client went
#: away (499), the deadline passed (408). Any other failure is an ``error``.
ABORTED_STATUSES = frozenset({408, 499})
#: The ``engine`` of ``vllm:num_requests_waiting``'s sample for the scheduler's global
#: queue: requests admitted and waiting for a worker, on no engine yet. vLLM has no
#: such queue (every request waits in an engine), and a rule on
#: ``sum(vllm:num_requests_waiting)`` should see them.
QUEUE_ENGINE = "queue"


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to the context."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


class Kind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class VllmSeries:
    """One vLLM metric as Tessera serves it."""

    name: str  # vLLM's; a counter's without ``_total``, which the exposition adds
    kind: Kind
    help: str
    #: a histogram's upper bounds, or how they follow from the context length
    buckets: tuple[float, ...] | Callable[[int], tuple[int, ...]] = ()
    labels: tuple[str, ...] = ()  # beyond ``model_name`` (and ``engine``)

    def bounds(self, max_model_len: int) -> tuple[float, ...]:
        return self.buckets(max_model_len) if callable(self.buckets) else self.buckets


def _histogram(name: str, help_: str, buckets) -> VllmSeries:
    return VllmSeries(name, Kind.HISTOGRAM, help_, buckets)


#: The front end's measurements of each request (``Metrics.finished``), by vLLM name.
REQUEST_SERIES: dict[str, VllmSeries] = {
    # arrival (before tokenizing) to the first token's delta reaching the front end
    "time_to_first_token": _histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TIME_TO_FIRST_TOKEN_BUCKETS,
    ),
    # after the first token, per token of the longest output (tessera_time_per_output_token)
    "time_per_output_token": _histogram(
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    # arrival to the last token
    "e2e_latency": _histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS,
    ),
    # submitted to placed: the scheduler's global queue and its answer
    "queue_time": _histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    # the worker took it to its first token reaching the front end (its engine's queue
    # included: the global queue is where Tessera's requests wait)
    "prefill_time": _histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    # first token to last
    "decode_time": _histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    # prefill + decode: the worker took it to its last token
    "inference_time": _histogram(
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "prompt_length": _histogram(
        "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
    ),
    "output_length": _histogram(  # every output's tokens (n > 1: their sum)
        "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
    ),
    "longest_output": _histogram(
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        token_buckets,
    ),
    "n": _histogram(
        "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
    ),
    "max_tokens": _histogram(
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        token_buckets,
    ),
    # a request's prompt tokens once its first token came (tessera_prompt_tokens: of
    # requests answered 200)
    "prompt_tokens": VllmSeries(
        "vllm:prompt_tokens", Kind.COUNTER, "Number of prefill tokens processed."
    ),
    # every request that reached a worker, by how it ended (FINISHED_REASONS)
    "finished": VllmSeries(
        "vllm:request_success",
        Kind.COUNTER,
        "Count of successfully processed requests.",
        labels=("finished_reason",),
    ),
}


@dataclass(frozen=True, slots=True)
class EngineSeries:
    """A vLLM series read from each worker's last report."""

    series: VllmSeries
    #: the figure: a number, or a histogram's (counts per bucket, sum)
    read: Callable[[EngineLoad], float | tuple[Sequence[int], float]]
    #: the scheduler's global queue is one more sample, its ``engine`` QUEUE_ENGINE
    with_queue: bool = False


#: Per worker (``engine``), from the scheduler's stats at scrape time.
ENGINE_SERIES: tuple[EngineSeries, ...] = (
    EngineSeries(
        VllmSeries(
            "vllm:num_requests_running",
            Kind.GAUGE,
            "Number of requests in model execution batches.",
        ),
        lambda load: load.running,  # sequences: each of n outputs, as vLLM's child requests
    ),
    EngineSeries(
        VllmSeries(
            "vllm:num_requests_waiting", Kind.GAUGE, "Number of requests waiting to be processed."
        ),
        lambda load: load.waiting,
        with_queue=True,
    ),
    EngineSeries(
        VllmSeries(
            "vllm:kv_cache_usage_perc", Kind.GAUGE, "KV-cache usage. 1 means 100 percent usage."
        ),
        lambda load: load.kv_usage,
    ),
    EngineSeries(
        VllmSeries(
            "vllm:num_preemptions", Kind.COUNTER, "Cumulative number of preemption from the engine."
        ),
        lambda load: load.preemptions,
    ),
    EngineSeries(
        VllmSeries(
            "vllm:prefix_cache_queries",
            Kind.COUNTER,
            "Prefix cache queries, in terms of number of queried tokens.",
        ),
        lambda load: load.prefix_cache.queries,
    ),
    EngineSeries(
        VllmSeries(
            "vllm:prefix_cache_hits",
            Kind.COUNTER,
            "Prefix cache hits, in terms of number of cached tokens.",
        ),
        lambda load: load.prefix_cache.hits,
    ),
    EngineSeries(
        VllmSeries(
            "vllm:generation_tokens", Kind.COUNTER, "Number of generation tokens processed."
        ),
        lambda load: load.generated_tokens,
    ),
    EngineSeries(
        VllmSeries(
            "vllm:inter_token_latency_seconds",
            Kind.HISTOGRAM,
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        ),
        lambda load: (load.itl_counts, load.itl_seconds),
    ),
    EngineSeries(
        VllmSeries("vllm:spec_decode_num_drafts", Kind.COUNTER, "Number of spec decoding drafts."),
        lambda load: load.speculation.steps,  # one draft per sequence and verification step
    ),
    EngineSeries(
        VllmSeries("vllm:spec_decode_num_draft_tokens", Kind.COUNTER, "Number of draft tokens."),
        lambda load: load.speculation.proposed,
    ),
    EngineSeries(
        VllmSeries(
            "vllm:spec_decode_num_accepted_tokens", Kind.COUNTER, "Number of accepted tokens."
        ),
        lambda load: load.speculation.accepted,
    ),
)


def finished_reason(status: int, reasons: Sequence[str]) -> str | None:
    """``vllm:request_success``'s ``finished_reason`` of a request that reached a worker
    and ended with HTTP ``status``, its outputs' finish reasons ``reasons``; None for a
    200 without them (nothing to count)."""
    if status == 200:
        return max(reasons, key=FINISHED_REASONS.index) if reasons else None
    return "abort" if status in ABORTED_STATUSES else "error"


class VllmRequestSeries:
    """One replica's ``REQUEST_SERIES`` on its registry, for ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self._metrics: dict[str, Counter | Histogram] = {}
        for key, series in REQUEST_SERIES.items():
            labels = ["model_name", *series.labels]
            if series.kind is Kind.HISTOGRAM:
                buckets = series.bounds(max_model_len)
                metric = Histogram(
                    series.name, series.help, labels, buckets=buckets, registry=registry
                )
            else:
                metric = Counter(series.name, series.help, labels, registry=registry)
            self._metrics[key] = metric
        for reason in FINISHED_REASONS:  # every reason from 0, as vLLM shows them
            self._metrics["finished"].labels(model_name, reason)

    def observe(self, key: str, value: float) -> None:
        self._metrics[key].labels(self.model_name).observe(value)

    def count(self, key: str, amount: float = 1, *labels: str) -> None:
        self._metrics[key].labels(self.model_name, *labels).inc(amount)


def engine_families(stats: ClusterStats, model_name: str) -> Iterator[Metric]:
    """``ENGINE_SERIES`` of every worker with a report, labelled ``model_name`` and
    ``engine``; the global queue joins ``vllm:num_requests_waiting``."""
    labels = ["model_name", "engine"]
    for entry in ENGINE_SERIES:
        series = entry.series
        if series.kind is Kind.HISTOGRAM:
            family = HistogramMetricFamily(series.name, series.help, labels=labels)
        elif series.kind is Kind.COUNTER:
            family = CounterMetricFamily(series.name, series.help, labels=labels)
        else:
            family = GaugeMetricFamily(series.name, series.help, labels=labels)
        for worker in stats.workers:
            if worker.load is None:
                continue
            value = entry.read(worker.load.engine)
            if series.kind is Kind.HISTOGRAM:
                counts, total = value
                family.add_metric(
                    [model_name, worker.worker_id], _cumulative(series.buckets, counts), total
                )
            else:
                family.add_metric([model_name, worker.worker_id], float(value))
        if entry.with_queue:
            family.add_metric([model_name, QUEUE_ENGINE], float(stats.queued))
        yield family


def _cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """A histogram's exposition buckets (``le``, count at or below) from its counts per
    bucket (the last above every bound); no counts yet: every bucket 0."""
    counts = list(counts) or [0] * (len(bounds) + 1)
    out, running = [], 0
    for bound, count in zip((*map(floatToGoString, bounds), "+Inf"), counts, strict=True):
        running += count
        out.append((bound, float(running)))
    return out
