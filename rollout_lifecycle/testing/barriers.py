"""The barrier check: whether a fleet's engine calls kept the lifecycle's phase order.

One check serves every caller (the library's tests, the demo's end-of-run report, the
benchmarks, users' tests): it reads the per-engine call histories that the simulated engine,
the stand-in server, the fault injector and the real-server tier all keep (entries with ``op``,
``tags``, ``start`` and ``end``; ``end`` is ``None`` for a call still in flight) and applies two
rules, for design invariants 1, 2 and 4:

* **In order within a scope.** Calls are grouped into scopes: *rounds* (round k of an engine is
  what follows its k-th pause, so round k of every engine is one cycle), *windows* (time
  intervals the caller knows hold one cycle, or part of one), or none. In each scope, every
  phase of ``CYCLE_PHASES`` present must have ended on every engine before the next phase
  present starts on any engine. This catches a phase issued to some engines before the previous
  phase was issued to all of them, not only one still running.
* **Never past a call in flight.** Sorted by start, the calls fall into runs of one phase (a
  phase's calls are all issued before any is waited for). When a run of a phase follows a run
  of the phase just before it (``BARRIER_PAIRS``), no call of the first may still be in flight
  on an engine that is still part of the fleet when the second begins: a straggler left over
  from a failed phase holds the barrier until it returns or its engine is gone (``gone``:
  killed, or retired by recovery). With windows, a run never spans two of them: a straggler
  from an earlier public call holds the next call's first phase after it, but not a later
  phase sent to other engines (the library orders calls to the straggler's own engine, which
  the per-engine checks see).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_lifecycle.contract.exceptions import InvalidArgument

History = Sequence[Mapping[str, Any]]

#: The phases of one colocated cycle, in the order the barriers impose, as (name, op, tag).
CYCLE_PHASES: tuple[tuple[str, str, str | None], ...] = (
    ("pause", "pause_generation", None),
    ("flush", "flush_cache", None),
    ("release", "release_memory_occupation", None),
    ("resume_weights", "resume_memory_occupation", "weights"),
    ("resume_kv", "resume_memory_occupation", "kv_cache"),
    ("continue", "continue_generation", None),
)
PHASE_NAMES: tuple[str, ...] = tuple(name for name, _, _ in CYCLE_PHASES)
#: Each phase with the one before it: the second never starts while the first is in flight.
BARRIER_PAIRS: tuple[tuple[str, str], ...] = tuple(itertools.pairwise(PHASE_NAMES))
_RANK = {name: rank for rank, name in enumerate(PHASE_NAMES)}
_PAIRS = frozenset(BARRIER_PAIRS)


def check_entry(entry: object) -> None:
    if not isinstance(entry, Mapping):
        raise InvalidArgument(f"a history entry must be a mapping, got {entry!r}")


def check_history(what: str, history: object) -> None:
    if isinstance(history, str | bytes | Mapping) or not isinstance(history, Sequence):
        raise InvalidArgument(f"{what} must be a sequence of history entries, got {history!r}")
    for entry in history:
        check_entry(entry)


def check_histories(histories: object) -> None:
    if not isinstance(histories, Mapping):
        raise InvalidArgument(f"histories must map engine ids to histories, got {histories!r}")
    for engine, history in histories.items():
        check_history(f"histories[{engine!r}]", history)


def cycle_phase_of(entry: Mapping[str, Any]) -> str | None:
    """The cycle phase (``CYCLE_PHASES``) a history entry belongs to, if any."""
    check_entry(entry)
    for name, op, tag in CYCLE_PHASES:
        if entry.get("op") != op:
            continue
        if tag is None or tag in (entry.get("tags") or ()):
            return name
    return None


def cycle_rounds(history: History) -> list[list[Mapping[str, Any]]]:
    """Split one engine's history at each pause: round k is what follows its k-th pause."""
    check_history("history", history)
    rounds: list[list[Mapping[str, Any]]] = []
    for entry in history:
        if entry.get("op") == "pause_generation":
            rounds.append([])
        if rounds:
            rounds[-1].append(entry)
    return rounds


@dataclass(frozen=True, slots=True)
class _Call:
    engine: str
    phase: str
    start: float
    end: float  # inf while in flight
    scope: int | None
    entry: Mapping[str, Any]

    def shown(self) -> str:
        ended = "still in flight" if math.isinf(self.end) else f"returned at {self.end:.6f}"
        extra = "".join(
            f", {key}={self.entry[key]}" for key in ("outcome", "injected") if key in self.entry
        )
        return f"{self.phase} on {self.engine} (started {self.start:.6f}{extra}) {ended}"


def _calls(
    histories: Mapping[str, History], scopes: str | Sequence[float] | None, phases: Collection[str]
) -> list[_Call]:
    calls: list[_Call] = []
    for engine, history in histories.items():
        pauses = -1  # rounds: the engine's pause count so far
        for entry in history:
            phase = cycle_phase_of(entry)
            if entry.get("op") == "pause_generation":
                pauses += 1
            if phase is None or phase not in phases:
                continue
            start, end = float(entry["start"]), entry.get("end")
            if scopes == "rounds":
                scope = pauses if pauses >= 0 else None
            elif scopes is None:
                scope = None
            else:
                assert not isinstance(scopes, str)
                scope = bisect.bisect_right(scopes, start) - 1  # -1: before the first
            stop = math.inf if end is None else float(end)
            calls.append(_Call(str(engine), phase, start, stop, scope, entry))
    return calls


def _check_options(scopes: object, gone: object, phases: object) -> None:
    if not (scopes is None or scopes == "rounds"):
        if isinstance(scopes, str | bytes) or not isinstance(scopes, Sequence):
            raise InvalidArgument(
                f"scopes must be 'rounds', None or a sequence of window start times, got {scopes!r}"
            )
        if not all(isinstance(t, int | float) and math.isfinite(t) for t in scopes) or list(
            scopes
        ) != sorted(scopes):
            raise InvalidArgument(f"window start times must be finite and sorted, got {scopes!r}")
    if gone is not None and not (
        isinstance(gone, Mapping)
        and all(t is None or (isinstance(t, int | float) and t == t) for t in gone.values())
    ):
        raise InvalidArgument(f"gone must map engine ids to times (or None), got {gone!r}")
    if isinstance(phases, str) or not isinstance(phases, Collection) or not phases:
        raise InvalidArgument(f"phases must be a non-empty collection of names, got {phases!r}")
    unknown = sorted(str(p) for p in phases if p not in _RANK)
    if unknown:
        raise InvalidArgument(f"unknown phases {unknown}; known: {list(PHASE_NAMES)}")


def barrier_violations(
    histories: Mapping[str, History],
    *,
    scopes: str | Sequence[float] | None = "rounds",
    ordered: bool = True,
    gone: Mapping[str, float | None] | None = None,
    phases: Collection[str] = PHASE_NAMES,
) -> list[str]:
    """Every barrier the calls in ``histories`` (engine id -> its call history) broke.

    ``scopes``: ``"rounds"`` (the default); a sorted sequence of window start times (window k
    starts at ``scopes[k]`` and holds the calls that start before the next window; calls before
    the first window form a scope of their own); or ``None``. ``ordered``: apply the in-order
    rule in each scope; without it (or without scopes) only the rule on calls in flight applies,
    for windows that may hold interleaved cycles (two public calls at once, a recovery that
    brings some engines up and heals others). ``gone``: when an engine stopped being part of the
    fleet; its calls still in flight after that hold no barrier. ``phases``: the phases to check
    (the others are ignored), e.g. ``("resume_kv", "continue")`` from the moment a replacement
    joined.
    """
    check_histories(histories)
    _check_options(scopes, gone, phases)
    if not isinstance(ordered, bool):
        raise InvalidArgument(f"ordered must be a bool, got {ordered!r}")
    calls = _calls(histories, scopes, phases)
    left = {str(k): math.inf if v is None else float(v) for k, v in (gone or {}).items()}

    def holds(call: _Call, at: float) -> bool:
        """``call`` still held its barrier at time ``at``."""
        return call.end > at and left.get(call.engine, math.inf) > at

    problems: list[str] = []
    ordered = ordered and scopes is not None
    if ordered:
        problems += _out_of_order(calls, "round" if scopes == "rounds" else "window", holds)
    # In flight: the calls sorted by start fall into runs of one phase (a run never spans two
    # windows: a straggler from an earlier window holds only the run right after its own). For
    # adjacent runs of a barrier pair, every call of the first must have returned when the
    # second began. (Within a scope that the in-order rule covers, it has reported it already.)
    windowed = scopes is not None and scopes != "rounds"
    runs: list[list[_Call]] = []
    for call in sorted(calls, key=lambda c: c.start):
        last = runs[-1][0] if runs else None
        if (
            last is not None
            and last.phase == call.phase
            and not (windowed and last.scope != call.scope)
        ):
            runs[-1].append(call)
        else:
            runs.append([call])
    for before, after in itertools.pairwise(runs):
        if (before[0].phase, after[0].phase) not in _PAIRS:
            continue
        first = after[0]
        for call in before:
            if not holds(call, first.start):
                continue
            if ordered and call.scope is not None and call.scope == first.scope:
                continue
            problems.append(
                f"{first.phase} started on {first.engine} at {first.start:.6f} while {call.shown()}"
            )
    return problems


def _out_of_order(
    calls: Sequence[_Call], word: str, holds: Callable[[_Call, float], bool]
) -> list[str]:
    """In each scope, each phase present ends everywhere before the next one present starts."""
    by_scope: dict[int, dict[str, list[_Call]]] = {}
    for call in calls:
        if call.scope is not None:
            by_scope.setdefault(call.scope, {}).setdefault(call.phase, []).append(call)
    problems: list[str] = []
    for scope, spans in sorted(by_scope.items()):
        where = f"{word} {scope}" if scope >= 0 else "before the first window"
        present = sorted(spans, key=_RANK.__getitem__)
        for earlier, later in itertools.pairwise(present):
            first = min(spans[later], key=lambda c: c.start)
            late = [c for c in spans[earlier] if holds(c, first.start)]
            if late:
                last = max(late, key=lambda c: c.end)
                problems.append(
                    f"{where}: {later} started on {first.engine} at {first.start:.6f} "
                    f"while {last.shown()}"
                )
    return problems


def fatal_calls(histories: Mapping[str, History]) -> list[str]:
    """Every call an engine logged as fatal to it (a misuse that killed it)."""
    check_histories(histories)
    return [
        f"{engine}: fatal {entry.get('op')} ({entry.get('detail')})"
        for engine, history in histories.items()
        for entry in history
        if entry.get("outcome") == "fatal"
    ]


def cycle_order_violations(histories: Mapping[str, History]) -> list[str]:
    """Barrier violations across engines, round by round, and every fatal call (invariants 1, 2
    and 4): ``fatal_calls`` then ``barrier_violations`` with its defaults."""
    return fatal_calls(histories) + barrier_violations(histories)


#: The read a check or an observation begins with (``server_info`` over HTTP, ``observe``
#: where the engine answers it in one call).
_FIRST_READS = ("server_info", "observe")


def calls_received(history: History) -> list[dict[str, Any]]:
    """A history's calls as the library made them, in order of start.

    An engine host reads the engine before each call it checks (``EngineHost.checked``) and
    for each observation (``EngineHost.observe``); a backend that keeps a history marks those
    reads with ``check_of`` (the checked operation, or ``"observe"``). Here the reads of a
    check are folded into the call they checked, which then starts when its first read did
    (and has ``checks``, the reads' operations); the reads of an observation become one
    ``observe`` call; a check whose call was not sent (the engine had restarted, say) becomes
    that call with ``outcome`` ``"not_sent"``. Entries of other histories pass as they are.
    What a test compares with the library's own record of its calls (one timeline span each).
    """
    check_history("history", history)
    out: list[dict[str, Any]] = []
    pending: dict[str, list[Mapping[str, Any]]] = {}

    def call(op: str, reads: list[Mapping[str, Any]], entry: Mapping[str, Any] | None) -> None:
        if entry is None:
            ends = [r["end"] for r in reads]
            end = None if None in ends else max(ends)
            entry = {"op": op, "tags": None, "end": end, "outcome": "not_sent"}
            if op == "observe":
                entry["outcome"] = "ok" if all(r.get("outcome") == "ok" for r in reads) else "error"
        merged = dict(entry)
        merged["start"] = min([r["start"] for r in reads] + [entry.get("start", math.inf)])
        merged["checks"] = [r["op"] for r in reads]
        out.append(merged)

    for entry in history:
        of = entry.get("check_of")
        if of is None:
            reads = pending.pop(str(entry.get("op")), None)
            if reads is None:
                out.append(dict(entry))
            else:
                call(str(entry["op"]), reads, entry)
            continue
        reads = pending.setdefault(str(of), [])
        if entry.get("op") in _FIRST_READS and reads:  # a new read of the same kind begins
            call(str(of), pending.pop(str(of)), None)
            reads = pending.setdefault(str(of), [])
        reads.append(entry)
    for op, reads in pending.items():
        call(op, reads, None)
    return sorted(out, key=lambda e: e["start"])
