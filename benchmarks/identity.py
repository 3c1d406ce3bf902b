"""What the identity checks cost: every checked call reads the engine first, against the same
calls sent plain.

Every call in ``CHECKED_OPS`` (pause, continue, release, resume, the begin of a weight-update
session, the version; not the session's end) is sent as ``EngineHost.checked(expect, op, *args)``,
which first reads the engine (``EngineHost.observe``) and only then runs the call. What it reads
is ``EngineRecord.expect``'s ``[incarnation, paused, identify]``: a pause reads only whether the
engine is paused (``/ping`` and ``/ready``), every other checked call the incarnation
(``/server_info``) and the pause state too (the first checked call of an engine reads its
incarnation whatever the call: the warm-up cycle's). A backend that offers ``observe()`` answers
the read itself: the HTTP client sends the routes asked for at once, the simulator answers from
its state in one call (one ``observe`` entry in its history, marked ``check_of``). Two
contenders, on the same engines and the same server, rounds interleaved (each round runs one
cycle of each, the order rotating):

- ``with checks``: the library as it is;
- ``without checks``: the same library with the commands' ``CHECKED_OPS`` patched empty
  (``rollout_lifecycle.core.commands.CHECKED_OPS = frozenset()``, in this process only: the
  runner issues the calls, so on Ray the actors then receive plain calls). Claims, guards,
  intents, the ledger and the timeline run in both.

A cycle is ``offload()``, ``onload_weights()``, ``update_weights(push, version=f"v{n}")``,
``onload_kv()``. Phase times are the server's own metrics (``lifecycle/<call>/<phase>_s``);
``flush``, the end of the weight-update session and the version read before the continue are
not checked (the controls); the cycle is timed around the four calls. Fleets:

- ``in-process``: ``SimulatedEngine(token_latency=0)``s in one group, the push a no-op; each
  cycle's engine calls are taken from the engines right after it (``take_history()``, untimed)
  and checked: every call ok, the barriers kept, and the reads the checks made, per engine and
  per checked operation (``check_of``): one ``observe`` per checked phase with checks
  (``expected_reads``), none without;
- ``ray``: simulated engine actors (``testing.simulated_engine_actors``), each lifecycle op
  taking U(LOW, HIGH) ms (``--latency-ms``; the read ``--read-latency-ms``), the push a no-op;
  the same checks of every cycle, from the actors' histories;
- ``real`` (``--real``): two real CPU SGLang servers this script starts (the test tier's flags
  and shim, as ``benchmarks/real_sglang.py --cpu``), each driven as an ``SGLangHTTPEngine``, the
  push ``FromDisk(model)``; then, with the servers serving and again paused, the time of one
  ``EngineHost.observe()`` (``/server_info``, ``/ping`` and ``/ready`` at once: the check of
  every checked call but a pause), of one ``observe(identify=False)`` (``/ping`` and ``/ready``
  at once: the pause's check), of each request alone, and of each ``observe`` on every server
  at once (as a phase sends them), with this process's CPU time for each.

    python -m benchmarks.identity                          # in process (100, 1,000) and Ray (16)
    python -m benchmarks.identity --real --fleet real      # two real CPU SGLang servers only
    python -m benchmarks.identity --sizes 1000 --rounds 31 --json /tmp/identity.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

from benchmarks._common import (
    PROOF_WINDOW,
    SPACED_S,
    Profile,
    complete_round,
    cpu_vllm_setup,
    machine,
    median,
    table,
    violations,
)
from benchmarks.soak_traffic import SGLANG_CACHE, cpu_sglang_launch
from rollout_lifecycle import (
    EngineGroup,
    EngineHost,
    FromDisk,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    SimulatedEngine,
    VLLMHTTPEngine,
    WeightUpdate,
    free_port,
    launched_vllm_factory,
)
from rollout_lifecycle.testing import local_ray, simulated_engine_actors

CHECKED = "with checks"
UNCHECKED = "without checks"
CONTENDERS = (CHECKED, UNCHECKED)
#: Where the baseline patches the checks away: the phase runner decides, per call, whether to
#: send it as ``checked(...)``. (A string, not an import: benchmarks use public names only.)
RUNNER_CHECKED_OPS = "rollout_lifecycle.core.commands.CHECKED_OPS"
#: What a check reads when its engine's last answer no longer proves its process (the calls of
#: a cycle spaced by more than ``LifecycleConfig.proof_window``, as a trainer's work spaces
#: them): the pause state where the record says paused (a new process is not paused), and the
#: incarnation with it for a pause of a serving engine. The first checked call of each call
#: reads; the ones after it in the same call are proven by the answers before them.
PAUSE_STATE = ("pause state",)
IDENTITY = ("incarnation", "pause state")
#: The paces a fleet's cycles run at: each call right after the one before, or spaced.
PACES = {"back to back": 0.0, f"calls {SPACED_S:g} s apart": SPACED_S}


class Phase(NamedTuple):
    """A phase reported: its name, its metric (``lifecycle/<call>_s``), the engine op each
    engine receives in it, whether that op is checked (``CHECKED_OPS``), and what its check
    reads of each engine in the spaced pace (back to back, no check reads anything: every
    answer proves the process for the next call)."""

    name: str
    call: str
    op: str
    checked: bool = False
    spaced: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The server's metric of the phase."""
        return f"lifecycle/{self.call}_s"

    def reads(self, gap: float) -> tuple[str, ...]:
        """What the phase's check reads at the pace ``gap``."""
        return self.spaced if gap > PROOF_WINDOW else ()


PHASES: tuple[Phase, ...] = (
    Phase("pause", "offload/pause", "pause_generation", True, IDENTITY),
    Phase("flush", "offload/flush", "flush_cache"),
    Phase("release", "offload/release", "release_memory_occupation", True),
    Phase(
        "resume_weights", "onload_weights/weights", "resume_memory_occupation", True, PAUSE_STATE
    ),
    Phase(
        "begin_weight_update",
        "update_weights/begin_weight_update",
        "begin_weight_update",
        True,
        PAUSE_STATE,
    ),
    Phase("end_weight_update", "update_weights/end_weight_update", "end_weight_update"),
    Phase(
        "update_weight_version",
        "update_weights/update_weight_version",
        "update_weight_version",
        True,
    ),
    Phase("resume_kv", "onload_kv/kv", "resume_memory_occupation", True, PAUSE_STATE),
    Phase("check_versions", "onload_kv/check_versions", "weight_version"),
    Phase("continue", "onload_kv/continue", "continue_generation", True),
)
CHECKED_PHASES = tuple(p.key for p in PHASES if p.checked)
#: The calls of a cycle, whose total times add up to the cycle (the gaps between them left out).
CALLS = ("offload", "onload_weights", "update_weights", "onload_kv")


def expected_reads(gap: float = 0.0, one_call: bool = True) -> Counter[str]:
    """The reads a cycle's checks make of one engine at the pace ``gap``, by the operation
    they check (their ``check_of``), derived from ``PHASES``: one per reading check where the
    backend answers ``observe()`` in one call (``one_call``, the simulator); else
    ``server_info`` where the check identifies the engine, plus ``ping`` and ``ready``, as
    ``EngineHost.observe`` reads a backend without ``observe()``."""
    reads: Counter[str] = Counter()
    for phase in PHASES:
        found = phase.reads(gap)
        if found:
            reads[phase.op] += 1 if one_call else int("incarnation" in found) + 2
    return reads


def possible_reads() -> Counter[str]:
    """Every read a cycle's checks may make of one engine, by the operation they check: one per
    checked call, as on a machine that stalls past the proof window before each of them."""
    return Counter(phase.op for phase in PHASES if phase.checked)


#: Keys of the derived per-cycle numbers.
CYCLE_KEY = "cycle_s"
CHECKED_SUM_KEY = "checked_phases_s"
#: The simulated engine's ops a check reads: ``observe`` (what ``EngineHost.observe`` asks the
#: simulator), and the reads it would make of a backend without one (``--read-latency-ms``).
READ_OPS = ("observe", "server_info", "ping", "ready")
#: The simulated engine's ops a cycle sends (``--latency-ms`` applies to them).
CYCLE_SIM_OPS = (
    "pause_generation",
    "flush_cache",
    "release_memory_occupation",
    "resume_memory_occupation",
    "begin_weight_update",
    "end_weight_update",
    "update_weight_version",
    "weight_version",
    "continue_generation",
)


@contextlib.contextmanager
def checks(on: bool) -> Iterator[None]:
    """The library as it is (``on``), or with no call checked (the commands' ``CHECKED_OPS``
    empty) for the body."""
    if on:
        yield
        return
    with mock.patch(RUNNER_CHECKED_OPS, frozenset()):
        yield


async def no_op_push(update: WeightUpdate) -> None:
    """A weight push that writes nothing (the session, the version and the flush still run)."""
    return None


@dataclass
class FleetRun:
    """One fleet's cycles at one pace, per contender, and what the checks of each cycle
    found."""

    fleet: str
    engines: int
    #: Seconds between the calls of a cycle (untimed): 0, or past the proof window.
    gap: float = 0.0
    #: Contender -> one metrics dict per timed cycle (plus ``cycle_s`` and ``checked_phases_s``).
    cycles: dict[str, list[dict[str, float]]] = field(
        default_factory=lambda: {name: [] for name in CONTENDERS}
    )
    #: Contender -> check reads per engine in each inspected cycle (where the engines keep a
    #: history; the median over the engines): ``sum(expected_reads().values())`` with checks,
    #: 0 without.
    reads: dict[str, list[float]] = field(default_factory=lambda: {n: [] for n in CONTENDERS})
    #: Contender -> cycles after which the server was not serving, an engine was dead or stale,
    #: an engine call failed, a barrier was broken or an engine missed a phase.
    bad: dict[str, list[str]] = field(default_factory=lambda: {n: [] for n in CONTENDERS})
    #: Contender -> cycles whose engine calls were checked (histories).
    inspected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONTENDERS, 0))
    final_state: str = ""
    dead: int = 0
    start_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: ``--real``: read -> (seconds, this process's CPU seconds) of each time it was timed.
    reads_s: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


async def timed_cycle(
    server: RolloutServer, push: Any, version: str, gap: float = 0.0
) -> dict[str, float]:
    """One cycle, ``gap`` seconds before each of its calls (a trainer's work, untimed); the
    server's metrics of it, the sum of its calls' times and the sum of its checked phases."""
    metrics: dict[str, float] = {}
    calls: list[Callable[[], Awaitable[dict[str, float]]]] = [
        server.offload,
        server.onload_weights,
        lambda: server.update_weights(push, version=version),
        server.onload_kv,
    ]
    for call in calls:
        if gap:
            await asyncio.sleep(gap)
        metrics.update(await call())
    metrics[CYCLE_KEY] = sum(metrics[f"lifecycle/{c}/total_s"] for c in CALLS)
    metrics[CHECKED_SUM_KEY] = sum(metrics.get(key, 0.0) for key in CHECKED_PHASES)
    return metrics


def server_faults(server: RolloutServer) -> list[str]:
    """What is wrong with the server after a cycle: not serving, dead or stale engines."""
    found = []
    if server.state is not ServerState.SERVING:
        found.append(f"server {server.state.value}")
    engines = server.snapshot().engines()
    found += [f"{e} dead" for e, s in engines.items() if not s.alive]
    found += [f"{e} stale" for e, s in engines.items() if s.stale]
    return found


def inspect_cycle(
    run: FleetRun, name: str, histories: Mapping[str, Sequence[Mapping[str, Any]]]
) -> None:
    """Check one cycle's engine calls: all ok, barriers kept, every phase once, and the reads
    of each engine's checks, by the operation they checked: ``expected_reads()`` with checks,
    none without (a difference is a problem of the cycle). Count the reads."""
    labels = list(histories)
    failed = [
        f"{engine}: {e.get('op')} {e.get('outcome')}"
        for engine, history in histories.items()
        for e in history
        if e.get("outcome") != "ok"
    ]
    run.bad[name] += failed[:5] + violations(histories, [labels])
    if not complete_round(histories, labels):
        run.bad[name].append("an engine missed a phase")
    # The pace forces the reads of ``expected_reads``; a machine that stalls past the proof
    # window before a call adds that call's read (at most one per checked call), as the
    # library must: an answer older than the window no longer proves the process.
    least = expected_reads(run.gap) if name == CHECKED else Counter()
    most = possible_reads() if name == CHECKED else Counter()
    counts = []
    for engine, history in histories.items():
        reads = Counter(str(e["check_of"]) for e in history if e.get("check_of") is not None)
        counts.append(reads.total())
        if not least <= reads <= most:
            run.bad[name].append(
                f"{engine}: check reads {dict(reads)}, expected at least {dict(least)} and at "
                f"most {dict(most)}"
            )
    run.reads[name].append(median(counts))
    run.inspected[name] += 1


async def _interleave(
    run: FleetRun,
    server: RolloutServer,
    rounds: int,
    push: Any,
    after: Callable[[str, float, float], Awaitable[None]] | None = None,
    budget_s: float | None = None,
    profile: Profile | None = None,
) -> None:
    """One untimed warm-up cycle per contender, then ``rounds`` rounds of one timed cycle per
    contender, their order rotating; ``after(name, began, ended)`` runs after each cycle,
    untimed (monotonic clock). Past ``budget_s`` no new round starts."""
    profile = profile or Profile(None)
    count = 0
    began_all = time.monotonic()
    for k in range(-1, rounds):
        if budget_s is not None and k >= 1 and time.monotonic() - began_all > budget_s:
            run.notes.append(f"stopped after {k} rounds (budget {budget_s:g} s)")
            break
        order = CONTENDERS if k % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            count += 1
            gc.collect()
            began = time.monotonic()
            with checks(name == CHECKED), profile.running() if name == CHECKED else _nothing():
                metrics = await timed_cycle(server, push, f"v{count}", run.gap)
            ended = time.monotonic()
            faults = server_faults(server)
            if k >= 0:
                run.cycles[name].append(metrics)
                run.bad[name] += faults
            elif faults:
                raise RuntimeError(f"warm-up cycle {name}: {faults}")
            if after is not None:
                await after(name if k >= 0 else "", began, ended)
        if k == -1:
            began_all = time.monotonic()


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _finish(run: FleetRun, server: RolloutServer) -> None:
    run.final_state = server.state.value
    run.dead = sum(not s.alive for s in server.snapshot().engines().values())


# -- in process ----------------------------------------------------------------------------------


async def run_in_process(
    engines: int, rounds: int, profile: Profile | None = None, gap: float = 0.0
) -> FleetRun:
    """``rounds`` rounds on ``engines`` in-process simulated engines with zero latency, the
    calls ``gap`` seconds apart."""
    fleet = [SimulatedEngine(f"sim-{i}", token_latency=0, seed=i) for i in range(engines)]
    server = RolloutServer([EngineGroup("actor", fleet)], name="identity-bench")
    run = FleetRun("in-process", engines, gap)

    async def after(name: str, began: float, ended: float) -> None:
        # Taken every cycle, so that the engines' histories do not grow through the run.
        histories = {e.label: e.take_history() for e in fleet}
        if name:
            inspect_cycle(run, name, histories)

    try:
        await _interleave(run, server, rounds, no_op_push, after, profile=profile)
        _finish(run, server)
    finally:
        await asyncio.gather(*(e.close() for e in fleet))
    return run


# -- Ray -----------------------------------------------------------------------------------------


async def run_on_ray(
    actors: int,
    rounds: int,
    latency_ms: tuple[float, float] = (1.0, 2.0),
    read_latency_ms: tuple[float, float] = (0.0, 0.0),
    seed: int = 0,
    gap: float = 0.0,
) -> FleetRun:
    """``rounds`` rounds on ``actors`` simulated engine actors, the calls ``gap`` seconds
    apart; needs a running Ray."""
    import ray

    low, high = latency_ms[0] / 1000, latency_ms[1] / 1000
    latency: dict[str, tuple[float, float]] = dict.fromkeys(CYCLE_SIM_OPS, (low, high))
    rlow, rhigh = read_latency_ms[0] / 1000, read_latency_ms[1] / 1000
    latency.update(dict.fromkeys(READ_OPS, (rlow, rhigh)))
    start = time.perf_counter()
    started = simulated_engine_actors(
        actors, label="sim", seed=seed, token_latency=0.0, op_latency=latency
    )
    run = FleetRun("ray", actors, gap)
    windows: list[tuple[str, float, float]] = []

    async def after(name: str, began: float, ended: float) -> None:
        if name:
            windows.append((name, began, ended))

    try:
        await asyncio.gather(*(a.ping.remote() for a in started))
        run.start_s = time.perf_counter() - start
        server = RolloutServer([EngineGroup("actor", started)], name="identity-bench")
        await _interleave(run, server, rounds, no_op_push, after)
        _finish(run, server)
        # The actors share this host's monotonic clock: each cycle's calls are the ones that
        # started inside its window.
        histories = await asyncio.gather(*(a.history.remote() for a in started))
        labels = [f"sim-{i}" for i in range(actors)]
        for name, began, ended in windows:
            inspect_cycle(
                run,
                name,
                {
                    label: [e for e in h if began <= float(e["start"]) <= ended]
                    for label, h in zip(labels, histories, strict=True)
                },
            )
    finally:
        for actor in started:
            ray.kill(actor)
    return run


# -- real SGLang servers -------------------------------------------------------------------------


#: ``EngineHost.observe`` as a check calls it: every checked call of a cycle but the pause
#: (the incarnation and the pause state), and the pause (the pause state only).
OBSERVE_IDENTIFY = "observe()"
OBSERVE_PAUSE_ONLY = "observe(identify=False)"


async def time_reads(
    hosts: Sequence[EngineHost], samples: int, state: str
) -> dict[str, list[tuple[float, float]]]:
    """(seconds, this process's CPU seconds) of ``EngineHost.observe()`` as the checks call it
    (with and without the incarnation) and of each of its requests alone, on one host at a
    time, and of each ``observe`` on every host at once (as a phase sends them); ``samples``
    rounds, the kinds' order rotating. ``state`` labels them."""
    one: dict[str, Callable[[EngineHost], Awaitable[Any]]] = {
        OBSERVE_IDENTIFY: lambda h: h.observe(),
        OBSERVE_PAUSE_ONLY: lambda h: h.observe(identify=False),
        "server_info": lambda h: h.backend.server_info(),
        "ping": lambda h: getattr(h.backend, "ping")(),  # noqa: B009 (not in the protocol)
        "ready": lambda h: getattr(h.backend, "ready")(),  # noqa: B009
    }
    every = {
        f"{kind} on all {len(hosts)} at once": one[kind]
        for kind in (OBSERVE_IDENTIFY, OBSERVE_PAUSE_ONLY)
    }
    names = [*one, *every]
    out: dict[str, list[tuple[float, float]]] = {f"{name}, {state}": [] for name in names}
    for k in range(samples):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            for host in hosts if name in one else [None]:
                wall, cpu = time.perf_counter(), time.process_time()
                if host is None:
                    await asyncio.gather(*(every[name](h) for h in hosts))
                else:
                    await one[name](host)
                took = time.perf_counter() - wall, time.process_time() - cpu
                out[f"{name}, {state}"].append(took)
    return out


def real_launch(kind: str, python: str | None, model: str | None) -> tuple[Callable[[], Any], str]:
    """A factory of CPU servers of ``kind`` (``sglang`` or ``vllm``) as the real-server test
    tiers run them, and the model path; defaults: ``ci/sglang-env``'s and ``ci/vllm-env``'s."""
    if kind == "sglang":
        return cpu_sglang_launch(python=python, model=model)
    venv = SGLANG_CACHE / "vllm-0.32.0"
    if python is None and not (venv / ".complete").exists():
        raise RuntimeError(f"no vLLM environment under {SGLANG_CACHE}: run bash ci/vllm-env")
    chosen = python or str(venv / "bin" / "python")
    path = model or str(SGLANG_CACHE / "tiny-gpt2")
    flags, env = cpu_vllm_setup()

    def launch() -> Any:
        return launched_vllm_factory(
            path, port=free_port(), python=chosen, env=env, extra_args=flags
        )()

    return launch, path


async def run_real(
    *,
    kind: str,
    servers: int,
    rounds: int,
    budget_s: float,
    samples: int,
    python: str | None,
    model: str | None,
    gaps: Sequence[float] = (0.0,),
) -> list[FleetRun]:
    """Start ``servers`` CPU servers of ``kind``, then run the contenders' cycles at each pace
    of ``gaps`` and time the reads (kept with the first pace's run)."""
    launch, model_path = real_launch(kind, python, model)
    launched: list[Any] = [launch() for _ in range(servers)]
    runs = [FleetRun(f"real {kind}", servers, gap) for gap in gaps]
    began = time.perf_counter()
    print(f"starting {servers} real {kind} server(s)", flush=True)
    backends: list[Any] = []
    client = SGLangHTTPEngine if kind == "sglang" else VLLMHTTPEngine
    try:
        await asyncio.gather(*(e.start() for e in launched))
        start_s = time.perf_counter() - began
        print(f"ready in {start_s:.1f} s", flush=True)
        backends = [client(e.url) for e in launched]
        server = RolloutServer([EngineGroup(kind, list(backends))], name="identity-bench")
        hosts: list[EngineHost] = list(server.groups[0].engines)
        for run in runs:
            run.start_s = start_s
            await _interleave(run, server, rounds, FromDisk(model_path), budget_s=budget_s)
            _finish(run, server)
        runs[0].reads_s = await time_reads(hosts, samples, "serving")
        await server.pause()
        runs[0].reads_s.update(await time_reads(hosts, samples, "paused"))
        await server.resume()
    finally:
        await asyncio.gather(*(b.close() for b in backends), return_exceptions=True)
        await asyncio.gather(*(e.close() for e in launched), return_exceptions=True)
    return runs


# -- report --------------------------------------------------------------------------------------


def _span(values: Sequence[float], scale: float, digits: int) -> str:
    if not values:
        return "-"
    return (
        f"{median(values) * scale:.{digits}f} "
        f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"
    )


def paired(run: FleetRun, key: str = CYCLE_KEY) -> tuple[list[float], list[float], float, float]:
    """``key``'s seconds with and without the checks, the median of the rounds' differences,
    and the ratio that difference makes over the median without."""
    w = [c.get(key, float("nan")) for c in run.cycles[CHECKED]]
    wo = [c.get(key, float("nan")) for c in run.cycles[UNCHECKED]]
    added = median([a - b for a, b in zip(w, wo, strict=False)])
    # Each round ran one cycle of each, in rotating order: the median of the rounds'
    # differences over the baseline's median is the ratio a bimodal spread leaves alone.
    ratio = 1 + added / median(wo) if wo and median(wo) > 0 else float("nan")
    return w, wo, added, ratio


def phase_rows(run: FleetRun) -> list[list[object]]:
    """Per phase: median (min-max) ms with and without checks, the added ms (median of each
    round's difference), per engine in microseconds, and with / without (1 + the added over
    the baseline's median)."""
    rows: list[list[object]] = []
    labels = [
        (p.name, p.key, ", ".join(p.reads(run.gap)) or ("nothing" if p.checked else "-"))
        for p in PHASES
    ]
    labels += [("checked phases, sum", CHECKED_SUM_KEY, ""), ("cycle (4 calls)", CYCLE_KEY, "")]
    digits = 3 if run.fleet == "in-process" and run.engines < 1000 else 2
    for name, key, checked in labels:
        w, wo, added, ratio = paired(run, key)
        rows.append(
            [
                name,
                checked,
                _span(w, 1e3, digits),
                _span(wo, 1e3, digits),
                f"{added * 1e3:+.{digits}f}",
                f"{added / run.engines * 1e6:+.1f}" if run.fleet == "in-process" else "-",
                f"{ratio:.2f}",
            ]
        )
    return rows


def report(run: FleetRun) -> str:
    """The fleet's table and its checks."""
    head = {
        "in-process": f"{run.engines:,} in-process simulated engines (zero latency), one group",
        "ray": f"{run.engines} simulated engine actors, one group "
        f"(fleet started in {run.start_s:.1f} s)",
        "real sglang": f"{run.engines} real CPU SGLang servers as SGLangHTTPEngine, one group "
        f"(ready in {run.start_s:.1f} s)",
        "real vllm": f"{run.engines} real CPU vLLM servers as VLLMHTTPEngine, one group "
        f"(ready in {run.start_s:.1f} s)",
    }[run.fleet]
    pace = next(name for name, gap in PACES.items() if gap == run.gap)
    cycles = {n: len(run.cycles[n]) for n in CONTENDERS}
    lines = [
        f"{head}, {pace}; {cycles[CHECKED]} / {cycles[UNCHECKED]} timed cycles with / without "
        f"checks",
        table(
            [
                "phase",
                "check reads",
                "with checks ms, median (min-max)",
                "without ms, median (min-max)",
                "added ms (median of rounds)",
                "added us per engine",
                "with / without (paired)",
            ],
            phase_rows(run),
        ),
    ]
    for name in CONTENDERS:
        want = expected_reads(run.gap).total() if name == CHECKED else 0
        reads = (
            f", check reads per engine per cycle {median(run.reads[name]):g} (expected {want})"
            if run.inspected[name]
            else ""
        )
        lines.append(
            f"{name}: {len(run.cycles[name])} cycles, {len(run.bad[name])} problems{reads}"
            + (f" ({'; '.join(run.bad[name][:3])})" if run.bad[name] else "")
        )
    lines.append(f"server ended {run.final_state}, dead engines {run.dead}")
    lines += run.notes
    if run.reads_s:
        rows = [
            [kind, _span([w for w, _ in v], 1e3, 2), _span([c for _, c in v], 1e3, 2), len(v)]
            for kind, v in run.reads_s.items()
        ]
        headers = ["engine read, engine state", "ms, median (min-max)", "client CPU ms", "n"]
        lines.append(table(headers, rows))
    return "\n".join(lines)


def as_json(runs: Sequence[FleetRun]) -> dict[str, Any]:
    """Every run's cycles and checks, for ``--json``."""
    return {
        "machine": machine(),
        "fleets": [
            {
                "fleet": r.fleet,
                "engines": r.engines,
                "gap_s": r.gap,
                "cycles": r.cycles,
                "reads_per_engine": r.reads,
                "problems": r.bad,
                "final_state": r.final_state,
                "dead": r.dead,
                "start_s": r.start_s,
                "notes": r.notes,
                "engine_reads_s": r.reads_s,
            }
            for r in runs
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]),
    )
    parser.add_argument(
        "--fleet",
        action="append",
        choices=("in-process", "ray", "real"),
        help="repeatable (default: in-process and ray, and real with --real)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument(
        "--rounds", type=int, help="in process: rounds per size (default 41 at <= 100, else 21)"
    )
    parser.add_argument("--ray-actors", type=int, default=16)
    parser.add_argument("--ray-rounds", type=int, default=31)
    parser.add_argument(
        "--latency-ms",
        type=float,
        nargs=2,
        default=(1.0, 2.0),
        metavar=("LOW", "HIGH"),
        help="Ray: each lifecycle op takes U(LOW, HIGH) ms (default 1 2)",
    )
    parser.add_argument(
        "--read-latency-ms",
        type=float,
        nargs=2,
        default=(0.0, 0.0),
        metavar=("LOW", "HIGH"),
        help="Ray: the check's read (observe) takes U(LOW, HIGH) ms (default 0 0)",
    )
    parser.add_argument(
        "--real", action="store_true", help="also two real CPU servers of each kind"
    )
    parser.add_argument(
        "--real-kinds", nargs="+", choices=("sglang", "vllm"), default=["sglang", "vllm"]
    )
    parser.add_argument(
        "--pace", action="append", choices=list(PACES), help="repeatable (default: every pace)"
    )
    parser.add_argument("--vllm-python", metavar="PY", help="real: the interpreter with vllm")
    parser.add_argument("--real-servers", type=int, default=2)
    parser.add_argument("--real-rounds", type=int, default=15)
    parser.add_argument(
        "--real-budget-s",
        type=float,
        default=90.0,
        help="real: start no new round after this many seconds of rounds (default 90)",
    )
    parser.add_argument(
        "--observe-samples", type=int, default=20, help="real: rounds of reads per state (20)"
    )
    parser.add_argument(
        "--sglang-python", metavar="PY", help="real: the interpreter with sglang (ci/sglang-env's)"
    )
    parser.add_argument("--model", metavar="PATH", help="real: the model (ci/sglang-env's)")
    parser.add_argument("--profile", help="append a pyinstrument profile of the checked cycles")
    parser.add_argument("--json", metavar="PATH", help="also write every cycle as JSON here")
    args = parser.parse_args(argv)
    fleets = args.fleet or ["in-process", "ray"]
    if args.real and "real" not in fleets:
        fleets.append("real")
    gaps = [PACES[name] for name in args.pace] if args.pace else list(PACES.values())
    print(f"machine: {machine()}")
    runs: list[FleetRun] = []

    def show(run: FleetRun) -> None:
        runs.append(run)
        print(report(run), flush=True)

    if "in-process" in fleets:
        for engines in args.sizes:
            for gap in gaps:
                rounds = args.rounds or (41 if engines <= 100 else 21)
                rounds = rounds if not gap else max(3, rounds // 3)  # (3 s of gaps a round)
                profile = Profile(args.profile if engines == max(args.sizes) else None)
                run = asyncio.run(run_in_process(engines, rounds, profile, gap))
                profile.write(f"checked cycles, {engines} in-process engines, gap {gap:g} s")
                show(run)
    if "ray" in fleets:
        with local_ray():
            for gap in gaps:
                rounds = args.ray_rounds if not gap else max(3, args.ray_rounds // 3)
                show(
                    asyncio.run(
                        run_on_ray(
                            args.ray_actors,
                            rounds,
                            (args.latency_ms[0], args.latency_ms[1]),
                            (args.read_latency_ms[0], args.read_latency_ms[1]),
                            gap=gap,
                        )
                    )
                )
    for kind in ("sglang", "vllm"):
        if "real" in fleets and kind in args.real_kinds:
            for run in asyncio.run(
                run_real(
                    kind=kind,
                    servers=args.real_servers,
                    rounds=args.real_rounds,
                    budget_s=args.real_budget_s,
                    samples=args.observe_samples,
                    python=args.sglang_python if kind == "sglang" else args.vllm_python,
                    model=args.model,
                    gaps=gaps,
                )
            ):
                show(run)
    if args.json:
        Path(args.json).write_text(json.dumps(as_json(runs), indent=2, default=str))
        print(f"cycles written to {args.json}")
    bad = sum(len(r.bad[n]) for r in runs for n in CONTENDERS) + sum(r.dead for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
