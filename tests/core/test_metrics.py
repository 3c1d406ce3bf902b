"""Per-call metrics: one flat dict of plain numbers per call, named lifecycle/<call>/<name>."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    EngineHost,
    LifecycleConfig,
    PhaseFailed,
    RolloutServer,
    SimulatedEngine,
    Tag,
)
from rollout_lifecycle.testing.faults import FaultyEngine, NotIdleYet
from rollout_lifecycle.testing.fleets import no_push
from rollout_lifecycle.testing.fleets import simulated_engines as sims
from rollout_lifecycle.testing.simulated import DEFAULT_MEMORY_BYTES

Fleet = Callable[..., list[Any]]
PHASE_KEYS = {
    "offload": ("pause", "flush", "release"),
    "onload_weights": ("weights",),
    "update_weights": ("begin_weight_update", "end_weight_update", "update_weight_version"),
    "onload_kv": ("kv", "check_versions", "continue"),
}


class NoMemoryMeter(FaultyEngine):
    """A backend that does not account memory (like a real SGLang server over HTTP)."""

    memory = None  # EngineHost.memory() finds no meter


async def cycle(server: RolloutServer) -> dict[str, dict[str, float]]:
    return {
        "offload": await server.offload(),
        "onload_weights": await server.onload_weights(),
        "update_weights": await server.update_weights(no_push, version="v1"),
        "onload_kv": await server.onload_kv(),
    }


def assert_plain(metrics: dict[str, float]) -> None:
    assert metrics
    assert all(type(v) in (int, float) for v in metrics.values()), metrics
    assert json.loads(json.dumps(metrics)) == metrics


async def test_every_call_returns_flat_phase_metrics_named_by_call_and_phase() -> None:
    server = RolloutServer([EngineGroup("a", sims(2)), EngineGroup("b", sims(2))])
    got = await cycle(server)
    for call, phases in PHASE_KEYS.items():
        metrics = got[call]
        assert_plain(metrics)
        assert metrics[f"lifecycle/{call}/total_s"] > 0
        for phase in phases:
            took = metrics[f"lifecycle/{call}/{phase}_s"]
            slowest = metrics[f"lifecycle/{call}/{phase}_slowest_s"]
            # The phase spans from its first call to its barrier: no engine's call is longer.
            assert 0 < slowest <= took <= metrics[f"lifecycle/{call}/total_s"]
        assert all(k.startswith(f"lifecycle/{call}/") for k in metrics)
        assert not any("bytes" in k for k in metrics)  # memory metrics are off by default
    assert got["offload"]["lifecycle/offload/flush_retries"] == 0
    assert "lifecycle/update_weights/update_s" in got["update_weights"]
    # server.metrics: the last call of each kind, merged into one dict.
    merged = {k: v for m in got.values() for k, v in m.items()}
    assert server.metrics == merged


async def test_the_slowest_engine_of_a_phase_is_named_beside_its_time() -> None:
    slow = SimulatedEngine(
        "slow", token_latency=0.001, op_latency={"release_memory_occupation": 0.08}
    )
    engines = [*sims(2), slow]
    server = RolloutServer([EngineGroup("actor", engines)])
    metrics = await server.offload()
    key = "lifecycle/offload/release_slowest_s"
    assert metrics[key] >= 0.08
    assert server.slowest_engines[key] == "actor/2"
    assert set(server.slowest_engines) == {k for k in metrics if k.endswith("_slowest_s")}
    assert set(server.slowest_engines.values()) <= {"actor/0", "actor/1", "actor/2"}


async def test_flush_retries_count_the_not_idle_answers_the_engines_gave() -> None:
    inner = sims(3)
    engines = [NotIdleYet(inner[0], 2), NotIdleYet(inner[1], 3), inner[2]]
    server = RolloutServer(
        [EngineGroup("actor", engines)], LifecycleConfig(flush_retry_interval=0.01)
    )
    metrics = await server.offload()
    assert metrics["lifecycle/offload/flush_retries"] == 5
    assert type(metrics["lifecycle/offload/flush_retries"]) is int
    flushes = [e for e in inner[1].history() if e["op"] == "flush_cache"]
    assert len(flushes) == 1  # the 400s came before the engine; one flush reached it


async def test_a_flush_reports_how_many_attempts_it_took() -> None:
    host = EngineHost(NotIdleYet(SimulatedEngine("sim", token_latency=0.001), 2))
    assert await host.flush_cache(5.0, 0.01) == 3
    assert await host.flush_cache(5.0, 0.01) == 1


async def test_memory_metrics_show_what_each_call_released_and_restored() -> None:
    config = LifecycleConfig(memory_metrics=True, release_tags=[Tag.KV_CACHE, Tag.WEIGHTS])
    server = RolloutServer([EngineGroup("actor", sims(3))], config)
    full = {tag: 3 * n for tag, n in DEFAULT_MEMORY_BYTES.items()}
    offload = await server.offload()
    assert_plain(offload)
    for tag, nbytes in full.items():
        assert offload[f"lifecycle/offload/{tag}_bytes_before"] == nbytes
    assert offload["lifecycle/offload/kv_cache_bytes_after"] == 0
    assert offload["lifecycle/offload/weights_bytes_after"] == 0
    assert offload["lifecycle/offload/cuda_graph_bytes_after"] == full["cuda_graph"]  # kept
    weights = await server.onload_weights()
    assert weights["lifecycle/onload_weights/weights_bytes_after"] == full["weights"]
    assert weights["lifecycle/onload_weights/kv_cache_bytes_after"] == 0
    kv = await server.onload_kv()
    for tag, nbytes in full.items():
        assert kv[f"lifecycle/onload_kv/{tag}_bytes_after"] == nbytes


async def test_engines_that_do_not_account_memory_report_no_memory_metrics() -> None:
    engines = [NoMemoryMeter(e) for e in sims(2)]
    server = RolloutServer([EngineGroup("actor", engines)], LifecycleConfig(memory_metrics=True))
    metrics = await server.offload()
    assert "lifecycle/offload/release_s" in metrics
    assert not any("bytes" in k for k in metrics)


async def test_a_failed_call_leaves_the_last_completed_metrics_in_place() -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.offload()
    await server.onload()
    before = server.metrics
    engines[1].arm("flush_cache", "reject")
    with pytest.raises(PhaseFailed):
        await server.offload()
    assert server.metrics == before
    # A call with nothing to do reports its total only.
    await server.reset()
    await server.offload()
    assert list(await server.offload()) == ["lifecycle/offload/total_s"]


async def test_a_call_made_from_a_hook_keeps_its_own_name() -> None:
    server = RolloutServer([EngineGroup("actor", sims(2))])

    async def push_on_wake(event: Any) -> None:
        await event.server.update_weights(no_push, version="from-hook")

    server.on("weights_restored", push_on_wake)
    await server.offload()
    metrics = await server.onload()
    assert "lifecycle/onload/weights_s" in metrics
    assert "lifecycle/update_weights/begin_weight_update_s" in metrics
    assert "lifecycle/onload/continue_s" in metrics


async def test_metrics_from_ray_engine_actors(engine_actors: Fleet) -> None:
    actors = engine_actors(3, label="ray", token_latency=0.001)
    server = RolloutServer([EngineGroup("actor", actors)], LifecycleConfig(memory_metrics=True))
    got = await cycle(server)
    for call, phases in PHASE_KEYS.items():
        assert_plain(got[call])
        for phase in phases:
            assert got[call][f"lifecycle/{call}/{phase}_slowest_s"] > 0
    assert got["offload"]["lifecycle/offload/flush_retries"] == 0
    assert set(server.slowest_engines.values()) <= {"actor/0", "actor/1", "actor/2"}
    assert got["offload"]["lifecycle/offload/kv_cache_bytes_after"] == 0
    resident = await actors[0].memory.remote()
    assert (
        got["onload_kv"]["lifecycle/onload_kv/kv_cache_bytes_after"] == 3 * (resident["kv_cache"])
    )
