"""Offload and onload on real SGLang servers: every phase's latency with requests decoding
against an idle fleet, and whether any request is lost.

Each round runs one full cycle per condition, the two conditions in alternating order:

- ``idle``: nothing in flight;
- ``traffic``: ``--in-flight`` streamed ``/generate`` requests per server of ``--new-tokens``
  tokens each (``ignore_eos``), all decoding (each has sent its first chunk) when the offload
  starts.

A cycle is ``offload()`` (pause, flush, release), ``onload_weights()`` (resume weights),
``update_weights(FromDisk(model))`` (the weight update: the server reloads the model it serves),
``onload_kv()`` (resume kv, continue), through one ``RolloutServer`` whose engines are the servers
themselves (in-process HTTP backends, no Ray). Phase times are the library's own metrics
(``lifecycle/<call>/<phase>_s``: first request sent to last answer, over every server). After
the cycle every answer must have all its tokens and finish reason ``length``, else it is lost.

Servers are launched by the script (``--sglang-python PY --model PATH``, each with
``launched_sglang_factory``; ``--cpu`` adds the flags and the device shim of the test tier in
``tests/real/servers.py`` that SGLang 0.5.23 needs on a machine without a GPU), or attached with
``--url`` (repeatable; ``--model`` is then the path the servers load for the weight update).

    python -m benchmarks.real_sglang --cpu \\
        --sglang-python ~/.cache/rollout-lifecycle/sglang-0.5.23/bin/python \\
        --model ~/.cache/rollout-lifecycle/tiny-gpt2
    python -m benchmarks.real_sglang --url http://127.0.0.1:30000 --model /models/m --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import cpu_sglang_setup, machine, median, table
from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    LaunchedSGLangEngine,
    LifecycleConfig,
    RolloutServer,
    SGLangHTTPEngine,
    free_port,
    launched_sglang_factory,
)

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("idle", "traffic")
#: Columns of the table: label, metric key (``None``: the offload call's wall time).
PHASES: tuple[tuple[str, str | None], ...] = (
    ("offload (wall)", None),
    ("pause", "lifecycle/offload/pause_s"),
    ("flush", "lifecycle/offload/flush_s"),
    ("release", "lifecycle/offload/release_s"),
    ("resume weights", "lifecycle/onload_weights/weights_s"),
    ("weight update", "lifecycle/update_weights/total_s"),
    ("resume kv", "lifecycle/onload_kv/kv_s"),
    ("continue", "lifecycle/onload_kv/continue_s"),
)


@dataclass
class Cycle:
    """One cycle of one condition: its phase times and what happened to its requests."""

    condition: str
    offload_wall_s: float
    metrics: dict[str, float]
    requests: int = 0
    lost: int = 0
    retracted: int = 0
    flush_retries: float = 0.0


@dataclass
class Result:
    servers: int
    in_flight: int
    new_tokens: int
    cycles: list[Cycle] = field(default_factory=list)


class Stream:
    """One streamed ``/generate`` request; ``started`` is set at its first chunk."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        self.started = asyncio.Event()
        self.final: dict[str, Any] | None = None
        self.task = asyncio.ensure_future(self._run(client, url, body))

    async def _run(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        try:
            async with client.stream("POST", f"{url}/generate", json=body) as answer:
                answer.raise_for_status()
                async for line in answer.aiter_lines():
                    if line.startswith("data:") and line.strip() != "data: [DONE]":
                        self.final = json.loads(line[len("data:") :])
                        self.started.set()
        finally:
            self.started.set()


async def _cycle(
    server: RolloutServer,
    urls: Sequence[str],
    condition: str,
    model: str,
    args: argparse.Namespace,
    tag: int,
) -> Cycle:
    streams: list[Stream] = []
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        if condition == "traffic":
            streams = [
                Stream(
                    client,
                    url,
                    {
                        "input_ids": [tag % 1000 + 1, i + 1],
                        "stream": True,
                        "sampling_params": {
                            "max_new_tokens": args.new_tokens,
                            "ignore_eos": True,
                        },
                    },
                )
                for url in urls
                for i in range(args.in_flight)
            ]
            await asyncio.wait_for(
                asyncio.gather(*(s.started.wait() for s in streams)), args.request_timeout_s
            )
        metrics: dict[str, float] = {}
        began = time.perf_counter()
        metrics.update(await server.offload())
        wall = time.perf_counter() - began
        metrics.update(await server.onload_weights())
        metrics.update(
            await server.update_weights(FromDisk(model), version=f"bench-{condition}-{tag}")
        )
        metrics.update(await server.onload_kv())
        await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
    cycle = Cycle(condition, wall, metrics, requests=len(streams))
    cycle.flush_retries = metrics.get("lifecycle/offload/flush_retries", 0.0)
    for stream in streams:
        meta = (stream.final or {}).get("meta_info") or {}
        complete = (
            stream.task.exception() is None
            and meta.get("completion_tokens") == args.new_tokens
            and (meta.get("finish_reason") or {}).get("type") == "length"
        )
        cycle.lost += not complete
        cycle.retracted += meta.get("num_retractions", 0) > 0
    return cycle


async def run_benchmark(
    urls: Sequence[str], backends: Sequence[Any], model: str, args: argparse.Namespace
) -> Result:
    """``args.rounds`` rounds of one cycle per condition, alternating which goes first."""
    server = RolloutServer(
        [EngineGroup("sglang", list(backends))], LifecycleConfig(), name="real-bench"
    )
    result = Result(len(urls), args.in_flight, args.new_tokens)
    tag = 0
    for k in range(args.warmup + args.rounds):
        order = CONDITIONS if k % 2 == 0 else CONDITIONS[::-1]
        for condition in order:
            tag += 1
            cycle = await _cycle(server, urls, condition, model, args, tag)
            if k >= args.warmup:
                result.cycles.append(cycle)
            print(
                f"round {k + 1 - args.warmup if k >= args.warmup else 'warm-up'} {condition:<7} "
                f"offload {cycle.offload_wall_s * 1000:8.1f} ms, requests {cycle.requests}, "
                f"lost {cycle.lost}, retracted {cycle.retracted}, flush retries "
                f"{cycle.flush_retries:g}",
                flush=True,
            )
    return result


def report(result: Result) -> str:
    """Median (min-max) ms per phase and condition, and traffic / idle."""
    rows: list[list[object]] = []
    for label, key in PHASES:
        cells: list[object] = [label]
        medians = {}
        for condition in CONDITIONS:
            values = [
                (c.offload_wall_s if key is None else c.metrics.get(key, float("nan"))) * 1000
                for c in result.cycles
                if c.condition == condition
            ]
            medians[condition] = median(values)
            cells.append(f"{medians[condition]:.1f} ({min(values):.1f}-{max(values):.1f})")
        cells.append(f"{medians['traffic'] / medians['idle']:.2f}")
        rows.append(cells)
    busy = [c for c in result.cycles if c.condition == "traffic"]
    head = (
        f"{result.servers} real SGLang server(s), {len(busy)} cycle(s) per condition; traffic: "
        f"{result.in_flight} request(s) per server of {result.new_tokens} tokens, decoding at "
        f"the offload; requests {sum(c.requests for c in busy)}, lost "
        f"{sum(c.lost for c in busy)}, retracted {sum(c.retracted for c in busy)}; flush "
        f"retries with traffic (median) {median([c.flush_retries for c in busy]):g}"
    )
    headers = ["phase", "idle ms, median (min-max)", "traffic ms, median (min-max)", "x idle"]
    return f"{head}\n{table(headers, rows)}"


async def _main(args: argparse.Namespace) -> Result:
    backends: list[Any]
    launched: list[LaunchedSGLangEngine] = []
    if args.url:
        backends = [SGLangHTTPEngine(url) for url in args.url]
        urls = list(args.url)
    else:
        extra = [a for chunk in args.sglang_args for a in shlex.split(chunk)]
        env = dict(item.split("=", 1) for item in args.sglang_env)
        if args.cpu:
            flags, shim = cpu_sglang_setup()
            extra, env = [*flags, *extra], {**shim, **env}
        launched = [
            launched_sglang_factory(
                args.model,
                port=free_port(),
                python=args.sglang_python,
                memory_saver=args.memory_saver,
                env=env,
                extra_args=extra,
            )()
            for _ in range(args.servers)
        ]
        began = time.monotonic()
        print(f"starting {len(launched)} server(s): {shlex.join(launched[0].command)}", flush=True)
        backends, urls = list(launched), [e.url for e in launched]
    try:
        if launched:
            await asyncio.gather(*(e.start() for e in launched))
            print(f"ready in {time.monotonic() - began:.1f} s: {', '.join(urls)}", flush=True)
        return await run_benchmark(urls, backends, args.model, args)
    finally:
        await asyncio.gather(*(b.close() for b in backends), return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]),
    )
    parser.add_argument("--sglang-python", metavar="PY", help="interpreter that has sglang")
    parser.add_argument("--model", required=True, metavar="PATH", help="the model served")
    parser.add_argument("--url", action="append", default=[], help="attach to this server")
    parser.add_argument("--servers", type=int, default=2, help="servers to launch (2)")
    parser.add_argument("--cpu", action="store_true", help="the test tier's CPU flags and shim")
    parser.add_argument("--sglang-args", action="append", default=[], metavar="ARGS")
    parser.add_argument("--sglang-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--memory-saver", action="store_true", help="--enable-memory-saver (needs CUDA)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed cycles per condition (3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    parser.add_argument("--in-flight", type=int, default=2, help="requests per server (2)")
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens per request (200)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if not args.url and not args.sglang_python:
        parser.error("give --sglang-python (launch servers) or --url (attach)")
    if any("=" not in item for item in args.sglang_env):
        parser.error("--sglang-env wants NAME=VALUE")
    print(f"machine: {machine()}")
    result = asyncio.run(_main(args))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
