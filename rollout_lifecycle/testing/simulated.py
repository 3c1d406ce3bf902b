"""A simulated SGLang 0.5.23 engine that keeps SGLang's lifecycle contract, fatal misuse included.

Tests, demos and benchmarks drive it instead of a GPU server; misuse kills it as it kills SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import math
import os
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_lifecycle.core.config import (
    ALL_TAGS,
    DEFAULT_GROUP_NAME,
    PauseMode,
    Tag,
    check_flag,
    check_int,
    check_seconds,
)
from rollout_lifecycle.core.exceptions import EngineDead, EngineRejected, InvalidArgument

GIB = 1 << 30

#: Resident bytes per tag when ``memory_bytes`` does not say otherwise.
DEFAULT_MEMORY_BYTES: Mapping[str, int] = {
    Tag.WEIGHTS.value: 16 * GIB,
    Tag.KV_CACHE.value: 40 * GIB,
    Tag.CUDA_GRAPH.value: 2 * GIB,
}

#: The operations whose duration ``op_latency`` can set (and that ``history()`` records).
LIFECYCLE_OPS: tuple[str, ...] = (
    "pause_generation",
    "continue_generation",
    "flush_cache",
    "release_memory_occupation",
    "resume_memory_occupation",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "init_weights_update_group",
    "destroy_weights_update_group",
    "update_weight_version",
    "weight_version",
    "server_info",
    "ready",
    "health",
    "abort_request",
)

SIM_VERSION = "0.5.23"

#: The weight version a server starts with when ``--weight-version`` is not given.
# sglang: arg_groups/fields/serving.py (weight_version defaults to "default")
DEFAULT_WEIGHT_VERSION = "default"

# The real server's answers, verbatim, where a client may read them.
# sglang: http_server.py flush_cache (``ret.message or "Flush cache failed.\n"``)
FLUSH_FAILED = "Flush cache failed.\n"
# sglang: flush_wrapper.py SchedulerFlushWrapper.check_pending / handle
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
# sglang: scheduler_components/weight_updater.py flush_cache_after_weight_update
WEIGHTS_WRITTEN_FLUSH_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)
SELECTORS: tuple[str, ...] = ("target", "draft", "all")

_VOCAB = 32000
_KNOWN_TAGS = frozenset(t.value for t in ALL_TAGS)
# SGLang resumes in this order within one call, whatever order the tags were given in.
_RESUME_ORDER: tuple[str, ...] = (Tag.CUDA_GRAPH.value, Tag.WEIGHTS.value, Tag.KV_CACHE.value)
# A forward pass touches these; cuda_graph being released only costs speed, not correctness.
_FORWARD_TAGS: tuple[str, ...] = (Tag.WEIGHTS.value, Tag.KV_CACHE.value)
# Whatever released weights hold after a resume without a CPU backup decodes to this token.
_GARBAGE_TOKEN = 0
# KV cache bytes per token slot, for the token capacity /server_info reports.
_KV_BYTES_PER_TOKEN = 128 * 1024


@dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    future: asyncio.Future[dict[str, Any]]
    internal: bool = False
    output: list[int] = field(default_factory=list)
    num_retractions: int = 0
    # (version before a change, output tokens generated under it), one per change seen while
    # the request was live in the scheduler. sglang: utils/weight_versions.py WeightVersionEvent
    version_events: list[tuple[str, int]] = field(default_factory=list)
    cached_tokens: int = 0
    on_garbage: bool = False

    def __post_init__(self) -> None:
        self.key = sum((i + 1) * t for i, t in enumerate(self.prompt)) % _VOCAB


#: History entries per tuple of older entries (see ``SimulatedEngine._record``).
_HISTORY_CHUNK = 16


#: The most requests ``max_running`` may let run at once.
MAX_RUNNING = 1_000_000


def _seconds(value: object) -> float | None:
    """``value`` as seconds if it is a finite number >= 0, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _requested(tags: Sequence[Tag | str] | None) -> tuple[object, ...] | str | None:
    """The tags a call asked for, as its history records them (tag names, not ``Tag``s)."""
    if tags is None or isinstance(tags, str):
        return tags
    return tuple(t.value if isinstance(t, Tag) else t for t in tags)


def _check_seconds(name: str, value: object) -> float:
    return check_seconds(name, value, positive=False)


def _detokenize(tokens: Sequence[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in tokens)


def _version_spans(
    events: Sequence[tuple[str, int]], current: str, count: int
) -> list[dict[str, Any]]:
    """``meta_info["weight_versions"]`` of a request that finished with ``count`` tokens.

    sglang: utils/weight_versions.py compute_weight_version_spans (scheduler side) followed by
    add_weight_versions_to_meta_info (tokenizer side, which hides spans past the output).
    """
    spans: list[dict[str, Any]] = []
    for version, raw_end in [*events, (current, count)]:
        end = min(raw_end, count)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    visible = [s for s in spans if s["start"] < count or s["start"] == 0]
    return [{**s, "end": min(s["end"], count)} for s in visible]


class SimulatedEngine:
    """One simulated SGLang server: generation that takes time, memory per tag, the lifecycle.

    Runs on the asyncio loop of its first caller (a scheduler task started lazily); no threads.
    A fatal misuse (see docs/sglang-contract.md) kills it: in-flight generates and
    every later call raise ``EngineDead``.
    """

    def __init__(
        self,
        label: str = "sim",
        *,
        token_latency: float = 0.005,
        op_latency: Mapping[str, float | tuple[float, float]] | None = None,
        seed: int | None = None,
        memory_bytes: Mapping[str, int] | None = None,
        weight_version: str = DEFAULT_WEIGHT_VERSION,
        weights_cpu_backup: bool = False,
        dp_dummy_batches: bool = False,
        health_timeout: float = 20.0,
        max_running: int = 1024,
        gpu_memory_bytes: int | None = None,
        check_model_paths: bool = False,
    ) -> None:
        if not isinstance(label, str) or not label:
            raise InvalidArgument(f"label must be a non-empty string, got {label!r}")
        self._label = label
        self._token_latency = _check_seconds("token_latency", token_latency)
        self._health_timeout = _check_seconds("health_timeout", health_timeout)
        self._op_latency = self._validate_op_latency(op_latency)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise InvalidArgument(f"seed must be an int or None, got {seed!r}")
        self._rng = random.Random(seed)
        self._capacity = self._validate_memory(memory_bytes)
        if not isinstance(weight_version, str):
            raise InvalidArgument(f"weight_version must be a string, got {weight_version!r}")
        check_int("max_running", max_running, minimum=1, maximum=MAX_RUNNING)
        if gpu_memory_bytes is not None and (
            not isinstance(gpu_memory_bytes, int)
            or isinstance(gpu_memory_bytes, bool)
            or gpu_memory_bytes < 0
        ):
            raise InvalidArgument(
                f"gpu_memory_bytes must be an int >= 0 or None, got {gpu_memory_bytes!r}"
            )
        self._gpu_memory_bytes = gpu_memory_bytes
        self._external_bytes = 0
        self._max_running = max_running
        self._weights_cpu_backup = check_flag("weights_cpu_backup", weights_cpu_backup)
        self._dp_dummy_batches = check_flag("dp_dummy_batches", dp_dummy_batches)
        self._check_model_paths = check_flag("check_model_paths", check_model_paths)
        # The front end hands the scheduler one flush at a time, in arrival order.
        # sglang: communicator.py FanOutCommunicator.queueing_call (flush_cache_communicator)
        self._flush_queue: asyncio.Lock | None = None

        self._initial_version = weight_version
        # The scheduler's version (stamped on output tokens) and the tokenizer's (what
        # /model_info reports) are kept apart: a weight update whose trailing flush fails moves
        # the first and not the second.
        # sglang: weight_updater.py update_weights_from_* (record_weight_version_after_update
        # before flush_cache_after_weight_update); tokenizer_control_mixin.py
        # _update_weight_version_if_provided only on success.
        self._weight_version = weight_version
        self._served_version = weight_version
        self._weights_valid = True
        self._released: set[str] = set()
        self._paused = False
        self._pause_mode: PauseMode | None = None
        self._running: list[_Request] = []
        self._waiting: deque[_Request] = deque()
        # Requests that arrived while paused wait in the tokenizer front end, not in the
        # scheduler: no scheduler abort and no idleness check sees them.
        # sglang: tokenizer_manager.py generate_request (is_pause_cond.wait_for before sending)
        self._front: list[_Request] = []
        self._in_flight: dict[str, _Request] = {}
        self._prefix_cache: set[tuple[int, ...]] = set()
        self._session_open = False
        self._session_selector: str | None = None
        self._groups: dict[str, dict[str, Any]] = {}
        self._flush_pending = False
        self._healthy = True
        self._dead = False
        self._death_reason: str | None = None
        self._closed = False
        # The newest history entries, and older finished ones as tuples of their items, in
        # tuples of ``_HISTORY_CHUNK`` (see ``_record``).
        self._history: list[dict[str, Any]] = []
        self._archive: list[tuple[tuple[tuple[str, Any], ...], ...]] = []
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "submitted",
                "completed",
                "aborted",
                "retractions",
                "prefills",
                "prefix_hits",
                "steps",
                "dummy_steps",
                "tokens",
                "garbage_tokens",
                "flushes",
                "weight_updates",
                "health_checks",
            ),
            0,
        )
        self._health_seq = 0
        self._scheduler: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None

    # ----------------------------------------------------------------------------- validation

    @staticmethod
    def _validate_op_latency(
        op_latency: Mapping[str, float | tuple[float, float]] | None,
    ) -> dict[str, float | tuple[float, float]]:
        if op_latency is None:
            return {}
        if not isinstance(op_latency, Mapping):
            raise InvalidArgument(f"op_latency must be a mapping, got {op_latency!r}")
        out: dict[str, float | tuple[float, float]] = {}
        for op, value in op_latency.items():
            if op not in LIFECYCLE_OPS:
                raise InvalidArgument(
                    f"unknown op {op!r} in op_latency; valid: {', '.join(LIFECYCLE_OPS)}"
                )
            if isinstance(value, tuple):
                if len(value) != 2:
                    raise InvalidArgument(
                        f"op_latency[{op!r}] must be seconds or a (low, high) pair, got {value!r}"
                    )
                low = _check_seconds(f"op_latency[{op!r}] low", value[0])
                high = _check_seconds(f"op_latency[{op!r}] high", value[1])
                if low > high:
                    raise InvalidArgument(f"op_latency[{op!r}] range has low > high: {value!r}")
                out[op] = (low, high)
            else:
                out[op] = _check_seconds(f"op_latency[{op!r}]", value)
        return out

    @staticmethod
    def _validate_memory(memory_bytes: Mapping[str, int] | None) -> dict[str, int]:
        capacity = dict(DEFAULT_MEMORY_BYTES)
        if memory_bytes is None:
            return capacity
        if not isinstance(memory_bytes, Mapping):
            raise InvalidArgument(f"memory_bytes must be a mapping, got {memory_bytes!r}")
        for tag, nbytes in memory_bytes.items():
            name = tag.value if isinstance(tag, Tag) else tag
            if name not in _KNOWN_TAGS:
                raise InvalidArgument(
                    f"unknown memory tag {tag!r} in memory_bytes; valid: "
                    f"{', '.join(sorted(_KNOWN_TAGS))}"
                )
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise InvalidArgument(f"memory_bytes[{name!r}] must be an int >= 0, got {nbytes!r}")
            capacity[name] = nbytes
        return capacity

    # ----------------------------------------------------------------------------- properties

    @property
    def label(self) -> str:
        """The engine's name in errors and history."""
        return self._label

    @property
    def dead(self) -> bool:
        """True once a fatal misuse has killed the engine."""
        return self._dead

    @property
    def paused(self) -> bool:
        """Whether generation is paused (introspection; the server shows it only as /ready 503)."""
        return self._paused

    @property
    def pause_mode(self) -> str | None:
        """The mode of the current pause, or None (introspection)."""
        return self._pause_value()

    @property
    def released_tags(self) -> list[str]:
        """The memory tags released now, in tag order (introspection; SGLang tracks none)."""
        return [t.value for t in ALL_TAGS if t.value in self._released]

    @property
    def weights_valid(self) -> bool:
        """False while the weights hold garbage (resumed without a CPU backup, not rewritten)."""
        return self._weights_valid

    @property
    def flush_pending(self) -> bool:
        """Whether a flush with a timeout is deferred, waiting for idleness (introspection)."""
        return self._flush_pending

    @property
    def weight_update_session_open(self) -> bool:
        """Whether a begin/end weight-update session is open (introspection)."""
        return self._session_open

    @property
    def death_reason(self) -> str | None:
        """What killed the engine, or None while it lives."""
        return self._death_reason

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
        recent = self._history
        recent.append(entry)
        if len(recent) >= 2 * _HISTORY_CHUNK:
            chunk = recent[:_HISTORY_CHUNK]
            if all(e["end"] is not None for e in chunk):  # finished: nothing writes to them
                self._archive.append(tuple(tuple(e.items()) for e in chunk))
                del recent[:_HISTORY_CHUNK]
        return entry

    @contextlib.asynccontextmanager
    async def _op(self, op: str, **fields: Any) -> AsyncIterator[dict[str, Any]]:
        entry = self._record(op, **fields)
        try:
            # A dead server refuses the connection at once: no latency, no effect.
            self._check_alive(op)
            self._ensure_scheduler()
            delay = self._draw_latency(op)
            if delay > 0:
                await asyncio.sleep(delay)
                self._check_alive(op)
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

    def _result(self, req: _Request, finish_reason: dict[str, Any]) -> dict[str, Any]:
        # sglang: output_streamer.py (spans from the scheduler's current version at finish),
        # weight_versions.py add_weight_versions_to_meta_info (weight_version = last span's)
        spans = _version_spans(req.version_events, self._weight_version, len(req.output))
        return {
            "text": _detokenize(req.output),
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

    def _finish(self, req: _Request, finish_reason: dict[str, Any]) -> None:
        self._in_flight.pop(req.rid, None)
        aborted = finish_reason["type"] == "abort"
        if not req.internal:
            self._counts["aborted" if aborted else "completed"] += 1
            if not aborted:
                self._prefix_cache.add(tuple(req.prompt))
        if not req.future.done():
            req.future.set_result(self._result(req, finish_reason))

    async def _abort(self, match: Callable[[_Request], bool], message: str) -> int:
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

    def _discard(self, req: _Request) -> None:
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

    def _enqueue(self, req: _Request) -> None:
        self._in_flight[req.rid] = req
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
        released = [t for t in _FORWARD_TAGS if t in self._released]
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
        still: list[_Request] = []
        done: list[_Request] = []
        for req in self._running:
            if len(req.output) < req.max_new_tokens:
                if self._weights_valid:
                    token = (req.key + 7919 * (len(req.output) + 1)) % _VOCAB
                else:
                    token = _GARBAGE_TOKEN
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

    def _parse_request(self, request: Mapping[str, Any]) -> _Request:
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
        return _Request(rid=rid, prompt=prompt, max_new_tokens=max_new, future=future)

    # ----------------------------------------------------------------------------- lifecycle

    async def pause_generation(self, mode: PauseMode | str) -> None:
        """``POST /pause_generation``: abort, retract or freeze in-flight requests; then paused."""
        raw = mode.value if isinstance(mode, PauseMode) else mode
        async with self._op("pause_generation", mode=raw):
            try:
                pause_mode = PauseMode(mode)
            except ValueError:
                valid = ", ".join(m.value for m in PauseMode)
                raise EngineRejected(
                    self._label, "pause_generation", f"unknown mode {mode!r}; valid: {valid}", 400
                ) from None
            self._paused = True
            self._pause_mode = pause_mode
            if pause_mode is PauseMode.ABORT:
                # The front end aborts until nothing is in flight and answers only then.
                await self._abort(lambda _: True, "aborted by pause_generation(mode=abort)")
            elif pause_mode is PauseMode.RETRACT:
                # Running requests give back their KV and queue up again, first in line.
                for req in reversed(self._running):
                    req.num_retractions += 1
                    self._waiting.appendleft(req)
                self._counts["retractions"] += len(self._running)
                self._running = []
            self._notify()

    async def continue_generation(self) -> None:
        """``POST /continue_generation``: let the scheduler run again (harmless if not paused).

        Requests the front end held while paused go to the scheduler now, behind the ones it
        already had."""
        async with self._op("continue_generation"):
            self._paused = False
            self._pause_mode = None
            self._waiting.extend(self._front)
            self._front.clear()
            self._notify()

    async def flush_cache(self, timeout: float) -> None:
        """``POST /flush_cache?timeout=T``: clear the prefix cache; 400 (``EngineRejected``)
        when SGLang would refuse.

        ``timeout`` 0 flushes at once if idle, the waiting queue ignored while paused (so a
        retract pause's requeued requests do not count), else answers "Flush cache failed.".
        ``timeout`` T > 0 flushes at once only if fully idle counting the waiting queue; else it
        is deferred and re-checked, still counting the waiting queue, until idle or until T
        passes ("Timed out waiting for idle state.": after a retract pause, every time).
        Flushes sent together wait for each other and run one after another, as SGLang's front
        end hands them over (its scheduler's "Another flush_cache is already in progress." is
        therefore never an answer).
        """
        # sglang: flush_wrapper.py SchedulerFlushWrapper.handle / check_pending;
        # scheduler.py Scheduler.flush_cache (is_fully_idle(ignore_waiting=self._engine_paused))
        op = "flush_cache"
        if self._flush_queue is None:
            self._flush_queue = asyncio.Lock()
        async with self._flush_queue, self._op(op, timeout=timeout):
            if _seconds(timeout) is None:
                raise EngineRejected(self._label, op, f"bad timeout {timeout!r}", 400)
            if timeout <= 0 or self._is_idle(ignore_waiting=False):
                self._flush_now(op)
                return
            self._flush_pending = True
            try:
                deadline = time.monotonic() + timeout
                while not self._is_idle(ignore_waiting=False):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise EngineRejected(self._label, op, FLUSH_TIMED_OUT, 400)
                    await self._wait_changed(remaining)
                    self._check_alive(op)
            finally:
                self._flush_pending = False
            self._flush_now(op)

    def _flush_now(self, op: str) -> None:
        # sglang: scheduler.py Scheduler.flush_cache
        if not self._is_idle(ignore_waiting=self._paused):
            raise EngineRejected(self._label, op, FLUSH_FAILED.strip(), 400)
        self._prefix_cache.clear()
        self._counts["flushes"] += 1

    async def release_memory_occupation(self, tags: Sequence[Tag | str] | None) -> None:
        """``POST /release_memory_occupation``; empty tags mean all three."""
        op = "release_memory_occupation"
        async with self._op(op, requested_tags=_requested(tags)) as entry:
            # SGLang asks "is TAG in tags" once per tag, so a tag named twice is released once.
            # sglang: weight_updater.py SchedulerWeightUpdaterManager.release_memory_occupation
            names = list(dict.fromkeys(self._tag_names(op, tags)))
            entry["tags"] = tuple(names)
            if not self._is_idle(ignore_waiting=self._paused):
                # The scheduler asserts idleness; the failed assertion takes the server down.
                raise self._fatal(
                    entry,
                    f"assertion failed in release_memory_occupation: engine not idle "
                    f"({len(self._running)} running, {len(self._waiting)} waiting, "
                    f"paused={self._paused}, mode={self._pause_value()})",
                )
            for name in names:
                if name not in _KNOWN_TAGS:
                    continue  # SGLang does not check tag names: a typo frees nothing.
                if name in self._released:
                    raise self._fatal(
                        entry,
                        f"memory saver aborted: tag {name!r} released twice (process exited)",
                    )
                self._released.add(name)
                if name == Tag.KV_CACHE.value:
                    self._prefix_cache.clear()  # releasing the KV pool flushes the cache itself
            self._notify()

    async def resume_memory_occupation(self, tags: Sequence[Tag | str] | None) -> None:
        """``POST /resume_memory_occupation``; empty tags mean all three."""
        op = "resume_memory_occupation"
        async with self._op(op, requested_tags=_requested(tags)) as entry:
            names = self._tag_names(op, tags)
            entry["tags"] = tuple(names)
            ordered = [t for t in _RESUME_ORDER for name in names if name == t]
            for name in ordered:
                if name not in self._released:
                    raise self._fatal(
                        entry,
                        f"KeyError in scheduler: resume of tag {name!r}, which is not released",
                    )
                if self._gpu_memory_bytes is not None:
                    need = self._resident_bytes() + self._external_bytes + self._capacity[name]
                    if need > self._gpu_memory_bytes:
                        raise self._fatal(
                            entry,
                            f"CUDA out of memory resuming {name!r}: needs {need} bytes of "
                            f"{self._gpu_memory_bytes} ({self._external_bytes} held elsewhere)",
                        )
                self._released.discard(name)
                if name == Tag.WEIGHTS.value and not self._weights_cpu_backup:
                    # Without --enable-weights-cpu-backup the remapped pages hold garbage.
                    self._weights_valid = False
            self._notify()

    async def _wait_unpaused_idle(self, op: str) -> None:
        """Unpaused, a weight call takes the model-update writer lock, so it waits for every
        in-flight generate to finish; paused, whoever paused holds it and the call runs now."""
        # sglang: tokenizer_control_mixin.py _weight_update_session_call,
        # update_weights_from_tensor / _distributed (model_update_lock.writer_lock unless paused)
        while not self._paused and (self._running or self._waiting):
            await self._wait_changed(None)
            self._check_alive(op)

    def _check_selector(self, op: str, selector: str) -> str:
        if selector not in SELECTORS:
            raise EngineRejected(
                self._label, op, f"selector must be one of {', '.join(SELECTORS)}", 400
            )
        return selector

    async def begin_weight_update(self, selector: str = "all") -> None:
        """``POST /begin_weight_update``: open a session (400 if one is open)."""
        # sglang: weight_updater.py SchedulerWeightUpdaterManager.begin_weight_update
        op = "begin_weight_update"
        async with self._op(op, selector=selector):
            self._check_selector(op, selector)
            await self._wait_unpaused_idle(op)
            if self._session_open:
                raise EngineRejected(
                    self._label,
                    op,
                    "a weight-update session is already open; call end_weight_update() first",
                    400,
                )
            self._session_open = True
            self._session_selector = selector

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update``: close the session (400 if none is open)."""
        # sglang: weight_updater.py SchedulerWeightUpdaterManager.end_weight_update
        op = "end_weight_update"
        async with self._op(op):
            await self._wait_unpaused_idle(op)
            if not self._session_open:
                raise EngineRejected(
                    self._label,
                    op,
                    "no weight-update session is open; call begin_weight_update() first",
                    400,
                )
            self._session_open = False
            self._session_selector = None

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
    ) -> None:
        """``POST /update_weights_from_disk`` (needs no session)."""
        op = "update_weights_from_disk"
        async with self._op(
            op,
            version=weight_version,
            model_path=model_path,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        ) as entry:
            if not isinstance(model_path, str) or not model_path:
                raise EngineRejected(self._label, op, f"bad model_path {model_path!r}", 400)
            # SGLang's loader fails on a path it cannot read: success false, version kept.
            # sglang: model_runner_components/weight_updater.py update_weights_from_disk
            refuse = None
            if self._check_model_paths and not await asyncio.to_thread(os.path.isdir, model_path):
                refuse = f"Failed to get weights iterator: no model at {model_path!r}."
            await self._write_weights(
                entry,
                weight_version,
                flush_cache,
                abort_all_requests,
                selector="all",
                refuse=refuse,
            )

    async def update_weights_from_tensor(
        self,
        payload: Any,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        selector: str = "all",
    ) -> None:
        """``POST /update_weights_from_tensor`` (only inside a begin/end session)."""
        op = "update_weights_from_tensor"
        async with self._op(
            op,
            version=weight_version,
            payload_type=type(payload).__name__,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            selector=selector,
        ) as entry:
            self._check_selector(op, selector)
            await self._write_weights(
                entry,
                weight_version,
                flush_cache,
                abort_all_requests,
                selector=selector,
                session=f"{op} must run between begin_weight_update() and end_weight_update()",
            )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """``POST /init_weights_update_group``: record the group (no collective is formed)."""
        # sglang: model_runner_components/weight_updater.py init_weights_update_group
        op = "init_weights_update_group"
        async with self._op(op, group_name=group_name, backend=backend):
            if not isinstance(group_name, str) or not group_name:
                raise EngineRejected(
                    self._label,
                    op,
                    "Failed to initialize custom process group: Group name cannot be empty.",
                    400,
                )
            self._groups[group_name] = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "backend": backend,
            }

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """``POST /destroy_weights_update_group``; 400 for a group that does not exist."""
        # sglang: model_runner_components/weight_updater.py destroy_weights_update_group
        op = "destroy_weights_update_group"
        async with self._op(op, group_name=group_name):
            if self._groups.pop(group_name, None) is None:
                raise EngineRejected(
                    self._label, op, "The group to be destroyed does not exist.", 400
                )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        load_format: str | None = None,
        selector: str = "all",
    ) -> None:
        """``POST /update_weights_from_distributed``: inside a session, over a group that
        ``init_weights_update_group`` formed (400 naming the known groups otherwise)."""
        op = "update_weights_from_distributed"
        async with self._op(
            op,
            version=weight_version,
            group_name=group_name,
            load_format=load_format,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            selector=selector,
        ) as entry:
            self._check_selector(op, selector)
            # sglang: model_runner_components/weight_updater.py receive_weights_from_distributed
            # (the assertion is caught by update_weights_from_distributed and answered as 400)
            unknown = None
            if group_name not in self._groups:
                unknown = (
                    f"Failed to receive weights: Group {group_name} not in "
                    f"{list(self._groups)}. Please call `init_weights_update_group` first."
                )
            await self._write_weights(
                entry,
                weight_version,
                flush_cache,
                abort_all_requests,
                selector=selector,
                session=f"{op} must run between begin_weight_update() and end_weight_update()",
                refuse=unknown,
            )

    async def _write_weights(
        self,
        entry: dict[str, Any],
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        *,
        selector: str,
        session: str | None = None,
        refuse: str | None = None,
    ) -> None:
        op: str = entry["op"]
        if weight_version is not None and not isinstance(weight_version, str):
            raise EngineRejected(self._label, op, f"bad weight_version {weight_version!r}", 400)
        if abort_all_requests:
            # sglang: the tokenizer's abort_request(abort_all=True), before the lock is taken
            await self._abort(lambda _: True, f"aborted by {op}(abort_all_requests=True)")
        await self._wait_unpaused_idle(op)
        # sglang: weight_updater.py update_weights_from_tensor / _distributed check the session
        # first, then receive, then load into the runners the request's own selector picks.
        if session is not None and not self._session_open:
            raise EngineRejected(self._label, op, session, 400)
        if refuse is not None:
            raise EngineRejected(self._label, op, refuse, 400)
        # The simulated model has no speculative draft: "draft" selects no runner, so the call
        # succeeds and loads nothing (sglang: weight_updater.py _select_runners).
        if selector != "draft":
            if Tag.WEIGHTS.value in self._released:
                raise self._fatal(
                    entry, f"illegal memory access: {op} wrote weights while 'weights' is released"
                )
            self._weights_valid = True
        self._counts["weight_updates"] += 1
        self._record_version_change(weight_version)
        if flush_cache and not self._is_idle(ignore_waiting=self._paused):
            # The weights and the scheduler's version moved; the answer is a 400 and the
            # tokenizer's version (/model_info) stays.
            # sglang: weight_updater.py flush_cache_after_weight_update
            raise EngineRejected(self._label, op, WEIGHTS_WRITTEN_FLUSH_FAILED, 400)
        if flush_cache:
            self._prefix_cache.clear()
        if weight_version is not None:
            self._served_version = weight_version

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = True) -> None:
        """``POST /update_weight_version``; SGLang's default aborts every request the scheduler
        holds (the front end's, held while paused, are out of its reach)."""
        # sglang: http_server.py update_weight_version; scheduler.py handle_update_weight_version
        op = "update_weight_version"
        async with self._op(op, version=version, abort_all_requests=abort_all_requests):
            if not isinstance(version, str):
                raise EngineRejected(self._label, op, f"bad new_version {version!r}", 400)
            if abort_all_requests:
                # Includes the requests a retract pause preserved: the field's costliest bug.
                await self._abort(lambda _: True, "aborted by update_weight_version")
            self._record_version_change(version)
            self._served_version = version

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request``: with one tokenizer worker, ``rid`` must be a live request's
        id exactly; ``rid=""`` without ``abort_all`` does nothing; ``abort_all`` aborts every
        request the scheduler holds."""
        async with self._op("abort_request", rid=rid, abort_all=abort_all) as entry:
            # sglang: tokenizer_manager.py TokenizerManager.abort_request (exact rid lookup in
            # rid_to_state; the scheduler then aborts what starts with it:
            # scheduler.py Scheduler.abort_request)
            if abort_all:
                count = await self._abort(lambda _: True, "aborted by abort_request")
            elif rid and rid in self._in_flight:
                count = await self._abort(
                    lambda r: r.rid.startswith(rid), "aborted by abort_request"
                )
            else:
                count = 0
            entry["detail"] = f"{count} aborted"

    async def health(self) -> None:
        """``GET /health_generate``: a real one-token generation; 503 if it does not finish."""
        op = "health"
        async with self._op(op):
            self._health_seq += 1
            self._counts["health_checks"] += 1
            loop = asyncio.get_running_loop()
            req = _Request(
                rid=f"HEALTH_CHECK_{self._label}_{self._health_seq}",
                prompt=[1],
                max_new_tokens=1,
                future=loop.create_future(),
                internal=True,
            )
            self._enqueue(req)
            try:
                await asyncio.wait({req.future}, timeout=self._health_timeout)
            except asyncio.CancelledError:
                self._discard(req)
                req.future.cancel()
                raise
            if not req.future.done():
                # While paused the probe just hangs; the server gives up and calls itself sick.
                self._discard(req)
                req.future.cancel()
                self._healthy = False
                raise EngineRejected(
                    self._label,
                    op,
                    f"no token within {self._health_timeout:g}s (paused={self._paused})",
                    503,
                )
            exc = req.future.exception()
            if exc is not None:
                self._check_alive(op)
                raise exc
            if req.future.result()["meta_info"]["finish_reason"]["type"] == "abort":
                self._healthy = False
                raise EngineRejected(self._label, op, "health check request was aborted", 503)
            self._healthy = True

    async def weight_version(self) -> str:
        """The served weight version (``GET /model_info``): ``"default"`` until an update that
        succeeded as a whole (or ``update_weight_version``) names another."""
        # sglang: http_server.py model_info (tokenizer_manager.config_value("weight_version"))
        async with self._op("weight_version"):
            version = self._served_version
        return version

    async def ready(self) -> bool:
        """``GET /ready``: True only when not paused and healthy (a health check that timed
        out marks the server unhealthy until one succeeds)."""
        # sglang: tokenizer_manager.py TokenizerManager.is_ready (not is_pause and is_healthy)
        async with self._op("ready"):
            ready = not self._paused and self._healthy
        return ready

    def server_args(self) -> dict[str, Any]:
        """The resolved server arguments this engine stands for (a subset of SGLang's)."""
        return {
            "model_path": "simulated/" + self._label,
            "tokenizer_path": "simulated/" + self._label,
            "weight_version": self._initial_version,
            "enable_memory_saver": True,
            "enable_weights_cpu_backup": self._weights_cpu_backup,
            "max_running_requests": self._max_running,
            "api_key": None,
            "admin_api_key": None,
            "dp_size": 1,
            "tp_size": 1,
        }

    def _memory_usage(self) -> dict[str, Any]:
        # What the scheduler measured at load, in GB; a release does not change it.
        # sglang: scheduler_components/memory_usage.py build_memory_usage
        def gb(tag: str) -> float:
            return round(self._capacity[tag] / GIB, 3)

        return {
            "weight": gb(Tag.WEIGHTS.value),
            "kvcache": gb(Tag.KV_CACHE.value),
            "startup_available": round(sum(self._capacity.values()) / GIB, 3),
            "token_capacity": self._capacity[Tag.KV_CACHE.value] // _KV_BYTES_PER_TOKEN,
            "token_capacity_swa": None,
            "graph": {"decode": gb(Tag.CUDA_GRAPH.value)},
        }

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info`` in SGLang's shape: the resolved server arguments (keys
        included), ``launch_command``, ``version`` and one ``internal_states`` entry per DP rank
        with ``memory_usage`` as measured at load. Nothing in it says paused or released:
        ``ready()`` and the introspection properties do."""
        # sglang: http_server.py server_info; utils/common.py build_server_info;
        # scheduler_components/internal_state.py get_internal_state
        async with self._op("server_info"):
            args = self.server_args()
            info = {
                **args,
                "launch_command": "python -m sglang.launch_server --model-path "
                + str(args["model_path"]),
                "startup_time": 0.0,
                "internal_states": [
                    {
                        **args,
                        "world_size": 1,
                        "effective_max_running_requests_per_dp": self._max_running,
                        "last_gen_throughput": 0.0,
                        "memory_usage": self._memory_usage(),
                    }
                ],
                "version": SIM_VERSION,
                "frontend": "python",
            }
        return info

    async def close(self) -> None:
        """Stop the scheduler; in-flight generates get ``EngineDead``. Idempotent, never raises."""
        entry = self._record("close", outcome="ok")
        if not self._closed:
            self._closed = True
            self._drop_all("engine closed")
            self._notify()
            task, self._scheduler = self._scheduler, None
            if task is not None and not task.done():
                task.cancel()
                if task.get_loop() is asyncio.get_running_loop():
                    await asyncio.wait({task})
        entry["end"] = time.monotonic()

    # ----------------------------------------------------------------------------- introspection

    def _pause_value(self) -> str | None:
        return None if self._pause_mode is None else self._pause_mode.value

    def _resident_bytes(self) -> int:
        return sum(self.memory().values())

    def memory(self) -> dict[str, int]:
        """Resident bytes per tag; a dead engine's process holds none."""
        return {
            t.value: 0 if self._dead or t.value in self._released else self._capacity[t.value]
            for t in ALL_TAGS
        }

    def set_external_memory(self, nbytes: int) -> None:
        """Say how many bytes other processes (the trainer) hold on this engine's GPU."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidArgument(f"external memory must be an int >= 0, got {nbytes!r}")
        self._external_bytes = nbytes

    def history(self) -> list[dict[str, Any]]:
        """Every lifecycle call that has returned (or raised), in order of start; a copy."""
        return [
            {k: list(v) if isinstance(v, tuple) else v for k, v in entry.items()}
            for entry in itertools.chain(
                (dict(items) for chunk in self._archive for items in chunk), self._history
            )
            if entry["end"] is not None
        ]

    def take_history(self) -> list[dict[str, Any]]:
        """``history()``, and forget what it returns; calls still running stay for a later take.

        A long run that checks its engines round by round takes each round's calls as it goes,
        so the engine's memory, and the work of keeping it, stays flat instead of growing with
        the run.
        """
        taken = self.history()
        self._archive.clear()
        self._history = [entry for entry in self._history if entry["end"] is None]
        return taken

    def state(self) -> dict[str, Any]:
        """What SGLang keeps to itself (its ``/server_info`` shows none of it), for tests:
        label, dead, paused and the pause mode, released tags, whether the weights are valid,
        a deferred flush, an open weight-update session, the lifecycle calls in flight."""
        return {
            "label": self._label,
            "dead": self._dead,
            "paused": self.paused,
            "pause_mode": self.pause_mode,
            "released_tags": self.released_tags,
            "weights_valid": self.weights_valid,
            "flush_pending": self.flush_pending,
            "weight_update_session_open": self.weight_update_session_open,
            # lifecycle calls that have started and not returned (their latency included)
            "in_flight": [e["op"] for e in self._history if e["end"] is None],
        }

    def stats(self) -> dict[str, int]:
        """Counters of the work done so far and the current queues."""
        return {
            **self._counts,
            "prefix_cache_size": len(self._prefix_cache),
            "running": len(self._running),
            "waiting": len(self._waiting),
            "held": len(self._front),
            "in_flight": len(self._in_flight),
        }


def check_engine_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as keyword arguments of ``SimulatedEngine``; an unknown name (which Python
    would refuse with a ``TypeError``) raises ``InvalidArgument`` naming it."""
    if not isinstance(options, Mapping):
        raise InvalidArgument(f"engine options must be a mapping, got {options!r}")
    known = inspect.signature(SimulatedEngine).parameters
    for name in options:
        if not isinstance(name, str) or name not in known:
            valid = ", ".join(known)
            raise InvalidArgument(f"unknown SimulatedEngine option {name!r}; valid: {valid}")
    return dict(options)


#: The most engines ``fleet_factories`` makes factories for.
MAX_FLEET = 1_000_000


def fleet_factories(
    count: int, *, label: str, seed: int | None, **options: Any
) -> list[Callable[[], SimulatedEngine]]:
    """Factories of the ``count`` engines of a simulated fleet: engine ``i`` is labelled
    ``f"{label}-{i}"`` and, with ``seed``, draws its op latencies from ``seed + i``, so that a
    fleet is reproducible and its engines differ. Bad ``options`` raise ``InvalidArgument``
    here, before any engine is built where the factories are called (a Ray actor, say)."""
    check_int("count", count, minimum=1, maximum=MAX_FLEET)
    options = check_engine_options(options)
    SimulatedEngine(label=label, seed=seed, **options)
    return [
        functools.partial(
            SimulatedEngine,
            label=f"{label}-{i}",
            seed=None if seed is None else seed + i,
            **options,
        )
        for i in range(count)
    ]
