"""The engine actor: a Ray async actor hosting one engine backend; what groups hold in production.

The backend is built inside the actor from a factory, so a client (an HTTP connection pool, a
simulated engine with its scheduler task) lives on the actor's own event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from rollout_lifecycle.backends import ray_transport  # noqa: F401 - registers the Ray seam
from rollout_lifecycle.backends.engine import EngineBackend, EngineHost
from rollout_lifecycle.contract.exceptions import InvalidArgument


def build_backend(factory: Callable[[], EngineBackend]) -> EngineBackend:
    """Call an engine factory and check that it made an engine backend."""
    if not callable(factory):
        raise InvalidArgument(f"an engine factory must be callable, got {factory!r}")
    backend = factory()
    if not isinstance(backend, EngineBackend):
        raise InvalidArgument(
            f"engine factory returned {type(backend).__name__}, not an engine backend"
        )
    return backend


class EngineActorBody(EngineHost):
    """``EngineHost`` built from a backend factory; the class behind ``EngineActor``."""

    def __init__(self, factory: Callable[[], EngineBackend]) -> None:
        super().__init__(build_backend(factory))

    async def ping(self) -> str:
        """Answer once the actor is up; returns the backend's label."""
        return self.backend.label

    async def node_id(self) -> str:
        """The Ray node this actor runs on (hex id; ``backends/placement.py`` checks it)."""
        return str(ray.get_runtime_context().get_node_id())


#: The Ray actor class. ``EngineActor.options(num_cpus=0).remote(factory)`` starts one.
EngineActor: Any = ray.remote(EngineActorBody)


def start_engine_actor(
    factory: Callable[[], EngineBackend], *, name: str | None = None, **options: Any
) -> Any:
    """Start one engine actor (no CPU reservation by default: the engine's work is I/O)."""
    if not callable(factory):
        raise InvalidArgument(f"factory must be callable, got {factory!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise InvalidArgument(f"name must be a non-empty string or None, got {name!r}")
    opts: dict[str, Any] = {"num_cpus": 0, **options}
    if name is not None:
        opts["name"] = name
    return EngineActor.options(**opts).remote(factory)
