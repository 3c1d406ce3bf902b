"""The synchronous facade: every call blocks, raises what the server raises, never deadlocks."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    FromDisk,
    HookFailed,
    IllegalTransition,
    InvalidArgument,
    LifecycleConfig,
    LifecycleError,
    LifecycleEvent,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    StaleWeights,
    WeightPushFailed,
    WeightUpdate,
)
from rollout_lifecycle.sync import (
    CalledFromLoopThread,
    SyncCallTimeout,
    SyncRolloutServer,
    SyncServerClosed,
)
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import simulated_engines as sims
from rollout_lifecycle.testing.waits import DEFAULT_DEADLINE_S

S = ServerState
#: Every facade call is bounded, so that a deadlock fails the test instead of hanging it.
T = 10.0


def request(i: int, tokens: int = 20) -> dict[str, Any]:
    return {"input_ids": [i, i + 1], "sampling_params": {"max_new_tokens": tokens}}


def blocking_until(check: Callable[[], bool], what: str) -> None:
    """Block this thread until ``check()`` holds (the facade's loop runs in its own thread),
    with ``testing.until``'s generous deadline."""
    deadline = time.monotonic() + DEFAULT_DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def in_flight(engine: FaultyEngine, op: str) -> None:
    """Wait until ``op`` is in flight on ``engine`` (sent, not answered)."""
    blocking_until(
        lambda: any(c["op"] == op and c["end"] is None for c in engine.calls), f"{op} to start"
    )


def facade_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("rollout-sync-")}


@pytest.fixture
def threads_left_behind() -> Iterator[Callable[[], set[threading.Thread]]]:
    """Threads started during the test that are still alive when it asks."""
    before = set(threading.enumerate())
    yield lambda: set(threading.enumerate()) - before


@pytest.fixture
def make() -> Iterator[Callable[..., SyncRolloutServer]]:
    """Facades over in-process simulated engines; every one is closed when the test ends."""
    made: list[SyncRolloutServer] = []

    def build(*groups: EngineGroup, **kw: Any) -> SyncRolloutServer:
        facade = SyncRolloutServer(list(groups) or [EngineGroup("actor", sims(2))], **kw)
        made.append(facade)
        return facade

    yield build
    for facade in made:
        facade.close()
    assert not facade_threads()


def test_a_colocated_step_runs_through_the_blocking_api(make: Any) -> None:
    engines = sims(3)
    rollout = make(EngineGroup("actor", engines), name="trainer-rollout")
    assert isinstance(rollout.server, RolloutServer) and rollout.name == "trainer-rollout"
    assert rollout.state is S.SERVING
    for step in range(1, 3):
        metrics = rollout.offload(timeout=T)
        assert rollout.state is S.RELEASED and "lifecycle/offload/total_s" in metrics
        rollout.onload_weights(timeout=T)
        assert rollout.state is S.WEIGHTS_RESTORED
        rollout.update_weights(FromDisk(f"/ckpt/{step}"), version=f"step-{step}", timeout=T)
        rollout.onload_kv(timeout=T)
        assert rollout.state is S.SERVING
    assert rollout.expected_version == "step-2"
    assert {"lifecycle/onload_kv/total_s", "lifecycle/update_weights/update_s"} <= set(
        rollout.metrics
    )
    assert [asyncio.run(e.weight_version()) for e in engines] == ["step-2"] * 3
    rollout.pause(timeout=T)
    assert rollout.state is S.DRAINED
    rollout.resume(timeout=T)
    rollout.offload(timeout=T)
    rollout.onload(timeout=T)  # weights, KV and continue in one call
    snapshot = rollout.snapshot()
    assert snapshot.state is S.SERVING and snapshot.name == "trainer-rollout"
    assert all(not e.paused and not e.released for e in snapshot.engines().values())
    assert all(o.ok for o in rollout.probe(timeout=T).values())
    assert repr(rollout) == "SyncRolloutServer('trainer-rollout', state='serving')"


def test_requests_in_flight_across_an_offload_complete(make: Any) -> None:
    engines = sims(2)
    rollout = make(EngineGroup("actor", engines))
    assert rollout.generate(request(0, 5), timeout=T)["output_ids"] == [
        *rollout.generate(request(0, 5), "actor", timeout=T)["output_ids"]
    ]
    answers: list[list[dict[str, Any]]] = []
    sender = threading.Thread(
        target=lambda: answers.append(
            rollout.generate_batch([request(i, 400) for i in range(8)], timeout=T)
        )
    )
    sender.start()
    # The offload meets requests decoding on every engine (400 tokens: about half a second).
    blocking_until(
        lambda: all(e.stats()["running"] >= 1 and e.stats()["tokens"] >= 1 for e in engines),
        "requests decoding on every engine",
    )
    rollout.offload(timeout=T)
    rollout.onload(timeout=T)
    sender.join(T)
    (batch,) = answers
    assert [len(a["output_ids"]) for a in batch] == [400] * 8
    assert all(a["meta_info"]["finish_reason"]["type"] == "length" for a in batch)
    assert sum(a["meta_info"]["num_retractions"] for a in batch) > 0  # retracted, not lost


def test_server_errors_propagate_with_their_types(make: Any) -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    rollout = make(EngineGroup("actor", engines))
    with pytest.raises(IllegalTransition) as illegal:
        rollout.onload_weights()
    assert illegal.value.state == "serving"
    assert illegal.value.allowed == ("released", "weights_restored")
    with pytest.raises(InvalidArgument, match="push must be callable"):
        rollout.update_weights("not a push")
    with pytest.raises(InvalidArgument, match="unknown event"):
        rollout.on("no_such_event", lambda event: None)
    with pytest.raises(InvalidArgument, match="timeout"):
        rollout.offload(timeout=0)
    with pytest.raises(InvalidArgument, match="unknown group"):
        rollout.generate(request(0), "no-such-group")

    refusal = RuntimeError("the trainer says no")

    def refuse(event: LifecycleEvent) -> None:
        raise refusal

    remove = rollout.on("before_release", refuse)
    with pytest.raises(HookFailed) as hook:
        rollout.offload(timeout=T)
    assert hook.value.__cause__ is refusal  # the very object the hook raised, in its thread
    assert rollout.state is S.DRAINED
    remove()
    rollout.resume(timeout=T)

    engines[1].arm("pause_generation", "reject")
    with pytest.raises(PhaseFailed) as failed:
        rollout.offload(timeout=T)
    assert failed.value.phase == "pause" and failed.value.failed_engines == ["actor/1"]
    assert rollout.state is S.FAILED
    assert rollout.reset(timeout=T) is S.SERVING  # the paused engines were continued

    rollout.offload(timeout=T)
    rollout.onload_weights(timeout=T)
    engines[0].arm("update_weights_from_disk", "reject")
    with pytest.raises(WeightPushFailed) as push:
        rollout.update_weights(FromDisk("/ckpt/1"), version="v1", timeout=T)
    assert list(push.value.failures) == ["actor/0"]
    with pytest.raises(StaleWeights) as stale:
        rollout.onload_kv(timeout=T)
    assert stale.value.engines == {"actor/0": "default"}
    rollout.update_weights(FromDisk("/ckpt/1"), version="v1", timeout=T)
    rollout.onload_kv(timeout=T)
    assert rollout.state is S.SERVING


def test_recover_replaces_a_dead_engine_through_a_sync_factory(make: Any) -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    rollout = make(EngineGroup("actor", engines))
    engines[0].arm("pause_generation", "die")
    with pytest.raises(PhaseFailed):
        rollout.offload(timeout=T)
    assert rollout.state is S.FAILED
    made_in: list[str] = []

    def factory(engine_id: str) -> SimulatedEngine:
        made_in.append(threading.current_thread().name)
        return SimulatedEngine(f"{engine_id}-new", token_latency=0.001)

    outcomes = rollout.recover(factory, timeout=T)
    assert all(o.ok for o in outcomes.values()) and "actor/0" in outcomes
    assert made_in == ["rollout-sync-rollout-worker"]
    assert rollout.state is S.SERVING
    assert rollout.snapshot().engines()["actor/0"].stale  # until it receives weights
    rollout.offload(timeout=T)
    rollout.onload_weights(timeout=T)
    rollout.update_weights(FromDisk("/ckpt/2"), version="v2", timeout=T)
    rollout.onload_kv(timeout=T)
    assert not rollout.snapshot().engines()["actor/0"].stale


def test_a_blocking_sync_push_runs_in_a_worker_thread_and_leaves_the_loop_free(
    make: Any,
) -> None:
    engines = sims(2)
    rollout = make(EngineGroup("actor", engines))
    seen: dict[str, Any] = {}
    pushing = threading.Event()
    reads: list[bool] = []

    def push(update: WeightUpdate) -> Any:
        seen["thread"] = threading.current_thread().name
        seen["state"] = rollout.state  # a call back into the facade, mid-update
        pushing.set()
        time.sleep(0.5)  # a blocking transfer: ray.get, a broadcast, a copy
        pushing.clear()
        return FromDisk("/ckpt/7")(update)  # an awaitable it returns is awaited on the loop

    def read_while_pushing() -> None:
        assert pushing.wait(T)
        rollout.snapshot()  # answered by the loop while the push blocks its own thread
        reads.append(pushing.is_set())

    reader = threading.Thread(target=read_while_pushing)
    rollout.offload(timeout=T)
    rollout.onload_weights(timeout=T)
    reader.start()
    rollout.update_weights(push, version="v7", timeout=T)
    reader.join(T)
    assert seen == {"thread": "rollout-sync-rollout-worker", "state": S.WEIGHTS_RESTORED}
    assert reads == [True]
    rollout.onload_kv(timeout=T)
    assert [asyncio.run(e.weight_version()) for e in engines] == ["v7", "v7"]


def test_hooks_that_call_back_into_the_facade_do_not_deadlock(make: Any) -> None:
    """Three levels: an offload's hook onloads weights, whose hook pushes, whose push reads."""
    engines = sims(2)
    rollout = make(EngineGroup("actor", engines))
    trail: list[str] = []

    def on_released(event: LifecycleEvent) -> None:
        trail.append(f"released hook sees {rollout.state.value}")
        rollout.onload_weights(timeout=T)

    def on_weights(event: LifecycleEvent) -> None:
        trail.append(f"weights hook sees {rollout.state.value}")
        rollout.update_weights(push, version="nested", timeout=T)

    def push(update: WeightUpdate) -> Any:
        trail.append(f"push sees {rollout.snapshot().state.value}")
        return FromDisk("/ckpt/nested")(update)

    def mid_transition(event: LifecycleEvent) -> None:
        # Inside the release phase (the state machine is mid-transition): reads still answer.
        trail.append(f"before_release sees {rollout.state.value}")

    rollout.on("before_release", mid_transition)
    remove_released = rollout.on("released", on_released)
    remove_weights = rollout.on("weights_restored", on_weights)
    rollout.offload(timeout=T)
    assert rollout.state is S.WEIGHTS_RESTORED
    assert trail == [
        "before_release sees drained",
        "released hook sees released",
        "weights hook sees weights_restored",
        "push sees weights_restored",
    ]
    remove_released()
    remove_weights()
    rollout.onload_kv(timeout=T)
    assert [asyncio.run(e.weight_version()) for e in engines] == ["nested", "nested"]

    # ROLL's pattern through the facade: the push is a hook of the offloaded() exit.
    pushes: list[str] = []

    def push_on_restore(event: LifecycleEvent) -> None:
        pushes.append(event.event)
        rollout.update_weights(FromDisk("/ckpt/roll"), version="roll", timeout=T)

    rollout.on("weights_restored", push_on_restore)
    with rollout.offloaded(timeout=T):
        assert rollout.state is S.RELEASED
    assert pushes == ["weights_restored"] and rollout.state is S.SERVING
    assert rollout.expected_version == "roll"


def test_a_hook_may_refuse_with_an_illegal_call_and_the_error_keeps_its_type(make: Any) -> None:
    rollout = make()

    def continue_too_early(event: LifecycleEvent) -> None:
        rollout.resume(timeout=T)  # KV is still released: refused

    rollout.offload(timeout=T)
    rollout.onload_weights(timeout=T)
    rollout.on("after_update_weights", continue_too_early)
    with pytest.raises(HookFailed) as hook:
        rollout.update_weights(FromDisk("/ckpt/1"), version="v1", timeout=T)
    assert isinstance(hook.value.__cause__, IllegalTransition)
    assert rollout.state is S.WEIGHTS_RESTORED


def test_calling_the_facade_from_its_own_loop_thread_raises(make: Any) -> None:
    rollout = make()
    on_loop: list[BaseException] = []

    async def async_hook(event: LifecycleEvent) -> None:
        try:
            rollout.snapshot()
        except CalledFromLoopThread as exc:
            on_loop.append(exc)
        rollout.offload()  # raises: the hook fails

    remove_async = rollout.on("drained", async_hook)
    with pytest.raises(HookFailed) as hook:
        rollout.pause(timeout=T)
    assert isinstance(hook.value.__cause__, CalledFromLoopThread)
    assert "event-loop thread" in str(hook.value.__cause__)
    assert len(on_loop) == 1
    assert rollout.state is S.DRAINED  # the server is unharmed
    remove_async()
    rollout.resume(timeout=T)

    async def close_from_loop(event: LifecycleEvent) -> None:
        rollout.close()

    remove = rollout.on("drained", close_from_loop)
    with pytest.raises(HookFailed) as closing:
        rollout.pause(timeout=T)
    assert isinstance(closing.value.__cause__, CalledFromLoopThread)
    remove()
    rollout.resume(timeout=T)

    def close_from_hook(event: LifecycleEvent) -> None:
        rollout.close()

    rollout.on("drained", close_from_hook)
    with pytest.raises(HookFailed) as worker:
        rollout.pause(timeout=T)
    assert isinstance(worker.value.__cause__, LifecycleError)
    assert "its own hooks" in str(worker.value.__cause__)
    assert not rollout.closed


CALLS: dict[str, Callable[[SyncRolloutServer], Any]] = {
    "offload": lambda r: r.offload(),
    "onload_weights": lambda r: r.onload_weights(),
    "update_weights": lambda r: r.update_weights(FromDisk("/x"), "v"),
    "onload_kv": lambda r: r.onload_kv(),
    "onload": lambda r: r.onload(),
    "pause": lambda r: r.pause(),
    "resume": lambda r: r.resume(),
    "recover": lambda r: r.recover(lambda engine_id: None),
    "reset": lambda r: r.reset(),
    "probe": lambda r: r.probe(),
    "generate": lambda r: r.generate(request(0)),
    "generate_batch": lambda r: r.generate_batch([request(0)]),
    "on": lambda r: r.on("serving", lambda event: None),
    "state": lambda r: r.state,
    "snapshot": lambda r: r.snapshot(),
    "metrics": lambda r: r.metrics,
    "expected_version": lambda r: r.expected_version,
    "server": lambda r: r.server,
    "paused": lambda r: r.paused().__enter__(),
    "offloaded": lambda r: r.offloaded().__enter__(),
}


def test_close_leaves_no_thread_and_every_call_then_raises(
    threads_left_behind: Callable[[], set[threading.Thread]],
) -> None:
    with SyncRolloutServer([EngineGroup("actor", sims(2))]) as rollout:
        remove = rollout.on("drained", lambda event: None)  # a hook ran in a worker thread
        rollout.pause(timeout=T)
        rollout.resume(timeout=T)
        rollout.generate(request(1), timeout=T)  # the generation client is closed too
        assert facade_threads()
    assert rollout.closed and repr(rollout) == "SyncRolloutServer('rollout', closed)"
    rollout.close()  # idempotent
    remove()  # a no-op once closed
    assert not threads_left_behind()
    for name, call in CALLS.items():
        with pytest.raises(SyncServerClosed, match="is closed") as closed:
            call(rollout)
        assert isinstance(closed.value, LifecycleError), name


def test_closing_during_a_call_settles_it_and_its_caller_hears_why(
    threads_left_behind: Callable[[], set[threading.Thread]],
) -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    engines[1].arm("release_memory_occupation", "slow", seconds=0.5)
    rollout = SyncRolloutServer([EngineGroup("actor", engines)])
    server = rollout.server
    errors: list[BaseException] = []

    def offload() -> None:
        try:
            rollout.offload()
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=offload)
    caller.start()
    in_flight(engines[1], "release_memory_occupation")
    rollout.close()
    caller.join(T)
    (error,) = errors
    assert isinstance(error, SyncServerClosed) and "while offload was running" in str(error)
    # The phase in flight was gathered before the call stopped: the state is exact.
    assert server.state is S.RELEASED
    assert all(
        e.released == ("weights", "kv_cache", "cuda_graph")
        for e in server.snapshot().engines().values()
    )
    assert not threads_left_behind()


def test_a_timeout_cancels_the_call_once_the_phase_in_flight_settles(make: Any) -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    rollout = make(EngineGroup("actor", engines))
    engines[0].arm("release_memory_occupation", "slow", seconds=0.4)
    start = time.monotonic()
    with pytest.raises(SyncCallTimeout) as timed_out:
        rollout.offload(timeout=0.1)
    took = time.monotonic() - start
    assert isinstance(timed_out.value, TimeoutError) and timed_out.value.call == "offload"
    assert took >= 0.35  # it waited for the release to land rather than abandon it
    assert rollout.state is S.RELEASED and timed_out.value.state == "released"
    rollout.onload(timeout=T)
    assert rollout.state is S.SERVING


def engines_whose_first_release_is_held() -> tuple[list[FaultyEngine], threading.Event]:
    """Two engines; the first one's release waits until the event is set (at most ``T``)."""
    engines = [FaultyEngine(e) for e in sims(2)]
    held = threading.Event()
    release = engines[0].inner.release_memory_occupation

    async def held_release(*args: Any, **kwargs: Any) -> Any:
        await asyncio.to_thread(held.wait, T)
        return await release(*args, **kwargs)

    engines[0].inner.release_memory_occupation = held_release  # type: ignore[method-assign]
    return engines, held


def test_an_interrupted_caller_gets_its_interrupt_after_the_call_settles(make: Any) -> None:
    """Ctrl-C during a release, then a second Ctrl-C while the call settles: the caller gets the
    first interrupt once the release has landed, never a server still moving. The release is
    held until both interrupts were handled. (A call past its timeout settles the same way:
    ``sync._settle``.)"""

    class Interrupt(BaseException):
        pass

    engines, held = engines_whose_first_release_is_held()
    handled: list[bool] = []  # per interrupt: whether the release was still in flight

    def interrupt(signum: int, frame: Any) -> None:
        handled.append(engines[0].in_flight > 0)
        raise Interrupt(len(handled))

    rollout = make(EngineGroup("actor", engines))
    main = threading.main_thread().ident or 0

    def interrupt_twice_during_release() -> None:
        in_flight(engines[0], "release_memory_occupation")
        for n in (1, 2):
            signal.pthread_kill(main, signal.SIGUSR1)
            blocking_until(lambda n=n: len(handled) == n, f"interrupt {n} to be handled")
        held.set()

    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=interrupt_twice_during_release)
    try:
        sender.start()
        with pytest.raises(Interrupt) as raised:
            rollout.offload(timeout=T)
        sender.join(T)
    finally:
        held.set()
        signal.signal(signal.SIGUSR1, previous)
    assert handled == [True, True] and raised.value.args == (1,)
    assert rollout.state is S.RELEASED  # settled, not left half-way
    rollout.onload(timeout=T)


@pytest.mark.parametrize("taken", [True, False], ids=["the-loop-took-it", "before-the-loop"])
def test_an_interrupt_during_the_hand_over_settles_the_call_before_it_is_raised(
    make: Any, taken: bool
) -> None:
    """Found under load: the loop may start a call before its hand-over returns to the caller,
    and a Ctrl-C can land in the hand-over. The caller gets it once the call has settled (here
    once the release it holds has landed); a call the loop never took never starts."""

    class Interrupt(BaseException):
        pass

    engines, held = engines_whose_first_release_is_held()
    rollout = make(EngineGroup("actor", engines))
    runtime = rollout._runtime
    hand_over = runtime.submit
    handed: list[Any] = []

    def interrupted_hand_over(pending: Any, call: Any, context: Any) -> None:
        if handed:  # (the offload's hand-over alone is interrupted)
            return hand_over(pending, call, context)
        handed.append(pending)
        if taken:
            hand_over(pending, call, context)
            in_flight(engines[0], "release_memory_occupation")
        raise Interrupt

    def release_once_cancelled() -> None:
        blocking_until(lambda: bool(handed) and handed[0].cancelled, "the call to be cancelled")
        held.set()

    runtime.submit = interrupted_hand_over
    helper = threading.Thread(target=release_once_cancelled)
    helper.start()
    try:
        with pytest.raises(Interrupt):
            rollout.offload(timeout=T)
        # settled when the caller got its interrupt: nothing in flight, nothing half-way
        assert engines[0].in_flight == 0
        assert rollout.state is (S.RELEASED if taken else S.SERVING)
    finally:
        held.set()
        helper.join(T)
        runtime.submit = hand_over
    assert handed[0].settled.result() == (True, None, None)  # cancelled
    if not taken:
        assert [c["op"] for c in engines[0].calls] == []  # it never started
    rollout.onload(timeout=T)
    assert rollout.state is S.SERVING


def test_a_sync_push_past_its_deadline_is_waited_for_before_the_call_fails(make: Any) -> None:
    config = LifecycleConfig(deadlines=Deadlines(weight_update=0.1))
    rollout = make(EngineGroup("actor", sims(2)), config=config)
    finished: list[float] = []

    def slow_push(update: WeightUpdate) -> None:
        time.sleep(0.4)
        finished.append(time.monotonic())

    rollout.pause(timeout=T)
    with pytest.raises(HookFailed) as hook:
        rollout.update_weights(slow_push, version="late", timeout=T)
    returned = time.monotonic()
    assert isinstance(hook.value.__cause__, asyncio.TimeoutError)
    assert finished and finished[0] <= returned  # never abandoned while still writing
    rollout.update_weights(lambda update: None, version="late", timeout=T)
    rollout.resume(timeout=T)


def test_sync_context_managers_restore_even_when_the_body_raises(make: Any) -> None:
    engines = sims(2)
    rollout = make(
        EngineGroup("actor", engines), EngineGroup("reward", sims(1, "r"), needs_offload=False)
    )
    with pytest.raises(ZeroDivisionError), rollout.offloaded(timeout=T) as inside:
        assert inside is rollout and rollout.state is S.RELEASED
        _ = 1 / 0
    assert rollout.state is S.SERVING
    with pytest.raises(KeyError), rollout.paused(timeout=T):
        assert rollout.state is S.DRAINED
        rollout.update_weights(FromDisk("/ckpt/p"), version="p", timeout=T)
        raise KeyError("body")
    assert rollout.state is S.SERVING
    assert rollout.expected_version == "p"


def test_wrap_builds_the_server_on_the_loop_thread(
    threads_left_behind: Callable[[], set[threading.Thread]],
) -> None:
    built_in: list[str] = []

    def factory() -> RolloutServer:
        built_in.append(threading.current_thread().name)
        return RolloutServer([EngineGroup("actor", sims(1))], name="wrapped")

    async def async_factory() -> RolloutServer:
        return factory()

    for make_server in (factory, async_factory):
        with SyncRolloutServer.wrap(make_server) as rollout:
            assert rollout.name == "wrapped"
            rollout.offload(timeout=T)
            rollout.onload(timeout=T)
    assert built_in == ["rollout-sync-rollout", "rollout-sync-rollout"]

    with pytest.raises(InvalidArgument, match="callable returning a RolloutServer"):
        SyncRolloutServer.wrap(RolloutServer([EngineGroup("actor", sims(1))]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not a RolloutServer"):
        SyncRolloutServer.wrap(lambda: "a server")
    with pytest.raises(InvalidArgument, match="at least one EngineGroup"):
        SyncRolloutServer([])
    assert not threads_left_behind()  # a failed start joins its loop thread


def test_closing_while_a_hook_calls_back_never_interrupts_the_nested_phase(
    threads_left_behind: Callable[[], set[threading.Thread]],
) -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    engines[0].arm("resume_memory_occupation", "slow", seconds=0.4)
    rollout = SyncRolloutServer([EngineGroup("actor", engines)])
    server = rollout.server
    rollout.on("released", lambda event: rollout.onload_weights())
    errors: list[BaseException] = []

    def offload() -> None:
        try:
            rollout.offload()
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=offload)
    caller.start()
    in_flight(engines[0], "resume_memory_occupation")  # the hook's onload_weights
    rollout.close()
    caller.join(T)
    assert [type(e) for e in errors] == [SyncServerClosed]
    # The nested resume was gathered, not cancelled half-way: records match the engines.
    assert server.state is S.WEIGHTS_RESTORED
    for record in server.snapshot().engines().values():
        assert record.released == ("kv_cache", "cuda_graph") and not record.uncertain
    assert [e.memory()["weights"] > 0 for e in engines] == [True, True]
    assert not threads_left_behind()


def test_a_nested_call_is_bounded_by_its_operation_not_its_own_timeout(make: Any) -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    rollout = make(EngineGroup("actor", engines))
    engines[1].arm("resume_memory_occupation", "slow", seconds=0.3)
    rollout.on("released", lambda event: rollout.onload_weights(timeout=0.05))
    rollout.offload(timeout=T)  # the hook's call outlived 0.05 s and still completed
    assert rollout.state is S.WEIGHTS_RESTORED
    engines[0].arm("resume_memory_occupation", "slow", seconds=0.3)
    with pytest.raises(SyncCallTimeout):  # a top-level call's timeout does apply
        rollout.onload_kv(timeout=0.05)
    assert rollout.state is S.KV_RESTORED  # the KV came back; continue was not sent
    rollout.resume(timeout=T)


def test_async_hooks_run_on_the_loop_and_sync_ones_in_workers(make: Any) -> None:
    rollout = make()
    where: list[tuple[str, str]] = []

    async def on_loop(event: LifecycleEvent) -> None:
        where.append(("async", threading.current_thread().name))
        assert event.server is rollout.server

    rollout.on("drained", on_loop)
    rollout.on("drained", lambda event: where.append(("sync", threading.current_thread().name)))
    rollout.pause(timeout=T)
    rollout.resume(timeout=T)
    assert where == [("async", "rollout-sync-rollout"), ("sync", "rollout-sync-rollout-worker")]


def test_system_exit_in_a_sync_hook_is_hook_failed_and_the_loop_survives(make: Any) -> None:
    rollout = make()
    remove = rollout.on("drained", lambda event: sys.exit(3))
    with pytest.raises(HookFailed) as failed:
        rollout.pause(timeout=T)
    assert isinstance(failed.value.__cause__, SystemExit)
    remove()
    assert rollout.state is S.DRAINED
    rollout.resume(timeout=T)
    rollout.offload(timeout=T)
    rollout.onload(timeout=T)
    assert rollout.state is S.SERVING
