"""The ``rollout-lifecycle demo`` command's run: colocated RL steps on local Ray, checked and
drawn (what it does is its description, ``demo_args.DESCRIPTION``; its parser is there too)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import shlex
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import ray

from rollout_lifecycle.backends.actor import EngineActorBody, start_engine_actor
from rollout_lifecycle.backends.ports import free_port
from rollout_lifecycle.backends.weights import FromDisk
from rollout_lifecycle.cli.demo_args import FAULTS, OUTPUTS, add_parser
from rollout_lifecycle.cli.demo_report import (
    SLOW_FLUSH_S,
    DemoReport,
    StartedEngine,
    Step,
    merge_metrics,
    read_history_file,
    timeline_history,
)
from rollout_lifecycle.cli.demo_router import DemoRouting
from rollout_lifecycle.contract.exceptions import (
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    PhaseFailed,
)
from rollout_lifecycle.contract.values import PauseMode
from rollout_lifecycle.core.config import LifecycleConfig
from rollout_lifecycle.core.group import EngineGroup
from rollout_lifecycle.core.server import RolloutServer
from rollout_lifecycle.core.states import ServerState
from rollout_lifecycle.testing import local_ray
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.simulated import SimulatedEngine

#: Engines per group and groups when none are given: simulated, and real servers (each holds
#: a whole SGLang server's memory, ~3 GB for a tiny model on a CPU).
DEFAULT_LAYOUT = {"simulated": (2, 2), "real": (1, 2)}


#: Requests per step when none are given, and their new tokens (real: long enough to be
#: decoding when the offload comes).
DEFAULT_REQUESTS = {"simulated": 16, "real": 6}


_REAL_NEW_TOKENS = 96


#: Seconds the demo lets real requests decode before the offload.
_REAL_WARMUP_S = 1.0


_TOKEN_LATENCY = 0.004


_OP_LATENCY: dict[str, float | tuple[float, float]] = {
    "pause_generation": (0.001, 0.01),
    "flush_cache": (0.001, 0.01),
    "release_memory_occupation": (0.01, 0.05),
    "resume_memory_occupation": (0.01, 0.05),
    "continue_generation": (0.001, 0.005),
}


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
    if args.router is not None and not (real or args.http):
        raise SystemExit(
            "rollout-lifecycle: --router needs engines with URLs: --http, or real servers"
        )
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


class _Demo(DemoReport, DemoRouting):
    def __init__(self, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.args = args
        self.out = out
        self.err = err
        self.dir = Path(args.out)
        self.mode = PauseMode(args.pause_mode)
        self.fault_step = min(2, args.steps)
        self.engines: list[StartedEngine] = []
        self.live: dict[str, StartedEngine] = {}
        self.steps: list[Step] = []
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
        self.no_router_yet()

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
                router = await self.start_router()
                server = self.server = RolloutServer(
                    self.make_groups(),
                    LifecycleConfig(
                        pause_mode=self.mode,
                        memory_metrics=True,
                        timeline_calls=8 * args.steps + 16,
                    ),
                    name="demo",
                    router=router,
                )
                await self.register_workers(server)
                for number in range(1, args.steps + 1):
                    self.step = number
                    await self.run_step(server, number)
            except (LifecycleError, asyncio.TimeoutError) as exc:
                # What the library could not handle is reported with the checks, not a traceback.
                self.problems.append(f"step {self.step}: {type(exc).__name__}: {exc}")
                self.progress(f"stopped: {type(exc).__name__}: {exc}")
            if self.server is not None:
                with contextlib.suppress(LifecycleError):  # (an unreachable router: reported)
                    await self.check_router()
                self.table()
                self.write_outputs(self.server)
                await self.check(self.server)
        finally:
            await self.stop_router()
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
        step = Step(number)
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
        batch = asyncio.ensure_future(self.send(server, requests))
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
        self, step: Step, requests: Sequence[dict[str, Any]], answers: Sequence[dict[str, Any]]
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
        self, step: Step, name: str, body: Callable[[], Awaitable[dict[str, float]]]
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
        merge_metrics(step.metrics, metrics)
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

    def add_failed_call(self, step: Step, name: str) -> None:
        """A call that raised returns no metrics: count its phases from the timeline."""
        server = self.server
        assert server is not None
        spans = server.timeline.spans()
        calls = [s for s in spans if s.kind == "call" and s.name == name]
        if calls:
            index = calls[-1].call_index
            phases = [s for s in spans if s.kind == "phase" and s.call_index == index]
            merge_metrics(
                step.metrics, {f"lifecycle/{s.call}/{s.name}_s": s.duration for s in phases}
            )

    async def heal(self, step: Step) -> None:
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
        merge_metrics(step.metrics, {k: v for k, v in server.metrics.items() if k.startswith(key)})

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
                engine = StartedEngine(slot, label, self.http_actor(standin.url), 0, standin)
                self.engines.append(engine)
        else:
            for slot, label, seed in slots:
                factory = functools.partial(_faulty_simulated, **self.options(label, seed))
                handle = DemoEngine.options(num_cpus=0).remote(factory)
                self.engines.append(StartedEngine(slot, label, handle, 0))
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
                port=free_port(),
                python=args.sglang_python,
                memory_saver=False,
                env=args.sglang_env_map,
                extra_args=args.sglang_argv,
                label=label,
            )()
            for _, label, _ in slots
        ]
        for (slot, label, _), server in zip(slots, launched, strict=True):
            self.engines.append(StartedEngine(slot, label, None, 0, launched=server))
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
            engine = StartedEngine(slot, label, self.http_actor(standin.url), self.step, standin)
        else:
            factory = functools.partial(_faulty_simulated, **self.options(label, seed))
            handle = DemoEngine.options(num_cpus=0).remote(factory)
            engine = StartedEngine(slot, label, handle, self.step)
        await asyncio.wait_for(engine.handle.ping.remote(), timeout=60)
        self.engines.append(engine)
        self.live[slot] = engine
        return engine.handle

    async def arm_fault(self, step: Step) -> None:
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

    async def history_of(self, engine: StartedEngine) -> list[dict[str, Any]]:
        if engine.history is not None:
            return engine.history
        if engine.launched is not None:
            assert self.server is not None
            return timeline_history(self.server, engine.slot)
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
        return await asyncio.to_thread(read_history_file, engine.standin.history_file)

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


__all__ = ["FAULTS", "OUTPUTS", "DemoEngine", "DemoEngineBody", "add_parser", "run"]
