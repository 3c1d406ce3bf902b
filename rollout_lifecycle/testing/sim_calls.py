"""How the simulated engine takes a control call: a history entry, the refusal of a dead or
closed server, the call's latency, the dropped connection of a server that restarted meanwhile,
and the outcome written back; and the death a fatal misuse causes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from rollout_lifecycle.contract.exceptions import EngineDead, EngineRejected, EngineUnreachable
from rollout_lifecycle.testing.sim_scheduler import SimScheduler
from rollout_lifecycle.testing.sim_state import SimState

#: The calls a server's front end answers by itself, without waiting for its data-parallel
#: ranks (sglang: http_server.py ping -> is_healthy, ready -> is_ready, model_info -> the
#: tokenizer manager's config; tokenizer_manager.py abort_request sends to the schedulers and
#: answers, and pause_generation in abort mode is such aborts until no weight update runs): a
#: server that lost a rank still answers them.
FRONT_END_OPS = frozenset({"ping", "ready", "weight_version", "abort_request"})


#: The fields of a call that has none.
_NO_FIELDS: dict[str, Any] = {}


def waits_for_ranks(op: str, fields: dict[str, Any]) -> bool:
    """Whether the call ``op`` (with ``fields``) waits for every data-parallel rank."""
    return op not in FRONT_END_OPS and not (
        op == "pause_generation" and fields.get("mode") == "abort"
    )


class SimCalls:
    """The front end of one simulated server's control calls (``op``, ``fatal``)."""

    def __init__(self, state: SimState, scheduler: SimScheduler) -> None:
        self._state = state
        self._scheduler = scheduler

    def _draw_latency(self, op: str) -> float:
        value = self._state.op_latency.get(op, 0.0)
        if isinstance(value, tuple):
            return self._state.rng.uniform(value[0], value[1])
        return value

    def answers_at_once(self, op: str) -> bool:
        """Whether ``op`` takes no time (no latency set for it): ``at_once`` may take it."""
        return not self._state.op_latency.get(op)

    def _start(self, op: str, purpose: str | None = None, **fields: Any) -> dict[str, Any]:
        """Record the call ``op`` starting now, with ``fields``; a dead or closed server refuses
        the connection at once, with no latency and no effect: recorded ``dead``,
        ``EngineDead``."""
        entry = self._entry(op, purpose, fields)
        self._scheduler.ensure_running()
        return entry

    def _entry(self, op: str, purpose: str | None, fields: dict[str, Any]) -> dict[str, Any]:
        """``_start`` without starting the decode loop."""
        state = self._state
        entry = state.record(op, purpose, **fields)
        try:
            state.check_alive(op)
        except EngineDead as exc:
            entry["outcome"], entry["detail"], entry["end"] = "dead", exc.message, time.monotonic()
            raise
        return entry

    def at_once(self, op: str, purpose: str | None = None) -> dict[str, Any]:
        """Take the call ``op`` that takes no time (``answers_at_once``) as ``op`` does a body
        that cannot fail: recorded, refused by a dead or closed server (``EngineDead``), else
        answered now. A read made thousands of times per phase (the checks' ``observe``) costs
        the fleet no coroutine of its own, and starts no decode loop: it reads the state, which
        the loop does not need to move for it."""
        entry = self._entry(op, purpose, _NO_FIELDS)
        entry["outcome"], entry["end"] = "ok", time.monotonic()
        return entry

    @contextlib.asynccontextmanager
    async def op(
        self, op: str, purpose: str | None = None, **fields: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Run the body as the call ``op``, recorded in the history with ``fields`` (and, for a
        read that checks the engine, its ``purpose``: ``SimState.record``)."""
        state = self._state
        entry = self._start(op, purpose, **fields)
        process = state.process
        try:
            delay = self._draw_latency(op)
            if delay > 0:
                await asyncio.sleep(delay)
                state.check_alive(op)
                if state.process != process:
                    # the process that took the call is gone: its connection dropped
                    raise EngineUnreachable(
                        state.label, op, "connection dropped: the server restarted"
                    )
            if state.slow_ranks and waits_for_ranks(op, fields):
                # the front end answers once the slowest rank has
                slowest = max(state.slow_ranks, key=state.slow_ranks.__getitem__)
                entry["detail"] = f"waits for slow rank {slowest}"
                await asyncio.sleep(state.slow_ranks[slowest])
                state.check_alive(op)
            if state.lost_ranks and waits_for_ranks(op, fields):
                # the front end waits for every rank's answer, and one rank never answers
                # (sglang: communicator.py FanOutCommunicator; nothing times it out)
                entry["detail"] = f"waits for lost rank(s) {sorted(state.lost_ranks)}"
                await asyncio.get_running_loop().create_future()
            yield entry
        except EngineRejected as exc:
            entry["outcome"] = "rejected"
            entry["detail"] = exc.message
            entry["status"] = exc.status
            raise
        except EngineDead as exc:
            if entry["outcome"] != "fatal":
                entry["outcome"] = "dead"
            entry["detail"] = exc.message
            raise
        except EngineUnreachable as exc:
            entry["outcome"] = "unreachable"
            entry["detail"] = exc.message
            raise
        except asyncio.CancelledError:
            entry["outcome"] = "cancelled"
            raise
        except BaseException as exc:
            entry["outcome"] = "error"
            entry["detail"] = repr(exc)
            raise
        else:
            entry["outcome"] = "ok"
        finally:
            entry["end"] = time.monotonic()

    def fatal(self, entry: dict[str, Any], reason: str) -> EngineDead:
        """Kill the engine because of the call ``entry`` records; return the error it raises."""
        self._scheduler.die(reason)
        entry["outcome"] = "fatal"
        return EngineDead(self._state.label, entry["op"], f"connection dropped: {reason}")
