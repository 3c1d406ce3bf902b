"""Snapshots (``core/snapshots.py``) on a bare fleet of records: a ``ServerSnapshot`` keeps every
field of every record through JSON, tells a snapshot taken mid-call, and ``adopt`` loads one
into another fleet's records only when the groups match and the records imply its state,
changing nothing when it refuses.

Adopting through the server, with every guard then applying to the engines, is
``tests/cli/test_ctl.py``'s (``ctl`` keeps its state as a snapshot); adopting a journal entry
written mid-release is ``test_hardening.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from rollout_lifecycle import ALL_TAGS, InvalidArgument, PauseMode, ServerState, Tag
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.core.ledger import EngineRecord, Fleet, Target
from rollout_lifecycle.core.snapshots import ServerSnapshot, adopt

S = ServerState


@dataclass
class Group:
    name: str
    needs_offload: bool
    records: tuple[EngineRecord, ...] = field(default=())


def fresh_ledger(
    shape: tuple[tuple[str, bool, int], ...] = (("actor", True, 2), ("ref", False, 1)),
) -> Fleet:
    """Records as a fresh server has them: every engine serving."""
    groups = [
        Group(name, offloads, tuple(EngineRecord(f"{name}/{i}", name, None) for i in range(n)))
        for name, offloads, n in shape
    ]
    return Fleet(groups, ALL_TAGS)


def settle(ledger: Fleet, state: ServerState) -> Fleet:
    """Make every record what a server settled in ``state`` records."""
    for record in ledger.records():
        goal = ledger.target(record, state)
        assert isinstance(goal, Target)
        record.paused = record.flushed = goal.paused
        record.pause_mode = PauseMode.RETRACT if goal.paused else None
        record.released = set(goal.released)
    return ledger


def knowledge(ledger: Fleet) -> list[Any]:
    """Everything the records say, to compare before and after."""
    return [r.snapshot() for r in ledger.records()]


def test_a_snapshot_keeps_every_field_of_every_record_through_json() -> None:
    ledger = settle(fresh_ledger(), S.RELEASED)
    actor0, actor1, ref0 = ledger.records()
    actor0.uncertain = {Tag.CUDA_GRAPH}
    actor0.released = {Tag.WEIGHTS, Tag.KV_CACHE}  # (any order: the snapshot keeps Tag's)
    actor0.incarnation = "startup-1"
    actor0.last_op, actor0.last_outcome = (
        "release_memory_occupation",
        EngineOutcome(Outcome.TIMED_OUT, "no answer in 5s"),
    )
    actor1.alive, actor1.stale, actor1.session_unknown = False, True, True
    ref0.pause_unknown = True
    snapshot = ServerSnapshot.of("trainer", S.FAILED, ledger)
    data = json.loads(json.dumps(snapshot.to_dict()))
    assert data["state"] == "failed"
    assert [(g["name"], g["needs_offload"]) for g in data["groups"]] == [
        ("actor", True),
        ("ref", False),
    ]
    again = ServerSnapshot.from_dict(data)
    assert again == snapshot
    assert list(again.engines()) == ["actor/0", "actor/1", "ref/0"]
    first = again.engines()["actor/0"]
    assert first.released == ("weights", "kv_cache")
    assert (first.uncertain, first.pause_mode, first.incarnation) == (
        ("cuda_graph",),
        "retract",
        "startup-1",
    )
    assert first.last_outcome == "timed_out (no answer in 5s)"
    assert again.engines()["actor/1"].session_unknown and again.engines()["ref/0"].pause_unknown


@pytest.mark.parametrize("flag", ["uncertain", "pause_unknown", "session_unknown"])
def test_a_snapshot_is_mid_call_when_a_live_engine_has_a_call_unanswered(flag: str) -> None:
    ledger = fresh_ledger()
    assert not ServerSnapshot.of("s", S.SERVING, ledger).in_flight()
    record = ledger.records()[1]
    setattr(record, flag, {Tag.KV_CACHE} if flag == "uncertain" else True)
    assert ServerSnapshot.of("s", S.SERVING, ledger).in_flight()
    record.alive = False  # a dead engine's unanswered call is over
    assert not ServerSnapshot.of("s", S.SERVING, ledger).in_flight()


@pytest.mark.parametrize("state", [S.SERVING, S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED])
def test_adopt_loads_the_records_and_enters_the_snapshots_state(state: ServerState) -> None:
    source = settle(fresh_ledger(), state)
    source.records()[0].incarnation = "startup-7"
    snapshot = ServerSnapshot.of("old", state, source)
    target = fresh_ledger()
    assert adopt(target, snapshot) is state
    assert knowledge(target) == knowledge(source)


def test_drained_records_may_be_adopted_as_kv_restored() -> None:
    """Both states hold every engine paused with all its memory resident."""
    snapshot = ServerSnapshot.of("old", S.KV_RESTORED, settle(fresh_ledger(), S.KV_RESTORED))
    assert adopt(fresh_ledger(), snapshot) is S.KV_RESTORED
    assert adopt(fresh_ledger(), dataclasses.replace(snapshot, state=S.DRAINED)) is S.DRAINED


def pause_in_flight(record: EngineRecord) -> None:
    """A pause (or continue) sent and not answered, as its intent records it."""
    record.paused, record.flushed, record.pause_unknown = True, False, True


def resume_in_flight(record: EngineRecord) -> None:
    """A resume of the weights sent and not answered."""
    record.uncertain = {Tag.WEIGHTS}
    record.released.discard(Tag.WEIGHTS)


@pytest.mark.parametrize(
    ("state", "settled", "in_flight"),
    [
        (S.PAUSING, S.SERVING, pause_in_flight),  # a drain's pause
        (S.SERVING, S.SERVING, pause_in_flight),  # a pause() whose state was not yet written
        (S.RELEASED, S.RELEASED, resume_in_flight),
    ],
)
def test_a_snapshot_taken_mid_call_is_adopted_as_failed(
    state: ServerState, settled: ServerState, in_flight: Any
) -> None:
    source = settle(fresh_ledger(), settled)
    in_flight(source.records()[0])
    snapshot = ServerSnapshot.of("old", state, source)
    assert snapshot.in_flight()
    target = fresh_ledger()
    assert adopt(target, snapshot) is S.FAILED
    assert knowledge(target) == knowledge(source)


@pytest.mark.parametrize("state", [S.DRAINED, S.WEIGHTS_RESTORED])
def test_a_session_that_may_be_open_is_adopted_as_failed_with_its_engines_stale(
    state: ServerState,
) -> None:
    # A process killed in its push: the records imply the state, but the engines hold a
    # session and maybe half the new weights. Adopted as failed, the session kept unknown (the
    # next reset, recover or update closes it first) and the engine stale (held paused until
    # a write completes).
    source = settle(fresh_ledger(), state)
    source.records()[0].session_unknown = True
    snapshot = ServerSnapshot.of("old", state, source)
    assert snapshot.in_flight()
    target = fresh_ledger()
    assert adopt(target, snapshot) is S.FAILED
    first, second = target.records()[:2]
    assert first.session_unknown and first.stale
    assert not second.session_unknown and not second.stale


def test_a_refused_snapshot_leaves_every_record_as_it_was() -> None:
    target = settle(fresh_ledger(), S.DRAINED)
    target.records()[0].incarnation = "mine"
    before = knowledge(target)
    snapshot = ServerSnapshot.of("old", S.RELEASED, settle(fresh_ledger(), S.RELEASED))
    (actor, ref) = snapshot.groups
    # the second engine's record is unreadable: the first was loaded by the time it is read
    broken = dataclasses.replace(actor.engines[1], pause_mode="sideways")
    bad = dataclasses.replace(
        snapshot, groups=(dataclasses.replace(actor, engines=(actor.engines[0], broken)), ref)
    )
    with pytest.raises(InvalidArgument, match="unknown pause mode 'sideways'"):
        adopt(target, bad)
    assert knowledge(target) == before
    # every record loaded, then found not to imply the snapshot's state
    with pytest.raises(InvalidArgument, match="imply 'released', not its state 'serving'"):
        adopt(target, dataclasses.replace(snapshot, state=S.SERVING))
    assert knowledge(target) == before


def test_adopt_refuses_another_fleets_snapshot() -> None:
    snapshot = ServerSnapshot.of("old", S.SERVING, fresh_ledger())
    others = [
        (("actor", True, 2), ("ref", True, 1)),  # ref offloads there
        (("actor", True, 3), ("ref", False, 1)),  # another engine
        (("ref", False, 1), ("actor", True, 2)),  # the groups in another order
        (("actor", True, 2),),
    ]
    for shape in others:
        target = fresh_ledger(shape)
        before = knowledge(target)
        with pytest.raises(InvalidArgument, match="are not this server's"):
            adopt(target, snapshot)
        assert knowledge(target) == before
    with pytest.raises(InvalidArgument, match="expected a ServerSnapshot"):
        adopt(fresh_ledger(), snapshot.to_dict())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"state": "sleeping"},
        {"name": 7},
        {"groups": None},
        {"groups": [{"name": "actor", "needs_offload": "yes", "engines": []}]},
        {"groups": [{"name": "actor", "engines": []}]},
    ],
)
def test_from_dict_refuses_what_is_not_a_snapshot(change: dict[str, Any]) -> None:
    data = {**ServerSnapshot.of("old", S.SERVING, fresh_ledger()).to_dict(), **change}
    with pytest.raises(InvalidArgument, match="not a server snapshot"):
        ServerSnapshot.from_dict(data)
