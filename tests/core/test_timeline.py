"""The timeline: one span per phase and per engine call, a Chrome trace, a Gantt chart, bounded."""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    InvalidArgument,
    LifecycleConfig,
    PhaseFailed,
    RolloutServer,
    SimulatedEngine,
    Span,
    Timeline,
)
from rollout_lifecycle.testing import calls_received, collector_load
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import no_push

Fleet = Callable[..., list[Any]]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LATENCY = {"release_memory_occupation": (0.0, 0.01), "resume_memory_occupation": (0.0, 0.01)}


def sims(count: int, prefix: str = "sim") -> list[SimulatedEngine]:
    return [
        SimulatedEngine(f"{prefix}-{i}", token_latency=0.001, op_latency=LATENCY, seed=i)
        for i in range(count)
    ]


async def cycle(server: RolloutServer, version: str = "v1") -> None:
    await server.offload()
    await server.onload_weights()
    await server.update_weights(no_push, version=version)
    await server.onload_kv()


def trace_of(server: RolloutServer, tmp_path: Path) -> dict[str, Any]:
    path = server.timeline.export_chrome_trace(tmp_path / "trace.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def engine_tracks(trace: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] != 1
    }


async def test_the_trace_has_exactly_one_span_per_engine_call(tmp_path: Path) -> None:
    groups = {"a": sims(2, "a"), "b": sims(3, "b")}
    server = RolloutServer([EngineGroup(name, engines) for name, engines in groups.items()])
    await cycle(server)
    await server.probe()
    trace = trace_of(server, tmp_path)
    tracks = engine_tracks(trace)
    calls = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "engine_call"]
    by_engine: dict[str, Counter[str]] = {}
    for event in calls:
        by_engine.setdefault(tracks[(event["pid"], event["tid"])], Counter())[event["name"]] += 1
    received = {
        f"{name}/{i}": calls_received(e.history())
        for name, es in groups.items()
        for i, e in enumerate(es)
    }
    for engine, history in received.items():
        # the engine's own record of what it received (the reads of each check in its call)
        assert by_engine[engine] == Counter(e["op"] for e in history)
    assert len(calls) == sum(len(history) for history in received.values())
    # One process for the server, one per group; one track per engine.
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert sorted(names.values()) == ["group a", "group b", f"server {server.name}"]
    assert sorted(tracks.values()) == ["a/0", "a/1", "b/0", "b/1", "b/2"]
    assert len({pid for pid, _ in tracks}) == 2


async def test_engine_spans_hold_the_engines_own_times_inside_their_phases(
    tmp_path: Path,
) -> None:
    engines = sims(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    await cycle(server)
    trace = trace_of(server, tmp_path)
    origin = trace["otherData"]["origin_s"]
    tracks = engine_tracks(trace)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    phases = [e for e in events if e["cat"] == "phase"]
    slack = 2.0  # microseconds of rounding
    for index, engine in enumerate(engines):
        spans = [
            e
            for e in events
            if e["cat"] == "engine_call" and tracks[(e["pid"], e["tid"])] == f"actor/{index}"
        ]
        history = calls_received(engine.history())
        assert [s["name"] for s in spans] == [h["op"] for h in history]
        for span, entry in zip(spans, history, strict=True):
            # Microseconds since the origin; the server issued the call before the engine
            # started it and gathered the answer after the engine ended it.
            assert span["ts"] <= (entry["start"] - origin) * 1e6 + slack
            assert span["ts"] + span["dur"] >= (entry["end"] - origin) * 1e6 - slack
            (phase,) = [p for p in phases if p["name"] == span["args"]["phase"]]
            assert phase["ts"] - slack <= span["ts"]
            assert span["ts"] + span["dur"] <= phase["ts"] + phase["dur"] + slack
    # Phases are barriers: each ends before the next one starts.
    for earlier, later in itertools.pairwise(phases):
        assert earlier["ts"] + earlier["dur"] <= later["ts"] + slack


async def test_spans_name_call_phase_state_engine_group_op_and_outcome() -> None:
    engines = [FaultyEngine(e) for e in sims(2)]
    server = RolloutServer([EngineGroup("actor", engines)])
    engines[1].arm("flush_cache", "reject")
    with pytest.raises(PhaseFailed):
        await server.offload()
    spans = server.timeline.spans()
    (call,) = server.timeline.spans("call")
    assert (call.name, call.call_index, call.outcome) == ("offload", 1, "error")
    phase_names = [s.name for s in server.timeline.spans("phase")]
    assert phase_names == ["pause", "flush", "continue_after_failure"]
    flush = [s for s in spans if s.kind == "engine_call" and s.phase == "flush"]
    assert {(s.engine, s.group, s.op, s.outcome) for s in flush} == {
        ("actor/0", "actor", "flush_cache", "ok"),
        ("actor/1", "actor", "flush_cache", "rejected"),
    }
    assert all(s.call == "offload" and s.state == "pausing" for s in flush)
    (failed,) = [s for s in spans if s.kind == "phase" and s.outcome == "failed"]
    assert failed.name == "flush"
    assert all(isinstance(s, Span) and s.end >= s.start for s in spans)


async def test_probe_and_calls_from_hooks_are_on_the_timeline() -> None:
    server = RolloutServer([EngineGroup("actor", sims(2))])

    async def push_on_wake(event: Any) -> None:
        await event.server.update_weights(no_push, version="v2")

    server.on("weights_restored", push_on_wake)
    await server.offload()
    await server.onload()
    await server.probe()
    calls = [(s.name, s.call_index) for s in server.timeline.spans("call")]
    assert calls == [("offload", 1), ("onload", 2), ("probe", 3)]
    nested = {s.name for s in server.timeline.spans("phase") if s.call == "update_weights"}
    assert {"begin_weight_update", "push", "end_weight_update"} <= nested
    assert all(s.call_index == 2 for s in server.timeline.spans() if s.call == "update_weights")


async def test_the_timeline_keeps_the_last_calls_and_can_be_cleared() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], LifecycleConfig(timeline_calls=3))
    await cycle(server, "v1")
    await cycle(server, "v2")  # calls 5..8
    assert len(server.timeline) == 3
    assert [s.call_index for s in server.timeline.spans("call")] == [6, 7, 8]
    assert [s.name for s in server.timeline.spans("call")] == [
        "onload_weights",
        "update_weights",
        "onload_kv",
    ]
    kept = server.timeline.spans("engine_call")
    assert {s.call_index for s in kept} == {6, 7, 8}
    server.timeline.clear()
    assert server.timeline.spans() == [] and len(server.timeline) == 0
    await server.offload()
    assert [s.call_index for s in server.timeline.spans("call")] == [9]


async def test_a_timeline_of_zero_calls_records_nothing_and_metrics_still_work() -> None:
    server = RolloutServer([EngineGroup("actor", sims(2))], LifecycleConfig(timeline_calls=0))
    metrics = await server.offload()
    assert "lifecycle/offload/release_s" in metrics
    assert server.timeline.spans() == []
    assert server.timeline.chrome_trace()["traceEvents"][0]["ph"] == "M"


async def test_recorded_engine_calls_cost_the_collector_nothing() -> None:
    """The timeline keeps a record per engine call (thousands per phase on a large fleet): the
    records must not be objects that every full collection of the process walks."""
    server = RolloutServer([EngineGroup("actor", sims(32))])

    async def cycles(count: int) -> None:
        for _ in range(count):
            await server.offload()
            await server.onload()

    await cycles(2)
    load = collector_load(server.timeline)
    await cycles(4)  # 8 more calls kept, 32 x 6 x 4 = 768 engine calls
    assert len(server.timeline.spans("engine_call")) == 32 * 6 * 6
    assert collector_load(server.timeline) - load < 8 * 60  # what the calls and phases cost


def test_bad_timeline_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="timeline_calls"):
        LifecycleConfig(timeline_calls=-1)
    with pytest.raises(InvalidArgument, match="memory_metrics"):
        LifecycleConfig(memory_metrics=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="kind"):
        Timeline().spans("engine")
    with pytest.raises(InvalidArgument, match="max_engines"):
        Timeline().plot_gantt("x.png", max_engines=0)


async def test_the_gantt_chart_is_a_png_with_a_row_per_engine(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    server = RolloutServer([EngineGroup("actor", sims(5))])
    await cycle(server)
    full = server.timeline.plot_gantt(tmp_path / "all.png")
    capped = server.timeline.plot_gantt(tmp_path / "two.png", max_engines=2)
    for path in (full, capped):
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(full)
    # 12 x (1.5 + 0.3 per row) inches at 100 dpi; rows: calls, phases and the engines shown.
    assert pixels.shape[:2] == (round((1.5 + 0.3 * (2 + 5)) * 100), 1200)
    assert image.imread(capped).shape[:2] == (round((1.5 + 0.3 * (2 + 2)) * 100), 1200)
    assert pixels[..., :3].std() > 0  # something is drawn


async def test_without_matplotlib_the_error_names_the_plot_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = RolloutServer([EngineGroup("actor", sims(1))])
    await server.offload()
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"rollout-lifecycle\[plot\]"):
        server.timeline.plot_gantt(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


async def test_ray_engine_actors_get_one_span_per_call(
    engine_actors: Fleet, tmp_path: Path
) -> None:
    actors = engine_actors(3, label="ray", token_latency=0.001)
    server = RolloutServer([EngineGroup("actor", actors)])
    await cycle(server)
    trace = trace_of(server, tmp_path)
    tracks = engine_tracks(trace)
    seen = Counter(
        tracks[(e["pid"], e["tid"])]
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "engine_call"
    )
    for index, actor in enumerate(actors):
        assert seen[f"actor/{index}"] == len(calls_received(await actor.history.remote()))
    assert (tmp_path / "gantt.png").exists() is False
    png = server.timeline.plot_gantt(tmp_path / "gantt.png")
    assert png.read_bytes()[:8] == PNG_SIGNATURE
