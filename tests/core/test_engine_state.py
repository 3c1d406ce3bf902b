"""An engine's one derived state (``EngineState``): what every combination of a record's facts
adds up to, the same for a record and its snapshot, and the fleet's queries as sets of states."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from rollout_lifecycle import EngineState, PauseMode, Tag
from rollout_lifecycle.contract.values import ALL_TAGS
from rollout_lifecycle.core.ledger import CONTINUABLE_STATES, EngineRecord, EngineSnapshot, Fleet

E = EngineState
TAG_SETS = st.sets(st.sampled_from(list(Tag)))


@st.composite
def records(draw: st.DrawFn, group: str = "actor", index: int = 0) -> EngineRecord:
    """A record with any combination of the facts the state is derived from that a record can
    hold: a pause or continue that did not answer leaves it paused and not flushed, and a KV
    cache asleep until the continue is a paused engine's."""
    record = EngineRecord(f"{group}/{index}", group, None)
    record.alive = draw(st.booleans())
    record.paused = draw(st.booleans())
    record.pause_mode = draw(st.none() | st.sampled_from(list(PauseMode)))
    record.flushed = draw(st.booleans())
    record.released = draw(TAG_SETS)
    record.uncertain = draw(TAG_SETS)
    record.stale = draw(st.booleans())
    record.pause_unknown = draw(st.booleans())
    if record.pause_unknown:
        record.paused, record.flushed = True, False
    record.kv_asleep = draw(st.booleans())
    if record.kv_asleep:
        record.paused = True
    return record


@given(records())
def test_serving_is_exactly_what_may_take_requests(record: EngineRecord) -> None:
    """The state is ``serving`` exactly when the record is alive, known to be unpaused, all its
    memory resident and holding the fleet's weights."""
    takes_requests = (
        record.alive
        and not record.paused
        and not record.pause_unknown
        and not record.stale
        and not (record.released or record.uncertain)
    )
    assert (record.state is E.SERVING) == takes_requests == record.serves


@given(records())
def test_each_state_says_what_its_name_says(record: EngineRecord) -> None:
    state = record.state
    assert (state is E.DEAD) == (not record.alive)
    if state is not E.DEAD:
        assert (state is E.UNCERTAIN) == bool(record.uncertain)
    if state is E.RELEASED:
        assert record.released and not record.uncertain
    if state in (E.STALE, E.WAITING):
        assert record.stale
        assert (state is E.WAITING) == record.paused
    if state in (E.WAITING, E.KV_ASLEEP, E.PAUSED, E.DRAINED):
        assert record.paused and not record.released and not record.uncertain
    if state in (E.KV_ASLEEP, E.PAUSED, E.DRAINED, E.SERVING):
        assert not record.stale
    # the KV cache asleep until the continue, whatever else holds, once the weights are there
    assert (state is E.KV_ASLEEP) == (
        state in (E.KV_ASLEEP, E.PAUSED, E.DRAINED) and record.kv_asleep
    )
    # drained: paused and idle, never on the strength of a pause that did not answer
    assert (state is E.DRAINED) == (state in (E.PAUSED, E.DRAINED) and record.idle), (
        "drained is a resident paused engine known to be idle"
    )
    if record.pause_unknown and state is not E.DEAD:
        assert state is not E.DRAINED and state is not E.SERVING


def test_an_unanswered_pause_or_continue_is_never_idle_even_in_place() -> None:
    """A record whose last pause was in place and whose continue (or a pause sent again) did
    not answer may be generating: it is ``paused`` (to be paused again), never ``drained``."""
    record = EngineRecord("actor/0", "actor", None)
    record.paused, record.pause_mode = True, PauseMode.IN_PLACE
    assert record.idle and record.state is E.DRAINED
    record.pause_unknown = True
    assert not record.idle and record.state is E.PAUSED
    assert record.snapshot().state is E.PAUSED


@given(records())
def test_a_snapshot_has_its_records_state(record: EngineRecord) -> None:
    snapshot = record.snapshot()
    assert snapshot.state is record.state
    assert EngineSnapshot.from_dict(snapshot.__dict__).state is record.state


@dataclass
class Group:
    name: str
    needs_offload: bool
    records: tuple[EngineRecord, ...] = field(default=())


@given(st.lists(records("actor"), max_size=6), st.lists(records("ref"), max_size=4))
def test_the_fleets_queries_are_sets_of_states(
    actor: list[EngineRecord], ref: list[EngineRecord]
) -> None:
    """``live``, ``broken`` and ``offloaded`` are the records in some states, as are the
    continuable ones; ``get``, ``count`` and ``by_state`` index the fleet by state."""
    for i, r in enumerate(actor):
        r.id = f"actor/{i}"
    for i, r in enumerate(ref):
        r.id = f"ref/{i}"
    fleet = Fleet([Group("actor", True, tuple(actor)), Group("ref", False, tuple(ref))], ALL_TAGS)
    everyone = actor + ref
    woken = [r for r in everyone if r.alive and not (r.released | r.uncertain)]
    assert fleet.live() == [r for r in everyone if r.alive]
    assert fleet.offloaded() == [r for r in actor if r.alive]
    assert fleet.broken() == [r for r in everyone if not r.alive or r.uncertain]
    # (a KV cache asleep until the continue is woken by it: such an engine is continued too)
    assert fleet.get(CONTINUABLE_STATES) == [r for r in woken if r.paused and not r.stale]
    assert fleet.live(skip={"actor/0"}) == [r for r in everyone if r.alive and r.id != "actor/0"]
    counts = fleet.by_state()
    assert list(counts) == list(EngineState)
    for state in EngineState:
        assert fleet.get([state]) == [r for r in everyone if r.state is state]
        assert fleet.count([state]) == counts[state]
    assert fleet.count() == sum(counts.values()) == len(everyone)
    assert fleet.get([E.SERVING, E.DRAINED], offloading=False) == [
        r for r in ref if r.state in (E.SERVING, E.DRAINED)
    ]
