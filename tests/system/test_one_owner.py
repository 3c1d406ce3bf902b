"""One engine, one owner, whatever its name: one server (or one fleet of Ray actors) given one
engine under two spellings refuses it, naming both; and what an engine shows after a fault is
taken for what it is (a release answered with a 5xx is of unknown effect; a server restarted
under a push is found before ``reset()`` settles on the records).

Two controllers spelling an engine differently, and with different lock directories, are
``test_claims_between_controllers.py``'s; a controller killed in its push is
``test_killed_controllers.py``'s."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import ray
from contract.test_urls import OTHER_SPELLINGS

from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    IllegalTransition,
    InvalidArgument,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    WeightUpdate,
    start_engine_actor,
)
from rollout_lifecycle.backends.sglang.client import sglang_http_factory
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.testing import StandInServer

S = ServerState
BOUND = 60.0
#: Spellings of this machine that no text comparison takes for 127.0.0.1.
SPELLINGS = OTHER_SPELLINGS


@pytest.fixture
def servers(two_standins: list[StandInServer]) -> list[StandInServer]:
    return two_standins


pytestmark = pytest.mark.usefixtures("own_lock_dir")


@pytest.fixture
def made(http_clients: list[SGLangHTTPEngine]) -> list[SGLangHTTPEngine]:
    return http_clients


def client(url: str, made: list[SGLangHTTPEngine]) -> SGLangHTTPEngine:
    engine = SGLangHTTPEngine(url, retries=0)
    made.append(engine)
    return engine


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_one_server_twice_under_two_spellings_is_refused_naming_both(
    servers: list[StandInServer], made: list[SGLangHTTPEngine], spelling: str
) -> None:
    url = servers[0].url
    other = url.replace("127.0.0.1", spelling)
    with pytest.raises(InvalidArgument, match=rf"{other} and {url} reach one server"):
        EngineGroup("actor", [client(url, made), client(other, made)])
    with pytest.raises(InvalidArgument, match=rf"{other} and {url} reach one server"):
        RolloutServer(
            [
                EngineGroup("actor", [client(url, made)]),
                EngineGroup("reward", [client(other, made)]),
            ]
        )
    assert servers[0].history() == []  # nothing sent


async def test_ray_actors_that_reach_one_server_under_two_spellings_are_refused_at_first_call(
    ray_cluster: None, servers: list[StandInServer]
) -> None:
    # Two engine actors are two handles: only their servers' addresses tell they are one.
    url = servers[0].url
    spelled = url.replace("127.0.0.1", socket.gethostname())
    actors = [start_engine_actor(sglang_http_factory(u)) for u in (url, spelled)]
    try:
        # Up first, as a framework starts its actors before it builds the server: the first
        # contact reads each engine within `Deadlines.probe` (10 s), which a loaded machine
        # can spend on starting an actor's process (then that engine is met by its first
        # check instead: a conflict, with nothing sent to it, but its twin already paused).
        await asyncio.wait_for(asyncio.gather(*(a.ping.remote() for a in actors)), BOUND)
        server = RolloutServer([EngineGroup("actor", actors)])
        with pytest.raises(InvalidArgument, match=rf"\({url}\) and actor/1 \({spelled}\) are one"):
            await asyncio.wait_for(server.offload(), BOUND)
        assert server.state is S.SERVING
        assert servers[0].history() == []  # refused before anything was sent
    finally:
        for actor in actors:
            ray.kill(actor)


async def test_a_release_answered_500_is_uncertain_and_recover_reads_the_server_there(
    servers: list[StandInServer], made: list[SGLangHTTPEngine]
) -> None:
    """An old process shutting down answers a release with a 500: whether it released is not
    known, so the tags are uncertain (never released again), and once a new process answers
    at the address, ``recover()`` reads it and brings the fresh server to the fleet's state."""
    engines = [client(s.url, made) for s in servers]
    server = RolloutServer([EngineGroup("actor", engines)])
    servers[1].inject({"path": "/release_memory_occupation", "kind": "status", "status": 500})
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    assert err.value.phase == "release"
    assert err.value.outcomes["actor/1"].outcome is Outcome.UNREACHABLE  # effect unknown
    record = server.snapshot().engines()["actor/1"]
    assert set(record.uncertain) == {"kv_cache", "weights", "cuda_graph"}
    await asyncio.to_thread(servers[1].restart)  # the old process went, a new one answers
    await asyncio.wait_for(server.recover(lambda engine_id: engines[1]), BOUND)
    assert server.state is S.RELEASED
    for standin, (engine_id, snap) in zip(
        servers, server.snapshot().engines().items(), strict=True
    ):
        state = standin.state()
        assert state["paused"] == snap.paused, engine_id
        assert sorted(state["released_tags"]) == sorted(snap.released), engine_id
    await server.onload_weights()
    await server.update_weights(FromDisk("/ckpt/1"), version="v1")  # (the fresh one needs it)
    await server.onload_kv()
    assert server.state is S.SERVING and all(s.alive() for s in servers)


async def test_a_server_restarted_under_a_push_is_found_before_reset_settles(
    servers: list[StandInServer], made: list[SGLangHTTPEngine]
) -> None:
    """The push outlives a restart of one server: its end answers 400 (the new process holds
    no session) and the update fails. ``reset()`` then reads every engine before it settles
    on the records: the fresh server is found, reset refuses naming it, and ``recover()``
    brings it in."""
    engines = [client(s.url, made) for s in servers]
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.offload()
    await server.onload_weights()

    async def push(update: WeightUpdate) -> Any:
        await FromDisk("/ckpt/1")(update)
        await asyncio.to_thread(servers[1].restart)

    with pytest.raises(PhaseFailed, match="end_weight_update"):
        await asyncio.wait_for(server.update_weights(push), BOUND)
    assert server.state is S.FAILED
    with pytest.raises(IllegalTransition, match=r"actor/1 is a fresh server"):
        await server.reset()
    assert server.snapshot().engines()["actor/1"].stale  # without the fleet's weights
    await asyncio.wait_for(server.recover(lambda engine_id: engines[1]), BOUND)
    # (a tie between a fresh server and one with its KV cache released goes with the most
    # restored: the fleet serves, the fresh one waits paused for the fleet's weights)
    assert server.state is S.SERVING
    records = server.snapshot().engines()
    for standin, snap in zip(servers, records.values(), strict=True):
        state = standin.state()
        assert state["paused"] == snap.paused and not state["released_tags"], snap.id
    assert records["actor/1"].stale and records["actor/1"].paused
    await server.pause()
    await server.update_weights(FromDisk("/ckpt/2"), version="v2")
    await server.resume()
    assert server.state is S.SERVING and all(s.alive() for s in servers)
    assert not any(s.state()["paused"] or s.state()["released_tags"] for s in servers)
