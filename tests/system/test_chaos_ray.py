"""Chaos on a real Ray cluster: engine actors killed mid-phase, then ``recover()``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import ray

from rollout_lifecycle import (
    DeadEnginePolicy,
    EngineGroup,
    FromDisk,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    StaleWeights,
)
from rollout_lifecycle.testing import until_actor_gone, until_began
from rollout_lifecycle.testing.simulated import DEFAULT_MEMORY_BYTES

Fleet = Callable[..., list[Any]]
#: How long the slowed op takes: ample time to kill an engine once every engine received it.
SLOW = 2.0
# Which op to slow down so that the kill lands inside the phase, and the state the phase's
# failure leaves the healthy engines in (what recover() brings the replacement to).
PHASES = {
    "pause": ("pause_generation", ServerState.SERVING),
    "flush": ("flush_cache", ServerState.SERVING),
    "release": ("release_memory_occupation", ServerState.RELEASED),
    "resume_kv": ("resume_memory_occupation", ServerState.DRAINED),
}


def factory_for(engine_actors: Fleet, made: list[str]) -> Callable[[str], Any]:
    async def make(engine_id: str) -> Any:
        made.append(engine_id)
        (actor,) = engine_actors(1, wait=False, label=f"replacement-{engine_id.replace('/', '-')}")
        return actor

    return make


async def onload_with_weights(server: RolloutServer) -> None:
    """A replacement is stale: generation continues only once it has received weights."""
    if server.state is ServerState.SERVING:
        # It waits paused in a serving fleet: the next update (paused around it) brings it in.
        await asyncio.wait_for(server.pause(), timeout=60)
    if server.state is ServerState.RELEASED:
        await asyncio.wait_for(server.onload_weights(), timeout=60)
    with pytest.raises(StaleWeights, match="actor/"):
        await server.onload()
    await asyncio.wait_for(server.update_weights(FromDisk("/ckpt/1"), "v1"), timeout=60)
    await asyncio.wait_for(server.onload(), timeout=60)
    assert not any(e.stale for e in server.snapshot().engines().values())


async def assert_fleet_whole_and_serving(server: RolloutServer) -> None:
    assert server.state is ServerState.SERVING
    handles = list(server.engines().values())
    memories = await asyncio.gather(*(h.memory.remote() for h in handles))
    assert memories == [dict(DEFAULT_MEMORY_BYTES)] * len(handles)
    infos = await asyncio.gather(*(h.state.remote() for h in handles))
    assert all(not i["paused"] and i["released_tags"] == [] for i in infos)
    outs = await asyncio.wait_for(
        asyncio.gather(
            *(
                h.generate.remote({"input_ids": [1], "sampling_params": {"max_new_tokens": 3}})
                for h in handles
            )
        ),
        timeout=30,
    )
    assert all(len(o["output_ids"]) == 3 for o in outs)


@pytest.mark.parametrize("phase", list(PHASES))
async def test_engine_killed_mid_phase_is_named_and_recover_restores_the_fleet(
    engine_actors: Fleet, phase: str
) -> None:
    op, settles_in = PHASES[phase]
    engines = engine_actors(4, token_latency=0.002, op_latency={op: SLOW})
    server = RolloutServer([EngineGroup("actor", engines)])
    times = 1
    if phase == "resume_kv":
        await server.offload()
        await server.onload_weights()  # (the weights' resume is the first of the op)
        call, times = server.onload_kv(), 2
    else:
        call = server.offload()
    task = asyncio.ensure_future(call)
    await until_began(engines, op, times=times)  # the other phases take no time: in the slow one
    ray.kill(engines[2])
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(task, timeout=60)
    assert err.value.phase == phase
    assert err.value.failed_engines == ["actor/2"]
    assert err.value.outcomes["actor/2"].outcome is Outcome.DEAD
    assert server.state is ServerState.FAILED
    snap = server.snapshot().engines()
    assert not snap["actor/2"].alive
    healthy = [snap[f"actor/{i}"] for i in (0, 1, 3)]
    if phase in ("pause", "flush"):
        assert all(not e.paused and e.released == () for e in healthy)  # continued, unreleased
    if phase == "release":
        assert all(e.released == ("weights", "kv_cache", "cuda_graph") for e in healthy)

    made: list[str] = []
    outcomes = await asyncio.wait_for(server.recover(factory_for(engine_actors, made)), timeout=90)
    assert made == ["actor/2"]
    assert all(o.ok for o in outcomes.values()) and "actor/2" in outcomes
    assert server.state is settles_in
    replaced = server.snapshot().engines()["actor/2"]
    assert replaced.alive and replaced.stale
    assert replaced.released == healthy[0].released
    # A replacement waits paused for the weights, also where its group serves.
    assert replaced.paused
    assert replaced.paused == healthy[0].paused or settles_in is ServerState.SERVING
    await onload_with_weights(server)
    await assert_fleet_whole_and_serving(server)


async def test_skip_policy_goes_on_without_a_dead_engine_then_recovers_it(
    engine_actors: Fleet,
) -> None:
    engines = engine_actors(3)
    server = RolloutServer(
        [EngineGroup("actor", engines)],
        LifecycleConfig(dead_engines=DeadEnginePolicy.SKIP),
    )
    ray.kill(engines[0])
    await until_actor_gone(engines[0])
    await asyncio.wait_for(server.offload(), timeout=30)
    assert server.state is ServerState.RELEASED
    snap = server.snapshot().engines()
    assert not snap["actor/0"].alive
    assert snap["actor/1"].released == ("weights", "kv_cache", "cuda_graph")
    await asyncio.wait_for(server.recover(factory_for(engine_actors, [])), timeout=60)
    assert server.state is ServerState.RELEASED
    assert server.snapshot().engines()["actor/0"].released == ("weights", "kv_cache", "cuda_graph")
    memory = await server.engines()["actor/0"].memory.remote()
    assert memory == {"weights": 0, "kv_cache": 0, "cuda_graph": 0}
    await onload_with_weights(server)
    await assert_fleet_whole_and_serving(server)


async def test_failed_is_left_only_by_recover_or_reset(engine_actors: Fleet) -> None:
    engines = engine_actors(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    ray.kill(engines[1])
    await until_actor_gone(engines[1])
    with pytest.raises(PhaseFailed):
        await server.offload()
    assert server.state is ServerState.FAILED
    for call in (server.offload, server.onload, server.onload_kv, server.resume):
        with pytest.raises(Exception, match="failed"):
            await call()
    assert server.state is ServerState.FAILED
    await asyncio.wait_for(server.recover(factory_for(engine_actors, [])), timeout=60)
    assert server.state is ServerState.SERVING
