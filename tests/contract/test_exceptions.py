"""The library's errors (``contract/exceptions``): each crosses a process (a Ray call, a
pickle) with its fields."""

from __future__ import annotations

import pickle

from rollout_lifecycle import (
    EngineOutcome,
    EngineRejected,
    HookFailed,
    IllegalEngineOp,
    IllegalTransition,
    Outcome,
    PhaseFailed,
    ServerState,
    WeightsNotVerified,
)
from rollout_lifecycle.contract.exceptions import shortlist
from rollout_lifecycle.core.states import Phase


def test_errors_pickle_with_their_fields() -> None:
    errors = [
        EngineRejected("e", "flush_cache", "not idle", 400),
        IllegalEngineOp("a/0", "release_memory_occupation", "busy"),
        IllegalTransition("onload_kv", "serving", ["weights_restored"]),
        PhaseFailed("pause", {"a/0": EngineOutcome(Outcome.DEAD, "gone")}, "failed"),
    ]
    for err in errors:
        copy = pickle.loads(pickle.dumps(err))
        assert type(copy) is type(err)
        assert str(copy) == str(err)
        assert copy.__dict__.keys() == err.__dict__.keys()
    assert pickle.loads(pickle.dumps(errors[0])).status == 400


def test_a_long_list_of_names_shows_the_first_and_counts_the_rest() -> None:
    assert shortlist(["a", "b"], 3) == "a, b"
    assert shortlist(["a", "b", "c"], 3) == "a, b, c"
    assert shortlist(["a", "b", "c", "d", "e"], 3) == "a, b, c and 2 more"
    tensors = tuple(f"w{i}" for i in range(6))
    error = WeightsNotVerified("v1", {"a/0": "differs"}, {"a/0": tensors})
    assert "a/0 differs (tensors w0, w1, w2, w3 and 2 more)" in str(error)


def test_a_phase_and_a_state_are_named_by_their_values() -> None:
    outcomes = {"a/0": EngineOutcome(Outcome.REJECTED, "busy")}
    error = PhaseFailed(Phase.FLUSH, outcomes, ServerState.FAILED)
    assert str(error).startswith(
        "phase 'flush' failed on 1 of 1 engine(s) (server is now 'failed')"
    )
    refused = IllegalTransition("onload_kv", ServerState.SERVING, ["weights_restored"])
    assert "in state 'serving';" in str(refused)
    hook = HookFailed("before_release", "refuse", ServerState.DRAINED)
    assert "(server left in 'drained')" in str(hook)
