"""The state machine: ``transitions`` runs the table of ``states``; this module drives it.

``Machine`` builds one ``transitions.AsyncMachine`` from ``TRANSITIONS`` with a phase callable
per phased trigger (``PHASED``) and the engines' records as the condition of each ``reset``
row. ``perform`` runs a public call by its plan in ``CALLS``: it refuses a state the call is not
legal in, then fires the plan's transitions in order. ``advance`` fires one: the phase runs
before the state changes, a failure moves to ``failed`` (refusals and user-code errors do not),
then the ``after_`` hooks of its phases and the hooks of the state entered run.

``fire`` is the one place a trigger runs. While it runs, the operation records the transition
in progress (``Operation.transition``): the ``before_`` hooks and the weight push run inside
it, and a lifecycle call they make is refused (``core/scope``), so a transition never fires
another from inside its phase. The hooks that run after it (``after_``, state hooks) may call
the server. An error of ``transitions`` never leaves this module: a trigger that is not legal
in the current state raises ``IllegalTransition``, and ``fail`` from ``failed`` is a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from transitions.core import MachineError
from transitions.extensions.asyncio import AsyncMachine

from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import (
    HookFailed,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    RouterError,
    StaleWeights,
    WeightPushFailed,
)
from rollout_lifecycle.core.args import NO_ARGS, PhaseArgs
from rollout_lifecycle.core.bus import RECORDS_CHANGED, Bus, StateEntered
from rollout_lifecycle.core.hooks import Hooks
from rollout_lifecycle.core.ledger import Fleet
from rollout_lifecycle.core.scope import Operation, current
from rollout_lifecycle.core.states import CALLS, PHASED, TRANSITIONS, ServerState, sources_of

S = ServerState


Phase = Callable[[PhaseArgs], Awaitable[None]]


class _Model:
    """The object ``transitions`` keeps the state on (and adds one trigger method per row to)."""

    state: str


class Machine:
    """Fires the transitions of one server."""

    def __init__(
        self,
        server: object,
        name: str,
        fleet: Fleet,
        hooks: Hooks,
        phases: Mapping[str, Phase],
        bus: Bus,
    ) -> None:
        if set(phases) != set(PHASED):
            raise InvalidArgument(f"phases must be given for exactly {PHASED}, got {set(phases)}")
        self._server = server
        self._name = name
        self._hooks = hooks
        self._bus = bus
        self._model = _Model()
        rows: list[dict[str, Any]] = []
        for row in TRANSITIONS:
            plain = {k: _plain(v) for k, v in row.items()}
            trigger = row["trigger"]
            if trigger in phases:
                plain["before"] = _before(phases[trigger])
            if trigger == "reset":
                plain["conditions"] = _settles_in(fleet, ServerState(row["dest"]))
            rows.append(plain)
        self._machine = AsyncMachine(
            model=self._model,
            states=[s.value for s in ServerState],
            transitions=rows,
            initial=S.SERVING.value,
            auto_transitions=False,
            send_event=True,
        )

    @property
    def state(self) -> ServerState:
        """The state the machine is in."""
        return ServerState(self._model.state)

    def set_state(self, state: ServerState) -> None:
        """Enter ``state`` without a transition (``adopt()``)."""
        self._machine.set_state(state.value)

    def plan(self, call: str) -> tuple[str, ...]:
        """The transitions ``call`` fires from the current state; ``IllegalTransition`` naming
        the states it is legal in when it is not legal here."""
        plans = CALLS[call]
        state = self.state
        if state not in plans:
            raise IllegalTransition(call, state.value, [s.value for s in plans])
        return plans[state]

    async def perform(self, call: str, args: PhaseArgs = NO_ARGS) -> None:
        """Run ``call``'s plan from the current state, transition by transition."""
        for trigger in self.plan(call):
            try:
                await self.advance(trigger, args)
            except (HookFailed, RouterError) as exc:
                # A hook stopped the drain (what it paused goes on), or the router could not
                # take the engines out before the pause (nothing was sent): back to serving.
                if self.state is S.PAUSING:
                    await self.fire("abandon")
                if isinstance(exc, HookFailed):
                    exc.left_in(self.state.value)  # the state the call leaves, not 'pausing'
                raise

    async def advance(self, trigger: str, args: PhaseArgs = NO_ARGS) -> None:
        """Fire one transition: run its phase, change state, run the hooks of the new state."""
        found = current(self._server)
        previous = self.state
        # ``pausing`` only leads into the drain: a cancelled call never stops there.
        if found is not None and found[0].cancelled and previous is not S.PAUSING:
            raise asyncio.CancelledError(f"cancelled before {trigger}")
        if found is not None and previous not in sources_of(trigger):
            # a hook (or a call it made) moved the server on: refused, never a raw machine error
            raise self._illegal(found[0], trigger)
        log = logger().bind(server=self._name, transition=trigger)
        log.debug("transition.start", state=previous.value)
        with self._hooks.transition() as phases:
            try:
                await self.fire(trigger, args)
            except (
                IllegalTransition,
                IllegalEngineOp,
                InvalidArgument,
                HookFailed,
                WeightPushFailed,
                StaleWeights,
                RouterError,
            ):
                # refused before any engine was touched (a router error comes before the pause
                # that opens every phase it can stop), or the user's code: no failure
                raise
            except BaseException as exc:
                if self.state is not S.FAILED and not isinstance(exc, asyncio.CancelledError):
                    await self.fire("fail")
                    self._bus.publish(RECORDS_CHANGED)
                    log.warning("transition.failed", state=previous.value, error=str(exc))
                    await self._hooks.emit(S.FAILED.value, S.FAILED, previous)
                raise
        self._bus.publish(RECORDS_CHANGED)
        state = self.state
        log.info("state.enter", state=state.value, previous=previous.value)
        for phase in phases:
            await self._hooks.emit(f"after_{phase}", state, previous, phase)
        if state is not previous:
            await self._hooks.emit(state.value, state, previous)

    async def fail(self) -> None:
        """Enter ``failed`` (no hooks run: the caller reports the failure); a no-op when the
        server is ``failed`` already."""
        if self.state is not S.FAILED:
            await self.fire("fail")

    async def fire(self, trigger: str, args: PhaseArgs = NO_ARGS) -> None:
        """Run ``trigger`` on the machine, recording it as the operation's transition in
        progress while its phase runs (a lifecycle call from a ``before_`` hook or the weight
        push is refused: ``core/scope``), and delivering ``StateEntered`` if the state changed (its
        subscribers, the router binding among them, are done before this returns).

        A trigger not legal in the current state raises ``IllegalTransition`` (never the
        ``MachineError`` of ``transitions``). ``transitions`` answers False when the transition
        did not happen: the conditions of ``reset`` did not hold (the caller checks the state),
        or a CancelledError reached a phase and ``transitions`` swallowed it, which leaves calls
        unsettled: that must fail the transition, never pass for success."""
        found = current(self._server)
        op = found[0] if found is not None else None
        outer = None if op is None else op.transition
        if op is not None:
            op.transition = trigger
        previous = self.state
        try:
            done = await getattr(self._model, trigger)(args=args)
        except MachineError:
            raise self._illegal(op, trigger) from None
        finally:
            if op is not None:
                op.transition = outer
            if self.state is not previous:
                await self._bus.deliver(StateEntered(self.state, previous))
        if not done and trigger != "reset":
            raise LifecycleError(f"transition {trigger!r} was interrupted inside a phase")

    def _illegal(self, op: Operation | None, trigger: str) -> IllegalTransition:
        """The refusal of ``trigger``, not legal in the current state, for ``op``'s call."""
        allowed = [s.value for s in sources_of(trigger)]
        reason = f"its transition {trigger!r} is allowed from: {', '.join(map(repr, allowed))}"
        call = trigger if op is None else op.call
        return IllegalTransition(call, self.state.value, allowed, reason)


def _before(phase: Phase) -> Callable[[Any], Awaitable[None]]:
    async def run(event: Any) -> None:
        await phase(event.kwargs["args"])

    return run


def _settles_in(fleet: Fleet, state: ServerState) -> Callable[[Any], bool]:
    return lambda event: fleet.settled_state() is state


def _plain(value: Any) -> Any:
    """A value of a transitions row with state enums turned into their names."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, ServerState) else value


__all__ = ["Machine", "Phase"]
