"""What a server records of its calls and phases: the metrics dict, the slowest engines, the
timeline, the call events, and (optionally) the resident memory before and after each call.

``Recorder`` observes the serializer (each public call's start and end) and the phase runner
(each settled ``PhaseResult``); the server reads its ``metrics``, ``slowest`` and ``timeline``.
It publishes each call's end on the server's bus (``CallEnded``), for what watches the server
from outside (``rollout_lifecycle.metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.contract.commands import EngineCommand, ReadMemory
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import EngineClaimed
from rollout_lifecycle.core.bus import Bus, CallEnded
from rollout_lifecycle.core.config import LifecycleConfig
from rollout_lifecycle.core.ledger import EngineRecord, Fleet
from rollout_lifecycle.core.runner import PhaseResult
from rollout_lifecycle.core.scope import Operation, current
from rollout_lifecycle.core.states import Phase, ServerState
from rollout_lifecycle.core.timeline import CallRecord, Timeline

#: The read of the memory metrics.
_MEMORY = ReadMemory()


class Recorder:
    """The metrics and timeline of one server."""

    def __init__(
        self,
        server: object,
        name: str,
        config: LifecycleConfig,
        fleet: Fleet,
        state: Callable[[], ServerState],
        ask: Callable[[EngineCommand, Sequence[EngineRecord], float], Awaitable[dict[str, Any]]],
        bus: Bus,
    ) -> None:
        self._server = server
        self._bus = bus
        self._name = name
        self._config = config
        self._fleet = fleet
        self._state = state
        self._ask = ask
        self.metrics: dict[str, float] = {}
        #: The engine behind each ``..._slowest_s`` metric of the last call of each kind.
        self.slowest: dict[str, str] = {}
        self.timeline = Timeline(config.timeline_calls, name=name)
        #: The public call in progress, as the timeline records it, and the slowest engine of
        #: each of its phases (set under the lock, so one at a time).
        self._trace: CallRecord | None = None
        self._call_slowest: dict[str, str] = {}
        self._start = 0.0
        self._memory_before: dict[str, int] = {}

    # -- calls (the serializer's observer) ------------------------------------------------------

    async def begin(self, op: Operation) -> None:
        """A public call starts under the lock."""
        memory = self._config.memory_metrics
        self._memory_before = await self._resident_bytes() if memory else {}
        self._start = time.monotonic()
        self._trace = self.timeline.begin_call(op.call, self._start)
        self._call_slowest = {}
        logger().info("call.start", server=self._name, call=op.call, state=self._state().value)

    async def end(self, op: Operation, outcome: str) -> None:
        """A public call ended; a call that succeeded updates the metrics."""
        end = time.monotonic()
        total = end - self._start
        op.metrics[f"lifecycle/{op.call}/total_s"] = total
        Timeline.end_call(self._trace, end, outcome)
        self._trace = None
        logger().info(
            "call.end",
            server=self._name,
            call=op.call,
            state=self._state().value,
            outcome=outcome,
            duration_s=round(total, 6),
        )
        self._bus.publish(CallEnded(op.call, outcome, total))
        if outcome != "ok":
            return
        if self._config.memory_metrics:
            after = await self._resident_bytes()
            for when, found in (("before", self._memory_before), ("after", after)):
                for tag, nbytes in found.items():
                    op.metrics[f"lifecycle/{op.call}/{tag}_bytes_{when}"] = nbytes
        self.metrics.update(op.metrics)
        self.slowest.update(self._call_slowest)

    def refused(self, op: Operation, error: EngineClaimed) -> None:
        """A call refused before it began: another controller holds one of its engines."""
        logger().info(
            "call.claimed", server=self._name, call=op.call, engine=error.engine, by=error.holder
        )
        self._bus.publish(CallEnded(op.call, "claimed", 0.0))

    # -- phases (the runner's observer) ---------------------------------------------------------

    def phase(self, result: PhaseResult) -> None:
        """Add a phase to the metrics of the call in progress and its spans to the timeline.

        A phase outside any call (``probe()``) is a call of its own on the timeline.
        """
        phase, seconds, begin = result.phase, result.seconds, result.start
        found = current(self._server)
        state = self._state().value
        if found is None:
            trace = self.timeline.begin_call(phase, begin)
            if trace is not None:
                Timeline.add_phase(trace, phase, phase, state, begin, begin + seconds, result.spans)
                Timeline.end_call(trace, begin + seconds, "ok")
            return
        op = found[0]
        prefix = f"lifecycle/{op.call}/{Phase(phase).metric}"
        metrics = op.metrics
        metrics[prefix + "_s"] = metrics.get(prefix + "_s", 0.0) + seconds
        if result.slowest is not None:
            key = prefix + "_slowest_s"
            if result.slowest[1] >= metrics.get(key, -1.0):
                metrics[key] = result.slowest[1]
                self._call_slowest[key] = result.slowest[0]
        if result.retries is not None:
            key = prefix + "_retries"
            metrics[key] = metrics.get(key, 0) + result.retries
        if self._trace is not None:
            Timeline.add_phase(
                self._trace, phase, op.call, state, begin, begin + seconds, result.spans
            )

    async def _resident_bytes(self) -> dict[str, int]:
        """Resident bytes per memory tag, summed over the live engines that account memory
        (``EngineHost.memory``); an engine that does not answer within the probe deadline, or
        answers nothing, is left out. A read beside the lifecycle (``PhaseRunner.ask``): no
        engine's record changes."""
        found = await self._ask(_MEMORY, self._fleet.live(), self._config.deadlines.probe)
        totals: dict[str, int] = {}
        for answer in found.values():
            if isinstance(answer, Mapping):
                for tag, nbytes in answer.items():
                    if isinstance(tag, str) and type(nbytes) is int:
                        totals[tag] = totals.get(tag, 0) + nbytes
        return totals


__all__ = ["Recorder"]
