"""A credential that never shows itself: its repr, str and format print a mask.

Admin keys travel inside engine factories (to Ray actors) and clients; wrapping them keeps them
out of logs, events, reprs and exception text by construction.
"""

from __future__ import annotations

import os

from rollout_lifecycle.contract.exceptions import InvalidArgument


class Secret:
    """Holds a secret string; only ``reveal()`` returns it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidArgument("a secret must be a non-empty string")
        self._value = value

    @classmethod
    def from_env(cls, name: str) -> Secret:
        """Read the secret from environment variable ``name`` (named, never shown, in errors)."""
        value = os.environ.get(name)
        if not value:
            raise InvalidArgument(f"environment variable {name!r} is not set or empty")
        return cls(value)

    def reveal(self) -> str:
        """The secret itself, for the one place that must send it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __reduce__(self) -> tuple[type[Secret], tuple[str]]:
        return (Secret, (self._value,))


def as_secret(value: str | Secret | None, *, what: str) -> Secret | None:
    """Accept a plain string or a ``Secret``; reject anything else without showing it."""
    if value is None or isinstance(value, Secret):
        return value
    if isinstance(value, str):
        return Secret(value)
    raise InvalidArgument(f"{what} must be a string or a Secret, got {type(value).__name__}")
