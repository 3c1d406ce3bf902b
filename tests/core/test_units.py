"""Units of several servers (``EngineGroup(unit=N)``): servers that live, serve and are replaced
together. A unit serves to the generation client and the router only while every member serves;
a member whose mate died (or holds tags in an unknown state) is never continued, and the whole
unit is named unhealthy; ``recover(unit_factory=...)`` replaces it whole (the members that still
lived retired), never one member; a verified write fails every member of a unit where one fails.

The fleets are simulated engines in process, with addresses a list-keeping router lists; what
reached each engine is read from its history, what the router listed from its log of calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from core.test_serves import AtURL, ListRouter

from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    IllegalEngineOp,
    InvalidArgument,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
)
from rollout_lifecycle.contract.fingerprint import Fingerprint
from rollout_lifecycle.core.verify import Verification, judge
from rollout_lifecycle.testing.fleets import READS
from rollout_lifecycle.testing.fleets import received_ops as ops

S = ServerState
UNIT = 2
#: Two units of two servers: pd/0-1 and pd/2-3.
URLS = [f"http://127.0.0.1:{31100 + i}" for i in range(2 * UNIT)]


class WatchedRouter(ListRouter):
    """A router that keeps its workers in a list, and what it listed whenever a binding looked
    (before each sync: what the last one left)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[frozenset[str]] = []

    async def workers(self) -> Sequence[Any]:
        self.history.append(frozenset(self.urls))
        return await super().workers()


def half_units(router: WatchedRouter, units: Sequence[Sequence[str]]) -> list[frozenset[str]]:
    """The sets the router listed between the binding's syncs (each sync adds a unit's
    members together and takes them out together), and now, that held some but not all
    members of a unit."""
    return [
        listed
        for listed in [*router.history, frozenset(router.urls)]
        if any(0 < len(listed & set(members)) < len(members) for members in units)
    ]


class UnitFactory:
    """Makes a fresh unit at new addresses; records what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, ...]] = []
        self.made: list[AtURL] = []

    def __call__(self, ids: tuple[str, ...]) -> list[AtURL]:
        self.asked.append(ids)
        made = [AtURL(f"http://127.0.0.1:{31200 + len(self.made) + i}") for i in range(len(ids))]
        self.made += made
        return made


def fleet() -> tuple[RolloutServer, list[AtURL], WatchedRouter]:
    engines = [AtURL(u) for u in URLS]
    router = WatchedRouter()
    server = RolloutServer([EngineGroup("pd", engines, unit=UNIT)], router=router)
    return server, engines, router


def test_a_group_must_hold_whole_units() -> None:
    engines = [AtURL(u) for u in URLS[:3]]
    with pytest.raises(InvalidArgument, match="3 engines, not a whole number of units of 2"):
        EngineGroup("pd", engines, unit=2)
    for bad in (0, True, 1.5):
        with pytest.raises(InvalidArgument, match="unit of group 'pd' must be an int"):
            EngineGroup("pd", engines, unit=bad)  # type: ignore[arg-type]
    assert "unit=3" in repr(EngineGroup("pd", engines, unit=3))


async def test_a_dead_member_makes_its_unit_unhealthy_and_takes_the_whole_unit_out() -> None:
    server, engines, router = fleet()
    await server.sync_router()
    assert sorted(router.urls) == URLS
    await engines[1].close()
    await server.probe()
    assert server.unhealthy_units() == {"pd/0-1": "pd/1 dead; recover() replaces the unit whole"}
    assert sorted(router.urls) == URLS[2:]  # pd/0 lives, but not as half a unit
    records = {r.id: r for r in server.fleet.records()}
    assert not server.fleet.serves(records["pd/0"], server.state)
    assert server.fleet.serves(records["pd/2"], server.state)
    assert router.history and half_units(router, [URLS[:2], URLS[2:]]) == []


async def test_a_member_is_never_continued_while_its_mate_lacks_memory() -> None:
    server, _, _ = fleet()
    await server.offload()
    await server.onload_weights()
    first, second = server.fleet.records()[:2]
    assert first.released and second.released
    second.released.clear()  # (as if its KV came back and its mate's did not)
    with pytest.raises(IllegalEngineOp, match=r"member pd/0 of its unit pd/0-1 holds tags"):
        second.check_continue()
    second.alive = False
    first.released.clear()
    with pytest.raises(IllegalEngineOp, match=r"its unit pd/0-1 is unhealthy: member pd/1 is"):
        first.check_continue()


async def test_a_member_killed_between_release_and_resume_is_replaced_with_its_whole_unit() -> None:
    server, engines, router = fleet()
    await server.sync_router()
    traffic = [server.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 50}})]
    await server.offload()
    await engines[1].close()  # between the release and the resume
    with pytest.raises(PhaseFailed, match="pd/1: dead"):
        await server.onload_weights()
    assert server.state is S.FAILED
    assert server.unhealthy_units() == {"pd/0-1": "pd/1 dead; recover() replaces the unit whole"}
    survivor_ops = len(ops(engines[0]))

    with pytest.raises(InvalidArgument, match=r"unit pd/0-1 must be replaced whole .*unit_factory"):
        await server.recover(lambda engine_id: AtURL("http://127.0.0.1:1"))
    assert len(ops(engines[0])) == survivor_ops  # refused before anything was sent

    factory = UnitFactory()
    outcomes = await server.recover(unit_factory=factory)
    assert factory.asked == [("pd/0", "pd/1")]
    assert {k: o.outcome for k, o in outcomes.items() if k in ("pd/0", "pd/1")} == {
        "pd/0": Outcome.OK,
        "pd/1": Outcome.OK,
    }
    assert server.unhealthy_units() == {}
    # after the unit was found unhealthy the survivor got nothing but reads and its retirement
    # (an abort pause, then close)
    later = [op for op in ops(engines[0])[survivor_ops:] if op not in READS]
    assert later == ["pause_generation", "close"]
    handles = [r.handle for r in server.fleet.records()]
    assert [getattr(getattr(h, "backend", h), "url", None) for h in handles[:2]] == [
        e.url for e in factory.made
    ]
    if server.state is not S.WEIGHTS_RESTORED:
        await server.onload_weights()
    await server.update_weights(FromDisk("/model"), "v2")
    await server.onload_kv()
    assert server.state is S.SERVING
    answers = [await t for t in traffic]
    assert all(a["meta_info"]["completion_tokens"] == 50 for a in answers)
    new_units = [[e.url for e in factory.made], URLS[2:]]
    assert sorted(router.urls) == sorted(u for unit in new_units for u in unit)
    assert half_units(router, [URLS[:2], *new_units]) == []


def test_a_verified_write_fails_every_member_of_a_unit_where_one_fails() -> None:
    good = Fingerprint("s", {"w": "1"})
    other = Fingerprint("s", {"w": "2"})
    groups = dict.fromkeys(["pd/0", "pd/1", "pd/2", "pd/3"], "pd")
    units = {"pd/0": "pd/0-1", "pd/1": "pd/0-1", "pd/2": "pd/2-3", "pd/3": "pd/2-3"}
    after = {"pd/0": good, "pd/1": "timed out", "pd/2": good, "pd/3": good}
    spec = Verification((good,))
    verdicts = judge(groups, after, {}, spec, units)
    assert sorted(verdicts) == ["pd/0", "pd/1"]
    assert verdicts["pd/0"].problem.startswith("member pd/1 of its unit pd/0-1 failed verification")
    # without a unit, pd/0 passes on its own
    assert sorted(judge(groups, after, {}, spec)) == ["pd/1"]
    # members that each pass alone (nothing to compare them with but each other) and disagree
    alone = {engine: engine for engine in groups}
    split = {"pd/0": good, "pd/1": other, "pd/2": good, "pd/3": good}
    noop = Verification(may_be_noop=True)
    assert judge(alone, split, {}, noop) == {}
    verdicts = judge(alone, split, {}, noop, units)
    assert sorted(verdicts) == ["pd/0", "pd/1"]
    assert verdicts["pd/1"].problem.startswith("the members of its unit pd/0-1 hold different")


async def test_a_member_restarted_in_place_has_its_whole_unit_replaced() -> None:
    server, engines, router = fleet()
    await server.sync_router()
    await engines[2].restart()  # a fresh process at pd/2's address: its unit's state is lost
    await server.probe()
    assert server.unhealthy_units() == {
        "pd/2-3": "pd/2 restarted apart; recover() replaces the unit whole"
    }
    assert sorted(router.urls) == URLS[:2]  # neither member serves now
    records = {r.id: r for r in server.fleet.records()}
    with pytest.raises(IllegalEngineOp, match="restarted apart from its unit pd/2-3"):
        records["pd/2"].check_continue()
    factory = UnitFactory()
    await server.recover(unit_factory=factory)
    assert factory.asked == [("pd/2", "pd/3")]
    assert [op for op in ops(engines[3]) if op not in READS][-2:] == ["pause_generation", "close"]
    await server.pause()
    await server.update_weights(FromDisk("/model"), "v2")
    await server.resume()
    assert server.unhealthy_units() == {}
    new_units = [URLS[:2], [e.url for e in factory.made]]
    assert sorted(router.urls) == sorted(u for unit in new_units for u in unit)
    assert half_units(router, [URLS[2:], *new_units]) == []


async def test_a_unit_factory_must_make_a_whole_new_unit() -> None:
    server, engines, _ = fleet()
    await engines[0].close()
    await server.probe()
    with pytest.raises(InvalidArgument, match=r"returned 1 engines for a unit of 2"):
        await server.recover(unit_factory=lambda ids: [AtURL("http://127.0.0.1:31300")])
    with pytest.raises(InvalidArgument, match=r"must return a sequence of 2 engines"):
        await server.recover(unit_factory=lambda ids: AtURL("http://127.0.0.1:31301"))
    # the member that still lives handed back as it was, beside a new one: not a whole unit
    with pytest.raises(PhaseFailed, match=r"pd/1: refused .*a unit is replaced whole; restart"):
        await server.recover(unit_factory=lambda ids: [AtURL("http://127.0.0.1:31302"), engines[1]])
    assert server.unhealthy_units() == {
        "pd/0-1": "pd/1 uncertain; recover() replaces the unit whole"
    }
    outcomes = await server.recover(unit_factory=UnitFactory())
    assert {o.outcome for o in outcomes.values()} == {Outcome.OK}
    assert server.unhealthy_units() == {}


async def test_a_resume_continues_the_whole_units_and_leaves_an_unhealthy_one_paused() -> None:
    server, engines, router = fleet()
    await server.sync_router()
    await server.pause()
    await engines[1].close()
    await server.probe()
    await server.resume()
    assert server.state is S.SERVING
    assert "continue_generation" not in ops(engines[0])  # its mate is dead: it stays paused
    assert all("continue_generation" in ops(e) for e in engines[2:])
    assert sorted(router.urls) == URLS[2:]
    assert server.fleet.implies(S.SERVING)  # (the unhealthy unit's member held paused)
