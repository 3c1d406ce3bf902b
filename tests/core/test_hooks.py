"""Hooks (``core/hooks.py``) on their own: registering and removing hooks, the events there are,
the order hooks run in and what each receives, the ``before_`` phases a transition collects,
what a hook that raises, overruns its deadline or is cancelled with its call turns into, and
the registrations refused.

The hooks are driven directly, as the machine and the phases drive them, over a stand-in for
their server (its name and identity are all they use) and a state the test sets.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    LifecycleConfig,
    RolloutServer,
    SimulatedEngine,
)
from rollout_lifecycle.contract.exceptions import HookFailed, InvalidArgument
from rollout_lifecycle.core.config import Deadlines
from rollout_lifecycle.core.hooks import HOOK_EVENTS, EventMaker, Hooks
from rollout_lifecycle.core.scope import CURRENT, HookCancelled, Operation, cancel
from rollout_lifecycle.core.server import LifecycleEvent
from rollout_lifecycle.core.states import HOOK_PHASES, ServerState
from rollout_lifecycle.testing.waits import until

S = ServerState


class Owner:
    """What the hooks know of their server: its identity and its name."""

    name = "hooks-test"


def events_of(owner: Any) -> EventMaker:
    """The events a server ``owner`` makes for its hooks (``RolloutServer``'s)."""
    return lambda event, state, previous, phase: LifecycleEvent(
        event, state, previous, owner, phase
    )


class Rig:
    """Hooks over a stand-in server whose state the test sets."""

    def __init__(self, hook_deadline: float = 30.0) -> None:
        self.owner = Owner()
        self.state = S.DRAINED
        self.hooks = Hooks(
            self.owner,
            self.owner.name,
            lambda: self.state,
            Deadlines(hook=hook_deadline),
            events_of(self.owner),
        )
        self.seen: list[str] = []

    def recorder(self, label: str) -> Callable[[LifecycleEvent], None]:
        def hook(event: LifecycleEvent) -> None:
            self.seen.append(f"{label}:{event.event}")

        return hook


def test_the_events_are_each_state_and_before_and_after_each_phase() -> None:
    expected = {s.value for s in S} | {
        f"{when}_{phase}" for phase in HOOK_PHASES for when in ("before", "after")
    }
    assert set(HOOK_EVENTS) == expected and len(HOOK_EVENTS) == len(expected)
    assert HOOK_PHASES == (
        "pause",
        "flush",
        "release",
        "resume_weights",
        "update_weights",
        "resume_kv",
        "continue",
    )
    assert set(Rig().hooks.registered) == expected  # every event can be registered, none else


async def test_a_hook_is_registered_by_state_or_name_and_taken_out_by_its_remover() -> None:
    rig = Rig()
    remove_a = rig.hooks.on(S.DRAINED, rig.recorder("a"))
    rig.hooks.on("drained", rig.recorder("b"))
    twice = rig.recorder("c")
    remove_c1 = rig.hooks.on("drained", twice)
    rig.hooks.on("drained", twice)
    await rig.hooks.emit("drained", S.DRAINED, S.PAUSING)
    assert rig.seen == ["a:drained", "b:drained", "c:drained", "c:drained"]
    remove_a()
    remove_a()  # (twice is no error, and takes out nothing else)
    remove_c1()  # one registration of a hook registered twice
    rig.seen.clear()
    await rig.hooks.emit("drained", S.DRAINED, S.PAUSING)
    assert rig.seen == ["b:drained", "c:drained"]


def test_an_unknown_event_or_an_uncallable_hook_is_refused_naming_it() -> None:
    rig = Rig()
    with pytest.raises(InvalidArgument) as unknown:
        rig.hooks.on("drainedd", rig.recorder("a"))
    assert "unknown event 'drainedd'" in str(unknown.value)
    assert "before_pause" in str(unknown.value) and "kv_restored" in str(unknown.value)
    with pytest.raises(InvalidArgument) as uncallable:
        rig.hooks.on("released", "print")  # type: ignore[arg-type]
    assert "'released'" in str(uncallable.value) and "'print'" in str(uncallable.value)
    assert "must be callable" in str(uncallable.value)
    assert all(hooks == [] for hooks in rig.hooks.registered.values())  # nothing half-registered


async def test_hooks_run_one_after_another_in_registration_order_with_their_event() -> None:
    rig = Rig()
    received: list[LifecycleEvent] = []

    async def slow(event: LifecycleEvent) -> None:
        rig.seen.append("slow started")
        await asyncio.sleep(0)  # (it awaits: the next hook waits for it to return)
        rig.seen.append("slow returned")
        received.append(event)

    def plain(event: LifecycleEvent) -> None:
        rig.seen.append("plain")
        received.append(event)

    rig.hooks.on("after_flush", slow)
    rig.hooks.on("after_flush", plain)
    await rig.hooks.emit("after_flush", S.DRAINED, S.PAUSING, "flush")
    assert rig.seen == ["slow started", "slow returned", "plain"]
    for event in received:
        assert (event.event, event.state, event.previous, event.phase) == (
            "after_flush",
            S.DRAINED,
            S.PAUSING,
            "flush",
        )
        assert event.server is rig.owner  # type: ignore[comparison-overlap]


async def test_a_hook_added_or_removed_while_hooks_run_counts_from_the_next_event() -> None:
    rig = Rig()
    removers: dict[str, Callable[[], None]] = {}

    def first(event: LifecycleEvent) -> None:
        rig.seen.append("first")
        removers["last"]()
        rig.hooks.on("released", rig.recorder("added"))

    remove_first = rig.hooks.on("released", first)
    removers["last"] = rig.hooks.on("released", rig.recorder("last"))
    await rig.hooks.emit("released", S.RELEASED, S.DRAINED)
    assert rig.seen == ["first", "last:released"]
    rig.seen.clear()
    remove_first()
    await rig.hooks.emit("released", S.RELEASED, S.DRAINED)
    assert rig.seen == ["added:released"]


async def test_a_hook_that_raises_stops_the_rest_and_is_hook_failed_naming_it() -> None:
    rig = Rig()
    error = RuntimeError("trainer not ready")

    def refuse(event: LifecycleEvent) -> None:
        rig.state = S.FAILED  # the server moved while it ran: the error names where it is now
        raise error

    rig.hooks.on("released", rig.recorder("before"))
    rig.hooks.on("released", refuse)
    rig.hooks.on("released", rig.recorder("after"))
    with pytest.raises(HookFailed) as failed:
        await rig.hooks.emit("released", S.RELEASED, S.DRAINED)
    assert rig.seen == ["before:released"]
    assert failed.value.__cause__ is error
    assert (failed.value.event, failed.value.state, failed.value.reason) == (
        "released",
        "failed",
        "raised",
    )
    assert failed.value.hook.endswith("refuse")
    assert "refuse for event 'released' raised (server left in 'failed')" in str(failed.value)


async def test_a_transition_collects_the_phases_whose_before_hooks_ran() -> None:
    rig = Rig()
    rig.state = S.PAUSING
    received: list[LifecycleEvent] = []
    rig.hooks.on("before_pause", received.append)
    rig.hooks.on("before_flush", received.append)
    await rig.hooks.before("pause")  # outside a transition: the hooks run, nothing is kept
    with rig.hooks.transition() as outer:
        await rig.hooks.before("pause")
        await rig.hooks.before("flush")
        assert outer == ["pause", "flush"]
        # a transition a hook fires after another keeps its own list
        with rig.hooks.transition() as inner:
            await rig.hooks.before("release")
        assert inner == ["release"] and outer == ["pause", "flush"]
        await rig.hooks.before("continue")
    assert outer == ["pause", "flush", "continue"]
    assert [(e.event, e.state, e.previous, e.phase) for e in received] == [
        ("before_pause", S.PAUSING, S.PAUSING, "pause"),
        ("before_pause", S.PAUSING, S.PAUSING, "pause"),
        ("before_flush", S.PAUSING, S.PAUSING, "flush"),
    ]


async def test_a_before_hook_that_raises_leaves_its_phase_out_of_the_transition() -> None:
    rig = Rig()
    rig.hooks.on("before_release", lambda event: 1 / 0)
    with rig.hooks.transition() as phases:
        await rig.hooks.before("flush")
        with pytest.raises(HookFailed, match="before_release"):
            await rig.hooks.before("release")
    assert phases == ["flush"]  # no after_release for a release that never ran


async def test_user_code_returns_its_result_and_only_wrap_false_lets_an_exception_through() -> None:
    rig = Rig()

    async def answer(arg: int) -> int:
        await asyncio.sleep(0)
        return arg + 1

    assert await rig.hooks.run_user("recover", lambda arg: arg * 2, 21, 5.0) == 42
    assert await rig.hooks.run_user("recover", answer, 41, 5.0) == 42
    error = ValueError("bad replacement")

    def bad(arg: object) -> None:
        raise error

    with pytest.raises(ValueError) as through:
        await rig.hooks.run_user("recover", bad, None, 5.0, wrap=False)
    assert through.value is error
    with pytest.raises(HookFailed) as wrapped:
        await rig.hooks.run_user("recover", bad, None, 5.0)
    assert wrapped.value.__cause__ is error
    # an exit is never let through as it is, wrapped or not
    with pytest.raises(HookFailed) as leaving:
        await rig.hooks.run_user("recover", lambda arg: sys.exit(3), None, 5.0, wrap=False)
    assert isinstance(leaving.value.__cause__, SystemExit)


async def test_a_keyboard_interrupt_from_a_hook_propagates_unchanged() -> None:
    rig = Rig()

    def interrupt(event: LifecycleEvent) -> None:
        raise KeyboardInterrupt

    rig.hooks.on("drained", interrupt)
    rig.hooks.on("drained", rig.recorder("after"))
    with pytest.raises(KeyboardInterrupt):
        await rig.hooks.emit("drained", S.DRAINED, S.PAUSING)
    assert rig.seen == []


class Stubborn:
    """User code that ignores its cancellation and returns only once ``release`` is set."""

    def __init__(self) -> None:
        self.told = asyncio.Event()
        self.release = asyncio.Event()
        self.returned = False
        #: It has stopped running (returned, or raised).
        self.ended = False

    async def __call__(self, arg: object) -> None:
        try:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.told.set()
            await self.release.wait()
            self.returned = True
        finally:
            self.ended = True


async def test_user_code_past_its_deadline_is_waited_for_when_there_is_no_grace() -> None:
    """A weight push must not write after its session closed: past its deadline it is
    cancelled, and one that ignores that is waited for until it returns."""
    rig = Rig()
    code = Stubborn()
    call = asyncio.ensure_future(rig.hooks.run_user("update_weights", code, None, 0.01, grace=None))
    await asyncio.wait_for(code.told.wait(), 30)
    # It cannot return before the code does, however long that takes: a run that gave up on
    # the code would end within this wait (its grace is short), a correct one never does.
    await asyncio.wait([call], timeout=0.2)
    assert not call.done()
    code.release.set()
    with pytest.raises(HookFailed) as failed:
        await asyncio.wait_for(call, 30)
    assert code.returned
    assert failed.value.reason == "did not return within 0.01s and was cancelled"
    assert isinstance(failed.value.__cause__, TimeoutError)


async def test_user_code_past_its_deadline_that_ignores_cancellation_is_left_behind() -> None:
    rig = Rig()
    code = Stubborn()
    call = asyncio.ensure_future(rig.hooks.run_user("released", code, None, 0.01, grace=0.01))
    try:
        await asyncio.wait_for(code.told.wait(), 30)
        with pytest.raises(HookFailed) as failed:
            await asyncio.wait_for(call, 30)
        assert not code.returned  # left behind, still running
        assert failed.value.reason == "did not return within 0.01s and was cancelled"
    finally:
        code.release.set()
        await until(lambda: code.ended, what="the code to end")


async def test_a_server_whose_hook_ignores_its_cancellation_stays_where_it_was() -> None:
    # Nothing was sent: the release's hook held it back, so the server is still drained.
    code = Stubborn()
    config = LifecycleConfig(deadlines=Deadlines(hook=0.2, probe=0.5))  # (grace: probe)
    server = RolloutServer([EngineGroup("actor", [SimulatedEngine("e0")])], config)
    server.on("before_release", code)
    try:
        with pytest.raises(HookFailed) as failed:
            await server.offload()
        assert failed.value.state == "drained" and server.state is ServerState.DRAINED
    finally:
        code.release.set()
        await until(lambda: code.ended, what="the code to end")


async def test_cancelling_its_call_cancels_a_running_hook_as_hook_cancelled() -> None:
    rig = Rig()
    op = Operation("offload")
    started = asyncio.Event()
    cancelled: list[bool] = []

    async def waits(event: LifecycleEvent) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    rig.hooks.on("drained", waits)
    token = CURRENT.set((rig.owner, op, None))
    try:
        emit = asyncio.ensure_future(rig.hooks.emit("drained", S.DRAINED, S.PAUSING))
    finally:
        CURRENT.reset(token)
    await asyncio.wait_for(started.wait(), 30)
    assert len(op.running) == 1  # the call knows the user code it waits for
    cancel(op)
    with pytest.raises(HookCancelled) as stopped:
        await asyncio.wait_for(emit, 30)
    assert cancelled == [True] and stopped.value.reason == "was cancelled"
    assert stopped.value.event == "drained" and op.running == set()


async def test_hook_failure_keeps_the_entered_state_and_retry_works() -> None:
    engines = [SimulatedEngine(f"e{i}") for i in range(2)]
    server = RolloutServer([EngineGroup("actor", engines)])
    calls = 0

    def flaky(event: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("trainer not ready")

    server.on("released", flaky)
    with pytest.raises(HookFailed) as err:
        await server.offload()
    assert err.value.state == "released"
    assert isinstance(err.value.__cause__, RuntimeError)
    assert server.state is ServerState.RELEASED
    await server.onload()
    assert server.state is ServerState.SERVING
    await server.offload()
    assert calls == 2
    await server.onload()
