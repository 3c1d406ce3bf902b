"""Call order when there is nothing to overlap: why slime-style keeps up when ops take no time.

Concurrency pays by overlapping engines' waiting. With op latencies near zero on 64
single-engine actors, a cycle is CPU work shared by the driver and 64 actor processes on this
machine's 2 cores: there is no waiting to overlap, and ``benchmarks.overhead`` shows the
slime-style baseline ahead of the raw floor and the library. This script sends the same calls
with no library code, one blocking ``ray.get`` per batch, in three orders:

- ``all at once``: per phase, every engine's call in one batch (the library's fan-out, with
  none of its cost);
- ``by server, phase order``: per phase, one batch per server, servers one after another; the
  barrier is still server-wide (every engine finishes a phase before any starts the next);
- ``by server, server order``: slime's order; per lifecycle call, each server runs all its
  phases before the next server starts, so the barrier is per server only.

If sending everything at once is no faster than slime's order, an orchestrator that costs any
CPU at all cannot be faster than slime-style in that regime. The table shows each order's
cycle time and the CPU time every process on the machine used during it (``/proc/stat``, both
cores). Barrier violations are counted across all engines for the first two orders and within
each server for the third (across all engines it breaks the server-wide barrier by design).

    python -m benchmarks.order                          # ops of 0 ms
    python -m benchmarks.order --latency-ms 5 20        # overhead's default latencies
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from benchmarks._common import (
    CYCLE_CALLS,
    CYCLE_OPS,
    LIFECYCLE_CALLS,
    add_latency_argument,
    complete_round,
    machine,
    median,
    rounds_by_index,
    send,
    table,
    violations,
)
from rollout_lifecycle.testing import local_ray, simulated_engine_actors

ALL_AT_ONCE = "all at once"
PHASE_ORDER = "by server, phase order"
SERVER_ORDER = "by server, server order"
ORDERS = (ALL_AT_ONCE, PHASE_ORDER, SERVER_ORDER)


@dataclass
class OrderResult:
    """Per order: cycle seconds, machine-wide CPU seconds per cycle (None where the host does
    not report it), barrier violations and incomplete rounds."""

    engines: int
    servers: int
    latency_ms: tuple[float, float]
    times: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float | None]] = field(default_factory=dict)
    violations: dict[str, list[str]] = field(default_factory=dict)
    incomplete: dict[str, int] = field(default_factory=dict)


def busy_cpu_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (not idle, not waiting for
    I/O), from ``/proc/stat``; None where there is no such file."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle, iowait = ticks[3], ticks[4]
    return (sum(ticks) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def run_batches(batches: Sequence[tuple[Sequence[Any], str, tuple[Any, ...]]]) -> None:
    """Each batch: one call per handle, then one blocking ``ray.get``; batches in order."""
    for handles, op, args in batches:
        ray.get([send(h, op, args) for h in handles])


def cycle_batches(order: str, servers: Sequence[Sequence[Any]]) -> list[Any]:
    """The batches of one cycle in ``order``."""
    phases = [(op, args) for _, op, args in CYCLE_CALLS]
    by_name = {name: (op, args) for name, op, args in CYCLE_CALLS}
    if order == ALL_AT_ONCE:
        everyone = [h for server in servers for h in server]
        return [(everyone, op, args) for op, args in phases]
    if order == PHASE_ORDER:
        return [(server, op, args) for op, args in phases for server in servers]
    if order == SERVER_ORDER:
        return [
            (server, *by_name[phase])
            for names in LIFECYCLE_CALLS
            for server in servers
            for phase in names
        ]
    raise ValueError(f"unknown order {order!r}; expected one of {', '.join(ORDERS)}")


async def run_orders(
    *,
    actors: int = 64,
    servers: int = 4,
    rounds: int = 15,
    latency_ms: tuple[float, float] = (0.0, 0.0),
    seed: int = 0,
) -> OrderResult:
    """Start the fleet, time every order, check every round; needs a running Ray."""
    if servers < 1 or servers > actors:
        raise ValueError(f"servers must be between 1 and the number of engines, got {servers}")
    low, high = latency_ms[0] / 1000, latency_ms[1] / 1000
    started = simulated_engine_actors(
        actors, op_latency=dict.fromkeys(CYCLE_OPS, (low, high)), seed=seed, label="sim"
    )
    try:
        await asyncio.gather(*(a.ping.remote() for a in started))
        handles = list(started)
        cuts = [round(i * actors / servers) for i in range(servers + 1)]
        split = [handles[a:b] for a, b in itertools.pairwise(cuts)]
        labels = [f"sim-{i}" for i in range(actors)]
        by_server = [labels[a:b] for a, b in itertools.pairwise(cuts)]
        result = OrderResult(actors, servers, latency_ms)
        plans = {order: cycle_batches(order, split) for order in ORDERS}
        ran: list[str | None] = []
        for batches in plans.values():  # warm-up
            run_batches(batches)
            ran.append(None)
        for k in range(rounds):
            for order in ORDERS[k % 3 :] + ORDERS[: k % 3]:
                gc.collect()
                cpu, began = busy_cpu_s(), time.perf_counter()
                run_batches(plans[order])
                took, cpu_after = time.perf_counter() - began, busy_cpu_s()
                result.times.setdefault(order, []).append(took)
                used = None if cpu is None or cpu_after is None else cpu_after - cpu
                result.cpu.setdefault(order, []).append(used)
                ran.append(order)
        histories = await asyncio.gather(*(a.history.remote() for a in started))
        per_round = rounds_by_index(dict(zip(labels, histories, strict=True)))
        if len(per_round) != len(ran):
            raise RuntimeError(f"engines ran {len(per_round)} rounds, the benchmark {len(ran)}")
        for who, round_histories in zip(ran, per_round, strict=True):
            if who is None:
                continue
            found = violations(round_histories, by_server if who == SERVER_ORDER else [labels])
            result.violations.setdefault(who, []).extend(found)
            missing = 0 if complete_round(round_histories, labels) else 1
            result.incomplete[who] = result.incomplete.get(who, 0) + missing
    finally:
        for actor in started:
            ray.kill(actor)
    return result


def report(result: OrderResult) -> str:
    """The table: each order's cycle time, its ratio to all-at-once, CPU used, checks."""
    base = median(result.times[ALL_AT_ONCE])
    rows: list[list[object]] = []
    for order in ORDERS:
        times = result.times[order]
        cpu = [c for c in result.cpu[order] if c is not None]
        rows.append(
            [
                order,
                len(times),
                f"{median(times):.3f}",
                f"{min(times):.3f}-{max(times):.3f}",
                f"{median(times) / base:.3f}",
                f"{median(cpu):.3f}" if cpu else "-",
                len(result.violations.get(order, [])),
                result.incomplete.get(order, 0),
            ]
        )
    lo, hi = result.latency_ms
    head = (
        f"{result.engines} engines (Ray actors), {result.servers} servers, "
        f"op latency U({lo:g}, {hi:g}) ms; one blocking ray.get per batch, no library code"
    )
    headers = [
        "order",
        "cycles",
        "median s",
        "min-max s",
        "x all at once",
        "busy CPU s (all processes)",
        "violations",
        "incomplete",
    ]
    return f"{head}\n{table(headers, rows)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=64, help="single-engine actors (64)")
    parser.add_argument("--servers", type=int, default=4, help="servers, default 4")
    parser.add_argument("--rounds", type=int, default=15, help="timed cycles per order")
    add_latency_argument(parser, (0.0, 0.0))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    with local_ray():
        result = asyncio.run(
            run_orders(
                actors=args.actors,
                servers=args.servers,
                rounds=args.rounds,
                latency_ms=(args.latency_ms[0], args.latency_ms[1]),
                seed=args.seed,
            )
        )
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
