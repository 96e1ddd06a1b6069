"""Helpers for jobs on a ``ray.cluster_utils.Cluster`` (tests and benchmarks)."""

from __future__ import annotations

from typing import Any


def cluster_node(cluster: Any, where: dict[str, Any]) -> Any:
    """The ``cluster_utils`` node a job's node agent ran on.

    ``where`` is what the agent reported (``<state-dir>/ray_nodes.json`` has one
    per slot): found by Ray node id, or by its raylet's pid where the cluster's
    nodes do not know their id (older Ray).
    """
    for node in cluster.worker_nodes:
        if getattr(node, "node_id", None) == where["node_id"]:
            return node
    for node in cluster.worker_nodes:
        if node.all_processes["raylet"][0].process.pid == where["raylet_pid"]:
            return node
    raise LookupError(f"no node of the cluster runs {where}")
