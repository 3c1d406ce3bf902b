"""What the Ray seam (``backends/ray_transport.ActorSeam``) hands to an actor method's
``remote``: every argument a value Ray carries without pickle."""

from __future__ import annotations

from typing import Any

import pytest
from ray._private.serialization import SerializationContext
from ray._private.worker import global_worker

from rollout_lifecycle.backends.ray_transport import ActorSeam
from rollout_lifecycle.contract.ops import CHECKED, FENCED, RUN


class _Method:
    def __init__(self, name: str, sent: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.name, self.sent = name, sent

    def remote(self, *args: Any) -> str:
        self.sent.append((self.name, args))
        return "ref"


class _Handle:
    """Stands for an actor handle: records each method call's arguments."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(name, self.sent)


EXPECT = ("0123456789abcdef", False, True)  # as a record gives it: (incarnation, paused, identify)


@pytest.mark.parametrize(
    ("op", "args", "method", "wire"),
    [
        (
            CHECKED,
            (EXPECT, "pause_generation", "retract"),
            "checked",
            (list(EXPECT), "pause_generation", "retract"),
        ),
        (
            FENCED,
            (["actor", 3], CHECKED, EXPECT, "release_memory_occupation", ["kv_cache"]),
            "fenced",
            (["actor", 3], CHECKED, list(EXPECT), "release_memory_occupation", ["kv_cache"]),
        ),
        (
            FENCED,
            (["actor", 3], RUN, "flush_cache", 10.0, 0.5),
            "fenced",
            (["actor", 3], RUN, "flush_cache", 10.0, 0.5),
        ),
    ],
)
def test_a_checked_calls_arguments_cross_ray_without_pickle(
    op: str, args: tuple[Any, ...], method: str, wire: tuple[Any, ...]
) -> None:
    # Ray serializes each argument of an actor call on its own: plain values as msgpack, what
    # msgpack will not take (a tuple among them) through pickle, several times the driver's CPU
    # per call. The record's expectation is a tuple; it crosses as a list of the same values.
    handle = _Handle()
    assert ActorSeam().send(handle, op, args) == "ref"
    assert handle.sent == [(method, wire)]
    context = SerializationContext(global_worker)
    kinds = [context.serialize(arg).metadata for arg in handle.sent[0][1]]
    assert set(kinds) == {b"XLANG"}, list(zip(handle.sent[0][1], kinds, strict=True))
