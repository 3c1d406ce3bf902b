"""The state machine (``core/machine.py``) on its own: which trigger fires from which state,
what an illegal trigger or call raises, where a phase runs relative to the change of state,
when ``StateEntered`` is delivered relative to the hooks, and what a failing transition leaves.

The machine is built from the real tables, hooks and bus, with recording phases in place of
engine calls and a stand-in for the records that decides where ``reset`` settles.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from core.test_hooks import events_of

from rollout_lifecycle.contract.exceptions import (
    HookFailed,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    RouterError,
    StaleWeights,
)
from rollout_lifecycle.core.args import PhaseArgs
from rollout_lifecycle.core.bus import Bus, RecordsChanged, StateEntered
from rollout_lifecycle.core.config import Deadlines
from rollout_lifecycle.core.hooks import Hooks
from rollout_lifecycle.core.machine import Machine
from rollout_lifecycle.core.scope import CURRENT, Operation, current
from rollout_lifecycle.core.server import LifecycleEvent
from rollout_lifecycle.core.states import PHASED, TRANSITIONS, ServerState, destination, sources_of

S = ServerState
#: Every trigger of the table but ``reset``, whose destination the records decide.
TRIGGERS = sorted({row["trigger"] for row in TRANSITIONS} - {"reset"})


class Owner:
    """What the machine and the hooks know of their server: its identity and its name."""

    name = "machine-test"


class Records:
    """Stands in for the fleet: the state the engines' records imply (``reset`` reads it)."""

    def __init__(self) -> None:
        self.settles: ServerState | None = S.SERVING

    def settled_state(self) -> ServerState | None:
        return self.settles


class Rig:
    """A machine over recording phases; ``log`` is every phase, hook and delivery in order."""

    def __init__(self) -> None:
        self.owner = Owner()
        self.records = Records()
        self.bus = Bus()
        self.log: list[str] = []
        self.args: list[PhaseArgs] = []
        #: The operation's transition in progress, as each phase saw it.
        self.transitions: list[str | None] = []
        #: What the phase of each trigger raises (nothing when absent).
        self.raises: dict[str, BaseException] = {}
        #: The ``before_`` phases each trigger's phase announces (as the real phases do).
        self.befores: dict[str, tuple[str, ...]] = {"drain": ("pause", "flush")}
        self.hooks = Hooks(
            self.owner,
            "machine-test",
            lambda: self.machine.state,
            Deadlines(hook=30),
            events_of(self.owner),
        )
        self.machine = Machine(
            self.owner,
            "machine-test",
            self.records,  # type: ignore[arg-type]
            self.hooks,
            {trigger: self._phase(trigger) for trigger in PHASED},
            self.bus,
        )
        self.bus.subscribe(StateEntered, self._entered)
        self.bus.subscribe(RecordsChanged, lambda _: self.log.append("records"))

    def _phase(self, trigger: str) -> Callable[[PhaseArgs], Awaitable[None]]:
        async def phase(args: PhaseArgs) -> None:
            found = current(self.owner)
            self.transitions.append(None if found is None else found[0].transition)
            self.log.append(f"phase {trigger} in {self.machine.state.value}")
            self.args.append(args)
            for name in self.befores.get(trigger, ()):
                await self.hooks.before(name)
            if trigger in self.raises:
                raise self.raises[trigger]

        return phase

    async def _entered(self, event: StateEntered) -> None:
        self.log.append(f"entered {event.state.value} from {event.previous.value}")
        await asyncio.sleep(0)  # a subscriber that awaits: the machine waits for it
        self.log.append(f"entered {event.state.value} done, machine in {self.machine.state}")

    def record(self, *events: str) -> None:
        """Log each run of a hook on ``events``."""

        def hook(event: LifecycleEvent) -> None:
            self.log.append(f"hook {event.event} {event.previous.value}->{event.state.value}")

        for event in events:
            self.hooks.on(event, hook)

    def state(self) -> ServerState:
        """The machine's state now (after a step that may have moved it)."""
        return self.machine.state

    def phases_run(self) -> list[str]:
        return [line.split()[1] for line in self.log if line.startswith("phase ")]


@contextmanager
def operation(rig: Rig, call: str) -> Iterator[Operation]:
    """Run the block as part of the public call ``call`` of the rig's server."""
    op = Operation(call)
    token = CURRENT.set((rig.owner, op, None))
    try:
        yield op
    finally:
        CURRENT.reset(token)


@pytest.mark.parametrize("trigger", TRIGGERS)
async def test_each_trigger_fires_from_exactly_its_source_states(trigger: str) -> None:
    for state in S:
        rig = Rig()
        rig.machine.set_state(state)
        lands = destination(trigger, state)
        if lands is None:
            with pytest.raises(IllegalTransition) as refused:
                await rig.machine.fire(trigger)
            assert refused.value.state == state.value
            assert refused.value.allowed == tuple(s.value for s in sources_of(trigger))
            assert rig.machine.state is state and rig.log == [], (trigger, state)
        else:
            await rig.machine.fire(trigger)
            assert rig.machine.state is lands, (trigger, state)
            assert rig.phases_run() == ([trigger] if trigger in PHASED else [])


async def test_an_illegal_call_raises_naming_the_state_and_sends_nothing() -> None:
    rig = Rig()
    rig.machine.set_state(S.RELEASED)
    with pytest.raises(IllegalTransition) as refused:
        await rig.machine.perform("resume")
    assert refused.value.call == "resume" and refused.value.state == "released"
    assert "resume() is not allowed in state 'released'" in str(refused.value)
    assert refused.value.allowed == ("serving", "drained", "kv_restored")
    assert rig.machine.state is S.RELEASED and rig.log == []


async def test_a_trigger_the_state_no_longer_allows_is_refused_in_the_name_of_its_call() -> None:
    rig = Rig()
    # e.g. a hook resumed the server before the call's next step
    with operation(rig, "onload"), pytest.raises(IllegalTransition) as refused:
        await rig.machine.advance("restore_kv")
    assert refused.value.call == "onload" and refused.value.state == "serving"
    assert "onload() is not allowed in state 'serving'" in str(refused.value)
    assert "its transition 'restore_kv' is allowed from: 'weights_restored'" in str(refused.value)
    assert rig.machine.state is S.SERVING and rig.log == []


async def test_a_phase_runs_in_the_source_state_as_the_transition_in_progress() -> None:
    rig = Rig()
    rig.machine.set_state(S.DRAINED)
    args = PhaseArgs(version="v7")
    with operation(rig, "offload") as op:
        await rig.machine.advance("release", args)
        assert op.transition is None  # cleared once the transition is done
    assert rig.log[0] == "phase release in drained"
    assert rig.transitions == ["release"]
    assert rig.args == [args] and rig.machine.state is S.RELEASED


async def test_state_entered_is_delivered_and_awaited_before_the_after_and_state_hooks() -> None:
    rig = Rig()
    rig.record("pausing", "before_pause", "before_flush", "after_pause", "after_flush", "drained")
    await rig.machine.perform("pause")
    assert rig.log == [
        "entered pausing from serving",
        "entered pausing done, machine in pausing",
        "records",
        "hook pausing serving->pausing",
        "phase drain in pausing",
        "hook before_pause pausing->pausing",
        "hook before_flush pausing->pausing",
        "entered drained from pausing",
        "entered drained done, machine in drained",
        "records",
        "hook after_pause pausing->drained",
        "hook after_flush pausing->drained",
        "hook drained pausing->drained",
    ]


async def test_a_self_loop_delivers_no_state_entered_and_runs_only_its_after_hooks() -> None:
    rig = Rig()
    rig.befores["write_weights"] = ("update_weights",)
    rig.record("weights_restored", "before_update_weights", "after_update_weights")
    rig.machine.set_state(S.WEIGHTS_RESTORED)
    await rig.machine.perform("update_weights")
    assert rig.machine.state is S.WEIGHTS_RESTORED
    assert rig.log == [
        "phase write_weights in weights_restored",
        "hook before_update_weights weights_restored->weights_restored",
        "records",
        "hook after_update_weights weights_restored->weights_restored",
    ]


async def test_a_failing_phase_moves_to_failed_and_runs_only_the_failed_hooks() -> None:
    rig = Rig()
    rig.raises["drain"] = RuntimeError("an engine died mid-flush")
    rig.record("after_pause", "after_flush", "drained", "failed")
    with pytest.raises(RuntimeError, match="mid-flush"):
        await rig.machine.perform("pause")
    assert rig.machine.state is S.FAILED
    after = rig.log[rig.log.index("phase drain in pausing") :]
    # no after_ hook of a phase that did not complete; failed is entered, then its hooks run
    assert after == [
        "phase drain in pausing",
        "entered failed from pausing",
        "entered failed done, machine in failed",
        "records",
        "hook failed pausing->failed",
    ]


@pytest.mark.parametrize(
    "refusal",
    [
        IllegalEngineOp("actor/0", "release_memory_occupation", "not flushed"),
        InvalidArgument("bad push"),
        HookFailed("before_release", "refuse", "drained"),
        StaleWeights("v2", {"actor/0": "v1"}),
        RouterError("http://router", "refused"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_refusal_or_user_code_error_leaves_the_state_where_it_was(
    refusal: LifecycleError,
) -> None:
    rig = Rig()
    rig.raises["release"] = refusal
    rig.record("failed", "released", "after_release")
    rig.machine.set_state(S.DRAINED)
    with pytest.raises(type(refusal)) as raised:
        await rig.machine.advance("release")
    assert raised.value is refusal
    assert rig.machine.state is S.DRAINED
    assert rig.log == ["phase release in drained"]  # no state entered, no hook


@pytest.mark.parametrize(
    "refusal",
    [HookFailed("before_flush", "refuse", "pausing"), RouterError("http://router", "down")],
    ids=lambda e: type(e).__name__,
)
async def test_a_drain_refused_by_a_hook_or_the_router_is_abandoned_to_serving(
    refusal: LifecycleError,
) -> None:
    rig = Rig()
    rig.raises["drain"] = refusal
    with pytest.raises(type(refusal)):
        await rig.machine.perform("offload")
    assert rig.machine.state is S.SERVING
    assert "entered serving from pausing" in rig.log and "release" not in rig.phases_run()
    if isinstance(refusal, HookFailed):  # it names the state the call leaves, not 'pausing'
        assert refusal.state == "serving" and "'serving'" in str(refusal)


async def test_a_phase_interrupted_by_a_swallowed_cancellation_is_never_a_success() -> None:
    rig = Rig()
    rig.raises["release"] = asyncio.CancelledError("inside the phase")
    rig.record("released", "after_release")
    rig.machine.set_state(S.DRAINED)
    with pytest.raises(LifecycleError, match="'release' was interrupted inside a phase"):
        await rig.machine.advance("release")
    assert rig.machine.state is S.FAILED  # not 'released': its calls may not have settled
    assert not any(line.startswith("hook") and "release" in line for line in rig.log)


async def test_a_cancelled_call_stops_before_a_transition_but_never_in_pausing() -> None:
    rig = Rig()
    with operation(rig, "offload") as op:
        op.cancelled = True
        with pytest.raises(asyncio.CancelledError):
            await rig.machine.advance("pause")
        assert rig.machine.state is S.SERVING and rig.log == []
        rig.machine.set_state(S.PAUSING)
        await rig.machine.advance("drain")  # the drain always completes
        assert rig.state() is S.DRAINED
        with pytest.raises(asyncio.CancelledError):
            await rig.machine.advance("release")
    assert rig.state() is S.DRAINED and rig.phases_run() == ["drain"]


@pytest.mark.parametrize("settles", [S.SERVING, S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED])
async def test_reset_leaves_failed_for_the_state_the_records_imply(settles: ServerState) -> None:
    rig = Rig()
    rig.machine.set_state(S.FAILED)
    rig.records.settles = settles
    await rig.machine.perform("reset")
    assert rig.machine.state is settles
    assert rig.log[0] == f"entered {settles.value} from failed"


async def test_reset_stays_failed_when_the_records_imply_no_state() -> None:
    rig = Rig()
    rig.machine.set_state(S.FAILED)
    rig.records.settles = None
    rig.record("serving", "failed")
    await rig.machine.perform("reset")  # no error here: the caller reads the state
    assert rig.machine.state is S.FAILED
    rig.records.settles = S.PAUSING  # never a destination of reset
    await rig.machine.perform("reset")
    assert rig.machine.state is S.FAILED
    assert not any(line.startswith(("entered", "hook")) for line in rig.log), rig.log


def test_the_phases_given_must_be_exactly_the_phased_triggers() -> None:
    owner = Owner()
    hooks = Hooks(owner, "m", lambda: S.SERVING, Deadlines(), events_of(owner))
    phases: dict[str, Any] = {trigger: None for trigger in PHASED}
    del phases["release"]
    with pytest.raises(InvalidArgument, match="phases must be given for exactly"):
        Machine(owner, "m", Records(), hooks, phases, Bus())  # type: ignore[arg-type]
    phases.update(release=None, pause=None)
    with pytest.raises(InvalidArgument, match="'pause'"):
        Machine(owner, "m", Records(), hooks, phases, Bus())  # type: ignore[arg-type]
