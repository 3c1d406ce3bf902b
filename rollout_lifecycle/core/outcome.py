"""What one engine call came to, and the single boundary where lower-layer errors are classified.

Ray wraps an actor's exception in ``RayTaskError``, reports a dead actor as ``ActorDiedError``
and so on; transports raise their own errors. ``classify`` maps all of them to one
``EngineOutcome`` so that the rest of the library reasons about outcomes, never about Ray.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

from rollout_lifecycle.core.exceptions import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
)


class Outcome(str, Enum):
    """How an engine call ended."""

    OK = "ok"
    #: The engine answered with an error; it is alive and did not do the call.
    REJECTED = "rejected"
    #: No answer within the deadline; what the engine did is unknown.
    TIMED_OUT = "timed_out"
    #: The engine is gone (actor died, process exited, connection refused).
    DEAD = "dead"
    #: The engine could not be reached; it may be alive.
    UNREACHABLE = "unreachable"
    #: The library refused to send the call because it would break the contract.
    REFUSED = "refused"
    #: The call was not sent (an earlier phase failed, or the engine was already dead).
    NOT_ATTEMPTED = "not_attempted"
    #: Anything else (a bug in a backend, garbage in an answer).
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class EngineOutcome:
    """The outcome of one engine call, with a human-readable detail."""

    outcome: Outcome
    detail: str = ""
    duration_s: float = 0.0
    #: The engine's status code, for a rejection that carries one.
    status: int | None = None

    @property
    def ok(self) -> bool:
        """True when the call succeeded."""
        return self.outcome is Outcome.OK

    def __str__(self) -> str:
        return f"{self.outcome.value} ({self.detail})" if self.detail else self.outcome.value


def _ray_errors() -> tuple[tuple[type[BaseException], ...], type[BaseException] | None]:
    try:
        from ray import exceptions as rex
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return (), None
    dead: tuple[type[BaseException], ...] = (rex.RayActorError,)
    unavailable = getattr(rex, "ActorUnavailableError", None)
    if unavailable is not None:
        dead = (*dead, unavailable)
    return dead, rex.RayTaskError


_RAY_DEAD, _RAY_TASK_ERROR = _ray_errors()


def unwrap(exc: BaseException) -> BaseException:
    """The error an engine actor raised, without Ray's wrapping."""
    if _RAY_TASK_ERROR is not None and isinstance(exc, _RAY_TASK_ERROR):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def classify(exc: BaseException, duration_s: float = 0.0) -> EngineOutcome:
    """Map any exception from an engine call to an outcome."""
    if isinstance(exc, _RAY_DEAD):
        return EngineOutcome(Outcome.DEAD, f"actor died: {type(exc).__name__}", duration_s)
    inner = unwrap(exc)
    detail = str(inner) or type(inner).__name__
    if isinstance(inner, _RAY_DEAD):
        return EngineOutcome(Outcome.DEAD, f"actor died: {type(inner).__name__}", duration_s)
    if isinstance(inner, EngineDead):
        return EngineOutcome(Outcome.DEAD, inner.message, duration_s)
    if isinstance(inner, EngineTimeout):
        return EngineOutcome(Outcome.TIMED_OUT, inner.message, duration_s)
    if isinstance(inner, EngineRejected):
        return EngineOutcome(
            Outcome.REJECTED, f"{inner.status}: {inner.message}", duration_s, inner.status
        )
    if isinstance(inner, EngineUnreachable):
        return EngineOutcome(Outcome.UNREACHABLE, inner.message, duration_s)
    if isinstance(inner, IllegalEngineOp):
        return EngineOutcome(Outcome.REFUSED, inner.reason, duration_s)
    if isinstance(inner, EngineError):
        return EngineOutcome(Outcome.ERROR, inner.message, duration_s)
    if isinstance(inner, asyncio.TimeoutError | TimeoutError):
        return EngineOutcome(Outcome.TIMED_OUT, detail, duration_s)
    if isinstance(inner, ConnectionRefusedError):
        return EngineOutcome(Outcome.DEAD, detail, duration_s)
    return EngineOutcome(Outcome.ERROR, f"{type(inner).__name__}: {detail}", duration_s)
