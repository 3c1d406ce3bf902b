"""The engine seam's one boundary where errors are classified (``contract/seam.classify``):
what an engine call raised, as an ``Outcome``."""

from __future__ import annotations

from rollout_lifecycle import EngineDead, EngineRejected, EngineTimeout, Outcome
from rollout_lifecycle.contract.seam import classify


def test_classify_maps_engine_errors_to_outcomes() -> None:
    assert classify(EngineRejected("e", "op", "no", 400)).outcome is Outcome.REJECTED
    assert classify(EngineDead("e", "op", "gone")).outcome is Outcome.DEAD
    assert classify(EngineTimeout("e", "op", "slow")).outcome is Outcome.TIMED_OUT
    assert classify(ConnectionRefusedError()).outcome is Outcome.DEAD
    assert classify(ValueError("garbage")).outcome is Outcome.ERROR
