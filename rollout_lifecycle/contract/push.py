"""What a user's weight push is handed: a ``WeightUpdate`` (the version and the engines to
write to), and the type of the push itself. ``RolloutServer.update_weights`` calls it, and the
built-in strategies (``backends/weights``) are such pushes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WeightUpdate:
    """What a weight-push callable receives: the version and the engines to write to."""

    version: str | None
    #: Engine id -> engine handle, for every live engine whose weights are being written.
    engines: Mapping[str, Any]


#: Writes weights into the engines of a ``WeightUpdate`` (sync or async).
WeightPush = Callable[[WeightUpdate], Any]

__all__ = ["WeightPush", "WeightUpdate"]
