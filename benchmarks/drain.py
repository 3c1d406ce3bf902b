"""Drain under load: how long ``offload()`` takes with N requests in flight whose remaining
decode is long, by how the drain treats them, and how many requests are lost.

Modes, on the same Ray engine actors, each timed from the offload request until every engine
has released its memory:

- ``idle``: nothing in flight (the reference);
- ``retract``: ``pause_mode=retract``: running requests give back their KV cache and wait; they
  finish after ``onload_kv()``;
- ``abort``: ``pause_mode=abort``: requests return at once with their partial output; the
  generation client resubmits each as prompt + partial output once the engines serve again;
- ``wait``: let every request finish, then offload (what a drain without pause costs).

Requests go through the generation client (``server.generate_batch``); after the onload every
answer must be complete (all ``max_new_tokens`` tokens, finish reason ``length``), else it
counts as lost. Each trial's engine histories are checked for barrier violations.

    python -m benchmarks.drain
    python -m benchmarks.drain --in-flight 256 --remaining-s 1 5 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from benchmarks._common import (
    CYCLE_OPS,
    complete_round,
    machine,
    median,
    rounds_by_index,
    table,
    violations,
)
from rollout_lifecycle import EngineGroup, LifecycleConfig, PauseMode, RolloutServer
from rollout_lifecycle.testing import local_ray, simulated_engine_actors

MODES = ("retract", "abort", "wait")


@dataclass
class Trial:
    """One offload of one mode at one remaining decode time."""

    mode: str
    remaining_s: float
    offload_s: float
    requests: int = 0
    lost: int = 0
    retractions: int = 0
    resubmissions: int = 0


@dataclass
class DrainResult:
    """Every trial of a run, and the invariant checks of their rounds."""

    engines: int
    in_flight: int
    token_latency_s: float
    op_latency_s: float
    trials: list[Trial] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    incomplete: int = 0


async def _running(engines: Sequence[Any]) -> int:
    stats = await asyncio.gather(*(e.stats.remote() for e in engines))
    return sum(s["running"] for s in stats)


async def _trial(
    server: RolloutServer,
    engines: Sequence[Any],
    mode: str,
    in_flight: int,
    remaining_s: float,
    token_latency: float,
    tag: int,
) -> Trial:
    if mode == "idle" or in_flight == 0:
        began = time.perf_counter()
        await server.offload()
        took = time.perf_counter() - began
        await server.onload_weights()
        await server.onload_kv()
        return Trial(mode, remaining_s, took)
    tokens = max(1, math.ceil(remaining_s / token_latency))
    requests = [
        {"input_ids": [tag, i + 1], "sampling_params": {"max_new_tokens": tokens}}
        for i in range(in_flight)
    ]
    batch = asyncio.ensure_future(server.generate_batch(requests))
    deadline = time.monotonic() + 30
    while await _running(engines) < in_flight:  # every request decoding, none queued
        if time.monotonic() > deadline or batch.done():
            batch.cancel()
            raise RuntimeError(f"{in_flight} requests did not all start decoding")
        await asyncio.sleep(0.01)
    began = time.perf_counter()
    if mode == "wait":
        await asyncio.wait_for(asyncio.shield(batch), remaining_s * 3 + 30)
    await server.offload()
    took = time.perf_counter() - began
    await server.onload_weights()
    await server.onload_kv()
    answers = await asyncio.wait_for(batch, remaining_s * 3 + 30)
    lost = sum(
        1
        for a in answers
        if len(a["output_ids"]) != tokens or a["meta_info"]["finish_reason"]["type"] != "length"
    )
    return Trial(
        mode,
        remaining_s,
        took,
        requests=len(answers),
        lost=lost + in_flight - len(answers),
        retractions=sum(a["meta_info"]["num_retractions"] for a in answers),
        resubmissions=sum(a["meta_info"]["num_resubmissions"] for a in answers),
    )


async def run_drain(
    *,
    engines: int = 4,
    in_flight: int = 64,
    remaining_s: Sequence[float] = (1.0, 4.0),
    repeats: int = 3,
    token_latency_s: float = 0.005,
    op_latency_s: float = 0.02,
) -> DrainResult:
    """Run every mode ``repeats`` times at each remaining decode time; needs a running Ray."""
    actors = simulated_engine_actors(
        engines,
        label="drain",
        token_latency=token_latency_s,
        op_latency=dict.fromkeys(CYCLE_OPS, op_latency_s),
    )
    result = DrainResult(engines, in_flight, token_latency_s, op_latency_s)
    servers = {
        mode: RolloutServer(
            [EngineGroup("actor", actors)], LifecycleConfig(pause_mode=mode), name=f"drain-{mode}"
        )
        for mode in (PauseMode.RETRACT, PauseMode.ABORT)
    }
    try:
        await asyncio.gather(*(a.ping.remote() for a in actors))
        tag = 0
        for _ in range(repeats):
            for seconds in remaining_s:
                for mode in ("idle", *MODES):
                    tag += 1
                    server = servers[PauseMode.ABORT if mode == "abort" else PauseMode.RETRACT]
                    trial = await _trial(
                        server, actors, mode, in_flight, seconds, token_latency_s, tag
                    )
                    result.trials.append(trial)
        labels = [f"drain-{i}" for i in range(engines)]
        histories = dict(
            zip(labels, await asyncio.gather(*(a.history.remote() for a in actors)), strict=True)
        )
        per_round = rounds_by_index(histories)
        if len(per_round) != len(result.trials):
            raise RuntimeError(f"engines ran {len(per_round)} rounds, trials {len(result.trials)}")
        for round_histories in per_round:
            result.violations += violations(round_histories, [labels])
            result.incomplete += 0 if complete_round(round_histories, labels) else 1
    finally:
        for server in servers.values():
            server.generation.close()
        for actor in actors:
            ray.kill(actor)
    return result


def report(result: DrainResult) -> str:
    """Offload latency per mode and remaining decode, as a multiple of the idle offload."""
    idle = median([t.offload_s for t in result.trials if t.mode == "idle"])
    rows: list[list[object]] = [["idle", "-", len([1 for t in result.trials if t.mode == "idle"])]]
    rows[0] += [f"{idle * 1000:.1f}", "1.00", 0, 0, 0, 0]
    for mode in MODES:
        for seconds in sorted({t.remaining_s for t in result.trials}):
            trials = [t for t in result.trials if t.mode == mode and t.remaining_s == seconds]
            if not trials:
                continue
            took = median([t.offload_s for t in trials])
            rows.append(
                [
                    mode,
                    f"{seconds:g}",
                    len(trials),
                    f"{took * 1000:.1f}",
                    f"{took / idle:.2f}",
                    sum(t.requests for t in trials),
                    sum(t.lost for t in trials),
                    sum(t.retractions for t in trials),
                    sum(t.resubmissions for t in trials),
                ]
            )
    head = (
        f"{result.engines} engines, {result.in_flight} requests in flight, "
        f"{result.token_latency_s * 1000:g} ms per token, {result.op_latency_s * 1000:g} ms per "
        f"engine op; barrier violations {len(result.violations)}, incomplete rounds "
        f"{result.incomplete}"
    )
    headers = [
        "mode",
        "remaining decode s",
        "trials",
        "offload median ms",
        "x idle",
        "requests",
        "lost",
        "retractions",
        "resubmissions",
    ]
    return f"{head}\n{table(headers, rows)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=64, help="requests in flight")
    parser.add_argument(
        "--remaining-s",
        type=float,
        nargs="+",
        default=[1.0, 4.0],
        help="decode time each request still has at the offload (default 1 4)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--token-latency-ms", type=float, default=5.0)
    parser.add_argument("--op-latency-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    with local_ray():
        result = asyncio.run(
            run_drain(
                engines=args.engines,
                in_flight=args.in_flight,
                remaining_s=args.remaining_s,
                repeats=args.repeats,
                token_latency_s=args.token_latency_ms / 1000,
                op_latency_s=args.op_latency_ms / 1000,
            )
        )
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
