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


def start_worker(config: SchedulerConfig, role: str, worker_id: str):
    """Start the worker actor ``worker_id`` of ``role``; its handle. Detached and named,
    so that a restarted scheduler finds it (``worker_actors``)."""
    from tessera.workers.process.actor import worker_actor_class  # the engine: see above

    return (
        worker_actor_class()
        .options(
            name=worker_actor_name(config.scheduler_name, worker_id),
            namespace=config.namespace,
            lifetime="detached",
            scheduling_strategy="SPREAD",  # over the Ray nodes: a lost node costs least
            num_cpus=config.worker_num_cpus,
            num_gpus=config.worker_num_gpus,
            resources={f"tessera-{role}": 1} if config.role_resources else None,
            max_restarts=config.worker_max_restarts,
            max_task_retries=0,  # a broken stream fails over from the front end
        )
        .remote(
            worker_id,
            role,
            config.engine,
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
