"""Test support: fleets of simulated engines on Ray, and checks of the lifecycle invariants.

Used by the library's own tests, the demo and the benchmarks, and meant for users' tests of code
built on the library (no GPU needed).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Awaitable, Iterator, Mapping
from typing import Any

from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.backends.hosted import HostedEngine, start_multi_engine_actor
from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.values import check_int
from rollout_lifecycle.testing.barriers import (
    BARRIER_PAIRS,
    CYCLE_PHASES,
    History,
    barrier_violations,
    calls_received,
    check_history,
    cycle_order_violations,
    cycle_phase_of,
    cycle_rounds,
    fatal_calls,
)
from rollout_lifecycle.testing.fleets import (
    faulty_engines,
    no_push,
    push_reaching,
    received_ops,
    simulated,
    simulated_engines,
)
from rollout_lifecycle.testing.simulated import MAX_FLEET, SimulatedEngine, fleet_factories
from rollout_lifecycle.testing.sse import asse_events, sse_events
from rollout_lifecycle.testing.standin import StandInServer
from rollout_lifecycle.testing.waits import until, until_actor_gone, until_began


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray cluster for a script or demo (2 CPUs, no dashboard, quiet), unless one is
    running already; shut down on exit only if it was started here."""
    import ray

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


def send_to_engine(handle: Any, op: str, args: tuple[Any, ...] = ()) -> Awaitable[Any]:
    """Issue one engine operation (an ``EngineHost`` method name) to a handle the way the
    library does (a Ray actor handle, a ``HostedEngine`` or an ``EngineHost``), without waiting:
    a Ray object ref or an asyncio task. For baselines and tests that drive engines by hand;
    nothing is guarded or recorded."""
    return seam.send(handle, op, args)


def collector_load(root: object = None) -> int:
    """How many references CPython's cyclic garbage collector follows in a full collection:
    over the whole process, or over the objects reachable from ``root``. Collects first until
    nothing more is untracked (a tuple is untracked only once its items are, one level of
    nesting per collection). Records kept per engine call must not make it grow: every full
    collection walks them all."""
    tracked = -1
    for _ in range(10):
        gc.collect()
        if tracked == (tracked := len(gc.get_objects())):
            break
    if root is None:
        return sum(len(gc.get_referents(o)) for o in gc.get_objects())
    seen: set[int] = set()
    todo, load = [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, type):
            continue  # untracked: never walked; a class: shared, not the structure's own
        seen.add(id(obj))
        referents = gc.get_referents(obj)
        load += len(referents)
        todo.extend(referents)
    return load


def released_ops(history: History) -> list[Mapping[str, Any]]:
    """The release calls in one engine's history."""
    check_history("history", history)
    return [e for e in history if e.get("op") == "release_memory_occupation"]


__all__ = [
    "BARRIER_PAIRS",
    "CYCLE_PHASES",
    "History",
    "SimulatedEngine",
    "StandInServer",
    "asse_events",
    "barrier_violations",
    "calls_received",
    "collector_load",
    "cycle_order_violations",
    "cycle_phase_of",
    "cycle_rounds",
    "fatal_calls",
    "faulty_engines",
    "local_ray",
    "no_push",
    "push_reaching",
    "received_ops",
    "released_ops",
    "send_to_engine",
    "simulated",
    "simulated_engine_actors",
    "simulated_engines",
    "simulated_multi_engine_actors",
    "sse_events",
    "until",
    "until_actor_gone",
    "until_began",
]
