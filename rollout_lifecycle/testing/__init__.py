"""Test support: fleets of simulated engines on Ray, and checks of the lifecycle invariants.

Used by the library's own tests, the demo and the benchmarks, and meant for users' tests of code
built on the library (no GPU needed).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Any

from rollout_lifecycle.backends import seam
from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.backends.hosted import HostedEngine, start_multi_engine_actor
from rollout_lifecycle.core.config import check_int
from rollout_lifecycle.core.exceptions import InvalidArgument
from rollout_lifecycle.testing.simulated import MAX_FLEET, SimulatedEngine, fleet_factories
from rollout_lifecycle.testing.standin import StandInServer

History = Sequence[Mapping[str, Any]]


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


def _check_entry(entry: object) -> None:
    if not isinstance(entry, Mapping):
        raise InvalidArgument(f"a history entry must be a mapping, got {entry!r}")


def _check_history(what: str, history: object) -> None:
    if isinstance(history, str | bytes | Mapping) or not isinstance(history, Sequence):
        raise InvalidArgument(f"{what} must be a sequence of history entries, got {history!r}")
    for entry in history:
        _check_entry(entry)


#: The phases of one colocated cycle, in the order the barriers impose, as (name, op, tag).
CYCLE_PHASES: tuple[tuple[str, str, str | None], ...] = (
    ("pause", "pause_generation", None),
    ("flush", "flush_cache", None),
    ("release", "release_memory_occupation", None),
    ("resume_weights", "resume_memory_occupation", "weights"),
    ("resume_kv", "resume_memory_occupation", "kv_cache"),
    ("continue", "continue_generation", None),
)


def cycle_phase_of(entry: Mapping[str, Any]) -> str | None:
    """The cycle phase (``CYCLE_PHASES``) a history entry belongs to, if any."""
    _check_entry(entry)
    for name, op, tag in CYCLE_PHASES:
        if entry.get("op") != op:
            continue
        if tag is None or tag in (entry.get("tags") or ()):
            return name
    return None


def cycle_rounds(history: History) -> list[list[Mapping[str, Any]]]:
    """Split one engine's history at each pause: round k is what follows its k-th pause."""
    _check_history("history", history)
    rounds: list[list[Mapping[str, Any]]] = []
    for entry in history:
        if entry.get("op") == "pause_generation":
            rounds.append([])
        if rounds:
            rounds[-1].append(entry)
    return rounds


def cycle_order_violations(histories: Mapping[str, History]) -> list[str]:
    """Barrier violations across engines, round by round (invariants 1, 2 and 4).

    In every round, each phase of ``CYCLE_PHASES`` must end on every engine before the next
    phase present in that round starts on any engine. Also reports any fatal op.
    """
    if not isinstance(histories, Mapping):
        raise InvalidArgument(f"histories must map engine ids to histories, got {histories!r}")
    for engine, history in histories.items():
        _check_history(f"histories[{engine!r}]", history)
    problems: list[str] = []
    for engine, history in histories.items():
        for entry in history:
            if entry.get("outcome") == "fatal":
                problems.append(f"{engine}: fatal {entry.get('op')} ({entry.get('detail')})")
    per_engine = {engine: cycle_rounds(h) for engine, h in histories.items()}
    count = max((len(r) for r in per_engine.values()), default=0)
    names = [p[0] for p in CYCLE_PHASES]
    for k in range(count):
        spans: dict[str, list[tuple[float, float, str]]] = {n: [] for n in names}
        for engine, rounds in per_engine.items():
            if k >= len(rounds):
                continue
            for entry in rounds[k]:
                phase = cycle_phase_of(entry)
                if phase is not None:
                    spans[phase].append((float(entry["start"]), float(entry["end"]), engine))
        present = [n for n in names if spans[n]]
        for earlier, later in itertools.pairwise(present):
            last_end = max(spans[earlier], key=lambda s: s[1])
            first_start = min(spans[later], key=lambda s: s[0])
            if first_start[0] < last_end[1]:
                problems.append(
                    f"round {k}: {later} started on {first_start[2]} at {first_start[0]:.6f} "
                    f"before {earlier} ended on {last_end[2]} at {last_end[1]:.6f}"
                )
    return problems


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
    _check_history("history", history)
    return [e for e in history if e.get("op") == "release_memory_occupation"]


__all__ = [
    "CYCLE_PHASES",
    "SimulatedEngine",
    "StandInServer",
    "collector_load",
    "cycle_order_violations",
    "cycle_phase_of",
    "cycle_rounds",
    "local_ray",
    "released_ops",
    "send_to_engine",
    "simulated_engine_actors",
    "simulated_multi_engine_actors",
]
