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
)


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
