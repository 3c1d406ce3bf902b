"""The engine seam: every call the library makes to an engine handle goes through here.

A group holds three kinds of handle: an ``EngineHost`` (an in-process backend), a Ray actor
handle of an ``EngineActor``, and a ``HostedEngine`` (one engine of a ``MultiEngineActor``).
Each kind has one ``EngineSeam`` implementation that knows how to send an operation without
waiting, what makes two handles the same engine, and how to stop a replaced engine. The wait
for a phase's calls (``wait``), the cancelling of a call nobody waits for (``cancel``) and the
mapping of what a call raised to an ``EngineOutcome`` (``classify``) live here too, so Ray is
named in this module and the backends, never in the lifecycle core.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Hashable, Sequence
from typing import Any, Protocol

import ray
from ray.actor import ActorHandle

from rollout_lifecycle.backends.engine import EngineBackend, EngineHost
from rollout_lifecycle.backends.gather import Landed, gather_calls
from rollout_lifecycle.backends.hosted import HostedEngine
from rollout_lifecycle.backends.http import url_identity
from rollout_lifecycle.core.events import logger
from rollout_lifecycle.core.exceptions import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineRestarted,
    EngineStateConflict,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.core.ops import Op
from rollout_lifecycle.core.outcome import EngineOutcome, Outcome


class EngineSeam(Protocol):
    """How the library reaches one kind of engine handle."""

    def send(self, handle: Any, op: Op | str, args: tuple[Any, ...]) -> Awaitable[Any]:
        """Issue ``op(*args)``; return what completes with its result, without waiting."""
        ...

    def identity(self, handle: Any) -> Hashable:
        """What makes two handles the same engine."""
        ...

    async def retire(self, handle: Any, deadline: float) -> None:
        """Stop an engine that was replaced, best effort, each step bounded by ``deadline``."""
        ...


async def _bounded(call: Awaitable[Any], deadline: float) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(_awaited(call), deadline)


async def _awaited(call: Awaitable[Any]) -> Any:
    return await call


def _actor_key(actor: Any) -> str:
    actor_id = getattr(actor, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else f"object-{id(actor)}"


class LocalSeam:
    """An ``EngineHost`` in this process: each call is an asyncio task on this loop."""

    def send(self, handle: EngineHost, op: Op | str, args: tuple[Any, ...]) -> Awaitable[Any]:
        task: Awaitable[Any] = asyncio.ensure_future(getattr(handle, op)(*args))
        return task

    def identity(self, handle: EngineHost) -> Hashable:
        # The server URL of an HTTP backend (normalised: localhost and 127.0.0.1 are one).
        url = getattr(handle.backend, "url", None)
        if isinstance(url, str):
            try:
                return ("url", url_identity(url))
            except InvalidArgument:
                pass
        return ("object", id(handle.backend))

    async def retire(self, handle: EngineHost, deadline: float) -> None:
        await _bounded(self.send(handle, Op.PAUSE, ("abort",)), deadline)
        await _bounded(handle.close(), deadline)


class HostedSeam:
    """One engine of a ``MultiEngineActor``: each call is a Ray call naming its index."""

    def send(self, handle: HostedEngine, op: Op | str, args: tuple[Any, ...]) -> Awaitable[Any]:
        ref: Awaitable[Any] = handle.send(str(op), args)
        return ref

    def identity(self, handle: HostedEngine) -> Hashable:
        return ("hosted", _actor_key(handle.actor), handle.index)

    async def retire(self, handle: HostedEngine, deadline: float) -> None:
        # Its actor hosts other engines: this engine is closed, the actor stays.
        await _bounded(self.send(handle, Op.PAUSE, ("abort",)), deadline)
        await _bounded(self.send(handle, Op.CLOSE, ()), deadline)


class ActorSeam:
    """A Ray actor handle of an ``EngineActor``: each call is an actor method call."""

    def send(self, handle: Any, op: Op | str, args: tuple[Any, ...]) -> Awaitable[Any]:
        ref: Awaitable[Any] = getattr(handle, op).remote(*args)
        return ref

    def identity(self, handle: Any) -> Hashable:
        return ("actor", _actor_key(handle))

    async def retire(self, handle: Any, deadline: float) -> None:
        # Abort first, so each request returns with its partial output (a generation client
        # resubmits it); close the backend (a launched server stops with its process group);
        # then kill the actor.
        await _bounded(self.send(handle, Op.PAUSE, ("abort",)), deadline)
        await _bounded(self.send(handle, Op.CLOSE, ()), deadline)
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # a dead actor may refuse to be killed again: nothing left to stop
            logger().debug("engine.retire_failed", handle=repr(handle))


_LOCAL, _HOSTED, _ACTOR = LocalSeam(), HostedSeam(), ActorSeam()


#: The seam of each handle type seen (one dict lookup per call instead of three isinstance).
_BY_TYPE: dict[type, EngineSeam] = {}


def seam_for(handle: Any) -> EngineSeam:
    """The seam of ``handle``'s kind; ``InvalidArgument`` for a handle of no known kind."""
    found = _BY_TYPE.get(type(handle))
    if found is not None:
        return found
    if isinstance(handle, EngineHost):
        found = _LOCAL
    elif isinstance(handle, HostedEngine):
        found = _HOSTED
    elif isinstance(handle, ActorHandle):
        found = _ACTOR
    else:
        raise InvalidArgument(f"{type(handle).__name__} is not an engine handle")
    _BY_TYPE[type(handle)] = found
    return found


def as_handle(engine: Any, group: str, index: int) -> Any:
    """What a group holds for ``engine``: the handle itself, or a bare backend in an
    ``EngineHost``; ``InvalidArgument`` naming the group and index for anything else."""
    if isinstance(engine, EngineHost | HostedEngine | ActorHandle):
        return engine
    if isinstance(engine, EngineBackend):
        return EngineHost(engine)
    raise InvalidArgument(
        f"engine #{index} of group {group!r} is {type(engine).__name__!s}, not an engine actor "
        f"handle, a HostedEngine, an EngineHost or an engine backend"
    )


def send(handle: Any, op: Op | str, args: tuple[Any, ...] = ()) -> Awaitable[Any]:
    """Issue ``op(*args)`` to ``handle``; do not wait."""
    name = op._value_ if type(op) is Op else op  # the plain name: attribute lookups cache it
    return seam_for(handle).send(handle, name, args)


def identity(handle: Any) -> Hashable:
    """What makes two handles the same engine: the server URL of an HTTP backend, the backend
    object of an ``EngineHost``, the Ray actor of an actor handle, the actor and index of a
    ``HostedEngine``."""
    try:
        return seam_for(handle).identity(handle)
    except InvalidArgument:
        pass
    # (checked last: an actor handle has every method of the backend protocol too)
    if isinstance(handle, EngineBackend):
        return _LOCAL.identity(EngineHost(handle))
    return ("object", id(handle))


async def retire(handle: Any, deadline: float) -> None:
    """Stop a replaced engine (it may be dead already), best effort."""
    await seam_for(handle).retire(handle, deadline)


async def wait(refs: Sequence[Awaitable[Any]], deadline: float) -> Landed:
    """Wait for every call of a phase until ``deadline`` seconds pass (see ``gather_calls``)."""
    return await gather_calls(refs, deadline)


def cancel(ref: object, future: asyncio.Future[Any]) -> None:
    """Stop an engine call nobody waits for (in process: cancel it; over Ray: ask Ray)."""
    future.cancel()
    if ref is future:
        return
    try:
        ray.cancel(ref)
    except Exception:  # best effort: the ref may be finished, or not a Ray ref at all
        return


def _ray_errors() -> tuple[tuple[type[BaseException], ...], type[BaseException]]:
    from ray import exceptions as rex

    dead: tuple[type[BaseException], ...] = (rex.RayActorError,)
    unavailable = getattr(rex, "ActorUnavailableError", None)
    if unavailable is not None:
        dead = (*dead, unavailable)
    return dead, rex.RayTaskError


_RAY_DEAD, _RAY_TASK_ERROR = _ray_errors()


def unwrap(exc: BaseException) -> BaseException:
    """The error an engine actor raised, without Ray's wrapping."""
    if isinstance(exc, _RAY_TASK_ERROR):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def classify(exc: BaseException, duration_s: float = 0.0) -> EngineOutcome:
    """Map any exception from an engine call (Ray's, a transport's, the library's) to an
    outcome: the one boundary where lower-layer errors are classified."""
    if isinstance(exc, _RAY_DEAD):
        return EngineOutcome(Outcome.DEAD, f"actor died: {type(exc).__name__}", duration_s)
    inner = unwrap(exc)
    detail = str(inner) or type(inner).__name__
    if isinstance(inner, _RAY_DEAD):
        return EngineOutcome(Outcome.DEAD, f"actor died: {type(inner).__name__}", duration_s)
    if isinstance(inner, EngineDead):
        return EngineOutcome(Outcome.DEAD, inner.message, duration_s)
    if isinstance(inner, EngineTimeout):
        return EngineOutcome(Outcome.TIMED_OUT, inner.message, duration_s)
    if isinstance(inner, EngineRejected):
        return EngineOutcome(
            Outcome.REJECTED, f"{inner.status}: {inner.message}", duration_s, inner.status
        )
    if isinstance(inner, EngineUnreachable):
        return EngineOutcome(Outcome.UNREACHABLE, inner.message, duration_s)
    if isinstance(inner, IllegalEngineOp):
        return EngineOutcome(Outcome.REFUSED, inner.reason, duration_s)
    if isinstance(inner, EngineRestarted):
        return EngineOutcome(Outcome.RESTARTED, inner.message, duration_s)
    if isinstance(inner, EngineStateConflict):
        return EngineOutcome(Outcome.CONFLICT, inner.message, duration_s)
    if isinstance(inner, EngineError):
        return EngineOutcome(Outcome.ERROR, inner.message, duration_s)
    if isinstance(inner, asyncio.TimeoutError | TimeoutError):
        return EngineOutcome(Outcome.TIMED_OUT, detail, duration_s)
    if isinstance(inner, ConnectionRefusedError):
        return EngineOutcome(Outcome.DEAD, detail, duration_s)
    return EngineOutcome(Outcome.ERROR, f"{type(inner).__name__}: {detail}", duration_s)


__all__ = [
    "ActorSeam",
    "EngineSeam",
    "HostedSeam",
    "Landed",
    "LocalSeam",
    "as_handle",
    "cancel",
    "classify",
    "identity",
    "retire",
    "seam_for",
    "send",
    "unwrap",
    "wait",
]
