"""Fault injection for tests of code built on the library: ``FaultyEngine`` wraps an engine
backend and rejects, delays, kills or loses the answers of its lifecycle calls on demand."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout_lifecycle.backends.engine import CHECKING, EngineBackend, introspect
from rollout_lifecycle.contract.capabilities import Capabilities, capabilities_of
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    InvalidArgument,
)
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.values import Tag, check_int, check_seconds

T = TypeVar("T")

#: What an armed fault does to a call.
FAULT_KINDS: tuple[str, ...] = ("reject", "slow", "die", "drop_after")

#: The calls a fault can be armed on, and that ``FaultyEngine.calls`` records: every call of
#: the backend protocol but ``generate`` (passed through) and ``close``.
FAULT_OPS: tuple[str, ...] = tuple(
    op.value
    for op in (
        Op.PAUSE,
        Op.CONTINUE,
        Op.FLUSH,
        Op.RELEASE,
        Op.RESUME,
        Op.BEGIN_UPDATE,
        Op.END_UPDATE,
        Op.UPDATE_FROM_DISK,
        Op.UPDATE_FROM_TENSOR,
        Op.UPDATE_FROM_DISTRIBUTED,
        Op.INIT_UPDATE_GROUP,
        Op.DESTROY_UPDATE_GROUP,
        Op.SET_VERSION,
        Op.WEIGHT_VERSION,
        Op.FINGERPRINT,
        Op.SERVER_INFO,
        Op.ABORT,
    )
)
#: The probes of whether the engine is paused (``EngineHost.observe``): forwarded, logged and
#: armable as the calls above, and answered False (cannot tell) for an inner engine without them.
#: (The wrapper offers no ``observe`` of its own: an engine host reads it through
#: ``server_info``, ``ping`` and ``ready``, SGLang's routes, so faults armed on them apply.)
PROBE_OPS: tuple[str, ...] = ("ping", "ready")
#: The calls whose first argument is the memory tags (recorded in ``calls``).
_TAGGED_OPS = frozenset({Op.RELEASE.value, Op.RESUME.value})


@dataclass
class _Armed:
    kind: str
    remaining: int
    seconds: float


def _tag_values(tags: Sequence[Tag | str] | None) -> list[str] | None:
    if tags is None or isinstance(tags, str):
        return None
    return [t.value if isinstance(t, Tag) else str(t) for t in tags]


class FaultyEngine:
    """An ``EngineBackend`` that forwards to ``inner`` and injects the faults it is armed with.

    Kinds (``arm(op, kind)``): ``"reject"`` answers 503 without calling ``inner``; ``"slow"``
    sleeps ``seconds`` and then calls ``inner`` (a call that misses its deadline and still
    lands); ``"die"`` kills the engine: this and every later call raise ``EngineDead`` and
    ``inner`` is closed, so its in-flight generates fail with ``EngineDead``; ``"drop_after"``
    calls ``inner`` and then raises ``EngineUnreachable`` (the effect landed, the answer was
    lost). Every lifecycle call is logged in ``calls``.
    """

    def __init__(self, inner: EngineBackend, *, label: str | None = None) -> None:
        if not isinstance(inner, EngineBackend):
            raise InvalidArgument(f"inner must be an engine backend, got {inner!r}")
        if label is not None and (not isinstance(label, str) or not label):
            raise InvalidArgument(f"label must be a non-empty string or None, got {label!r}")
        self._inner = inner
        self._label = label
        self._armed: dict[str, deque[_Armed]] = {}
        self._in_flight = 0
        self._dead = False
        #: One entry per lifecycle call forwarded or failed, in order of start: ``op``,
        #: ``start``, ``end`` (None while in flight), ``outcome`` (``pending``, ``ok``,
        #: ``rejected``, ``dead``, ``unreachable``, ``timed_out``, ``cancelled`` or ``error``),
        #: ``tags`` (release and resume), ``injected`` (the fault kind, or None) and ``landed``
        #: (``inner`` carried the call out).
        self.calls: list[dict[str, Any]] = []
        #: When ``close()`` was first called (the owner retired the engine), else None.
        self.closed_at: float | None = None
        #: When a ``"die"`` fault killed the engine, else None.
        self.died_at: float | None = None

    def __repr__(self) -> str:
        return f"FaultyEngine({self.label!r}, dead={self._dead}, in_flight={self._in_flight})"

    # -- fault control ------------------------------------------------------------------------

    def arm(self, op: str, kind: str, *, count: int = 1, seconds: float = 0.0) -> None:
        """Make the next ``count`` calls of ``op`` fail as ``kind`` (after those armed before)."""
        if not isinstance(op, str) or op not in FAULT_OPS + PROBE_OPS:
            valid = ", ".join(FAULT_OPS + PROBE_OPS)
            raise InvalidArgument(f"unknown op {op!r}; valid: {valid}")
        if not isinstance(kind, str) or kind not in FAULT_KINDS:
            raise InvalidArgument(f"unknown fault kind {kind!r}; valid: {', '.join(FAULT_KINDS)}")
        check_int("count", count, minimum=1)
        seconds = check_seconds("seconds", seconds, positive=False)
        if kind == "slow" and seconds <= 0:
            raise InvalidArgument(f"a 'slow' fault needs seconds > 0, got {seconds!r}")
        if kind != "slow" and seconds:
            raise InvalidArgument(f"seconds only applies to kind 'slow', got {seconds!r}")
        self._armed.setdefault(op, deque()).append(_Armed(kind, count, float(seconds)))

    def disarm(self) -> None:
        """Forget every armed fault (an injected death stays)."""
        self._armed.clear()

    def _take(self, op: str) -> _Armed | None:
        queue = self._armed.get(op)
        if not queue:
            return None
        armed = queue[0]
        armed.remaining -= 1
        if armed.remaining <= 0:
            queue.popleft()
        return armed

    # -- inspection ---------------------------------------------------------------------------

    @property
    def label(self) -> str:
        """The given label, else the inner engine's."""
        return self._label if self._label is not None else self._inner.label

    @property
    def capabilities(self) -> Capabilities:
        """What the inner engine's driver declares."""
        return capabilities_of(self._inner)

    @property
    def inner(self) -> EngineBackend:
        """The wrapped backend."""
        return self._inner

    @property
    def url(self) -> str | None:
        """The wrapped backend's server URL, if it has one (a router's worker URL)."""
        url = getattr(self._inner, "url", None)
        return url if isinstance(url, str) else None

    @property
    def in_flight(self) -> int:
        """Lifecycle calls that have started and not returned (sleeping ``slow`` ones included)."""
        return self._in_flight

    @property
    def injected_death(self) -> bool:
        """True once a ``"die"`` fault has killed the engine."""
        return self._dead

    # -- the wrapper ----------------------------------------------------------------------------

    async def _kill(self) -> None:
        if not self._dead:
            self.died_at = time.monotonic()
        self._dead = True
        close = getattr(self._inner, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()

    def _dead_error(self, op: str) -> EngineDead:
        return EngineDead(self.label, op, "connection refused: engine died (injected fault)")

    async def _call(
        self,
        op: str,
        invoke: Callable[[], Awaitable[T]],
        *,
        tags: Sequence[Tag | str] | None = None,
    ) -> T:
        entry: dict[str, Any] = {
            "op": op,
            "start": time.monotonic(),
            "end": None,
            "outcome": "pending",
            "tags": _tag_values(tags),
            "injected": None,
            "landed": False,
        }
        check = CHECKING.get()
        if check is not None:  # a read the engine host makes to check the engine
            entry["check_of"] = check
        self.calls.append(entry)
        self._in_flight += 1
        try:
            if self._dead:
                entry["injected"] = "die"
                raise self._dead_error(op)
            armed = self._take(op)
            kind = armed.kind if armed is not None else None
            entry["injected"] = kind
            if kind == "reject":
                raise EngineRejected(self.label, op, "injected fault: service unavailable", 503)
            if kind == "die":
                await self._kill()
                raise EngineDead(self.label, op, "connection dropped: engine died (injected fault)")
            if armed is not None and kind == "slow":
                await asyncio.sleep(armed.seconds)
                if self._dead:
                    raise self._dead_error(op)
            result = await invoke()
            entry["landed"] = True
            if kind == "drop_after":
                raise EngineUnreachable(
                    self.label, op, "injected fault: connection lost after the call landed"
                )
            entry["outcome"] = "ok"
            return result
        except EngineRejected:
            entry["outcome"] = "rejected"
            raise
        except EngineDead:
            entry["outcome"] = "dead"
            raise
        except EngineUnreachable:
            entry["outcome"] = "unreachable"
            raise
        except EngineTimeout:
            entry["outcome"] = "timed_out"
            raise
        except asyncio.CancelledError:
            entry["outcome"] = "cancelled"
            raise
        except BaseException:
            entry["outcome"] = "error"
            raise
        finally:
            entry["end"] = time.monotonic()
            self._in_flight -= 1

    # -- EngineBackend ----------------------------------------------------------------------------

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``, passed through (``EngineDead`` once a fault killed the engine)."""
        if self._dead:
            raise self._dead_error("generate")
        return await self._inner.generate(request)

    async def ping(self) -> bool:
        """``GET /ping``, through the armed faults (False for an inner engine without it)."""
        return await self._probe("ping")

    async def ready(self) -> bool:
        """``GET /ready``, through the armed faults (False for an inner engine without it)."""
        return await self._probe("ready")

    async def _probe(self, op: str) -> bool:
        method: Callable[[], Awaitable[bool]] | None = getattr(self._inner, op, None)
        if method is None:
            return False
        return await self._call(op, method)

    async def close(self) -> None:
        """Close ``inner``."""
        if self.closed_at is None:
            self.closed_at = time.monotonic()
        await self._inner.close()

    # -- what the simulated engine offers tests -------------------------------------------------

    def history(self) -> list[dict[str, Any]]:
        """The inner engine's own op history (``[]`` if it keeps none)."""
        result: list[dict[str, Any]] = introspect(self._inner, "history", [])
        return result

    def memory(self) -> dict[str, int]:
        """The inner engine's resident bytes per tag (``{}`` if it does not account memory)."""
        result: dict[str, int] = introspect(self._inner, "memory", {})
        return result

    def state(self) -> dict[str, Any]:
        """The inner engine's own state (``{}`` if it publishes none)."""
        result: dict[str, Any] = introspect(self._inner, "state", {})
        return result


class NotIdleYet(FaultyEngine):
    """A ``FaultyEngine`` whose first ``busy`` flushes are answered as SGLang 0.5.23 answers a
    flush while requests remain (400 "not idle yet": ``Scheduler.flush_cache`` refuses when
    not ``is_fully_idle``), without reaching ``inner``; the flush after them goes through."""

    def __init__(self, inner: EngineBackend, busy: int) -> None:
        super().__init__(inner)
        self.busy = check_int("busy", busy, minimum=0)

    async def flush_cache(self, timeout: float) -> None:
        if self.busy:
            self.busy -= 1
            raise EngineRejected(self.label, "flush_cache", "engine not idle", 400)
        await super().flush_cache(timeout)  # type: ignore[misc]  # (declared from FAULT_OPS)


def _forwarded(name: str) -> Callable[..., Awaitable[Any]]:
    """``FaultyEngine``'s method for the backend call ``name``: forwarded to ``inner`` through
    the armed faults, with the same arguments; a call ``inner`` does not offer is answered 501,
    as ``EngineHost`` answers it."""
    tagged = name in _TAGGED_OPS

    async def call(self: FaultyEngine, *args: Any, **kwargs: Any) -> Any:
        method: Callable[..., Awaitable[Any]] | None = getattr(self.inner, name, None)
        if method is None:
            raise EngineRejected(
                self.label, name, f"{type(self.inner).__name__} does not support it", 501
            )
        tags = (args[0] if args else kwargs.get("tags")) if tagged else None
        return await self._call(name, lambda: method(*args, **kwargs), tags=tags)

    call.__name__ = name
    call.__qualname__ = f"FaultyEngine.{name}"
    call.__doc__ = f"``{name}``, through the armed faults."
    return call


# One method per call of the backend protocol, declared from FAULT_OPS rather than by hand (a
# subclass may override one and call ``super()``'s).
for _name in FAULT_OPS:
    setattr(FaultyEngine, _name, _forwarded(_name))


__all__ = ["FAULT_KINDS", "FAULT_OPS", "PROBE_OPS", "FaultyEngine", "NotIdleYet"]
