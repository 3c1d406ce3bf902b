"""One lifecycle call at a time: the operation in progress, user-code scopes, and cancellation.

Every public lifecycle call becomes an ``Operation`` and runs under the server's lock
(``Serializer.run``). User code the operation runs (hooks, the weight push, a ``recover()``
factory) runs in a ``Scope``: a call to the server made from inside it is part of the operation
and runs inline; one made by a task the user code left behind waits for the lock like any
other. User code that runs in the middle of a step (a ``before_<phase>`` hook or the weight
push, inside a transition in progress, and a ``recover()`` factory) cannot fire a transition of
its own: a lifecycle call from it (``LIFECYCLE_CALLS``) is refused at once with
``IllegalTransition``, before anything is sent. A cancelled caller never abandons a phase in
flight: the operation is asked to stop at its next phase boundary, and ``CancelledError``
reaches the caller once the records are exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import EngineClaimed, HookFailed, IllegalTransition
from rollout_lifecycle.core import terminate
from rollout_lifecycle.core.calls import LIFECYCLE_CALLS

# A lifecycle call (``calls.LIFECYCLE_CALLS``) made from user code that runs in the middle of a
# step (``Scope.refuse``) is refused; the others (``state``, ``snapshot()``, ``probe()``,
# ``sync_router()``) fire no transition and are allowed anywhere.


@dataclass(eq=False)
class Operation:
    """One public call in progress; ``cancelled`` asks it to stop at the next phase boundary."""

    call: str
    cancelled: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    #: The trigger of the transition in progress (``Machine.fire``), while its phase runs: the
    #: ``before_`` hooks and the weight push run inside it.
    transition: str | None = None
    #: The user code (hooks, weight push, factory) this operation is waiting for: cancelling
    #: the operation cancels it.
    running: set[asyncio.Future[Any]] = field(default_factory=set)


@dataclass(eq=False)
class Scope:
    """One run of user code (a hook, weight push or factory) inside an operation.

    A call to the server made while it runs is part of the operation (it runs inline, since
    the operation holds the lock, one at a time per scope); once the user code has returned
    or was stopped, a call from a task it left behind is a call of its own, serialized behind
    the operation. Calls still running inline when the user code returns finish before the
    operation goes on. When ``refuse`` is set, the user code runs in the middle of a step and
    a lifecycle call made while it runs is refused instead (``refusal``).
    """

    #: Why a lifecycle call from this user code is refused (it runs inside a transition in
    #: progress, or in ``recover()`` before the replacements are swapped in); None when such
    #: a call runs inline.
    refuse: str | None = None
    #: The server's state when the user code started (it does not change while it runs).
    state: str = ""
    closed: bool = False
    #: The task running async user code: it has returned once the task is done (even before
    #: the operation has resumed to notice).
    task: asyncio.Future[Any] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: dict[asyncio.Future[Any], Operation] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        """Whether the user code is still running."""
        return not self.closed and (self.task is None or not self.task.done())

    def refusal(self, call: str) -> IllegalTransition | None:
        """The error refusing ``call`` made while the user code runs; None when it may run."""
        if self.refuse is None or call not in LIFECYCLE_CALLS:
            return None
        return IllegalTransition(call, self.state, (), reason=self.refuse)


#: (server, operation, scope of the user code running, if any) of the current task.
CURRENT: contextvars.ContextVar[tuple[object, Operation, Scope | None] | None] = (
    contextvars.ContextVar("rollout_lifecycle_current_operation", default=None)
)


def current(owner: object) -> tuple[Operation, Scope | None] | None:
    """The operation of ``owner`` (a server) the current task runs in, and its open scope."""
    found = CURRENT.get()
    if found is None or found[0] is not owner:
        return None
    return found[1], found[2]


class HookCancelled(HookFailed):
    """User code was cancelled because its operation was: the call stops at the last
    boundary it completed and its caller sees ``CancelledError``."""


def cancel(op: Operation) -> None:
    """Ask ``op`` to stop at its next boundary, and cancel the user code it waits for."""
    op.cancelled = True
    for task in list(op.running):
        task.cancel()


class CallObserver(Protocol):
    """What the serializer reports of each call it runs under the lock (metrics, timeline)."""

    async def begin(self, op: Operation) -> None:
        """The call has the lock and is about to run."""
        ...

    async def end(self, op: Operation, outcome: str) -> None:
        """The call ended with ``outcome`` (``ok``, ``error`` or ``cancelled``)."""
        ...

    def refused(self, op: Operation, error: EngineClaimed) -> None:
        """The call never began: another controller holds one of its engines."""
        ...


class Serializer:
    """Runs public calls one at a time, and calls from user code inside the one running."""

    def __init__(
        self,
        owner: object,
        name: str,
        observer: CallObserver,
        check: Callable[[str], None],
        claim: Callable[[str], Awaitable[Callable[[], None]]] | None = None,
        completed: Callable[[], None] | None = None,
    ) -> None:
        self._owner = owner
        self._name = name
        self._observer = observer
        #: Refuses a call before it runs (a group with no live engine).
        self._check = check
        #: Claims the engines for a whole call (``core/claims.Claims``); returns the release.
        self._claim = claim
        #: Runs once a lifecycle call made outside any operation has completed (a router out
        #: of step with the engines that serve raises there: ``RouterSync.check``).
        self._completed = completed
        self.lock = asyncio.Lock()
        terminate.install()  # a SIGTERM lets the call in progress settle first

    async def run(self, call: str, body: Callable[[], Awaitable[None]]) -> dict[str, float]:
        """Run ``body`` as the public call ``call``; its metrics.

        A lifecycle call made from user code that runs in the middle of a step (``Scope.refuse``)
        raises ``IllegalTransition`` here, before anything runs or is sent.
        """
        found = current(self._owner)
        scope = found[1] if found is not None else None
        if found is not None and scope is not None and scope.open:
            refused = scope.refusal(call)
            if refused is not None:
                raise refused
            # Made from a hook, weight push or factory while it runs: part of the operation
            # that called it, which holds the lock. Cancelling the nested call stops it at its
            # next phase boundary, like any call.
            op = Operation(call, metrics=found[0].metrics)
            task: asyncio.Future[dict[str, float]] = asyncio.ensure_future(
                self._inline(op, scope, body)
            )
            scope.calls[task] = op
            task.add_done_callback(lambda t: scope.calls.pop(t, None))
        else:
            # Everything else, including a task that user code started and left running after
            # it returned, waits for the lock.
            op = Operation(call)
            task = asyncio.ensure_future(self._locked(op, body))
        # A SIGTERM to the process cancels an outermost call as its caller would (terminate).
        settling = terminate.settling() if found is None else contextlib.nullcontext()
        with settling:
            metrics = await self._settled(op, task, call)
        if found is None and self._completed is not None and call in LIFECYCLE_CALLS:
            self._completed()
        return metrics

    async def _settled(
        self, op: Operation, task: asyncio.Future[dict[str, float]], call: str
    ) -> dict[str, float]:
        """``task``'s metrics; a cancelled caller waits for it to settle first."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Settle what is in flight before letting go: the operation stops at the next phase
            # boundary (its running hook is cancelled), and the caller sees CancelledError only
            # once state is exact again.
            cancel(op)
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                logger().warning(
                    "call.cancelled_with_error",
                    server=self._name,
                    call=call,
                    error=str(task.exception()),
                )
            raise

    async def _inline(
        self, op: Operation, scope: Scope, body: Callable[[], Awaitable[None]]
    ) -> dict[str, float]:
        async with scope.lock:
            if op.cancelled:
                raise asyncio.CancelledError(f"{op.call} cancelled before it started")
            token = CURRENT.set((self._owner, op, None))
            try:
                self._check(op.call)
                await body()
            except HookCancelled as exc:
                raise asyncio.CancelledError(str(exc)) from exc
            finally:
                CURRENT.reset(token)
        return {}

    async def _locked(self, op: Operation, body: Callable[[], Awaitable[None]]) -> dict[str, float]:
        async with self.lock:
            if op.cancelled:
                raise asyncio.CancelledError(f"{op.call} cancelled before it started")
            # One controller per engine, for the whole call (calls made inside it included).
            try:
                release = None if self._claim is None else await self._claim(op.call)
            except EngineClaimed as exc:
                self._observer.refused(op, exc)
                raise
            try:
                return await self._claimed(op, body)
            finally:
                if release is not None:
                    release()

    async def _claimed(
        self, op: Operation, body: Callable[[], Awaitable[None]]
    ) -> dict[str, float]:
        await self._observer.begin(op)
        token = CURRENT.set((self._owner, op, None))
        outcome = "error"
        try:
            self._check(op.call)
            await body()
            outcome = "ok"
        except HookCancelled as exc:
            outcome = "cancelled"
            raise asyncio.CancelledError(str(exc)) from exc
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            CURRENT.reset(token)
            if outcome != "ok":
                await self._observer.end(op, outcome)
        await self._observer.end(op, outcome)
        return dict(op.metrics)


__all__ = [
    "CURRENT",
    "LIFECYCLE_CALLS",
    "CallObserver",
    "HookCancelled",
    "Operation",
    "Scope",
    "Serializer",
]
