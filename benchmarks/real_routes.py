"""What each route the offload uses costs on one real SGLang server, idle and with requests
decoding: the probes (``/ready``, ``/ping``, ``/model_info``), the identity read
(``/server_info``, which asks the scheduler for its state: ``get_internal_state``), and the
pause and flush themselves. Each route is timed alone, one after another, per round; rounds
alternate idle and traffic (``--in-flight`` streams of ``--new-tokens`` tokens, read by this
process), the first two untimed.

    python -m benchmarks.real_routes --cpu \\
        --sglang-python ~/.cache/rollout-lifecycle/sglang-0.5.23/bin/python \\
        --model ~/.cache/rollout-lifecycle/tiny-gpt2
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks._common import cpu_sglang_setup, machine, median, table
from benchmarks.real_sglang import open_streams
from rollout_lifecycle import free_port, launched_sglang_factory

#: The routes, in the order an offload meets them: method, path, body.
ROUTES: tuple[tuple[str, str, dict[str, Any] | None], ...] = (
    ("GET", "/ready", None),
    ("GET", "/ping", None),
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    ("POST", "/pause_generation", {"mode": "retract"}),
    ("POST", "/flush_cache", None),
)


async def measure(url: str, rounds: int, in_flight: int, new_tokens: int) -> dict[str, Any]:
    """Milliseconds per route and condition: ``{condition: {path: [ms, ...]}}``."""
    times: dict[str, dict[str, list[float]]] = {"idle": {}, "traffic": {}}
    async with (
        httpx.AsyncClient(timeout=60.0, trust_env=False) as client,
        httpx.AsyncClient(timeout=600.0, trust_env=False) as traffic,
    ):
        for k in range(2 + 2 * rounds):
            condition = "idle" if k % 2 == 0 else "traffic"
            streams = []
            if condition == "traffic":
                streams = await open_streams(
                    traffic, "sglang", [url], in_flight, new_tokens, k, timeout=600.0
                )
            for method, path, body in ROUTES:
                began = time.perf_counter()
                answer = await client.request(method, url + path, json=body)
                took = (time.perf_counter() - began) * 1000
                answer.raise_for_status()
                if k >= 2:
                    times[condition].setdefault(path, []).append(took)
            (await client.post(url + "/continue_generation", json={})).raise_for_status()
            await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
    return times


def report(times: dict[str, dict[str, list[float]]]) -> str:
    """Median (min-max) ms per route and condition, and traffic / idle."""
    rows = []
    for _, path, _ in ROUTES:
        idle, busy = times["idle"][path], times["traffic"][path]
        rows.append(
            [
                path,
                f"{median(idle):.1f} ({min(idle):.1f}-{max(idle):.1f})",
                f"{median(busy):.1f} ({min(busy):.1f}-{max(busy):.1f})",
                f"{median(busy) / median(idle):.2f}",
            ]
        )
    return table(["route", "idle ms", "traffic ms", "x idle"], rows)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    flags, env = cpu_sglang_setup() if args.cpu else ([], {})
    engine = launched_sglang_factory(
        args.model, port=free_port(), env=env, extra_args=flags, python=args.sglang_python,
        memory_saver=False,
    )()  # fmt: skip
    try:
        await engine.start()
        return await measure(engine.url, args.rounds, args.in_flight, args.new_tokens)
    finally:
        await engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sglang-python", metavar="PY", required=True)
    parser.add_argument("--model", metavar="PATH", required=True)
    parser.add_argument("--cpu", action="store_true", help="the test tiers' CPU flags and env")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per condition")
    parser.add_argument("--in-flight", type=int, default=4, help="streams decoding (4)")
    parser.add_argument("--new-tokens", type=int, default=200, help="per stream (200)")
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print(report(asyncio.run(_main(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
