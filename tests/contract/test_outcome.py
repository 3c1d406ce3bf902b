"""``ok_outcome``, the runner's way to make the outcome of each call that succeeded, is the
outcome ``EngineOutcome`` makes: every field, frozen alike."""

from __future__ import annotations

import dataclasses

import pytest

from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome, ok_outcome


def test_an_ok_outcome_made_fast_is_the_dataclass_s_in_every_field() -> None:
    made, built = ok_outcome(0.25), EngineOutcome(Outcome.OK, "", 0.25)
    # (every field by name: one added to the dataclass and not set here raises AttributeError)
    for f in dataclasses.fields(EngineOutcome):
        assert getattr(made, f.name) == getattr(built, f.name), f.name
    assert made == built and hash(made) == hash(built) and made.ok and str(made) == "ok"
    assert type(made) is EngineOutcome


def test_an_ok_outcome_made_fast_is_frozen() -> None:
    made = ok_outcome(0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.detail = "changed"  # type: ignore[misc]
