"""What goes over the wire to SGLang: the client's timeouts, and the checks of the values a
call sends (each raises ``InvalidArgument`` naming the value before anything is sent)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.values import check_seconds

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class HTTPTimeouts:
    """Seconds each kind of SGLang call may take before it raises ``EngineTimeout``.

    ``connect`` bounds opening a connection; the others bound the wait for an answer.
    ``flush_margin`` is added to a flush's own server-side wait (``?timeout=T``), so the client
    never gives up before the server has answered "not idle".
    """

    connect: float = 5.0
    #: pause, continue, begin/end weight update, weight version, abort.
    control: float = 60.0
    #: release and resume (a resume maps gigabytes back; it can take long).
    memory: float = 300.0
    #: weight updates from disk, tensors or a collective group.
    weights: float = 1800.0
    #: ``/server_info`` and ``/model_info``.
    probe: float = 10.0
    #: one ``/generate`` run to completion.
    generate: float = 3600.0
    #: a pause in wait mode (``PauseMode.WAIT``): it answers once every request in flight has
    #: run to its end, so it gets a request's bound.
    drain: float = 3600.0
    flush_margin: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            check_seconds(f"HTTP timeout {f.name!r}", getattr(self, f.name), positive=True)


def check_str(name: str, value: object, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        kind = "a string or None" if optional else "a string"
        raise InvalidArgument(f"{name} must be {kind}, got {shown(value)}")
    return value


def check_str_list(name: str, value: object, *, allow_empty: bool = True) -> list[str]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{name} must be a sequence of strings, got {shown(value)}")
    items = list(value)
    if not all(isinstance(item, str) for item in items):
        raise InvalidArgument(f"{name} must hold strings only")
    if not items and not allow_empty:
        raise InvalidArgument(f"{name} must not be empty")
    return items


def check_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string, got {value!r}")
    return value


def check_shapes(value: object) -> list[list[int]]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"shapes must be a list of lists of ints, got {shown(value)}")
    shapes: list[list[int]] = []
    for shape in value:
        if isinstance(shape, str) or not isinstance(shape, Sequence):
            raise InvalidArgument(f"each shape must be a list of ints, got {shape!r}")
        dims = list(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise InvalidArgument(f"each shape must hold ints >= 0, got {shape!r}")
        shapes.append(dims)
    return shapes


def parse_version(value: object) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version string such as ``0.5.23``, ``0.5.23.post1`` or
    ``0.5.23-sim`` (the leading numbers count, a suffix does not); None if it has none."""
    if not isinstance(value, str):
        return None
    match = _VERSION.match(value)
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def shown(value: object) -> str:
    """A value from an answer, short enough for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


__all__ = [
    "HTTPTimeouts",
    "check_name",
    "check_shapes",
    "check_str",
    "check_str_list",
    "parse_version",
    "shown",
]
