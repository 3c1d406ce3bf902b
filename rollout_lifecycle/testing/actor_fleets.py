"""Fleets of simulated engines in Ray actors, and local Ray clusters to run them on: one node
(``local_ray``) or several (``LocalCluster``: each node its own raylet, on this machine).

The part of the test kit that needs Ray: ``rollout_lifecycle.testing`` loads this module the
first time one of its names is asked for, so the in-process simulator imports without Ray.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import ray
from ray.cluster_utils import Cluster

from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.backends.hosted import HostedEngine, start_multi_engine_actor
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.values import check_int
from rollout_lifecycle.testing.simulated import MAX_FLEET, fleet_factories


def init_local_ray() -> None:
    """Start a local Ray cluster of this process's own (2 CPUs, no dashboard, quiet) and connect
    to it. Always its own (``address="local"``): a bare ``ray.init()`` joins the cluster another
    process on this machine last started (``ray start``, ``LocalCluster``) if one runs."""
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray cluster for a script or demo (``init_local_ray``), unless this process is
    connected to one already; shut down on exit only if it was started here."""
    started = not ray.is_initialized()
    if started:
        init_local_ray()
    try:
        yield
    finally:
        if started:
            ray.shutdown()


#: How fast the cluster's control store (GCS) finds a node lost: a health check every 300 ms
#: with a 1 s deadline, the node dead after 3 missed in a row: a killed raylet was found lost in
#: 0.8 s here (quiet; 6 s beside the test suite and two CPU hogs), while a live one would have
#: to stall through three 1 s checks in a row to be taken for lost. Ray's defaults take tens of
#: seconds. (``_system_config`` keys of ray 2.60's ``ray_config_def.h``.)
FAST_NODE_LOSS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}

#: How often each process hands its ``ray.util.metrics`` records to its node's metrics agent
#: (``RayMetrics``): every second against Ray's 10 s, so a test reads what it recorded soon. A
#: second is the least Ray takes (its core worker floors the interval at 1000 ms: ray 2.60,
#: ``OpenTelemetryMetricRecorder._resolve_gauge_ttl_seconds`` says so of ``stats.h``).
FAST_METRICS = {"metrics_report_interval_ms": 1000}


class LocalCluster:
    """A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``): each node
    its own raylet with ``cpus`` CPUs and ``gpus`` of the custom resource ``resource`` standing
    for GPUs; the driver connected to it. A node removed is lost as a machine is (its raylet
    killed, no drain), and the cluster finds it lost within seconds (``FAST_NODE_LOSS``).

    ``with LocalCluster(3) as cluster:``; the process must not be connected to Ray already.
    """

    def __init__(
        self, nodes: int = 3, *, cpus: int = 1, gpus: int = 2, resource: str = "gpu"
    ) -> None:
        check_int("nodes", nodes, minimum=1, maximum=16)
        check_int("cpus", cpus, minimum=0, maximum=64)
        check_int("gpus", gpus, minimum=0, maximum=64)
        self._shape = {"num_cpus": cpus, "resources": {resource: gpus}}
        self._count = nodes
        self._cluster: Cluster | None = None
        self._nodes: dict[str, Any] = {}
        self._head = ""

    def __enter__(self) -> LocalCluster:
        if ray.is_initialized():
            raise InvalidArgument(
                "this process is connected to Ray already: ray.shutdown() before a LocalCluster"
            )
        config = {**FAST_NODE_LOSS, **FAST_METRICS}
        head = {**self._shape, "include_dashboard": False, "_system_config": config}
        self._cluster = cluster = Cluster(initialize_head=True, head_node_args=head)
        head_node: Any = cluster.head_node
        self._head = str(head_node.node_id)
        self._nodes[self._head] = head_node
        try:
            for _ in range(self._count - 1):
                self.add_node()
            ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        except BaseException:
            cluster.shutdown()  # type: ignore[no-untyped-call]
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()  # type: ignore[no-untyped-call]
            self._cluster = None

    @property
    def address(self) -> str:
        """The cluster's address, for another driver's ``ray.init(address=...)``."""
        assert self._cluster is not None, "the cluster is not running"
        return str(self._cluster.address)

    @property
    def head(self) -> str:
        """The head node's id (hex): the driver's, the one never removed."""
        return self._head

    def metrics_url(self, node_id: str | None = None) -> str:
        """Where the metrics agent of node ``node_id`` (the head, the driver's, by default)
        answers Prometheus (with ``ray[default]``: a minimal Ray runs no agent)."""
        wanted = node_id or self.head
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if node["NodeID"] == wanted and node["Alive"]:
                return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        raise InvalidArgument(f"no live node {wanted} in this cluster: {self.node_ids()}")

    def node_ids(self) -> list[str]:
        """The nodes running now (hex ids), the head first."""
        return list(self._nodes)

    def add_node(self, **shape: Any) -> str:
        """Start one more node (the cluster's node shape, ``shape`` overriding it); its id."""
        assert self._cluster is not None, "the cluster is not running"
        node = self._cluster.add_node(wait=True, **{**self._shape, **shape})
        self._nodes[node.node_id] = node
        return str(node.node_id)

    def remove_node(self, node_id: str) -> None:
        """Lose a node: its raylet killed at once (its actors die with it)."""
        assert self._cluster is not None, "the cluster is not running"
        if node_id == self.head:
            raise InvalidArgument("the head node holds the driver's connection: remove another")
        node = self._nodes.pop(node_id, None)
        if node is None:
            raise InvalidArgument(f"no node {node_id} in this cluster: {self.node_ids()}")
        self._cluster.remove_node(node, allow_graceful=False)


def simulated_engine_actors(
    count: int, *, label: str = "sim", seed: int | None = None, **options: Any
) -> list[Any]:
    """Start ``count`` Ray engine actors, each hosting a ``SimulatedEngine(**options)``.

    Engine ``i`` is labelled ``f"{label}-{i}"``; with ``seed`` it draws its op latencies from
    ``seed + i``, so a fleet is reproducible and its engines differ.
    """
    check_int("count", count, minimum=1, maximum=MAX_FLEET)
    factories = fleet_factories(count, label=label, seed=seed, **options)
    return [start_engine_actor(factory) for factory in factories]


def simulated_multi_engine_actors(
    actors: int,
    engines_per_actor: int,
    *,
    label: str = "sim",
    seed: int | None = None,
    **options: Any,
) -> tuple[list[Any], list[HostedEngine]]:
    """Start ``actors`` actors of ``engines_per_actor`` ``SimulatedEngine(**options)`` each.

    Engine ``i`` (counting across actors) is labelled ``f"{label}-{i}"`` and, with ``seed``,
    draws its op latencies from ``seed + i``, as in ``simulated_engine_actors``. Returns the
    actors and the engine handles in order.
    """
    check_int("actors", actors, minimum=1, maximum=MAX_FLEET)
    check_int("engines_per_actor", engines_per_actor, minimum=1, maximum=MAX_FLEET)
    factories = fleet_factories(actors * engines_per_actor, label=label, seed=seed, **options)
    started: list[Any] = []
    handles: list[HostedEngine] = []
    for a in range(actors):
        first = a * engines_per_actor
        actor, hosted = start_multi_engine_actor(factories[first : first + engines_per_actor])
        started.append(actor)
        handles.extend(hosted)
    return started, handles


__all__ = [
    "FAST_NODE_LOSS",
    "LocalCluster",
    "init_local_ray",
    "local_ray",
    "simulated_engine_actors",
    "simulated_multi_engine_actors",
]
