"""The command table (``core/commands``): every operation has one, the checked and reading ones
are the ones the contract names, and a command's intent is exactly undone by a refusal (but the
end of a session's, whose refusal says whether one is open), kept by an answer that never came,
and replaced by the effect of a call that landed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_lifecycle import PauseMode, Tag
from rollout_lifecycle.contract.ops import CHECKED_OPS, Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.core.commands import COMMANDS, MEMORY, PAUSE, SESSION, command
from rollout_lifecycle.core.ledger import EngineRecord

WITH_INTENT = {
    Op.PAUSE: PAUSE,
    Op.CONTINUE: PAUSE,
    Op.RELEASE: MEMORY,
    Op.RESUME: MEMORY,
    Op.BEGIN_UPDATE: SESSION,
    Op.END_UPDATE: SESSION,
}
FIELDS = ("paused", "pause_mode", "flushed", "released", "uncertain", "pause_unknown")
TAGS = st.sets(st.sampled_from(list(Tag)))


def facts(record: EngineRecord) -> dict[str, Any]:
    out = {name: copy.copy(getattr(record, name)) for name in FIELDS}
    out["session_unknown"] = record.session_unknown
    return out


@st.composite
def records(draw: st.DrawFn) -> EngineRecord:
    record = EngineRecord("g/0", "g", None)
    record.paused = draw(st.booleans())
    record.pause_mode = draw(st.sampled_from([None, *PauseMode])) if record.paused else None
    record.flushed = record.paused and draw(st.booleans())
    record.released = draw(TAGS)
    record.uncertain = draw(TAGS)
    record.pause_unknown = draw(st.booleans())
    record.session_unknown = draw(st.booleans())
    return record


def test_every_operation_has_a_command_and_the_table_says_what_the_contract_does() -> None:
    assert set(COMMANDS) == set(Op)
    assert {op for op, c in COMMANDS.items() if c.checked} == set(CHECKED_OPS)
    assert {op: c.part for op, c in COMMANDS.items() if c.part is not None} == WITH_INTENT
    for cmd in COMMANDS.values():
        if cmd.reads:
            assert cmd.part is None and not cmd.checked, cmd.op
    assert command("pause_generation") is COMMANDS[Op.PAUSE]
    with pytest.raises(ValueError, match="'pause' is not an engine operation"):
        command("pause")


@pytest.mark.parametrize("op", [op for op in WITH_INTENT if COMMANDS[op].refused is None])
@given(record=records(), tags=TAGS, mode=st.sampled_from(list(PauseMode)))
def test_a_refusal_undoes_the_intent_exactly(
    op: Op, record: EngineRecord, tags: set[Tag], mode: PauseMode
) -> None:
    before = facts(record)
    record.intend(op, tuple(tags), mode)
    record.apply(op, tuple(tags), mode, EngineOutcome(Outcome.REJECTED, "no", status=503))
    assert facts(record) == before


@pytest.mark.parametrize("op", list(WITH_INTENT))
@given(record=records(), tags=TAGS, mode=st.sampled_from(list(PauseMode)))
def test_no_answer_leaves_what_the_intent_left_unknown(
    op: Op, record: EngineRecord, tags: set[Tag], mode: PauseMode
) -> None:
    record.intend(op, tuple(tags), mode)
    intended = facts(record)
    record.apply(op, tuple(tags), mode, EngineOutcome(Outcome.TIMED_OUT, "no answer"))
    assert facts(record) == intended
    assert record.uncertain >= tags if op in (Op.RELEASE, Op.RESUME) else True
    if WITH_INTENT[op] is PAUSE:
        assert record.paused and record.pause_unknown and not record.flushed
    if WITH_INTENT[op] is SESSION:
        assert record.session_unknown


@given(record=records(), tags=TAGS)
def test_a_landed_memory_call_replaces_its_intent_with_its_effect(
    record: EngineRecord, tags: set[Tag]
) -> None:
    uncertain = set(record.uncertain)
    record.intend(Op.RELEASE, tuple(tags), None)
    record.apply(Op.RELEASE, tuple(tags), None, EngineOutcome(Outcome.OK))
    assert record.uncertain == uncertain and record.released >= tags
    record.intend(Op.RESUME, tuple(tags), None)
    record.apply(Op.RESUME, tuple(tags), None, EngineOutcome(Outcome.OK))
    assert record.uncertain == uncertain and not record.released & tags


@given(record=records(), mode=st.sampled_from(list(PauseMode)))
def test_a_landed_pause_or_continue_sets_every_pause_fact(
    record: EngineRecord, mode: PauseMode
) -> None:
    record.intend(Op.PAUSE, (), mode)
    record.apply(Op.PAUSE, (), mode, EngineOutcome(Outcome.OK))
    assert (record.paused, record.pause_mode, record.flushed, record.pause_unknown) == (
        True,
        mode,
        False,
        False,
    )
    record.intend(Op.CONTINUE, (), None)
    record.apply(Op.CONTINUE, (), None, EngineOutcome(Outcome.OK))
    assert (record.paused, record.pause_mode, record.flushed, record.pause_unknown) == (
        False,
        None,
        False,
        False,
    )


@pytest.mark.parametrize(("status", "open_after"), [(400, False), (503, True)])
def test_a_refused_end_of_session_says_whether_one_is_open(status: int, open_after: bool) -> None:
    record = EngineRecord("g/0", "g", None)
    record.intend(Op.END_UPDATE, (), None)
    record.apply(Op.END_UPDATE, (), None, EngineOutcome(Outcome.REJECTED, "no", status=status))
    assert record.session_unknown is open_after
