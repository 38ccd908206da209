"""Prometheus metrics of the HTTP front end and of the cluster behind it.

Each front-end replica keeps its own request families: request counts by endpoint and
status, and latency histograms (time to first token, time per output token, end to
end), measured where the user feels them. Replicas publish them to each other through
Ray's GCS key-value store (``ReplicaBoard``), so that one scrape of ``/metrics``, which
Serve's proxy hands to any replica, shows every live replica's request series, each
labelled ``replica``: sum over that label for the whole front end. The cluster's state
(per worker: sequences running and waiting, KV usage, prefix-cache hits, preemptions,
generated tokens; the global queue, refusals, failovers) comes from the scheduler's
stats, read at scrape time, once per scrape and without a ``replica`` label, so it is
never counted twice. Beside Tessera's own series, vLLM's names for the same figures
(``cluster/vllm_metrics.py``), so that what reads vLLM's metrics reads Tessera's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tessera.cluster.client import Timings
from tessera.cluster.vllm_metrics import VllmRequestSeries, engine_families, finished_reason
from tessera.scheduler.api import ClusterStats, WorkerStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class _ClusterCollector(Collector):
    """Families built from the latest ``ClusterStats`` (set before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: ClusterStats | None = None

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        gauges = {
            "running_sequences": (
                "sequences in the worker's batch",
                lambda w, load: load.engine.running,
            ),
            "waiting_sequences": (
                "sequences queued in the worker's engine",
                lambda w, load: load.engine.waiting,
            ),
            "kv_usage_ratio": (
                "fraction of the worker's KV blocks in use",
                lambda w, load: load.engine.kv_usage,
            ),
            "free_kv_blocks": ("free KV blocks", lambda w, load: load.engine.free_blocks),
            "total_kv_blocks": (
                "KV blocks in the worker's pool",
                lambda w, load: load.engine.total_blocks,
            ),
            "step_time_seconds": (
                "recent mean engine step time",
                lambda w, load: load.engine.step_time,
            ),
            "ongoing_requests": ("requests placed on the worker", lambda w, load: w.ongoing),
            "prefix_cache_hit_rate": (
                "prompt tokens found in the prefix cache / tokens looked up",
                lambda w, load: load.engine.prefix_cache.hit_rate,
            ),
            "spec_acceptance_rate": (
                "speculative decoding: draft tokens accepted / proposed",
                lambda w, load: load.engine.speculation.acceptance_rate,
            ),
            "spec_tokens_per_step": (
                "speculative decoding: mean tokens a verification step produced",
                lambda w, load: load.engine.speculation.mean_tokens_per_step,
            ),
        }
        counters = {
            "preemptions": (
                "sequences preempted for KV space",
                lambda load: load.engine.preemptions,
            ),
            "prefix_cache_queries": (
                "prompt tokens looked up",
                lambda load: load.engine.prefix_cache.queries,
            ),
            "prefix_cache_hits": (
                "prompt tokens found cached",
                lambda load: load.engine.prefix_cache.hits,
            ),
            "generated_tokens": ("tokens generated", lambda load: load.engine.generated_tokens),
            "engine_steps": (
                "engine steps that ran a batch",
                lambda load: load.engine.steps,
            ),
            "engine_step_seconds": (
                "time in those steps (over an interval, / engine_steps: the mean step)",
                lambda load: load.engine.step_seconds,
            ),
            "engine_host_seconds": (
                "of that time, outside the model's forward (scheduling, batch, sampling)",
                lambda load: load.engine.host_seconds,
            ),
            "engine_decode_steps": (
                "engine steps of decodes only (one token a sequence, no prompt token)",
                lambda load: load.engine.decode_steps,
            ),
            "engine_decode_seconds": (
                "time in those decode steps",
                lambda load: load.engine.decode_seconds,
            ),
            "kv_transfers": (
                "KV transfers pulled into the worker",
                lambda load: load.transfers.pulls,
            ),
            "kv_transfer_blocks": (
                "KV blocks pulled into the worker",
                lambda load: load.transfers.blocks_received,
            ),
            "kv_transfer_bytes": (
                "KV bytes pulled into the worker",
                lambda load: load.transfers.bytes_received,
            ),
            "kv_transfer_seconds": (
                "time spent in completed KV transfers",
                lambda load: load.transfers.seconds,
            ),
            "kv_transfer_local_hits": (
                "disaggregated requests whose prompt blocks were all cached here already",
                lambda load: load.transfers.local_hits,
            ),
            "kv_transfers_served": (
                "prefills this worker computed and sent to decode workers",
                lambda load: load.transfers.served,
            ),
            "spec_proposed_tokens": (
                "speculative decoding: draft tokens proposed",
                lambda load: load.engine.speculation.proposed,
            ),
            "spec_accepted_tokens": (
                "speculative decoding: draft tokens the target accepted",
                lambda load: load.engine.speculation.accepted,
            ),
            "spec_verification_steps": (
                "speculative decoding: verification steps (per sequence)",
                lambda load: load.engine.speculation.steps,
            ),
        }
        families = {
            name: GaugeMetricFamily(f"tessera_worker_{name}", help_, labels=["worker"])
            for name, (help_, _) in gauges.items()
        }
        counter_families = {
            name: CounterMetricFamily(f"tessera_worker_{name}", help_, labels=["worker"])
            for name, (help_, _) in counters.items()
        }
        up = GaugeMetricFamily(
            "tessera_worker_status",
            "1 for the worker's current status",
            labels=["worker", "status"],
        )
        for worker in stats.workers:
            for status in WorkerStatus:
                up.add_metric([worker.worker_id, status.value], float(worker.status is status))
            load = worker.load
            if load is None:
                continue
            for name, (_, value) in gauges.items():
                families[name].add_metric([worker.worker_id], float(value(worker, load)))
            for name, (_, value) in counters.items():
                counter_families[name].add_metric([worker.worker_id], float(value(load)))
        fallbacks = CounterMetricFamily(
            "tessera_worker_kv_transfer_fallbacks",
            "KV transfers that failed, so the decode worker prefilled itself, by reason",
            labels=["worker", "reason"],
        )
        phases = GaugeMetricFamily(
            "tessera_worker_request_phases",
            "disaggregated requests on the worker by phase",
            labels=["worker", "phase"],
        )
        for worker in stats.workers:
            if worker.load is not None:
                for reason, count in sorted(worker.load.transfers.fallbacks.items()):
                    fallbacks.add_metric([worker.worker_id, reason], float(count))
                for phase, count in worker.load.phases:
                    phases.add_metric([worker.worker_id, phase], float(count))
        ranks = GaugeMetricFamily(
            "tessera_worker_rank",
            "1 for each rank of a tensor-parallel worker group, with its device and node",
            labels=["worker", "rank", "place"],
        )
        for worker in stats.workers:
            for rank, place in enumerate(worker.ranks):
                ranks.add_metric([worker.worker_id, str(rank), place], 1.0)
        yield up
        yield ranks
        yield from families.values()
        yield from counter_families.values()
        yield fallbacks
        yield phases
        yield GaugeMetricFamily(
            "tessera_queued_requests", "requests waiting in the global queue", value=stats.queued
        )
        for name, help_, value in (
            ("placed_requests", "requests the scheduler placed on a worker", stats.placed),
            ("refused_requests", "requests refused (overload, deadline, no worker)", stats.refused),
            (
                "failovers",
                "placements that resumed a request after a worker failed",
                stats.failovers,
            ),
        ):
            yield CounterMetricFamily(f"tessera_{name}", help_, value=value)
        yield from engine_families(stats, self.model_name)


class _ReplicasCollector(Collector):
    """Every replica's request families from their snapshots (set before each scrape),
    each sample labelled with its replica."""

    def __init__(self) -> None:
        self.snapshots: Mapping[str, bytes] = {}

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self.snapshots.items()):
            for family in text_string_to_metric_families(text.decode()):
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type)
                    merged[family.name] = out
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value)
        yield from merged.values()


class Metrics:
    """One front-end replica's metrics; ``render(stats, snapshots)`` is the /metrics
    body. ``replica`` names this replica in the ``replica`` label; ``model_name`` (the
    served name) and ``max_model_len`` (the context) shape vLLM's series."""

    def __init__(self, replica: str, model_name: str, max_model_len: int) -> None:
        disable_created_metrics()  # no *_created series: they only add noise here
        self.replica = replica
        self.registry = CollectorRegistry()  # this replica's request families
        self.requests = Counter(
            "tessera_requests",
            "HTTP requests by endpoint and status code (499: the client went away)",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tessera_requests_in_flight",
            "requests this replica is serving now",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tessera_time_to_first_token_seconds",
            "arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "tessera_time_per_output_token_seconds",
            "mean time per output token after the first, per request",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tessera_e2e_request_latency_seconds",
            "arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tessera_prompt_tokens", "prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "tessera_generation_tokens",
            "tokens generated for finished requests",
            registry=self.registry,
        )
        self.phases = Histogram(
            "tessera_request_phase_seconds",
            "where a request's time to first token went, per phase: validate (parse, "
            "tokenize), placement (the scheduler's queue and answer), start (the worker "
            "takes it), engine_first_token (the worker's prefill until its first token "
            "reaches the front end), relay (the front end hands that token on); all but "
            "engine_first_token are the front end's",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.vllm = VllmRequestSeries(self.registry, model_name, max_model_len)
        self._replicas = _ReplicasCollector()
        self._cluster = _ClusterCollector(model_name)
        self._exposed = CollectorRegistry()
        self._exposed.register(self._replicas)
        self._exposed.register(self._cluster)

    def finished(
        self,
        endpoint: str,
        status: int,
        arrival: float,
        first_token: float | None,
        end: float,
        prompt_tokens: int,
        completion_tokens: int,
        longest_output: int,
        started: float | None = None,
        timings: Timings | None = None,
        finish_reasons: Sequence[str] = (),
        n: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        """Record one request (times from ``time.monotonic``). ``started``: when the
        front end had validated it and began to submit it; ``timings``: its (first)
        stream's, for the phases of its time to first token; ``finish_reasons``: its
        outputs' (``stop``, ``length``, ``abort``); ``n`` and ``max_tokens``: what it
        asked for."""
        self.requests.labels(endpoint, str(status)).inc()
        vllm = self.vllm
        accepted = timings.accepted if timings is not None else None
        if first_token is not None or accepted is not None:  # it reached a worker
            reason = finished_reason(status, finish_reasons)
            if reason is not None:
                vllm.count("finished", 1, reason)
        if first_token is not None:
            vllm.count("prompt_tokens", prompt_tokens)
        if status != 200:
            return
        if started is not None and timings is not None:
            marks = (
                ("validate", arrival, started),
                ("placement", timings.submitted, timings.placed),
                ("start", timings.placed, timings.accepted),
                ("engine_first_token", timings.accepted, timings.first_token),
                ("relay", timings.first_token, first_token),
            )
            for phase, begin, until in marks:
                if begin is not None and until is not None:
                    self.phases.labels(phase).observe(max(until - begin, 0.0))
        self.e2e.observe(end - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        vllm.observe("e2e_latency", end - arrival)
        vllm.observe("prompt_length", prompt_tokens)
        vllm.observe("output_length", completion_tokens)
        vllm.observe("longest_output", longest_output)
        vllm.observe("n", n)
        if max_tokens is not None:
            vllm.observe("max_tokens", max_tokens)
        if timings is not None and None not in (timings.placed, accepted, timings.first_token):
            # vLLM's request phases, as far as the front end sees them:
            # submitted -queue-> placed ... accepted -prefill-> first token -decode-> end
            vllm.observe("queue_time", max(timings.placed - timings.submitted, 0.0))
            vllm.observe("prefill_time", max(timings.first_token - accepted, 0.0))
            vllm.observe("decode_time", max(end - timings.first_token, 0.0))
            vllm.observe("inference_time", max(end - accepted, 0.0))
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            vllm.observe("time_to_first_token", first_token - arrival)
            if longest_output > 1:
                tpot = (end - first_token) / (longest_output - 1)
                self.tpot.observe(tpot)
                vllm.observe("time_per_output_token", tpot)

    def snapshot(self) -> bytes:
        """This replica's request families, as it publishes them to the others."""
        return generate_latest(self.registry)

    def render(
        self, stats: ClusterStats | None, snapshots: Mapping[str, bytes] | None = None
    ) -> bytes:
        """The /metrics body: the request series of this replica and of the others
        (``snapshots``: replica -> its ``snapshot()``), and the cluster's from ``stats``."""
        self._replicas.snapshots = {**(snapshots or {}), self.replica: self.snapshot()}
        self._cluster.stats = stats
        return generate_latest(self._exposed)
