"""The base of the library's named values: an enum whose members print as their values.

The bottom of the package: it imports nothing of the library's.
"""

from __future__ import annotations

from enum import Enum


class ValueEnum(str, Enum):
    """An enum whose members print as their values (``str``, ``format`` and f-strings give
    ``"serving"``, not ``"ServerState.SERVING"``): the operations, outcomes, server states,
    engine states and phases, whose values are names in events, metrics and errors."""

    def __str__(self) -> str:
        return str(self.value)


__all__ = ["ValueEnum"]
