"""The simulated engine's machinery and scheduler: recorded ops, deaths, aborts, and the decode
loop that admits, steps and finishes requests (what ``/generate`` runs on).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.backends.engine import CHECKING
from rollout_lifecycle.contract.exceptions import EngineDead, EngineRejected, EngineUnreachable
from rollout_lifecycle.contract.values import ALL_TAGS, Tag
from rollout_lifecycle.testing.sim_state import (
    FORWARD_TAGS,
    GARBAGE_TOKEN,
    HISTORY_CHUNK,
    VOCAB,
    SimRequest,
    SimState,
    detokenize,
    version_spans,
)


class SimScheduler(SimState):
    """Op recording, fatal misuse, the request queues and the decode loop."""

    # ----------------------------------------------------------------------------- machinery

    def _ensure_scheduler(self) -> None:
        if self._dead or self._closed:
            return
        loop = asyncio.get_running_loop()
        task = self._scheduler
        if task is not None and task.get_loop() is loop and not task.done():
            return
        if task is None or task.get_loop() is not loop:
            # A new loop (e.g. one per test) needs its own event; the old one is bound elsewhere.
            self._changed = asyncio.Event()
        self._scheduler = loop.create_task(self._schedule(), name=f"sim-scheduler-{self._label}")

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _wait_changed(self, timeout: float | None) -> bool:
        event = self._changed
        if event is None:
            event = self._changed = asyncio.Event()
        if timeout is None:
            await event.wait()
            return True
        if timeout <= 0:
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _check_alive(self, op: str) -> None:
        if self._dead:
            raise EngineDead(self._label, op, f"engine is dead: {self._death_reason}")
        if self._closed:
            raise EngineDead(self._label, op, "engine is closed")

    def _draw_latency(self, op: str) -> float:
        value = self._op_latency.get(op, 0.0)
        if isinstance(value, tuple):
            return self._rng.uniform(value[0], value[1])
        return value

    def _record(self, op: str, **fields: Any) -> dict[str, Any]:
        """Append the history entry of a call that starts now; the caller fills in its end.

        Entries hold only strings, numbers, None and tuples of those (``history()`` turns the
        tuples into lists), and older finished entries are kept as tuples of tuples, which
        CPython's collector stops tracking: a fleet of thousands of in-process engines keeps
        millions of entries, and every full collection would otherwise visit each one.
        """
        entry: dict[str, Any] = {
            "op": op,
            "engine": self._label,
            "tags": None,
            "mode": None,
            "start": time.monotonic(),
            "end": None,
            "outcome": "pending",
            "detail": None,
            **fields,
        }
        check = CHECKING.get()
        if check is not None:  # a read the engine host makes to check the engine
            entry["check_of"] = check
        recent = self._history
        recent.append(entry)
        if len(recent) >= 2 * HISTORY_CHUNK:
            chunk = recent[:HISTORY_CHUNK]
            if all(e["end"] is not None for e in chunk):  # finished: nothing writes to them
                self._archive.append(tuple(tuple(e.items()) for e in chunk))
                del recent[:HISTORY_CHUNK]
        return entry

    @contextlib.asynccontextmanager
    async def _op(self, op: str, **fields: Any) -> AsyncIterator[dict[str, Any]]:
        entry = self._record(op, **fields)
        process = self._process
        try:
            # A dead server refuses the connection at once: no latency, no effect.
            self._check_alive(op)
            self._ensure_scheduler()
            delay = self._draw_latency(op)
            if delay > 0:
                await asyncio.sleep(delay)
                self._check_alive(op)
                if self._process != process:
                    # the process that took the call is gone: its connection dropped
                    raise EngineUnreachable(
                        self._label, op, "connection dropped: the server restarted"
                    )
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

    def _fatal(self, entry: dict[str, Any], reason: str) -> EngineDead:
        """Kill the engine because of the call ``entry`` records; return the error it raises."""
        self._die(reason)
        entry["outcome"] = "fatal"
        return EngineDead(self._label, entry["op"], f"connection dropped: {reason}")

    def _die(self, reason: str) -> None:
        if self._dead:
            return
        self._dead = True
        self._death_reason = reason
        self._drop_all(f"connection dropped: engine died: {reason}")
        self._notify()

    def _drop_all(self, message: str) -> None:
        for req in self._in_flight.values():
            if not req.future.done():
                req.future.set_exception(EngineDead(self._label, "generate", message))
        self._in_flight.clear()
        self._running.clear()
        self._waiting.clear()
        self._front.clear()

    def _is_idle(self, *, ignore_waiting: bool) -> bool:
        """The scheduler's idleness: nothing running and, unless ignored, nothing waiting.

        The front end's held requests never count: the scheduler has not seen them.
        """
        # sglang: scheduler.py Scheduler.is_fully_idle(ignore_waiting=...)
        return not self._running and (ignore_waiting or not self._waiting)

    def _tag_names(self, op: str, tags: Sequence[Tag | str] | None) -> list[str]:
        if isinstance(tags, str):
            # The server's body schema wants a list; a bare string is a 400, not per-char tags.
            raise EngineRejected(self._label, op, f"tags must be a list, got {tags!r}", 400)
        if not tags:
            return [t.value for t in ALL_TAGS]
        return [t.value if isinstance(t, Tag) else str(t) for t in tags]

    def _result(self, req: SimRequest, finish_reason: dict[str, Any]) -> dict[str, Any]:
        # sglang: output_streamer.py (spans from the scheduler's current version at finish),
        # weight_versions.py add_weight_versions_to_meta_info (weight_version = last span's)
        spans = version_spans(req.version_events, self._weight_version, len(req.output))
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

    @staticmethod
    def _aborted(message: str) -> dict[str, Any]:
        # sglang: schedule_batch.py FINISH_ABORT.to_json
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}

    def _finish(self, req: SimRequest, finish_reason: dict[str, Any]) -> None:
        self._in_flight.pop(req.rid, None)
        aborted = finish_reason["type"] == "abort"
        if not req.internal:
            self._counts["aborted" if aborted else "completed"] += 1
            if not aborted:
                self._prefix_cache.add(tuple(req.prompt))
        if not req.future.done():
            req.future.set_result(self._result(req, finish_reason))

    async def _abort(self, match: Callable[[SimRequest], bool], message: str) -> int:
        """Abort the scheduler's requests that ``match``; those held in the front end while
        paused are out of its reach (they reach the scheduler only after continue)."""
        # sglang: scheduler.py Scheduler.abort_request walks the waiting queue and the batches
        victims = [r for r in (*self._running, *self._waiting) if match(r)]
        if not victims:
            return 0
        doomed = set(map(id, victims))
        self._running = [r for r in self._running if id(r) not in doomed]
        self._waiting = deque(r for r in self._waiting if id(r) not in doomed)
        for req in victims:
            self._finish(req, self._aborted(message))
        self._notify()
        # Let the aborted generate calls return before the control call that aborted them
        # answers, as the HTTP server sends their responses first.
        await asyncio.sleep(0)
        return len(victims)

    def _discard(self, req: SimRequest) -> None:
        """Forget a request whose caller went away (SGLang aborts on a closed connection)."""
        if self._in_flight.pop(req.rid, None) is None:
            return
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)
        if req in self._front:
            self._front.remove(req)
        self._notify()

    def _enqueue(self, req: SimRequest) -> None:
        self._in_flight[req.rid] = req
        if self._paused:
            self._counts["arrived_paused"] += 1
        (self._front if self._paused else self._waiting).append(req)
        self._notify()

    def _record_version_change(self, new_version: str | None) -> None:
        """Move the scheduler's weight version; live requests remember where it changed."""
        # sglang: scheduler.py Scheduler.record_weight_version_change
        if new_version is None or new_version == self._weight_version:
            return
        for req in (*self._running, *self._waiting):
            if req.output:
                req.version_events.append((self._weight_version, len(req.output)))
        self._weight_version = new_version

    # ----------------------------------------------------------------------------- scheduler

    async def _schedule(self) -> None:
        try:
            while not (self._dead or self._closed):
                if not self._may_step():
                    await self._wait_changed(None)
                    continue
                if self._forward_on_released():
                    return
                self._admit()
                await asyncio.sleep(self._token_latency)
                # Control calls may have run during the step; it lands only if it still may, so
                # a pause that arrives mid-step discards it: no token is produced while paused.
                if self._dead or self._closed or not self._may_step():
                    continue
                if self._forward_on_released():
                    return
                if self._running:
                    self._decode_step()
                elif self._dp_dummy_batches:
                    self._counts["dummy_steps"] += 1
                self._notify()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the simulation must not hang callers
            self._die(f"simulated scheduler crashed: {exc!r}")

    def _may_step(self) -> bool:
        # An idle data-parallel rank still runs dummy batches to keep its peers in lockstep.
        work = self._running or self._waiting or self._dp_dummy_batches
        return not self._paused and bool(work)

    def _forward_on_released(self) -> bool:
        """Kill the engine if the forward pass about to run would touch released memory."""
        released = [t for t in FORWARD_TAGS if t in self._released]
        if not released:
            return False
        # Nothing in SGLang stops a forward pass on unmapped memory.
        what = "a forward pass" if self._running or self._waiting else "a data-parallel dummy batch"
        self._die(
            f"illegal memory access: {what} ran while {', '.join(released)} released and "
            "generation not paused"
        )
        return True

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self._max_running:
            req = self._waiting.popleft()
            if tuple(req.prompt) in self._prefix_cache:
                req.cached_tokens = len(req.prompt)
                self._counts["prefix_hits"] += 1
            self._running.append(req)
            self._counts["prefills"] += 1

    def _decode_step(self) -> None:
        self._counts["steps"] += 1
        still: list[SimRequest] = []
        done: list[SimRequest] = []
        for req in self._running:
            if len(req.output) < req.max_new_tokens:
                if self._weights_valid:
                    token = (req.key + 7919 * (len(req.output) + 1)) % VOCAB
                else:
                    token = GARBAGE_TOKEN
                    req.on_garbage = True
                    self._counts["garbage_tokens"] += 1
                req.output.append(token)
                self._counts["tokens"] += 1
            (done if len(req.output) >= req.max_new_tokens else still).append(req)
        self._running = still
        for req in done:
            # sglang: schedule_batch.py FINISH_LENGTH.to_json
            self._finish(req, {"type": "length", "length": req.max_new_tokens})

    # ----------------------------------------------------------------------------- generation

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``: runs to completion, or returns early with finish reason abort."""
        self._check_alive("generate")
        self._ensure_scheduler()
        req = self._parse_request(request)
        self._counts["submitted"] += 1
        self._enqueue(req)
        try:
            return await req.future
        except asyncio.CancelledError:
            self._discard(req)
            raise

    def _parse_request(self, request: Mapping[str, Any]) -> SimRequest:
        def reject(message: str) -> EngineRejected:
            return EngineRejected(self._label, "generate", message, 400)

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
        elif rid in self._in_flight:
            raise reject(f"duplicate request id {rid!r}")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        return SimRequest(rid=rid, prompt=prompt, max_new_tokens=max_new, future=future)
