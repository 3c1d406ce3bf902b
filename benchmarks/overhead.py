"""Overhead at Ray scale: one full cycle (offload + onload weights + onload KV) on simulated
engines with seeded random op latencies, by every contender on the same engines in one run.

Contenders, each timed per cycle:

- ``lower bound``: per phase, the slowest engine's call as the engines measured it, summed;
- ``raw floor``: a bare ``asyncio.gather`` of the same calls per phase, no library;
- ``ray.get floor``: the same calls per phase, then one blocking ``ray.get`` of all their refs
  (the other bare way to wait; the ``best floor`` is the faster of the two floors' medians);
- ``library``: ``RolloutServer.offload() / onload_weights() / onload_kv()``;
- ``slime-style``: the engines split into servers processed one after another, one blocking
  ``ray.get`` per server per phase, flush sent once and polled every 1 s until it passes;
- ``sequential``: a naive loop awaiting one engine call at a time (stopped at a time budget,
  then its time is a lower bound).

Engines are Ray actors with one engine each (``--fleet 64x1``) or async actors hosting many
engines each (``--fleet 16x64``). Rounds interleave the contenders (rotating their order), so
machine noise hits all of them alike; the sequential loop runs after them. Every round's engine
histories are checked for barrier violations (within each server for slime-style, across all
engines for the others) and for a complete, successful cycle on every engine.

    python -m benchmarks.overhead                        # 64x1 and 16x64 (1,024 engines)
    python -m benchmarks.overhead --fleet 64x1 --rounds 15 --latency-ms 0 0
    python -m benchmarks.overhead --fleet 16x64 --profile /tmp/overhead-profile.txt
    python -m benchmarks.overhead --fleet 64x1 --nodes 3 --seq-budget-s 0

With ``--nodes N`` the fleet runs on a cluster of N nodes on this machine (``LocalCluster``,
each its own raylet), its actors spread over them through a placement group (``SPREAD``, one
bundle per actor), the driver on the head node: every call but the head's third crosses
raylets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from benchmarks._common import (
    CYCLE_CALLS,
    CYCLE_OPS,
    LIFECYCLE_CALLS,
    Profile,
    add_latency_argument,
    complete_round,
    library_cycle,
    lower_bound,
    machine,
    median,
    rounds_by_index,
    send,
    table,
    violations,
)
from rollout_lifecycle import EngineGroup, EnginePlacement, RolloutServer
from rollout_lifecycle.testing import (
    LocalCluster,
    fleet_factories,
    local_ray,
    simulated_engine_actors,
    simulated_multi_engine_actors,
)

RAW = "raw floor"
RAY_GET = "ray.get floor"
LIBRARY = "library"
SLIME = "slime-style"
SEQUENTIAL = "sequential"
#: slime's flush: one attempt (the engine does not wait for idleness), then every second.
SLIME_FLUSH_POLL_S = 1.0
SLIME_FLUSH_TRIES = 60


@dataclass
class FleetResult:
    """What one fleet's run measured."""

    actors: int
    per_actor: int
    servers: int
    latency_ms: tuple[float, float]
    start_s: float
    #: Nodes of the cluster the actors are spread over (1: one local raylet).
    nodes: int = 1
    #: Contender -> seconds of each timed cycle.
    times: dict[str, list[float]] = field(default_factory=dict)
    #: Contender -> the lower bound of each of its timed cycles (same order as ``times``).
    bounds: dict[str, list[float]] = field(default_factory=dict)
    #: Contender -> barrier violations and fatal ops found in its rounds.
    violations: dict[str, list[str]] = field(default_factory=dict)
    #: Contender -> rounds in which some engine did not run every phase once, successfully.
    incomplete: dict[str, int] = field(default_factory=dict)
    #: Calls the sequential loop made one at a time in each cycle (all of them: engines x 6).
    seq_calls: list[int] = field(default_factory=list)

    @property
    def engines(self) -> int:
        """Engines in the fleet."""
        return self.actors * self.per_actor

    @property
    def best_floor(self) -> float:
        """The faster of the two bare-Ray floors' median cycles (``raw floor``, ``ray.get``)."""
        return min(median(self.times[name]) for name in (RAW, RAY_GET) if name in self.times)


async def raw_cycle(handles: Sequence[Any]) -> None:
    """The floor: per phase, every call issued, then one bare ``asyncio.gather``."""
    for _, op, args in CYCLE_CALLS:
        await asyncio.gather(*(send(h, op, args) for h in handles))


def ray_get_cycle(handles: Sequence[Any]) -> None:
    """The other floor: per phase, every call issued, then one blocking ``ray.get`` of them all."""
    for _, op, args in CYCLE_CALLS:
        ray.get([send(h, op, args) for h in handles])


async def sequential_cycle(
    handles: Sequence[Any], budget_s: float | None = None
) -> tuple[float, int]:
    """The naive loop: one engine call at a time. Returns its seconds and the calls it made.

    Past ``budget_s`` it stops: the rest of the cycle is finished with one gather per phase
    (untimed, so that the engines end the cycle serving) and its time is a lower bound.
    """
    start = time.perf_counter()
    stopped: float | None = None
    made = 0
    for _, op, args in CYCLE_CALLS:
        rest: Sequence[Any] = ()
        for i, handle in enumerate(handles):
            if stopped is None and budget_s is not None and time.perf_counter() - start > budget_s:
                stopped = time.perf_counter() - start
            if stopped is not None:
                rest = handles[i:]
                break
            await send(handle, op, args)
            made += 1
        if rest:
            await asyncio.gather(*(send(h, op, args) for h in rest))
    return (time.perf_counter() - start if stopped is None else stopped), made


def slime_flush(engines: Sequence[Any]) -> int:
    """slime's flush: one attempt per engine, then the ones not idle again every second.

    Blocks (``ray.get``); returns the number of rounds of attempts it took.
    """
    todo = list(engines)
    for attempt in range(1, SLIME_FLUSH_TRIES + 1):
        refs = [send(h, "flush_cache", (0.0, SLIME_FLUSH_POLL_S)) for h in todo]
        ray.wait(refs, num_returns=len(refs))
        failed = []
        for handle, ref in zip(todo, refs, strict=True):
            try:
                ray.get(ref)
            except Exception:
                failed.append(handle)
        if not failed:
            return attempt
        todo = failed
        time.sleep(SLIME_FLUSH_POLL_S)
    raise TimeoutError(f"slime-style flush: engines not idle after {SLIME_FLUSH_TRIES} tries")


def slime_cycle(servers: Sequence[Sequence[Any]]) -> None:
    """slime-style: servers one after another, one blocking ``ray.get`` per server per phase.

    Each lifecycle call (offload, onload weights, onload KV) walks the servers in turn, as
    slime's ``RolloutManager`` does, and each server runs its phases with a blocking ``ray.get``.
    """
    calls = {name: (op, args) for name, op, args in CYCLE_CALLS}
    for phases in LIFECYCLE_CALLS:
        for engines in servers:
            for phase in phases:
                if phase == "flush":
                    slime_flush(engines)
                    continue
                op, args = calls[phase]
                ray.get([send(h, op, args) for h in engines])


async def _histories(actors: Sequence[Any], hosted: bool) -> list[list[dict[str, Any]]]:
    if hosted:
        per_actor = await asyncio.gather(*(a.histories.remote() for a in actors))
        return [h for group in per_actor for h in group]
    return list(await asyncio.gather(*(a.history.remote() for a in actors)))


async def run_fleet(
    *,
    actors: int,
    per_actor: int = 1,
    servers: int = 4,
    rounds: int = 7,
    seq_budget_s: float | None = 20.0,
    latency_ms: tuple[float, float] = (5.0, 20.0),
    seed: int = 0,
    profile: Profile | None = None,
    nodes: int = 1,
) -> FleetResult:
    """Start the fleet, time every contender, check every round; needs a running Ray.

    ``rounds`` timed cycles of the raw floor, the library and slime-style, then one of the
    sequential loop (``seq_budget_s`` None: no budget; 0: skip it).
    """
    if servers < 1 or servers > actors * per_actor:
        raise ValueError(f"servers must be between 1 and the number of engines, got {servers}")
    low, high = latency_ms[0] / 1000, latency_ms[1] / 1000
    options: dict[str, Any] = {
        "op_latency": dict.fromkeys(CYCLE_OPS, (low, high)),
        "seed": seed,
        "label": "sim",
    }
    start = time.perf_counter()
    hosted = per_actor > 1
    placement = None
    if nodes > 1:
        if hosted:
            raise ValueError("--nodes spreads single-engine actors: use a fleet of Nx1")
        placement = await EnginePlacement.reserve(actors, {"gpu": 1}, strategy="SPREAD")
        started = await placement.start_all(fleet_factories(actors, **options))
        handles: list[Any] = list(started)
    elif hosted:
        started, hosted_handles = simulated_multi_engine_actors(actors, per_actor, **options)
        handles = list(hosted_handles)
    else:
        started = simulated_engine_actors(actors, **options)
        handles = list(started)
    try:
        await asyncio.gather(*(a.ping.remote() for a in started))
        result = FleetResult(
            actors, per_actor, servers, latency_ms, time.perf_counter() - start, nodes
        )
        await _run_contenders(result, started, handles, hosted, rounds, seq_budget_s, profile)
    finally:
        for actor in started:
            ray.kill(actor)
        if placement is not None:
            placement.remove()
    return result


async def _run_contenders(
    result: FleetResult,
    started: Sequence[Any],
    handles: list[Any],
    hosted: bool,
    rounds: int,
    seq_budget_s: float | None,
    profile: Profile | None,
) -> None:
    n = len(handles)
    cuts = [round(i * n / result.servers) for i in range(result.servers + 1)]
    split = [handles[a:b] for a, b in itertools.pairwise(cuts)]
    server = RolloutServer([EngineGroup(f"server{i}", part) for i, part in enumerate(split)])
    labels = [f"sim-{i}" for i in range(n)]
    by_server = [labels[a:b] for a, b in itertools.pairwise(cuts)]
    profile = profile or Profile(None)

    async def library() -> None:
        with profile.running():
            await library_cycle(server)

    async def slime() -> None:
        slime_cycle(split)

    async def ray_get() -> None:
        ray_get_cycle(handles)

    contenders: dict[str, Callable[[], Awaitable[None]]] = {
        RAW: lambda: raw_cycle(handles),
        RAY_GET: ray_get,
        LIBRARY: library,
        SLIME: slime,
    }
    #: Which contender ran each round (None: warm-up, not timed).
    ran: list[str | None] = []
    await raw_cycle(handles)  # warm-up: first calls, imports, worker code paths
    await library_cycle(server)
    ran += [None, None]
    for k in range(rounds):
        names = list(contenders)
        for name in names[k % len(names) :] + names[: k % len(names)]:
            gc.collect()
            began = time.perf_counter()
            await contenders[name]()
            result.times.setdefault(name, []).append(time.perf_counter() - began)
            ran.append(name)
    profile.write(f"library cycles, {n} engines ({result.actors}x{result.per_actor})")
    if seq_budget_s != 0:
        gc.collect()
        took, made = await sequential_cycle(handles, seq_budget_s)
        result.times[SEQUENTIAL] = [took]
        result.seq_calls.append(made)
        ran.append(SEQUENTIAL)
    histories = dict(zip(labels, await _histories(started, hosted), strict=True))
    per_round = rounds_by_index(histories)
    if len(per_round) != len(ran):
        raise RuntimeError(f"engines ran {len(per_round)} rounds, the benchmark {len(ran)}")
    for who, round_histories in zip(ran, per_round, strict=True):
        if who is None:
            continue
        result.bounds.setdefault(who, []).append(lower_bound(round_histories))
        found = violations(round_histories, by_server if who == SLIME else [labels])
        result.violations.setdefault(who, []).extend(found)
        missing = 0 if complete_round(round_histories, labels) else 1
        result.incomplete[who] = result.incomplete.get(who, 0) + missing


def report(result: FleetResult) -> str:
    """The fleet's table: times, ratios to the lower bound and to the floors, checks."""
    all_bounds = [b for v in result.bounds.values() for b in v]
    raw = median(result.times.get(RAW, []))
    best = result.best_floor
    rows: list[list[object]] = [
        ["lower bound", len(all_bounds), f"{median(all_bounds):.3f}", "", "1.00", "", "", "", ""]
    ]
    for name in (RAW, RAY_GET, LIBRARY, SLIME, SEQUENTIAL):
        times = result.times.get(name, [])
        if not times:
            continue
        bounds = result.bounds[name]
        vs_bound = median([t / b for t, b in zip(times, bounds, strict=True)])
        label = f"{SLIME} ({result.servers} servers)" if name == SLIME else name
        mark = ""
        if name == SEQUENTIAL:
            total = result.engines * len(CYCLE_CALLS)
            if result.seq_calls[0] < total:
                mark = ">"  # stopped at its budget: a lower bound
                label += f" (stopped after {result.seq_calls[0]:,} of {total:,} calls)"
        rows.append(
            [
                label,
                len(times),
                f"{mark}{median(times):.3f}",
                f"{min(times):.3f}-{max(times):.3f}" if not mark else "",
                f"{mark}{vs_bound:.2f}",
                f"{mark}{median(times) / raw:.3f}",
                f"{mark}{median(times) / best:.3f}",
                len(result.violations.get(name, [])),
                result.incomplete.get(name, 0),
            ]
        )
    lo, hi = result.latency_ms
    where = f" on {result.nodes} nodes" if result.nodes > 1 else ""
    head = (
        f"{result.engines:,} engines ({result.actors} actors x {result.per_actor}){where}, "
        f"{result.servers} servers (library: one group each), op latency U({lo:g}, {hi:g}) ms, "
        f"fleet started in {result.start_s:.1f} s"
    )
    headers = [
        "contender",
        "cycles",
        "median s",
        "min-max s",
        "x lower bound",
        "x raw floor",
        "x best floor",
        "violations",
        "incomplete",
    ]
    return f"{head}\n{table(headers, rows)}"


def _fleet(text: str) -> tuple[int, int]:
    actors, _, per = text.partition("x")
    return int(actors), int(per or 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--fleet",
        action="append",
        type=_fleet,
        help="ACTORSxENGINES_PER_ACTOR, repeatable (default: 64x1 and 16x64)",
    )
    parser.add_argument("--servers", type=int, default=4, help="servers (groups), default 4")
    parser.add_argument("--rounds", type=int, default=7, help="timed cycles per contender")
    parser.add_argument(
        "--seq-budget-s",
        type=float,
        default=20.0,
        help="stop the sequential loop after this long (0: skip it), default 20",
    )
    add_latency_argument(parser, (5.0, 20.0))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", help="append a pyinstrument profile of the library here")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="spread the actors over a cluster of this many local nodes (Nx1 fleets), default 1",
    )
    args = parser.parse_args(argv)
    fleets = args.fleet or [(64, 1), (16, 64)]
    print(f"machine: {machine()}")
    if args.profile:
        print("profiled run: the library's times include the profiler's overhead")
    if args.nodes > 1:
        most = max(actors for actors, _ in fleets)
        # (one CPU per node: the head's raylet runs the driver; a bundle per actor, spread)
        cluster: contextlib.AbstractContextManager[object] = LocalCluster(
            args.nodes, cpus=1, gpus=math.ceil(most / args.nodes) + 1
        )
    else:
        cluster = local_ray()
    with cluster:
        for actors, per_actor in fleets:
            result = asyncio.run(
                run_fleet(
                    actors=actors,
                    per_actor=per_actor,
                    servers=args.servers,
                    rounds=args.rounds,
                    seq_budget_s=args.seq_budget_s or 0,
                    latency_ms=(args.latency_ms[0], args.latency_ms[1]),
                    seed=args.seed,
                    profile=Profile(args.profile),
                    nodes=args.nodes,
                )
            )
            print(report(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
