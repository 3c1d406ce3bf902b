"""The ``rollout-lifecycle demo`` command: colocated RL steps on local Ray, checked and drawn.

It starts simulated SGLang engines as Ray actors (with ``--http`` each behind a stand-in SGLang
server on loopback), keeps generation traffic in flight through ``RolloutServer.generate_batch``
and runs offload -> onload weights -> versioned weight update -> onload KV every step, with a
fault the library has to handle if asked. It prints a line per call on stderr and a table of the
steps on stdout, writes the Chrome trace, the Gantt chart, the state diagram and the metrics to
``--out``, checks the invariants on the engines' own histories and exits 1 if one broke.

With ``--sglang-python PY --model PATH`` the engines are real SGLang servers instead, started
by the demo (``launched_sglang_factory``, one per engine, on free loopback ports) and stopped
when it ends; ``--sglang-args`` and ``--sglang-env`` add server flags and environment (a CPU
machine needs e.g. ``--sglang-args "--device cpu --disable-cuda-graph ..."``). A real server
keeps no history of the ops it received, so the barriers are checked on the calls the
library's timeline recorded; the fault injection needs the simulated engines and is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import ray

from rollout_lifecycle.backends.actor import EngineActorBody, start_engine_actor
from rollout_lifecycle.backends.weights import FromDisk
from rollout_lifecycle.core.config import LifecycleConfig, PauseMode
from rollout_lifecycle.core.exceptions import (
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    PhaseFailed,
)
from rollout_lifecycle.core.group import EngineGroup
from rollout_lifecycle.core.server import RolloutServer
from rollout_lifecycle.core.states import ServerState, mermaid
from rollout_lifecycle.testing import cycle_order_violations, local_ray
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.simulated import DEFAULT_MEMORY_BYTES, SimulatedEngine

#: What ``--inject-fault`` can do to one engine (engine 0 of group 0, in step 2 or the last).
FAULTS: tuple[str, ...] = ("none", "slow-flush", "flush-reject", "engine-death")
FAULT_HELP = {
    "slow-flush": "its flush answers 0.4 s late: every engine waits at the idle barrier",
    "flush-reject": "its flush is refused (5xx): nothing is released anywhere, the server "
    "fails, reset() brings it back to serving and the offload is run again",
    "engine-death": "it dies in the release: the server fails with what was released recorded; "
    "recover() replaces it, brings the replacement to 'released' and the step goes on",
}
#: The delay of the ``slow-flush`` fault.
SLOW_FLUSH_S = 0.4
#: Engines per group and groups when none are given: simulated, and real servers (each holds
#: a whole SGLang server's memory, ~3 GB for a tiny model on a CPU).
DEFAULT_LAYOUT = {"simulated": (2, 2), "real": (1, 2)}
#: Requests per step when none are given, and their new tokens (real: long enough to be
#: decoding when the offload comes).
DEFAULT_REQUESTS = {"simulated": 16, "real": 6}
_REAL_NEW_TOKENS = 96
#: Seconds the demo lets real requests decode before the offload.
_REAL_WARMUP_S = 1.0
#: The files ``--out`` receives.
OUTPUTS = {
    "trace": "trace.json",
    "gantt": "timeline.png",
    "diagram": "lifecycle.mmd",
    "metrics": "metrics.json",
}
_GIB = 1 << 30
_TOKEN_LATENCY = 0.004
_OP_LATENCY: dict[str, float | tuple[float, float]] = {
    "pause_generation": (0.001, 0.01),
    "flush_cache": (0.001, 0.01),
    "release_memory_occupation": (0.01, 0.05),
    "resume_memory_occupation": (0.01, 0.05),
    "continue_generation": (0.001, 0.005),
}
_TAGS = ("weights", "kv_cache", "cuda_graph")


# -- engines ---------------------------------------------------------------------------------


class DemoEngineBody(EngineActorBody):
    """An engine actor around a ``FaultyEngine``, so that the demo can arm a fault from outside."""

    async def arm(self, op: str, kind: str, count: int = 1, seconds: float = 0.0) -> None:
        """``FaultyEngine.arm`` on the hosted backend."""
        backend = self.backend
        if not isinstance(backend, FaultyEngine):
            raise InvalidArgument(f"engine {backend.label} has no fault injection")
        backend.arm(op, kind, count=count, seconds=seconds)


#: The Ray actor class of the demo's in-process engines.
DemoEngine: Any = ray.remote(DemoEngineBody)


def _faulty_simulated(**options: Any) -> FaultyEngine:
    return FaultyEngine(SimulatedEngine(**options))


@dataclass(eq=False)
class _Engine:
    """One engine the demo started: the slot it fills and, once replaced, its history."""

    slot: str
    label: str
    handle: Any
    #: The step it joined in (0: from the start).
    joined: int
    standin: Any = None
    history: list[dict[str, Any]] | None = None
    #: The real SGLang server behind it, when the demo launched one.
    launched: Any = None


@dataclass
class _Step:
    """What one step did: metrics of its calls, the answers it got, what happened."""

    number: int
    metrics: dict[str, float] = field(default_factory=dict)
    done: int = 0
    retracted: int = 0
    aborted: int = 0
    notes: list[str] = field(default_factory=list)


# -- the command line ------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand to the ``rollout-lifecycle`` parser."""
    demo = sub.add_parser(
        "demo",
        help="run colocated RL steps on local Ray with simulated engines",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="faults:\n"
        + "\n".join(f"  {name}: {text}" for name, text in FAULT_HELP.items())
        + f"\n\nfiles written to --out: {', '.join(OUTPUTS.values())}",
    )
    demo.add_argument("--steps", type=int, default=3, help="RL steps to run (default 3)")
    demo.add_argument(
        "--groups", type=int, default=None, help="engine groups (default 2; real servers 1)"
    )
    demo.add_argument("--engines", type=int, default=None, help="engines per group (default 2)")
    demo.add_argument(
        "--requests",
        type=int,
        default=None,
        help="generate requests in flight per step (default 16; real servers 6)",
    )
    demo.add_argument(
        "--pause-mode",
        choices=[PauseMode.RETRACT.value, PauseMode.ABORT.value],
        default=PauseMode.RETRACT.value,
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--http",
        action="store_true",
        help="put each engine behind a stand-in SGLang server on loopback (needs the standin "
        "extra); the engine actors speak SGLang's HTTP API to them",
    )
    demo.add_argument(
        "--inject-fault", choices=FAULTS, default="none", help="a fault the library must handle"
    )
    real = demo.add_argument_group(
        "real SGLang servers",
        "run the steps on real SGLang servers the demo launches and stops (no fault injection)",
    )
    real.add_argument(
        "--sglang-python",
        metavar="PY",
        help="the interpreter that has sglang installed; with --model, use real servers",
    )
    real.add_argument("--model", metavar="PATH", help="the model every server loads")
    real.add_argument(
        "--sglang-args",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra sglang.launch_server arguments, split like a shell does; repeatable (use "
        "--sglang-args=--flag for a single flag)",
    )
    real.add_argument(
        "--sglang-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for every server process; repeatable",
    )
    demo.add_argument(
        "--out",
        default="demo-output",
        metavar="DIR",
        help="where to write the trace, the Gantt chart, the diagram and the metrics "
        "(default ./demo-output)",
    )
    # Test hook: at the fault step, continue one engine directly (bypassing the server) while
    # its KV cache is released, so that a test sees the invariant checks catch a real breach.
    demo.add_argument("--sabotage", action="store_true", help=argparse.SUPPRESS)


def _positive(name: str, value: int, limit: int) -> None:
    if not 1 <= value <= limit:
        raise SystemExit(f"rollout-lifecycle: --{name} must be between 1 and {limit}, got {value}")


def _real_options(args: argparse.Namespace) -> None:
    """Check the real-server options; ``args.real`` says whether the demo uses real servers."""
    real = args.sglang_python is not None or args.model is not None
    if real and (args.sglang_python is None or args.model is None):
        raise SystemExit("rollout-lifecycle: --sglang-python and --model go together")
    if not real and (args.sglang_args or args.sglang_env):
        raise SystemExit(
            "rollout-lifecycle: --sglang-args and --sglang-env need --sglang-python and --model"
        )
    if real:
        clashes = [
            name
            for name, used in (
                ("--http", args.http),
                ("--inject-fault", args.inject_fault != "none"),
                ("--sabotage", args.sabotage),
            )
            if used
        ]
        if clashes:
            raise SystemExit(
                f"rollout-lifecycle: not with real SGLang servers: {', '.join(clashes)} (fault "
                "injection is designed for the simulated engines)"
            )
        env: dict[str, str] = {}
        for item in args.sglang_env:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise SystemExit(f"rollout-lifecycle: --sglang-env wants NAME=VALUE, got {item!r}")
            env[name] = value
        args.sglang_env_map = env
        args.sglang_argv = [a for chunk in args.sglang_args for a in shlex.split(chunk)]
    args.real = real
    kind = "real" if real else "simulated"
    groups, engines = DEFAULT_LAYOUT[kind]
    args.groups = groups if args.groups is None else args.groups
    args.engines = engines if args.engines is None else args.engines
    args.requests = DEFAULT_REQUESTS[kind] if args.requests is None else args.requests


def run(
    args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run the demo on a local Ray cluster (one already running is used and left running)."""
    _real_options(args)
    _positive("steps", args.steps, 1000)
    _positive("groups", args.groups, 8)
    _positive("engines", args.engines, 16)
    _positive("requests", args.requests, 10_000)
    out = stdout or sys.stdout
    started = time.monotonic()
    with local_ray():
        code = asyncio.run(_Demo(args, out, stderr or sys.stderr).run())
    print(f"demo finished in {time.monotonic() - started:.1f}s", file=out)
    return code


# -- the demo --------------------------------------------------------------------------------


class _Demo:
    def __init__(self, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.args = args
        self.out = out
        self.err = err
        self.dir = Path(args.out)
        self.mode = PauseMode(args.pause_mode)
        self.fault_step = min(2, args.steps)
        self.engines: list[_Engine] = []
        self.live: dict[str, _Engine] = {}
        self.steps: list[_Step] = []
        #: Each step's time window, for checking the engines' histories step by step.
        self.windows: list[tuple[int, float, float]] = []
        self.problems: list[str] = []
        #: What the injected fault did, as the demo saw it (checked at the end).
        self.fault_seen: list[str] = []
        self.replacements = 0
        self.step = 0
        self.started = time.monotonic()
        self.server: RolloutServer | None = None
        self.histories_dir: tempfile.TemporaryDirectory[str] | None = None

    # -- output --------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def progress(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        print(
            f"demo: {elapsed:5.1f}s step {self.step}/{self.args.steps} {text}",
            file=self.err,
            flush=True,
        )

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> int:
        args = self.args
        self.dir.mkdir(parents=True, exist_ok=True)
        where = "behind stand-in SGLang servers (HTTP)" if args.http else "on local Ray"
        kind = "simulated engine(s)"
        if args.real:
            where = f"(model {args.model}, launched with {args.sglang_python})"
            kind = "real SGLang server(s)"
        self.say(
            f"demo: {args.groups} group(s) x {args.engines} {kind} {where}, pause "
            f"mode {args.pause_mode}, {args.steps} step(s), {args.requests} requests per step, "
            f"fault: {args.inject_fault}"
        )
        if args.real:
            self.say(
                "demo: real servers: the fault scenarios (slow-flush, flush-reject, "
                "engine-death) are left out (their injection is designed for the simulated "
                "engines); the barriers are checked on the library's timeline (a real server "
                "keeps no op history) and no memory is checked (nothing says what it holds)"
            )
        try:
            try:
                await self.start_engines()
                server = self.server = RolloutServer(
                    self.make_groups(),
                    LifecycleConfig(
                        pause_mode=self.mode,
                        memory_metrics=True,
                        timeline_calls=8 * args.steps + 16,
                    ),
                    name="demo",
                )
                for number in range(1, args.steps + 1):
                    self.step = number
                    await self.run_step(server, number)
            except (LifecycleError, asyncio.TimeoutError) as exc:
                # What the library could not handle is reported with the checks, not a traceback.
                self.problems.append(f"step {self.step}: {type(exc).__name__}: {exc}")
                self.progress(f"stopped: {type(exc).__name__}: {exc}")
            if self.server is not None:
                self.table()
                self.write_outputs(self.server)
                await self.check(self.server)
        finally:
            await self.stop_engines()
        broken = bool(self.problems)
        for problem in self.problems:
            self.say(f"  ! invariant broken: {problem}")
        return 1 if broken else 0

    def make_groups(self) -> list[EngineGroup]:
        groups: dict[str, list[Any]] = {}
        for engine in self.engines:
            groups.setdefault(engine.slot.partition("/")[0], []).append(engine.handle)
        return [EngineGroup(name, handles) for name, handles in groups.items()]

    async def run_step(self, server: RolloutServer, number: int) -> None:
        args = self.args
        step = _Step(number)
        self.steps.append(step)
        start = time.monotonic()
        if number == self.fault_step:
            await self.arm_fault(step)
            if args.sabotage:
                self.sabotage(server)
        base = _REAL_NEW_TOKENS if args.real else 40
        requests: list[dict[str, Any]] = [
            {"input_ids": [number, i], "sampling_params": {"max_new_tokens": base + i % 24}}
            for i in range(args.requests)
        ]
        if args.real:  # a real model may stop early at its end-of-text token
            for request in requests:
                request["sampling_params"]["ignore_eos"] = True
        batch = asyncio.ensure_future(server.generate_batch(requests))
        try:
            # Decoding has started: the offload meets requests in flight.
            await asyncio.sleep(_REAL_WARMUP_S if args.real else 0.05)
            await self.call(step, "offload", server.offload)
            await asyncio.sleep(0.05)  # the trainer's turn on the GPU
            await self.call(step, "onload_weights", server.onload_weights)
            version = f"step-{number}"
            # A real server reloads the model it serves (there is no trainer to write others).
            push = FromDisk(args.model if args.real else f"/checkpoints/{version}")
            await self.call(
                step, "update_weights", lambda: server.update_weights(push, version=version)
            )
            await self.call(step, "onload_kv", server.onload_kv)
            answers = await asyncio.wait_for(batch, timeout=600 if args.real else 60)
        finally:
            if not batch.done():
                batch.cancel()
                with contextlib.suppress(BaseException):
                    await batch
            self.windows.append((number, start, time.monotonic()))
        self.count_answers(step, requests, answers)

    def count_answers(
        self, step: _Step, requests: Sequence[dict[str, Any]], answers: Sequence[dict[str, Any]]
    ) -> None:
        lost_engine = any(e.joined == step.number for e in self.engines)
        for request, answer in zip(requests, answers, strict=True):
            meta = answer["meta_info"]
            wanted = request["sampling_params"]["max_new_tokens"]
            finish = (meta.get("finish_reason") or {}).get("type")
            if finish == "length" and len(answer["output_ids"]) == wanted:
                step.done += 1
            else:
                self.problems.append(
                    f"step {step.number}: request {request['input_ids']} ended {finish!r} with "
                    f"{len(answer['output_ids'])} of {wanted} tokens"
                )
            step.retracted += meta.get("num_retractions", 0) > 0
            step.aborted += meta.get("num_resubmissions", 0) > 0
        if self.mode is PauseMode.RETRACT and step.aborted and not lost_engine:
            self.problems.append(
                f"step {step.number}: {step.aborted} request(s) aborted under retract"
            )

    async def call(
        self, step: _Step, name: str, body: Callable[[], Awaitable[dict[str, float]]]
    ) -> None:
        """Run one lifecycle call; if a phase fails, heal the server and run it once more."""
        server = self.server
        assert server is not None
        before = server.state.value
        try:
            metrics = await body()
        except PhaseFailed as exc:
            bad = {k: str(v) for k, v in exc.outcomes.items() if not v.ok}
            self.progress(f"{name:<15} FAILED in phase {exc.phase}: {bad}")
            step.notes.append(f"{name} failed in {exc.phase} on {', '.join(sorted(bad))}")
            self.fault_seen.append(f"{exc.phase}:{','.join(sorted(bad))}")
            self.add_failed_call(step, name)
            await self.heal(step)
            before = server.state.value
            metrics = await body()
            step.notes.append(f"{name} run again")
        _merge(step.metrics, metrics)
        phases = [
            f"{key.rsplit('/', 1)[1][:-2]} {value * 1e3:.1f}ms"
            for key, value in metrics.items()
            if key.endswith("_s") and not key.endswith(("_slowest_s", "/total_s"))
        ]
        total = metrics.get(f"lifecycle/{name}/total_s", 0.0) * 1e3
        self.progress(
            f"{name:<15} {before:>16} -> {server.state.value:<16} {total:7.1f}ms  "
            + (", ".join(phases) or "(nothing to do)")
        )

    def add_failed_call(self, step: _Step, name: str) -> None:
        """A call that raised returns no metrics: count its phases from the timeline."""
        server = self.server
        assert server is not None
        spans = server.timeline.spans()
        calls = [s for s in spans if s.kind == "call" and s.name == name]
        if calls:
            index = calls[-1].call_index
            phases = [s for s in spans if s.kind == "phase" and s.call_index == index]
            _merge(step.metrics, {f"lifecycle/{s.call}/{s.name}_s": s.duration for s in phases})

    async def heal(self, step: _Step) -> None:
        """Leave ``failed``: replace broken engines with ``recover()``, else ``reset()``."""
        server = self.server
        assert server is not None
        broken = [e.id for e in server.snapshot().engines().values() if not e.alive or e.uncertain]
        if broken:
            for slot in broken:  # keep what a replaced engine did, for the checks
                engine = self.live[slot]
                engine.history = await self.history_of(engine)
            outcomes = await server.recover(self.replacement)
            self.progress(
                f"recover         replaced {', '.join(broken)} -> {server.state.value} "
                f"({', '.join(f'{k}: {v}' for k, v in sorted(outcomes.items())) or 'ok'})"
            )
            step.notes.append(f"recover() replaced {', '.join(broken)}")
            key = "lifecycle/recover/"
        else:
            try:
                await server.reset()
            except IllegalTransition:  # the records disagree: recover() finishes the job
                await server.recover(self.replacement)
            self.progress(f"reset           -> {server.state.value}")
            step.notes.append(f"reset() -> {server.state.value}")
            key = "lifecycle/reset/"
        _merge(step.metrics, {k: v for k, v in server.metrics.items() if k.startswith(key)})

    # -- engines -------------------------------------------------------------------------------

    def options(self, label: str, seed: int) -> dict[str, Any]:
        return {
            "label": label,
            "seed": seed,
            "token_latency": _TOKEN_LATENCY,
            "op_latency": _OP_LATENCY,
        }

    async def start_engines(self) -> None:
        args = self.args
        slots = [
            (f"group{g}/{i}", f"g{g}-{i}", self.args.seed + 100 * g + i)
            for g in range(args.groups)
            for i in range(args.engines)
        ]
        if args.real:
            await self.launch_real(slots)
        elif args.http:
            from rollout_lifecycle.testing.standin import StandInServer

            self.histories_dir = tempfile.TemporaryDirectory(prefix="rollout-lifecycle-demo-")
            folder = self.histories_dir.name
            servers = await asyncio.to_thread(
                StandInServer.start_all,
                [
                    StandInServer(
                        history_file=f"{folder}/{label}.jsonl", **self.options(label, seed)
                    )
                    for _, label, seed in slots
                ],
            )
            for (slot, label, _), standin in zip(slots, servers, strict=True):
                engine = _Engine(slot, label, self.http_actor(standin.url), 0, standin)
                self.engines.append(engine)
        else:
            for slot, label, seed in slots:
                factory = functools.partial(_faulty_simulated, **self.options(label, seed))
                handle = DemoEngine.options(num_cpus=0).remote(factory)
                self.engines.append(_Engine(slot, label, handle, 0))
        self.live = {e.slot: e for e in self.engines}
        await asyncio.wait_for(
            asyncio.gather(*(e.handle.ping.remote() for e in self.engines)), timeout=60
        )

    async def launch_real(self, slots: Sequence[tuple[str, str, int]]) -> None:
        """Launch one real SGLang server per slot, together, and an HTTP engine actor for each."""
        from rollout_lifecycle.backends.launch import launched_sglang_factory

        args = self.args
        launched = [
            launched_sglang_factory(
                args.model,
                port=_free_port(),
                python=args.sglang_python,
                memory_saver=False,
                env=args.sglang_env_map,
                extra_args=args.sglang_argv,
                label=label,
            )()
            for _, label, _ in slots
        ]
        for (slot, label, _), server in zip(slots, launched, strict=True):
            self.engines.append(_Engine(slot, label, None, 0, launched=server))
        self.progress(
            f"starting {len(launched)} SGLang server(s): {shlex.join(launched[0].command)}"
        )
        began = time.monotonic()
        await asyncio.gather(*(e.start() for e in launched))
        self.progress(
            f"{len(launched)} SGLang server(s) ready in {time.monotonic() - began:.1f}s: "
            + ", ".join(e.url for e in launched)
        )
        for started in self.engines:
            started.handle = self.http_actor(started.launched.url)

    def http_actor(self, url: str) -> Any:
        from rollout_lifecycle.backends.http import sglang_http_factory

        return start_engine_actor(sglang_http_factory(url))

    async def replacement(self, slot: str) -> Any:
        """``recover()``'s factory: a new engine for ``slot``, up and answering."""
        self.replacements += 1
        old = self.live[slot]
        label = f"{old.label.split('~')[0]}~r{self.replacements}"
        seed = self.args.seed + 1000 + self.replacements
        if self.args.http:
            from rollout_lifecycle.testing.standin import StandInServer

            assert self.histories_dir is not None
            standin = StandInServer(
                history_file=f"{self.histories_dir.name}/{label}.jsonl",
                **self.options(label, seed),
            )
            await asyncio.to_thread(standin.start)
            engine = _Engine(slot, label, self.http_actor(standin.url), self.step, standin)
        else:
            factory = functools.partial(_faulty_simulated, **self.options(label, seed))
            handle = DemoEngine.options(num_cpus=0).remote(factory)
            engine = _Engine(slot, label, handle, self.step)
        await asyncio.wait_for(engine.handle.ping.remote(), timeout=60)
        self.engines.append(engine)
        self.live[slot] = engine
        return engine.handle

    async def arm_fault(self, step: _Step) -> None:
        fault = self.args.inject_fault
        if fault == "none":
            return
        target = self.engines[0]
        if self.args.http:
            rules: dict[str, dict[str, Any]] = {
                "slow-flush": {"path": "/flush_cache", "kind": "delay", "seconds": SLOW_FLUSH_S},
                "flush-reject": {"path": "/flush_cache", "kind": "status", "status": 500},
                "engine-death": {"path": "/release_memory_occupation", "kind": "die"},
            }
            await asyncio.to_thread(target.standin.inject, rules[fault])
        else:
            op, kind, seconds = {
                "slow-flush": ("flush_cache", "slow", SLOW_FLUSH_S),
                "flush-reject": ("flush_cache", "reject", 0.0),
                "engine-death": ("release_memory_occupation", "die", 0.0),
            }[fault]
            await target.handle.arm.remote(op, kind, 1, seconds)
        step.notes.append(f"{fault} armed on {target.slot}")
        self.progress(f"fault armed     {fault} on {target.slot} ({target.label})")

    def sabotage(self, server: RolloutServer) -> None:
        """Continue one engine behind the server's back while its KV cache is released."""
        target = self.engines[0]

        async def breach(event: Any) -> None:
            remove()
            self.progress(f"sabotage        continue_generation sent to {target.slot} directly")
            await target.handle.continue_generation.remote()

        remove = server.on(ServerState.WEIGHTS_RESTORED, breach)

    async def history_of(self, engine: _Engine) -> list[dict[str, Any]]:
        if engine.history is not None:
            return engine.history
        if engine.launched is not None:
            assert self.server is not None
            return _timeline_history(self.server, engine.slot)
        if engine.standin is None:
            found: list[dict[str, Any]] = await asyncio.wait_for(
                engine.handle.history.remote(), timeout=30
            )
            return found
        if engine.standin.alive():
            with contextlib.suppress(Exception):
                found = await asyncio.to_thread(engine.standin.history)
                return found
        # A stand-in that died appended every op to its history file first.
        return await asyncio.to_thread(_read_history_file, engine.standin.history_file)

    async def stop_engines(self) -> None:
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine.handle)
        launched = [e.launched for e in self.engines if e.launched is not None]
        await asyncio.gather(*(e.close() for e in launched), return_exceptions=True)
        standins = [e.standin for e in self.engines if e.standin is not None]
        await asyncio.gather(*(asyncio.to_thread(s.stop, 2.0) for s in standins))
        if self.histories_dir is not None:
            self.histories_dir.cleanup()

    # -- results -------------------------------------------------------------------------------

    def table(self) -> None:
        columns = [
            ("pause", "offload/pause_s"),
            ("flush", "offload/flush_s"),
            ("release", "offload/release_s"),
            ("weights", "onload_weights/weights_s"),
            ("update", "update_weights/total_s"),
            ("kv", "onload_kv/kv_s"),
            ("continue", "onload_kv/continue_s"),
        ]
        self.say(
            "phase timings in ms (a failed attempt included); resident GiB "
            "(weights/kv_cache/cuda_graph) of all engines after the offload and the onload; "
            "aborted: requests aborted (abort pause) or lost with a dead engine, then "
            "resubmitted by the generation client"
        )
        header = " ".join(f"{name:>8}" for name, _ in columns)
        self.say(
            f"{'step':>4} {header} {'done':>5} {'retracted':>9} {'aborted':>7} "
            f"{'offloaded':>11} {'onloaded':>11}  notes"
        )
        for step in self.steps:
            cells = []
            for _, key in columns:
                value = step.metrics.get(f"lifecycle/{key}")
                cells.append(f"{'-' if value is None else f'{value * 1e3:.1f}':>8}")
            self.say(
                f"{step.number:>4} {' '.join(cells)} {step.done:>5} {step.retracted:>9} "
                f"{step.aborted:>7} {self.memory(step, 'offload'):>11} "
                f"{self.memory(step, 'onload_kv'):>11}  {'; '.join(step.notes)}"
            )

    @staticmethod
    def memory(step: _Step, call: str) -> str:
        found = [step.metrics.get(f"lifecycle/{call}/{tag}_bytes_after") for tag in _TAGS]
        if any(v is None for v in found):
            return "-"
        return "/".join(f"{(v or 0) / _GIB:g}" for v in found)

    def write_outputs(self, server: RolloutServer) -> None:
        paths = {name: self.dir / file for name, file in OUTPUTS.items()}
        server.timeline.export_chrome_trace(paths["trace"])
        paths["diagram"].write_text(mermaid(), encoding="utf-8")
        paths["metrics"].write_text(
            json.dumps(
                {
                    "steps": [{"step": s.number, "metrics": s.metrics} for s in self.steps],
                    "slowest_engines": server.slowest_engines,
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        written = [f"{paths['trace']} (open it in https://ui.perfetto.dev)"]
        try:
            server.timeline.plot_gantt(
                paths["gantt"], title=f"rollout-lifecycle demo: {self.args.steps} step(s)"
            )
            written.append(str(paths["gantt"]))
        except ImportError as exc:
            self.say(f"demo: no {OUTPUTS['gantt']}: {exc}")
        written += [str(paths["diagram"]), str(paths["metrics"])]
        self.say("wrote " + ", ".join(written))

    async def check(self, server: RolloutServer) -> None:
        """The invariants, on the engines' own histories and what the server reports."""
        histories = {e.label: await self.history_of(e) for e in self.engines}
        self.problems += self.order_problems(histories)
        expected = f"step-{self.args.steps}"
        versions = {}
        for engine in self.live.values():
            with contextlib.suppress(Exception):
                versions[engine.slot] = await asyncio.wait_for(
                    engine.handle.weight_version.remote(), timeout=30
                )
        if len(self.steps) == self.args.steps and self.steps[-1].done == self.args.requests:
            wrong = {k: v for k, v in versions.items() if v != expected}
            if wrong or len(versions) != len(self.live):
                self.problems.append(f"weight versions {versions}, expected all {expected!r}")
            if server.state is not ServerState.SERVING:
                self.problems.append(f"final state {server.state.value}, expected serving")
        if not self.args.real:  # a CPU server without the memory saver frees nothing
            self.problems += self.memory_problems()
        self.problems += self.fault_problems(server)
        ops = sum(len(h) for h in histories.values())
        verdict = "INVARIANTS BROKEN" if self.problems else "all invariants held"
        source = " (as the library's timeline recorded them)" if self.args.real else ""
        self.say(
            f"checked {ops} engine ops across {len(histories)} engines{source}: {verdict}; final "
            f"state {server.state.value}, weight version {versions.get(self.engines[0].slot)}"
        )

    def order_problems(self, histories: Mapping[str, list[dict[str, Any]]]) -> list[str]:
        """Barriers (invariants 1, 2 and 4) step by step, and no fatal call anywhere.

        In each step, the engines present from its start are checked together; an engine that
        joined in the step (a replacement) is checked on its own, and its continue must wait
        for every engine's KV cache like the others'.
        """
        problems: list[str] = []
        for number, start, end in self.windows:
            members: dict[str, list[dict[str, Any]]] = {}
            joined: dict[str, list[dict[str, Any]]] = {}
            for engine in self.engines:
                entries = [e for e in histories[engine.label] if start <= float(e["start"]) <= end]
                if entries:
                    (joined if engine.joined == number else members)[engine.label] = entries
            found = cycle_order_violations(members)
            for label, entries in joined.items():
                found += cycle_order_violations({label: entries})
                found += _join_barrier(label, entries, members)
            problems += [f"step {number}: {p}" for p in found if ": fatal " not in p]
        for label, history in histories.items():
            # A stand-in killed by an injected 'die' logs its death as fatal: the fault's doing.
            killed = any(e.get("op") == "fault" and e.get("kind") == "die" for e in history)
            for entry in history:
                if entry.get("outcome") != "fatal":
                    continue
                if not (killed and entry.get("op") == "server_died"):
                    problems.append(f"{label}: fatal {entry.get('op')} ({entry.get('detail')})")
        return problems

    def memory_problems(self) -> list[str]:
        """Every offload leaves the released tags at zero; every onload brings all back."""
        problems = []
        engines = len(self.live)
        for step in self.steps:
            for tag in _TAGS:
                offloaded = step.metrics.get(f"lifecycle/offload/{tag}_bytes_after")
                onloaded = step.metrics.get(f"lifecycle/onload_kv/{tag}_bytes_after")
                where = f"step {step.number}: {tag}"
                if offloaded is not None and offloaded != 0:
                    problems.append(f"{where}: {offloaded:g} bytes resident after the offload")
                full = engines * DEFAULT_MEMORY_BYTES[tag]
                if onloaded is not None and onloaded != full:
                    problems.append(f"{where}: {onloaded:g} bytes after the onload, not {full}")
        return problems

    def fault_problems(self, server: RolloutServer) -> list[str]:
        """An injected fault must have happened, and been handled."""
        fault = self.args.inject_fault
        target = self.engines[0].slot
        if fault == "none" or self.args.sabotage:
            return []
        if fault == "slow-flush":
            took = server.timeline.spans("engine_call")
            slow = [
                s
                for s in took
                if s.engine == target and s.op == "flush_cache" and s.duration >= SLOW_FLUSH_S
            ]
            return [] if slow else [f"slow-flush: no flush of {target} took {SLOW_FLUSH_S}s"]
        want = "flush" if fault == "flush-reject" else "release"
        if not any(seen == f"{want}:{target}" for seen in self.fault_seen):
            return [f"{fault}: no {want} failed on {target} alone (seen: {self.fault_seen})"]
        if fault == "engine-death" and not any(e.joined for e in self.engines):
            return [f"engine-death: {target} was never replaced"]
        return []


def _merge(into: dict[str, float], metrics: Mapping[str, float]) -> None:
    """Add one call's metrics to a step's: times and retries add up, the slowest is the max."""
    for key, value in metrics.items():
        if key.endswith("_slowest_s"):
            into[key] = max(into.get(key, value), value)
        elif key.endswith(("_s", "_retries")):
            into[key] = into.get(key, 0) + value
        else:
            into[key] = value


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


#: The memory tags each resume phase of the timeline resumes.
_PHASE_TAGS = {"weights": ["weights"], "kv": ["kv_cache", "cuda_graph"]}


def _timeline_history(server: RolloutServer, engine: str) -> list[dict[str, Any]]:
    """One engine's calls as the server's timeline recorded them, in the form of an engine
    history (for engines that keep none: real SGLang servers)."""
    return [
        {
            "op": span.op,
            "start": span.start,
            "end": span.end,
            "outcome": span.outcome,
            "tags": _PHASE_TAGS.get(span.phase or "", []),
            "engine": engine,
        }
        for span in server.timeline.spans("engine_call")
        if span.engine == engine
    ]


def _read_history_file(name: str) -> list[dict[str, Any]]:
    path = Path(name)
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def _join_barrier(
    label: str, entries: Sequence[Mapping[str, Any]], members: Mapping[str, Sequence[Any]]
) -> list[str]:
    """A replacement's first continue after it joined waits for every engine's KV restore,
    and no engine continues before the replacement has its KV cache back."""
    joined = float(entries[0]["start"])
    everyone = [e for h in (entries, *members.values()) for e in h if float(e["start"]) >= joined]
    kv = [
        e
        for e in everyone
        if e.get("op") == "resume_memory_occupation" and "kv_cache" in (e.get("tags") or ())
    ]
    resumed = [e for e in everyone if e.get("op") == "continue_generation"]
    if not kv or not resumed:
        return []
    last = max(kv, key=lambda e: float(e["end"]))
    first = min(resumed, key=lambda e: float(e["start"]))
    if float(first["start"]) < float(last["end"]):
        return [
            f"{label} joined: continue_generation started on {first.get('engine')} before "
            f"resume_kv ended on {last.get('engine')}"
        ]
    return []


__all__ = ["FAULTS", "OUTPUTS", "DemoEngine", "DemoEngineBody", "add_parser", "run"]
