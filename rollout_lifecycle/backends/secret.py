"""A credential that never shows itself: its repr, str and format print a mask.

A key is sent in an HTTP header, so a value no header can carry (non-ASCII, a control
character such as a line break, whitespace at either end) is refused when it is wrapped, with
``InvalidArgument`` saying what is wrong and where, never what the key is.

Admin keys travel inside engine factories (to Ray actors) and clients; wrapping them keeps them
out of logs, events, reprs and exception text by construction.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from rollout_lifecycle.contract.exceptions import InvalidArgument


class Secret:
    """Holds a secret string; only ``reveal()`` returns it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidArgument("a secret must be a non-empty string")
        problem = header_problem(value)
        if problem is not None:
            raise InvalidArgument(f"a secret must fit in an HTTP header, but it {problem}")
        self._value = value

    @classmethod
    def from_env(cls, name: str) -> Secret:
        """Read the secret from environment variable ``name`` (named, never shown, in errors)."""
        value = os.environ.get(name)
        if not value:
            raise InvalidArgument(f"environment variable {name!r} is not set or empty")
        problem = header_problem(value)
        if problem is not None:
            raise InvalidArgument(
                f"environment variable {name!r} holds a key that cannot go in an HTTP header: "
                f"it {problem}"
            )
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


def header_problem(value: str) -> str | None:
    """Why ``value`` cannot be sent as a key in an HTTP header (``Authorization: Bearer
    <value>``), as the end of a sentence that never shows it; None when it can.

    A header value is bytes the client encodes as ASCII (httpx), of visible characters, spaces
    and tabs, with no whitespace at either end (RFC 9110, section 5.5): a key with a non-ASCII
    character, a control character (a line break, say, from a file with CRLF line ends) or
    surrounding whitespace would be refused by the client at its first call, or sent as
    another key.
    """
    if not value.isascii():
        where = [i for i, c in enumerate(value) if not c.isascii()]
        return f"holds a non-ASCII character {_at(where, value)}; HTTP headers carry ASCII only"
    controls = [i for i, c in enumerate(value) if (ord(c) < 0x20 and c != "\t") or c == "\x7f"]
    if controls:
        return (
            f"holds a control character (a line break, say) {_at(controls, value)}; remove it "
            f"(a key read from a file may end in a newline)"
        )
    if value != value.strip(" \t"):
        return "begins or ends with whitespace, which an HTTP header cannot carry; remove it"
    return None


def _at(indices: list[int], value: str) -> str:
    """Where in ``value`` the characters at ``indices`` are, counted from 1 (never what they
    are)."""
    shown = ", ".join(str(i + 1) for i in indices[:5]) + (", ..." if len(indices) > 5 else "")
    return f"at position{'s' if len(indices) > 1 else ''} {shown} of its {len(value)} characters"


def as_secret(value: str | Secret | None, *, what: str) -> Secret | None:
    """Accept a plain string or a ``Secret``; reject anything else without showing it."""
    if value is None or isinstance(value, Secret):
        return value
    if isinstance(value, str):
        problem = header_problem(value) if value else None
        if problem is not None:
            raise InvalidArgument(f"{what} cannot go in an HTTP header: it {problem}")
        return Secret(value)
    raise InvalidArgument(f"{what} must be a string or a Secret, got {type(value).__name__}")


def secret_kwargs(kwargs: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``kwargs`` with the values of ``names`` wrapped in ``Secret`` (an engine factory is a
    ``functools.partial``, whose repr shows its arguments)."""
    out = dict(kwargs)
    for name in names:
        if name in out:
            out[name] = as_secret(out[name], what=name)
    return out
