"""``RolloutServer`` itself (``core/server.py``): the groups it accepts and the context managers
that always bring the fleet back. The calls' behaviour is tested where it lives (phases,
reconcile, recovery, machine, generation; the parts its clients share in ``test_parts.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    EngineHost,
    InvalidArgument,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
)

S = ServerState


def server_and_engines(n: int = 2) -> tuple[RolloutServer, list[SimulatedEngine]]:
    sims = [SimulatedEngine() for _ in range(n)]
    return RolloutServer([EngineGroup("actor", list(sims))]), sims


def serving(sims: list[SimulatedEngine]) -> bool:
    return all(not s.paused and not s.released_tags and not s.dead for s in sims)


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        (EngineGroup("a", [SimulatedEngine()]), "groups must be a sequence of EngineGroup"),
        ([], "needs at least one EngineGroup"),
        (["a"], "expected an EngineGroup, got 'a'"),
        (
            [EngineGroup("a", [SimulatedEngine()]), EngineGroup("a", [SimulatedEngine()])],
            "two groups are named 'a'",
        ),
    ],
)
def test_groups_that_are_not_a_list_of_distinct_groups_are_refused(groups: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        RolloutServer(groups)


def test_an_engine_belongs_to_one_group_once() -> None:
    shared = SimulatedEngine()
    with pytest.raises(InvalidArgument, match="engine b/0 is also engine a/0"):
        RolloutServer([EngineGroup("a", [shared]), EngineGroup("b", [shared])])
    with pytest.raises(InvalidArgument, match=r"engine #1 of group 'a' is the same engine as"):
        EngineGroup("a", [shared, shared])  # the group refuses it before a server sees it


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": {"pause_mode": "abort"}}, "config must be a LifecycleConfig"),
        ({"journal": "state.json"}, "journal must be callable or None"),
        ({"name": ""}, "server name"),
    ],
)
def test_a_bad_config_journal_or_name_is_refused_by_name(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidArgument, match=match):
        RolloutServer([EngineGroup("a", [SimulatedEngine()])], **kwargs)


async def test_offloaded_brings_the_fleet_back_when_the_body_raises() -> None:
    server, sims = server_and_engines()
    with pytest.raises(RuntimeError, match="training step failed"):
        async with server.offloaded() as same:
            assert same is server and server.state is S.RELEASED
            assert all(s.paused and s.released_tags for s in sims)
            raise RuntimeError("training step failed")
    assert server.state is S.SERVING and serving(sims)


async def test_paused_continues_the_fleet_when_the_body_raises() -> None:
    server, sims = server_and_engines()
    with pytest.raises(RuntimeError, match="sync failed"):
        async with server.paused():
            assert server.state is S.DRAINED and all(s.paused for s in sims)
            raise RuntimeError("sync failed")
    assert server.state is S.SERVING and serving(sims)


async def test_a_failed_server_is_left_failed_on_exit_for_recover_to_settle() -> None:
    """A body that fails the server: the exit sends nothing more (no onload on top of a failed
    phase), and the failure is what the caller sees."""
    server, sims = server_and_engines()
    with pytest.raises(PhaseFailed, match="resume_weights"):
        async with server.offloaded():
            sims[1]._die("injected")
            await server.onload_weights()
    assert server.state is S.FAILED
    assert sims[0].paused and sims[0].released_tags  # nothing was sent to it after the failure


def test_groups_and_servers_reject_bad_input_before_touching_engines() -> None:
    engine = SimulatedEngine("e")
    with pytest.raises(InvalidArgument, match="no engines"):
        EngineGroup("actor", [])
    with pytest.raises(InvalidArgument, match="same object"):
        EngineGroup("actor", [engine, engine])
    with pytest.raises(InvalidArgument, match="'a/b'"):
        EngineGroup("a/b", [engine])
    with pytest.raises(InvalidArgument, match="str"):
        EngineGroup("actor", ["http://localhost:30000"])
    with pytest.raises(InvalidArgument, match="at least one"):
        RolloutServer([])
    host = EngineHost(engine)
    with pytest.raises(InvalidArgument, match="named 'actor'"):
        RolloutServer([EngineGroup("actor", [host]), EngineGroup("actor", [SimulatedEngine()])])
    with pytest.raises(InvalidArgument, match="belongs to one group"):
        RolloutServer([EngineGroup("a", [host]), EngineGroup("b", [host])])
    with pytest.raises(InvalidArgument, match="LifecycleConfig"):
        RolloutServer([EngineGroup("a", [host])], config={"pause_mode": "retract"})  # type: ignore[arg-type]
    assert engine.history() == []


async def test_in_process_fleet_runs_a_full_cycle_and_reports_state() -> None:
    engines = [SimulatedEngine(f"e{i}", token_latency=0.001) for i in range(3)]
    server = RolloutServer([EngineGroup("actor", engines)])
    metrics = await server.offload()
    assert {"lifecycle/offload/pause_s", "lifecycle/offload/flush_s"} <= metrics.keys()
    assert all(e.memory() == {"weights": 0, "kv_cache": 0, "cuda_graph": 0} for e in engines)
    snap = server.snapshot()
    assert snap.state is ServerState.RELEASED
    assert snap.to_dict()["groups"][0]["engines"][0]["released"] == (
        "weights",
        "kv_cache",
        "cuda_graph",
    )
    await server.onload()
    assert all(e.memory()["kv_cache"] > 0 for e in engines)
    assert server.state is ServerState.SERVING
    await asyncio.gather(*(e.close() for e in engines))
