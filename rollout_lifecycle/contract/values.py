"""Values every layer speaks: pause modes, memory tags, and the checks that turn a caller's
value into one of them or refuse it with an error naming the value.

The bottom of the package (with the operations, outcomes, exceptions and transports beside it):
it imports nothing of the library's but its exceptions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import TypeVar

from rollout_lifecycle.contract.exceptions import InvalidArgument


class PauseMode(str, Enum):
    """How ``pause_generation`` treats requests in flight (SGLang's ``mode``, mapped to vLLM's
    by its client)."""

    #: Running requests give back their KV cache and wait; they finish after continue. Nothing
    #: is lost and nothing is aborted. The default.
    RETRACT = "retract"
    #: Every in-flight request returns at once with its partial output and finish reason abort.
    ABORT = "abort"
    #: The scheduler freezes with requests holding their KV cache. Memory cannot be released in
    #: this mode; only a weight update that keeps memory resident may use it.
    IN_PLACE = "in_place"
    #: Requests in flight run to their end before the pause answers: none is aborted or held,
    #: so memory can be released. vLLM does it itself (``/pause?mode=wait``); SGLang has no such
    #: mode, and its client waits for the engine to go idle (a flush with a wait), then pauses
    #: in retract mode. The pause lasts as long as the longest request in flight:
    #: ``Deadlines.pause`` and the client's ``HTTPTimeouts.drain`` bound it.
    WAIT = "wait"


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


def check_seconds(
    what: str, value: object, *, positive: bool = True, maximum: float = MAX_SECONDS
) -> float:
    """``value`` as a number of seconds, or ``InvalidArgument`` naming ``what`` and the value.

    An int or a float (not a bool), finite, > 0 (``positive``) or >= 0, and at most ``maximum``
    (a week by default: every wait the library takes is bounded, so none overflows later).
    """
    if type(value) is float and (value > 0 if positive else value >= 0) and value <= maximum:
        return value  # (the common case, at once: an engine host checks two per flush; NaN fails)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {value!r}")
    low = "> 0" if positive else ">= 0"
    try:
        ok = math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= maximum
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise InvalidArgument(
            f"{what} must be a finite number of seconds {low} and <= {maximum:g}, got "
            f"{short_repr(value)}"
        )
    return float(value)


def check_flag(what: str, value: object) -> bool:
    """``value`` if it is a real bool (not a string such as ``"no"``, not 0/1), else refuse it."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be True or False, got {short_repr(value)}")
    return value


def check_int(what: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]``, else refuse it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise InvalidArgument(f"{what} must be an int {bound}, got {short_repr(value)}")
    return value


def check_name(what: str, value: object, *, trimmed: bool = False) -> str:
    """``value`` if it is a name fit for a log line: a string that is not blank and holds only
    printable characters (``str.isprintable``: no newline, tab or other control character, no
    format or line-separator character, no space but ' '); with ``trimmed``, also none at
    either end. Else ``InvalidArgument`` naming ``what`` and the value.

    Names and versions land in log lines, event and metrics keys, state files and SGLang's
    requests (``/update_weight_version``): a newline in one forges a line there.
    """
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{what} must be a non-blank string, got {short_repr(value)}")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise InvalidArgument(
            f"{what} must hold printable characters only (no {bad!r}), got {short_repr(value)}"
        )
    if trimmed and value != value.strip():
        raise InvalidArgument(
            f"{what} must not start or end with whitespace, got {short_repr(value)}"
        )
    return value


def check_strings(what: str, value: object) -> tuple[str, ...]:
    """``value`` as a tuple if it is a sequence of strings (not one string, nor a mapping);
    else ``InvalidArgument`` naming ``what`` and the value (or the first item that is no
    string)."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{what} must be a sequence of strings, got {short_repr(value)}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise InvalidArgument(f"{what} must hold strings only, got {short_repr(item)}")
    return items


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut short for an error message (an int of 10**5000 digits cannot even
    be printed)."""
    try:
        text = repr(value)
    except ValueError:  # an int too large to convert to a string
        if isinstance(value, int):
            return f"<an int of about {value.bit_length() * 0.30103:.0f} digits>"
        return "<unprintable value>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_tags(tags: Iterable[str | Tag], *, what: str = "tags") -> tuple[Tag, ...]:
    """Validate tag names; SGLang accepts typos silently (and frees nothing), so we do not."""
    if isinstance(tags, str | Tag):
        raise InvalidArgument(f"{what} must be a sequence of tag names, got the string {tags!r}")
    if isinstance(tags, bytes | Mapping) or not isinstance(tags, Iterable):
        raise InvalidArgument(f"{what} must be a sequence of tag names, got {short_repr(tags)}")
    out: list[Tag] = []
    for raw in tags:
        try:
            tag = Tag(raw)
        except (ValueError, TypeError):
            valid = ", ".join(t.value for t in Tag)
            raise InvalidArgument(f"unknown memory tag {raw!r} in {what}; valid: {valid}") from None
        if tag in out:
            raise InvalidArgument(f"memory tag {tag.value!r} appears twice in {what}")
        out.append(tag)
    if not out:
        raise InvalidArgument(f"{what} is empty; name the tags explicitly")
    return tuple(out)


E = TypeVar("E", bound=Enum)


def without_wait(mode: PauseMode) -> PauseMode:
    """``mode``, with ``WAIT`` as ``RETRACT``, which keeps every request too: for a pause that
    must not wait on traffic. An engine whose last pause is unknown may be paused already (on
    SGLang a wait would then time out), a replacement has nothing to wait for, and engines
    serving others around a weight write might never go idle."""
    return PauseMode.RETRACT if mode is PauseMode.WAIT else mode


def member(enum: type[E], value: object, what: str) -> E:
    """``value`` as a member of ``enum``, or an error naming the value and the valid ones."""
    try:
        return enum(value)
    except (ValueError, TypeError):
        valid = ", ".join(str(m.value) for m in enum)
        raise InvalidArgument(f"unknown {what} {value!r}; valid: {valid}") from None
