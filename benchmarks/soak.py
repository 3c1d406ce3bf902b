"""Soak: the lifecycle under faults for 100,000 property steps, and 100,000 generate requests
over at least 100 offload/onload cycles, with nothing lost.

Three parts, each reported with the same care (``--only`` picks some):

- ``property``: the property state machine with faults (``benchmarks/soak_property.py``) until
  ``--steps`` steps, in batches of fresh processes, ``--workers`` at a time, on a virtual clock.
  Reports steps, examples, violations (each the invariant's text), calls, faults, recoveries,
  requests, and the peak memory of each batch.
- ``in-process`` and ``ray``: requests through the library's generation client while a colocated
  trainer cycles the fleet, legs alternating ``retract`` and ``abort``, an engine killed and
  replaced with ``recover()`` every ``--death-every`` cycles (``benchmarks/soak_traffic.py``).
  In process the simulated engines run on a virtual clock; on Ray they are actor processes in
  real time. Reports requests submitted / completed / aborted / resubmitted / lost, cycles,
  deaths, recoveries, barrier and order violations in the engines' histories, wall time, and the
  driver's memory after the first and the last cycle.
- ``real``: the same traffic soak against real CPU SGLang 0.5.23 servers (``--real``; needs
  ``bash ci/sglang-env``), sized for a CPU.

The exit status is 1 if anything was lost or violated, so a run is a check as well as a
measurement. Typical runs::

    python -m benchmarks.soak                       # the full soak (see benchmarks/README.md)
    python -m benchmarks.soak --small               # CI's size: a minute or two
    python -m benchmarks.soak --only property --steps 20000
    python -m benchmarks.soak --only real --real-cycles 10 --real-requests 640
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import machine, table
from benchmarks.soak_property import PropertyReport, soak_property
from benchmarks.soak_traffic import (
    Knobs,
    TrafficReport,
    cpu_sglang_launch,
    run_soak_in_process,
    soak_on_ray,
    soak_real,
)

PARTS = ("property", "in-process", "ray", "real")
#: The full soak's sizes, and CI's (``--small``).
FULL = {
    "steps": 100_000,
    "requests": 100_000,
    "cycles": 100,
    "legs": 10,
    "ray_requests": 100_000,
    "ray_cycles": 100,
    "death_every": 5,
}
SMALL = {
    "steps": 2_000,
    "requests": 2_000,
    "cycles": 4,
    "legs": 2,
    "ray_requests": 1_000,
    "ray_cycles": 4,
    "death_every": 2,
}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--small", action="store_true", help="CI's size (a minute or two)")
    parser.add_argument(
        "--only", nargs="+", choices=PARTS, help="run these parts (default: all but real)"
    )
    parser.add_argument("--real", action="store_true", help="also run the real-server part")
    parser.add_argument("--steps", type=int, help="property steps (default 100,000)")
    parser.add_argument("--batch", type=int, default=300, help="examples per property batch")
    parser.add_argument("--workers", type=int, default=2, help="property batches at a time")
    parser.add_argument("--requests", type=int, help="in-process requests (default 100,000)")
    parser.add_argument("--cycles", type=int, help="in-process cycles (default 100)")
    parser.add_argument("--legs", type=int, help="fleets, modes alternating (default 10)")
    parser.add_argument("--engines", type=int, default=8, help="engines per fleet (default 8)")
    parser.add_argument("--ray-requests", type=int, help="requests on Ray (default 100,000)")
    parser.add_argument("--ray-cycles", type=int, help="cycles on Ray (default 100)")
    parser.add_argument(
        "--death-every", type=int, help="kill and recover an engine every N cycles (default 5)"
    )
    parser.add_argument("--real-requests", type=int, default=640, help="requests, real servers")
    parser.add_argument("--real-cycles", type=int, default=10, help="cycles, real servers")
    parser.add_argument(
        "--real-death-every", type=int, default=5, help="stop and replace a real server every N"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write every report as JSON here")
    args = parser.parse_args(argv)
    for key, value in (SMALL if args.small else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = args.only or [p for p in PARTS if p != "real" or args.real]
    return args


#: The real-server soak's traffic: long enough answers, and twice the concurrency per cycle,
#: that offloads find requests still decoding on a CPU (each leg's min_in_flight_at_offload
#: says). The real-SGLang test tier runs the soak so too, on its own servers.
REAL_KNOBS = Knobs(concurrency=32, tokens=(16, 64), trainer_step_s=0.2, min_decode_s=0.3)


def run_real(args: argparse.Namespace) -> TrafficReport:
    launch, model = cpu_sglang_launch()
    return asyncio.run(
        soak_real(
            launch=launch,
            model=model,
            servers=2,
            requests=args.real_requests,
            cycles=args.real_cycles,
            legs=2,
            death_every=args.real_death_every,
            seed=args.seed,
            knobs=REAL_KNOBS,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    print(f"soak on {machine()}")
    print(f"parts: {', '.join(args.parts)}", flush=True)
    began = time.monotonic()
    prop: PropertyReport | None = None
    traffic: list[TrafficReport] = []
    if "property" in args.parts:
        print(f"property machine: {args.steps} steps, {args.workers} batches at a time", flush=True)
        prop = soak_property(
            steps=args.steps, batch_examples=args.batch, workers=args.workers, seed=args.seed
        )
    sizes = {"engines": args.engines, "death_every": args.death_every, "seed": args.seed}
    if "in-process" in args.parts:
        print(f"in process: {args.requests} requests, {args.cycles} cycles", flush=True)
        traffic.append(
            run_soak_in_process(requests=args.requests, cycles=args.cycles, legs=args.legs, **sizes)
        )
    if "ray" in args.parts:
        print(f"on Ray: {args.ray_requests} requests, {args.ray_cycles} cycles", flush=True)
        traffic.append(
            soak_on_ray(
                requests=args.ray_requests,
                cycles=args.ray_cycles,
                legs=min(args.legs, args.ray_cycles),
                **sizes,
            )
        )
    if "real" in args.parts:
        print(f"real SGLang: {args.real_requests} requests, {args.real_cycles} cycles", flush=True)
        traffic.append(run_real(args))
    failures = report(prop, traffic)
    print(f"soak done in {time.monotonic() - began:.0f}s: {'FAILED' if failures else 'ok'}")
    for failure in failures:
        print(f"  {failure}")
    if args.json:
        dump(Path(args.json), prop, traffic)
    return 1 if failures else 0


def report(prop: PropertyReport | None, traffic: Sequence[TrafficReport]) -> list[str]:
    """Print the tables; the reasons the soak failed (nothing lost, nothing violated)."""
    failures: list[str] = []
    if prop is not None:
        row = prop.row()
        print("\nproperty machine (faults injected, invariants checked after every step)")
        print(table(list(row), [list(row.values())]))
        totals = prop.totals()
        outcomes = {k[len("outcome_") :]: n for k, n in totals.items() if k.startswith("outcome_")}
        faults = {k[len("faults_") :]: n for k, n in totals.items() if k.startswith("faults_")}
        print(f"  faults by kind: {faults}; request outcomes: {outcomes}")
        print(f"  examples cut short by Hypothesis (out of data): {totals['stopped']}")
        if prop.violations:
            failures.append(f"property machine: {prop.violations} violation(s)")
            for batch in prop.batches:
                if batch.failure:
                    print(f"\n--- batch seed={batch.seed} failed:\n{batch.failure}")
    if traffic:
        rows = [t.row() for t in traffic]
        print("\nrequests through the generation client while the fleet cycles")
        print(table(list(rows[0]), [list(r.values()) for r in rows]))
    for t in traffic:
        curve = t.rss_mb[:: max(1, len(t.rss_mb) // 10)]
        if t.rss_mb and curve[-1] != t.rss_mb[-1]:
            curve.append(t.rss_mb[-1])
        print(
            f"  {t.fleet} driver RSS MiB by cycle: " + ", ".join(f"{c}: {m:.0f}" for c, m in curve)
        )
        for leg in t.per_leg:
            print(f"  {t.fleet} leg: {leg}")
        for note in t.notes:
            print(f"  {t.fleet} note: {note}")
        for error in t.errors:
            print(f"  {t.fleet} error: {error}")
        for sample in t.violation_samples:
            print(f"  {t.fleet} violation: {sample}")
        if t.lost or t.violations or t.aborted_under_retract or t.unsent or t.errors:
            failures.append(
                f"{t.fleet}: lost={t.lost} violations={t.violations} "
                f"aborted under retract={t.aborted_under_retract} unsent={t.unsent} "
                f"errors={len(t.errors)}"
            )
    return failures


def dump(path: Path, prop: PropertyReport | None, traffic: Sequence[TrafficReport]) -> None:
    data: dict[str, Any] = {
        "traffic": [t.row() | {"per_leg": t.per_leg, "rss_mb": t.rss_mb} for t in traffic]
    }
    if prop is not None:
        data["property"] = prop.row() | {
            "totals": dict(prop.totals()),
            "batch_peak_rss_mb": [b.peak_rss_mb for b in prop.batches],
        }
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"reports written to {path}")


if __name__ == "__main__":
    sys.exit(main())
