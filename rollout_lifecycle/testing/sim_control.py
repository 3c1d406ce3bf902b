"""The simulated engine's lifecycle calls: pause and continue, flush, memory release and resume,
aborts, the health check and the probes (``/ready``, ``/ping``, ``/model_info``,
``/server_info``), each with SGLang 0.5.23's refusals and deaths.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from rollout_lifecycle.backends.sglang.api import FLUSH_FAILED, FLUSH_TIMED_OUT, PAUSE_MODES
from rollout_lifecycle.contract.exceptions import EngineRejected, EngineUnhealthy
from rollout_lifecycle.contract.values import ALL_TAGS, PauseMode, Tag
from rollout_lifecycle.testing.sim_calls import SimCalls
from rollout_lifecycle.testing.sim_scheduler import SimScheduler
from rollout_lifecycle.testing.sim_state import (
    KNOWN_TAGS,
    RESUME_ORDER,
    SIM_VERSION,
    SimRequest,
    SimState,
    requested_tags,
    seconds_of,
)


class SimControl:
    """The lifecycle calls and probes of one simulated server (``SimulatedEngine`` documents
    each): what they change is in ``state``; what they do to requests, ``scheduler`` does;
    each call is taken by ``calls``."""

    def __init__(self, state: SimState, scheduler: SimScheduler, calls: SimCalls) -> None:
        self._state = state
        self._scheduler = scheduler
        self._calls = calls

    def _tag_names(self, op: str, tags: Sequence[Tag | str] | None) -> list[str]:
        if isinstance(tags, str):
            # The server's body schema wants a list; a bare string is a 400, not per-char tags.
            raise EngineRejected(self._state.label, op, f"tags must be a list, got {tags!r}", 400)
        if not tags:
            return [t.value for t in ALL_TAGS]
        return [t.value if isinstance(t, Tag) else str(t) for t in tags]

    async def pause_generation(self, mode: PauseMode | str) -> None:
        """``POST /pause_generation``."""
        raw = mode.value if isinstance(mode, PauseMode) else mode
        async with self._calls.op("pause_generation", mode=raw):
            # sglang: io_struct.py PauseGenerationReqInput.mode is a Literal of these three; any
            # other (the library's "wait" included) is a 400 validation error, nothing paused.
            if raw not in PAUSE_MODES:
                valid = ", ".join(PAUSE_MODES)
                raise EngineRejected(
                    self._state.label,
                    "pause_generation",
                    f"unknown mode {mode!r}; valid: {valid}"
                    + (
                        " (SGLangHTTPEngine carries the library's wait mode out)"
                        if raw == "wait"
                        else ""
                    ),
                    400,
                )
            await self._scheduler.pause(PauseMode(raw))

    async def continue_generation(self) -> None:
        """``POST /continue_generation``."""
        async with self._calls.op("continue_generation"):
            self._scheduler.unpause()

    async def flush_cache(self, timeout: float) -> None:
        """``POST /flush_cache?timeout=T``, one flush at a time."""
        # sglang: flush_wrapper.py SchedulerFlushWrapper.handle / check_pending;
        # scheduler.py Scheduler.flush_cache (is_fully_idle(ignore_waiting=self._engine_paused))
        state = self._state
        op = "flush_cache"
        async with self._flush_turn(), self._calls.op(op, timeout=timeout):
            if seconds_of(timeout) is None:
                raise EngineRejected(state.label, op, f"bad timeout {timeout!r}", 400)
            if timeout <= 0 or state.is_idle(ignore_waiting=False):
                self._flush_now(op)
                return
            state.flush_pending = True
            try:
                clock = asyncio.get_running_loop().time  # the clock the wait times out on
                deadline = clock() + timeout
                while not state.is_idle(ignore_waiting=False):
                    remaining = deadline - clock()
                    if remaining <= 0:
                        raise EngineRejected(state.label, op, FLUSH_TIMED_OUT, 400)
                    await state.wait_changed(remaining)
                    state.check_alive(op)
            finally:
                state.flush_pending = False
            self._flush_now(op)

    @contextlib.asynccontextmanager
    async def _flush_turn(self) -> AsyncIterator[None]:
        """One flush at a time, as SGLang's front end queues them; ``flush_waiters`` counts the
        flushes waiting for their turn."""
        state = self._state
        if state.flush_queue is None:
            state.flush_queue = asyncio.Lock()
        state.flush_waiters += 1
        try:
            await state.flush_queue.acquire()
        finally:
            state.flush_waiters -= 1
        try:
            yield
        finally:
            state.flush_queue.release()

    def _flush_now(self, op: str) -> None:
        # sglang: scheduler.py Scheduler.flush_cache
        state = self._state
        if not state.is_idle(ignore_waiting=state.paused):
            raise EngineRejected(state.label, op, FLUSH_FAILED.strip(), 400)
        state.prefix_cache.clear()
        state.counts["flushes"] += 1

    async def release_memory_occupation(self, tags: Sequence[Tag | str] | None) -> None:
        """``POST /release_memory_occupation``."""
        state = self._state
        op = "release_memory_occupation"
        async with self._calls.op(op, requested_tags=requested_tags(tags)) as entry:
            # SGLang asks "is TAG in tags" once per tag, so a tag named twice is released once.
            # sglang: weight_updater.py SchedulerWeightUpdaterManager.release_memory_occupation
            names = list(dict.fromkeys(self._tag_names(op, tags)))
            entry["tags"] = tuple(names)
            if not state.is_idle(ignore_waiting=state.paused):
                # The scheduler asserts idleness; the failed assertion takes the server down.
                raise self._calls.fatal(
                    entry,
                    f"assertion failed in release_memory_occupation: engine not idle "
                    f"({len(state.running)} running, {len(state.waiting)} waiting, "
                    f"paused={state.paused}, mode={state.pause_value()})",
                )
            for name in names:
                if name not in KNOWN_TAGS:
                    continue  # SGLang does not check tag names: a typo frees nothing.
                if name in state.released:
                    raise self._calls.fatal(
                        entry,
                        f"memory saver aborted: tag {name!r} released twice (process exited)",
                    )
                state.released[name] = None
                if name == Tag.KV_CACHE.value:
                    state.prefix_cache.clear()  # releasing the KV pool flushes the cache itself
            state.notify()

    async def resume_memory_occupation(self, tags: Sequence[Tag | str] | None) -> None:
        """``POST /resume_memory_occupation``."""
        state = self._state
        op = "resume_memory_occupation"
        async with self._calls.op(op, requested_tags=requested_tags(tags)) as entry:
            names = self._tag_names(op, tags)
            entry["tags"] = tuple(names)
            ordered = [t for t in RESUME_ORDER for name in names if name == t]
            for name in ordered:
                if name not in state.released:
                    raise self._calls.fatal(
                        entry,
                        f"KeyError in scheduler: resume of tag {name!r}, which is not released",
                    )
                if state.gpu_memory_bytes is not None:
                    need = state.resident_bytes() + state.external_bytes + state.capacity[name]
                    if need > state.gpu_memory_bytes:
                        raise self._calls.fatal(
                            entry,
                            f"CUDA out of memory resuming {name!r}: needs {need} bytes of "
                            f"{state.gpu_memory_bytes} ({state.external_bytes} held elsewhere)",
                        )
                del state.released[name]
                if name == Tag.WEIGHTS.value and not state.weights_cpu_backup:
                    # Without --enable-weights-cpu-backup the remapped pages hold garbage.
                    state.weights_valid = False
            state.notify()

    async def health(self) -> None:
        """``GET /health_generate``."""
        state = self._state
        op = "health"
        async with self._calls.op(op):
            state.health_seq += 1
            state.counts["health_checks"] += 1
            loop = asyncio.get_running_loop()
            req = SimRequest(
                rid=f"HEALTH_CHECK_{state.label}_{state.health_seq}",
                prompt=[1],
                max_new_tokens=1,
                future=loop.create_future(),
                internal=True,
            )
            self._scheduler.enqueue(req)
            try:
                await asyncio.wait({req.future}, timeout=state.health_timeout)
            except asyncio.CancelledError:
                self._scheduler.discard(req)
                req.future.cancel()
                raise
            if not req.future.done():
                # While paused the probe just hangs; the server gives up and calls itself sick.
                self._scheduler.discard(req)
                req.future.cancel()
                state.healthy = False
                raise EngineRejected(
                    state.label,
                    op,
                    f"no token within {state.health_timeout:g}s (paused={state.paused})",
                    503,
                )
            exc = req.future.exception()
            if exc is not None:
                state.check_alive(op)
                raise exc
            if req.future.result()["meta_info"]["finish_reason"]["type"] == "abort":
                state.healthy = False
                raise EngineRejected(state.label, op, "health check request was aborted", 503)
            state.healthy = True

    async def weight_version(self) -> str:
        """``GET /model_info``'s weight version."""
        # sglang: http_server.py model_info (tokenizer_manager.config_value("weight_version"))
        async with self._calls.op("weight_version"):
            version = self._state.served_version
        return version

    async def ready(self) -> bool:
        """``GET /ready``."""
        # sglang: tokenizer_manager.py TokenizerManager.is_ready (not is_pause and is_healthy)
        async with self._calls.op("ready"):
            ready = not self._state.paused and self._state.healthy
        return ready

    async def ping(self) -> bool:
        """``GET /ping``."""
        # sglang: http_server.py sagemaker_health (200 when is_healthy(); unlike /ready, a
        # paused server answers 200)
        async with self._calls.op("ping"):
            healthy = self._state.healthy
        return healthy

    async def observe(
        self, *, paused: bool = True, identify: bool = True, purpose: str | None = None
    ) -> dict[str, Any]:
        """``/server_info``'s incarnation and the pause ``/ping`` and ``/ready`` tell; a server
        of several ranks that lost one is ``EngineUnhealthy``, as the SGLang driver finds it
        (its ``/server_info`` waits for every rank: ``SGLangLink._server_info``)."""
        calls, state = self._calls, self._state
        if state.lost_ranks and (identify or state.dp_size > 1):
            entry = calls.at_once("observe", purpose)
            error = EngineUnhealthy(state.label, "observe", state.dp_size, None)
            entry["outcome"], entry["detail"] = "dead", error.message
            raise error
        if calls.answers_at_once("observe") and not state.slow_ranks:
            calls.at_once("observe", purpose)
            return self._observed(paused=paused, identify=identify)
        async with calls.op("observe", purpose):
            found = self._observed(paused=paused, identify=identify)
        return found

    def _observed(self, *, paused: bool, identify: bool) -> dict[str, Any]:
        state = self._state
        return {
            "incarnation": state.incarnation if identify else None,
            "paused": state.paused if paused and state.healthy else None,
        }

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info``."""
        # sglang: http_server.py server_info; utils/common.py build_server_info;
        # scheduler_components/internal_state.py get_internal_state
        state = self._state
        async with self._calls.op("server_info"):
            args = state.server_args()
            info = {
                **args,
                "launch_command": "python -m sglang.launch_server --model-path "
                + str(args["model_path"]),
                "startup_time": state.startup_time(),
                "internal_states": [
                    {
                        **args,
                        "world_size": 1,
                        "effective_max_running_requests_per_dp": state.max_running,
                        "last_gen_throughput": 0.0,
                        "memory_usage": state.memory_usage(),
                    }
                ],
                "version": SIM_VERSION,
                "frontend": "python",
            }
        return info

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request``."""
        async with self._calls.op("abort_request", rid=rid, abort_all=abort_all) as entry:
            # sglang: tokenizer_manager.py TokenizerManager.abort_request (exact rid lookup in
            # rid_to_state; the scheduler then aborts what starts with it:
            # scheduler.py Scheduler.abort_request)
            if abort_all:
                count = await self._scheduler.abort(lambda _: True, "aborted by abort_request")
            elif rid and rid in self._state.in_flight:
                count = await self._scheduler.abort(
                    lambda r: r.rid.startswith(rid), "aborted by abort_request"
                )
            else:
                count = 0
            entry["detail"] = f"{count} aborted"
