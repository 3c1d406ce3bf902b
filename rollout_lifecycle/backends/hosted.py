"""Many engines in one Ray actor: a fleet of thousands of simulated engines on a few cores.

A ``MultiEngineActor`` hosts several engine backends on one event loop; a ``HostedEngine`` names
one of them and is what an ``EngineGroup`` holds in its place. Each call to a hosted engine is
still its own Ray call (``actor.call.remote(index, op, ...)``), so a group drives it, guards it
and times it exactly like an engine with an actor of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rollout_lifecycle.backends.actor import build_backend
from rollout_lifecycle.backends.engine import EngineBackend, EngineHost
from rollout_lifecycle.backends.ray_transport import actor_key
from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.values import check_int

#: The most engines one actor hosts (as many as a simulated fleet may have).
MAX_HOSTED = 1_000_000

#: The calls a hosted engine answers: the public methods of ``EngineHost``.
HOSTED_OPS: frozenset[str] = frozenset(
    name for name in dir(EngineHost) if not name.startswith("_") and name != "backend"
)


def _check_factories(factories: object) -> None:
    if isinstance(factories, str | bytes) or not isinstance(factories, Sequence) or not factories:
        raise InvalidArgument(f"factories must be a non-empty sequence, got {factories!r}")
    for factory in factories:
        if not callable(factory):
            raise InvalidArgument(f"every factory must be callable, got {factory!r}")


class MultiEngineActorBody:
    """Hosts one ``EngineHost`` per backend factory; the class behind ``MultiEngineActor``."""

    def __init__(self, factories: Sequence[Callable[[], EngineBackend]]) -> None:
        _check_factories(factories)
        self._hosts = [EngineHost(build_backend(f)) for f in factories]

    async def call(self, index: int, op: str, *args: Any) -> Any:
        """Run ``op(*args)`` on engine ``index``, as its own actor would."""
        if not isinstance(op, str) or op not in HOSTED_OPS:
            raise InvalidArgument(f"{op!r} is not an engine operation")
        check_int("index", index, maximum=len(self._hosts) - 1)
        return await getattr(self._hosts[index], op)(*args)

    async def ping(self) -> list[str]:
        """Answer once the actor is up; the label of every hosted engine, in order."""
        return [h.backend.label for h in self._hosts]

    async def histories(self) -> list[list[dict[str, Any]]]:
        """Every hosted engine's recorded calls (``EngineHost.history``), in order."""
        return [await h.history() for h in self._hosts]

    async def memories(self) -> list[dict[str, int]]:
        """Every hosted engine's resident bytes per tag (``EngineHost.memory``), in order."""
        return [await h.memory() for h in self._hosts]

    async def close(self) -> None:
        """Close every hosted engine."""
        for host in self._hosts:
            await host.close()


#: The Ray actor class; ``start_multi_engine_actor`` starts one.
MultiEngineActor: Any = ray.remote(MultiEngineActorBody)


@dataclass(frozen=True, eq=False)
class HostedEngine:
    """A handle on engine ``index`` of a ``MultiEngineActor``; an ``EngineGroup`` accepts it."""

    actor: Any
    index: int

    def __post_init__(self) -> None:
        check_int("index", self.index, maximum=MAX_HOSTED)

    def send(self, op: str, args: tuple[Any, ...] = ()) -> Any:
        """Issue ``op(*args)`` to the hosted engine; returns the Ray object ref, without waiting."""
        return self.actor.call.remote(self.index, op, *args)


class HostedSeam:
    """One engine of a ``MultiEngineActor``: each call is a Ray call naming its index."""

    def send(self, handle: HostedEngine, op: str, args: tuple[Any, ...]) -> Awaitable[Any]:
        ref: Awaitable[Any] = handle.send(op, args)
        return ref

    def identity(self, handle: HostedEngine) -> Hashable:
        return ("hosted", actor_key(handle.actor), handle.index)

    async def retire(self, handle: HostedEngine, deadline: float) -> None:
        # Its actor hosts other engines: this engine is closed, the actor stays.
        await seam.abort_and_close(self, handle, deadline)


seam.register(HostedEngine, HostedSeam())


def start_multi_engine_actor(
    factories: Sequence[Callable[[], EngineBackend]], **options: Any
) -> tuple[Any, list[HostedEngine]]:
    """Start one actor hosting an engine per factory; returns it and a handle per engine.

    No CPU is reserved by default (the engines' work is I/O); the actor accepts as many
    concurrent calls as its engines can have generate requests in flight.
    """
    _check_factories(factories)
    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 100_000, **options}
    actor = MultiEngineActor.options(**opts).remote(list(factories))
    return actor, [HostedEngine(actor, i) for i in range(len(factories))]


__all__ = [
    "HOSTED_OPS",
    "HostedEngine",
    "HostedSeam",
    "MultiEngineActor",
    "MultiEngineActorBody",
    "start_multi_engine_actor",
]
