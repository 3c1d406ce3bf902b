"""A real SGLang 0.5.23 server restarted at its URL at each boundary of a colocated cycle (after
the pause, the flush, the release, the weights, the KV cache) is never killed: the call that
meets it refuses to act on the new process, the records learn what it is (a fresh server), and
``recover()`` plus one cycle bring it back with the fleet's weights."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from core.test_identity import once
from real.lifecycle_checks import assert_reads_then_the_pause, routes_around_a_rollout
from real.servers import RealServer

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    FromDisk,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    incarnation_of,
)
from rollout_lifecycle.contract.identity import PROOF_WINDOW

pytestmark = pytest.mark.real_sglang

S = ServerState
#: Generous deadlines: a restart takes tens of seconds, and the machine may be loaded.
CONFIG = LifecycleConfig(
    deadlines=Deadlines(pause=60, flush=60, release=60, resume=60, continue_=60, probe=30)
)


async def reported(url: str) -> dict[str, Any]:
    """What the server says of itself: its incarnation, and whether it is paused."""
    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as client:
        info = (await client.get("/server_info")).json()
        ping = (await client.get("/ping")).status_code
        ready = (await client.get("/ready")).status_code
    return {"incarnation": incarnation_of(info), "paused": ping == 200 and ready == 503}


async def assert_records_match(server: RolloutServer, real: list[RealServer]) -> None:
    """Every record says what its server reports (incarnation, paused), and no server died."""
    snapshot = server.snapshot().engines()
    for index, process in enumerate(real):
        assert process.alive(), f"server {index} died:\n{process.output()}"
        record = snapshot[f"actor/{index}"]
        seen = await reported(process.url)
        assert record.incarnation == seen["incarnation"], index
        if not record.pause_unknown:
            assert record.paused == seen["paused"], index


@pytest.fixture
async def rollout_server(real_servers: list[RealServer]) -> AsyncIterator[RolloutServer]:
    engines = [SGLangHTTPEngine(s.url) for s in real_servers]
    yield RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await asyncio.gather(*(e.close() for e in engines))


async def failing_step(server: RolloutServer, model: str, boundary: str) -> PhaseFailed:
    """Run the cycle up to the call that meets the restart; that call's error."""
    with pytest.raises(PhaseFailed) as err:
        if boundary in ("after_pause", "after_flush"):
            await server.offload()
        elif boundary == "after_release":
            await server.onload_weights()
        elif boundary == "after_weights":
            await server.update_weights(FromDisk(model), version="v1")
        else:
            await server.onload_kv()
    return err.value


#: The boundaries inside a call, and the hook that runs there.
HOOKED = {
    "after_pause": "before_flush",
    "after_flush": "before_release",
    "after_kv": "before_continue",
}


@pytest.mark.parametrize(
    ("boundary", "phase"),
    [
        ("after_pause", "release"),
        ("after_flush", "release"),
        ("after_release", "resume_weights"),
        ("after_weights", "begin_weight_update"),
        ("after_kv", "continue"),
    ],
)
async def test_a_server_restarted_at_a_boundary_of_the_cycle_is_never_killed(
    rollout_server: RolloutServer,
    real_servers: list[RealServer],
    real_sglang: Any,
    boundary: str,
    phase: str,
) -> None:
    server, victim, model = rollout_server, real_servers[0], real_sglang.model
    before = (await reported(victim.url))["incarnation"]
    # The twin is paused at every boundary and nothing talks to it during the restart: it is
    # held (servers.RealServer.held) so that its paused scheduler leaves the cores to the start.
    restart = functools.partial(victim.restart, hold=real_servers[1:])
    if boundary in HOOKED:
        server.on(HOOKED[boundary], once(lambda: asyncio.to_thread(restart)))
    if boundary not in ("after_pause", "after_flush"):
        await server.offload()
    if boundary in ("after_weights", "after_kv"):
        await server.onload_weights()
    if boundary == "after_kv":
        await server.update_weights(FromDisk(model), version="v1")
    if boundary in ("after_release", "after_weights"):
        await asyncio.to_thread(restart)
    error = await failing_step(server, model, boundary)
    assert error.phase == phase and error.failed_engines == ["actor/0"]
    assert error.outcomes["actor/0"].outcome is Outcome.RESTARTED
    assert server.state is S.FAILED
    record = server.snapshot().engines()["actor/0"]
    assert (record.paused, record.released, record.stale) == (False, (), True)
    assert record.incarnation != before
    await assert_records_match(server, real_servers)
    # back: recover (the restarted one is brought to the fleet's memory state), then a cycle
    # that gives every engine the same weights
    await server.recover(lambda engine_id: server.engines()[engine_id])
    assert server.state is not S.FAILED
    await assert_records_match(server, real_servers)
    if server.state is S.SERVING:
        await server.pause()
        await server.update_weights(FromDisk(model), version="v2")
        await server.resume()
    else:
        if server.state is S.RELEASED:
            await server.onload_weights()
        await server.update_weights(FromDisk(model), version="v2")
        await server.onload()
    assert server.state is S.SERVING
    assert not any(r.stale or r.paused for r in server.snapshot().engines().values())
    await assert_records_match(server, real_servers)


async def test_renewed_proofs_let_the_pause_after_a_rollout_go_out_without_a_read(
    real_servers: list[RealServer],
) -> None:
    """``renew_proofs``: a real server's incarnation reads the same on every ``/server_info``
    of one process, so the reads while it serves keep it proven, and the pause after a rollout
    of several proof windows is the first request each server gets from the offload."""
    engines = [SGLangHTTPEngine(s.url) for s in real_servers]
    config = LifecycleConfig(deadlines=CONFIG.deadlines, renew_proofs=True)
    server = RolloutServer([EngineGroup("actor", engines)], config)
    try:
        routes = await routes_around_a_rollout(server, engines, 3 * PROOF_WINDOW)
        # the incarnation's reads every half window while serving, and the pause first
        assert_reads_then_the_pause(routes, {"/server_info"}, 4, "/pause_generation")
        assert server.state is S.DRAINED
        await assert_records_match(server, real_servers)
    finally:
        if server.state is S.DRAINED:
            await server.resume()
        await asyncio.gather(*(e.close() for e in engines))
