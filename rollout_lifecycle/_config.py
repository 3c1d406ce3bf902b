"""Configuration: pause modes, memory tags, per-phase deadlines and the lifecycle policy.

Everything a transition waits for has a deadline here; nothing in the library waits without one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TypeVar

from rollout_lifecycle._exceptions import InvalidArgument


class PauseMode(str, Enum):
    """How ``pause_generation`` treats requests in flight (SGLang's ``mode``)."""

    #: Running requests give back their KV cache and wait; they finish after continue. Nothing
    #: is lost and nothing is aborted. The default.
    RETRACT = "retract"
    #: Every in-flight request returns at once with its partial output and finish reason abort.
    ABORT = "abort"
    #: The scheduler freezes with requests holding their KV cache. Memory cannot be released in
    #: this mode; only a weight update that keeps memory resident may use it.
    IN_PLACE = "in_place"


class Tag(str, Enum):
    """A kind of device memory an SGLang engine can release and resume."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"


ALL_TAGS: tuple[Tag, ...] = (Tag.WEIGHTS, Tag.KV_CACHE, Tag.CUDA_GRAPH)
#: The collective group SGLang's weight-update requests name when none is given.
# sglang: io_struct.py InitWeightsUpdateGroupReqInput.group_name
DEFAULT_GROUP_NAME = "weight_update_group"
#: The longest wait the library accepts for any deadline or timeout (a week): longer ones are
#: mistakes, and past ~9e9 s Python's own waits overflow.
MAX_SECONDS = 7 * 24 * 3600.0
#: Tags resumed by ``onload_weights`` (step 5 of the safe sequence, docs/design.md).
WEIGHT_TAGS: tuple[Tag, ...] = (Tag.WEIGHTS,)
#: Tags resumed by ``onload_kv`` (step 7 of the safe sequence, docs/design.md).
KV_TAGS: tuple[Tag, ...] = (Tag.KV_CACHE, Tag.CUDA_GRAPH)


def parse_tags(tags: Iterable[str | Tag], *, what: str = "tags") -> tuple[Tag, ...]:
    """Validate tag names; SGLang accepts typos silently (and frees nothing), so we do not."""
    if isinstance(tags, str | Tag):
        raise InvalidArgument(f"{what} must be a sequence of tag names, got the string {tags!r}")
    out: list[Tag] = []
    for raw in tags:
        try:
            tag = Tag(raw)
        except ValueError:
            valid = ", ".join(t.value for t in Tag)
            raise InvalidArgument(f"unknown memory tag {raw!r} in {what}; valid: {valid}") from None
        if tag in out:
            raise InvalidArgument(f"memory tag {tag.value!r} appears twice in {what}")
        out.append(tag)
    if not out:
        raise InvalidArgument(f"{what} is empty; name the tags explicitly")
    return tuple(out)


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase may take on every engine before the engine counts as timed out."""

    pause: float = 60.0
    flush: float = 120.0
    release: float = 120.0
    resume: float = 300.0
    continue_: float = 60.0
    weight_update: float = 1800.0
    probe: float = 10.0
    #: A replacement engine's start-up (its first answer), in ``recover()``.
    startup: float = 900.0
    #: One hook (or a ``recover()`` factory) from its call to its return. A hook may run a
    #: whole weight update (``update_weights`` from a ``weights_restored`` hook), so the default
    #: is the weight update's. A cancelled call cancels its running hook at once.
    hook: float = 1800.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgument(
                    f"deadline {f.name!r} must be a number of seconds, got {value!r}"
                )
            if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
                raise InvalidArgument(
                    f"deadline {f.name!r} must be a positive number of seconds no larger than "
                    f"{MAX_SECONDS:g}, got {value!r}"
                )


E = TypeVar("E", bound=Enum)


def _member(enum: type[E], value: object, what: str) -> E:
    """``value`` as a member of ``enum``, or an error naming the value and the valid ones."""
    try:
        return enum(value)
    except ValueError:
        valid = ", ".join(str(m.value) for m in enum)
        raise InvalidArgument(f"unknown {what} {value!r}; valid: {valid}") from None


class DeadEnginePolicy(str, Enum):
    """What a transition does when an engine is found dead."""

    #: The transition fails (``PhaseFailed``); the server goes to ``failed``.
    FAIL = "fail"
    #: The dead engine is left out and the transition goes on with the live ones.
    SKIP = "skip"


@dataclass(frozen=True)
class LifecycleConfig:
    """How a ``RolloutServer`` drives its engines."""

    pause_mode: PauseMode = PauseMode.RETRACT
    deadlines: Deadlines = field(default_factory=Deadlines)
    #: Tags ``offload()`` releases. All three by default (step 3 of the safe sequence,
    #: docs/design.md).
    release_tags: tuple[Tag, ...] = ALL_TAGS
    #: When pause or flush fails, continue generation on the engines that were paused so that
    #: serving is not left stuck.
    continue_on_failure: bool = True
    dead_engines: DeadEnginePolicy = DeadEnginePolicy.FAIL
    #: Pause between flush attempts while an engine is not idle yet.
    flush_retry_interval: float = 0.05
    #: How many of the last public calls ``RolloutServer.timeline`` keeps the spans of (one
    #: span per phase and per engine call); 0 records none.
    timeline_calls: int = 16
    #: Ask every engine for its resident bytes per tag before and after each public call
    #: (``lifecycle/<call>/<tag>_bytes_before`` / ``_after`` metrics). One extra call per engine
    #: on each side of the call, so off by default; engines that do not account memory
    #: (a real SGLang server over HTTP) report nothing.
    memory_metrics: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "pause_mode", _member(PauseMode, self.pause_mode, "pause_mode"))
        object.__setattr__(
            self, "dead_engines", _member(DeadEnginePolicy, self.dead_engines, "dead_engines")
        )
        if not isinstance(self.deadlines, Deadlines):
            raise InvalidArgument(f"deadlines must be a Deadlines, got {self.deadlines!r}")
        object.__setattr__(self, "release_tags", parse_tags(self.release_tags, what="release_tags"))
        interval = self.flush_retry_interval
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not (0 < interval <= self.deadlines.flush)
        ):
            raise InvalidArgument(
                f"flush_retry_interval must be a positive number of seconds no larger than the "
                f"flush deadline, got {interval!r}"
            )
        calls = self.timeline_calls
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise InvalidArgument(f"timeline_calls must be an int >= 0, got {calls!r}")
        if not isinstance(self.memory_metrics, bool):
            raise InvalidArgument(f"memory_metrics must be a bool, got {self.memory_metrics!r}")
