"""Start a cluster from one ``ClusterConfig``: Ray, the scheduler actor, its workers.

``await Cluster.start(config)`` joins the Ray cluster at ``config.address`` (or
starts a local one when Ray is not running yet), gets or creates the named scheduler
actor (its settings, a ``SchedulerConfig``, built by ``scheduler_config``), which starts
the configured workers, and waits until they are healthy. It
returns a ``Cluster`` with the Python API the front ends use (``submit``, ``abort``,
``stats``).

Several front ends (Ray Serve replicas) share one scheduler by name, so only its
creator owns it: ``shutdown`` stops the scheduler and its workers only when this
``Cluster`` created them (and Ray only when it started Ray); a front end that found
the scheduler running leaves it be. ``detached=True`` creates a scheduler that
outlives its creator (a Serve replica bootstrapping the cluster under ``serve run``
or KubeRay, where replicas come and go); otherwise it dies with its creator's process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import ray

from tessera.cluster.client import ClusterClient, RequestStream
from tessera.cluster.cluster_config import ClusterConfig, ConfigError
from tessera.cluster.environment import check_environment
from tessera.scheduler.actor import scheduler_actor_class
from tessera.scheduler.api import ClusterStats
from tessera.scheduler.autoscaler import PoolPolicy
from tessera.scheduler.config import SchedulerConfig, WorkerPool
from tessera.scheduler.worker_actors import STARTUP_TIMEOUT_S, stop_group, worker_actors
from tessera.workers.api import InvalidRequestError, Request, SamplingParams
from tessera.workers.process.kv_auth import ClusterSecret

logger = logging.getLogger(__name__)

#: CPUs (and torch threads) of a worker that computes on a GPU.
GPU_WORKER_CPUS = 1.0


def resolve_device(config: ClusterConfig) -> tuple[str, float]:
    """(the workers' torch device, GPUs each asks Ray for). ``auto`` takes a GPU per
    worker when the Ray cluster has any GPU, so the Ray autoscaler (KubeRay) can add
    GPU nodes for new workers."""
    device = config.device
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return device, (1.0 if device == "cuda" else 0.0)


def resolve_worker_cpus(config: ClusterConfig, device: str) -> float:
    """CPUs (and torch threads) per worker: as configured, else the Ray cluster's CPUs
    shared evenly among the most workers the pools may grow to (so that autoscaled
    workers fit too), at least 1; a GPU worker takes 1. The Serve proxy, replicas and
    the scheduler reserve none: on a 2-core machine one worker gets both cores."""
    if config.worker_num_cpus is not None:
        return config.worker_num_cpus
    if device == "cuda":
        return GPU_WORKER_CPUS
    most = sum(high * config.ranks(role) for role, (_, _, high) in config.pools.items())
    return float(max(1, int(ray.cluster_resources().get("CPU", 1) // max(most, 1))))


def check_groups(config: ClusterConfig, num_gpus: float, worker_num_cpus: float) -> None:
    """Raise ``ConfigError`` before anything starts where a worker group
    (``tensor_parallel_size`` ranks, each a worker's CPUs and GPUs) cannot be served or
    can never fit the Ray cluster (its whole CPUs or GPUs, one node's with
    ``STRICT_PACK``)."""
    sizes = {"tensor_parallel_size": config.tensor_parallel_size}
    if config.disaggregated and config.prefill_tensor_parallel_size is not None:
        sizes["prefill_tensor_parallel_size"] = config.prefill_tensor_parallel_size
    if max(sizes.values()) == 1:
        return
    for size in sizes.values():
        engine = config.engine_config("cpu")
        try:
            dataclasses.replace(engine, tensor_parallel_size=size).check_tensor_parallel()
        except ValueError as error:
            raise ConfigError(str(error)) from None
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    where = "one node" if not config.tensor_parallel_spread else "the Ray cluster"
    for field, size in sizes.items():
        for name, each in (("CPU", worker_num_cpus), ("GPU", num_gpus)):
            if not each:
                continue
            if config.tensor_parallel_spread:
                have = sum(node.get(name, 0.0) for node in nodes)
            else:
                have = max((node.get(name, 0.0) for node in nodes), default=0.0)
            if size * each > have:
                raise ConfigError(
                    f"{field}: {size} ranks of {each:g} {name} each need "
                    f"{size * each:g} {name}s on {where}; it has {have:g}"
                )


def scheduler_config(
    config: ClusterConfig, device: str, num_gpus: float, worker_num_cpus: float
) -> SchedulerConfig:
    """The scheduler's settings from the cluster's: its workers run on ``device`` (not
    auto: see ``resolve_device``), each asks Ray for ``num_gpus`` and
    ``worker_num_cpus`` (see ``resolve_worker_cpus``)."""
    return SchedulerConfig(
        pools=tuple(
            WorkerPool(
                role,
                workers,
                PoolPolicy.for_role(
                    role,
                    min_workers=low,
                    max_workers=high,
                    upscale_delay_s=config.upscale_delay_s,
                    downscale_delay_s=config.downscale_delay_s,
                    target_kv_usage=config.target_kv_usage,
                    target_ongoing_requests=config.ongoing_target,
                    target_prefill_queue_tokens=config.prefill_queue_target,
                ),
            )
            for role, (workers, low, high) in config.pools.items()
        ),
        engine=config.engine_config(device),
        worker_num_gpus=num_gpus,
        worker_num_cpus=worker_num_cpus,
        worker_max_restarts=config.worker_max_restarts,
        role_resources=config.role_resources,
        # one secret per cluster, for its workers only (kv_auth); never logged
        kv_transfer=config.kv_transfer_config(ClusterSecret.generate()),
        placement=config.placement,
        max_ongoing_requests=config.capacity,
        max_queued_requests=config.max_queued_requests,
        queue_timeout_s=config.queue_timeout_s,
        report_interval_s=config.report_interval_s,
        health_timeout_s=config.health_timeout_s,
        scheduler_name=config.scheduler_name,
        namespace=config.namespace,
        tensor_parallel_spread=config.tensor_parallel_spread,
        prefill_tensor_parallel_size=config.prefill_tensor_parallel_size,
    )


class Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        scheduler,
        client: ClusterClient,
        owns_ray: bool,
        owns_scheduler: bool,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.client = client
        self.owns_ray = owns_ray
        self.owns_scheduler = owns_scheduler
        #: CPUs (and torch threads) each worker got (``resolve_worker_cpus``).
        self.worker_num_cpus = config.worker_num_cpus
        #: The workers' torch device (``resolve_device``: cpu or cuda once started).
        self.device = config.device
        #: What a worker's model computes in (``LoadedModel.precision``: "fast" or a
        #: dtype's name; ``dtype="auto"`` resolved), None before any worker registered.
        self.precision: str | None = None

    @classmethod
    async def start(
        cls,
        config: ClusterConfig,
        ready_timeout_s: float = STARTUP_TIMEOUT_S,
        detached: bool = False,
    ) -> Cluster:
        """Start (or join) the cluster ``config`` describes; raise ``ConfigError``
        naming the field for a configuration that cannot run here."""
        from tessera.workers.model.loader import load_tokenizer

        check_environment(config)
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(address=config.address, namespace=config.namespace)
        try:
            scheduler = ray.get_actor(config.scheduler_name, namespace=config.namespace)
            owns_scheduler = False
        except ValueError:  # not running yet: create it
            device, num_gpus = resolve_device(config)
            worker_cpus = resolve_worker_cpus(config, device)
            check_groups(config, num_gpus, worker_cpus)
            options = {"name": config.scheduler_name, "namespace": config.namespace}
            if detached:
                options["lifetime"] = "detached"
            scheduler = (
                scheduler_actor_class()
                .options(**options, get_if_exists=True)
                .remote(scheduler_config(config, device, num_gpus, worker_cpus))
            )
            owns_scheduler = True
        try:
            await scheduler.start.remote()
            stats = await scheduler.wait_ready.remote(ready_timeout_s, not owns_scheduler)
            await _load_loras(scheduler, config)
        except BaseException:
            if owns_scheduler:
                await _stop(scheduler, config)
            if owns_ray:
                ray.shutdown()
            raise
        logger.info("cluster ready: %d workers", len(stats.workers))
        tokenizer = load_tokenizer(
            config.model,
            config.revision,
            tokenizer=config.tokenizer,
            chat_template=config.chat_template,
        )
        client = ClusterClient(scheduler, tokenizer)
        cluster = cls(config, scheduler, client, owns_ray, owns_scheduler)
        resolved = await scheduler.get_config.remote()
        cluster.worker_num_cpus, cluster.device = resolved.worker_num_cpus, resolved.engine.device
        info = await scheduler.model_info.remote()
        cluster.precision = None if info is None else info.precision
        return cluster

    async def submit(
        self,
        request: str | Request,
        prompt: str | Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        **options,
    ) -> RequestStream:
        """See ``ClusterClient.submit``."""
        return await self.client.submit(request, prompt, sampling, **options)

    async def abort(self, request_id: str) -> bool:
        return await self.client.abort(request_id)

    async def stats(self) -> ClusterStats:
        return await self.client.stats()

    async def shutdown(self) -> None:
        """Stop the scheduler and every worker it started if this ``Cluster`` created
        it, and Ray if it started Ray; a shared scheduler is left running. This
        client's requests are stopped and its channels closed first."""
        await self.client.close()
        if self.owns_scheduler:
            await _stop(self.scheduler, self.config)
        if self.owns_ray:
            ray.shutdown()


async def _load_loras(scheduler: Any, config: ClusterConfig) -> None:
    """Load ``lora_modules``; ``ConfigError`` naming the one that cannot be served."""
    for name, path in config.loras:
        try:
            await scheduler.load_lora.remote(name, path)
        except InvalidRequestError as error:  # Ray's error is also the scheduler's
            cause = getattr(error, "cause", error)
            raise ConfigError(f"lora_modules: {name}={path}: {cause.message}") from None
        logger.info("LoRA adapter %r served from %s", name, path)


async def _stop(scheduler, config: ClusterConfig) -> None:
    """Stop the scheduler and its workers. Workers are detached (they outlive a
    scheduler crash), so any its ``shutdown`` did not reach are killed here by name."""
    try:
        await scheduler.shutdown.remote()
    finally:
        ray.kill(scheduler, no_restart=True)
        for worker_id, worker in worker_actors(config.scheduler_name, config.namespace):
            ray.kill(worker, no_restart=True)
            stop_group(config.scheduler_name, worker_id)
