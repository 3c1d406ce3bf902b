"""A fleet of vLLM engines behind Ray: engine actors and hosted engines over vLLM stand-in
servers run the lifecycle, and a release at sleep level 2 (vLLM discards the weights) serves
again only after a push."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from wire.conftest import contract_model_dir, vllm_standin

from rollout_lifecycle import EngineGroup, FromDisk, PhaseFailed, RolloutServer, ServerState
from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.backends.hosted import start_multi_engine_actor
from rollout_lifecycle.backends.vllm.client import vllm_http_factory
from rollout_lifecycle.testing.standin import VLLMStandInServer


@pytest.fixture
def standins() -> Iterator[list[VLLMStandInServer]]:
    servers = [vllm_standin() for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def fleet_over(ray_cluster: None) -> Iterator[Any]:
    """A vLLM group over three servers: one engine actor and two engines hosted in one actor."""
    actors: list[Any] = []

    def build(servers: list[VLLMStandInServer], **options: Any) -> list[Any]:
        factories = [vllm_http_factory(s.url, **options) for s in servers]
        actor = start_engine_actor(factories[0])
        host, hosted = start_multi_engine_actor(factories[1:])
        actors.extend([actor, host])
        return [actor, *hosted]

    yield build
    for actor in actors:
        ray.kill(actor)


def checksums(server: VLLMStandInServer) -> dict[str, str]:
    answer = httpx.post(f"{server.url}/weight_checker", json={"action": "checksum"}, timeout=30)
    answer.raise_for_status()
    return dict(answer.json()["checksums"])


def paused(server: VLLMStandInServer) -> bool:
    return bool(httpx.get(f"{server.url}/is_paused", timeout=30).json()["is_paused"])


def ops(server: VLLMStandInServer) -> list[str]:
    """The engine calls the server has seen, in order."""
    return [str(entry["op"]) for entry in server.history()]


def short() -> dict[str, Any]:
    return {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}


async def test_a_level_2_fleet_serves_the_pushed_weights_after_a_cycle(
    standins: list[VLLMStandInServer], fleet_over: Any
) -> None:
    before = [checksums(s) for s in standins]
    server = RolloutServer([EngineGroup("vllm", fleet_over(standins, sleep_level=2))])
    await server.offload()
    assert all(s.memory()["device"]["weights"] == 0 for s in standins)
    await server.onload_weights()
    await server.update_weights(FromDisk(contract_model_dir()), version="step-1")
    await server.onload_kv()
    assert server.state is ServerState.SERVING
    assert [checksums(s) for s in standins] == before
    answers = await asyncio.gather(*(server.generate(short()) for _ in range(6)))
    assert all(len(a["output_ids"]) == 4 for a in answers)


async def test_a_level_2_fleet_without_a_push_is_never_continued_and_recovers_with_one(
    standins: list[VLLMStandInServer], fleet_over: Any
) -> None:
    server = RolloutServer([EngineGroup("vllm", fleet_over(standins, sleep_level=2))])
    await server.offload()
    await server.onload_weights()
    with pytest.raises(PhaseFailed, match="level-2 sleep discarded them") as failed:
        await server.onload_kv()
    assert all(f"vllm/{i}: refused" in str(failed.value) for i in range(3))
    for s in standins:  # nothing that runs a forward pass reached any engine
        assert paused(s)
        assert "continue_generation" not in ops(s)

    async def no_replacement(engine_id: str) -> Any:
        raise AssertionError(f"{engine_id} is alive and needs no replacement")

    assert await server.recover(no_replacement) == {}
    assert server.state is ServerState.WEIGHTS_RESTORED
    await server.update_weights(FromDisk(contract_model_dir()), version="step-1")
    await server.onload_kv()
    assert server.state is ServerState.SERVING
    for s in standins:  # continued only after the push
        seen = ops(s)
        assert seen.index("continue_generation") > seen.index("update_weights_from_disk")
    assert len((await server.generate(short()))["output_ids"]) == 4


async def test_an_engine_that_dies_at_its_weights_wake_is_replaced_and_serves_after_a_push(
    standins: list[VLLMStandInServer], fleet_over: Any
) -> None:
    # On a GPU a wake can run out of memory and end the process; the stand-in's death fault
    # stands for it. The fleet names the engine, recover() replaces it, and the replacement
    # joins paused with its KV cache asleep, waiting for weights like any replacement.
    server = RolloutServer([EngineGroup("vllm", fleet_over(standins))])
    await server.offload()
    doomed = standins[1]
    doomed.inject({"path": "/wake_up", "kind": "die"})
    with pytest.raises(PhaseFailed, match=r"vllm/1: unreachable \(POST /wake_up"):
        await server.onload_weights()
    assert doomed.wait_dead(30) and server.state is ServerState.FAILED
    made: list[VLLMStandInServer] = []

    def replace(engine_id: str) -> Any:
        assert engine_id == "vllm/1"
        made.append(vllm_standin())
        return start_engine_actor(vllm_http_factory(made[-1].url))

    outcomes = await server.recover(replace)
    assert list(outcomes) == ["vllm/1"] and outcomes["vllm/1"].ok
    try:
        assert server.state is ServerState.WEIGHTS_RESTORED
        assert paused(made[0]) and made[0].memory()["device"]["kv_cache"] == 0
        await server.update_weights(FromDisk(contract_model_dir()), version="step-1")
        await server.onload_kv()
        assert server.state is ServerState.SERVING and not paused(made[0])
        answers = await asyncio.gather(*(server.generate(short()) for _ in range(6)))
        assert all(len(a["output_ids"]) == 4 for a in answers)
        assert "vllm/1" in {e for a in answers for e in a["meta_info"]["engines"]}
    finally:
        for server_made in made:
            server_made.stop()
