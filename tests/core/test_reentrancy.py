"""Calls user code makes back into its own server.

User code that runs inside a transition in progress (every ``before_<phase>`` hook, and the
weight push inside ``write_weights``) or inside ``recover()`` (its factory) cannot fire a
transition of its own: a lifecycle call from it is refused at once with ``IllegalTransition``
naming the call and the code, before anything is sent. A hook that runs once a transition has
completed (``after_<phase>``, the state hooks) may call the server, and the call runs inline.
The sweep makes every lifecycle call from a hook on every event through a whole cycle, with the
hook catching what its call raised or letting it through, and checks that nothing but a
``LifecycleError`` escapes, no hook recurses, the records imply the state the server ends in,
and every engine is alive.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from rollout_lifecycle import (
    HOOK_EVENTS,
    Deadlines,
    EngineGroup,
    HookFailed,
    IllegalTransition,
    LifecycleConfig,
    LifecycleError,
    LifecycleEvent,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    SyncRolloutServer,
    WeightUpdate,
)
from rollout_lifecycle.core.scope import LIFECYCLE_CALLS
from rollout_lifecycle.testing import fatal_calls
from rollout_lifecycle.testing.faults import FaultyEngine

S = ServerState

#: Small deadlines: a call that hangs or recurses until a deadline shows at once.
DEADLINES = Deadlines(
    pause=2.0,
    flush=2.0,
    release=2.0,
    resume=2.0,
    continue_=2.0,
    weight_update=2.0,
    probe=1.0,
    startup=2.0,
    hook=2.0,
)
CONFIG = LifecycleConfig(deadlines=DEADLINES, flush_retry_interval=0.001)
#: The lifecycle calls a hook can make (every one of them, so a new call joins the sweep).
CALLS = tuple(sorted(LIFECYCLE_CALLS))
#: The events whose hooks run inside a transition in progress.
INSIDE = tuple(e for e in HOOK_EVENTS if e.startswith("before_"))
#: A hook makes its call on at most this many of its runs: on a server that let a hook recurse,
#: the sweep stops instead of running into the hook deadline.
LIMIT = 3
#: A hook whose call fires its own event again once that call's transition has completed
#: recurses through complete transitions, as a function that calls itself would: only the
#: counter stops it. Every other hook runs one at a time.
SELF_RECURSIVE = {("after_update_weights", "update_weights")}
#: How often ``cycle`` fires an event at most: once in the step, once in the failed drain.
FIRINGS = 2


def simulated_and_faulty(n: int = 2) -> tuple[list[SimulatedEngine], list[FaultyEngine]]:
    inner = [SimulatedEngine(f"e{i}", token_latency=0) for i in range(n)]
    return inner, [FaultyEngine(e) for e in inner]


def keeper() -> SimulatedEngine:
    return SimulatedEngine("k0", token_latency=0)


def no_push(update: WeightUpdate) -> None:
    """A weight push that writes nothing."""


def replacement(engine_id: str) -> SimulatedEngine:
    return SimulatedEngine(f"new-{engine_id.replace('/', '-')}", token_latency=0)


def calling(server: RolloutServer, call: str) -> Awaitable[Any]:
    """``server.<call>()`` with the arguments it needs."""
    if call == "update_weights":
        return server.update_weights(no_push, version="nested")
    if call == "recover":
        return server.recover(replacement)
    if call == "add_engines":
        return server.add_engines("actor", [SimulatedEngine("joiner", token_latency=0)])
    if call == "remove_engines":
        return server.remove_engines(["actor/1"], stop=False)
    method: Callable[[], Awaitable[Any]] = getattr(server, call)
    return method()


@dataclass
class Reentrant:
    """A hook that makes ``call`` on each of its first ``LIMIT`` runs, and what came of it;
    with ``through``, what the call raised is raised by the hook too."""

    call: str
    through: bool = False
    runs: int = 0
    depth: int = 0
    deepest: int = 0
    #: What each call it made raised (None: it returned).
    outcomes: list[BaseException | None] = field(default_factory=list)

    def hook(self) -> Callable[[LifecycleEvent], Awaitable[None]]:
        async def reentrant_hook(event: LifecycleEvent) -> None:
            self.runs += 1
            self.depth += 1
            self.deepest = max(self.deepest, self.depth)
            try:
                if self.runs <= LIMIT:
                    try:
                        await calling(event.server, self.call)
                        self.outcomes.append(None)
                    except Exception as exc:
                        self.outcomes.append(exc)
                        if self.through:
                            raise
            finally:
                self.depth -= 1

        return reentrant_hook


async def cycle(server: RolloutServer, engines: list[FaultyEngine]) -> list[Exception]:
    """One colocated step and one failed drain (it fires ``failed``), then back out of
    ``failed``; what each call raised."""
    raised: list[Exception] = []

    async def step(call: Callable[[], Awaitable[Any]]) -> None:
        try:
            await asyncio.wait_for(call(), 20)
        except Exception as exc:
            raised.append(exc)

    await step(server.offload)
    await step(server.onload_weights)
    await step(lambda: server.update_weights(no_push, version="v1"))
    await step(server.onload_kv)
    if server.state is S.SERVING:
        engines[0].arm("pause_generation", "reject")  # the drain fails: 'failed'
        await step(server.offload)
    if server.state is S.FAILED:
        await step(server.reset)
    return raised


def assert_settled(server: RolloutServer) -> None:
    """The server is ``failed``, or in the state its records imply (a fleet that stopped in
    ``kv_restored`` settles as ``drained``)."""
    state, implied = server.state, server.fleet.settled_state()
    assert state is S.FAILED or implied is state or (state, implied) == (S.KV_RESTORED, S.DRAINED)


def state_of(server: RolloutServer) -> ServerState:
    """The server's state now (after a call that may have moved it)."""
    return server.state


def sent(engine: FaultyEngine, op: str) -> int:
    """How many ``op`` calls ``engine`` received."""
    return sum(c["op"] == op for c in engine.calls)


def histories(engines: list[SimulatedEngine]) -> dict[str, list[dict[str, Any]]]:
    return {e.label: e.history() for e in engines}


@pytest.mark.parametrize("through", [False, True], ids=["catches", "raises"])
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("event", HOOK_EVENTS)
async def test_a_hook_calling_the_server_never_recurses_nor_breaks_the_contract(
    event: str, call: str, through: bool
) -> None:
    inner, engines = simulated_and_faulty()
    kept = keeper()
    server = RolloutServer(
        [EngineGroup("actor", engines), EngineGroup("reward", [kept], needs_offload=False)],
        CONFIG,
    )
    hook = Reentrant(call, through)
    server.on(event, hook.hook())
    raised = await cycle(server, engines)
    assert all(isinstance(e, LifecycleError) for e in raised), raised
    if through:  # what the hook raised reached the caller as HookFailed, caused by it
        refused = {id(e) for e in hook.outcomes if e is not None}
        causes = {id(e.__cause__) for e in raised if isinstance(e, HookFailed)}
        assert refused <= causes
    assert all(e is None or isinstance(e, LifecycleError) for e in hook.outcomes), hook.outcomes
    assert hook.runs >= 1, f"the cycle never fired {event!r}"
    if (event, call) in SELF_RECURSIVE:
        assert hook.runs == hook.deepest == LIMIT + 1
    else:
        assert hook.deepest == 1, f"the hook ran inside itself {hook.deepest} deep"
        assert hook.runs <= FIRINGS, hook.runs
    if event in INSIDE:
        for outcome in hook.outcomes:
            assert isinstance(outcome, IllegalTransition), outcome
            assert outcome.call == call
            assert "reentrant_hook" in str(outcome) and repr(event) in str(outcome)
    assert_settled(server)
    everyone = [*inner, kept]
    assert [e.label for e in everyone if e.dead] == []
    assert fatal_calls(histories(everyone)) == []


async def test_a_before_release_hook_calling_offload_is_refused_at_once() -> None:
    inner, engines = simulated_and_faulty()
    server = RolloutServer([EngineGroup("actor", engines)], LifecycleConfig(deadlines=DEADLINES))
    nested: list[BaseException] = []

    async def offload_again(event: LifecycleEvent) -> None:
        try:
            await event.server.offload()
        except BaseException as exc:
            nested.append(exc)
            raise

    remove = server.on("before_release", offload_again)
    start = time.monotonic()
    with pytest.raises(HookFailed) as failed:
        await server.offload()
    assert time.monotonic() - start < DEADLINES.hook / 4
    (refused,) = nested
    assert isinstance(refused, IllegalTransition) and failed.value.__cause__ is refused
    assert refused.call == "offload" and refused.state == "drained"
    assert "offload_again" in str(refused) and "'before_release'" in str(refused)
    # The release was never sent; the server is where the drain left it.
    assert server.state is S.DRAINED and failed.value.state == "drained"
    assert all(sent(e, "release_memory_occupation") == 0 for e in engines)
    remove()
    await server.offload()
    await server.onload()
    assert state_of(server) is S.SERVING and not any(e.dead for e in inner)


async def test_a_before_resume_kv_hook_calling_onload_is_refused_at_once() -> None:
    inner, engines = simulated_and_faulty()
    server = RolloutServer([EngineGroup("actor", engines)], LifecycleConfig(deadlines=DEADLINES))
    await server.offload()
    await server.onload_weights()
    nested: list[BaseException] = []

    async def onload_again(event: LifecycleEvent) -> None:
        try:
            await event.server.onload()
        except BaseException as exc:
            nested.append(exc)
            raise

    remove = server.on("before_resume_kv", onload_again)
    start = time.monotonic()
    with pytest.raises(HookFailed) as failed:
        await server.onload()
    assert time.monotonic() - start < DEADLINES.hook / 4
    (refused,) = nested
    assert isinstance(refused, IllegalTransition) and failed.value.__cause__ is refused
    assert refused.call == "onload" and "onload_again" in str(refused)
    assert "'before_resume_kv'" in str(refused) and "'restore_kv'" in str(refused)
    assert server.state is S.WEIGHTS_RESTORED
    assert all(sent(e, "resume_memory_occupation") == 1 for e in engines)
    remove()
    await server.onload()
    assert state_of(server) is S.SERVING and not any(e.dead for e in inner)


async def test_a_weight_push_calling_the_server_is_refused() -> None:
    inner, engines = simulated_and_faulty()
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    nested: list[BaseException] = []

    async def resume_too_early(update: WeightUpdate) -> None:
        snapshot = server.snapshot()  # reading is allowed
        assert snapshot.state is S.DRAINED
        try:
            await server.resume()
        except BaseException as exc:
            nested.append(exc)
            raise

    await server.pause()
    with pytest.raises(HookFailed) as failed:
        await server.update_weights(resume_too_early, version="v1")
    (refused,) = nested
    assert isinstance(refused, IllegalTransition) and failed.value.__cause__ is refused
    assert refused.call == "resume" and "resume_too_early" in str(refused)
    assert "weight push" in str(refused) and "'write_weights'" in str(refused)
    assert all(sent(e, "continue_generation") == 0 for e in engines)
    assert server.state is S.DRAINED
    await server.update_weights(no_push, version="v1")
    await server.resume()
    assert state_of(server) is S.SERVING and not any(e.dead for e in inner)


async def test_a_recover_factory_calling_recover_is_refused() -> None:
    _, engines = simulated_and_faulty()
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    engines[0].arm("server_info", "die")
    await server.probe()
    made: list[str] = []

    async def factory(engine_id: str) -> SimulatedEngine:
        made.append(engine_id)
        await server.recover(factory)
        return replacement(engine_id)

    start = time.monotonic()
    with pytest.raises(IllegalTransition) as refused:
        await server.recover(factory)
    assert time.monotonic() - start < DEADLINES.startup / 4
    assert made == ["actor/0"] and refused.value.call == "recover"
    assert "recover() factory" in str(refused.value)
    recovered = await server.recover(replacement)
    assert set(recovered) == {"actor/0"} and server.state is S.SERVING


def test_a_sync_hook_of_the_facade_calling_offload_is_refused() -> None:
    inner, engines = simulated_and_faulty()
    nested: list[BaseException] = []
    with SyncRolloutServer([EngineGroup("actor", engines)], CONFIG) as rollout:

        def offload_again(event: LifecycleEvent) -> None:
            try:
                rollout.offload(timeout=5)
            except BaseException as exc:
                nested.append(exc)

        rollout.on("before_release", offload_again)
        rollout.offload(timeout=10)
        assert rollout.state is S.RELEASED
        rollout.onload(timeout=10)
    (refused,) = nested
    assert isinstance(refused, IllegalTransition) and refused.call == "offload"
    assert not any(e.dead for e in inner)


async def test_state_and_after_hooks_still_call_the_server() -> None:
    inner, engines = simulated_and_faulty()
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    seen: list[str] = []

    async def write(event: LifecycleEvent) -> None:
        await event.server.update_weights(no_push, version="v2")
        seen.append(event.server.state.value)

    async def report(event: LifecycleEvent) -> None:
        seen.append(f"after_release: {(await event.server.probe()).keys()}")

    server.on("weights_restored", write)
    server.on("after_release", report)
    await server.offload()
    await server.onload()
    assert seen[-1] == "weights_restored" and "actor/0" in seen[0]
    assert server.state is S.SERVING and server.expected_version == "v2"
    assert not any(e.dead for e in inner)


# -- the errors the machine raises ---------------------------------------------------------


async def test_a_drain_a_hook_refused_names_the_state_the_server_is_left_in() -> None:
    _, engines = simulated_and_faulty()
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)

    def refuse(event: LifecycleEvent) -> None:
        raise RuntimeError("not now")

    server.on("before_flush", refuse)
    with pytest.raises(HookFailed) as failed:
        await server.offload()
    assert server.state is S.SERVING
    assert failed.value.state == "serving" and "'serving'" in str(failed.value)
    assert "pausing" not in str(failed.value)
    copy = pickle.loads(pickle.dumps(failed.value))
    assert (copy.event, copy.hook, copy.state, copy.reason, str(copy)) == (
        failed.value.event,
        failed.value.hook,
        "serving",
        "raised",
        str(failed.value),
    )


def test_an_illegal_transition_carries_its_reason_and_pickles() -> None:
    plain = IllegalTransition("resume", "released", ["drained", "kv_restored"])
    assert str(plain).endswith("it is allowed from: 'drained', 'kv_restored'")
    assert plain.reason is None
    why = IllegalTransition("reset", "failed", ["failed"], reason="the records imply no state")
    assert str(why) == "reset() is not allowed in state 'failed'; the records imply no state"
    for error in (plain, why):
        copy = pickle.loads(pickle.dumps(error))
        assert (copy.call, copy.state, copy.allowed, copy.reason, str(copy)) == (
            error.call,
            error.state,
            error.allowed,
            error.reason,
            str(error),
        )


async def test_no_error_of_the_state_machine_library_reaches_a_caller() -> None:
    _, engines = simulated_and_faulty()
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    machine = server._machine
    with pytest.raises(IllegalTransition, match="'release' is allowed from: 'drained'"):
        await machine.fire("release")
    assert server.state is S.SERVING
    engines[0].arm("pause_generation", "reject")
    with pytest.raises(PhaseFailed):
        await server.pause()
    assert state_of(server) is S.FAILED
    await machine.fail()  # already failed: nothing to fire
    with pytest.raises(IllegalTransition):
        await machine.fire("fail")
    assert await server.reset() is S.SERVING
