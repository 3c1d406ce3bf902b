"""Hooks and user code: the events a server emits, and how code a user hands it is run.

``Hooks`` keeps the hooks registered for each event and runs them. ``run_user`` runs any user
code the lifecycle calls (a hook, the weight push, a ``recover()`` factory) inside the operation
in progress: bounded by a deadline, cancelled with its operation, and with whatever it raises
turned into ``HookFailed`` so that a user's bug never leaves a phase half done.

User code may call the server. Where it runs decides what such a call does. A ``before_<phase>``
hook and the weight push run inside a transition in progress, and a ``recover()`` factory runs
before its replacements are swapped in: from there a lifecycle call (``offload``,
``onload_weights``, ``update_weights``, ``onload_kv``, ``onload``, ``pause``, ``resume``,
``reset``, ``recover``) is refused at once with ``IllegalTransition`` naming the call and the
code, since it would fire a transition inside the one in progress (or act on engines about to
be replaced). The hooks that run once a transition has completed (``after_<phase>`` and the
state hooks, ``failed`` included) may make any call: it runs inline, as part of the operation.
``state``, ``snapshot()``, ``probe()`` and ``sync_router()`` fire no transition and are allowed
everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import HookFailed, InvalidArgument
from rollout_lifecycle.core.config import Deadlines
from rollout_lifecycle.core.scope import CURRENT, HookCancelled, Operation, Scope, cancel, current
from rollout_lifecycle.core.states import HOOK_PHASES, Phase, ServerState

T = TypeVar("T")

#: A hook: called with the event its server makes (``RolloutServer``'s ``LifecycleEvent``).
Hook = Callable[[Any], Any]
#: What makes a hook's event: from the event's name, the state entered, the one left and the
#: phase (for ``before_<phase>`` / ``after_<phase>``).
EventMaker = Callable[[str, ServerState, ServerState, "str | None"], object]

#: The events hooks can subscribe to: entering each state, and before / after each phase.
HOOK_EVENTS: tuple[str, ...] = (
    *(s.value for s in ServerState),
    *(f"{when}_{phase}" for phase in HOOK_PHASES for when in ("before", "after")),
)


class Hooks:
    """The hooks of one server, by event, and the runner of every piece of user code.

    ``owner`` is the server: user code it runs is inside the server's operation in progress
    (``core/scope``); ``name`` is the server's name in events; ``event`` makes what a hook
    receives."""

    def __init__(
        self,
        owner: object,
        name: str,
        state: Callable[[], ServerState],
        deadlines: Deadlines,
        event: EventMaker,
    ) -> None:
        self._owner = owner
        self._name = name
        self._event = event
        self._state = state
        self._deadlines = deadlines
        #: The phases of the transition in progress whose ``before_`` hooks ran (``transition``).
        self._phases: list[str] | None = None
        self.registered: dict[str, list[Hook]] = {e: [] for e in HOOK_EVENTS}

    def on(self, event: str | ServerState, hook: Hook) -> Callable[[], None]:
        """Register ``hook`` for ``event``; returns its remover (see ``RolloutServer.on``)."""
        key = event.value if isinstance(event, ServerState) else event
        if key not in self.registered:
            raise InvalidArgument(f"unknown event {event!r}; events: {', '.join(HOOK_EVENTS)}")
        if not callable(hook):
            raise InvalidArgument(f"hook for {key!r} must be callable, got {hook!r}")
        self.registered[key].append(hook)

        def remove() -> None:
            if hook in self.registered[key]:
                self.registered[key].remove(hook)

        return remove

    async def emit(
        self, event: str, state: ServerState, previous: ServerState, phase: str | None = None
    ) -> None:
        """Run the hooks of ``event``, in registration order."""
        for hook in list(self.registered[event]):
            info = self._event(event, state, previous, phase)
            await self.run_user(event, hook, info, self._deadlines.hook)

    @contextlib.contextmanager
    def transition(self) -> Iterator[list[str]]:
        """Collect, while a transition runs, the phases whose ``before_`` hooks ran: the list
        of their names, whose ``after_`` hooks run once it completes (``Machine.advance``). A
        transition fired by a hook that runs after another keeps its own list."""
        outer, self._phases = self._phases, []
        try:
            yield self._phases
        finally:
            self._phases = outer

    async def before(self, phase: Phase) -> None:
        """Run the ``before_<phase>`` hooks; the phase's ``after_`` hooks follow the transition."""
        state = self._state()
        await self.emit(f"before_{phase}", state, state, phase)
        if self._phases is not None:
            self._phases.append(phase)

    async def run_user(
        self,
        event: str,
        fn: Callable[[Any], Any],
        arg: Any,
        deadline: float,
        *,
        wrap: bool = True,
        grace: float | None = -1.0,
        own: tuple[type[Exception], ...] = (),
    ) -> Any:
        """Run user code (a hook, the weight push, a ``recover()`` factory) inside the
        operation in progress, in a ``Scope`` of its own; its result.

        An awaitable it returns runs as a task bounded by ``deadline`` and cancelled when the
        operation is. Whatever it raises, ``BaseException`` included, becomes ``HookFailed``
        (``KeyboardInterrupt`` propagates as it is; with ``wrap=False`` an ``Exception``
        does too, and so does one of ``own``, the library's own errors a built-in strategy
        raises); a cancellation of the operation becomes ``HookCancelled``. Past its
        deadline it is cancelled and given ``grace`` seconds to stop (the probe deadline by
        default; ``None`` waits for it: a weight push must not write after its session
        closed). A sync callable runs on the loop and cannot be bounded: it must not block.

        ``event`` is the hook's event, ``update_weights`` for the weight push or ``recover``
        for a factory. A lifecycle call the code makes while it runs inside a transition in
        progress (a ``before_`` hook, the push) or inside ``recover()`` (a factory) is refused
        with ``IllegalTransition`` (``Scope.refuse``); from any other hook it runs inline.
        """
        if grace is not None and grace < 0:
            grace = self._deadlines.probe
        found = current(self._owner)
        op = found[0] if found is not None else Operation(event)
        name = getattr(fn, "__qualname__", repr(fn))
        scope = Scope(refuse=_refuse(event, name, op), state=self._state().value)
        task: asyncio.Future[Any] | None = None
        stopped = ""
        token = CURRENT.set((self._owner, op, scope))
        try:
            try:
                result = fn(arg)
                if inspect.isawaitable(result):
                    # created here, the task's context carries the scope
                    task = scope.task = asyncio.ensure_future(_captured(result))
            finally:
                CURRENT.reset(token)
            if task is not None:
                op.running.add(task)
                try:
                    done, _ = await asyncio.wait([task], timeout=deadline)
                finally:
                    op.running.discard(task)
                if not done:
                    stopped = f"did not return within {deadline:g}s and was cancelled"
                    task.cancel()
                    # a hook that ignores its cancellation is left behind
                    await asyncio.wait([task], timeout=grace)
                    raise TimeoutError(stopped)
                caught, result = task.result()
                if caught is not None:
                    raise caught
            return result
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if task is not None and not task.done() and not stopped:
                # this task itself was cancelled (a hook past its deadline that ignores its
                # cancellation is left behind, and the call fails with HookFailed below)
                task.cancel()
                raise
            state = self._state().value
            if isinstance(exc, asyncio.CancelledError) and op.cancelled:
                raise HookCancelled(event, name, state, "was cancelled") from exc
            if (not wrap or isinstance(exc, own)) and isinstance(exc, Exception) and not stopped:
                raise
            logger().warning(
                "hook.failed",
                server=self._name,
                hook_event=event,
                hook=name,
                error=repr(exc),
            )
            raise HookFailed(event, name, state, stopped or "raised") from exc
        finally:
            scope.closed = True
            # calls it made that still run are part of it: they finish (or stop at their next
            # boundary, if the operation was cancelled) before the operation goes on
            while scope.calls:
                if op.cancelled:
                    for nested in scope.calls.values():
                        cancel(nested)
                await asyncio.wait(list(scope.calls))


#: What the user code run under an event that is not a hook's is, in a refusal's message.
_USER_CODE = {"update_weights": "the weight push", "recover": "the recover() factory"}


def _refuse(event: str, name: str, op: Operation) -> str | None:
    """Why a lifecycle call from user code ``name`` run for ``event`` in ``op`` is refused, or
    None when it is allowed (a hook that runs once its transition has completed)."""
    hook = event in HOOK_EVENTS
    if op.transition is not None:
        where = f"inside the transition {op.transition!r} in progress"
    elif not hook:
        where = f"in the middle of {op.call}()"
    else:
        return None
    what = f"hook {name} for event {event!r}" if hook else f"{_USER_CODE.get(event, event)} {name}"
    hint = "; an after_ or state hook can make it" if hook else ""
    return f"it was called from {what}, which runs {where} and cannot fire a transition{hint}"


async def _captured(result: Awaitable[T]) -> tuple[BaseException | None, T | None]:
    """Await user code's awaitable, handing back what it raised instead of raising it: a
    ``SystemExit`` raised in a task would otherwise leave through the event loop itself."""
    try:
        return None, await result
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        return exc, None


__all__ = ["HOOK_EVENTS", "EventMaker", "Hook", "Hooks"]
