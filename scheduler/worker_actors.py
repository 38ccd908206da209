"""The worker actors as the scheduler sees them: their Ray names, how one is started,
and how a restarted scheduler finds the live ones.

The worker actor's module loads the engine (torch and the model code). Only the
scheduler's process starts workers, so that module is imported in ``start_worker``,
when the first worker starts: the front ends and the command line, which import this
layer, never load it.
"""

from __future__ import annotations

import ray

from tessera.scheduler.config import SchedulerConfig

#: A starting worker (loading its model) may take this long to answer its first report.
STARTUP_TIMEOUT_S = 600.0
#: Workers that die before registering, in a row, before the scheduler stops replacing them.
MAX_START_FAILURES = 3


def worker_actor_name(scheduler_name: str, worker_id: str) -> str:
    """The Ray name of a worker actor: ``<scheduler name>/<worker id>``."""
    return f"{scheduler_name}/{worker_id}"


def group_name(scheduler_name: str, worker_id: str) -> str:
    """The Ray name of a worker group's placement group (``tensor_parallel_size > 1``)."""
    return f"{worker_actor_name(scheduler_name, worker_id)}/ranks"


def start_worker(config: SchedulerConfig, role: str, worker_id: str):
    """Start the worker actor ``worker_id`` of ``role``; its handle. Detached and named,
    so that a restarted scheduler finds it (``worker_actors``).

    With ``tensor_parallel_size`` N > 1 the worker is a group: a named, detached
    placement group of N bundles of the worker's CPUs and GPUs (``STRICT_PACK``: one
    node; ``PACK`` where ``tensor_parallel_spread`` lets CPU groups span nodes), the
    worker actor (rank 0) in bundle 0 and its engine's ranks in the others
    (``workers/engine/tensor_parallel.py``). It stays while the worker does: Ray
    restarts a worker into the same bundle, and ``stop_group`` removes it."""
    from tessera.workers.process.actor import worker_actor_class  # the engine: see above

    resources = {f"tessera-{role}": 1} if config.role_resources else None
    placement: dict = {"scheduling_strategy": "SPREAD"}  # a lost node costs least
    engine = config.engine_for(role)
    size = engine.tensor_parallel_size
    if size > 1:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": config.worker_num_cpus}
        if config.worker_num_gpus:
            bundle["GPU"] = config.worker_num_gpus
        first = {**bundle, **(resources or {})}
        group = placement_group(
            [first] + [bundle] * (size - 1),
            strategy="PACK" if config.tensor_parallel_spread else "STRICT_PACK",
            name=group_name(config.scheduler_name, worker_id),
            lifetime="detached",
        )
        placement = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0
            )
        }
    return (
        worker_actor_class()
        .options(
            name=worker_actor_name(config.scheduler_name, worker_id),
            namespace=config.namespace,
            lifetime="detached",
            num_cpus=config.worker_num_cpus,
            num_gpus=config.worker_num_gpus,
            resources=resources,
            max_restarts=config.worker_max_restarts,
            max_task_retries=0,  # a broken stream fails over from the front end
            **placement,
        )
        .remote(
            worker_id,
            role,
            engine,
            config.scheduler_name,
            config.namespace,
            max(1, int(config.worker_num_cpus)),
            config.kv_transfer,
        )
    )


def worker_actors(scheduler_name: str, namespace: str) -> list[tuple[str, object]]:
    """(worker id, handle) of each live worker actor of that scheduler."""
    prefix = worker_actor_name(scheduler_name, "")
    found = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == namespace and actor["name"].startswith(prefix):
            try:
                handle = ray.get_actor(actor["name"], namespace=namespace)
            except ValueError:  # gone since it was listed
                continue
            found.append((actor["name"].removeprefix(prefix), handle))
    return found


def stop_group(scheduler_name: str, worker_id: str) -> None:
    """Remove a worker group's placement group, if it has one (after its worker)."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:
        group = get_placement_group(group_name(scheduler_name, worker_id))
    except ValueError:  # not a group
        return
    remove_placement_group(group)
