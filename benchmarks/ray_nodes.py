"""More Ray nodes on this machine, joined to the Ray cluster this process is connected
to (the test session's, or a benchmark's): tests/cluster/test_multi_node.py and
benchmarks/multi_node.py.

Each added node is a real raylet with its own object store, CPUs and custom resources,
started the way ``ray.cluster_utils.Cluster.add_node`` starts its non-head nodes (that
class would start a second head; the cluster already has one). ``remove`` kills exactly
that node's processes, at once and without draining, like a machine that is lost: the
workers on it exit when they lose their raylet, and Ray declares the node dead once
its health checks fail.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import ray
from ray._private.node import Node
from ray._private.parameter import RayParams


class RayNodes:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.removed: list[str] = []  # ids of the nodes removed

    @property
    def ids(self) -> list[str]:
        """The ids of the nodes added and not removed, in the order added."""
        return [n.node_id for n in self.nodes]

    def add(self, num_cpus: int = 1, resources: dict[str, float] | None = None) -> str:
        """Start a node and wait until Ray lists it alive; return its node id."""
        params = RayParams(
            num_cpus=num_cpus,
            num_gpus=0,
            resources=resources or {},
            gcs_address=ray.get_runtime_context().gcs_address,
            object_store_memory=80 * 2**20,
            min_worker_port=0,
            max_worker_port=0,
            include_log_monitor=False,  # the head's monitors this machine's logs
            node_manager_port=0,
        )
        params.dashboard_agent_listen_port = None  # a free one, not the head's
        node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=False)
        self.nodes.append(node)
        deadline = time.monotonic() + 60
        while not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray node {node.node_id} did not join in 60 s")
            time.sleep(0.1)
        return node.node_id

    def remove(self, node_id: str, graceful: bool = False) -> None:
        """Kill the node's processes (raylet, object store, agents): at once, like a
        lost machine (Ray declares it dead only when its health checks have failed,
        ~15 s), or ``graceful``: the raylet deregisters as it stops."""
        (node,) = [n for n in self.nodes if n.node_id == node_id]
        self.nodes.remove(node)
        self.removed.append(node_id)
        node.kill_all_processes(check_alive=False, allow_graceful=graceful, wait=True)

    def remove_all(self, timeout_s: float = 90.0) -> None:
        """Remove what is left (gracefully), one node at a time, each time waiting until
        Ray lists every node removed as dead: until then it would still place actors on
        a lost one. (Two nodes leaving at once once aborted the GCS, in its syncer's
        gRPC streams to them: ray-project/ray#35432's class of crash.)"""
        for node in list(self.nodes):
            self.remove(node.node_id, graceful=True)
            self._wait_removed_dead(timeout_s)
        self._wait_removed_dead(timeout_s)

    def _wait_removed_dead(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(n["NodeID"] in self.removed and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray still lists a removed node alive after {timeout_s} s")
            time.sleep(0.2)


@contextlib.contextmanager
def added_nodes(*resources: dict[str, float]) -> Iterator[RayNodes]:
    """One node with one CPU per ``resources`` entry (its custom resources), for the
    ``with`` body; all that are left are removed afterwards."""
    nodes = RayNodes()
    try:
        for extra in resources:
            nodes.add(1, extra)
        yield nodes
    finally:
        nodes.remove_all()


def head_node_id() -> str:
    """The node this process (the driver) runs on."""
    return ray.get_runtime_context().get_node_id()
