"""What the demo records and checks: each engine and step it ran, the table it prints, the files
it writes, and the invariants it checks at the end (the cycle order in every engine's history,
memory released and back, what the injected fault did).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_lifecycle.cli.demo_args import KIND_NAMES, OUTPUTS
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.core.server import RolloutServer
from rollout_lifecycle.core.states import ServerState, mermaid
from rollout_lifecycle.testing import barrier_violations, calls_received, fatal_calls
from rollout_lifecycle.testing.simulated import DEFAULT_MEMORY_BYTES

#: The delay of the ``slow-flush`` fault.
SLOW_FLUSH_S = 0.4


GIB = 1 << 30


TAGS = ("weights", "kv_cache", "cuda_graph")


#: The ops every engine receives in one full cycle (offload, onload weights, onload KV).
CYCLE_OPS = frozenset(
    {
        "pause_generation",
        "flush_cache",
        "release_memory_occupation",
        "resume_memory_occupation",
        "continue_generation",
    }
)


@dataclass(eq=False)
class StartedEngine:
    """One engine the demo started: the slot it fills and, once replaced, its history."""

    slot: str
    label: str
    handle: Any
    #: The step it joined in (0: from the start).
    joined: int
    standin: Any = None
    history: list[dict[str, Any]] | None = None
    #: The real server behind it, when the demo launched one, and its kind (``sglang``,
    #: ``vllm``).
    launched: Any = None
    kind: str = ""


@dataclass
class Step:
    """What one step did: metrics of its calls, the answers it got, what happened."""

    number: int
    metrics: dict[str, float] = field(default_factory=dict)
    done: int = 0
    retracted: int = 0
    aborted: int = 0
    notes: list[str] = field(default_factory=list)
    #: Each group's requests: [done, sent].
    by_group: dict[str, list[int]] = field(default_factory=dict)


def merge_metrics(into: dict[str, float], metrics: Mapping[str, float]) -> None:
    """Add one call's metrics to a step's: times and retries add up, the slowest is the max."""
    for key, value in metrics.items():
        if key.endswith("_slowest_s"):
            into[key] = max(into.get(key, value), value)
        elif key.endswith(("_s", "_retries")):
            into[key] = into.get(key, 0) + value
        else:
            into[key] = value


#: The memory tags each resume phase of the timeline resumes.
_PHASE_TAGS = {"weights": ["weights"], "kv": ["kv_cache", "cuda_graph"]}


def timeline_history(server: RolloutServer, engine: str) -> list[dict[str, Any]]:
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


def read_history_file(name: str) -> list[dict[str, Any]]:
    path = Path(name)
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


class DemoReport:
    """The demo's table, output files and end-of-run checks; ``_Demo`` runs the steps that fill
    them (and sets the attributes below)."""

    args: argparse.Namespace
    dir: Path
    engines: list[StartedEngine]
    live: dict[str, StartedEngine]
    steps: list[Step]
    windows: list[tuple[int, float, float]]
    problems: list[str]
    fault_seen: list[str]
    #: Each group's name and kind (``KIND_NAMES``).
    group_kinds: list[tuple[str, str]]

    def say(self, text: str) -> None:
        raise NotImplementedError

    async def history_of(self, engine: StartedEngine) -> list[dict[str, Any]]:
        raise NotImplementedError

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

    def groups_report(self, server: RolloutServer) -> None:
        """A line per group: its kind, the steps in which every engine of it ran the whole
        cycle without a failure (on the server's timeline), and its requests done and lost.
        Without a fault, a group that missed a cycle or lost a request breaks an invariant."""
        spans = [s for s in server.timeline.spans("engine_call") if s.outcome == Outcome.OK]
        engines = self.args.engines
        for name, kind in self.group_kinds:
            cycled = 0
            for _, start, end in self.windows:
                ops: dict[str, set[str]] = {}
                for span in spans:
                    if span.group == name and start <= span.start <= end:
                        ops.setdefault(str(span.engine), set()).add(str(span.op))
                cycled += len(ops) == engines and all(o >= CYCLE_OPS for o in ops.values())
            done = sum(s.by_group.get(name, [0, 0])[0] for s in self.steps)
            sent = sum(s.by_group.get(name, [0, 0])[1] for s in self.steps)
            self.say(
                f"group {name} ({KIND_NAMES[kind]} x{engines}): cycled in {cycled}/"
                f"{len(self.windows)} step(s), {done}/{sent} requests done, {sent - done} lost"
            )
            faultless = self.args.inject_fault == "none" and not self.args.sabotage
            if faultless and cycled != len(self.windows):
                self.problems.append(
                    f"group {name}: every engine cycled in {cycled} of {len(self.windows)} step(s)"
                )

    @staticmethod
    def memory(step: Step, call: str) -> str:
        found = [step.metrics.get(f"lifecycle/{call}/{tag}_bytes_after") for tag in TAGS]
        if any(v is None for v in found):
            return "-"
        return "/".join(f"{(v or 0) / GIB:g}" for v in found)

    def write_outputs(self, server: RolloutServer) -> None:
        paths = {name: self.dir / file for name, file in OUTPUTS.items()}
        # The trace names each group's engine kind (its processes are the groups).
        trace = server.timeline.chrome_trace()
        trace["otherData"]["engine_kinds"] = {n: KIND_NAMES[k] for n, k in self.group_kinds}
        paths["trace"].write_text(json.dumps(trace), encoding="utf-8")
        paths["diagram"].write_text(mermaid(), encoding="utf-8")
        paths["metrics"].write_text(
            json.dumps(
                {
                    "groups": {name: kind for name, kind in self.group_kinds},
                    "steps": [
                        {"step": s.number, "metrics": s.metrics, "requests": s.by_group}
                        for s in self.steps
                    ],
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
        # (the reads an engine host made to check each call are part of that call)
        ops = sum(len(calls_received(h)) for h in histories.values())
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
            found = barrier_violations(members)
            for label, entries in joined.items():
                found += barrier_violations({label: entries})
                # From the moment it joined, its KV restore and everyone's hold the continue.
                joined_at = float(entries[0]["start"])
                since = {
                    k: [e for e in h if float(e["start"]) >= joined_at]
                    for k, h in {**members, label: entries}.items()
                }
                kv_first = ("resume_kv", "continue")
                found += [
                    f"{label} joined: {p}"
                    for p in barrier_violations(since, scopes=[joined_at], phases=kv_first)
                ]
            problems += [f"step {number}: {p}" for p in found]
        for label, history in histories.items():
            # A stand-in killed by an injected 'die' logs its death as fatal: the fault's doing.
            killed = any(e.get("op") == "fault" and e.get("kind") == "die" for e in history)
            problems += [
                p
                for p in fatal_calls({label: history})
                if not (killed and p.startswith(f"{label}: fatal server_died "))
            ]
        return problems

    def memory_problems(self) -> list[str]:
        """Every offload leaves the released tags at zero; every onload brings all back."""
        problems = []
        engines = len(self.live)
        for step in self.steps:
            for tag in TAGS:
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
