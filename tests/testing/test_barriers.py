"""The barrier check of the test kit (``rollout_lifecycle.testing.barriers``) on hand-made
histories: what each rule catches, what scoping changes, and what it leaves alone."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from rollout_lifecycle.testing import (
    BARRIER_PAIRS,
    CYCLE_PHASES,
    barrier_violations,
    cycle_order_violations,
    fatal_calls,
)

OPS = {name: (op, tag) for name, op, tag in CYCLE_PHASES}


def call(phase: str, start: float, end: float | None, **extra: Any) -> dict[str, Any]:
    op, tag = OPS[phase]
    return {"op": op, "tags": [tag] if tag else None, "start": start, "end": end, **extra}


def cycle(at: float, *, phases: tuple[str, ...] = tuple(OPS)) -> list[dict[str, Any]]:
    """One engine's calls of one cycle from time ``at``, a second per phase."""
    return [call(p, at + i, at + i + 0.5) for i, p in enumerate(phases)]


def clean_histories(engines: int = 2, cycles: int = 2) -> dict[str, list[dict[str, Any]]]:
    return {f"e{k}": [c for n in range(cycles) for c in cycle(10.0 * n)] for k in range(engines)}


def test_a_clean_fleet_breaks_nothing_under_every_scoping() -> None:
    histories = clean_histories(engines=3, cycles=3)
    assert barrier_violations(histories) == []
    assert barrier_violations(histories, scopes=None) == []
    assert barrier_violations(histories, scopes=[0.0, 10.0, 20.0]) == []
    assert cycle_order_violations(histories) == []


def test_the_pairs_are_the_cycle_in_order() -> None:
    names = [name for name, _, _ in CYCLE_PHASES]
    assert list(BARRIER_PAIRS) == list(itertools.pairwise(names))


@pytest.mark.parametrize(("before", "after"), BARRIER_PAIRS)
def test_a_call_in_flight_holds_the_next_phase(before: str, after: str) -> None:
    histories = clean_histories()
    late = next(c for c in histories["e1"] if c["start"] == 10.0 + list(OPS).index(before))
    late["end"] = None  # e1's call of cycle 2 never returned
    for scopes in ("rounds", None, [0.0, 10.0]):
        found = barrier_violations(histories, scopes=scopes)
        assert len(found) == 1, (scopes, found)
        assert f"{after} started on e0" in found[0] and "still in flight" in found[0]
        assert f"{before} on e1" in found[0]


def test_a_phase_sent_before_the_previous_reached_every_engine_is_caught_in_a_scope() -> None:
    histories = clean_histories(cycles=1)
    # e1's pause is issued only after e0 has already started flushing: nothing was in flight
    # when the flush began, so only an ordering scope (rounds or windows) can see it.
    histories["e1"][0].update(start=1.2, end=1.4)
    assert barrier_violations(histories, scopes=None) == []
    for scopes, word in (("rounds", "round"), ([0.0], "window")):
        (found,) = barrier_violations(histories, scopes=scopes)
        assert found.startswith(f"{word} 0: flush started on e0 at 1.000000 while pause on e1")


def test_a_straggler_across_windows_is_caught_until_its_engine_is_gone() -> None:
    # Window 0 offloads (pause, flush, release), window 1 from 10.0 onloads; e1's release is
    # still running when e0's weights come back in the next window.
    offload, onload = ("pause", "flush", "release"), ("resume_weights", "resume_kv", "continue")
    histories = {e: cycle(0.0, phases=offload) + cycle(10.0, phases=onload) for e in ("e0", "e1")}
    histories["e1"][2]["end"] = 10.5
    histories["e1"] = histories["e1"][:3]  # e1 then left the fleet
    (found,) = barrier_violations(histories, scopes=[0.0, 10.0])
    assert found.startswith("resume_weights started on e0 at 10.000000 while release on e1")
    assert barrier_violations(histories, scopes=None) == [found]
    assert barrier_violations(histories, scopes=[0.0, 10.0], gone={"e1": 9.0}) == []
    assert barrier_violations(histories, scopes=[0.0, 10.0], gone={"e1": None}) == [found]
    # Gone only after the resume began: the barrier was broken before that.
    assert barrier_violations(histories, scopes=None, gone={"e1": 10.2}) == [found]


def test_phases_limits_the_check_to_the_named_ones() -> None:
    histories = clean_histories(cycles=1)
    histories["e1"][0]["end"] = 1.5  # a broken pause -> flush barrier
    histories["e1"][4]["end"] = 5.5  # a broken resume_kv -> continue barrier
    assert len(barrier_violations(histories)) == 2
    (found,) = barrier_violations(histories, phases=("resume_kv", "continue"))
    assert "continue started on e0" in found and "resume_kv on e1" in found


def test_a_phase_missing_from_a_round_orders_its_neighbours() -> None:
    # A pause/resume round: no memory phases, so continue must wait for every pause.
    histories = {
        "e0": cycle(0.0, phases=("pause", "continue")),
        "e1": [call("pause", 0.0, 1.5), call("continue", 1.6, 2.0)],
    }
    (found,) = barrier_violations(histories)
    assert "round 0: continue started on e0 at 1.000000 while pause on e1" in found
    assert barrier_violations(histories, scopes=None) == []  # not a barrier pair: no rule 2


def test_calls_before_the_first_pause_belong_to_no_round() -> None:
    # A replacement's bring-up (resumes, then continue) before it ever paused: out of any
    # round, it is still held by the rule on calls in flight.
    histories = clean_histories(cycles=1)
    histories["new"] = [call("resume_kv", 4.2, 5.8)]
    assert barrier_violations(histories, scopes=None) == barrier_violations(histories)
    (found,) = barrier_violations(histories)
    assert "continue started on e0 at 5.000000 while resume_kv on new" in found


def test_calls_that_are_no_phase_are_ignored() -> None:
    histories = clean_histories(cycles=1)
    for entries in histories.values():
        entries.insert(1, {"op": "server_info", "tags": None, "start": 0.2, "end": 9.0})
        entries.insert(1, {"op": "update_weights_from_tensor", "start": 3.6, "end": None})
    assert barrier_violations(histories) == []


def test_fatal_calls_come_first_in_cycle_order_violations() -> None:
    histories = clean_histories(cycles=1)
    histories["e0"][2].update(outcome="fatal", detail="busy")
    histories["e1"][0]["end"] = 1.5
    found = cycle_order_violations(histories)
    assert found[0] == "e0: fatal release_memory_occupation (busy)"
    assert found[1:] == barrier_violations(histories) and len(found) == 2
    assert fatal_calls(histories) == found[:1]
