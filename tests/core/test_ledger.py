"""The fleet ledger without engines: the memory-target table, the state the records imply, the
operations the records know, and the guard of each call that could kill an engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rollout_lifecycle import (
    ALL_TAGS,
    KV_TAGS,
    EngineHost,
    PauseMode,
    ServerState,
    Tag,
)
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.exceptions import IllegalEngineOp, InvalidArgument
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.core.ledger import (
    DRAINED_STATES,
    KEEPERS_SERVE,
    SETTLED_STATES,
    EngineRecord,
    EngineSnapshot,
    Fleet,
    Target,
    may_serve,
    target,
)

S = ServerState
SETTLED = (S.SERVING, S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED)


@dataclass
class Group:
    name: str
    needs_offload: bool
    records: tuple[EngineRecord, ...] = field(default=())


def ledger_and_records(offloading: int = 2, keeping: int = 1) -> tuple[Fleet, list[EngineRecord]]:
    def records(group: str, count: int) -> tuple[EngineRecord, ...]:
        return tuple(EngineRecord(f"{group}/{i}", group, None) for i in range(count))

    groups = [
        Group("actor", True, records("actor", offloading)),
        Group("ref", False, records("ref", keeping)),
    ]
    return Fleet(groups, ALL_TAGS), [r for g in groups for r in g.records]


def put(record: EngineRecord, goal: Target) -> None:
    """Make ``record`` what a server settled with ``goal`` for it records."""
    record.paused, record.flushed = goal.paused, goal.paused
    record.pause_mode = PauseMode.RETRACT if goal.paused else None
    record.released = set(goal.released)


def test_the_memory_target_of_every_state() -> None:
    assert target(S.SERVING, True, ALL_TAGS) == Target(False, (), held=False)
    assert target(S.DRAINED, True, ALL_TAGS) == Target(True, (), held=True)
    # pause() leaves a group that keeps its memory paused in drained; offload() leaves it serving
    assert target(S.DRAINED, False, ALL_TAGS) == Target(True, (), held=False)
    assert target(S.RELEASED, True, ALL_TAGS) == Target(True, ALL_TAGS, held=True)
    assert target(S.WEIGHTS_RESTORED, True, ALL_TAGS) == Target(True, KV_TAGS, held=True)
    assert target(S.KV_RESTORED, True, ALL_TAGS) == Target(True, (), held=True)
    for state in (S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED):
        assert target(state, False, ALL_TAGS) == Target(False, (), held=False), state
    assert target(S.PAUSING, True, ALL_TAGS) is None
    assert target(S.FAILED, False, ALL_TAGS) is None
    # only the configured tags are ever released
    assert target(S.RELEASED, True, (Tag.KV_CACHE,)) == Target(True, (Tag.KV_CACHE,), held=True)


def test_the_state_sets_derived_from_the_targets() -> None:
    assert SETTLED_STATES == (S.SERVING, S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED)
    assert DRAINED_STATES == (S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED)
    assert {S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED} == KEEPERS_SERVE


def test_which_groups_may_serve_in_each_state() -> None:
    served = {(s, offloads) for s in S for offloads in (True, False) if may_serve(s, offloads)}
    keepers = {(s, False) for s in S}
    # in failed the records decide: a drain that failed continued what it paused
    assert served == {(S.SERVING, True), (S.FAILED, True), *keepers}


@pytest.mark.parametrize("state", SETTLED)
def test_records_at_a_states_targets_imply_that_state(state: ServerState) -> None:
    ledger, records = ledger_and_records()
    for record in records:
        goal = ledger.target(record, state)
        assert goal is not None
        put(record, goal)
    assert ledger.settled_state() is state
    assert ledger.majority_state(()) is state


def test_kv_restored_records_imply_drained() -> None:
    ledger, records = ledger_and_records()
    for record in records:
        goal = ledger.target(record, S.KV_RESTORED)
        assert goal is not None
        put(record, goal)
    assert ledger.settled_state() is S.DRAINED


def test_records_that_disagree_imply_no_state() -> None:
    ledger, records = ledger_and_records()
    records[0].paused = records[0].flushed = True
    records[0].released = {Tag.KV_CACHE}
    assert ledger.settled_state() is None
    ledger, records = ledger_and_records()
    records[0].uncertain = {Tag.WEIGHTS}
    assert ledger.settled_state() is None
    # a broken engine left out, the rest agree
    assert ledger.settled_state(skip={records[0].id}) is S.SERVING


def test_the_majority_of_a_partly_released_fleet() -> None:
    ledger, records = ledger_and_records(offloading=3)
    for record in records[:2]:
        put(record, Target(True, ALL_TAGS, held=True))
    assert ledger.settled_state() is None
    assert ledger.majority_state(()) is S.RELEASED


def test_named_queries() -> None:
    ledger, records = ledger_and_records()
    actor0, actor1, ref0 = records
    actor1.alive = False
    ref0.paused = True
    assert ledger.live() == [actor0, ref0]
    assert ledger.offloaded() == [actor0]
    assert ledger.broken() == [actor1]
    assert ledger.dead_groups() == []
    actor0.alive = False
    assert [g.name for g in ledger.dead_groups()] == ["actor"]


def test_an_operation_the_ledger_does_not_know_is_an_error() -> None:
    record = EngineRecord("g/0", "g", None)
    with pytest.raises(ValueError, match="release_memory"):
        record.apply("release_memory", (Tag.KV_CACHE,), None, EngineOutcome(Outcome.OK))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        record.intend("pause", (), None)  # type: ignore[arg-type]
    assert not record.released and not record.paused


def test_every_operation_but_a_backends_own_read_is_a_method_of_the_engine_host() -> None:
    """The protocol is declared once: each ``Op`` names an ``EngineHost`` method, which adapts
    it to the backend; ``EngineHost.run`` carries the one that is a backend's own method
    (vLLM's ``is_sleeping``) to the backend itself."""
    unadapted = {op for op in Op if not callable(getattr(EngineHost, op.value, None))}
    assert unadapted == {Op.IS_SLEEPING}


# -- what a driver declares, kept by the record ------------------------------------------------

VLLM_DECLARED = {
    "family": "vllm",
    "release_requires": [["weights", "kv_cache"]],
    "kv_wakes_at_continue": True,
}
OK = EngineOutcome(Outcome.OK, "")


def test_a_record_takes_its_drivers_capabilities_with_the_incarnation_it_names() -> None:
    record = EngineRecord("actor/0", "actor", None)
    assert record.capabilities is None
    record.met("inc-1", VLLM_DECLARED)
    assert record.capabilities is not None and record.capabilities.family == "vllm"
    # until they are read, a check identifies the engine even where its pause state would
    # prove it (they come with the incarnation: once per process)
    paused = EngineRecord("actor/1", "actor", None)
    paused.incarnation, paused.paused = "inc-2", True
    assert paused.expect(Op.CONTINUE, 0.0) == ("inc-2", True, True)
    paused.met("inc-2", VLLM_DECLARED)
    assert paused.expect(Op.CONTINUE, 0.0) == ("inc-2", True, False)
    # another process's declaration is not this one's; garbage is not taken
    record.met("inc-other", {"family": "other"})
    assert record.capabilities.family == "vllm"
    record.declares({"kv_wakes_at_continue": "yes"})
    assert record.capabilities is None
    # a checked call's answer brings them too, and a restart forgets them with the process
    record.apply(Op.PAUSE, (), PauseMode.RETRACT, OK, "inc-1", VLLM_DECLARED)
    assert record.capabilities is not None
    record.restart("inc-3")
    assert record.capabilities is None and record.incarnation == "inc-3"


def test_the_kv_cache_a_vllm_driver_wakes_at_the_continue_is_asleep_until_then() -> None:
    """A KV resume that landed on a driver whose continue wakes the KV cache leaves the record
    ``kv_asleep``: the engine's state is ``KV_ASLEEP`` until a continue lands, through the
    snapshot too; on a driver without that capability it is ``DRAINED``."""
    for declared, after_resume in ((VLLM_DECLARED, "kv_asleep"), ({"family": "s"}, "drained")):
        record = EngineRecord("actor/0", "actor", None)
        record.apply(Op.PAUSE, (), PauseMode.RETRACT, OK, "inc-1", declared)
        record.apply(Op.FLUSH, (), None, OK)
        record.apply(Op.RELEASE, ALL_TAGS, None, OK)
        record.apply(Op.RESUME, (Tag.WEIGHTS,), None, OK)
        assert record.state.value == "released"
        record.apply(Op.RESUME, KV_TAGS, None, OK)
        assert record.state.value == after_resume
        snapshot = record.snapshot()
        assert snapshot.state.value == after_resume
        copy = EngineRecord("actor/0", "actor", None)
        copy.load(type(snapshot).from_dict(snapshot.__dict__))
        assert copy.state.value == after_resume and copy.capabilities == record.capabilities
        timed_out = EngineOutcome(Outcome.TIMED_OUT, "no answer")
        record.apply(Op.CONTINUE, (), None, timed_out)
        assert record.kv_asleep == (after_resume == "kv_asleep")  # (may not have woken)
        record.apply(Op.CONTINUE, (), None, OK)
        assert not record.kv_asleep and record.state.value == "serving"


def test_a_release_the_driver_cannot_make_is_refused_before_it_is_sent() -> None:
    record = EngineRecord("actor/0", "actor", None)
    record.paused, record.flushed, record.pause_mode = True, True, PauseMode.RETRACT
    record.check_release([Tag.WEIGHTS])  # (capabilities not known yet: the engine decides)
    record.met("inc-1", VLLM_DECLARED)
    with pytest.raises(IllegalEngineOp, match=r"vllm cannot release tags \['weights'\]"):
        record.check_release([Tag.WEIGHTS])
    record.check_release([Tag.WEIGHTS, Tag.KV_CACHE])


def test_a_snapshot_whose_capabilities_are_garbage_is_refused_by_name() -> None:
    saved = EngineRecord("actor/0", "actor", None).snapshot().__dict__.copy()
    saved["capabilities"] = {"family": 1}
    with pytest.raises(InvalidArgument, match=r"field 'capabilities': .*family must be a name"):
        EngineSnapshot.from_dict(saved)
    saved["capabilities"] = "vllm"
    with pytest.raises(InvalidArgument, match="field 'capabilities'"):
        EngineSnapshot.from_dict(saved)
    saved["capabilities"] = VLLM_DECLARED
    loaded = EngineSnapshot.from_dict(saved).capabilities
    assert loaded is not None and {k: loaded[k] for k in VLLM_DECLARED} == VLLM_DECLARED
    # a form written before a capability was declared loads with its default
    assert loaded["fingerprint_scheme"] == Capabilities().fingerprint_scheme


def test_engine_record_guards_each_fatal_call() -> None:
    record = EngineRecord(id="actor/0", group="actor", handle=None)
    with pytest.raises(IllegalEngineOp, match="not released"):
        record.check_resume([Tag.KV_CACHE])
    with pytest.raises(IllegalEngineOp, match="not paused"):
        record.check_release([Tag.KV_CACHE])
    ok = EngineOutcome(Outcome.OK)
    record.apply("pause_generation", (), PauseMode.RETRACT, ok)
    with pytest.raises(IllegalEngineOp, match="flush"):
        record.check_release([Tag.KV_CACHE])
    record.apply("flush_cache", (), None, ok)
    record.check_release([Tag.KV_CACHE])
    record.apply("release_memory_occupation", (Tag.KV_CACHE,), None, ok)
    with pytest.raises(IllegalEngineOp, match="already released"):
        record.check_release([Tag.KV_CACHE, Tag.WEIGHTS])
    with pytest.raises(IllegalEngineOp, match="kv_cache"):
        record.check_continue()
    with pytest.raises(IllegalEngineOp, match="not released"):
        record.check_resume([Tag.KV_CACHE, Tag.WEIGHTS])  # the resume-everything trap
    record.check_resume([Tag.KV_CACHE])
    record.apply("release_memory_occupation", (Tag.WEIGHTS,), None, ok)
    with pytest.raises(IllegalEngineOp, match="weights are released"):
        record.check_write_weights()


def test_in_place_pause_never_allows_a_release() -> None:
    record = EngineRecord(id="a/0", group="a", handle=None)
    ok = EngineOutcome(Outcome.OK)
    record.apply("pause_generation", (), PauseMode.IN_PLACE, ok)
    record.apply("flush_cache", (), None, ok)
    with pytest.raises(IllegalEngineOp, match="in_place"):
        record.check_release([Tag.KV_CACHE])


def test_a_release_without_answer_makes_its_tags_unknown_and_blocks_both_directions() -> None:
    record = EngineRecord(id="a/0", group="a", handle=None)
    ok = EngineOutcome(Outcome.OK)
    record.apply("pause_generation", (), PauseMode.RETRACT, ok)
    record.apply("flush_cache", (), None, ok)
    record.apply(
        "release_memory_occupation", (Tag.KV_CACHE,), None, EngineOutcome(Outcome.TIMED_OUT)
    )
    with pytest.raises(IllegalEngineOp, match="unknown"):
        record.check_release([Tag.KV_CACHE])
    with pytest.raises(IllegalEngineOp, match="unknown"):
        record.check_resume([Tag.KV_CACHE])
    with pytest.raises(IllegalEngineOp):
        record.check_continue()
    assert record.snapshot().uncertain == ("kv_cache",)
