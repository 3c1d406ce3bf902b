"""Shared by the benchmarks: the cycle's phases, the library's cycle, engine histories split by
round, lower bounds, invariant checks, medians, tables and a description of the machine."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import statistics
import sys
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from rollout_lifecycle import LifecycleConfig, RolloutServer
from rollout_lifecycle.testing import (
    CYCLE_PHASES,
    cycle_order_violations,
    cycle_phase_of,
    cycle_rounds,
    send_to_engine,
)

History = Sequence[Mapping[str, Any]]

_CONFIG = LifecycleConfig()
#: How long an answer proves the process that gave it (the default ``proof_window``).
PROOF_WINDOW = _CONFIG.proof_window
#: Seconds between two calls that are just past the proof window, as after a trainer's work:
#: the later call's check reads the engine first.
SPACED_S = PROOF_WINDOW + 0.1
#: One full cycle (offload + onload weights + onload KV) as the library sends it: phase name,
#: engine op and its arguments, in barrier order. The baselines send exactly these calls.
CYCLE_CALLS: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("pause", "pause_generation", (_CONFIG.pause_mode.value,)),
    ("flush", "flush_cache", (_CONFIG.deadlines.flush, _CONFIG.flush_retry_interval)),
    ("release", "release_memory_occupation", ([t.value for t in _CONFIG.release_tags],)),
    ("resume_weights", "resume_memory_occupation", (["weights"],)),
    ("resume_kv", "resume_memory_occupation", (["kv_cache", "cuda_graph"],)),
    ("continue", "continue_generation", ()),
)
#: The phases of each lifecycle call of the cycle (offload, onload weights, onload KV), by name.
LIFECYCLE_CALLS: tuple[tuple[str, ...], ...] = (
    ("pause", "flush", "release"),
    ("resume_weights",),
    ("resume_kv", "continue"),
)
#: The simulated engine ops a cycle calls (the ones a latency distribution is given for).
CYCLE_OPS: tuple[str, ...] = tuple(dict.fromkeys(op for _, op, _ in CYCLE_CALLS))


def send(handle: Any, op: str, args: tuple[Any, ...]) -> Any:
    """``send_to_engine``, typed as Ray's untyped refs: the baselines hand them to ``ray.get``."""
    return send_to_engine(handle, op, args)


async def library_cycle(server: RolloutServer) -> None:
    """The library's full cycle."""
    await server.offload()
    await server.onload_weights()
    await server.onload_kv()


def rounds_by_index(histories: Mapping[str, History]) -> list[dict[str, History]]:
    """Round k of every engine, as a histories mapping per round."""
    split = {engine: cycle_rounds(h) for engine, h in histories.items()}
    count = max((len(r) for r in split.values()), default=0)
    return [{e: r[k] for e, r in split.items() if k < len(r)} for k in range(count)]


def lower_bound(round_histories: Mapping[str, History]) -> float:
    """The best possible time of one cycle with barriers: per phase, the slowest engine's call
    (as the engine itself measured it), summed over the phases."""
    slowest: dict[str, float] = {}
    for history in round_histories.values():
        for entry in history:
            phase = cycle_phase_of(entry)
            if phase is not None and entry.get("end") is not None:
                took = float(entry["end"]) - float(entry["start"])
                slowest[phase] = max(slowest.get(phase, 0.0), took)
    return sum(slowest.values())


def violations(
    round_histories: Mapping[str, History], servers: Sequence[Sequence[str]]
) -> list[str]:
    """Barrier violations and fatal ops of one round, checked within each server."""
    found: list[str] = []
    for index, engines in enumerate(servers):
        part = {e: round_histories[e] for e in engines if e in round_histories}
        found.extend(f"server {index}: {v}" for v in cycle_order_violations(part))
    return found


def complete_round(round_histories: Mapping[str, History], engines: Sequence[str]) -> bool:
    """True if every engine ran every phase of the cycle once, and each call succeeded."""
    want = [p[0] for p in CYCLE_PHASES]
    for engine in engines:
        entries = [e for e in round_histories.get(engine, ()) if cycle_phase_of(e) is not None]
        if [cycle_phase_of(e) for e in entries] != want or any(
            e.get("outcome") != "ok" for e in entries
        ):
            return False
    return True


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


class ServerLog:
    """The lines the servers a benchmark launched print (the launcher's ``<EVENT>.log``
    events), kept as they come; every other event goes on as the library's own logger sends
    it (to ``logging``'s ``rollout_lifecycle`` logger) once ``install()`` ed."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, _logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        if str(event.get("event", "")).endswith(".log"):
            self.lines.append(str(event.get("line", "")))
            raise structlog.DropEvent
        return event

    def install(self) -> ServerLog:
        """Route the library's events through this log; returns it."""
        structlog.configure(
            processors=[
                self,
                structlog.stdlib.filter_by_level,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
                structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=True),
            ],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger,
        )
        return self

    def take(self) -> list[str]:
        """The lines kept so far, forgotten here."""
        lines, self.lines = self.lines, []
        return lines


def cpu_wait_s() -> float | None:
    """Seconds the calling thread has spent ready to run but waiting for a CPU (Linux's
    ``/proc/thread-self/schedstat``, its second field: run-queue wait in ns); None where the
    kernel does not say. The difference over a timed call is how much of it the machine's
    other processes took from this one."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def machine() -> str:
    """One line about the machine: CPU model, cores, memory, Python and Ray versions."""
    import ray

    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                model = text.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kib / (1 << 20):.0f} GiB RAM"
    return (
        f"{model}, {os.cpu_count()} cores{memory}, {platform.system()} {platform.release()}, "
        f"Python {sys.version.split()[0]}, Ray {ray.__version__}"
    )


def _real_servers() -> Any:
    """``tests/real/servers.py``, read by path: the tests are not a package."""
    path = Path(__file__).resolve().parent.parent / "tests" / "real" / "servers.py"
    spec = importlib.util.spec_from_file_location("_real_servers", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"the CPU setup needs {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def cpu_sglang_setup() -> tuple[list[str], dict[str, str]]:
    """The real-server test tier's CPU flags and device-shim environment for SGLang servers."""
    module = _real_servers()
    env: dict[str, str] = module.RealSGLang(python="", model="").child_env()
    return list(module.CPU_FLAGS), env


def cpu_vllm_setup() -> tuple[list[str], dict[str, str]]:
    """The real-vLLM tier's CPU flags and environment for vLLM servers (dev mode, one process
    for the engine core and the model)."""
    module = _real_servers()
    env: dict[str, str] = module.RealVLLM(python="", model="").child_env()
    return list(module.VLLM_CPU_FLAGS), env


class Profile:
    """A pyinstrument profile accumulated over several timed bodies, written as text.

    Profiled runs time the profiled contender with the profiler's overhead: read their tables
    for where the time goes, not for the ratios.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._profiler: Any = None
        if path:
            from pyinstrument import Profiler

            self._profiler = Profiler(interval=0.0005, async_mode="enabled")

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Profile the body (nothing happens without a path)."""
        if self._profiler is None:
            yield
            return
        self._profiler.start()
        try:
            yield
        finally:
            self._profiler.stop()

    def write(self, title: str) -> None:
        """Append what was recorded so far to the file, under ``title``."""
        if self._profiler is None or self._profiler.last_session is None:
            return
        text = self._profiler.output_text(unicode=False, color=False, show_all=False)
        with open(str(self.path), "a", encoding="utf-8") as out:
            out.write(f"=== {title}\n{text}\n")
        print(f"profile of {title} appended to {self.path}")


def add_latency_argument(parser: argparse.ArgumentParser, default: tuple[float, float]) -> None:
    """``--latency-ms LOW HIGH``: every engine op takes U(LOW, HIGH) ms, seeded per engine."""
    parser.add_argument(
        "--latency-ms",
        type=float,
        nargs=2,
        default=default,
        metavar=("LOW", "HIGH"),
        help=f"each engine op takes U(LOW, HIGH) ms, seeded per engine (default {default[0]:g} "
        f"{default[1]:g})",
    )
