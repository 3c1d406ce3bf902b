"""Many engines per Ray actor: hosted engines behave in groups exactly like engines with an
actor each, and one engine's death leaves its neighbours serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from rollout_lifecycle import (
    EngineGroup,
    InvalidArgument,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
)
from rollout_lifecycle.backends.hosted import (
    HostedEngine,
    start_multi_engine_actor,
)
from rollout_lifecycle.testing import cycle_order_violations, simulated_multi_engine_actors
from rollout_lifecycle.testing.waits import until


@pytest.fixture
def hosted(ray_cluster: None) -> Iterator[Any]:
    """Start multi-engine actors; every actor started is killed when the test ends."""
    started: list[Any] = []

    def start(actors: int, per_actor: int, **options: Any) -> tuple[list[Any], list[HostedEngine]]:
        got, engines = simulated_multi_engine_actors(actors, per_actor, **options)
        started.extend(got)
        ray.get([a.ping.remote() for a in got], timeout=60)
        return got, engines

    yield start
    for actor in started:
        ray.kill(actor)


async def _histories(actors: list[Any]) -> dict[str, list[dict[str, Any]]]:
    per_actor = await asyncio.gather(*(a.histories.remote() for a in actors))
    flat = [h for group in per_actor for h in group]
    return {f"sim-{i}": h for i, h in enumerate(flat)}


async def test_hosted_engines_run_a_full_cycle_behind_barriers(hosted: Any) -> None:
    actors, engines = hosted(2, 3, seed=7, op_latency={"pause_generation": (0.001, 0.02)})
    assert await asyncio.gather(*(a.ping.remote() for a in actors)) == [
        ["sim-0", "sim-1", "sim-2"],
        ["sim-3", "sim-4", "sim-5"],
    ]
    server = RolloutServer([EngineGroup("a", engines[:2]), EngineGroup("b", engines[2:])])
    await server.offload()
    assert all(e.released for e in server.snapshot().engines().values())
    await server.onload_weights()
    await server.onload_kv()
    assert server.state is ServerState.SERVING
    histories = await _histories(actors)
    assert cycle_order_violations(histories) == []
    assert all(sum(e["op"] == "pause_generation" for e in h) == 1 for h in histories.values())


async def test_requests_in_flight_on_hosted_engines_survive_an_offload(hosted: Any) -> None:
    _, engines = hosted(1, 2, token_latency=0.002)
    server = RolloutServer([EngineGroup("actor", engines)])
    requests = [{"input_ids": [i], "sampling_params": {"max_new_tokens": 40}} for i in range(6)]
    batch = asyncio.ensure_future(server.generate_batch(requests))

    async def all_held() -> bool:
        stats = await asyncio.gather(*(e.send("stats") for e in engines))
        return sum(s["running"] + s["waiting"] for s in stats) == len(requests)

    await until(all_held, what="the engines' schedulers to hold every request")
    await server.offload()
    await server.onload_weights()
    await server.onload_kv()
    answers = await asyncio.wait_for(batch, 30)
    assert [len(a["output_ids"]) for a in answers] == [40] * 6
    assert sum(a["meta_info"]["num_resubmissions"] for a in answers) == 0


async def test_one_dead_hosted_engine_leaves_its_neighbours_serving(hosted: Any) -> None:
    _, engines = hosted(1, 3)
    # Releasing a tag twice kills the engine, as it kills SGLang.
    await engines[0].send("release_memory_occupation", (["kv_cache"],))
    with pytest.raises(ray.exceptions.RayTaskError, match="released twice"):
        await engines[0].send("release_memory_occupation", (["kv_cache"],))
    server = RolloutServer([EngineGroup("actor", engines)])
    with pytest.raises(PhaseFailed) as failed:
        await server.offload()
    outcomes = failed.value.outcomes
    assert outcomes["actor/0"].outcome is Outcome.DEAD
    assert outcomes["actor/1"].ok and outcomes["actor/2"].ok
    assert [await engines[i].send("weight_version") for i in (1, 2)] == ["default", "default"]


async def test_a_hosted_engine_answers_only_engine_operations(hosted: Any) -> None:
    _, engines = hosted(1, 1)
    for op in ("_backend", "__init__", "backend"):
        with pytest.raises(ray.exceptions.RayTaskError, match="not an engine operation"):
            await engines[0].send(op)


def test_bad_multi_engine_actor_input_is_refused_before_anything_starts() -> None:
    with pytest.raises(InvalidArgument):
        start_multi_engine_actor([])
    with pytest.raises(InvalidArgument):
        start_multi_engine_actor([object()])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        simulated_multi_engine_actors(0, 2)
    with pytest.raises(InvalidArgument):
        simulated_multi_engine_actors(1, 2, token_latency=-1)


async def test_recover_closes_a_replaced_hosted_engine_and_spares_its_neighbours(
    hosted: Any,
) -> None:
    actors, engines = hosted(1, 3, token_latency=0.002)
    (spare_actor,), (spare,) = hosted(1, 1, token_latency=0.002)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.offload()
    made: list[HostedEngine] = []

    def factory(engine_id: str) -> HostedEngine:
        made.append(spare)
        return spare

    # Mark engine 1 uncertain (its resume got no answer) so that recover() replaces it.
    record = server.groups[0].records[1]
    record.uncertain.add(next(iter(record.released)))
    await asyncio.wait_for(server.recover(factory), 60)
    assert made == [spare] and server.state is ServerState.RELEASED
    infos = await asyncio.gather(*(actors[0].call.remote(i, "state") for i in (0, 2)))
    assert all(i["released_tags"] for i in infos)  # the neighbours still serve their fleet
    with pytest.raises(Exception, match=r"closed|dead"):  # the replaced one was closed
        await actors[0].call.remote(1, "server_info")
    await server.onload_weights()
    await server.update_weights(lambda update: None, "v1")
    await server.onload_kv()
    assert server.state is ServerState.SERVING
    del spare_actor
