"""The library's errors (``contract/exceptions``): each crosses a process (a Ray call, a
pickle) with its fields."""

from __future__ import annotations

import pickle

from rollout_lifecycle import (
    EngineOutcome,
    EngineRejected,
    IllegalEngineOp,
    IllegalTransition,
    Outcome,
    PhaseFailed,
    WeightsNotVerified,
)
from rollout_lifecycle.contract.exceptions import shortlist


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
