"""What a user's weight push is handed: a ``WeightUpdate`` (the version and the engines to
write to), and the type of the push itself. ``RolloutServer.update_weights`` calls it, and the
built-in strategies (``backends/weights``) are such pushes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_lifecycle.contract.ops import Op


@dataclass(frozen=True)
class WeightUpdate:
    """What a weight-push callable receives: the version and the engines to write to."""

    version: str | None
    #: Engine id -> engine handle, for every live engine whose weights are being written.
    engines: Mapping[str, Any]


#: Writes weights into the engines of a ``WeightUpdate`` (sync or async). A push may say which
#: weight-write operations it sends (an attribute ``sends``, a collection of ``Op``, as the
#: built-in strategies do): a write to an engine whose driver does not carry one of them
#: (``Capabilities.weight_writes``) is refused before anything is sent.
WeightPush = Callable[[WeightUpdate], Any]


def sends_of(push: object) -> frozenset[Op]:
    """The weight-write operations ``push`` says it sends (none when it does not say)."""
    said = getattr(push, "sends", None)
    if not isinstance(said, Collection) or isinstance(said, str):
        return frozenset()
    return frozenset(op for op in said if isinstance(op, Op))


__all__ = ["WeightPush", "WeightUpdate", "sends_of"]
