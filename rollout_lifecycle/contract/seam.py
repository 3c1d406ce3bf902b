"""The engine seam: every call the library makes to an engine handle goes through here.

A group holds handles of some kind: an ``EngineHost`` (an in-process backend), a Ray actor
handle, one engine of a multi-engine actor, or whatever a backend brings. Each kind has one
``EngineSeam`` that knows how to send an operation without waiting, what makes two handles the
same engine, and how to stop a replaced engine; a backend registers it for its handle type
(``register``) when its module is imported. A backend whose calls return references of its own
kind (Ray's object refs) registers that kind too (``register_refs``): how to wait for many at
once, how to cancel one, and which of its errors mean the engine is gone. A backend that can
wrap a bare object into a handle (an engine backend into an ``EngineHost``) registers an
adopter (``register_adopter``).

So the lifecycle core names no transport: it imports neither Ray nor httpx, and a new kind of
engine is a backend module and its registration. The mapping of what a call raised to an
``EngineOutcome`` (``classify``) is here too: the one boundary where lower-layer errors are
classified.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_lifecycle.contract.commands import Close, EngineCommand, Pause
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineError,
    EngineFenced,
    EngineRejected,
    EngineRestarted,
    EngineStateConflict,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.gather import BatchWait, Landed, gather_calls
from rollout_lifecycle.contract.ops import RUN, Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.contract.values import PauseMode

#: The calls that retire an engine: an abort pause, then a close.
_ABORT_ALL, _CLOSE = Pause(PauseMode.ABORT), Close()


class EngineSeam(Protocol):
    """How the library reaches one kind of engine handle."""

    def send(self, handle: Any, op: str, args: tuple[Any, ...]) -> Awaitable[Any]:
        """Issue ``op(*args)``; return what completes with its result, without waiting."""
        ...

    def identity(self, handle: Any) -> Hashable:
        """What makes two handles the same engine."""
        ...

    async def retire(self, handle: Any, deadline: float) -> None:
        """Stop an engine that was replaced, best effort, each step bounded by ``deadline``."""
        ...


@dataclass(frozen=True)
class RefKind:
    """What the library needs of a transport's own kind of call reference."""

    #: Waits for many of them at once (see ``gather.BatchWait``).
    wait: BatchWait
    #: Asks the transport to stop the call behind one (best effort; it may have finished).
    cancel: Callable[[Any], None]
    #: The error the engine raised, without the transport's wrapping of it.
    unwrap: Callable[[BaseException], BaseException]
    #: The transport's errors that mean the engine (its process, its actor) is gone.
    dead: tuple[type[BaseException], ...]


#: Handle types in the order registered, and the seam of each type seen (one dict lookup per
#: call instead of an isinstance per registration).
_SEAMS: list[tuple[type, EngineSeam]] = []
_BY_TYPE: dict[type, EngineSeam] = {}
_ADOPTERS: list[Callable[[Any], Any | None]] = []
_REF_KINDS: list[tuple[type, RefKind]] = []
_REF_BY_TYPE: dict[type, RefKind | None] = {}
_DEAD: tuple[type[BaseException], ...] = ()


def register(handle_type: type, seam: EngineSeam) -> None:
    """Reach handles of ``handle_type`` (and its subclasses) through ``seam``."""
    _SEAMS.append((handle_type, seam))
    _BY_TYPE.clear()


def register_adopter(adopt: Callable[[Any], Any | None]) -> None:
    """``adopt(obj)`` returns the handle that serves ``obj``, or None if it is not its kind."""
    _ADOPTERS.append(adopt)


def register_refs(ref_type: type, kind: RefKind) -> None:
    """Calls of some transport return ``ref_type`` references: wait, cancel and classify them
    as ``kind`` says."""
    global _DEAD
    _REF_KINDS.append((ref_type, kind))
    _REF_BY_TYPE.clear()
    _DEAD = (*_DEAD, *kind.dead)


def _found(handle: Any) -> EngineSeam | None:
    """The seam registered for ``handle``'s type (or a base of it), None if there is none."""
    kind = type(handle)
    found = _BY_TYPE.get(kind)
    if found is None:
        found = next((seam for t, seam in _SEAMS if isinstance(handle, t)), None)
        if found is not None:
            _BY_TYPE[kind] = found
    return found


def seam_for(handle: Any) -> EngineSeam:
    """The seam of ``handle``'s kind; ``InvalidArgument`` for a handle of no registered kind."""
    found = _found(handle)
    if found is None:
        raise InvalidArgument(
            f"{type(handle).__name__} is not an engine handle (no engine seam is registered "
            f"for it; importing its backend registers one)"
        )
    return found


def _adopted(obj: object) -> Any | None:
    for adopt in _ADOPTERS:
        handle = adopt(obj)
        if handle is not None:
            return handle
    return None


def as_handle(engine: Any, group: str, index: int) -> Any:
    """What a group holds for ``engine``: the handle itself, or what a backend wraps it in (a
    bare engine backend in an ``EngineHost``); ``InvalidArgument`` naming the group and index
    for anything else."""
    if _found(engine) is not None:
        return engine
    handle = _adopted(engine)
    if handle is not None:
        return handle
    raise InvalidArgument(
        f"engine #{index} of group {group!r} is {type(engine).__name__!s}, not an engine actor "
        f"handle, a HostedEngine, an EngineHost or an engine backend"
    )


def send(handle: Any, op: Op | str, args: tuple[Any, ...] = ()) -> Awaitable[Any]:
    """Issue ``op(*args)`` to ``handle``; do not wait."""
    name = op._value_ if type(op) is Op else op  # the plain name: attribute lookups cache it
    return seam_for(handle).send(handle, name, args)


def command(handle: Any, what: EngineCommand) -> Awaitable[Any]:
    """Issue the typed command ``what`` to ``handle``; do not wait. It goes as its wire form
    (``EngineCommand.wire``: its operation's name and its args, plain values) to the engine
    host's one generic method, ``EngineHost.run``."""
    return seam_for(handle).send(handle, RUN, what.wire)


def identity(handle: Any) -> Hashable:
    """What makes two handles the same engine (the seam of its kind says: the server URL of an
    HTTP backend, the Ray actor of an actor handle, ...); a bare object a backend adopts is the
    engine of its handle; anything else is itself."""
    found = _found(handle)
    if found is not None:
        return found.identity(handle)
    adopted = _adopted(handle)
    if adopted is not None:
        return seam_for(adopted).identity(adopted)
    return ("object", id(handle))


async def bounded(call: Awaitable[Any], deadline: float) -> None:
    """Await ``call`` for at most ``deadline`` seconds, ignoring what it raises."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(_awaited(call), deadline)


async def _awaited(call: Awaitable[Any]) -> Any:
    return await call


async def abort_and_close(transport: EngineSeam, handle: Any, deadline: float) -> None:
    """How retiring an engine starts on every transport: an ``abort`` pause, so that each of
    its requests returns with its partial output (a generation client resubmits it), then a
    close of its backend (a launched server stops with its process group); each step bounded
    by ``deadline`` and best effort."""
    await bounded(transport.send(handle, RUN, _ABORT_ALL.wire), deadline)
    await bounded(transport.send(handle, RUN, _CLOSE.wire), deadline)


async def retire(handle: Any, deadline: float) -> None:
    """Stop a replaced engine (it may be dead already), best effort."""
    await seam_for(handle).retire(handle, deadline)


def _ref_kind(ref: object) -> RefKind | None:
    kind = type(ref)
    if kind in _REF_BY_TYPE:
        return _REF_BY_TYPE[kind]
    found = next((k for t, k in _REF_KINDS if isinstance(ref, t)), None)
    _REF_BY_TYPE[kind] = found
    return found


def _batch_of(ref: object) -> BatchWait | None:
    kind = _ref_kind(ref)
    return kind.wait if kind is not None else None


async def wait(refs: Sequence[Awaitable[Any]], deadline: float) -> Landed:
    """Wait for every call of a phase until ``deadline`` seconds pass (see ``gather_calls``)."""
    return await gather_calls(refs, deadline, _batch_of)


def cancel(ref: object, future: asyncio.Future[Any]) -> None:
    """Stop an engine call nobody waits for: cancel its future here and, for a reference of a
    registered kind, ask its transport to stop the call."""
    future.cancel()
    if ref is future:
        return
    kind = _ref_kind(ref)
    if kind is None:
        return
    try:
        kind.cancel(ref)
    except Exception:  # best effort: the call may be finished already
        return


def unwrap(exc: BaseException) -> BaseException:
    """The error an engine raised, without a transport's wrapping of it."""
    for _, kind in _REF_KINDS:
        inner = kind.unwrap(exc)
        if inner is not exc:
            return inner
    return exc


def classify(exc: BaseException, duration_s: float = 0.0) -> EngineOutcome:
    """Map any exception from an engine call (a transport's, the library's) to an outcome."""
    if isinstance(exc, _DEAD):
        return EngineOutcome(Outcome.DEAD, f"actor died: {type(exc).__name__}", duration_s)
    inner = unwrap(exc)
    detail = str(inner) or type(inner).__name__
    if isinstance(inner, _DEAD):
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
    if isinstance(inner, EngineFenced):  # (carried out nothing, as a refusal)
        return EngineOutcome(Outcome.REFUSED, inner.message, duration_s)
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
    "EngineSeam",
    "Landed",
    "RefKind",
    "as_handle",
    "bounded",
    "cancel",
    "classify",
    "identity",
    "register",
    "register_adopter",
    "register_refs",
    "retire",
    "seam_for",
    "send",
    "unwrap",
    "wait",
]
