"""Test support: fleets of simulated engines, in process or on Ray, and checks of the lifecycle
invariants.

Used by the library's own tests, the demo and the benchmarks, and meant for users' tests of code
built on the library (no GPU needed). The in-process simulator and the checks import without
Ray; the names that need it (the actor fleets, ``local_ray``) load it when first asked for.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.lazy import lazy_names
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
from rollout_lifecycle.testing.simulated import SimulatedEngine, fleet_factories
from rollout_lifecycle.testing.sse import asse_events, sse_events
from rollout_lifecycle.testing.standin import StandInServer
from rollout_lifecycle.testing.waits import held_at, until, until_actor_gone, until_began

if TYPE_CHECKING:
    from rollout_lifecycle.backends.actor import start_engine_actor as start_engine_actor
    from rollout_lifecycle.backends.hosted import HostedEngine as HostedEngine
    from rollout_lifecycle.backends.hosted import (
        start_multi_engine_actor as start_multi_engine_actor,
    )
    from rollout_lifecycle.testing.actor_fleets import (
        LocalCluster,
        local_ray,
        simulated_engine_actors,
        simulated_multi_engine_actors,
    )

#: Names whose modules load when first asked for: they bring Ray with them.
_LAZY: dict[str, str] = {
    "LocalCluster": "rollout_lifecycle.testing.actor_fleets",
    "local_ray": "rollout_lifecycle.testing.actor_fleets",
    "simulated_engine_actors": "rollout_lifecycle.testing.actor_fleets",
    "simulated_multi_engine_actors": "rollout_lifecycle.testing.actor_fleets",
    "start_engine_actor": "rollout_lifecycle.backends.actor",
    "HostedEngine": "rollout_lifecycle.backends.hosted",
    "start_multi_engine_actor": "rollout_lifecycle.backends.hosted",
}


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
    "LocalCluster",
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
    "fleet_factories",
    "held_at",
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


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)
