"""The library's exception tree.

Catch ``LifecycleError`` to catch everything this library raises. Engine backends raise the
``EngineError`` family; the server translates whatever a lower layer (Ray, a transport) raises
into these at one boundary (``rollout_lifecycle.contract.seam.classify``).

Every exception here pickles with its fields intact, because engine errors cross Ray actor
boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_lifecycle.contract.outcome import EngineOutcome


class LifecycleError(Exception):
    """Base class of every error raised by rollout_lifecycle."""

    def __reduce__(self) -> str | tuple[Any, ...]:
        # Subclasses keep their constructor arguments in ``self._init``; pickling replays them so
        # that an error raised inside a Ray actor arrives with the same fields.
        return (type(self), self._init) if hasattr(self, "_init") else super().__reduce__()


class InvalidArgument(LifecycleError, ValueError):
    """A value given to the library is unusable; raised before any engine is touched."""


class IllegalTransition(LifecycleError):
    """The requested lifecycle call is not allowed from the server's current state, or not
    from where it was made (user code running inside a transition in progress).

    The message names the states the call is allowed from (``allowed``) or, when ``reason`` is
    given, says why instead.
    """

    def __init__(
        self, call: str, state: str, allowed: Iterable[str], reason: str | None = None
    ) -> None:
        self._init = (call, state, tuple(allowed), reason)
        self.call = call
        self.state = state
        self.allowed = tuple(allowed)
        self.reason = reason
        why = reason
        if why is None:
            why = f"it is allowed from: {', '.join(repr(s) for s in self.allowed)}"
        super().__init__(f"{call}() is not allowed in state {str(state)!r}; {why}")


class IllegalEngineOp(LifecycleError):
    """An engine call would break the SGLang contract (it would kill the engine); not sent."""

    def __init__(self, engine: str, op: str, reason: str) -> None:
        self._init = (engine, op, reason)
        self.engine = engine
        self.op = op
        self.reason = reason
        super().__init__(f"refused {op} on engine {engine}: {reason}")


class PhaseFailed(LifecycleError):
    """A phase did not succeed on every targeted engine; ``outcomes`` says what each did."""

    def __init__(self, phase: str, outcomes: Mapping[str, EngineOutcome], state: str) -> None:
        self._init = (phase, dict(outcomes), state)
        self.phase = phase
        self.outcomes = dict(outcomes)
        self.state = state
        bad = {k: v for k, v in self.outcomes.items() if not v.ok}
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(bad.items()))
        super().__init__(
            f"phase {str(phase)!r} failed on {len(bad)} of {len(self.outcomes)} engine(s) "
            f"(server is now {str(state)!r}): {detail}"
        )

    @property
    def failed_engines(self) -> list[str]:
        """Ids of the engines whose outcome was not ``ok``."""
        return sorted(k for k, v in self.outcomes.items() if not v.ok)


class HookFailed(LifecycleError):
    """A user hook raised; the server is left in the last state it completed (``state``), or
    back in ``serving`` when the hook refused a drain."""

    def __init__(self, event: str, hook: str, state: str, reason: str = "raised") -> None:
        self._init = (event, hook, state, reason)
        self.event = event
        self.hook = hook
        #: The state the call left the server in.
        self.state = state
        #: What went wrong: ``raised`` (the cause is ``__cause__``) or why it was stopped.
        self.reason = reason
        super().__init__(self._message())

    def left_in(self, state: str) -> None:
        """The call settled with the server in ``state`` (a drain the hook refused went back
        to ``serving``): ``state``, the message and the pickled fields say so."""
        self.state = state
        self._init = (self.event, self.hook, state, self.reason)
        self.args = (self._message(),)

    def _message(self) -> str:
        where = f"server left in {str(self.state)!r}"
        return f"hook {self.hook} for event {self.event!r} {self.reason} ({where})"


class WeightPushFailed(LifecycleError):
    """Some engines did not take the new weights (a built-in push: ``FromDisk``,
    ``FromTensor``, ``FromDistributed``); ``failures`` says why, by engine id. Like a push of
    the caller's own that raised, it leaves the server where it was: the update may be tried
    again, and no engine continues on what it holds until a write completes."""

    def __init__(self, strategy: str, failures: Mapping[str, str]) -> None:
        self._init = (strategy, dict(failures))
        self.strategy = strategy
        self.failures = dict(failures)
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(self.failures.items()))
        super().__init__(f"{strategy} failed on {len(self.failures)} engine(s): {detail}")


class StaleWeights(LifecycleError):
    """Engines do not report the expected weight version; generation stays paused on them."""

    def __init__(self, expected: str | None, engines: Mapping[str, str | None]) -> None:
        self._init: tuple[Any, ...] = (expected, dict(engines))
        self.expected = expected
        self.engines = dict(engines)
        found = ", ".join(f"{k} has {v!r}" for k, v in sorted(self.engines.items()))
        want = f"weight version {expected!r}" if expected is not None else "new weights"
        super().__init__(
            f"{len(self.engines)} engine(s) lack {want} ({found}); generation stays paused "
            f"until update_weights() reaches them"
        )


class WeightsNotVerified(StaleWeights):
    """After a weight write, engines do not hold what verification asked for (``core/verify``):
    they disagree with their group, still hold the weights from before the push, differ from
    the expected fingerprint, or could not be read. Each is marked stale, kept paused and out of
    the router until a write reaches it; ``problems`` says why, by engine id, and ``tensors``
    names the tensors that differ (empty when none can be named)."""

    def __init__(
        self,
        version: str | None,
        problems: Mapping[str, str],
        tensors: Mapping[str, Iterable[str]],
    ) -> None:
        self._init = (version, dict(problems), {k: tuple(v) for k, v in tensors.items()})
        self.version = version
        self.problems = dict(problems)
        self.tensors = {k: tuple(v) for k, v in tensors.items()}
        self.expected = version
        self.engines = {k: version for k in self.problems}
        detail = "; ".join(
            f"{k} {why}{_tensor_list(self.tensors.get(k, ()))}"
            for k, why in sorted(self.problems.items())
        )
        LifecycleError.__init__(
            self,
            f"weight verification failed on {len(self.problems)} engine(s): {detail}; they "
            f"stay paused and out of the router until update_weights() reaches them",
        )


def shortlist(names: Sequence[str], shown: int) -> str:
    """The first ``shown`` of ``names``, and how many more, for a message: ``a, b and 3 more``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _tensor_list(names: tuple[str, ...], shown: int = 4) -> str:
    return f" (tensors {shortlist(names, shown)})" if names else ""


class RouterError(LifecycleError):
    """The router in front of the fleet refused a worker change or could not be reached. Raised
    before an engine is paused (nothing was sent: the state is unchanged) or after engines were
    continued (they serve; ``RolloutServer.sync_router()`` puts the router right)."""

    def __init__(self, router: str, message: str, status: int | None = None) -> None:
        self._init: tuple[Any, ...] = (router, message, status)
        self.router = router
        self.message = message
        self.status = status
        super().__init__(f"router {router}: {message}")


class EngineError(LifecycleError):
    """An engine could not carry out a call."""

    def __init__(self, engine: str, op: str, message: str) -> None:
        self._init: tuple[Any, ...] = (engine, op, message)
        self.engine = engine
        self.op = op
        self.message = message
        super().__init__(f"{op} on engine {engine}: {message}")


class EngineRejected(EngineError):
    """The engine answered with an error status; it is alive and did not do the call."""

    def __init__(self, engine: str, op: str, message: str, status: int = 400) -> None:
        super().__init__(engine, op, message)
        self._init = (engine, op, message, status)
        self.status = status


class EngineDead(EngineError):
    """The engine is gone (process died, actor died, connection refused); it answers nothing."""


class EngineUnhealthy(EngineDead):
    """The engine's server answers, but not as a whole: one of its processes is gone or stuck
    (a data-parallel rank that never answers while the server's front end does). Nothing is
    sent to it; it counts as dead, and ``recover()`` replaces the whole server, never a part.

    ``ranks`` is how many ranks the server has; ``waited`` how long its state read, which
    every rank must answer, went unanswered (None from a model that knows it never will)."""

    def __init__(self, engine: str, op: str, ranks: int, waited: float | None) -> None:
        within = "" if waited is None else f" in {waited:g}s"
        super().__init__(
            engine,
            op,
            f"unhealthy: the server answers /ping, but its state read, which each of its "
            f"{ranks} data-parallel ranks must answer, gave nothing{within}: a rank's "
            f"process is gone or stuck, and the server does not bring one back. Nothing was "
            f"sent; replace the whole server (recover(), its factory stopping every process of "
            f"the old one)",
        )
        self._init = (engine, op, ranks, waited)
        self.ranks = ranks
        self.waited = waited


class EngineUnreachable(EngineError):
    """The engine could not be reached (transport error); it may or may not be alive."""


class EngineTimeout(EngineError):
    """The engine did not answer within the call's deadline; what it did is unknown."""


class EngineRestarted(EngineError):
    """The process at the engine's address is not the one the records describe (it restarted,
    or another server took its address): nothing was sent. ``found`` is its incarnation."""

    def __init__(self, engine: str, op: str, expected: str | None, found: str | None) -> None:
        super().__init__(
            engine,
            op,
            f"the engine restarted (incarnation {expected} is now {found}); nothing was sent, "
            f"and its record now describes a fresh server",
        )
        self._init = (engine, op, expected, found)
        self.expected = expected
        self.found = found


class EngineStateConflict(EngineError):
    """The engine reports a state its records do not describe (another controller may drive
    it): nothing was sent. The message names both views."""

    def __init__(self, engine: str, op: str, records: str, reported: str) -> None:
        super().__init__(
            engine,
            op,
            f"the records hold it {records}, but the engine reports {reported}; another "
            f"controller may be driving it, so nothing was sent",
        )
        self._init = (engine, op, records, reported)
        self.records = records
        self.reported = reported


class EngineFenced(EngineError):
    """The engine refused a command sent under a lease older than one it has already served
    (another controller took the fleet over: ``lease``): nothing was carried out.
    ``epoch`` is the command's lease, ``current`` the newest the engine has seen."""

    def __init__(self, engine: str, op: str, epoch: int, current: int) -> None:
        super().__init__(
            engine,
            op,
            f"fenced: sent under lease epoch {epoch}, but the engine already serves epoch "
            f"{current} (another controller took the fleet over); nothing was carried out: stop "
            f"this controller, or adopt the fleet from its journal in a new server",
        )
        self._init = (engine, op, epoch, current)
        self.epoch = epoch
        self.current = current


class LeaseLost(LifecycleError):
    """This controller's lease on its engines expired or was taken over (``lease``):
    what it was about to do was refused before anything was sent."""

    def __init__(self, what: str, epoch: int | None, detail: str) -> None:
        self._init = (what, epoch, detail)
        self.what = what
        self.epoch = epoch
        super().__init__(
            f"{what} refused: this controller's lease (epoch {epoch}) {detail}; nothing was "
            f"sent: stop this controller, or adopt the fleet from its journal in a new server"
        )


class EngineClaimed(LifecycleError):
    """Another controller drives the engine now (another process on this host, or another
    server in this one): the call was refused before anything was sent. ``holder`` says who."""

    def __init__(self, engine: str, holder: str, details: Mapping[str, Any] | None = None) -> None:
        self._init = (engine, holder, dict(details or {}))
        self.engine = engine
        self.holder = holder
        #: What the holder wrote of itself (``pid``, ``host``, ``server``, ``call``, ...).
        self.details = dict(details or {})
        super().__init__(
            f"engine {engine} is driven by another controller ({holder}); nothing was sent: "
            f"one controller drives an engine at a time"
        )
