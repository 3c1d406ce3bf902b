"""Every benchmark at tiny sizes, on the session's Ray cluster: they keep working and their runs
keep the lifecycle invariants. Invariants are asserted, never times."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from benchmarks import (
    drain,
    growth,
    guard,
    identity,
    lease,
    memory_plan,
    order,
    overhead,
    path,
    real_routes,
    real_sglang,
    soak,
    soak_property,
    soak_traffic,
    table,
    verify,
)
from benchmarks._common import CYCLE_CALLS, ServerLog
from rollout_lifecycle.contract.ops import CHECKED_OPS, Op

GB = memory_plan.GB


def _check_fleet(result: overhead.FleetResult) -> None:
    stopped = result.seq_calls[0] < result.engines * len(CYCLE_CALLS)
    for name in (
        overhead.RAW,
        overhead.RAY_GET,
        overhead.LIBRARY,
        overhead.SLIME,
        overhead.SEQUENTIAL,
    ):
        assert result.times[name], name
        assert result.violations[name] == [], name
        assert result.incomplete[name] == 0, name
        if name == overhead.SEQUENTIAL and stopped:
            continue  # timed only up to its budget
        for took, bound in zip(result.times[name], result.bounds[name], strict=True):
            # Phases are barriers: the slowest call of each phase fits inside the cycle.
            assert 0 < bound <= took, (name, bound, took)
    table = overhead.report(result)
    assert "slime-style (2 servers)" in table and "x best floor" in table
    floors = [statistics.median(result.times[name]) for name in (overhead.RAW, overhead.RAY_GET)]
    assert result.best_floor == min(floors)


async def test_overhead_runs_every_contender_on_actor_and_hosted_fleets(ray_cluster: None) -> None:
    actors = await overhead.run_fleet(
        actors=2, servers=2, rounds=1, seq_budget_s=None, latency_ms=(1.0, 2.0)
    )
    _check_fleet(actors)
    assert actors.seq_calls == [2 * len(CYCLE_CALLS)]
    # Hosted engines, and a sequential loop stopped at once by its budget: the rest of its
    # cycle still completes, phase by phase.
    hosted = await overhead.run_fleet(
        actors=1, per_actor=3, servers=2, rounds=1, seq_budget_s=1e-9, latency_ms=(1.0, 2.0)
    )
    _check_fleet(hosted)
    assert hosted.engines == 3
    assert hosted.seq_calls[0] < 3 * len(CYCLE_CALLS)
    assert "stopped after" in overhead.report(hosted)


async def test_slime_style_flush_polls_a_busy_engine_every_second(
    engine_actors: Callable[..., list[Any]],
) -> None:
    (engine,) = engine_actors(1, token_latency=0.005)
    request = engine.generate.remote({"input_ids": [1], "sampling_params": {"max_new_tokens": 60}})
    for _ in range(500):
        if (await engine.stats.remote())["running"]:
            break
        await asyncio.sleep(0.01)
    began = time.monotonic()
    attempts = overhead.slime_flush([engine])
    assert attempts >= 2
    assert time.monotonic() - began >= overhead.SLIME_FLUSH_POLL_S
    assert len((await request)["output_ids"]) == 60  # the flush waited for it, lost nothing
    flushes = [e for e in await engine.history.remote() if e["op"] == "flush_cache"]
    assert [e["outcome"] for e in flushes] == ["rejected"] * (attempts - 1) + ["ok"]


@pytest.mark.parametrize("freeze", [False, True])
async def test_growth_measures_both_contenders_without_violations(freeze: bool) -> None:
    points = [await growth.measure(n, rounds=2, freeze=freeze) for n in (5, 50)]
    for point in points:
        assert len(point.library) == len(point.raw) == 2
        assert point.checked == 4 and point.violations == [] and point.incomplete == 0
    assert "50 / 5" in growth.report(points)
    assert gc.get_freeze_count() == 0  # nothing left frozen


async def test_the_guard_measures_both_ratios_and_fails_a_ratio_past_its_limit(
    ray_cluster: None,
) -> None:
    ratios = [await guard.in_process(20, rounds=2), await guard.on_ray(2, rounds=1)]
    for ratio in ratios:
        assert ratio.value > 0 and ratio.faults == () and ratio.target < ratio.limit
    assert "library / raw floor, 20 in-process" in guard.report(ratios)
    assert "library / best floor, 2 Ray actors" in guard.report(ratios)
    # The verdict: past the limit, not a number, or a broken invariant fails; at it, passes.
    at_limit = dataclasses.replace(ratios[0], value=ratios[0].limit)
    assert not at_limit.failed
    assert dataclasses.replace(at_limit, value=at_limit.limit * 1.01).failed
    assert dataclasses.replace(at_limit, value=float("nan")).failed
    assert dataclasses.replace(at_limit, faults=("a barrier violated",)).failed
    assert "FAIL" in guard.report([dataclasses.replace(at_limit, value=9.0)])


async def test_verify_measures_a_push_with_and_without_its_verification() -> None:
    points = await verify.run([2, 6], rounds=2)
    assert [p["engines"] for p in points] == [2, 6]
    for point in points:
        assert point["plain_s"] > 0 and point["verified_s"] > 0
        assert point["fingerprint_before_s"] > 0 and point["verify_weights_s"] > 0
    assert "verified push s" in verify.report(points)


def test_identity_checks_the_phases_the_library_checks() -> None:
    checked = {op.value for op in CHECKED_OPS}
    for phase in identity.PHASES:
        assert phase.checked == (phase.op in checked), phase
        assert phase.reads(0.0) == ()  # back to back, every answer proves the next call
        # `EngineRecord.expect`, spaced: the first checked call of each call reads (a pause of
        # a serving engine its incarnation too), the others are proven by the answers before.
        first = phase.name in ("pause", "resume_weights", "begin_weight_update", "resume_kv")
        assert bool(phase.reads(identity.SPACED_S)) == first, phase
        assert ("incarnation" in phase.reads(identity.SPACED_S)) == (phase.op == Op.PAUSE.value)
    assert {p.op for p in identity.PHASES if p.checked} == checked  # every one is measured


@pytest.mark.parametrize("gap", list(identity.PACES.values()))
async def test_identity_times_both_contenders_and_the_checks_really_read(gap: float) -> None:
    run = await identity.run_in_process(engines=3, rounds=2, gap=gap)
    for name in identity.CONTENDERS:
        assert len(run.cycles[name]) == 2, name  # every round ran a cycle of each
        assert run.inspected[name] == 2 and run.bad[name] == [], name
        for cycle in run.cycles[name]:
            assert all(p.key in cycle for p in identity.PHASES), name
            # The phases are inside the cycle's calls, one after another.
            assert 0 < cycle[identity.CHECKED_SUM_KEY] <= cycle[identity.CYCLE_KEY], name
    # With checks, every check read what the pace calls for (the simulator answers a check's
    # read in one `observe`; `inspect_cycle` compared every engine's reads, by the op they
    # checked); the patched baseline sent plain.
    # At least what the pace forces; at most one per checked call, which a machine that stalls
    # past the proof window between two calls adds.
    least, most = identity.expected_reads(gap).total(), identity.possible_reads().total()
    assert (least, most) == (0 if not gap else 4, 7)
    assert len(run.reads[identity.CHECKED]) == 2
    assert all(least <= n <= most for n in run.reads[identity.CHECKED])
    assert run.reads[identity.UNCHECKED] == [0, 0]
    # Read through server_info / ping / ready, spaced: the pause reads all three (a serving
    # engine's incarnation and pause state), the three others the pause state.
    assert identity.expected_reads(gap, one_call=False).total() == (0 if not gap else 3 + 3 * 2)
    assert run.final_state == "serving" and run.dead == 0
    text = identity.report(run)
    assert "update_weight_version" in text and "added us per engine" in text


async def test_drain_loses_no_request_in_any_mode(ray_cluster: None) -> None:
    result = await drain.run_drain(
        engines=2,
        in_flight=4,
        remaining_s=(0.3,),
        repeats=1,
        token_latency_s=0.005,
        op_latency_s=0.002,
    )
    assert result.violations == [] and result.incomplete == 0
    by_mode = {t.mode: t for t in result.trials}
    assert set(by_mode) == {"idle", *drain.MODES}
    for mode in drain.MODES:
        trial = by_mode[mode]
        assert trial.requests == 4 and trial.lost == 0, trial
    assert by_mode["retract"].retractions >= 4 and by_mode["retract"].resubmissions == 0
    assert by_mode["abort"].resubmissions >= 4 and by_mode["abort"].retractions == 0
    assert by_mode["wait"].retractions == by_mode["wait"].resubmissions == 0
    assert "x idle" in drain.report(result)


async def test_memory_plan_peaks_follow_from_the_per_tag_accounting(ray_cluster: None) -> None:
    setup = memory_plan.Setup(gpus=2)
    at_once, staged = await memory_plan.run_plan(setup)
    engine = setup.weights + setup.kv_cache + setup.cuda_graph
    assert at_once.update_peak == engine + setup.at_push
    assert staged.update_peak == max(setup.weights + setup.at_push, engine)
    assert at_once.trainer_at_kv_wake == setup.at_push and staged.trainer_at_kv_wake == 0
    assert at_once.training_peak == staged.training_peak == setup.training
    text = memory_plan.report(setup, [at_once, staged])
    assert "MODEL (not a measurement)" in text and "NO (out of memory)" in text


def test_memory_plan_refuses_weights_larger_than_the_pool() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        _ = memory_plan.Setup(params=400e9).kv_cache


def test_order_sends_the_same_batches_in_phase_or_server_order() -> None:
    a, b, c = "a", "b", "c"
    ops = [op for _, op, _ in CYCLE_CALLS]
    everyone = order.cycle_batches(order.ALL_AT_ONCE, [[a, b], [c]])
    assert [(list(h), op) for h, op, _ in everyone] == [([a, b, c], op) for op in ops]
    by_phase = order.cycle_batches(order.PHASE_ORDER, [[a, b], [c]])
    assert [(list(h), op) for h, op, _ in by_phase] == [
        (server, op) for op in ops for server in ([a, b], [c])
    ]
    by_server = order.cycle_batches(order.SERVER_ORDER, [[a, b], [c]])
    offload, weights, kv = ops[:3], ops[3:4], ops[4:]
    assert [(list(h), op) for h, op, _ in by_server] == [
        (server, op)
        for phases in (offload, weights, kv)
        for server in ([a, b], [c])
        for op in phases
    ]
    assert sorted(map(repr, by_server)) == sorted(map(repr, by_phase))  # the same batches
    with pytest.raises(ValueError, match="'sideways'"):
        order.cycle_batches("sideways", [[a]])


async def test_order_times_every_order_without_violations(ray_cluster: None) -> None:
    result = await order.run_orders(actors=3, servers=2, rounds=1, latency_ms=(1.0, 2.0))
    for name in order.ORDERS:
        assert len(result.times[name]) == len(result.cpu[name]) == 1
        assert result.violations[name] == [] and result.incomplete[name] == 0
    assert "by server, server order" in order.report(result)


# -- the soak (benchmarks/soak.py) at tiny sizes ----------------------------------------------


def test_the_traffic_soak_in_process_loses_nothing_through_deaths_and_both_modes() -> None:
    result = soak_traffic.run_soak_in_process(
        requests=400, cycles=4, legs=2, engines=4, death_every=1, seed=3
    )
    assert [leg["mode"] for leg in result.per_leg] == ["retract", "abort"]
    assert result.cycles == 4 and result.submitted == 400
    assert result.completed == 400 and result.lost == 0 and result.unsent == 0
    assert result.violations == 0 and result.errors == []
    assert result.deaths == result.recoveries == 4
    assert result.aborted_under_retract == 0 and result.aborted > 0  # the abort leg aborts
    assert len(result.rss_mb) == 4
    assert result.leaves == result.joins == 1  # (an actor engine churned at cycle 3)


def test_the_property_soak_counts_steps_and_reports_every_example() -> None:
    result = soak_property.soak_property(steps=150, batch_examples=8, workers=1, progress=False)
    assert result.steps >= 150 and result.violations == 0
    assert all(b.returncode == 0 for b in result.batches)
    totals = result.totals()
    assert totals["examples"] == len(result.rows) >= 1
    assert totals["steps"] == result.steps == sum(r["steps"] for r in result.rows)


def test_the_soak_fails_on_a_loss_or_a_violation(capsys: pytest.CaptureFixture[str]) -> None:
    clean = soak_traffic.TrafficReport(
        "in-process", 1, 1, 10, 10, 0, 0, 0, 0, 0, 0, 1.0, [(0, 90.0)]
    )
    assert soak.report(None, [clean]) == []
    lost = dataclasses.replace(clean, completed=9, lost=1)
    assert soak.report(None, [lost]) != []
    broken = soak_property.PropertyReport(
        [soak_property.Batch(0, 1, 1, 1.0, [_example(passed=False)], "invariant 1 violated")]
    )
    assert broken.violations == 1 and soak.report(broken, []) != []
    assert "invariant 1 violated" in capsys.readouterr().out
    stopped = soak_property.PropertyReport([soak_property.Batch(0, 1, 0, 1.0, [_example()])])
    assert stopped.violations == 0 and soak.report(stopped, []) == []


def _example(passed: bool = True) -> dict[str, Any]:
    """A report line as the property machine writes it."""
    return {
        "steps": 3,
        "passed": passed,
        "stopped": False,
        "error": None if passed else "AssertionError",
        "outcomes": {"length": 1},
        "requests": 1,
        "maxrss_mb": 100.0,
    }


#: The most package modules one offload may cross from the public call to an engine's request
#: (docs/design.md, "One offload").
MOST_MODULES = 12


async def test_one_offload_crosses_at_most_twelve_modules_to_each_request(
    ray_cluster: None,
) -> None:
    """In process, the stack at every HTTP request; on Ray, the driver's stack at every actor
    call plus what runs in the actor (the in-process chain from the engine host down)."""
    local = await path.http_chains()
    paths = [name for name, _ in local]
    assert {"/pause_generation", "/flush_cache", "/release_memory_occupation"} <= set(paths)
    for name, chain in local:
        assert chain[0] == "core/server" and chain[-1] == "backends/http/transport", chain
        assert len(set(chain)) <= MOST_MODULES, (name, chain)
    (pause,) = [chain for name, chain in local if name == "/pause_generation"]
    actor_side = pause[pause.index("backends/engine") :]
    assert "core/reconcile" in pause and "core/runner" in pause  # through the reconciler
    remote = await path.ray_chains()
    assert {"checked", "flush_cache", "release_memory_occupation"} <= {n for n, _ in remote}
    for name, chain in remote:
        assert chain[-1] == "backends/ray_transport", chain
        assert len(set(chain) | set(actor_side)) <= MOST_MODULES, (name, chain)


async def test_lease_times_the_three_servers_on_one_fleet(ray_cluster: None) -> None:
    args = argparse.Namespace(engines=2, rounds=2, nodes=1, latency_ms=(0.0, 0.0))
    times = await lease.run(args)
    assert set(times) == {"host claims", "cluster lease", "lease + journal"}
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())


def test_the_step_timeline_reads_sglangs_log_lines_and_sets_calls_against_them() -> None:
    # The format SGLang 0.5.23 logs with SGLANG_LOG_MS (utils/common.py configure_logger) and
    # the line of a decode step (metrics_reporter.report_decode_stats); a step that ends
    # 3 ms after a call was sent and a call answered 30 ms after that end.
    lines = [
        "[2026-12-01 23:14:05.100 TP0] Decode batch, #running-req: 4, #token: 40, ",
        '[2026-12-01 23:14:05] INFO:     127.0.0.1:50932 - "GET /ping HTTP/1.1" 200 OK',
        "[2026-12-01 23:14:05.107] Decode batch, #running-req: 4, #token: 44, ",
    ]
    ends = real_routes.steps(lines)
    assert len(ends) == 2
    assert ends[1] - ends[0] == pytest.approx(0.007, abs=1e-6)
    sent = ends[1] - 0.003
    calls = [("traffic", "/server_info", sent, ends[1] + 0.030)]
    text = real_routes.against_steps(calls, ends)
    assert "decode step: 7.0 ms median" in text
    row = next(line for line in text.splitlines() if "/server_info" in line)
    assert "| 3.0 (3.0-3.0)" in row and "| 30.0 (30.0-30.0)" in row


def test_vllms_routes_are_set_against_the_streams_chunks() -> None:
    # vLLM logs no step: the chunks' arrivals are the timeline. Chunks of one step come
    # together (within 1 ms) and count as one; a wake answered before the next chunk, and a
    # /resume that waited 19 ms for it and answered 8 ms after.
    arrivals = [10.0, 10.0004, 10.003, 10.0032, 10.050, 10.0502]
    calls = [
        ("traffic", "/wake_up?tags=kv_cache", 10.020, 10.025),
        ("traffic", "/resume", 10.031, 10.058),
    ]
    text = real_routes.against_steps(calls, arrivals, "vllm")
    assert "decode step: 24.7 ms median (2.6-46.8, 2 steps)" in text  # (between clusters)
    wake = next(line for line in text.splitlines() if "kv_cache" in line)
    resume = next(line for line in text.splitlines() if "/resume" in line)
    assert wake.rstrip(" |").endswith("| 1")  # answered before the step's end
    assert "| 19.0 (19.0-19.0)" in resume and "| 8.0 (8.0-8.0)" in resume
    assert "/server_info" not in text  # (SGLang's routes)


def test_a_servers_log_keeps_its_lines_and_lets_every_other_event_go_on() -> None:
    log = ServerLog()
    with pytest.raises(structlog.DropEvent):
        log(None, "info", {"event": "sglang.log", "line": "[WeightChecker] checksum ... 0.012s"})
    other = {"event": "phase.end", "phase": "pause"}
    assert log(None, "info", other) is other
    assert log.take() == ["[WeightChecker] checksum ... 0.012s"] and log.take() == []
    found = real_sglang.CHECKSUM_LINE.search(
        "[2026-12-01 23:14:05] [WeightChecker] checksum computed for 148 tensors in 0.012s"
    )
    assert found is not None and float(found[1]) == 0.012


async def test_the_table_measures_every_in_process_ratio_and_judges_it() -> None:
    argv = ["--engines", "20", "--big", "200", "--rounds", "1", "--big-rounds", "1"]
    rows: list[table.Row] = []
    await table.in_process(rows, table.parser().parse_args(argv))
    assert [r.what for r in rows] == [
        "library / raw floor",
        "library's own time per engine per phase",
        "growth of the library's own time",
        "checked / unchecked cycle",
        "verified / unverified push",
    ]
    assert all(math.isfinite(r.value) and not r.faults for r in rows)
    judged = {r.what: r.cells()[4] for r in rows}
    assert judged["verified / unverified push"] == "-"  # (no target of its own)
    own = rows[1]
    assert judged[own.what] == ("met" if own.value <= 10 else "missed")
