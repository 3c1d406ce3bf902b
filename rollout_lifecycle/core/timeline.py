"""The lifecycle timeline: every call, phase and engine call a server made, as timed spans.

Recording is cheap (one tuple per engine call, appended to a list; nothing is formatted) and
bounded (the spans of the last ``LifecycleConfig.timeline_calls`` public calls). Reading turns
the records into ``Span`` objects, a Chrome trace (``traceEvents`` JSON that Perfetto and
``chrome://tracing`` open) or a PNG Gantt chart (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.contract.values import check_int
from rollout_lifecycle.core.config import MAX_TIMELINE_CALLS

#: The engine calls of a phase, flat: for each call its engine id, group, op, start and end
#: (``time.monotonic()`` seconds) and ``Outcome`` value, one after another. Flat, so that
#: recording a call makes no object for CPython's collector to count or walk.
EngineCalls = Sequence[str | float]
_FIELDS = 6

_OK = Outcome.OK.value

#: What a span is: a public call, a phase (a server-wide barrier) or one call to one engine.
SPAN_KINDS: tuple[str, ...] = ("call", "phase", "engine_call")


class _PhaseRecord:
    """One phase as recorded: its engine calls are a flat tuple, converted only when read."""

    __slots__ = ("call", "calls", "end", "name", "start", "state")

    def __init__(
        self, name: str, call: str, state: str, start: float, end: float, calls: EngineCalls
    ) -> None:
        self.name = name
        self.call = call
        self.state = state
        self.start = start
        self.end = end
        self.calls = tuple(calls)  # of strings and floats: untracked after the first pass


class CallRecord:
    """One public call (``offload``, ``onload_kv``, ...) and the phases it ran."""

    __slots__ = ("end", "index", "name", "outcome", "phases", "start")

    def __init__(self, name: str, index: int, start: float) -> None:
        self.name = name
        self.index = index
        self.start = start
        self.end: float | None = None
        self.outcome = "running"
        self.phases: list[_PhaseRecord] = []


@dataclass(frozen=True)
class Span:
    """One timed span of the timeline. Times are ``time.monotonic()`` seconds.

    ``kind`` is ``"call"`` (a public call: ``name`` is the call), ``"phase"`` (``name`` is the
    phase, as in the ``lifecycle/<call>/<phase>_s`` metrics and the ``phase.*`` events) or
    ``"engine_call"`` (``name`` is the op sent to ``engine``, within ``phase``).
    """

    kind: str
    name: str
    #: The public call the span belongs to, and its number on this server (1 = first call).
    call: str
    call_index: int
    start: float
    end: float
    #: ``ok``, ``error`` or ``cancelled`` for a call; ``ok`` or ``failed`` for a phase (failed:
    #: some engine call was not ok); the engine's ``Outcome`` value for an engine call.
    outcome: str
    phase: str | None = None
    #: The server's state when the phase began (a phase runs before its transition's state
    #: change, so this is the transition's source state).
    state: str | None = None
    engine: str | None = None
    group: str | None = None
    op: str | None = None

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return self.end - self.start


class Timeline:
    """The spans of a server's last public calls; ``RolloutServer.timeline``.

    Keeps the last ``max_calls`` calls (``0`` records nothing). A call made from a hook of
    another call (a nested call) is kept with the call that made it; ``probe()`` counts as a
    call of its own. Each engine call costs six slots of a tuple and two floats while it is
    recorded (about 100 bytes), and nothing that CPython's garbage collector walks.
    """

    def __init__(self, max_calls: int = 16, *, name: str = "rollout") -> None:
        check_int("max_calls", max_calls, maximum=MAX_TIMELINE_CALLS)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"name must be a non-empty string, got {name!r}")
        self._name = name
        self._max_calls = max_calls
        self._calls: deque[CallRecord] = deque(maxlen=max_calls)
        self._count = 0

    def __repr__(self) -> str:
        return f"Timeline({self._name!r}, calls={len(self._calls)}, max_calls={self._max_calls})"

    def __len__(self) -> int:
        """The number of calls kept."""
        return len(self._calls)

    @property
    def max_calls(self) -> int:
        """How many of the last calls are kept."""
        return self._max_calls

    # -- recording (the server's side; kept cheap) ------------------------------------------

    def begin_call(self, name: str, start: float) -> CallRecord | None:
        """Start recording a public call; None when the timeline keeps nothing."""
        self._count += 1
        if not self._max_calls:
            return None
        record = CallRecord(name, self._count, start)
        self._calls.append(record)
        return record

    @staticmethod
    def end_call(record: CallRecord | None, end: float, outcome: str) -> None:
        """Close a call begun with ``begin_call``."""
        if record is not None:
            record.end = end
            record.outcome = outcome

    @staticmethod
    def add_phase(
        record: CallRecord,
        name: str,
        call: str,
        state: str,
        start: float,
        end: float,
        calls: EngineCalls = (),
    ) -> None:
        """Record one settled phase of ``record`` and the engine calls it gathered."""
        record.phases.append(_PhaseRecord(name, call, state, start, end, calls))

    def clear(self) -> None:
        """Forget every span recorded so far (call numbers keep counting)."""
        self._calls.clear()

    # -- reading ------------------------------------------------------------------------------

    def spans(self, kind: str | None = None) -> list[Span]:
        """Every span kept, in recording order (a call, then its phases, each followed by its
        engine calls); only those of ``kind`` when given. A call still running ends now."""
        if kind is not None and kind not in SPAN_KINDS:
            raise InvalidArgument(f"unknown span kind {kind!r}; valid: {', '.join(SPAN_KINDS)}")
        return [s for s in self._iter_spans() if kind is None or s.kind == kind]

    def _iter_spans(self) -> Iterator[Span]:
        for call in list(self._calls):
            phases = list(call.phases)
            end = call.end
            if end is None:
                end = max([call.start, *(p.end for p in phases)])
            yield Span("call", call.name, call.name, call.index, call.start, end, call.outcome)
            for phase in phases:
                flat = phase.calls
                calls = [flat[i : i + _FIELDS] for i in range(0, len(flat), _FIELDS)]
                failed = any(c[5] != _OK for c in calls)
                yield Span(
                    "phase",
                    phase.name,
                    phase.call,
                    call.index,
                    phase.start,
                    phase.end,
                    "failed" if failed else "ok",
                    phase=phase.name,
                    state=phase.state,
                )
                for engine, group, op, start, stop, outcome in calls:
                    yield Span(
                        "engine_call",
                        str(op),
                        phase.call,
                        call.index,
                        float(start),
                        float(stop),
                        str(outcome),
                        phase=phase.name,
                        state=phase.state,
                        engine=str(engine),
                        group=str(group),
                        op=str(op),
                    )

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline in Chrome's trace event format (complete ``"ph": "X"`` events).

        Process 1 is the server, with a track of calls and a track of phases; each engine
        group is a process of its own with one track per engine. Timestamps are microseconds
        since the first span kept.
        """
        spans = self.spans()
        origin = min((s.start for s in spans), default=0.0)
        events: list[dict[str, Any]] = [
            _meta("process_name", 1, 0, f"server {self._name}"),
            _meta("process_sort_index", 1, 0, 0, key="sort_index"),
            _meta("thread_name", 1, 1, "calls"),
            _meta("thread_name", 1, 2, "phases"),
        ]
        processes: dict[str, int] = {}
        tracks: dict[str, tuple[int, int]] = {}
        for engine, group in _engines(spans):
            if group not in processes:
                pid = processes[group] = len(processes) + 2
                events.append(_meta("process_name", pid, 0, f"group {group}"))
                events.append(_meta("process_sort_index", pid, 0, pid, key="sort_index"))
            pid = processes[group]
            tid = sum(1 for p, _ in tracks.values() if p == pid) + 1
            tracks[engine] = (pid, tid)
            events.append(_meta("thread_name", pid, tid, engine))
            events.append(_meta("thread_sort_index", pid, tid, tid, key="sort_index"))
        for span in spans:
            args: dict[str, Any] = {"call": span.call, "call_index": span.call_index}
            if span.kind == "call":
                pid, tid = 1, 1
            elif span.kind == "phase":
                pid, tid = 1, 2
                args["state"] = span.state
            else:
                assert span.engine is not None
                pid, tid = tracks[span.engine]
                args.update(phase=span.phase, engine=span.engine, group=span.group)
            args["outcome"] = span.outcome
            events.append(
                {
                    "name": span.name,
                    "cat": span.kind,
                    "ph": "X",
                    "ts": round((span.start - origin) * 1e6, 3),
                    "dur": round(max(0.0, span.duration) * 1e6, 3),
                    "pid": pid,
                    "tid": tid,
                    "args": args,
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"server": self._name, "clock": "time.monotonic", "origin_s": origin},
        }

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write ``chrome_trace()`` as JSON to ``path`` (open it in https://ui.perfetto.dev)."""
        target = _path("path", path)
        target.write_text(json.dumps(self.chrome_trace()), encoding="utf-8")
        return target

    def plot_gantt(
        self,
        path: str | os.PathLike[str],
        *,
        max_engines: int = 64,
        title: str | None = None,
    ) -> Path:
        """Draw the timeline as a PNG Gantt chart: a row of calls, a row of phases, then one row
        per engine (the first ``max_engines`` by id) whose bars are its calls coloured by phase
        (so that the weights' and the KV cache's resume differ), a dashed line at
        every phase barrier (the end of a phase); what did not succeed is hatched red. Needs
        matplotlib (the ``plot`` extra)."""
        target = _path("path", path)
        check_int("max_engines", max_engines, minimum=1)
        if title is not None and not isinstance(title, str):
            raise InvalidArgument(f"title must be a string or None, got {title!r}")
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as exc:
            raise ImportError(
                "plot_gantt needs matplotlib: pip install 'rollout-lifecycle[plot]'"
            ) from exc
        spans = self.spans()
        origin = min((s.start for s in spans), default=0.0)
        # Name a call or phase on its bar only where the name has room.
        label_min = 0.03 * (max((s.end for s in spans), default=origin) - origin)
        engines = [e for e, _ in _engines(spans)]
        shown = engines[:max_engines]
        rows = ["calls", "phases", *shown]
        row_of = {name: i for i, name in enumerate(rows)}
        palette = _palette()
        colors: dict[str, Any] = {}

        def color(name: str) -> Any:
            if name not in colors:
                colors[name] = palette[len(colors) % len(palette)]
            return colors[name]

        figure = Figure(figsize=(12, 1.5 + 0.3 * len(rows)), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        # (row, failed) -> bar ranges and colours; a call that did not succeed is hatched red.
        bars: dict[tuple[int, bool], tuple[list[tuple[float, float]], list[Any]]] = {}
        for span in spans:
            if span.kind == "call":
                row = 0
            elif span.kind == "phase":
                row = 1
            else:
                row = row_of.get(span.engine or "", -1)
            if row < 0:
                continue
            x = (span.start - origin, max(span.duration, 1e-6))
            face = "#d9d9d9" if span.kind != "engine_call" else color(span.phase or span.name)
            failed = span.outcome not in ("ok", "running")
            ranges, faces = bars.setdefault((row, failed), ([], []))
            ranges.append(x)
            faces.append(face)
            if span.kind != "engine_call" and span.duration > label_min:
                axes.text(
                    x[0] + x[1] / 2,
                    row,
                    span.name,
                    ha="center",
                    va="center",
                    fontsize=6,
                    clip_on=True,
                )
        for (row, failed), (ranges, faces) in bars.items():
            axes.broken_barh(
                ranges,
                (row - 0.4, 0.8),
                facecolors=faces,
                edgecolor="red" if failed else "black",
                linewidth=0.8 if failed else 0.2,
                hatch="////" if failed else None,
            )
        for span in spans:
            if span.kind == "phase":
                axes.axvline(span.end - origin, color="grey", linestyle="--", linewidth=0.5)
        axes.set_yticks(range(len(rows)), labels=rows, fontsize=7)
        axes.set_ylim(len(rows) - 0.5, -0.5)
        axes.set_xlabel("seconds")
        hidden = len(engines) - len(shown)
        heading = title or f"rollout lifecycle: server {self._name}"
        if hidden:
            heading += f" ({hidden} more engines not shown)"
        axes.set_title(heading, fontsize=9)
        if colors:
            axes.legend(
                handles=[
                    Patch(facecolor=c, edgecolor="black", label=op) for op, c in colors.items()
                ],
                loc="upper left",
                bbox_to_anchor=(1.0, 1.0),
                fontsize=7,
            )
        figure.tight_layout()
        figure.savefig(target, format="png")
        return target


def _path(what: str, value: object) -> Path:
    """A file path given as a string or ``os.PathLike``; else ``InvalidArgument``."""
    if isinstance(value, str | os.PathLike):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            return Path(path)
    raise InvalidArgument(f"{what} must be a non-empty file path, got {value!r}")


def _meta(name: str, pid: int, tid: int, value: object, *, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _engines(spans: Sequence[Span]) -> list[tuple[str, str]]:
    """(engine id, group) of every engine in ``spans``, by group then engine index."""
    found = {(s.engine, s.group or "") for s in spans if s.engine is not None}

    def order(item: tuple[str, str]) -> tuple[str, int, str]:
        engine, group = item
        _, _, index = engine.rpartition("/")
        return (group, int(index) if index.isdigit() else -1, engine)

    return sorted(found, key=order)


def _palette() -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i) for i in range(cmap.N)]


__all__ = ["SPAN_KINDS", "EngineCalls", "Span", "Timeline"]
