"""Growth: the library's own cost per engine per phase at 100, 1,000 and 10,000 engines.

In-process simulated engines with zero op latency (an ``EngineGroup`` accepts bare backends),
so a cycle's time is the library's bookkeeping plus the engines' own work. The raw floor runs
the same calls on the same engines with a bare ``asyncio.gather`` per phase; the library's own
cost is the difference (median of the per-round differences; rounds alternate the two), divided
by engines x phases. Linear growth makes the 10,000 / 1,000 ratio 10.

Time spent in CPython's cyclic garbage collector during each cycle is recorded too (through
``gc.callbacks``), so the tables also show each cost without it: a full collection walks every
live object in the process, so its cost grows with the fleet's heap, not with the cycle.
``--gc-freeze`` takes the fleet out of the collector's reach after the warm-up (``gc.freeze()``),
as if the engines lived in other processes, as they do in production.

    python -m benchmarks.growth
    python -m benchmarks.growth --gc-freeze
    python -m benchmarks.growth --sizes 1000 10000 --rounds 9 --profile /tmp/growth.txt
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from benchmarks._common import (
    CYCLE_CALLS,
    Profile,
    complete_round,
    library_cycle,
    machine,
    median,
    table,
    violations,
)
from rollout_lifecycle import EngineGroup, EngineHost, RolloutServer, SimulatedEngine

PHASES = len(CYCLE_CALLS)


class GcClock:
    """Seconds spent in the cyclic garbage collector, and full collections, while running."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.full += info["generation"] == 2

    @contextmanager
    def running(self) -> Iterator[GcClock]:
        """Count the collections that happen in the body."""
        self.seconds, self.full = 0.0, 0
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)


@dataclass
class GrowthPoint:
    """One fleet size's measurements (one entry per timed cycle)."""

    engines: int
    raw: list[float] = field(default_factory=list)
    library: list[float] = field(default_factory=list)
    raw_gc: list[float] = field(default_factory=list)
    library_gc: list[float] = field(default_factory=list)
    raw_full: list[int] = field(default_factory=list)
    library_full: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    incomplete: int = 0
    #: Timed rounds whose engine calls were checked (violations, completeness).
    checked: int = 0

    @property
    def own_s(self) -> float:
        """The library's own cost of one cycle: median of per-round (library - raw)."""
        return median([lib - raw for lib, raw in zip(self.library, self.raw, strict=True)])

    @property
    def own_without_gc_s(self) -> float:
        """The library's own cost of one cycle with the collector's time taken out of both."""
        pairs = zip(self.library, self.library_gc, self.raw, self.raw_gc, strict=True)
        return median([(lib - lgc) - (raw - rgc) for lib, lgc, raw, rgc in pairs])

    def per_engine_phase_us(self, seconds: float) -> float:
        """``seconds`` of one cycle as microseconds per engine per phase."""
        return seconds / (self.engines * PHASES) * 1e6


async def raw_cycle(hosts: Sequence[EngineHost]) -> None:
    """The floor: per phase, one bare ``asyncio.gather`` of every engine's call."""
    for _, op, args in CYCLE_CALLS:
        await asyncio.gather(*(getattr(h, op)(*args) for h in hosts))


async def measure(
    engines: int, rounds: int, profile: Profile | None = None, *, freeze: bool = False
) -> GrowthPoint:
    """Time ``rounds`` cycles of each contender on ``engines`` in-process engines; with
    ``freeze``, everything alive after the warm-up (the fleet) is moved out of the collector's
    reach with ``gc.freeze()``, as if the engines lived in other processes."""
    profile = profile or Profile(None)
    fleet = [SimulatedEngine(f"sim-{i}", seed=i) for i in range(engines)]
    server = RolloutServer([EngineGroup("actor", fleet)])
    hosts: list[EngineHost] = list(server.groups[0].engines)
    point = GrowthPoint(engines)
    clock = GcClock()
    labels = [e.label for e in fleet]

    def check_round() -> None:
        # Each round's calls are taken from the engines right after it (untimed), so that their
        # histories, and the work of keeping them, stay the same size through the run.
        round_histories = {e.label: e.take_history() for e in fleet}
        point.violations += violations(round_histories, [labels])
        point.incomplete += 0 if complete_round(round_histories, labels) else 1
        point.checked += 1

    try:
        await raw_cycle(hosts)  # warm-up: starts every engine's scheduler task
        await library_cycle(server)
        for engine in fleet:
            engine.take_history()
        if freeze:
            gc.collect()
            gc.freeze()
        for k in range(rounds):
            for name in ("raw", "library") if k % 2 == 0 else ("library", "raw"):
                gc.collect()
                with clock.running():
                    began = time.perf_counter()
                    if name == "raw":
                        await raw_cycle(hosts)
                    else:
                        with profile.running():
                            await library_cycle(server)
                    took = time.perf_counter() - began
                getattr(point, name).append(took)
                getattr(point, f"{name}_gc").append(clock.seconds)
                getattr(point, f"{name}_full").append(clock.full)
                check_round()
        profile.write(f"library cycles, {engines} in-process engines")
    finally:
        gc.unfreeze()
        await asyncio.gather(*(e.close() for e in fleet))
    return point


def report(points: Sequence[GrowthPoint]) -> str:
    """The growth table and the ratio of each size to the one 10x smaller."""
    rows: list[list[object]] = []
    for p in points:
        lib, raw = median(p.library), median(p.raw)
        us = p.per_engine_phase_us
        rows.append(
            [
                p.engines,
                len(p.library),
                f"{raw:.4f}",
                f"{lib:.4f}",
                f"{us(raw):.1f}",
                f"{us(lib):.1f}",
                f"{us(p.own_s):.1f}",
                f"{us(p.own_without_gc_s):.1f}",
                f"{median(p.raw_gc):.3f} / {median(p.library_gc):.3f}",
                f"{median(p.raw_full):g} / {median(p.library_full):g}",
                len(p.violations),
                p.incomplete,
            ]
        )
    headers = [
        "engines",
        "cycles",
        "raw s",
        "library s",
        "raw us/eng/phase",
        "library us/eng/phase",
        "library own us/eng/phase",
        "own without gc",
        "gc s raw / lib",
        "full gcs raw / lib",
        "violations",
        "incomplete",
    ]
    lines = [table(headers, rows)]
    by_size = {p.engines: p for p in points}
    for big in sorted(by_size):
        small = by_size.get(big // 10)
        if small is None or big % 10:
            continue
        b = by_size[big]

        def no_gc(p: GrowthPoint, name: str) -> float:
            times, gcs = getattr(p, name), getattr(p, f"{name}_gc")
            return median([t - g for t, g in zip(times, gcs, strict=True)])

        lines.append(
            f"{big:,} / {small.engines:,} (linear: 10): "
            f"library cycle x{median(b.library) / median(small.library):.1f}, "
            f"raw cycle x{median(b.raw) / median(small.raw):.1f}, "
            f"library own cost x{b.own_s / small.own_s:.1f}; without gc: "
            f"library cycle x{no_gc(b, 'library') / no_gc(small, 'library'):.1f}, "
            f"raw cycle x{no_gc(b, 'raw') / no_gc(small, 'raw'):.1f}, "
            f"library own cost x{b.own_without_gc_s / small.own_without_gc_s:.1f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument(
        "--rounds", type=int, help="timed cycles per contender (default: 41, 31, 15 by size)"
    )
    parser.add_argument("--profile", help="append a pyinstrument profile of the largest size here")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() the fleet after the warm-up: full collections then walk only what the "
        "cycles allocate, as in a driver whose engines live in other processes",
    )
    args = parser.parse_args(argv)
    print(
        f"machine: {machine()}" + (" (fleet frozen out of the collector)" if args.gc_freeze else "")
    )
    points = []
    for engines in args.sizes:
        rounds = args.rounds or (41 if engines <= 100 else 31 if engines <= 1000 else 15)
        profile = Profile(args.profile if engines == max(args.sizes) else None)
        points.append(asyncio.run(measure(engines, rounds, profile, freeze=args.gc_freeze)))
        print(f"{engines} engines done", flush=True)
    print(report(points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
