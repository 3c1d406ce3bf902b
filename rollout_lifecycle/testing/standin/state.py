"""What every stand-in server is made of, whichever engine's routes it serves (SGLang's in
``app``, vLLM's in ``vllm_app``): the state its routes share (the simulated engine, its death,
its history file, the fault rules in force), the FastAPI app with the death watcher and the
fault middleware, the faults route, and the wait for a client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from rollout_lifecycle.contract.exceptions import EngineDead, InvalidArgument, LifecycleError
from rollout_lifecycle.testing.simulated import SimulatedEngine
from rollout_lifecycle.testing.standin.bodies import BadRequest
from rollout_lifecycle.testing.standin.faults import (
    FaultMiddleware,
    FaultRule,
    parse_fault_rules,
)

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request

T = TypeVar("T")

#: What to install when the stand-in's web stack is missing.
NEEDS = (
    "the stand-in servers need fastapi, uvicorn and uvloop: "
    "pip install 'rollout-lifecycle[standin]'"
)
_DEATH_POLL_S = 0.05


class StandInDied(LifecycleError, RuntimeError):
    """Raised by an in-process app whose engine died when no ``on_death`` ended the process."""


def check_path(what: str, value: object) -> str | None:
    """A file path (a string or ``os.PathLike``) as a string, None for None; else refuse it."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise InvalidArgument(f"{what} must be a path or None, got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"{what} must be a non-empty text path or None, got {value!r}")
    return path


class StandInState:
    """What the routes share: the engine, death handling and the history file."""

    def __init__(
        self,
        engine: SimulatedEngine,
        *,
        on_death: Callable[[], None] | None,
        history_file: str | None,
        model_path: str,
    ) -> None:
        self.engine = engine
        self.on_death = on_death
        self.history_path = None if history_file is None else Path(history_file)
        self.model_path = model_path
        self.initial_model_path = model_path
        self._written: set[tuple[str, float]] = set()
        self._death_written = False
        self._dying = False
        #: Paths of the app's routes (the paths a fault rule may name).
        self.routes: set[str] = set()
        #: Fault rules in force, first match wins; a rule leaves once its count is spent.
        self.faults: list[FaultRule] = []
        #: Every fault applied so far, as history entries (``op`` ``"fault"``).
        self.fault_log: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ faults

    def take_fault(self, path: str) -> FaultRule | None:
        """The rule the request to ``path`` meets, counted now; None when none matches."""
        for rule in self.faults:
            if rule.path == path:
                rule.take()
                if rule.count == 0:
                    self.faults.remove(rule)
                return rule
        return None

    def record_fault(self, rule: FaultRule, method: str, start: float, detail: str) -> None:
        """Log one applied fault in the history (and its file, at once)."""
        entry = {
            "op": "fault",
            "engine": self.engine.label,
            "kind": rule.kind,
            "path": rule.path,
            "method": method,
            "tags": None,
            "mode": None,
            "start": start,
            "end": time.monotonic(),
            "outcome": "injected",
            "detail": detail,
        }
        self.fault_log.append(entry)
        self._append([json.dumps(entry, sort_keys=True)])

    def history(self) -> list[dict[str, Any]]:
        """The engine's ops and the applied faults, in order of start."""
        return sorted([*self.engine.history(), *self.fault_log], key=lambda e: float(e["start"]))

    def kill(self, reason: str) -> NoReturn:
        """Kill the engine and the server as a fatal misuse does (an injected ``die``)."""
        self.engine._die(reason)
        self.die()

    def _append(self, lines: list[str]) -> None:
        if self.history_path is None or not lines:
            return
        with self.history_path.open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()

    # The file is appended as ops complete, flushed per line, so it survives os._exit.
    def sync_history(self) -> None:
        if self.history_path is None:
            return
        new = [e for e in self.engine.history() if (e["op"], e["start"]) not in self._written]
        lines = []
        for entry in sorted(new, key=lambda e: e["end"]):
            self._written.add((entry["op"], entry["start"]))
            lines.append(json.dumps(entry, default=repr, sort_keys=True))
        if self.engine.dead and not self._death_written:
            self._death_written = True
            now = time.monotonic()
            lines.append(
                json.dumps(
                    {
                        "op": "server_died",
                        "engine": self.engine.label,
                        "tags": None,
                        "mode": None,
                        "start": now,
                        "end": now,
                        "outcome": "fatal",
                        "detail": self.engine.death_reason,
                    },
                    sort_keys=True,
                )
            )
        self._append(lines)

    def die(self) -> NoReturn:
        """The engine is dead: end the process (``on_death``) so no response goes out."""
        self.sync_history()
        if self.on_death is not None and not self._dying:
            self._dying = True
            self.on_death()
        raise StandInDied(f"engine {self.engine.label} died: {self.engine.death_reason}")

    async def call(self, awaitable: Awaitable[T]) -> T:
        """Await an engine call; a death during it drops the connection instead of answering."""
        try:
            result = await awaitable
        except EngineDead:
            self.die()
        finally:
            if not self.engine.dead:
                self.sync_history()
        if self.engine.dead:
            self.die()
        return result

    async def watch(self) -> None:
        # A death with no request attached (e.g. a dummy batch on released memory) still ends it.
        with contextlib.suppress(StandInDied):
            while not self.engine.dead:  # noqa: ASYNC110 - the engine exposes no death event
                await asyncio.sleep(_DEATH_POLL_S)
            self.die()


async def wait_disconnect(request: Request) -> None:
    """Return once the client of ``request`` has gone (its ``http.disconnect``): both stand-ins
    race a generation against it, to abort a request nobody will read, as the servers do."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def fault_rules(state: StandInState, request: Request) -> dict[str, Any]:
    """The faults route of a stand-in: POST adds rules (all or none), DELETE clears them; each
    answers the rules in force."""
    if request.method == "POST":
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise BadRequest(f"JSON decode error: {exc}") from None
        state.faults.extend(parse_fault_rules(body, state.routes))
    elif request.method == "DELETE":
        state.faults.clear()
    return {"faults": [rule.to_json() for rule in state.faults]}


def standin_app(state: StandInState) -> FastAPI:
    """A stand-in's FastAPI app over ``state``: the death watcher for its lifetime, the state at
    ``app.state.standin`` and the fault middleware. The caller adds its key check after, so that
    a request passes it before it can meet an injected fault (the last added runs first)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        label = state.engine.label
        watcher = asyncio.create_task(state.watch(), name=f"standin-watch-{label}")
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    from fastapi import FastAPI  # the standin extra; create_app said so if it is missing

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.standin = state
    app.add_middleware(FaultMiddleware, state=state)
    return app


__all__ = [
    "NEEDS",
    "StandInDied",
    "StandInState",
    "check_path",
    "fault_rules",
    "standin_app",
    "wait_disconnect",
]
