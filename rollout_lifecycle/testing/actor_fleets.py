"""Fleets of simulated engines in Ray actors, and a local Ray cluster to run them on.

The part of the test kit that needs Ray: ``rollout_lifecycle.testing`` loads this module the
first time one of its names is asked for, so the in-process simulator imports without Ray.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import ray

from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.backends.hosted import HostedEngine, start_multi_engine_actor
from rollout_lifecycle.contract.values import check_int
from rollout_lifecycle.testing.simulated import MAX_FLEET, fleet_factories


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray cluster for a script or demo (2 CPUs, no dashboard, quiet), unless one is
    running already; shut down on exit only if it was started here."""
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False
        )
    try:
        yield
    finally:
        if started:
            ray.shutdown()


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


__all__ = ["local_ray", "simulated_engine_actors", "simulated_multi_engine_actors"]
