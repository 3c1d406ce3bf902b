"""What each route of a cycle costs on one real server, idle and with requests decoding, one
route after another per round; rounds alternate idle and traffic (``--in-flight`` streams of
``--new-tokens`` tokens, read by this process), the first two untimed.

SGLang (``--sglang-python``): the offload's probes (``/ready``, ``/ping``, ``/model_info``),
the identity read (``/server_info``, which asks the scheduler for its state:
``get_internal_state``), and the pause and flush themselves. vLLM (``--vllm-python``): the
whole cycle: ``/is_paused``, the keep pause, the flush, the sleep, the weights' wake, the KV
cache's wake (the library's continue: it resumes the scheduler once nothing is asleep, vllm
``EngineCore.wake_up``), and ``/resume``, which the library no longer sends, timed to show
what it cost after the wake.

With traffic, each call is also set against the scheduler's decode steps: the server logs
every decode step with a millisecond timestamp (``--decode-log-interval 1``,
``SGLANG_LOG_MS=1``; sglang: ``batch_result_processor.process_batch_result_decode`` ->
``metrics_reporter.report_decode_stats``, after the step's tokens are streamed, just before
the scheduler's loop reads its socket again: ``Scheduler.event_loop_overlap``,
``ingest_requests``). A call that waits for the scheduler answers soon after the first step
that ends after it was sent: the second table says how long each call waited for that step's
end and how long after it the answer came. vLLM logs no step; its timeline is the streams'
chunks as this process reads them (each after the step that made its token).

    python -m benchmarks.real_routes --cpu \\
        --sglang-python ~/.cache/rollout-lifecycle/sglang-0.5.23/bin/python \\
        --model ~/.cache/rollout-lifecycle/tiny-gpt2
    python -m benchmarks.real_routes --cpu --steps --in-flight 12 --new-tokens 1500 \\
        --vllm-python ~/.cache/rollout-lifecycle/vllm-0.32.0/bin/python \\
        --model ~/.cache/rollout-lifecycle/tiny-gpt2
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks._common import (
    ServerLog,
    cpu_sglang_setup,
    cpu_vllm_setup,
    machine,
    median,
    table,
)
from benchmarks.real_sglang import Stream, open_streams
from rollout_lifecycle import free_port, launched_sglang_factory, launched_vllm_factory

Route = tuple[str, str, dict[str, Any] | None]

#: The routes of each engine, in the order a cycle meets them: method, path, body.
ROUTES: dict[str, tuple[Route, ...]] = {
    "sglang": (
        ("GET", "/ready", None),
        ("GET", "/ping", None),
        ("GET", "/model_info", None),
        ("GET", "/server_info", None),
        ("POST", "/pause_generation", {"mode": "retract"}),
        ("POST", "/flush_cache", None),
    ),
    "vllm": (
        ("GET", "/is_paused", None),
        ("POST", "/pause?mode=keep", None),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/sleep?level=1&mode=keep", None),
        ("POST", "/wake_up?tags=weights", None),
        ("POST", "/wake_up?tags=kv_cache", None),
        ("POST", "/resume", None),
    ),
}
#: What ends a round the routes left paused (vLLM's end with its continue).
CONTINUE = {"sglang": "/continue_generation", "vllm": None}


#: A decode step's line in the server's log, and its time (``SGLANG_LOG_MS``: to the ms).
# sglang: utils/common.py configure_logger ("[%(asctime)s.%(msecs)03d<prefix>] %(message)s")
STEP_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})[^\]]*\] Decode batch")


def steps(lines: Sequence[str]) -> list[float]:
    """The end of each decode step the server logged (``time.time()`` seconds)."""
    ends = []
    for line in lines:
        found = STEP_LINE.match(line)
        if found:
            whole = time.mktime(time.strptime(found[1], "%Y-%m-%d %H:%M:%S"))
            ends.append(whole + int(found[2]) / 1000)
    return ends


#: One timed call: condition, path, sent and answered (``time.time()`` seconds).
Call = tuple[str, str, float, float]


async def measure(
    url: str,
    rounds: int,
    in_flight: int,
    new_tokens: int,
    calls: list[Call] | None = None,
    kind: str = "sglang",
    arrivals: list[float] | None = None,
) -> dict[str, Any]:
    """Milliseconds per route and condition: ``{condition: {path: [ms, ...]}}``; each timed
    call also goes to ``calls``, and the traffic's chunks' arrival times to ``arrivals``."""
    times: dict[str, dict[str, list[float]]] = {"idle": {}, "traffic": {}}
    async with (
        httpx.AsyncClient(timeout=60.0, trust_env=False) as client,
        httpx.AsyncClient(timeout=600.0, trust_env=False) as traffic,
    ):
        for k in range(2 + 2 * rounds):
            condition = "idle" if k % 2 == 0 else "traffic"
            streams: list[Stream] = []
            if condition == "traffic":
                streams = await open_streams(
                    traffic, kind, [url], in_flight, new_tokens, k, timeout=600.0
                )
            for method, path, body in ROUTES[kind]:
                sent, began = time.time(), time.perf_counter()
                answer = await client.request(method, url + path, json=body)
                took = (time.perf_counter() - began) * 1000
                answer.raise_for_status()
                if k >= 2:
                    times[condition].setdefault(path, []).append(took)
                    if calls is not None:
                        calls.append((condition, path, sent, sent + took / 1000))
            if CONTINUE[kind] is not None:
                (await client.post(url + str(CONTINUE[kind]), json={})).raise_for_status()
            await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
            if arrivals is not None:
                arrivals.extend(t for s in streams for t in s.arrivals)
    return times


def report(times: dict[str, dict[str, list[float]]], kind: str = "sglang") -> str:
    """Median (min-max) ms per route and condition, and traffic / idle."""
    rows = []
    for _, path, _ in ROUTES[kind]:
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


def against_steps(calls: Sequence[Call], ends: Sequence[float], kind: str = "sglang") -> str:
    """Each route's calls with traffic set against the decode steps: the step's length, how
    long a call waited for the end of the step it was sent in, and its answer after that end
    (negative: it answered before the step ended, without waiting for the scheduler)."""
    ordered = sorted(ends)
    rows = []
    # (vLLM's timeline is chunks: those of one step arrive within a millisecond, one step)
    lengths = [b - a for a, b in itertools.pairwise(ordered) if 0.001 < b - a < 1.0]
    for _, path, _ in ROUTES[kind]:
        waits, tails, before = [], [], 0
        for condition, route, sent, answered in calls:
            if condition != "traffic" or route != path:
                continue
            at = bisect.bisect_left(ordered, sent)  # (the first step to end after the send)
            end = ordered[at] if at < len(ordered) else None
            if end is None or end - sent > 1.0:
                continue  # (no step ran: the streams had ended or the server was paused)
            waits.append((end - sent) * 1000)
            tails.append((answered - end) * 1000)
            before += answered < end
        if waits:
            rows.append(
                [
                    path,
                    str(len(waits)),
                    f"{median(waits):.1f} ({min(waits):.1f}-{max(waits):.1f})",
                    f"{median(tails):.1f} ({min(tails):.1f}-{max(tails):.1f})",
                    str(before),
                ]
            )
    header = (
        f"decode step: {median(lengths) * 1000:.1f} ms median "
        f"({min(lengths) * 1000:.1f}-{max(lengths) * 1000:.1f}, {len(lengths)} steps)\n"
        if lengths
        else "no decode step logged\n"
    )
    columns = ["route", "calls", "to the step's end ms", "answer after it ms", "answered before"]
    return header + table(columns, rows)


async def _main(args: argparse.Namespace) -> str:
    kind = "vllm" if args.vllm_python else "sglang"
    log = ServerLog().install()
    if kind == "vllm":
        flags, env = cpu_vllm_setup() if args.cpu else ([], {})
        engine: Any = launched_vllm_factory(
            args.model, port=free_port(), env=env, extra_args=flags, python=args.vllm_python
        )()
    else:
        flags, env = cpu_sglang_setup() if args.cpu else ([], {})
        if args.steps:
            flags += ["--decode-log-interval", "1"]
            env = {**env, "SGLANG_LOG_MS": "1"}
        engine = launched_sglang_factory(
            args.model, port=free_port(), env=env, extra_args=flags, python=args.sglang_python,
            memory_saver=False,
        )()  # fmt: skip
    calls: list[Call] = []
    arrivals: list[float] = []
    try:
        await engine.start()
        times = await measure(
            engine.url, args.rounds, args.in_flight, args.new_tokens, calls, kind, arrivals
        )
    finally:
        await engine.close()
    out = report(times, kind)
    if args.steps:
        ends = steps(log.take()) if kind == "sglang" else arrivals
        out += "\n\n" + against_steps(calls, ends, kind)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    engines = parser.add_mutually_exclusive_group(required=True)
    engines.add_argument("--sglang-python", metavar="PY", help="launch an SGLang server")
    engines.add_argument("--vllm-python", metavar="PY", help="launch a vLLM server")
    parser.add_argument("--model", metavar="PATH", required=True)
    parser.add_argument("--cpu", action="store_true", help="the test tiers' CPU flags and env")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per condition")
    parser.add_argument("--in-flight", type=int, default=4, help="streams decoding (4)")
    parser.add_argument("--new-tokens", type=int, default=200, help="per stream (200)")
    parser.add_argument(
        "--steps", action="store_true", help="set each call against the server's decode steps"
    )
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print(asyncio.run(_main(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
