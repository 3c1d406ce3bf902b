"""Routing and holding for the generation client: which engine serves a request, and waiting
while none does.

``Router.acquire`` picks a serving engine (``Fleet.serves``: alive, unpaused, all memory
resident, with the fleet's weights, in a group the server's state lets serve, as the router
binding registers them; and not seen dying by this client, nor half of a prefill/decode pair,
which only a router in that mode can serve; the fewest requests outstanding first), and holds
the request while there is none, waking at every state change and phase end, until
``hold_timeout`` or the request's deadline. A request whose every possible engine is dead, or
a prefill/decode half, fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rollout_lifecycle.core.bus import Bus
from rollout_lifecycle.core.ledger import EngineRecord, EngineState, Fleet, GroupRecords, may_serve
from rollout_lifecycle.core.requests import (
    GenerationError,
    GenerationTimeout,
    NoLiveEngine,
    Request,
)
from rollout_lifecycle.core.states import ServerState


class ServerView(Protocol):
    """What a generation client reads of the server it sends through (a ``RolloutServer``):
    its records and state, and its events (``core/bus``)."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> ServerState: ...

    @property
    def groups(self) -> Sequence[GroupRecords]: ...

    @property
    def fleet(self) -> Fleet: ...

    @property
    def expected_version(self) -> str | None: ...

    @property
    def bus(self) -> Bus: ...


class Router:
    """The engine choice and the holding of one generation client."""

    def __init__(
        self,
        server: ServerView,
        counts: dict[str, int],
        hold_timeout: float,
        request_timeout: float,
        recheck: Callable[[], float],
    ) -> None:
        self._server = server
        self._counts = counts
        self._hold_timeout = hold_timeout
        self._request_timeout = request_timeout
        self._recheck = recheck
        #: Requests of the client at each engine now, by engine id.
        self.outstanding: dict[str, int] = {}
        #: Engine id -> the handle and incarnation the client saw die in that slot (a
        #: replacement is not dead, nor is a new process restarted at the same address).
        self.dead: dict[str, tuple[Any, str | None]] = {}
        #: Requests waiting for a serving engine now.
        self.holding = 0
        self._wake: asyncio.Event | None = None
        self._wake_loop: asyncio.AbstractEventLoop | None = None

    def _group_may_serve(self, group: GroupRecords, state: ServerState) -> bool:
        return may_serve(state, group.needs_offload)

    def _engine_serves(self, record: EngineRecord, state: ServerState) -> bool:
        return (
            self._server.fleet.serves(record, state)
            and not self.seen_dead(record)
            and not _half(record)
        )

    def pick(self, work: Request) -> EngineRecord | None:
        state = self._server.state
        candidates = [
            r
            for g in self._server.groups
            if work.group in (None, g.name)
            for r in g.records
            if self._engine_serves(r, state)
        ]
        if not candidates:
            return None
        preferred = [r for r in candidates if r.id not in work.avoid] or candidates
        return min(preferred, key=lambda r: self.outstanding.get(r.id, 0))

    async def acquire(self, work: Request, deadline: float) -> EngineRecord:
        """A serving engine for ``work``; waits (holds) while there is none."""
        clock = asyncio.get_running_loop().time  # the clock of ``deadline`` and of the waits
        start = clock()
        held = False
        try:
            while True:
                wake = self._event()
                record = self.pick(work)
                if record is not None:
                    return record
                self._check_alive(work)
                self._check_direct(work)
                now = clock()
                waited = now - start
                if now >= deadline:
                    limit, bound = "request_timeout", self._request_timeout
                elif waited >= self._hold_timeout:
                    limit, bound = "hold_timeout", self._hold_timeout
                else:
                    if not held:
                        held = True
                        self.holding += 1
                        self._counts["held"] += 1
                    pause = min(self._hold_timeout - waited, deadline - now, self._recheck())
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), pause)
                    continue
                state = self._server.state.value
                message = (
                    f"generate request held {waited:.3g}s ({limit}={bound:g}s) with no engine "
                    f"to serve it: {self._why_held(work)}"
                )
                raise GenerationTimeout(
                    message,
                    state,
                    limit,
                    waited,
                    work.compose(None, message) if work.engines else None,
                )
        finally:
            if held:
                self.holding -= 1

    def saw_die(self, engine: str, handle: Any, incarnation: str | None) -> None:
        """Remember that a request of this client lost an engine (the process ``handle`` and
        ``incarnation`` name, in slot ``engine``) to its death."""
        self.dead[engine] = (handle, incarnation)

    def seen_dead(self, record: EngineRecord) -> bool:
        """Whether this client saw the process ``record`` describes die under a request."""
        seen = self.dead.get(record.id)
        return seen is not None and seen[0] is record.handle and seen[1] == record.incarnation

    def _engine_dead(self, record: EngineRecord) -> bool:
        """Dead for good: recorded dead by the server, or seen dying by this client (the same
        handle; a replacement in its slot is another engine)."""
        return not record.alive or self.seen_dead(record)

    def _groups_of(self, work: Request) -> list[GroupRecords]:
        """The groups that could serve ``work`` (its group, or all)."""
        return [g for g in self._server.groups if work.group in (None, g.name)]

    def _check_alive(self, work: Request) -> None:
        """Fail ``work`` at once when every engine that could ever serve it is dead."""
        records = [r for g in self._groups_of(work) for r in g.records]
        if not all(self._engine_dead(r) for r in records):
            return
        where = f"group {work.group!r}" if work.group is not None else "any group"
        dead = ", ".join(r.id for r in records) or "none"
        message = (
            f"no engine of {where} is alive to serve the generate request (dead: {dead}; "
            f"server {self._server.state.value!r})"
        )
        if work.engines:
            message += f"; {work.produced} token(s) produced so far are in .partial"
        raise NoLiveEngine(
            message,
            self._server.state.value,
            work.group,
            work.compose(None, message) if work.engines else None,
        )

    def _check_direct(self, work: Request) -> None:
        """Refuse ``work`` at once when every engine that could serve it is a half of a
        prefill/decode pair: such a request needs a prefill and a decode server together, as a
        router in prefill/decode mode sends it, and this client sends to one engine."""
        records = [r for g in self._groups_of(work) for r in g.records]
        if not records or not all(_half(r) for r in records):
            return
        where = f"group {work.group!r}" if work.group is not None else "any group"
        halves = ", ".join(
            f"{r.id} {r.capabilities.worker_type}" for r in records if r.capabilities
        )
        raise GenerationError(
            f"every engine of {where} is half of a prefill/decode pair ({halves}): send its "
            f"requests through sglang-router in prefill/decode mode, which pairs the halves"
        )

    def _why_held(self, work: Request) -> str:
        state = self._server.state
        groups = self._groups_of(work)
        where = f"group {work.group!r}" if work.group is not None else "any group"
        if not any(self._group_may_serve(g, state) for g in groups):
            return f"the server is {state.value!r} ({where} does not serve in that state)"
        expected = self._server.expected_version
        lacks = (
            "is a fresh server no weight update has reached"
            if expected is None
            else f"lacks weight version {expected!r}"
        )
        why = {
            EngineState.DEAD: "dead",
            EngineState.UNCERTAIN: "holds released memory",
            EngineState.RELEASED: "holds released memory",
            EngineState.STALE: lacks,
            EngineState.WAITING: lacks,
            EngineState.KV_ASLEEP: "paused, its KV cache asleep until the continue",
            EngineState.PAUSED: "paused",
            EngineState.DRAINED: "paused",
        }
        notes = []
        for g in groups:
            for r in g.records:
                engine = r.state
                if engine is not EngineState.DEAD and self.seen_dead(r):
                    notes.append(f"{r.id} died under a request")
                elif _half(r):
                    notes.append(f"{r.id} is a prefill/decode half, served through a router")
                elif engine in why:
                    notes.append(f"{r.id} {why[engine]}")
        return f"the server is {state.value!r} and no engine of {where} serves ({', '.join(notes)})"

    def _event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._wake is None or self._wake_loop is not loop:
            self._wake, self._wake_loop = asyncio.Event(), loop
        return self._wake

    def notify(self) -> None:
        wake, self._wake = self._wake, None
        if wake is None:
            return
        try:
            same_loop = asyncio.get_running_loop() is self._wake_loop
        except RuntimeError:
            same_loop = False
        if same_loop:
            wake.set()  # waiters of another (finished) loop are gone; theirs is just dropped


def _half(record: EngineRecord) -> bool:
    """Whether ``record``'s server is one half of a prefill/decode pair (as its driver
    declared with its incarnation): a request sent to it alone cannot be served."""
    caps = record.capabilities
    return caps is not None and caps.half


__all__ = ["Router"]
