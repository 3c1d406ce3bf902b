"""Invariant checks on a ``RolloutServer``'s timeline, for engines that keep no history of their
own (real SGLang servers).

The library's test kit (``rollout_lifecycle.testing``) checks the barriers on engine histories,
which only simulated engines and the stand-in record. A real server records nothing, but the
server's timeline has every engine call it made with the time it was issued and the time it
landed, which bracket what the engine did: a barrier that holds on these spans held on the
engines. ``histories`` turns the timeline into the kit's history format, so the kit's own
``cycle_order_violations`` runs on it; ``ledger_violations`` replays each engine's calls
against the SGLang contract's fatal misuses. ``routes_around_a_rollout`` reads, from the HTTP
client's own events, which routes each real server got while it served and from the pause on;
``assert_reads_then_the_pause`` checks them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from structlog.testing import capture_logs

from rollout_lifecycle import KV_TAGS, WEIGHT_TAGS, RolloutServer, Span

#: The tags a resume carried, by the phase that sent it (engine-call spans carry no tags).
_RESUMED = {
    "resume_weights": [t.value for t in WEIGHT_TAGS],
    "resume_kv": [t.value for t in KV_TAGS],
    "recover_resume": None,  # tags vary; not used by these tests
}

History = list[dict[str, Any]]


def engine_calls(server: RolloutServer, call: str | None = None) -> list[Span]:
    """The engine-call spans of the server's timeline (of the calls named ``call`` if given)."""
    return [s for s in server.timeline.spans("engine_call") if call is None or s.call == call]


def histories(server: RolloutServer, release_tags: Sequence[str]) -> dict[str, History]:
    """Each engine's calls, in the order they were issued, as ``testing`` history entries
    (``op``, ``start``, ``end``, ``tags``, ``outcome``, ``phase``, ``call``).

    A release carries ``release_tags``, a resume the tags of its phase. An outcome other than
    ``ok`` that says the engine died is ``fatal`` (what the kit reports as a violation).
    """
    out: dict[str, History] = {}
    for span in sorted(engine_calls(server), key=lambda s: s.start):
        assert span.engine is not None
        tags: list[str] | None = None
        if span.name == "release_memory_occupation":
            tags = list(release_tags)
        elif span.name == "resume_memory_occupation":
            tags = _RESUMED.get(span.phase or "")
        out.setdefault(span.engine, []).append(
            {
                "op": span.name,
                "start": span.start,
                "end": span.end,
                "tags": tags,
                "outcome": "fatal" if span.outcome == "dead" else span.outcome,
                "phase": span.phase,
                "call": span.call,
            }
        )
    return out


def ledger_violations(engine_histories: Mapping[str, History]) -> list[str]:
    """Calls that the SGLang contract calls fatal or unsafe, replayed engine by engine.

    A release needs a pause and a flush since the last continue and never names a tag that is
    released; a resume names only released tags; a continue runs on fully resident memory; a
    weight-update session opens only with the weights resident and while paused.
    """
    problems: list[str] = []
    for engine, history in engine_histories.items():
        paused = flushed = False
        released: set[str] = set()
        for entry in history:
            op, tags = entry["op"], set(entry.get("tags") or ())
            if entry["outcome"] != "ok":
                problems.append(f"{engine}: {op} in {entry['phase']} ended {entry['outcome']}")
                continue
            if op == "pause_generation":
                paused, flushed = True, False
            elif op == "flush_cache":
                flushed = paused and True
            elif op == "release_memory_occupation":
                if not (paused and flushed):
                    problems.append(f"{engine}: release without a pause and a flush before it")
                if tags & released:
                    problems.append(f"{engine}: released {sorted(tags & released)} twice")
                released |= tags
            elif op == "resume_memory_occupation":
                if tags - released:
                    problems.append(f"{engine}: resumed {sorted(tags - released)}, not released")
                released -= tags
            elif op == "continue_generation":
                if released:
                    problems.append(f"{engine}: continued with {sorted(released)} released")
                paused = flushed = False
            elif op == "begin_weight_update" and ("weights" in released or not paused):
                problems.append(f"{engine}: weight update began unpaused or on released weights")
    return problems


def phase_names(server: RolloutServer, call: str) -> list[str]:
    """The phases of the last call named ``call``, in the order they ran."""
    spans = [s for s in server.timeline.spans() if s.call == call]
    last = max(s.call_index for s in spans)
    return [s.name for s in spans if s.kind == "phase" and s.call_index == last]


def phase_overlaps(server: RolloutServer) -> list[str]:
    """Phases of one call that overlap in time (each phase is a barrier: none may)."""
    problems: list[str] = []
    phases = server.timeline.spans("phase")
    for earlier, later in itertools.pairwise(phases):
        if later.call_index == earlier.call_index and later.start < earlier.end:
            problems.append(
                f"{later.call}: {later.name} started {earlier.end - later.start:.6f}s before "
                f"{earlier.name} ended"
            )
    return problems


async def routes_around_a_rollout(
    server: RolloutServer, engines: Sequence[Any], seconds: float
) -> dict[str, tuple[list[str], list[str]]]:
    """Pause and resume ``server`` (each engine's incarnation read at first contact), let it
    serve for ``seconds`` (a rollout), then pause it; by engine label, the routes each engine
    got while it served and those from the pause on (the HTTP client's ``http.request``
    events, in order). The server is left drained."""
    await server.pause()
    await server.resume()
    with capture_logs() as events:
        await asyncio.sleep(seconds)
        end = len(events)
        await server.pause()

    def paths(part: Sequence[Mapping[str, Any]], label: str) -> list[str]:
        return [e["path"] for e in part if e["event"] == "http.request" and e["engine"] == label]

    return {e.label: (paths(events[:end], e.label), paths(events[end:], e.label)) for e in engines}


def assert_reads_then_the_pause(
    routes: Mapping[str, tuple[list[str], list[str]]],
    reads: set[str],
    at_least: int,
    pause: str,
) -> None:
    """Of ``routes_around_a_rollout``'s routes: each engine got the incarnation's ``reads``
    while it served, nothing else and at least ``at_least`` requests (the renewal's rounds),
    and the offload's ``pause`` first, without a read before it."""
    for during, after in routes.values():
        assert set(during) == reads and len(during) >= at_least, during
        assert after[:1] == [pause], after
