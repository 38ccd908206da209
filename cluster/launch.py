"""Start a cluster from one ``ClusterConfig``: Ray, the scheduler actor, its workers.

``await Cluster.start(config)`` joins the Ray cluster at ``config.address`` (or
starts a local one when Ray is not running yet), gets or creates the named scheduler
actor, which starts the configured workers, and waits until they are healthy. It
returns a ``Cluster`` with the Python API the front ends use (``submit``, ``abort``,
``stats``); ``shutdown`` stops the scheduler and its workers, and Ray if it started
it. Several front ends (Ray Serve replicas) share one scheduler by name.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import ray

from cluster.client import ClusterClient
from cluster.config import ClusterConfig, check_environment
from scheduler.actor import STARTUP_TIMEOUT_S, scheduler_actor_class
from scheduler.api import ClusterStats
from workers.api import Request, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


def resolve_device(config: ClusterConfig) -> tuple[str, float]:
    """(the workers' torch device, GPUs each asks Ray for). ``auto`` takes a GPU per
    worker when the Ray cluster has any GPU, so the Ray autoscaler (KubeRay) can add
    GPU nodes for new workers."""
    device = config.device
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return device, (1.0 if device == "cuda" else 0.0)


class Cluster:
    def __init__(self, config: ClusterConfig, scheduler, client: ClusterClient, owns_ray: bool):
        self.config = config
        self.scheduler = scheduler
        self.client = client
        self._owns_ray = owns_ray

    @classmethod
    async def start(
        cls, config: ClusterConfig, ready_timeout_s: float = STARTUP_TIMEOUT_S
    ) -> Cluster:
        """Start (or join) the cluster ``config`` describes; raise ``ConfigError``
        naming the field for a configuration that cannot run here."""
        from workers.model.loader import load_tokenizer

        check_environment(config)
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(address=config.address, namespace=config.namespace)
        device, num_gpus = resolve_device(config)
        scheduler = (
            scheduler_actor_class()
            .options(name=config.scheduler_name, namespace=config.namespace, get_if_exists=True)
            .remote(config, device, num_gpus)
        )
        try:
            await scheduler.start.remote()
            stats = await scheduler.wait_ready.remote(ready_timeout_s)
        except BaseException:
            await _stop(scheduler)
            if owns_ray:
                ray.shutdown()
            raise
        logger.info("cluster ready: %d workers on %s", len(stats.workers), device)
        return cls(
            config, scheduler, ClusterClient(scheduler, load_tokenizer(config.model)), owns_ray
        )

    async def submit(
        self,
        request: str | Request,
        prompt: str | Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        **options,
    ) -> AsyncIterator[RequestOutput]:
        """See ``ClusterClient.submit``."""
        return await self.client.submit(request, prompt, sampling, **options)

    async def abort(self, request_id: str) -> bool:
        return await self.client.abort(request_id)

    async def stats(self) -> ClusterStats:
        return await self.client.stats()

    async def shutdown(self) -> None:
        """Stop the scheduler and every worker it started (and Ray, if we started it)."""
        await _stop(self.scheduler)
        if self._owns_ray:
            ray.shutdown()


async def _stop(scheduler) -> None:
    try:
        await scheduler.shutdown.remote()
    finally:
        ray.kill(scheduler, no_restart=True)
