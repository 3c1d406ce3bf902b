"""One call at a time (``core/scope.py``) on its own: the serializer runs public calls in turn,
reports each to its observer with its outcome, refuses a call before its body runs, holds the
engines' claim for the whole call, and never lets a cancelled caller go before its call has
settled; a call made from user code while it runs is part of the call in progress.

``tests/core/test_reentrancy.py`` shows, through a server, which calls user code may make from
where; here the serializer is driven directly, with bodies that stand in for a call's phases.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import pytest
from structlog.testing import capture_logs

from rollout_lifecycle.contract.exceptions import IllegalTransition, InvalidArgument
from rollout_lifecycle.core.scope import (
    CURRENT,
    LIFECYCLE_CALLS,
    HookCancelled,
    Operation,
    Scope,
    Serializer,
    cancel,
    current,
)
from rollout_lifecycle.core.states import CALLS
from rollout_lifecycle.testing.waits import until

#: An outer bound on every wait: a regression that hangs fails the test instead.
BOUND = 30.0


class Observer:
    """Records what the serializer reports of each call it runs under the lock."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def begin(self, op: Operation) -> None:
        self.seen.append(f"begin {op.call}")

    async def end(self, op: Operation, outcome: str) -> None:
        self.seen.append(f"end {op.call} {outcome}")

    def refused(self, op: Operation, error: Exception) -> None:
        self.seen.append(f"refused {op.call}")


class CountingLock(asyncio.Lock):
    """The server's lock, counting the calls that have come to take it."""

    tries = 0

    async def acquire(self) -> Literal[True]:
        self.tries += 1
        return await super().acquire()


class Rig:
    """A serializer for a stand-in server; ``log`` is what the bodies did, in order."""

    def __init__(self, *, claim: Callable[[str], Awaitable[Callable[[], None]]] | None = None):
        self.owner = object()
        self.observer = Observer()
        self.refused: set[str] = set()
        self.serializer = Serializer(self.owner, "scope-test", self.observer, self.check, claim)
        self.lock = self.serializer.lock = CountingLock()
        self.log: list[str] = []

    def check(self, call: str) -> None:
        if call in self.refused:
            raise InvalidArgument(f"{call} refused: a group has no live engine")

    def op(self) -> Operation:
        """The operation the current task runs in."""
        found = current(self.owner)
        assert found is not None, "not inside a call of this server"
        return found[0]

    def body(self, name: str, gate: asyncio.Event | None = None) -> Callable[[], Awaitable[None]]:
        """A call's body: logs its start, waits for ``gate`` (a phase in flight), logs its end."""

        async def run() -> None:
            self.log.append(f"{name} started")
            if gate is not None:
                await gate.wait()
            self.log.append(f"{name} ended")

        return run


@contextmanager
def user_code(rig: Rig, scope: Scope) -> Iterator[None]:
    """Run the block as user code that the current call of ``rig``'s server runs in ``scope``
    (what ``Hooks.run_user`` sets up)."""
    token = CURRENT.set((rig.owner, rig.op(), scope))
    try:
        yield
    finally:
        CURRENT.reset(token)


def test_the_lifecycle_calls_are_the_table_s_calls_and_those_that_change_engines() -> None:
    changing = {"recover", "add_engines", "remove_engines"}
    assert frozenset({*CALLS, *changing}) == LIFECYCLE_CALLS
    assert not {"sync_router", "probe", "snapshot", "state"} & LIFECYCLE_CALLS


async def test_calls_run_one_at_a_time_in_the_order_they_came() -> None:
    rig = Rig()
    gate = asyncio.Event()
    first = asyncio.ensure_future(rig.serializer.run("offload", rig.body("offload", gate)))
    await until(lambda: rig.log == ["offload started"], what="the first call to start")
    others = [
        asyncio.ensure_future(rig.serializer.run(call, rig.body(call)))
        for call in ("onload_weights", "onload_kv")
    ]
    await until(
        lambda: rig.lock.tries == 3 or len(rig.log) > 1,
        what="the other calls to wait for the lock (or to start)",
    )
    assert rig.log == ["offload started"]
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, *others), BOUND)
    assert rig.log == [
        "offload started",
        "offload ended",
        "onload_weights started",
        "onload_weights ended",
        "onload_kv started",
        "onload_kv ended",
    ]
    assert rig.observer.seen == [
        "begin offload",
        "end offload ok",
        "begin onload_weights",
        "end onload_weights ok",
        "begin onload_kv",
        "end onload_kv ok",
    ]


async def test_a_call_returns_its_metrics_and_the_observer_sees_its_outcome() -> None:
    rig = Rig()

    async def measured() -> None:
        rig.op().metrics["lifecycle/offload/total_s"] = 1.5

    async def broken() -> None:
        raise ValueError("a phase broke")

    async def interrupted() -> None:
        raise HookCancelled("drained", "hook", "drained", "was cancelled")

    metrics = await rig.serializer.run("offload", measured)
    assert metrics == {"lifecycle/offload/total_s": 1.5}
    with pytest.raises(ValueError, match="a phase broke"):
        await rig.serializer.run("onload", broken)
    # user code cancelled with its call: the caller sees a cancellation, not the hook's error
    with pytest.raises(asyncio.CancelledError):
        await rig.serializer.run("pause", interrupted)
    assert rig.observer.seen == [
        "begin offload",
        "end offload ok",
        "begin onload",
        "end onload error",
        "begin pause",
        "end pause cancelled",
    ]


async def test_a_refused_call_runs_nothing_and_the_next_call_goes_on() -> None:
    rig = Rig()
    rig.refused.add("offload")
    with pytest.raises(InvalidArgument, match="offload refused"):
        await asyncio.wait_for(rig.serializer.run("offload", rig.body("offload")), BOUND)
    await asyncio.wait_for(rig.serializer.run("resume", rig.body("resume")), BOUND)
    assert rig.log == ["resume started", "resume ended"]
    assert rig.observer.seen == [
        "begin offload",
        "end offload error",
        "begin resume",
        "end resume ok",
    ]


async def test_the_engines_are_claimed_for_the_whole_call_and_given_back_however_it_ends() -> None:
    log: list[str] = []
    refuse = {"pause"}

    async def claim(call: str) -> Callable[[], None]:
        if call in refuse:
            raise InvalidArgument(f"{call}: another controller holds the engines")
        log.append(f"claim {call}")
        return lambda: log.append(f"release {call}")

    rig = Rig(claim=claim)
    rig.log = log

    async def broken() -> None:
        log.append("onload started")
        raise ValueError("a phase broke")

    await rig.serializer.run("offload", rig.body("offload"))
    with pytest.raises(ValueError):
        await rig.serializer.run("onload", broken)
    with pytest.raises(InvalidArgument, match="another controller"):
        await rig.serializer.run("pause", rig.body("pause"))
    assert log == [
        "claim offload",
        "offload started",
        "offload ended",
        "release offload",
        "claim onload",
        "onload started",
        "release onload",
    ]
    assert "begin pause" not in rig.observer.seen  # refused before it began
    assert not rig.serializer.lock.locked()


async def test_a_cancelled_caller_is_let_go_only_once_its_call_has_settled() -> None:
    rig = Rig()
    phase = asyncio.Event()
    ops: list[Operation] = []

    async def offload() -> None:
        ops.append(rig.op())
        rig.log.append("phase sent")
        await phase.wait()  # shielded: the caller's cancellation does not interrupt it
        rig.log.append("phase settled")
        if rig.op().cancelled:  # the next boundary: the call stops here
            raise asyncio.CancelledError("stopped at the boundary")
        rig.log.append("next phase sent")

    caller = asyncio.ensure_future(rig.serializer.run("offload", offload))
    await until(lambda: rig.log == ["phase sent"], what="the phase to be sent")
    caller.cancel()
    await until(lambda: ops[0].cancelled, what="the call to be asked to stop")
    assert not caller.done()  # still waiting for the phase in flight
    phase.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, BOUND)
    assert rig.log == ["phase sent", "phase settled"]
    assert rig.observer.seen == ["begin offload", "end offload cancelled"]


async def test_an_error_a_cancelled_call_ends_with_is_logged_and_the_caller_sees_the_cancel() -> (
    None
):
    rig = Rig()
    phase = asyncio.Event()

    ops: list[Operation] = []

    async def offload() -> None:
        ops.append(rig.op())
        rig.log.append("phase sent")
        await phase.wait()
        raise RuntimeError("the phase failed as it settled")

    caller = asyncio.ensure_future(rig.serializer.run("offload", offload))
    await until(lambda: rig.log == ["phase sent"], what="the phase to be sent")
    with capture_logs() as logs:
        caller.cancel()
        await until(lambda: ops[0].cancelled, what="the call to be asked to stop")
        phase.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(caller, BOUND)
    (event,) = [e for e in logs if e["event"] == "call.cancelled_with_error"]
    assert event["call"] == "offload" and event["server"] == "scope-test"
    assert event["error"] == "the phase failed as it settled"


async def test_a_call_cancelled_while_it_waits_for_the_lock_never_runs() -> None:
    rig = Rig()
    gate = asyncio.Event()
    waiting: list[asyncio.Future[Any]] = []

    async def offload() -> None:
        rig.log.append("offload started")
        await gate.wait()
        rig.log.append(f"offload ended, the waiting call done: {waiting[0].done()}")

    first = asyncio.ensure_future(rig.serializer.run("offload", offload))
    await until(lambda: rig.log == ["offload started"], what="the first call to start")
    waiting.append(asyncio.ensure_future(rig.serializer.run("resume", rig.body("resume"))))
    await until(lambda: rig.lock.tries == 2, what="the second call to wait for the lock")
    waiting[0].cancel()
    gate.set()
    await asyncio.wait_for(first, BOUND)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting[0], BOUND)
    assert rig.log == ["offload started", "offload ended, the waiting call done: False"]
    assert rig.observer.seen == ["begin offload", "end offload ok"]


async def test_a_call_from_user_code_runs_inline_in_the_call_and_shares_its_metrics() -> None:
    rig = Rig()
    nested: list[str] = []

    async def weights_restored_hook_calls_update() -> None:
        nested.append(rig.op().call)
        rig.op().metrics["lifecycle/update_weights/total_s"] = 2.0

    async def onload() -> None:
        rig.op().metrics["lifecycle/onload/total_s"] = 3.0
        with user_code(rig, Scope(state="weights_restored")):
            # the outer call holds the lock: a call that waited for it would never run
            inline = await asyncio.wait_for(
                rig.serializer.run("update_weights", weights_restored_hook_calls_update), BOUND
            )
        assert inline == {}  # the outer call reports the metrics
        nested.append(rig.op().call)

    metrics = await rig.serializer.run("onload", onload)
    assert nested == ["update_weights", "onload"]
    assert metrics == {"lifecycle/onload/total_s": 3.0, "lifecycle/update_weights/total_s": 2.0}
    assert rig.observer.seen == ["begin onload", "end onload ok"]  # one call, not two


async def test_calls_user_code_makes_at_once_run_inline_one_at_a_time() -> None:
    rig = Rig()

    async def nested(name: str) -> None:
        rig.log.append(f"{name} started")
        await asyncio.sleep(0)  # a yield point (not a wait): the other call could start here
        rig.log.append(f"{name} ended")

    async def offload() -> None:
        with user_code(rig, Scope(state="released")):
            calls = [
                rig.serializer.run(c, functools.partial(nested, c)) for c in ("probe", "snapshot")
            ]
            await asyncio.wait_for(asyncio.gather(*calls), BOUND)

    await rig.serializer.run("offload", offload)
    assert rig.log == ["probe started", "probe ended", "snapshot started", "snapshot ended"]


async def test_a_refusing_scope_refuses_only_lifecycle_calls_naming_why() -> None:
    rig = Rig()
    why = "it was called from hook h for event 'before_release', which runs inside a transition"

    async def release() -> None:
        with user_code(rig, Scope(refuse=why, state="drained")):
            for call in ("offload", "recover"):
                with pytest.raises(IllegalTransition) as refused:
                    await rig.serializer.run(call, rig.body(call))
                assert (refused.value.call, refused.value.state) == (call, "drained")
                assert refused.value.reason == why and why in str(refused.value)
            await asyncio.wait_for(rig.serializer.run("sync_router", rig.body("sync")), BOUND)

    await rig.serializer.run("offload", release)
    assert rig.log == ["sync started", "sync ended"]


async def test_user_code_no_longer_running_makes_calls_of_its_own() -> None:
    rig = Rig()
    finished = asyncio.ensure_future(asyncio.sleep(0))
    await finished
    assert Scope().open and not Scope(closed=True).open and not Scope(task=finished).open
    left: list[asyncio.Future[Any]] = []

    async def offload() -> None:
        with user_code(rig, Scope(task=finished)):  # its task is done: it has returned
            left.append(asyncio.ensure_future(rig.serializer.run("onload", rig.body("onload"))))
        await until(
            lambda: rig.lock.tries == 2 or "onload started" in rig.log,
            what="the left-behind call to wait for the lock (or to run)",
        )
        rig.log.append("offload ended")

    await rig.serializer.run("offload", offload)
    await asyncio.wait_for(left[0], BOUND)
    assert rig.log == ["offload ended", "onload started", "onload ended"]
    assert rig.observer.seen == ["begin offload", "end offload ok", "begin onload", "end onload ok"]


async def test_a_call_to_another_server_from_user_code_is_not_part_of_this_call() -> None:
    rig, other = Rig(), Rig()

    async def offload() -> None:
        with user_code(rig, Scope(state="released")):
            assert current(other.owner) is None
            await asyncio.wait_for(other.serializer.run("pause", other.body("pause")), BOUND)

    await rig.serializer.run("offload", offload)
    # the other server ran it as a call of its own, under its own lock
    assert other.observer.seen == ["begin pause", "end pause ok"]
    assert rig.observer.seen == ["begin offload", "end offload ok"]


async def test_cancel_asks_the_operation_to_stop_and_cancels_the_user_code_it_waits_for() -> None:
    op = Operation("offload")
    hook = asyncio.ensure_future(asyncio.Event().wait())
    op.running.add(hook)
    cancel(op)
    assert op.cancelled
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(hook, BOUND)
