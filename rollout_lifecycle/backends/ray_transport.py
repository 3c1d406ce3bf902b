"""Engines behind Ray: the seam of a Ray actor handle of an ``EngineActor``, and how the library
waits for, cancels and classifies Ray's object refs.

Importing this module registers both with the engine seam (``contract.seam``); the modules that
make Ray handles (``backends.actor``, ``backends.hosted``) import it, so Ray is loaded only when
a Ray handle can exist.

The barrier's wait for Ray refs does not wrap each in an asyncio future (every such future costs
a thread hop and an event-loop wake-up when its call lands): one helper thread waits for all of
a phase's refs with ``ray.wait`` in slices and fetches each slice's results with one ``ray.get``,
so a call's end time is known to within the slice (10 ms, or a quarter of the time waited so
far, at most 100 ms) while the barrier itself passes as the last call lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Hashable
from typing import Any

import ray
from ray import exceptions as rex
from ray.actor import ActorHandle

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.gather import Landed
from rollout_lifecycle.contract.ops import CHECKED, FENCED, RUN

#: Slices of one ``ray.wait``: a ref's end time is known to within the slice, which grows with
#: the phase (a fraction of the time waited so far), so a long phase costs few wake-ups. The
#: last ref ends the wait at once (``ray.wait`` returns when every ref is ready). Each wake-up
#: costs the driver a ``ray.wait`` over the refs still pending, on cores the engines' actors may
#: share: at 64 single-engine actors on 2 cores, slices of 2 ms and a tenth (31 wake-ups in a
#: 150 ms phase against 10 now) cost ~0.045 s of the driver's CPU per 6-phase cycle; in one run
#: of interleaved cycles the library's cycle was 1.06 x the bare ``ray.get`` floor's with them
#: and 1.01 x without (benchmarks/README.md, section 1, gives the spread over runs).
_MIN_SLICE_S = 0.01
_MAX_SLICE_S = 0.1
_SLICE_FRACTION = 0.25


def actor_key(actor: Any) -> str:
    """What names a Ray actor across its handles."""
    actor_id = getattr(actor, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else f"object-{id(actor)}"


class ActorSeam:
    """A Ray actor handle of an ``EngineActor``: each call is an actor method call."""

    def send(self, handle: Any, op: str, args: tuple[Any, ...]) -> Awaitable[Any]:
        if op == RUN:
            # A command (``EngineHost.run(name, *args)``) goes as a call of the host's method
            # of its name where the host has one: Ray sends a call with no arguments at about
            # three quarters of the cost of one with any (a read's ``run("server_info")``
            # measured 35% dearer than ``server_info()`` on 64 actors; ``benchmarks.overhead``'s
            # cycle 4-7%). ``run`` carries the rest.
            method = getattr(handle, args[0], None)
            if method is not None:
                direct: Awaitable[Any] = method.remote(*args[1:])
                return direct
        if op == CHECKED:
            args = _plain_expectation(args, 0)
        elif op == FENCED and len(args) > 2 and args[1] == CHECKED:
            args = _plain_expectation(args, 2)
        ref: Awaitable[Any] = getattr(handle, op).remote(*args)
        return ref

    def identity(self, handle: Any) -> Hashable:
        return ("actor", actor_key(handle))

    async def retire(self, handle: Any, deadline: float) -> None:
        await seam.abort_and_close(self, handle, deadline)  # then the actor is killed
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # a dead actor may refuse to be killed again: nothing left to stop
            logger().debug("engine.retire_failed", handle=repr(handle))


def _plain_expectation(args: tuple[Any, ...], at: int) -> tuple[Any, ...]:
    """``args`` with the checked call's expectation (``args[at]``, a tuple) as a list: Ray
    serializes each argument on its own, a list of plain values as msgpack and a tuple through
    pickle (``ray._private.serialization.SerializationContext._serialize_to_msgpack`` hands what
    msgpack will not take to pickle5): 21 against 3 us to serialize, and submitting a checked
    pause took 413 against 359 us of the driver's CPU (median of 25 batches of 200 calls). In
    process the tuple stays: the record gives the same one to every call it proves."""
    return (*args[:at], list(args[at]), *args[at + 1 :])


def _dead_errors() -> tuple[type[BaseException], ...]:
    dead: tuple[type[BaseException], ...] = (rex.RayActorError,)
    unavailable = getattr(rex, "ActorUnavailableError", None)
    if unavailable is not None:
        dead = (*dead, unavailable)
    return dead


def _unwrap(exc: BaseException) -> BaseException:
    """The error an engine actor raised, without Ray's wrapping."""
    if isinstance(exc, rex.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def _cancel(ref: Any) -> None:
    ray.cancel(ref)


def wait_refs(
    loop: asyncio.AbstractEventLoop,
    refs: list[Any],
    positions: list[int],
    landed: Landed,
    timeout: float,
    stop: threading.Event,
) -> asyncio.Future[BaseException | None]:
    """Wait in a helper thread; the future gives the error that stopped it early, if any."""
    done: asyncio.Future[BaseException | None] = loop.create_future()
    where = {ref: i for ref, i in zip(refs, positions, strict=True)}
    failure: list[BaseException] = []

    def finish() -> None:
        if not done.done():
            done.set_result(failure[0] if failure else None)

    def run() -> None:
        start = time.monotonic()
        pending = refs
        try:
            while pending and not stop.is_set():
                waited = time.monotonic() - start
                left = timeout - waited
                if left <= 0:
                    break
                piece = min(left, max(_MIN_SLICE_S, min(_MAX_SLICE_S, waited * _SLICE_FRACTION)))
                ready, pending = ray.wait(
                    pending, num_returns=len(pending), timeout=piece, fetch_local=False
                )
                if ready:
                    now = time.monotonic()
                    _fetch(ready, where, landed, now)
        except Exception as exc:  # e.g. refs Ray cannot wait for together
            failure.append(exc)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(finish)

    threading.Thread(target=run, name="rollout-lifecycle-wait", daemon=True).start()
    return done


def _fetch(ready: list[Any], where: dict[Any, int], landed: Landed, now: float) -> None:
    """Record the results of refs that landed (one ``ray.get``; one per ref only on errors)."""
    try:
        values = ray.get(ready)
    except Exception:
        for ref in ready:
            i = where[ref]
            try:
                landed.values[i] = ray.get(ref)
            except Exception as exc:
                landed.errors[i] = exc
            landed.ends[i] = now
        return
    for ref, value in zip(ready, values, strict=True):
        i = where[ref]
        landed.values[i] = value
        landed.ends[i] = now


seam.register(ActorHandle, ActorSeam())
seam.register_refs(
    ray.ObjectRef,
    seam.RefKind(wait=wait_refs, cancel=_cancel, unwrap=_unwrap, dead=_dead_errors()),
)

__all__ = ["ActorSeam", "actor_key", "wait_refs"]
