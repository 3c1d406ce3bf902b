"""The benchmarks' regression guard: at a size CI can afford, the ratios whose targets
benchmarks/README.md states, each measured within one run (the contenders' rounds interleaved,
so that the machine's load hits them alike), and a failure when one passes its limit: a bound
well past its target, where load alone does not take it (each ratio's below).

- **in process**: the library's cycle against the raw floor (``growth``) on 1,000 simulated
  engines. The target (10 us of library time per engine per phase on a raw floor of about
  70 us) is about 1.15; the guard fails past 2.0, where a regression such as the identity
  checks' first version (x2.9) lands.
- **on Ray**: the library's cycle against the best bare-Ray floor (``overhead``: the faster
  of one ``asyncio.gather`` and one blocking ``ray.get`` per phase) on 16 single-engine actors
  with U(5, 20) ms ops. The target is 1.10 (64 actors); the guard fails past 1.5.

Every round's engine calls are checked as the full benchmarks check them (no barrier violated,
every call made); a violation fails the guard whatever the ratios.

    python -m benchmarks.guard            # ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks import growth, overhead
from benchmarks._common import machine, median, table
from rollout_lifecycle.testing import local_ray


@dataclass(frozen=True)
class Ratio:
    """One guarded ratio: what it compares, what it came to, its target and its limit."""

    name: str
    value: float
    target: float
    limit: float
    #: Invariant failures of the run it came from (barrier violations, incomplete rounds).
    faults: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        """Past its limit (or not a number), or its run broke an invariant."""
        return not self.value <= self.limit or bool(self.faults)


async def in_process(engines: int, rounds: int) -> Ratio:
    """The library's cycle against the raw floor on ``engines`` in-process engines."""
    point = await growth.measure(engines, rounds)
    faults = list(point.violations)
    if point.incomplete:
        faults.append(f"{point.incomplete} incomplete rounds")
    value = median([lib / raw for lib, raw in zip(point.library, point.raw, strict=True)])
    return Ratio(
        f"library / raw floor, {engines} in-process engines", value, 1.15, 2.0, tuple(faults)
    )


async def on_ray(actors: int, rounds: int) -> Ratio:
    """The library's cycle against the best bare-Ray floor on ``actors`` single-engine Ray
    actors."""
    result = await overhead.run_fleet(
        actors=actors, servers=min(4, actors), rounds=rounds, seq_budget_s=0
    )
    faults = [f"{name}: {found}" for name, found in result.violations.items() if found] + [
        f"{name}: {n} incomplete rounds" for name, n in result.incomplete.items() if n
    ]
    value = median(result.times[overhead.LIBRARY]) / result.best_floor
    return Ratio(f"library / best floor, {actors} Ray actors", value, 1.10, 1.5, tuple(faults))


def report(ratios: Sequence[Ratio]) -> str:
    """The guard's table."""
    rows = [
        [
            r.name,
            f"{r.value:.3f}",
            f"{r.target:.2f}",
            f"{r.limit:.2f}",
            "; ".join(r.faults) or "-",
            "FAIL" if r.failed else "ok",
        ]
        for r in ratios
    ]
    return table(["ratio", "measured", "target", "limit", "invariant faults", "verdict"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the guard from the command line; exit 1 when a ratio fails."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=1000, help="in-process engines")
    parser.add_argument("--rounds", type=int, default=7, help="timed cycles per contender")
    parser.add_argument("--actors", type=int, default=16, help="single-engine Ray actors")
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    ratios = [asyncio.run(in_process(args.engines, args.rounds))]
    with local_ray():
        ratios.append(asyncio.run(on_ray(args.actors, args.rounds)))
    print(report(ratios))
    failed = [r.name for r in ratios if r.failed]
    if failed:
        print(f"benchmarks.guard: past the limit or broken: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
