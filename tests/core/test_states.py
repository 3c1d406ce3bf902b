"""The server's states, the transition table and the call plans read from it."""

from __future__ import annotations

import pytest

from rollout_lifecycle import (
    EngineGroup,
    IllegalTransition,
    RolloutServer,
    ServerState,
    SimulatedEngine,
)
from rollout_lifecycle.core.states import (
    CALLS,
    PHASED,
    TRANSITIONS,
    _path,
    destination,
    sources_of,
)

S = ServerState
CALL_PLANS = [(call, state, plan) for call, plans in CALLS.items() for state, plan in plans.items()]


@pytest.mark.parametrize(("call", "state", "plan"), CALL_PLANS)
def test_every_call_plan_is_a_path_through_the_transitions(
    call: str, state: ServerState, plan: tuple[str, ...]
) -> None:
    at = state
    for trigger in plan:
        nxt = destination(trigger, at)
        assert nxt is not None, f"{call}: {trigger} is not legal in {at}"
        at = nxt
    # each call ends where its name says
    ends = {
        "offload": {S.RELEASED},
        "onload_weights": {S.WEIGHTS_RESTORED},
        "update_weights": {state},
        "onload_kv": {S.SERVING},
        "onload": {S.SERVING},
        "pause": {S.DRAINED},
        "resume": {S.SERVING},
        "reset": {S.SERVING},  # (destination() takes reset to serving; the records decide)
    }
    assert at in ends[call], (call, state, at)


def test_a_plan_is_the_fewest_forward_transitions_to_the_goal() -> None:
    # (docs/design.md's calls table, which a test compares with CALLS, pins every plan)
    assert _path(S.RELEASED, S.SERVING) == ("restore_weights", "restore_kv", "resume")
    assert _path(S.DRAINED, S.DRAINED) == ()
    # the way out of 'failed' is reset, which no call chains toward a goal
    with pytest.raises(ValueError, match="no transitions lead from 'failed' to 'serving'"):
        _path(S.FAILED, S.SERVING)


def test_every_phased_trigger_is_a_transition() -> None:
    triggers = {row["trigger"] for row in TRANSITIONS}
    assert set(PHASED) <= triggers
    assert "before" not in {k for row in TRANSITIONS for k in row}


async def test_an_illegal_call_names_the_states_it_is_legal_in() -> None:

    engine = SimulatedEngine(label="s")
    server = RolloutServer([EngineGroup("a", [engine])])
    with pytest.raises(IllegalTransition) as caught:
        await server.onload_kv()
    assert caught.value.allowed == tuple(s.value for s in CALLS["onload_kv"])
    assert server.state is S.SERVING
    await engine.close()


def test_server_states_are_exactly_the_designed_names() -> None:
    assert [s.value for s in ServerState] == [
        "serving",
        "pausing",
        "drained",
        "released",
        "weights_restored",
        "kv_restored",
        "failed",
    ]


def test_transition_table_allows_weight_writes_only_where_weights_are_resident() -> None:
    assert set(sources_of("write_weights")) == {
        ServerState.DRAINED,
        ServerState.WEIGHTS_RESTORED,
        ServerState.KV_RESTORED,
    }
    assert ServerState.RELEASED not in sources_of("write_weights")
    assert sources_of("restore_kv") == (ServerState.WEIGHTS_RESTORED,)
    assert set(sources_of("resume")) == {ServerState.DRAINED, ServerState.KV_RESTORED}
    assert ServerState.FAILED not in sources_of("fail")
    assert all("trigger" in row and "source" in row for row in TRANSITIONS)
