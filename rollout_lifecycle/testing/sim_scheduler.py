"""The simulated engine's scheduler: the request queues and the decode loop that admits, steps
and finishes requests (what ``/generate`` runs on), and what a pause, an abort or the death of
the server does to them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from rollout_lifecycle.contract.exceptions import EngineDead, EngineRejected
from rollout_lifecycle.contract.values import PauseMode
from rollout_lifecycle.testing.sim_state import (
    FORWARD_TAGS,
    GARBAGE_TOKEN,
    VOCAB,
    SimRequest,
    SimState,
    detokenize,
    version_spans,
)


def abort_reason(message: str) -> dict[str, Any]:
    """The finish reason of an aborted request."""
    # sglang: schedule_batch.py FINISH_ABORT.to_json
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def parse_request(
    label: str, in_flight: Mapping[str, SimRequest], request: Mapping[str, Any]
) -> SimRequest:
    """The request a ``/generate`` body asks for; 400 (``EngineRejected``) for a bad one."""

    def reject(message: str) -> EngineRejected:
        return EngineRejected(label, "generate", message, 400)

    if not isinstance(request, Mapping):
        raise reject(f"request must be a JSON object, got {request!r}")
    if request.get("stream"):
        raise reject("streaming is not supported by the simulated engine")
    input_ids = request.get("input_ids")
    text = request.get("text")
    if (input_ids is None) == (text is None):
        raise reject("exactly one of 'text' or 'input_ids' must be given")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in input_ids
        ):
            raise reject(f"input_ids must be a list of token ids >= 0, got {input_ids!r}")
        prompt = list(input_ids)
    else:
        if not isinstance(text, str):
            raise reject(f"text must be a string, got {text!r}")
        prompt = list(text.encode())
    params = request.get("sampling_params") or {}
    if not isinstance(params, Mapping):
        raise reject(f"sampling_params must be an object, got {params!r}")
    max_new = params.get("max_new_tokens", 16)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise reject(f"max_new_tokens must be an int >= 0, got {max_new!r}")
    rid = request.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise reject(f"rid must be a non-empty string, got {rid!r}")
    elif rid in in_flight:
        raise reject(f"duplicate request id {rid!r}")
    future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    return SimRequest(rid=rid, prompt=prompt, max_new_tokens=max_new, future=future)


class SimScheduler:
    """The requests of one simulated server, from arrival to their answer, and the decode loop
    (a task on the loop of the engine's first caller) that runs them."""

    def __init__(self, state: SimState) -> None:
        self._state = state
        self._task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------------------- the task

    def ensure_running(self) -> None:
        """Start the decode loop on the running loop, unless it runs there or the engine is
        dead or closed."""
        state = self._state
        if state.dead or state.closed:
            return
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and task.get_loop() is loop and not task.done():
            return
        if task is None or task.get_loop() is not loop:
            # A new loop (e.g. one per test) needs its own event; the old one is bound elsewhere.
            state.changed = asyncio.Event()
        self._task = loop.create_task(self._schedule(), name=f"sim-scheduler-{state.label}")

    async def stop(self) -> None:
        """Cancel the decode loop (and wait for it, if it runs on this loop)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            if task.get_loop() is asyncio.get_running_loop():
                await asyncio.wait({task})

    def die(self, reason: str) -> None:
        """The server dies: every request in flight fails with ``EngineDead``."""
        state = self._state
        if state.dead:
            return
        state.dead = True
        state.death_reason = reason
        self.drop_all(f"connection dropped: engine died: {reason}")
        state.notify()

    def drop_all(self, message: str) -> None:
        """Fail every request in flight with ``EngineDead(message)`` and empty the queues."""
        state = self._state
        for req in state.in_flight.values():
            if not req.future.done():
                req.future.set_exception(EngineDead(state.label, "generate", message))
        state.in_flight.clear()
        state.running.clear()
        state.waiting.clear()
        state.front.clear()

    # ----------------------------------------------------------------------------- requests

    def _result(self, req: SimRequest, finish_reason: dict[str, Any]) -> dict[str, Any]:
        # sglang: output_streamer.py (spans from the scheduler's current version at finish),
        # weight_versions.py add_weight_versions_to_meta_info (weight_version = last span's)
        spans = version_spans(req.version_events, self._state.weight_version, len(req.output))
        return {
            "text": detokenize(req.output),
            "output_ids": list(req.output),
            "meta_info": {
                "id": req.rid,
                "finish_reason": finish_reason,
                "prompt_tokens": len(req.prompt),
                "completion_tokens": len(req.output),
                "cached_tokens": req.cached_tokens,
                "weight_version": spans[-1]["version"],
                "num_retractions": req.num_retractions,
                "weight_versions": spans,
            },
        }

    def _finish(self, req: SimRequest, finish_reason: dict[str, Any]) -> None:
        state = self._state
        state.in_flight.pop(req.rid, None)
        aborted = finish_reason["type"] == "abort"
        if not req.internal:
            state.counts["aborted" if aborted else "completed"] += 1
            if not aborted:
                state.prefix_cache[tuple(req.prompt)] = None
        if not req.future.done():
            req.future.set_result(self._result(req, finish_reason))

    async def abort(self, match: Callable[[SimRequest], bool], message: str) -> int:
        """Abort the scheduler's requests that ``match``; those held in the front end while
        paused are out of its reach (they reach the scheduler only after continue)."""
        # sglang: scheduler.py Scheduler.abort_request walks the waiting queue and the batches
        state = self._state
        victims = [r for r in (*state.running, *state.waiting) if match(r)]
        if not victims:
            return 0
        doomed = set(map(id, victims))
        state.running = [r for r in state.running if id(r) not in doomed]
        state.waiting = deque(r for r in state.waiting if id(r) not in doomed)
        for req in victims:
            self._finish(req, abort_reason(message))
        state.notify()
        # Let the aborted generate calls return before the control call that aborted them
        # answers, as the HTTP server sends their responses first.
        await asyncio.sleep(0)
        return len(victims)

    def discard(self, req: SimRequest) -> None:
        """Forget a request whose caller went away (SGLang aborts on a closed connection)."""
        state = self._state
        if state.in_flight.pop(req.rid, None) is None:
            return
        if req in state.running:
            state.running.remove(req)
        if req in state.waiting:
            state.waiting.remove(req)
        if req in state.front:
            state.front.remove(req)
        state.notify()

    def enqueue(self, req: SimRequest) -> None:
        """Take a request: to the scheduler's waiting queue, or held in the front end while
        paused or holding arrivals."""
        state = self._state
        state.in_flight[req.rid] = req
        if state.paused:
            state.counts["arrived_paused"] += 1
        (state.front if state.paused or state.hold_arrivals else state.waiting).append(req)
        state.notify()

    def record_version_change(self, new_version: str | None) -> None:
        """Move the scheduler's weight version; live requests remember where it changed."""
        # sglang: scheduler.py Scheduler.record_weight_version_change
        state = self._state
        if new_version is None or new_version == state.weight_version:
            return
        for req in (*state.running, *state.waiting):
            if req.output:
                req.version_events.append((state.weight_version, len(req.output)))
        state.weight_version = new_version

    async def pause(self, mode: PauseMode) -> None:
        """Pause generation: abort, retract or freeze the requests in flight."""
        state = self._state
        state.paused = True
        state.pause_mode = mode
        if mode is PauseMode.ABORT:
            # The front end aborts until nothing is in flight and answers only then.
            await self.abort(lambda _: True, "aborted by pause_generation(mode=abort)")
        elif mode is PauseMode.RETRACT:
            # Running requests give back their KV and queue up again, first in line.
            for req in reversed(state.running):
                req.num_retractions += 1
                state.waiting.appendleft(req)
            state.counts["retractions"] += len(state.running)
            state.running = []
        state.notify()

    def unpause(self) -> None:
        """Let the scheduler run again; the requests the front end held while paused go to it
        now, behind the ones it already had (unless it holds arrivals)."""
        state = self._state
        state.paused = False
        state.pause_mode = None
        self.hold_arrivals(state.hold_arrivals)

    def hold_arrivals(self, hold: bool) -> None:
        """Hold new requests in the front end (``hold``) or, unless paused, let the held ones
        go to the scheduler, behind the ones it already had."""
        state = self._state
        state.hold_arrivals = hold
        if not (hold or state.paused):
            state.waiting.extend(state.front)
            state.front.clear()
        state.notify()

    # ----------------------------------------------------------------------------- scheduler

    async def _schedule(self) -> None:
        state = self._state
        try:
            while not (state.dead or state.closed):
                if not self._may_step():
                    await state.wait_changed(None)
                    continue
                if self._forward_on_released():
                    return
                self._admit()
                await asyncio.sleep(state.token_latency)
                # Control calls may have run during the step; it lands only if it still may, so
                # a pause that arrives mid-step discards it: no token is produced while paused.
                if state.dead or state.closed or not self._may_step():
                    continue
                if self._forward_on_released():
                    return
                if state.running:
                    self._decode_step()
                elif state.dp_dummy_batches:
                    state.counts["dummy_steps"] += 1
                state.notify()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the simulation must not hang callers
            self.die(f"simulated scheduler crashed: {exc!r}")

    def _may_step(self) -> bool:
        # An idle data-parallel rank still runs dummy batches to keep its peers in lockstep.
        state = self._state
        work = state.running or state.waiting or state.dp_dummy_batches
        return not state.paused and bool(work)

    def _forward_on_released(self) -> bool:
        """Kill the engine if the forward pass about to run would touch released memory."""
        state = self._state
        if state.forward_fault is not None:
            self.die(f"a forward pass ran on unusable weights: {state.forward_fault}")
            return True
        released = [t for t in FORWARD_TAGS if t in state.released]
        if not released:
            return False
        # Nothing in SGLang stops a forward pass on unmapped memory.
        what = "a forward pass" if state.running or state.waiting else "a data-parallel dummy batch"
        self.die(
            f"illegal memory access: {what} ran while {', '.join(released)} released and "
            "generation not paused"
        )
        return True

    def _admit(self) -> None:
        state = self._state
        while state.waiting and len(state.running) < state.max_running:
            req = state.waiting.popleft()
            if tuple(req.prompt) in state.prefix_cache:
                req.cached_tokens = len(req.prompt)
                state.counts["prefix_hits"] += 1
            state.running.append(req)
            state.counts["prefills"] += 1

    def _decode_step(self) -> None:
        state = self._state
        state.counts["steps"] += 1
        still: list[SimRequest] = []
        done: list[SimRequest] = []
        for req in state.running:
            if len(req.output) < req.max_new_tokens:
                if state.weights_valid:
                    token = (req.key + 7919 * (len(req.output) + 1)) % VOCAB
                else:
                    token = GARBAGE_TOKEN
                    req.on_garbage = True
                    state.counts["garbage_tokens"] += 1
                req.output.append(token)
                state.counts["tokens"] += 1
            (done if len(req.output) >= req.max_new_tokens else still).append(req)
        state.running = still
        for req in done:
            # sglang: schedule_batch.py FINISH_LENGTH.to_json
            self._finish(req, {"type": "length", "length": req.max_new_tokens})

    # ----------------------------------------------------------------------------- generation

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run ``request`` to completion, or to an early finish with reason abort."""
        state = self._state
        state.check_alive("generate")
        self.ensure_running()
        req = parse_request(state.label, state.in_flight, request)
        state.counts["submitted"] += 1
        self.enqueue(req)
        try:
            return await req.future
        except asyncio.CancelledError:
            self.discard(req)
            raise
