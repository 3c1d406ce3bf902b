"""The router binding (``core/router_sync.py``) against a router kept in a list: workers are
taken out before a pause is sent and put back if that is refused, the binding looks again only
after the phases and state changes that can change who serves, a router out of step fails a
call only while engines serve, and the binding touches only the workers it owns, whatever
spelling of their address the router keeps.

Which engines the binding registers (the ``Fleet.serves`` predicate, in every state) is
``test_serves.py``'s; the binding behind a real sglang-router is ``tests/system/test_router.py``
and ``test_router_ownership.py``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest
from core.loopback import loopback, port
from structlog.testing import capture_logs

from rollout_lifecycle import (
    EngineGroup,
    RolloutServer,
    RouterError,
    ServerState,
    SimulatedEngine,
)
from rollout_lifecycle.contract.commands import EngineCommand
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.bus import StateEntered
from rollout_lifecycle.core.router_sync import RouterSync
from rollout_lifecycle.core.runner import PhaseResult, Plan

S = ServerState
A, B, C = loopback(1), loopback(2), loopback(3)
FOREIGN = "http://other-team.test:9"


class AtURL(SimulatedEngine):
    """A simulated engine with an address, so a router can list it."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(token_latency=0.001, **options)
        self.url = url

    def received(self, op: str) -> bool:
        return any(e["op"] == op for e in self.history())

    def count(self, op: str) -> int:
        return sum(1 for e in self.history() if e["op"] == op)


class Worker:
    def __init__(self, url: str, worker_type: str = "regular") -> None:
        self.url = url
        self.worker_type = worker_type


class ListRouter:
    """A router that keeps its workers in a list (in the spelling each was added with) and a
    log of the calls it received; finds a worker by address as sglang-router's client does."""

    url = "http://router.test:1"

    def __init__(self, listed: Sequence[str] = (), engines: Sequence[AtURL] = ()) -> None:
        self.listed = list(listed)
        #: The type and bootstrap port each listed worker was registered with.
        self.types: dict[str, tuple[str, int | None]] = {}
        self.calls: list[tuple[str, str]] = []
        #: What it listed each time a binding looked (what the last sync, or call, left).
        self.looked: list[frozenset[str]] = []
        self._engines = {url_identity(e.url): e for e in engines}
        #: Per removal: whether its engine had been sent a pause by then.
        self.paused_when_removed: dict[str, bool] = {}
        #: Addresses whose removal is refused.
        self.refuse_removal: set[str] = set()
        #: Whether listing the workers fails (the router cannot be reached).
        self.listing_fails = False

    async def workers(self) -> Sequence[Worker]:
        self.calls.append(("workers", ""))
        self.looked.append(frozenset(self.listed))
        if self.listing_fails:
            raise RouterError(self.url, "GET /workers: unreachable")
        return [Worker(u, self.types.get(u, ("regular", None))[0]) for u in self.listed]

    async def add(
        self, url: str, *, worker_type: str = "regular", bootstrap_port: int | None = None
    ) -> None:
        self.calls.append(("add", url))
        self.listed.append(url)
        self.types[url] = (worker_type, bootstrap_port)

    async def remove(self, url: str) -> None:
        self.calls.append(("remove", url))
        key = url_identity(url)
        if key in {url_identity(u) for u in self.refuse_removal}:
            raise RouterError(self.url, f"DELETE {url}: 503", 503)
        engine = self._engines.get(key)
        if engine is not None:
            self.paused_when_removed[url] = engine.received("pause_generation")
        self.listed = [u for u in self.listed if url_identity(u) != key]

    def count(self, call: str) -> int:
        return sum(1 for name, _ in self.calls if name == call)


def binding(server: RolloutServer) -> RouterSync:
    sync = server._router
    assert sync is not None
    return sync


async def keepers_paused_around_a_write(
    refuse: str | None = None,
) -> tuple[RolloutServer, ListRouter, list[AtURL]]:
    """A server whose memory-keeping group (at ``B`` and ``C``) is paused around a weight
    write in ``weights_restored``: a pause that changes no state, so only the binding's check
    before the pause takes their workers out. The removal at ``refuse`` is refused."""
    keepers = [AtURL(B), AtURL(C)]
    router = ListRouter(engines=keepers)
    groups = [
        EngineGroup("actor", [AtURL(A)]),
        EngineGroup("ref", keepers, needs_offload=False),
    ]
    server = RolloutServer(groups, router=router)
    await server.sync_router()
    await server.offload()
    await server.onload_weights()
    assert sorted(router.listed) == [B, C]
    router.calls.clear()
    router.refuse_removal = {refuse} if refuse else set()
    return server, router, keepers


async def test_a_pause_is_sent_only_once_its_engines_are_out_of_the_router() -> None:
    server, router, keepers = await keepers_paused_around_a_write()
    listed: list[list[str]] = []
    await server.update_weights(lambda update: listed.append(list(router.listed)))
    assert router.paused_when_removed == {B: False, C: False}
    assert all(e.received("pause_generation") for e in keepers)
    assert listed == [[]]  # out while their weights were written
    assert sorted(router.listed) == [B, C]  # and back once continued
    assert server.state is S.WEIGHTS_RESTORED


async def test_a_refused_removal_sends_no_pause_and_puts_back_what_was_taken_out() -> None:
    server, router, keepers = await keepers_paused_around_a_write(refuse=C)
    with pytest.raises(RouterError, match="503"):
        await server.update_weights(lambda update: None)
    assert server.state is S.WEIGHTS_RESTORED
    assert not any(e.received("pause_generation") for e in keepers)
    assert sorted(router.listed) == [B, C]  # B was taken out, then registered again
    assert router.calls.index(("remove", B)) < router.calls.index(("add", B))
    assert binding(server).failure is None  # in step again: nothing to raise later


def command_of(op: Op) -> EngineCommand:
    """A command of ``op`` with no arguments (what the binding reads of a plan is its op)."""
    kind = type(f"Bare{op.name}", (EngineCommand,), {"op": op, "__slots__": ()})
    return cast(EngineCommand, kind())


async def test_the_router_is_looked_at_only_after_phases_that_may_change_who_serves() -> None:
    router = ListRouter()
    server = RolloutServer([EngineGroup("actor", [AtURL(A)])], router=router)
    targets = tuple(server.fleet.records())
    ok = {r.id: EngineOutcome(Outcome.OK) for r in targets}
    missed = {r.id: EngineOutcome(Outcome.TIMED_OUT, "no answer") for r in targets}
    for op in Op:
        router.calls.clear()
        await binding(server).after(
            Plan(command_of(op), targets), PhaseResult(op.value, ok, 0.0, 0.0)
        )
        changes_who_serves = op in (Op.PAUSE, Op.CONTINUE, Op.SERVER_INFO, Op.OBSERVE)
        assert router.count("workers") == int(changes_who_serves), op
        # any phase in which a call did not succeed may have found an engine dead
        await binding(server).after(
            Plan(command_of(op), targets), PhaseResult(op.value, missed, 0.0, 0.0)
        )
        assert router.count("workers") == int(changes_who_serves) + 1, op


@pytest.mark.parametrize(
    ("previous", "state", "looks"),
    [
        (S.SERVING, S.PAUSING, True),  # the offloading group stops serving
        (S.KV_RESTORED, S.SERVING, True),  # it serves again
        (S.PAUSING, S.FAILED, True),  # in failed, the records decide
        (S.PAUSING, S.DRAINED, False),
        (S.DRAINED, S.RELEASED, False),  # the memory-keeping group serves throughout
        (S.SERVING, S.FAILED, False),
    ],
)
async def test_a_state_change_is_followed_only_when_it_changes_which_groups_may_serve(
    previous: ServerState, state: ServerState, looks: bool
) -> None:
    router = ListRouter()
    groups = [
        EngineGroup("actor", [AtURL(A)]),
        EngineGroup("ref", [AtURL(B)], needs_offload=False),
    ]
    server = RolloutServer(groups, router=router)
    await binding(server).entered(StateEntered(state, previous))
    assert router.count("workers") == int(looks)
    # a fleet of groups that keep their memory is never let serve or held by a state
    keepers = ListRouter()
    only = RolloutServer([EngineGroup("ref", [AtURL(B)], needs_offload=False)], router=keepers)
    await binding(only).entered(StateEntered(state, previous))
    assert keepers.calls == []


@pytest.mark.looptime
async def test_a_serving_engine_whose_worker_url_is_unread_is_named_not_passed_over() -> None:
    # An engine that does not answer the read of its address (an actor whose process has not
    # started yet) cannot be registered: the sync lists the rest, then says which one and why.
    engines = [AtURL(A), AtURL(B)]
    router = ListRouter(engines=engines)
    server = RolloutServer([EngineGroup("actor", engines)], router=router)
    late = server.fleet.records()[1]

    async def unanswered() -> str | None:
        await asyncio.Event().wait()  # past deadlines.probe (virtual time)
        return B

    late.handle.worker_url = unanswered
    with pytest.raises(RouterError, match=rf"\['{late.id}'\] serve but did not answer"):
        await server.sync_router()
    assert router.listed == [A]
    await server.pause()  # paused, it is not expected in the router: in step again
    assert binding(server).failure is None
    with pytest.raises(RouterError, match="did not answer the read of their worker URL"):
        await server.resume()  # it serves again, still unlisted: the call says so
    assert server.state is S.SERVING and router.listed == [A]
    del late.handle.worker_url  # it answers now
    assert await server.sync_router() == {"added": [B], "removed": []}
    assert binding(server).failure is None and sorted(router.listed) == [A, B]


async def test_a_router_out_of_step_fails_no_call_while_no_engine_serves() -> None:
    engines = [AtURL(A), AtURL(B)]
    router = ListRouter(engines=engines)
    with capture_logs() as logs:  # (from the start: the binding binds its logger when made)
        server = RolloutServer([EngineGroup("actor", engines)], router=router)
        await server.sync_router()
        router.listing_fails = True
        await server.pause()  # the workers are taken out; the checks after cannot list
    assert server.state is S.DRAINED and router.listed == []
    assert isinstance(binding(server).failure, RouterError)
    assert "router.out_of_step" in [e["event"] for e in logs]
    router.listing_fails = False
    await server.resume()  # in step again: the engines serve and are listed
    assert binding(server).failure is None
    assert sorted(router.listed) == [A, B]


async def test_an_offload_that_leaves_keepers_serving_behind_a_router_out_of_step_raises() -> None:
    # Every call that ends with engines serving while the router is out of step raises it,
    # the offload too (its groups that keep their memory serve on): not the next call.
    keepers = [AtURL(B)]
    router = ListRouter(engines=keepers)
    groups = [EngineGroup("actor", [AtURL(A)]), EngineGroup("ref", keepers, needs_offload=False)]
    server = RolloutServer(groups, router=router)
    await server.sync_router()
    router.listing_fails = True
    with pytest.raises(RouterError):
        await server.offload()
    assert server.state is S.RELEASED  # the offload itself completed
    router.listing_fails = False
    await server.sync_router()  # as the error says: in step again
    assert binding(server).failure is None and router.listed == [B]
    await server.onload_weights()


async def test_a_worker_listed_under_another_spelling_of_an_engines_address_is_its_own() -> None:
    spelled = [f"http://localhost:{port(1)}/", f"http://LOCALHOST:{port(2)}"]
    router = ListRouter(listed=spelled)
    server = RolloutServer([EngineGroup("actor", [AtURL(A), AtURL(B)])], router=router)
    assert await server.sync_router() == {"added": [], "removed": []}
    first, _ = server.fleet.records()
    first.paused = True  # (as a pause left it)
    assert await server.sync_router() == {"added": [], "removed": [spelled[0]]}
    assert router.listed == [spelled[1]]


async def test_a_worker_the_binding_does_not_own_is_never_touched() -> None:
    engines = [AtURL(A), AtURL(B)]
    router = ListRouter(listed=[FOREIGN], engines=engines)
    server = RolloutServer([EngineGroup("actor", engines)], router=router)
    await server.sync_router()
    await server.offload()
    assert router.listed == [FOREIGN]
    await server.onload()
    await server.pause()
    await server.resume()
    assert await server.sync_router() == {"added": [], "removed": []}
    assert sorted(router.listed) == sorted([FOREIGN, A, B])
    assert ("remove", FOREIGN) not in router.calls


async def test_a_joining_engine_is_listed_once_it_serves_a_leaving_one_out_before_its_pause() -> (
    None
):
    """An engine that joins a serving fleet waits paused for the weights: the router does not
    list it until a push has reached it and it serves. An engine that leaves is taken out of
    the router before the pause that drains it is sent."""
    engines = [AtURL(A), AtURL(B)]
    joining = AtURL(C)
    router = ListRouter(engines=[*engines, joining])
    server = RolloutServer([EngineGroup("actor", engines)], router=router)
    await server.sync_router()
    assert sorted(router.listed) == [A, B]
    await server.add_engines("actor", [joining])
    assert sorted(router.listed) == [A, B]  # (stale: it waits paused)
    await server.offload()
    await server.onload_weights()
    await server.update_weights(lambda update: None, "v1")
    await server.onload_kv()
    assert sorted(router.listed) == [A, B, C]
    pauses = engines[0].count("pause_generation")
    seen: dict[str, int] = {}
    take_out = router.remove

    async def remove(url: str) -> None:
        seen[url] = engines[0].count("pause_generation")
        await take_out(url)

    router.remove = remove  # type: ignore[method-assign]
    await server.remove_engines(["actor/0"])
    assert sorted(router.listed) == [B, C]
    assert seen[A] == pauses  # (out of the router before the pause that drains it)
    assert engines[0].count("pause_generation") == pauses + 2  # (the leave's, the stop's)
