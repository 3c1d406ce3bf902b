"""What a public call hands the phases of its transitions (``PhaseArgs``): the groups a drain
pauses, the user's weight push and its version, what a verified write checks. The state machine
(``core/machine``) carries it from the call to the phases unread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollout_lifecycle.contract.push import WeightPush
from rollout_lifecycle.core.ledger import GroupRecords
from rollout_lifecycle.core.verify import Verification


@dataclass(frozen=True)
class PhaseArgs:
    """What a call hands the phases of its transitions."""

    #: The groups a drain pauses (``offload()``: those that offload; ``pause()``: all).
    groups: Sequence[GroupRecords] = ()
    #: The weight push and version of ``update_weights()``.
    push: WeightPush | None = None
    version: str | None = None
    #: What a verified write checks; None: the write is not verified.
    verify: Verification | None = None


#: The arguments of a call whose phases need none.
NO_ARGS = PhaseArgs()

__all__ = ["NO_ARGS", "PhaseArgs"]
