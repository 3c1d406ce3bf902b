"""What weight verification costs a push: the same push from disk to N in-process simulated
engines, verified (``update_weights(verify=True)``: a fingerprint read on every engine before
and after the push, and the comparison) and not, in interleaved rounds.

Prints, per fleet size, the median seconds of a push each way, their ratio, and the two
verification phases (``fingerprint_before``, ``verify_weights``) per push and per engine. The
simulated engine answers its fingerprint at once: this measures the library's side (the reads'
round trips through the phase runner and the comparison), not an engine hashing its weights,
which real servers add (``benchmarks.real_sglang`` and ``docs/design.md`` give those).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from benchmarks._common import median, table
from rollout_lifecycle import EngineGroup, FromDisk, LifecycleConfig, RolloutServer
from rollout_lifecycle.testing import simulated_engines

PHASES = ("fingerprint_before", "verify_weights")


async def measure(engines: int, rounds: int) -> dict[str, float]:
    """Median seconds of an unverified and a verified push to ``engines`` engines, and of the
    verification phases."""
    fleet = simulated_engines(engines, token_latency=0.001)
    config = LifecycleConfig(timeline_calls=0)
    server = RolloutServer([EngineGroup("actor", fleet)], config=config)
    await server.pause()
    plain: list[float] = []
    verified: list[float] = []
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    for i in range(rounds):
        for verify in (False, True) if i % 2 == 0 else (True, False):
            start = time.perf_counter()
            metrics = await server.update_weights(
                FromDisk(f"/ckpt/{i}-{verify}"), f"v{i}-{verify}", verify=verify
            )
            (verified if verify else plain).append(time.perf_counter() - start)
            if verify:
                for phase in PHASES:
                    phases[phase].append(metrics[f"lifecycle/update_weights/{phase}_s"])
    await server.resume()
    for engine in fleet:
        await engine.close()
    out = {"engines": engines, "plain_s": median(plain), "verified_s": median(verified)}
    out.update({f"{p}_s": median(v) for p, v in phases.items()})
    return out


def report(points: Sequence[dict[str, float]]) -> str:
    rows = []
    for p in points:
        check = p["fingerprint_before_s"] + p["verify_weights_s"]
        rows.append(
            [
                int(p["engines"]),
                f"{p['plain_s']:.4f}",
                f"{p['verified_s']:.4f}",
                f"{p['verified_s'] / p['plain_s']:.2f}",
                f"{check:.4f}",
                f"{check / p['engines'] * 1e6:.1f}",
            ]
        )
    headers = ["engines", "push s", "verified push s", "ratio", "verification s", "us/engine"]
    return table(headers, rows)


async def run(sizes: Sequence[int], rounds: int) -> list[dict[str, float]]:
    return [await measure(n, rounds) for n in sizes]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    points = asyncio.run(run(args.sizes, args.rounds))
    print(report(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
