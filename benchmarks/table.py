"""One run, one table: every ratio benchmarks/README.md sets a target for, measured one after
another in one process, each with the machine's load (the 1-minute load average) at its start
and at its end, so that a ratio is read with the load it was taken under.

Each row is a ratio within one measurement: its contenders' rounds interleaved, so the load
hits them alike (the benchmark it comes from says how).

- **in process**: the library's cycle against the raw floor on 1,000 simulated engines
  (``guard.in_process``); at 10,000 engines the library's own time per engine per phase, and
  its growth from 1,000 (``growth.measure``); the cycle with the identity checks against the
  same cycle without (``identity.run_in_process``); a verified push against an unverified one
  (``verify.measure``);
- **on Ray**: the library's cycle against the best bare-Ray floor (the faster of
  ``asyncio.gather`` and ``ray.get``) at ``--actors`` single-engine actors
  (``guard.on_ray``), and with the checks against without at 16 (``identity.run_on_ray``);
- **on a cluster**: the same library-against-floor ratio with the actors spread over the nodes
  of a ``--nodes``-node local cluster (real raylets on this machine);
- **on real servers** (``--sglang-python``, ``--vllm-python`` and ``--model``): the offload with
  requests decoding against idle on two SGLang and two vLLM servers, and a verified cycle against
  an idle one (``real_sglang``); the checked cycle against the unchecked one on two SGLang
  servers (``identity.run_real``).

    python -m benchmarks.table                        # ~12 min without real servers
    python -m benchmarks.table --cpu \\
        --sglang-python ~/.cache/rollout-lifecycle/sglang-0.5.23/bin/python \\
        --vllm-python ~/.cache/rollout-lifecycle/vllm-0.32.0/bin/python \\
        --model ~/.cache/rollout-lifecycle/tiny-gpt2   # ~25 min
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from benchmarks import growth, guard, identity, lease, real_sglang, verify
from benchmarks._common import machine, median, table
from rollout_lifecycle.testing import local_ray


@dataclass
class Row:
    """One ratio of the table: where it was measured, what it compares, what it came to, its
    target, and the load average at the start and the end of its measurement."""

    where: str
    what: str
    value: float
    target: str = "-"
    #: Whether the target is met (None: no target, or one the table cannot judge).
    met: bool | None = None
    load: tuple[float, float] = (0.0, 0.0)
    #: What went wrong in its run (a barrier broken, a round incomplete, a request lost).
    faults: list[str] = field(default_factory=list)
    #: How the value reads (``"x"``: a ratio; ``"us"``: microseconds).
    unit: str = "x"

    def cells(self) -> list[object]:
        shown = f"{self.value:.1f} us" if self.unit == "us" else f"{self.value:.3f}"
        verdict = "-" if self.met is None else "met" if self.met else "missed"
        return [
            self.where,
            self.what,
            shown,
            self.target,
            verdict,
            f"{self.load[0]:.1f} -> {self.load[1]:.1f}",
            "; ".join(self.faults) or "-",
        ]


def _load() -> float:
    return os.getloadavg()[0]


async def _measured(rows: list[Row], make: Callable[[], Awaitable[list[Row]]]) -> None:
    """Run one measurement, stamp its rows with the load around it, print them as they come."""
    before = _load()
    try:
        made = await make()
    except Exception as exc:  # (one broken measurement must not take the others' rows)
        made = [Row(make.__qualname__.split(".")[0], "(failed)", float("nan"),
                    faults=[f"{type(exc).__name__}: {str(exc)[:300]}"])]  # fmt: skip
    after = _load()
    for row in made:
        row.load = (before, after)
        print(" | ".join(str(c) for c in row.cells()), flush=True)
    rows.extend(made)


def _guarded(where: str, ratio: guard.Ratio) -> Row:
    what = ratio.name.partition(",")[0]  # ("library / raw floor", "library / best floor")
    return Row(where, what, ratio.value, f"<= {ratio.target:.2f}",
               ratio.value <= ratio.target, faults=list(ratio.faults))  # fmt: skip


async def in_process(rows: list[Row], args: argparse.Namespace) -> None:
    """The in-process rows."""

    here, big = f"in process, {args.engines:,} engines", args.big

    async def floor() -> list[Row]:
        return [_guarded(here, await guard.in_process(args.engines, args.rounds))]

    async def growth_rows() -> list[Row]:
        small = await growth.measure(big // 10, args.big_rounds)
        large = await growth.measure(big, args.big_rounds)
        own, grew = large.per_engine_phase_us(large.own_s), large.own_s / small.own_s
        faults = large.violations + small.violations
        return [
            Row(f"in process, {big:,} engines", "library's own time per engine per phase", own,
                "<= 10 us", own <= 10, faults=faults, unit="us"),
            Row(f"in process, {big:,} / {big // 10:,}", "growth of the library's own time",
                grew, "<= 12", grew <= 12),
        ]  # fmt: skip

    async def checks() -> list[Row]:
        run = await identity.run_in_process(args.engines, args.rounds)
        ratio = identity.paired(run)[3]
        faults = [f"{n}: {len(b)} bad cycles" for n, b in run.bad.items() if b]
        return [Row(here, "checked / unchecked cycle", ratio, "<= 1.05", ratio <= 1.05,
                    faults=faults)]  # fmt: skip

    async def verified() -> list[Row]:
        point = await verify.measure(args.engines, args.rounds)
        return [Row(here, "verified / unverified push", point["verified_s"] / point["plain_s"])]

    for make in (floor, growth_rows, checks, verified):
        await _measured(rows, make)


async def on_ray(rows: list[Row], args: argparse.Namespace, where: str, checks: bool) -> None:
    """The rows on the Ray cluster already running (one node or several)."""

    async def floor() -> list[Row]:
        ratio = await guard.on_ray(args.actors, args.rounds)
        return [_guarded(f"{where}, {args.actors} actors", ratio)]

    async def checked() -> list[Row]:
        run = await identity.run_on_ray(16, args.rounds)
        ratio = identity.paired(run)[3]
        faults = [f"{n}: {len(b)} bad cycles" for n, b in run.bad.items() if b]
        return [Row(f"{where}, 16 actors", "checked / unchecked cycle", ratio, "<= 1.05",
                    ratio <= 1.05, faults=faults)]  # fmt: skip

    await _measured(rows, floor)
    if checks:
        await _measured(rows, checked)


async def on_real(rows: list[Row], args: argparse.Namespace) -> None:
    """The rows on real servers."""

    def fleet(kind: str, python: str) -> Callable[[], Awaitable[list[Row]]]:
        # vLLM on a CPU cannot show its weights (its linear layers are packed copies:
        # tests/real/test_real_vllm.py), so only SGLang's verified cycle is measured.
        sglang = kind == "sglang"

        async def phases() -> list[Row]:
            argv = ["--model", args.model, "--rounds", str(args.real_rounds), f"--{kind}-python"]
            argv += [python, "--conditions", "idle", "traffic", *(["verified"] if sglang else [])]
            argv += ["--cpu"] if args.cpu else []
            result = await real_sglang.run(real_sglang.parse(argv))
            lost = sum(c.lost for c in result.cycles)
            faults = [f"{lost} requests lost"] if lost else []
            where = f"real {kind}, 2 servers"

            def of(condition: str, key: str | None) -> float:
                return median(result.values(kind, condition, key))

            busy = of("traffic", None) / of("idle", None)  # (the offload's wall time)
            made = [
                Row(where, "offload with traffic / idle", busy, "<= 1.3" if sglang else "-",
                    busy <= 1.3 if sglang else None, faults=faults),
            ]  # fmt: skip
            less = of("traffic", real_sglang.LESS_WAIT) / of("idle", real_sglang.LESS_WAIT)
            if less == less:  # (NaN where the kernel does not say how long the loop waited)
                made.append(Row(where, "the same, less the loop's wait for a CPU", less))
            if sglang:
                cycle = of("verified", real_sglang.CYCLE) / of("idle", real_sglang.CYCLE)
                hashing = of("verified", real_sglang.HASHING) / of("idle", real_sglang.CYCLE)
                made += [
                    Row(where, "verified / idle cycle (one fingerprint read)", cycle, "<= 1.05",
                        cycle <= 1.05),
                    Row(where, "the servers' own hashing / idle cycle", 1 + hashing),
                ]  # fmt: skip
            return made

        return phases

    async def checks() -> list[Row]:
        runs = await identity.run_real(
            kind="sglang", servers=2, rounds=args.real_rounds, budget_s=90.0, samples=5,
            python=args.sglang_python, model=args.model,
        )  # fmt: skip
        ratio = identity.paired(runs[0])[3]
        faults = [f"{n}: {len(b)} bad cycles" for n, b in runs[0].bad.items() if b]
        return [Row("real sglang, 2 servers", "checked / unchecked cycle", ratio, "<= 1.10",
                    ratio <= 1.10, faults=faults)]  # fmt: skip

    for kind, python in (("sglang", args.sglang_python), ("vllm", args.vllm_python)):
        if python:
            await _measured(rows, fleet(kind, python))
    if args.sglang_python:
        await _measured(rows, checks)


HEADERS = ["where", "ratio", "measured", "target", "", "load avg (start -> end)", "faults"]


def parser() -> argparse.ArgumentParser:
    """The table's command line."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]),
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per contender (7)")
    parser.add_argument("--engines", type=int, default=1000, help="in-process engines (1,000)")
    parser.add_argument("--big", type=int, default=10000, help="the large fleet (10,000)")
    parser.add_argument("--big-rounds", type=int, default=3, help="rounds at 10,000 engines (3)")
    parser.add_argument("--actors", type=int, default=64, help="Ray actors (64)")
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the local cluster (3)")
    parser.add_argument("--sglang-python", metavar="PY")
    parser.add_argument("--vllm-python", metavar="PY")
    parser.add_argument("--model", metavar="PATH", help="the model the real servers load")
    parser.add_argument("--cpu", action="store_true", help="the test tiers' CPU flags and env")
    parser.add_argument("--real-rounds", type=int, default=7, help="cycles per condition (7)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run every measurement and print the table; exit 1 when a run broke an invariant."""
    line = parser()
    args = line.parse_args(argv)
    if (args.sglang_python or args.vllm_python) and not args.model:
        line.error("the real servers need --model")
    began = time.monotonic()
    print(f"machine: {machine()}", flush=True)
    rows: list[Row] = []
    asyncio.run(in_process(rows, args))
    with local_ray():
        asyncio.run(on_ray(rows, args, "Ray, 1 node", checks=True))
    with lease.cluster(args.nodes):
        asyncio.run(on_ray(rows, args, f"Ray, {args.nodes}-node cluster", checks=False))
    if args.sglang_python or args.vllm_python:
        asyncio.run(on_real(rows, args))
    print(f"\none run, {time.monotonic() - began:.0f} s")
    print(table(HEADERS, [r.cells() for r in rows]))
    broken = [f"{r.where}: {r.what}" for r in rows if r.faults]
    if broken:
        print(f"benchmarks.table: runs that broke an invariant: {', '.join(broken)}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
