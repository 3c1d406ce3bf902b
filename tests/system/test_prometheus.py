"""The lifecycle's metrics for Prometheus (``rollout_lifecycle.metrics``): scraped over HTTP from
the endpoint during and after cycles, each value checked against what the server itself says
(its ``metrics`` dict, its fleet, its generation client's ``stats()``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from rollout_lifecycle import (
    EngineClaimed,
    EngineGroup,
    InvalidArgument,
    LifecycleConfig,
    LifecycleEvent,
    Outcome,
    PauseMode,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    WeightsNotVerified,
)
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.claims import HostClaims
from rollout_lifecycle.metrics import PHASES, PrometheusMetrics, RayMetrics
from rollout_lifecycle.testing import StandInServer, until
from rollout_lifecycle.testing.faults import NotIdleYet
from rollout_lifecycle.testing.fleets import push_reaching
from rollout_lifecycle.testing.fleets import simulated_engines as sims

BOUND = 30.0
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
async def exporter() -> AsyncIterator[tuple[PrometheusMetrics, str]]:
    metrics = PrometheusMetrics()
    port = metrics.serve()
    yield metrics, f"http://127.0.0.1:{port}/metrics"
    metrics.close()


async def scrape(url: str) -> Samples:
    """Every sample the endpoint answers now, by name and labels."""
    async with httpx.AsyncClient() as client:
        answer = await asyncio.wait_for(client.get(url), BOUND)
    answer.raise_for_status()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"rollout_lifecycle_{name}", frozenset(labels.items()))]


async def test_a_scrape_mid_call_and_after_it_agrees_with_the_server(
    exporter: tuple[PrometheusMetrics, str],
) -> None:
    metrics, url = exporter
    inner = sims(3)
    server = RolloutServer(
        [EngineGroup("actor", [NotIdleYet(inner[0], 2), *inner[1:]])],
        LifecycleConfig(flush_retry_interval=0.01),
        name="trainer",
    )
    metrics.watch(server)
    seen: list[Samples] = []

    async def look(event: LifecycleEvent) -> None:
        samples = await scrape(url)
        seen.append(samples)
        # the state the call is in, and every engine as its record says
        assert value(samples, "server_state", server="trainer", state=event.state.value) == 1
        assert sum(v for (n, _), v in samples.items() if n.endswith("server_state")) == 1
        for state, n in server.fleet.by_state().items():
            assert value(samples, "engines", server="trainer", state=state.value) == n

    server.on("before_release", look)
    got = await server.offload()
    mid = seen[0]  # pause and flush had settled, the release had not begun
    assert value(mid, "phase_seconds_count", server="trainer", phase="flush") == 1
    assert ("rollout_lifecycle_phase_seconds_count", frozenset(
        {"server": "trainer", "phase": "release"}.items())) not in mid  # fmt: skip
    assert value(mid, "engines", server="trainer", state="drained") == 3

    after = await scrape(url)
    for phase in ("pause", "flush", "release"):
        took = value(after, "phase_seconds_sum", server="trainer", phase=phase)
        assert took == pytest.approx(got[f"lifecycle/offload/{phase}_s"], rel=1e-9)
        assert value(after, "engine_calls_total", server="trainer", phase=phase, outcome="ok") == 3
    assert value(after, "flush_retries_total", server="trainer", phase="flush") == 2
    assert got["lifecycle/offload/flush_retries"] == 2
    call = {"server": "trainer", "call": "offload", "outcome": "ok"}
    assert value(after, "call_seconds_count", **call) == 1
    assert value(after, "call_seconds_sum", **call) == pytest.approx(
        got["lifecycle/offload/total_s"], rel=1e-9
    )
    assert value(after, "server_state", server="trainer", state="released") == 1
    assert value(after, "engines", server="trainer", state="released") == 3

    await server.onload()
    again = await scrape(url)
    assert value(again, "server_state", server="trainer", state="serving") == 1
    assert value(again, "server_state", server="trainer", state="released") == 0
    assert value(again, "engines", server="trainer", state="serving") == 3
    assert value(again, "phase_seconds_count", server="trainer", phase="pause") == 1


async def test_verification_failures_and_dead_engines_are_counted(
    exporter: tuple[PrometheusMetrics, str],
) -> None:
    metrics, url = exporter
    engines = sims(3)
    server = RolloutServer([EngineGroup("actor", engines)], name="rl")
    metrics.watch(server)
    await server.offload()
    await server.onload_weights()
    with pytest.raises(WeightsNotVerified):
        await server.update_weights(
            push_reaching("/ckpt/1", "actor/0", "actor/1"), "v1", verify=True
        )
    samples = await scrape(url)
    assert value(samples, "weights_verified_total", server="rl") == 3
    assert value(samples, "verification_failures_total", server="rl") == 1
    assert value(samples, "stale_engines", server="rl") == 1
    for state, n in server.fleet.by_state().items():  # (stale weights, memory released)
        assert value(samples, "engines", server="rl", state=state.value) == n
    error = {"server": "rl", "call": "update_weights", "outcome": "error"}
    assert value(samples, "call_seconds_count", **error) == 1

    await server.update_weights(push_reaching("/ckpt/2", "actor/0", "actor/1", "actor/2"), "v2")
    await engines[2].close()  # dies: the next phase finds it dead
    with pytest.raises(Exception):  # noqa: B017 (the policy's error; the records are the point)
        await server.onload_kv()
    samples = await scrape(url)
    assert value(samples, "engines", server="rl", state="dead") == 1
    assert value(samples, "engine_calls_total", server="rl", phase="kv", outcome="dead") == 1
    stale = sum(1 for r in server.fleet.records() if r.stale)
    assert value(samples, "stale_engines", server="rl") == stale
    for state, n in server.fleet.by_state().items():
        assert value(samples, "engines", server="rl", state=state.value) == n


async def test_the_gauges_are_read_at_the_scrape_whatever_changed_the_records(
    exporter: tuple[PrometheusMetrics, str],
) -> None:
    """A probe outside any call that finds an engine dead, and an adopted snapshot: no call
    ends and no state is entered, and the next scrape shows both."""
    metrics, url = exporter
    engines = sims(3)
    server = RolloutServer([EngineGroup("actor", engines)], name="probed")
    metrics.watch(server)
    await engines[1].close()
    outcomes = await server.probe()
    assert outcomes["actor/1"].outcome is Outcome.DEAD
    samples = await scrape(url)
    assert value(samples, "engines", server="probed", state="dead") == 1
    assert value(samples, "engines", server="probed", state="serving") == 2

    source = RolloutServer([EngineGroup("actor", sims(3))], name="source")
    await source.offload()
    later = RolloutServer([EngineGroup("actor", sims(3))], name="adopter")
    metrics.watch(later)
    assert value(await scrape(url), "server_state", server="adopter", state="serving") == 1
    later.adopt(source.snapshot())
    samples = await scrape(url)
    assert value(samples, "server_state", server="adopter", state="released") == 1
    assert value(samples, "engines", server="adopter", state="released") == 3


async def test_a_failing_exporter_never_fails_the_call(
    exporter: tuple[PrometheusMetrics, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics, url = exporter
    server = RolloutServer([EngineGroup("actor", sims(2))], name="sturdy")
    metrics.watch(server)

    def broken(*labels: str) -> None:
        raise RuntimeError("the exporter broke")

    monkeypatch.setattr(metrics._kept[PHASES], "labels", broken)
    with capture_logs() as logs:
        await server.offload()
    assert server.state is ServerState.RELEASED
    failed = [e for e in logs if e["event"] == "metrics.failed"]
    assert len(failed) == 3 and "the exporter broke" in str(failed[0]["error"])  # a phase each
    assert value(await scrape(url), "server_state", server="sturdy", state="released") == 1


async def test_requests_lost_and_resubmitted_are_the_generation_clients_counts(
    exporter: tuple[PrometheusMetrics, str],
) -> None:
    metrics, url = exporter
    engines = sims(2, token_latency=0.002)
    server = RolloutServer(
        [EngineGroup("actor", engines)],
        LifecycleConfig(pause_mode=PauseMode.ABORT),
        name="gen",
    )
    metrics.watch(server)
    assert not any(n.startswith("rollout_lifecycle_requests") for n, _ in await scrape(url))
    # (long enough to be running when the offload's pause aborts them, 0.8 s each; the
    # assertions below hold whichever were)
    requests = [{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400}}] * 4
    batch = asyncio.ensure_future(server.generate_batch(requests))
    await until(lambda: sum(e.stats()["in_flight"] for e in engines) == 4)
    await server.offload()  # aborts them: each is resubmitted once the fleet serves again
    await server.onload()
    answers = await asyncio.wait_for(batch, BOUND)
    samples = await scrape(url)
    stats = server.generation.stats()
    assert value(samples, "requests_total", server="gen", outcome="completed") == 4
    assert value(samples, "requests_total", server="gen", outcome="failed") == 0
    resubmitted = sum(a["meta_info"]["num_resubmissions"] for a in answers)
    assert value(samples, "request_resubmissions_total", server="gen") == resubmitted
    assert stats["resubmissions"] == resubmitted
    assert value(samples, "requests_in_flight", server="gen") == 0


@pytest.mark.usefixtures("own_lock_dir")
async def test_a_call_refused_by_another_controllers_claim_is_a_claim_conflict(
    exporter: tuple[PrometheusMetrics, str],
    two_standins: list[StandInServer],
    http_clients: list[SGLangHTTPEngine],
) -> None:
    metrics, url = exporter
    http_clients.extend(SGLangHTTPEngine(s.url, retries=0) for s in two_standins)
    server = RolloutServer([EngineGroup("actor", list(http_clients))], name="trainer")
    metrics.watch(server)
    other = HostClaims().acquire(
        [f"address:{url_identity(s.url)}" for s in two_standins],
        {"pid": 1, "server": "operator", "call": "pause"},
    )
    try:
        with pytest.raises(EngineClaimed):
            await server.pause()
    finally:
        other.release()
    samples = await scrape(url)
    assert value(samples, "claim_conflicts_total", server="trainer", call="pause") == 1
    assert not any(n.endswith("call_seconds_count") for n, _ in samples)  # it never began
    await server.pause()
    samples = await scrape(url)
    assert value(samples, "call_seconds_count", server="trainer", call="pause", outcome="ok") == 1
    assert value(samples, "claim_conflicts_total", server="trainer", call="pause") == 1


def test_two_servers_of_one_name_are_refused_and_a_stopped_watch_stops_counting() -> None:
    metrics = PrometheusMetrics()
    first = RolloutServer([EngineGroup("actor", sims(1))], name="same")
    stop = metrics.watch(first)
    with pytest.raises(InvalidArgument, match="'same' is watched already"):
        metrics.watch(RolloutServer([EngineGroup("actor", sims(1))], name="same"))
    stop()
    asyncio.run(first.pause())
    assert "phase_seconds_count" not in metrics.text()
    metrics.watch(RolloutServer([EngineGroup("actor", sims(1))], name="same"))  # free again


def test_ray_metrics_are_refused_without_ray_or_with_a_bad_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (tests/system/test_multinode.py reads them back from a cluster's metrics agent)
    with pytest.raises(InvalidArgument, match="every must be"):
        RayMetrics(every=0)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(InvalidArgument, match=r"connect this process to Ray \(ray.init\)"):
        RayMetrics()
