"""Offload and onload on real SGLang servers, and on real vLLM servers in the same run: every
phase's latency with requests decoding against an idle fleet, and whether any request is lost.

Each round runs one full cycle per engine kind and condition, the conditions in alternating
order:

- ``idle``: nothing in flight;
- ``traffic``: ``--in-flight`` streamed requests per server (``/generate`` on SGLang with
  ``--new-tokens`` tokens, ``/v1/completions`` on vLLM with ``--vllm-new-tokens``: it decodes
  faster), ``ignore_eos``, all decoding (each has sent its first token) when the offload starts;
  their streams are read on the asyncio loop that runs the offload, as in a driver that also
  sends the rollouts;
- ``apart`` (with ``--conditions``): the same requests, read by another process, so that the
  offload's loop does nothing else: what is left of the gap is the servers';
- ``verified`` (with ``--conditions``): idle, the weight update verified
  (``update_weights(verify=True, may_be_noop=True)``: the push reloads the checkpoint the
  servers hold, so each engine's fingerprint is read after the push only, not before); its
  cycle against the idle one is what one fingerprint read adds to a cycle (a push that changes
  the weights reads twice: ``verify_weights`` in the table is one read).

A cycle is ``offload()`` (pause, flush, release), ``onload_weights()`` (resume weights),
``update_weights(FromDisk(model))`` (the weight update: the server reloads the model it serves),
``onload_kv()`` (resume kv, continue), through one ``RolloutServer`` per engine kind whose
engines are the servers themselves (in-process HTTP backends, no Ray). Phase times are the
library's own metrics (``lifecycle/<call>/<phase>_s``: first request sent to last answer, over
every server). After
the cycle every answer must have all its tokens and finish reason ``length``, else it is lost.
The row "the loop waiting for a CPU" is how long, within the offload, the thread that runs it
was ready to run and waited for a CPU the servers' processes held (Linux's schedstat): on a
machine whose cores the servers share, that is the part of a gap that is neither the library's
work nor an answer it waits for.

Servers are launched by the script (``--sglang-python PY --model PATH``, each with
``launched_sglang_factory``; ``--vllm-python PY`` adds as many vLLM servers, with
``launched_vllm_factory``; ``--cpu`` adds the flags and environment of the test tiers in
``tests/real/servers.py`` that SGLang 0.5.23 and vLLM 0.32.0 need on a machine without a GPU), or
attached with ``--url`` / ``--vllm-url`` (repeatable; ``--model`` is then the path the servers
load for the weight update).

    python -m benchmarks.real_sglang --cpu \\
        --sglang-python ~/.cache/rollout-lifecycle/sglang-0.5.23/bin/python \\
        --vllm-python ~/.cache/rollout-lifecycle/vllm-0.32.0/bin/python \\
        --model ~/.cache/rollout-lifecycle/tiny-gpt2
    python -m benchmarks.real_sglang --url http://127.0.0.1:30000 --model /models/m --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import (
    SPACED_S,
    ServerLog,
    cpu_sglang_setup,
    cpu_vllm_setup,
    cpu_wait_s,
    machine,
    median,
    table,
)
from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    LifecycleConfig,
    RolloutServer,
    SGLangHTTPEngine,
    VLLMHTTPEngine,
    free_port,
    launched_sglang_factory,
    launched_vllm_factory,
)
from rollout_lifecycle.testing import asse_events

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("idle", "traffic")
#: Every condition ``--conditions`` may name (``apart``: the traffic read by another process).
ALL_CONDITIONS = ("idle", "traffic", "apart", "verified")
KINDS = ("sglang", "vllm")
#: The whole cycle's wall time, as a row of the table.
CYCLE = "cycle"
#: The time the offload's loop thread was ready to run and waited for a CPU (``cpu_wait_s``).
CPU_WAIT = "bench/offload_cpu_wait_s"
#: The offload's wall time less that wait: what it took with the machine's cores to itself.
LESS_WAIT = "bench/offload_less_cpu_wait_s"
#: The longest a launched SGLang server took to hash its weights for one fingerprint read of the
#: cycle, as it logs it (sglang: utils/weight_checker.py ``WeightChecker._compute_checksum``,
#: "[WeightChecker] checksum computed for N tensors in S s", timed on the server around the
#: hashing alone).
HASHING = "bench/verify_hashing_s"
CHECKSUM_LINE = re.compile(r"\[WeightChecker\] checksum computed for \d+ tensors in ([0-9.]+)s")
#: Rows of the table: label, metric key (``None``: the offload call's wall time).
PHASES: tuple[tuple[str, str | None], ...] = (
    ("cycle (wall)", CYCLE),
    ("offload (wall)", None),
    ("offload: the loop waiting for a CPU", CPU_WAIT),
    ("offload less that wait", LESS_WAIT),
    ("pause", "lifecycle/offload/pause_s"),
    ("flush", "lifecycle/offload/flush_s"),
    ("release", "lifecycle/offload/release_s"),
    ("resume weights", "lifecycle/onload_weights/weights_s"),
    ("weight update", "lifecycle/update_weights/total_s"),
    ("verify_weights", "lifecycle/update_weights/verify_weights_s"),
    ("verify: the slowest server's hashing", HASHING),
    ("resume kv", "lifecycle/onload_kv/kv_s"),
    ("continue", "lifecycle/onload_kv/continue_s"),
)


@dataclass
class Cycle:
    """One cycle of one condition on one engine kind: its phase times and what happened to its
    requests."""

    kind: str
    condition: str
    offload_wall_s: float
    metrics: dict[str, float]
    requests: int = 0
    lost: int = 0
    retracted: int = 0
    flush_retries: float = 0.0


@dataclass
class Fleet:
    """The servers of one engine kind and the ``RolloutServer`` that drives them."""

    kind: str
    urls: list[str]
    server: RolloutServer
    new_tokens: int
    #: What its launched servers print (nothing for attached ones).
    log: ServerLog = field(default_factory=ServerLog)


@dataclass
class Result:
    servers: int
    in_flight: int
    new_tokens: dict[str, int]
    cycles: list[Cycle] = field(default_factory=list)

    def values(self, kind: str, condition: str, key: str | None) -> list[float]:
        """Seconds of ``key`` (a row of ``PHASES``; None: the offload's wall time) in each of
        ``kind``'s cycles of ``condition`` (NaN where a cycle has none)."""
        return [
            c.offload_wall_s if key is None else c.metrics.get(key, float("nan"))
            for c in self.cycles
            if c.condition == condition and c.kind == kind
        ]


class Stream:
    """One streamed request; ``started`` is set at its first token. SGLang: ``/generate``, each
    chunk holds everything so far; vLLM: ``/v1/completions``, each chunk holds its new tokens."""

    def __init__(self, client: httpx.AsyncClient, kind: str, url: str, prompt: list[int],
                 new_tokens: int) -> None:  # fmt: skip
        self.started = asyncio.Event()
        #: When each chunk came (``time.time()``): each follows the step that made its tokens.
        self.arrivals: list[float] = []
        self.tokens = 0
        self.reason: str | None = None
        self.retracted = False
        if kind == "sglang":
            path = "/generate"
            body: dict[str, Any] = {
                "input_ids": prompt,
                "stream": True,
                "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
            }
        else:
            path = "/v1/completions"
            body = {"prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}  # fmt: skip
        self.task = asyncio.ensure_future(self._run(client, kind, f"{url}{path}", body))

    def answer(self) -> list[Any]:
        """What became of the request, once it has ended: ``[tokens, finish reason, retracted,
        failed]`` (plain values: the ``apart`` condition's traffic process prints them)."""
        return [self.tokens, self.reason, self.retracted, self.task.exception() is not None]

    async def _run(
        self, client: httpx.AsyncClient, kind: str, url: str, body: dict[str, Any]
    ) -> None:
        try:
            async with client.stream("POST", url, json=body) as answer:
                answer.raise_for_status()
                async for chunk in asse_events(answer.aiter_bytes()):
                    self.arrivals.append(time.time())
                    if kind == "sglang":
                        meta = chunk.get("meta_info") or {}
                        self.tokens = meta.get("completion_tokens", 0)
                        self.reason = (meta.get("finish_reason") or {}).get("type")
                        self.retracted = meta.get("num_retractions", 0) > 0
                    else:
                        choice = chunk["choices"][0]
                        self.tokens += len(choice.get("token_ids") or [])
                        self.reason = choice.get("finish_reason") or self.reason
                    if self.tokens:
                        self.started.set()
        finally:
            self.started.set()


async def open_streams(
    client: httpx.AsyncClient, kind: str, urls: Sequence[str], in_flight: int, new_tokens: int,
    tag: int, timeout: float,
) -> list[Stream]:  # fmt: skip
    """``in_flight`` streamed requests per server, each with its own prompt, once every one
    decodes (has its first token; ``timeout`` seconds at most)."""
    streams = [
        Stream(client, kind, url, [tag % 1000 + 1, i + 1], new_tokens)
        for url in urls
        for i in range(in_flight)
    ]
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), timeout)
    return streams


def _complete(tokens: int, reason: str | None, failed: bool, new_tokens: int) -> bool:
    """A request came back whole: every token, finished by its length."""
    return not failed and tokens == new_tokens and reason == "length"


async def traffic_child(spec: dict[str, Any]) -> None:
    """The ``apart`` condition's traffic, in a process of its own: opens the streams, prints
    ``started`` once every one has its first token, and at the end one JSON line per stream
    (tokens, finish reason, retracted, failed)."""
    timeout = httpx.Timeout(spec["timeout"], connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        streams = await open_streams(
            client, spec["kind"], spec["urls"], spec["in_flight"], spec["new_tokens"], spec["tag"],
            spec["timeout"],
        )  # fmt: skip
        print("started", flush=True)
        await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
    for s in streams:
        print(json.dumps(s.answer()), flush=True)


async def _apart(fleet: Fleet, args: argparse.Namespace, tag: int) -> asyncio.subprocess.Process:
    """Start the ``apart`` traffic (``traffic_child``) and wait until every stream decodes."""
    spec = {
        "kind": fleet.kind,
        "urls": fleet.urls,
        "in_flight": args.in_flight,
        "new_tokens": fleet.new_tokens,
        "tag": tag,
        "timeout": args.request_timeout_s,
    }
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.real_sglang", "--traffic-child", json.dumps(spec),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), args.request_timeout_s)
    if line.strip() != b"started":
        raise RuntimeError(f"the traffic process did not start its streams: {line!r}")
    return child


async def _cycle(
    fleet: Fleet, condition: str, model: str, args: argparse.Namespace, tag: int
) -> Cycle:
    streams: list[Stream] = []
    child: asyncio.subprocess.Process | None = None
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        if condition == "traffic":
            streams = await open_streams(
                client, fleet.kind, fleet.urls, args.in_flight, fleet.new_tokens, tag,
                args.request_timeout_s,
            )  # fmt: skip
        elif condition == "apart":
            child = await _apart(fleet, args, tag)
        # Every offload comes after a rollout in a training loop: no answer is recent enough to
        # prove the process (``proof_window``), so its pause reads the engine first. Without
        # this gap an idle cycle would start within the window of the last one, skip that read
        # and look cheaper than it is.
        await asyncio.sleep(args.gap_s)
        fleet.log.take()
        server = fleet.server
        metrics: dict[str, float] = {}
        began, waited = time.perf_counter(), cpu_wait_s()
        metrics.update(await server.offload())
        wall = time.perf_counter() - began
        if waited is not None:
            metrics[CPU_WAIT] = (cpu_wait_s() or waited) - waited
            metrics[LESS_WAIT] = wall - metrics[CPU_WAIT]
        metrics.update(await server.onload_weights())
        metrics.update(
            await server.update_weights(
                FromDisk(model),
                version=f"bench-{fleet.kind}-{condition}-{tag}",
                verify=condition == "verified",
                # (the same checkpoint again: the fingerprints cannot change, so the one
                # before the push is not read; the one after it is)
                may_be_noop=condition == "verified",
            )
        )
        metrics.update(await server.onload_kv())
        metrics[CYCLE] = time.perf_counter() - began
        hashing = [float(m[1]) for line in fleet.log.take() if (m := CHECKSUM_LINE.search(line))]
        if hashing:
            metrics[HASHING] = max(hashing)
        await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
    answers = [s.answer() for s in streams]
    if child is not None:
        out, _ = await asyncio.wait_for(child.communicate(), args.request_timeout_s)
        answers = [json.loads(line) for line in out.decode().splitlines() if line]
        if child.returncode or len(answers) != len(fleet.urls) * args.in_flight:
            raise RuntimeError(f"the traffic process exited {child.returncode}: {out!r}")
    cycle = Cycle(fleet.kind, condition, wall, metrics, requests=len(answers))
    cycle.flush_retries = metrics.get("lifecycle/offload/flush_retries", 0.0)
    for tokens, reason, retracted, failed in answers:
        cycle.lost += not _complete(tokens, reason, failed, fleet.new_tokens)
        cycle.retracted += bool(retracted)
    return cycle


async def run_benchmark(fleets: Sequence[Fleet], model: str, args: argparse.Namespace) -> Result:
    """``args.rounds`` rounds of one cycle per fleet and condition, alternating which condition
    goes first."""
    tokens = {f.kind: f.new_tokens for f in fleets}
    result = Result(len(fleets[0].urls), args.in_flight, tokens)
    tag = 0
    conditions = tuple(args.conditions)
    for k in range(args.warmup + args.rounds):
        order = conditions if k % 2 == 0 else conditions[::-1]
        for condition in order:
            for fleet in fleets:
                tag += 1
                cycle = await _cycle(fleet, condition, model, args, tag)
                if k >= args.warmup:
                    result.cycles.append(cycle)
                print(
                    f"round {k + 1 - args.warmup if k >= args.warmup else 'warm-up'} "
                    f"{fleet.kind:<6} {condition:<7} offload {cycle.offload_wall_s * 1000:8.1f} "
                    f"ms, requests {cycle.requests}, lost {cycle.lost}, retracted "
                    f"{cycle.retracted}, flush retries {cycle.flush_retries:g}",
                    flush=True,
                )
    return result


def report(result: Result) -> str:
    """Median (min-max) ms per phase, engine kind and condition, and traffic / idle."""
    kinds = [k for k in KINDS if any(c.kind == k for c in result.cycles)]
    conditions = [c for c in ALL_CONDITIONS if any(x.condition == c for x in result.cycles)]
    busy_conditions = [c for c in conditions if c != "idle"]
    rows: list[list[object]] = []
    for label, key in PHASES:
        if key is not None and key != CYCLE and not any(key in c.metrics for c in result.cycles):
            continue  # (a phase no cycle ran: verify_weights without the verified condition)
        cells: list[object] = [label]
        for kind in kinds:
            medians = {}
            for condition in conditions:
                values = [v * 1000 for v in result.values(kind, condition, key)]
                medians[condition] = median(values)
                cells.append(f"{medians[condition]:.1f} ({min(values):.1f}-{max(values):.1f})")
            for condition in busy_conditions:
                cells.append(f"{medians[condition] / medians['idle']:.2f}")
        rows.append(cells)
    lines = []
    for kind in kinds:
        for condition in (c for c in busy_conditions if c in ("traffic", "apart")):
            busy = [c for c in result.cycles if c.condition == condition and c.kind == kind]
            lines.append(
                f"{result.servers} real {kind} server(s), {len(busy)} cycle(s) per condition; "
                f"{condition}: {result.in_flight} request(s) per server of "
                f"{result.new_tokens[kind]} tokens, decoding at the offload; requests "
                f"{sum(c.requests for c in busy)}, lost {sum(c.lost for c in busy)}, retracted "
                f"{sum(c.retracted for c in busy)}; flush retries (median) "
                f"{median([c.flush_retries for c in busy]):g}"
            )
    headers = ["phase"]
    for kind in kinds:
        headers += [f"{kind} {c} ms" for c in conditions]
        headers += [f"{c} x idle" for c in busy_conditions]
    lines.append(
        "ms: median (min-max) of the cycles; x idle: the condition's median / idle median "
        "(traffic: the streams read on the offload's loop; apart: by another process; "
        "verified: idle, the weight update verified)"
    )
    return "\n".join([*lines, table(headers, rows)])


def _launch(args: argparse.Namespace, kind: str) -> list[Any]:
    """``args.servers`` servers of ``kind``, launched lazily (``start()``)."""
    factory: Callable[..., Callable[[], Any]]
    if kind == "sglang":
        extra = [a for chunk in args.sglang_args for a in shlex.split(chunk)]
        env = dict(item.split("=", 1) for item in args.sglang_env)
        if args.cpu:
            flags, shim = cpu_sglang_setup()
            extra, env = [*flags, *extra], {**shim, **env}
        factory = functools.partial(
            launched_sglang_factory,
            python=args.sglang_python,
            memory_saver=args.memory_saver,
        )
    else:
        extra, env = cpu_vllm_setup() if args.cpu else ([], {})
        factory = functools.partial(launched_vllm_factory, python=args.vllm_python)
    return [
        factory(args.model, port=free_port(), env=env, extra_args=extra)()
        for _ in range(args.servers)
    ]


async def run(args: argparse.Namespace) -> Result:
    """Launch or attach the servers ``args`` name and run the benchmark's rounds on them."""
    backends: list[Any] = []
    fleets: list[Fleet] = []
    log = ServerLog().install()
    try:
        launched: list[Any] = []
        for kind, urls, python, client in (
            ("sglang", args.url, args.sglang_python, SGLangHTTPEngine),
            ("vllm", args.vllm_url, args.vllm_python, VLLMHTTPEngine),
        ):
            if urls:
                engines = [client(url) for url in urls]
            elif python:
                engines = _launch(args, kind)
                launched += engines
            else:
                continue
            backends += engines
            server = RolloutServer(
                [EngineGroup(kind, engines)],
                LifecycleConfig(renew_proofs=args.renew_proofs),
                name=f"real-bench-{kind}",
            )
            tokens = args.new_tokens if kind == "sglang" else args.vllm_new_tokens
            fleets.append(Fleet(kind, [e.url for e in engines], server, tokens, log))
        if launched:
            began = time.monotonic()
            for engine in launched:
                print(f"starting {shlex.join(engine.command)}", flush=True)
            await asyncio.gather(*(e.start() for e in launched))
            print(f"ready in {time.monotonic() - began:.1f} s", flush=True)
        return await run_benchmark(fleets, args.model, args)
    finally:
        await asyncio.gather(*(b.close() for b in backends), return_exceptions=True)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The benchmark's arguments (``main``'s, but the traffic child's), checked."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]),
    )
    parser.add_argument("--sglang-python", metavar="PY", help="interpreter that has sglang")
    parser.add_argument("--vllm-python", metavar="PY", help="interpreter that has vllm")
    parser.add_argument("--model", required=True, metavar="PATH", help="the model served")
    parser.add_argument("--url", action="append", default=[], help="attach to this SGLang")
    parser.add_argument("--vllm-url", action="append", default=[], help="attach to this vLLM")
    parser.add_argument("--servers", type=int, default=2, help="servers to launch per kind (2)")
    parser.add_argument("--cpu", action="store_true", help="the test tiers' CPU flags and env")
    parser.add_argument("--sglang-args", action="append", default=[], metavar="ARGS")
    parser.add_argument("--sglang-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--memory-saver", action="store_true", help="--enable-memory-saver (needs CUDA)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed cycles per condition (3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    parser.add_argument("--in-flight", type=int, default=2, help="requests per server (2)")
    parser.add_argument("--new-tokens", type=int, default=200, help="per SGLang request (200)")
    parser.add_argument("--vllm-new-tokens", type=int, default=1500, help="per vLLM request (1500)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--gap-s",
        type=float,
        default=SPACED_S,
        help="seconds between a condition's set-up and its offload, in every condition; longer "
        "than the proof window, as after a rollout (default %(default)g)",
    )
    parser.add_argument(
        "--renew-proofs",
        action="store_true",
        help="LifecycleConfig(renew_proofs=True): the servers' identity is read while they serve "
        "(during each condition's gap), so the offload's pause reads nothing first",
    )
    parser.add_argument(
        "--conditions",
        nargs="+",
        choices=ALL_CONDITIONS,
        default=list(CONDITIONS),
        help="the conditions each round runs (default: idle traffic)",
    )
    args = parser.parse_args(argv)
    if "idle" not in args.conditions:
        parser.error("--conditions must include idle (every ratio is to it)")
    if not (args.url or args.sglang_python or args.vllm_url or args.vllm_python):
        parser.error("give --sglang-python / --vllm-python (launch servers) or --url / --vllm-url")
    if any("=" not in item for item in args.sglang_env):
        parser.error("--sglang-env wants NAME=VALUE")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--traffic-child"]:  # (the apart condition's traffic process)
        asyncio.run(traffic_child(json.loads(argv[1])))
        return 0
    args = parse(argv)
    print(f"machine: {machine()}")
    result = asyncio.run(run(args))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
