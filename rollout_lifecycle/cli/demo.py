"""The ``rollout-lifecycle demo`` command's run: colocated RL steps on local Ray, checked and
drawn (what it does is its description, ``demo_args.DESCRIPTION``; its parser is there too)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import ray

from rollout_lifecycle.backends.actor import EngineActorBody, start_engine_actor
from rollout_lifecycle.backends.ports import free_port
from rollout_lifecycle.backends.weights import FromDisk
from rollout_lifecycle.cli.ctl_state import ENGINE_NAMES
from rollout_lifecycle.cli.demo_args import FAULTS, KIND_NAMES, OUTPUTS, REAL_KINDS, add_parser
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

#: Groups and engines per group when none are given: simulated, real servers (each holds a
#: whole server's memory, ~3 GB for a tiny model on a CPU), and a mixed fleet (one SGLang
#: group and one vLLM group).
DEFAULT_LAYOUT = {"simulated": (2, 2), "real": (1, 2), "mixed": (2, 1)}


#: Requests per step when none are given, and their new tokens (real: long enough to be
#: decoding when the offload comes).
DEFAULT_REQUESTS = {"simulated": 16, "real": 6}


#: (vLLM decodes a tiny model on a CPU ~10x faster than SGLang: its requests are longer, within
#: the tiny model's 2,048 positions.)
_REAL_NEW_TOKENS = {"sglang": 96, "vllm": 1200}


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


def _fail(text: str) -> NoReturn:
    raise SystemExit(f"rollout-lifecycle: {text}")


def _server_options(args: argparse.Namespace, kind: str) -> tuple[dict[str, str], list[str]]:
    """``--KIND-env`` as a mapping and ``--KIND-args`` as a list, checked."""
    env: dict[str, str] = {}
    for item in getattr(args, f"{kind}_env"):
        name, sep, value = item.partition("=")
        if not sep or not name:
            _fail(f"--{kind}-env wants NAME=VALUE, got {item!r}")
        env[name] = value
    argv: list[str] = []
    for chunk in getattr(args, f"{kind}_args"):
        try:
            argv += shlex.split(chunk)
        except ValueError as exc:
            _fail(f"--{kind}-args {chunk!r}: {exc}")
    return env, argv


def _launcher(args: argparse.Namespace, kind: str, port: int, label: str) -> Any:
    """A zero-argument factory of one real server of ``kind`` (checked now, started later)."""
    options: dict[str, Any] = {
        "port": port,
        "python": args.python_of[kind],
        "env": args.server_env[kind],
        "extra_args": args.server_argv[kind],
        "label": label,
    }
    if kind == "vllm":
        from rollout_lifecycle.backends.vllm.launch import launched_vllm_factory

        return launched_vllm_factory(args.model, **options)
    from rollout_lifecycle.backends.sglang.launch import launched_sglang_factory

    return launched_sglang_factory(args.model, memory_saver=False, **options)


def check_options(args: argparse.Namespace) -> None:
    """Check the parsed options (``SystemExit`` naming a bad value); sets ``args.kinds`` (the
    real servers' kinds, none for simulated engines), ``args.real`` and the layout."""
    kinds = [k for k in REAL_KINDS if getattr(args, f"{k}_python") is not None]
    for kind in REAL_KINDS:
        given = [f"--{kind}-{what}" for what in ("args", "env") if getattr(args, f"{kind}_{what}")]
        if given and kind not in kinds:
            _fail(f"{' and '.join(given)} need --{kind}-python and --model")
    if kinds and args.model is None:
        flags = ", ".join(f"--{k}-python {getattr(args, f'{k}_python')}" for k in kinds)
        _fail(f"{flags}: needs --model (the model the servers load)")
    if args.model is not None and not kinds:
        _fail(f"--model {args.model}: needs --sglang-python and/or --vllm-python")
    real = bool(kinds)
    if real:
        clashes = [
            name
            for name, used in (
                ("--http", args.http),
                (f"--inject-fault {args.inject_fault}", args.inject_fault != "none"),
                ("--sabotage", args.sabotage),
            )
            if used
        ]
        names = " and ".join(ENGINE_NAMES[k] for k in kinds)
        if clashes:
            _fail(
                f"not with real {names} servers: {', '.join(clashes)} (fault injection is "
                "designed for the simulated engines)"
            )
        if "vllm" in kinds and args.router is not None:
            _fail(
                f"--router {args.router}: not with real vLLM servers (sglang-router sends "
                "SGLang's /generate to its workers)"
            )
        args.python_of = {k: getattr(args, f"{k}_python") for k in kinds}
        args.server_env, args.server_argv = {}, {}
        for kind in kinds:
            args.server_env[kind], args.server_argv[kind] = _server_options(args, kind)
            python = args.python_of[kind]
            if shutil.which(python) is None:
                _fail(f"--{kind}-python {python}: no such interpreter")
            try:  # the launcher's own checks (a key flag in the arguments, ...), before Ray
                _launcher(args, kind, 1, "check")
            except InvalidArgument as exc:
                _fail(f"--{kind}-python/--{kind}-args/--{kind}-env: {exc}")
    args.kinds = kinds
    args.real = real
    if args.router is not None and not (real or args.http):
        _fail("--router needs engines with URLs: --http, or real servers")
    layout = "mixed" if len(kinds) > 1 else "real" if real else "simulated"
    groups, engines = DEFAULT_LAYOUT[layout]
    if layout == "mixed" and args.groups not in (None, groups):
        _fail(
            f"--groups {args.groups}: a mixed fleet has one SGLang group and one vLLM group "
            "(use --engines for more servers in each)"
        )
    args.groups = groups if args.groups is None else args.groups
    args.engines = engines if args.engines is None else args.engines
    if args.requests is None:
        args.requests = DEFAULT_REQUESTS["real" if real else "simulated"]
    _positive("steps", args.steps, 1000)
    _positive("groups", args.groups, 8)
    _positive("engines", args.engines, 16)
    _positive("requests", args.requests, 10_000)


def group_kinds(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Each engine group's name and kind (``KIND_NAMES``), in order, for checked ``args``.

    Simulated engines and stand-ins are ``group0``, ``group1``, ...; a group of real servers
    is named after its kind (``sglang0``, ``vllm0``): a mixed fleet is ``sglang0`` and
    ``vllm0``.
    """
    if not args.kinds:
        kind = "standin" if args.http else "simulated"
        return [(f"group{g}", kind) for g in range(args.groups)]
    found: list[tuple[str, str]] = []
    for g in range(args.groups):
        kind = args.kinds[g % len(args.kinds)]
        found.append((f"{kind}{sum(k == kind for _, k in found)}", kind))
    return found


def run(
    args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run the demo on a local Ray cluster (one already running is used and left running)."""
    check_options(args)
    out = stdout or sys.stdout
    started = time.monotonic()
    with local_ray():
        code = asyncio.run(_Demo(args, out, stderr or sys.stderr).run())
    print(f"demo finished in {time.monotonic() - started:.1f}s", file=out)
    return code


class _RealServers:
    """The real servers the demo launches and stops; ``_Demo`` sets the attributes below."""

    args: argparse.Namespace
    engines: list[StartedEngine]
    group_kinds: list[tuple[str, str]]

    def progress(self, text: str) -> None:
        raise NotImplementedError

    async def launch_real(self, slots: Sequence[tuple[str, str, int]]) -> None:
        """Launch one real server per slot, of its group's kind, all together, and an HTTP
        engine actor for each."""
        kind_of = dict(self.group_kinds)
        for slot, label, _ in slots:
            kind = kind_of[slot.partition("/")[0]]
            server = _launcher(self.args, kind, free_port(), label)()
            self.engines.append(StartedEngine(slot, label, None, 0, launched=server, kind=kind))
        by_kind: dict[str, list[Any]] = {}
        for engine in self.engines:
            by_kind.setdefault(engine.kind, []).append(engine.launched)
        for kind, servers in by_kind.items():
            self.progress(
                f"starting {len(servers)} {ENGINE_NAMES[kind]} server(s): "
                f"{shlex.join(servers[0].command)}"
            )
        began = time.monotonic()

        async def start(kind: str, servers: list[Any]) -> None:
            await asyncio.gather(*(e.start() for e in servers))
            self.progress(
                f"{len(servers)} {ENGINE_NAMES[kind]} server(s) ready in "
                f"{time.monotonic() - began:.1f}s: "
                + ", ".join(f"{e.url} (pid {e.pid})" for e in servers)
            )

        await asyncio.gather(*(start(kind, servers) for kind, servers in by_kind.items()))
        for started in self.engines:
            started.handle = self.http_actor(started.launched.url, started.kind)

    def http_actor(self, url: str, kind: str) -> Any:
        """An engine actor driving the server at ``url`` (vLLM's API for ``vllm``, else
        SGLang's)."""
        if kind == "vllm":
            from rollout_lifecycle.backends.vllm.client import vllm_http_factory

            return start_engine_actor(vllm_http_factory(url))
        from rollout_lifecycle.backends.sglang.client import sglang_http_factory

        return start_engine_actor(sglang_http_factory(url))

    async def stop_launched(self) -> None:
        """Stop every real server launched (its whole process group) and say so."""
        launched = [e for e in self.engines if e.launched is not None]
        await asyncio.gather(*(e.launched.close() for e in launched), return_exceptions=True)
        for kind in REAL_KINDS:
            stopped = [e.launched for e in launched if e.kind == kind]
            if stopped:
                self.progress(
                    f"stopped {len(stopped)} {ENGINE_NAMES[kind]} server(s): "
                    + ", ".join(f"pid {e.pid} exit {e.returncode}" for e in stopped)
                )


class _Demo(DemoReport, DemoRouting, _RealServers):
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
        #: Each group's name and kind.
        self.group_kinds = group_kinds(args)
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
        kinds = [KIND_NAMES[k] for k in args.kinds] or [KIND_NAMES[self.group_kinds[0][1]]]
        fleet = f"{args.groups} group(s) x {args.engines} {kinds[0]}(s)"
        if args.real:
            launched = ", ".join(f"{k} with {args.python_of[k]}" for k in args.kinds)
            where = f"(model {args.model}, launched: {launched})"
        if len(kinds) > 1:
            fleet = "a mixed fleet: " + " and ".join(f"{args.engines} {k}(s)" for k in kinds)
        self.say(
            f"demo: {fleet} {where}, pause mode {args.pause_mode}, {args.steps} step(s), "
            f"{args.requests} requests per step, fault: {args.inject_fault}"
        )
        self.say(
            "demo: groups: "
            + ", ".join(f"{name} = {KIND_NAMES[k]}s" for name, k in self.group_kinds)
            + (" (in one RolloutServer: every barrier spans both)" if len(kinds) > 1 else "")
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
                self.groups_report(self.server)
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
        # A real fleet's requests go to its groups in turn (each kind gets its own length);
        # simulated ones to any engine, least outstanding first.
        groups: list[str | None] = [
            self.group_kinds[i % len(self.group_kinds)][0] if args.real else None
            for i in range(args.requests)
        ]
        kind_of = dict(self.group_kinds)
        requests: list[dict[str, Any]] = [
            {
                "input_ids": [number, i],
                "sampling_params": {
                    "max_new_tokens": (_REAL_NEW_TOKENS[kind_of[g]] if g else 40) + i % 24
                },
            }
            for i, g in enumerate(groups)
        ]
        if args.real:  # a real model may stop early at its end-of-text token
            for request in requests:
                request["sampling_params"]["ignore_eos"] = True
        batch = asyncio.ensure_future(self.send(server, requests, groups))
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
        self.count_answers(step, requests, answers, groups)

    def count_answers(
        self,
        step: Step,
        requests: Sequence[dict[str, Any]],
        answers: Sequence[dict[str, Any]],
        groups: Sequence[str | None],
    ) -> None:
        lost_engine = any(e.joined == step.number for e in self.engines)
        for request, answer, group in zip(requests, answers, groups, strict=True):
            meta = answer["meta_info"]
            wanted = request["sampling_params"]["max_new_tokens"]
            finish = (meta.get("finish_reason") or {}).get("type")
            served = meta.get("engines") or []
            # The group it was sent to, else the one whose engine answered it.
            name = group or (str(served[-1]).partition("/")[0] if served else "?")
            counts = step.by_group.setdefault(name, [0, 0])
            counts[1] += 1
            if finish == "length" and len(answer["output_ids"]) == wanted:
                step.done += 1
                counts[0] += 1
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
            (f"{name}/{i}", f"{name}-{i}" if args.real else f"g{g}-{i}", args.seed + 100 * g + i)
            for g, (name, _) in enumerate(self.group_kinds)
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
                handle = self.http_actor(standin.url, "standin")
                engine = StartedEngine(slot, label, handle, 0, standin)
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
            handle = self.http_actor(standin.url, "standin")
            engine = StartedEngine(slot, label, handle, self.step, standin)
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
        await self.stop_launched()
        standins = [e.standin for e in self.engines if e.standin is not None]
        await asyncio.gather(*(asyncio.to_thread(s.stop, 2.0) for s in standins))
        if self.histories_dir is not None:
            self.histories_dir.cleanup()

    # -- results -------------------------------------------------------------------------------


__all__ = [
    "FAULTS",
    "OUTPUTS",
    "DemoEngine",
    "DemoEngineBody",
    "add_parser",
    "check_options",
    "group_kinds",
    "run",
]
