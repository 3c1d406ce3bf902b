"""What one engine call came to: an ``Outcome`` and its detail.

The engine seam (``contract.seam.classify``) maps whatever a call raised (Ray's errors, a
transport's, the library's) to an ``EngineOutcome``, so the core reasons about outcomes, never
about Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_lifecycle.contract.enums import ValueEnum


class Outcome(ValueEnum):
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
    #: The process at the engine's address is a new one (it restarted): the call was not sent,
    #: and the engine's record now describes a fresh server.
    RESTARTED = "restarted"
    #: The engine reports a state its record does not describe (another controller may drive
    #: it): the call was not sent.
    CONFLICT = "conflict"
    #: Anything else (a bug in a backend, garbage in an answer).
    ERROR = "error"


#: The status of a rejected begin of a weight-update session that says one is open already
#: (each backend maps its engine's answer to it: SGLang's 400 "a weight-update session is
#: already open"). Evidence of a session nothing recorded, which is closed, not an error.
SESSION_OPEN = 409

#: What an engine showed of itself that its record does not describe (``core/identity``).
DISAGREEMENTS = frozenset({Outcome.RESTARTED, Outcome.CONFLICT})


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


_new = object.__new__


def _setter(name: str) -> Callable[[EngineOutcome, Any], None]:
    """The slot descriptor's ``__set__`` of ``EngineOutcome``'s field ``name``."""
    setter: Callable[[EngineOutcome, Any], None] = vars(EngineOutcome)[name].__set__
    return setter


_set_outcome, _set_detail, _set_duration, _set_status = (
    _setter(name) for name in ("outcome", "detail", "duration_s", "status")
)
_OK = Outcome.OK


def ok_outcome(duration_s: float) -> EngineOutcome:
    """``EngineOutcome(Outcome.OK, "", duration_s)``, made without the frozen dataclass's
    ``__init__`` (four ``object.__setattr__`` calls): each engine call of a phase that
    succeeds gets one, thousands per phase. Its slots are set through their descriptors, as
    that ``__init__`` sets them."""
    made = _new(EngineOutcome)
    _set_outcome(made, _OK)
    _set_detail(made, "")
    _set_duration(made, duration_s)
    _set_status(made, None)
    return made
