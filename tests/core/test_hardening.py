"""Misuse that must neither kill an engine nor hang a call: work a hook leaves behind, one engine
under two names, hooks that never return or raise ``BaseException``s, fleets with no live engine,
and a process that dies with calls in flight (the journal)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from rollout_lifecycle import (
    DeadEnginePolicy,
    Deadlines,
    EngineGroup,
    EngineHost,
    HookFailed,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleConfig,
    LifecycleError,
    LifecycleEvent,
    PhaseFailed,
    RolloutServer,
    ServerSnapshot,
    ServerState,
    SGLangHTTPEngine,
    SimulatedEngine,
)
from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.sync import SyncCallTimeout, SyncRolloutServer
from rollout_lifecycle.testing import simulated_engine_actors
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import faulty_engines as faulty
from rollout_lifecycle.testing.fleets import simulated_engines as sims

S = ServerState
#: An outer bound on every call that a regression could hang: far below any default deadline.
BOUND = 30.0


def dead(engines: list[Any]) -> list[str]:
    """The engines the simulator killed (a contract violation such as a second resume)."""
    inner = [e.inner if isinstance(e, FaultyEngine) else e for e in engines]
    return [e.label for e in inner if e.dead]


def assert_exact(server: RolloutServer) -> None:
    """The records imply the state the server is in, and no call is left in flight."""
    implied = server.fleet.settled_state()
    state = server.state
    assert implied is state or (state, implied) == (S.KV_RESTORED, S.DRAINED), (state, implied)
    for engine in server.snapshot().engines().values():
        assert engine.alive and not engine.uncertain and not engine.pause_unknown, engine


def released_calls(engine: FaultyEngine) -> int:
    return sum(c["op"] == "release_memory_occupation" for c in engine.calls)


# -- calls from tasks a hook leaves behind ---------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_an_onload_a_released_hook_left_running_waits_for_the_lock(kind: str) -> None:
    engines = faulty(2)
    for engine in engines:  # the left-behind onload is still resuming when the caller's begins
        engine.arm("resume_memory_occupation", "slow", seconds=0.2)
    server = RolloutServer([EngineGroup("actor", engines)])
    started: list[asyncio.Task[Any]] = []

    def start_onload(event: LifecycleEvent) -> None:
        started.append(asyncio.ensure_future(event.server.onload()))

    async def start_onload_async(event: LifecycleEvent) -> None:
        start_onload(event)

    server.on("released", start_onload if kind == "sync" else start_onload_async)
    await asyncio.wait_for(server.offload(), BOUND)
    # The caller's next call races the task the hook left behind: both are serialized.
    await asyncio.wait_for(server.onload(), BOUND)
    await asyncio.wait_for(started[0], BOUND)  # no raw transitions error, no engine error
    assert server.state is S.SERVING
    assert dead(engines) == []
    assert_exact(server)


async def test_a_left_behind_call_racing_an_offload_runs_after_it() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    order: list[str] = []
    left: list[asyncio.Task[Any]] = []

    async def pause_later(event: LifecycleEvent) -> None:
        async def pause() -> None:
            await event.server.resume()
            order.append(f"left-behind resume ended in {event.server.state.value}")

        left.append(asyncio.ensure_future(pause()))

    server.on("drained", pause_later)
    await asyncio.wait_for(server.offload(), BOUND)
    order.append("offload returned")
    with pytest.raises(IllegalTransition):  # resume is not legal in released: refused cleanly
        await asyncio.wait_for(left[0], BOUND)
    assert order == ["offload returned"]
    assert server.state is S.RELEASED and dead(engines) == []
    await server.onload()
    assert_exact(server)


async def test_a_call_a_hook_starts_and_awaits_runs_inside_the_call() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])

    async def write(event: LifecycleEvent) -> None:
        # gather wraps the call in a task of its own; the hook awaits it: part of the call
        await asyncio.gather(event.server.update_weights(lambda update: None, "v1"))

    server.on("weights_restored", write)
    await server.offload()
    await asyncio.wait_for(server.onload(), BOUND)
    assert server.state is S.SERVING and server.expected_version == "v1"
    assert {await e.weight_version() for e in engines} == {"v1"}


def test_a_facade_hook_task_left_behind_is_serialized() -> None:
    engines = faulty(2)
    for engine in engines:  # the left-behind onload is still resuming when the caller's begins
        engine.arm("resume_memory_occupation", "slow", seconds=0.3)
    left: list[Any] = []
    with SyncRolloutServer([EngineGroup("actor", engines)]) as rollout:

        async def start_onload(event: LifecycleEvent) -> None:
            left.append(asyncio.ensure_future(event.server.onload()))

        rollout.on("released", start_onload)
        rollout.offload(timeout=BOUND)
        rollout.onload(timeout=BOUND)
        assert rollout.state is S.SERVING
        rollout._call("wait", lambda: asyncio.wait_for(left[0], BOUND))
        assert_exact(rollout.server)
    assert dead(engines) == []


# -- one engine, one identity ----------------------------------------------------------------


def test_one_engine_in_two_groups_is_refused() -> None:
    (engine,) = sims(1)
    with pytest.raises(InvalidArgument, match="belongs to one group"):
        RolloutServer([EngineGroup("a", [engine]), EngineGroup("b", [engine])])
    with pytest.raises(InvalidArgument, match="belongs to one group"):
        RolloutServer([EngineGroup("a", [engine]), EngineGroup("b", [EngineHost(engine)])])
    with pytest.raises(InvalidArgument, match="same engine"):
        EngineGroup("a", [engine, EngineHost(engine)])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("http://127.0.0.1:30000", "http://localhost:30000"),
        ("http://localhost:30000/", "http://[::1]:30000"),
        ("http://0.0.0.0:30000", "http://LOCALHOST:30000"),
        ("http://Example.COM", "http://example.com:80"),
        ("https://10.0.0.1", "https://10.0.0.1:443/"),
    ],
)
def test_two_spellings_of_one_server_are_one_engine(first: str, second: str) -> None:
    assert url_identity(first) == url_identity(second)
    engines = [SGLangHTTPEngine(first), SGLangHTTPEngine(second)]
    with pytest.raises(InvalidArgument, match="same engine"):
        EngineGroup("a", engines)
    with pytest.raises(InvalidArgument, match="belongs to one group"):
        RolloutServer([EngineGroup("a", engines[:1]), EngineGroup("b", engines[1:])])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30001"),
        ("http://127.0.0.1:30000", "https://127.0.0.1:30000"),
        ("http://10.0.0.1:30000", "http://10.0.0.2:30000"),
        ("http://h:1/a", "http://h:1/b"),
    ],
)
def test_different_servers_are_different_engines(first: str, second: str) -> None:
    assert url_identity(first) != url_identity(second)
    EngineGroup("a", [SGLangHTTPEngine(first), SGLangHTTPEngine(second)])


async def test_recover_refuses_a_replacement_that_is_another_engine() -> None:
    a, b = faulty(1, "a"), sims(1, "b")
    config = LifecycleConfig(dead_engines=DeadEnginePolicy.SKIP)
    server = RolloutServer([EngineGroup("a", a), EngineGroup("b", b)], config)
    a[0].arm("server_info", "die")
    await server.probe()
    assert not server.snapshot().engines()["a/0"].alive
    with pytest.raises(InvalidArgument, match="is engine b/0 already"):
        await server.recover(lambda engine_id: b[0])
    # nothing was retired: b/0 still serves
    assert not b[0].dead and server.snapshot().engines()["b/0"].alive
    assert (await server.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}))[
        "meta_info"
    ]["completion_tokens"] == 2
    await server.recover(lambda engine_id: SimulatedEngine("a-new", token_latency=0.001))
    assert server.snapshot().engines()["a/0"].alive


async def test_recover_refuses_as_a_replacement_the_engine_an_earlier_recover_put_in() -> None:
    # An engine is named by what its record holds now: the replacement, not the engine that
    # held its slot before.
    a = faulty(2, "a")
    config = LifecycleConfig(dead_engines=DeadEnginePolicy.SKIP)
    server = RolloutServer([EngineGroup("a", a)], config)
    a[0].arm("server_info", "die")
    await server.probe()
    new = SimulatedEngine("a-new", token_latency=0.001)
    await server.recover(lambda engine_id: new)
    assert server.snapshot().engines()["a/0"].alive
    a[1].arm("server_info", "die")
    await server.probe()
    with pytest.raises(InvalidArgument, match="is engine a/0 already"):
        await server.recover(lambda engine_id: new)
    assert not new.dead and server.snapshot().engines()["a/0"].alive


# -- hooks that never return ---------------------------------------------------------------


async def test_wait_for_bounds_an_offload_whose_hook_never_returns() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    cancelled: list[bool] = []

    async def forever(event: LifecycleEvent) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    remove = server.on("before_release", forever)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.wait_for(server.offload(), 2), BOUND)
    assert time.monotonic() - began < BOUND
    assert cancelled == [True]
    assert server.state is S.DRAINED  # the drain completed, the release was never sent
    assert all(not e.state()["released_tags"] for e in engines)
    assert_exact(server)
    remove()
    await server.offload()
    await server.onload()
    assert server.state is S.SERVING and dead(engines) == []


async def test_a_hook_past_its_deadline_fails_the_call_with_hook_failed() -> None:
    engines = sims(2)
    config = LifecycleConfig(deadlines=Deadlines(hook=0.2))
    server = RolloutServer([EngineGroup("actor", engines)], config)
    remove = server.on("before_release", lambda event: asyncio.Event().wait())
    with pytest.raises(HookFailed, match=r"did not return within 0\.2s") as failed:
        await asyncio.wait_for(server.offload(), BOUND)
    assert isinstance(failed.value.__cause__, TimeoutError)
    assert server.state is S.DRAINED
    assert_exact(server)
    remove()
    await server.onload()
    assert server.state is S.SERVING


#: Every hook event a full offload / onload cycle runs, in order.
CYCLE_EVENTS = [
    "before_pause",
    "pausing",
    "after_pause",
    "before_flush",
    "after_flush",
    "drained",
    "before_release",
    "after_release",
    "released",
    "before_resume_weights",
    "after_resume_weights",
    "weights_restored",
    "before_resume_kv",
    "after_resume_kv",
    "kv_restored",
    "before_continue",
    "after_continue",
    "serving",
]


@pytest.mark.parametrize("event", CYCLE_EVENTS)
@pytest.mark.parametrize("how", ["cancelled", "deadline"])
async def test_a_hook_that_never_returns_at_any_event_stops_the_cycle_at_a_boundary(
    event: str, how: str
) -> None:
    engines = sims(2)
    config = LifecycleConfig(deadlines=Deadlines(hook=0.3 if how == "deadline" else 600))
    server = RolloutServer([EngineGroup("actor", engines)], config)
    remove = server.on(event, lambda e: asyncio.Event().wait())
    stopped = 0
    for call in (server.offload, server.onload):
        try:
            await asyncio.wait_for(call(), 1.0 if how == "cancelled" else BOUND)
        except (TimeoutError, HookFailed):
            stopped += 1
    assert stopped == 1
    assert server.state is not S.FAILED
    assert_exact(server)
    remove()
    if server.state is not S.SERVING:
        await asyncio.wait_for(server.onload(), BOUND)
    assert server.state is S.SERVING and dead(engines) == []
    assert all(not e.state()["released_tags"] for e in engines)


def test_a_facade_call_with_a_sync_hook_that_never_returns_is_bounded() -> None:
    engines = sims(2)
    release = threading.Event()
    rollout = SyncRolloutServer([EngineGroup("actor", engines)])
    try:
        remove = rollout.on("before_release", lambda event: release.wait(120))
        began = time.monotonic()
        with pytest.raises(SyncCallTimeout):
            rollout.offload(timeout=2)
        assert time.monotonic() - began < BOUND
        assert rollout.state is S.DRAINED
        assert_exact(rollout.server)
        remove()
        rollout.onload(timeout=BOUND)
        assert rollout.state is S.SERVING
    finally:
        began = time.monotonic()
        rollout.close()  # does not wait for the hook's thread
        assert time.monotonic() - began < BOUND
        release.set()
    assert dead(engines) == []


def test_a_facade_sync_hook_past_its_deadline_is_hook_failed() -> None:
    engines = sims(2)
    release = threading.Event()
    config = LifecycleConfig(deadlines=Deadlines(hook=0.3))
    try:
        with SyncRolloutServer([EngineGroup("actor", engines)], config) as rollout:
            rollout.on("before_flush", lambda event: release.wait(120))
            with pytest.raises(HookFailed, match="did not return within"):
                rollout.offload(timeout=BOUND)
            assert rollout.state is S.SERVING  # the drain a hook refused is undone
            assert_exact(rollout.server)
    finally:
        release.set()


# -- every exception from a hook is HookFailed -----------------------------------------------


def raise_system_exit(event: Any) -> None:
    sys.exit(3)


async def raise_system_exit_async(event: Any) -> None:
    sys.exit(3)


async def raise_cancelled_async(event: Any) -> None:
    raise asyncio.CancelledError("from the hook itself")


def raise_cancelled(event: Any) -> None:
    raise asyncio.CancelledError("from the hook itself")


@pytest.mark.parametrize(
    ("hook", "cause"),
    [
        (raise_system_exit, SystemExit),
        (raise_system_exit_async, SystemExit),
        (raise_cancelled, asyncio.CancelledError),
        (raise_cancelled_async, asyncio.CancelledError),
    ],
)
@pytest.mark.parametrize("event", ["before_release", "drained", "before_continue"])
async def test_base_exceptions_from_hooks_are_hook_failed(
    hook: Any, cause: type[BaseException], event: str
) -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    remove = server.on(event, hook)
    with pytest.raises(HookFailed) as failed:
        await asyncio.wait_for(server.offload(), BOUND)
        await asyncio.wait_for(server.onload(), BOUND)
    assert isinstance(failed.value.__cause__, cause)
    assert server.state is not S.FAILED
    assert_exact(server)
    remove()
    await server.onload()
    assert server.state is S.SERVING and dead(engines) == []


@pytest.mark.parametrize("push", [raise_system_exit, raise_system_exit_async])
async def test_a_weight_push_raising_system_exit_is_hook_failed(push: Any) -> None:
    server = RolloutServer([EngineGroup("actor", sims(2))])
    await server.pause()
    with pytest.raises(HookFailed) as failed:
        await server.update_weights(push, "v2")
    assert isinstance(failed.value.__cause__, SystemExit)
    assert server.state is S.DRAINED
    await server.update_weights(lambda update: None, "v2")
    await server.resume()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_facade_hooks_raising_system_exit_are_hook_failed(kind: str) -> None:
    with SyncRolloutServer([EngineGroup("actor", sims(2))]) as rollout:
        rollout.on(
            "before_release", raise_system_exit if kind == "sync" else raise_system_exit_async
        )
        with pytest.raises(HookFailed) as failed:
            rollout.offload(timeout=BOUND)
        assert isinstance(failed.value.__cause__, SystemExit)
        assert rollout.state is S.DRAINED


def test_keyboard_interrupt_from_a_facade_hook_propagates_unchanged() -> None:
    def interrupt(event: Any) -> None:
        raise KeyboardInterrupt

    with SyncRolloutServer([EngineGroup("actor", sims(2))]) as rollout:
        remove = rollout.on("drained", interrupt)
        with pytest.raises(KeyboardInterrupt):
            rollout.pause(timeout=BOUND)
        remove()
        assert rollout.state is S.DRAINED
        rollout.resume(timeout=BOUND)  # the loop survived


# -- no success on nothing -------------------------------------------------------------------


async def test_no_call_succeeds_on_a_group_whose_engines_are_all_dead() -> None:
    engines = faulty(2)
    config = LifecycleConfig(dead_engines=DeadEnginePolicy.SKIP)
    server = RolloutServer([EngineGroup("actor", engines)], config)
    for engine in engines:
        engine.arm("pause_generation", "die")
    with pytest.raises(PhaseFailed):  # every engine died in the pause: not a success
        await asyncio.wait_for(server.offload(), BOUND)
    for call in (server.offload, server.onload, server.pause, server.resume):
        with pytest.raises(IllegalEngineOp, match=r"group 'actor'.*all 2 engines"):
            await asyncio.wait_for(call(), BOUND)
    with pytest.raises(IllegalEngineOp, match="all 2 engines"):
        await server.update_weights(lambda update: None)
    # recover() brings the fleet back
    fresh = iter(sims(2, "new"))
    await server.recover(lambda engine_id: next(fresh))
    assert all(e.alive for e in server.snapshot().engines().values())


async def test_a_skipped_dead_engine_does_not_fail_a_phase_its_peers_pass() -> None:
    engines = faulty(2)
    config = LifecycleConfig(dead_engines=DeadEnginePolicy.SKIP)
    server = RolloutServer([EngineGroup("actor", engines)], config)
    engines[0].arm("pause_generation", "die")
    await asyncio.wait_for(server.offload(), BOUND)
    assert server.state is S.RELEASED
    assert [e.id for e in server.snapshot().engines().values() if not e.alive] == ["actor/0"]


# -- the journal: intent before the send, outcome after --------------------------------------


async def test_the_journal_records_uncertain_tags_before_a_release_is_sent() -> None:
    engines = faulty(2)
    entries: list[tuple[ServerSnapshot, int]] = []

    def journal(snapshot: ServerSnapshot) -> None:
        entries.append((snapshot, sum(released_calls(e) for e in engines)))

    server = RolloutServer([EngineGroup("actor", engines)], journal=journal)
    await server.offload()
    intents = [
        (snap, sent) for snap, sent in entries if any(e.uncertain for e in snap.engines().values())
    ]
    assert intents, "no journal entry recorded the release in flight"
    snap, sent = intents[0]
    assert sent == 0  # written before the first release went out
    assert {e.uncertain for e in snap.engines().values()} == {("weights", "kv_cache", "cuda_graph")}
    last = entries[-1][0]
    assert last.state is S.RELEASED
    assert all(not e.uncertain and len(e.released) == 3 for e in last.engines().values())


async def test_a_process_killed_mid_release_leaves_a_record_that_refuses_a_second_release() -> None:
    engines = faulty(2)
    entries: list[ServerSnapshot] = []
    server = RolloutServer([EngineGroup("actor", engines)], journal=entries.append)
    for engine in engines:
        engine.arm("release_memory_occupation", "slow", seconds=0.3)
    task = asyncio.ensure_future(server.offload())
    deadline = time.monotonic() + BOUND
    while not all(released_calls(e) for e in engines):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    last = entries[-1]  # what a process killed now (SIGKILL) leaves behind
    await task
    # A new process adopts the last journal entry: the release may or may not have landed.
    again = RolloutServer([EngineGroup("actor", engines)])
    again.adopt(last)
    assert again.state is S.FAILED
    for call in (again.offload, again.onload, again.reset):
        with pytest.raises((IllegalTransition, IllegalEngineOp)):
            await call()
    assert [released_calls(e) for e in engines] == [1, 1]  # never released twice
    assert dead(engines) == []
    # recover() replaces the engines whose memory is unknown
    fresh = iter(sims(2, "new"))
    await again.recover(lambda engine_id: next(fresh))
    assert again.state is not S.FAILED
    assert_exact(again)


async def test_a_journal_that_raises_before_a_send_sends_nothing() -> None:
    engines = faulty(2)
    armed = False

    def journal(snapshot: ServerSnapshot) -> None:
        if armed and any(e.uncertain for e in snapshot.engines().values()):
            raise OSError("disk full")

    server = RolloutServer([EngineGroup("actor", engines)], journal=journal)
    await server.pause()
    armed = True
    with pytest.raises(OSError, match="disk full"):
        await server.offload()
    assert [released_calls(e) for e in engines] == [0, 0]
    assert all(not e.uncertain for e in server.snapshot().engines().values())
    armed = False
    await server.reset()
    await server.offload()
    await server.onload()
    assert server.state is S.SERVING and dead(engines) == []


def test_lifecycle_errors_are_the_only_errors_for_misuse() -> None:
    """A refused call raises a LifecycleError, never a raw error of the state machine library."""
    with SyncRolloutServer([EngineGroup("actor", sims(1))]) as rollout:
        with pytest.raises(LifecycleError):
            rollout.onload_kv(timeout=BOUND)
        with pytest.raises(LifecycleError):
            rollout.update_weights(lambda update: None, timeout=BOUND)


# -- engine actors ----------------------------------------------------------------------------


class _MarksItsClose(SimulatedEngine):
    """A simulated engine that leaves a file behind when it is closed (seen across Ray)."""

    def __init__(self, label: str, path: str) -> None:
        super().__init__(label, token_latency=0.001)
        self._path = path

    async def close(self) -> None:
        Path(self._path).write_text("closed")  # noqa: ASYNC240 - a few bytes, in a test
        await super().close()


def _marking(label: str, path: str) -> SimulatedEngine:
    return _MarksItsClose(label, path)


def test_one_engine_actor_in_two_groups_is_refused(engine_actors: Any) -> None:
    (actor,) = engine_actors(1)
    again = ray.cloudpickle.loads(ray.cloudpickle.dumps(actor))  # another handle, same actor
    assert again is not actor
    with pytest.raises(InvalidArgument, match="belongs to one group"):
        RolloutServer([EngineGroup("a", [actor]), EngineGroup("b", [again])])
    with pytest.raises(InvalidArgument, match="same engine"):
        EngineGroup("a", [actor, again])


async def test_a_replaced_engine_actor_closes_its_backend_before_it_is_killed(
    ray_cluster: None, tmp_path: Path
) -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    marks = [tmp_path / f"closed-{i}" for i in range(2)]
    actors = [
        start_engine_actor(functools.partial(_marking, f"m{i}", str(mark)))
        for i, mark in enumerate(marks)
    ]
    (fresh,) = simulated_engine_actors(1, label="fresh", token_latency=0.001)
    try:
        ray.get([a.ping.remote() for a in [*actors, fresh]], timeout=60)
        server = RolloutServer([EngineGroup("actor", actors)])
        # engine 0's memory state is unknown (a release that never answered, say)
        snap = server.snapshot()
        (group,) = snap.groups
        first = dataclasses.replace(group.engines[0], uncertain=("weights",))
        engines = (first, *group.engines[1:])
        server.adopt(
            dataclasses.replace(
                snap, state=S.FAILED, groups=(dataclasses.replace(group, engines=engines),)
            )
        )
        await asyncio.wait_for(server.recover(lambda engine_id: fresh), BOUND)
        assert server.state is S.SERVING
        assert marks[0].read_text() == "closed"  # closed, then killed
        assert not marks[1].exists()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actors[0].ping.remote(), timeout=60)
    finally:
        for actor in [*actors, fresh]:
            ray.kill(actor)
