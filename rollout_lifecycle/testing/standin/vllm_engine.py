"""The vLLM 0.32.0 engine behind the vLLM stand-in (``vllm_app``): vLLM's lifecycle (pause
modes, sleep levels and tags, the in-place reload, weight versions, checksums, the
weight-transfer session) over a ``SimulatedEngine``, which runs the requests.

Each method cites the vLLM function it models (paths under ``vllm/``). What a CPU server cannot
show is modelled from the source and is stand-in only: the device memory ``/sleep`` frees, the
weights a level-2 sleep loses, the weight-transfer session, and the death of the engine on the
forward pass after a failed reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from typing import Any

from rollout_lifecycle.contract.exceptions import EngineRejected, InvalidArgument
from rollout_lifecycle.contract.values import PauseMode
from rollout_lifecycle.testing.sim_state import SIM_TENSORS
from rollout_lifecycle.testing.simulated import SimulatedEngine

#: The version ``/version`` reports.
VLLM_VERSION = "0.32.0"
#: The memory a sleep of level 1 or 2 puts to sleep (``v1/executor/abstract.py SLEEP_TAGS``).
SLEEP_TAGS: tuple[str, ...] = ("weights", "kv_cache")
#: The worker's refusal without ``--weight-transfer-config``
#: (``v1/worker/gpu_worker.py Worker._check_weight_transfer_engine``).
NOT_CONFIGURED = (
    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
)
#: The tensors ``/weight_checker`` reports a checksum for (the simulated model's).
TENSORS: tuple[str, ...] = SIM_TENSORS
#: How often a ``wait`` pause asks whether the requests in flight have drained.
_DRAIN_POLL_S = 0.01
#: How long a ``wait`` pause waits for the requests in flight before it answers 500.
_DRAIN_DEADLINE_S = 600.0


class VLLMError(Exception):
    """A call vLLM answers with its error body (``serve/exception_handling``): ``status`` and
    ``message``, and the error type vLLM names."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    @property
    def kind(self) -> str:
        # vllm: entrypoints/serve/exception_handling/error_response.py create_error_response
        kinds = {400: "BadRequestError", 404: "NotFoundError"}
        return kinds.get(self.status, "InternalServerError")


class VLLMEngineModel:
    """One vLLM server's engine: the simulated engine runs the requests; this adds what vLLM
    keeps on top of them (sleeping tags and level, the loaded checkpoint, a failed reload, the
    weight-transfer session)."""

    def __init__(
        self, engine: SimulatedEngine, *, weights_path: str, weight_transfer: bool = False
    ) -> None:
        if not isinstance(engine, SimulatedEngine):
            raise InvalidArgument(f"engine must be a SimulatedEngine, got {engine!r}")
        self.engine = engine
        #: The API server's start (``process_start_time_seconds``).
        self.started = time.time()
        #: The tags asleep now (``Executor.sleeping_tags``) and the level of the last sleep.
        self.sleeping: set[str] = set()
        self.level = 0
        #: The sleep state the metrics gauge shows (``AsyncLLM.sleep`` / ``wake_up``).
        self.sleep_state = {"sleep": 0, "level": 0}
        #: A wait pause is draining the requests in flight (PAUSED_NEW).
        self._draining = False
        #: What the weights hold: the checkpoint last loaded, or the last transfer.
        self.weights_source = weights_path
        #: Why the next forward pass kills the engine (a reload failed), or None.
        self.broken: str | None = None
        self.weight_transfer = bool(weight_transfer)
        self.transfer_init: dict[str, Any] | None = None
        self.session_active = False
        self.transfers = 0
        self.weight_bytes = engine.memory().get("weights", 0)

    # ------------------------------------------------------------------ pause

    async def pause(self, mode: str, *, clear: bool = True) -> None:
        """``/pause?mode=``: abort answers every request with ``abort``; keep freezes them and
        gives back their KV blocks (they are recomputed after the resume); wait lets them end.
        Then, with ``clear`` (every pause; a sleep only from level 1), the prefix cache is
        reset."""
        # vllm: v1/engine/core.py EngineCoreProc.pause_scheduler: abort finishes every request
        # FINISHED_ABORTED; keep sets PAUSED_ALL; then _finish_pause(clear_cache=True) ->
        # _reset_caches(reset_running_requests=True), which preempts the running requests
        # (v1/core/sched/scheduler.py Scheduler.reset_prefix_cache), so their blocks are free.
        if mode not in ("abort", "wait", "keep"):
            raise VLLMError(f"Invalid pause mode: {mode}", 400)
        if mode == "wait":
            # vllm: PAUSED_NEW queues new requests and keeps stepping until the ones in flight
            # drain; the stand-in holds arrivals in the front end, waits for the scheduler to
            # empty (the engine publishes no drain event), then pauses. Requests an earlier keep
            # pause froze drain too: PAUSED_NEW steps whatever the pause state was.
            self.engine.hold_arrivals(True)
            self._draining = True
            try:
                if self.engine.paused:
                    await self.engine.continue_generation()
                try:
                    await self._drain()
                finally:  # paused even if the drain gave up (vLLM stays in PAUSED_NEW)
                    await self.engine.pause_generation(PauseMode.RETRACT)
            finally:
                self.engine.hold_arrivals(False)
                self._draining = False
        else:
            await self.engine.pause_generation(
                PauseMode.ABORT if mode == "abort" else PauseMode.RETRACT
            )
        if clear:
            await self.reset_prefix_cache()

    async def _drain(self) -> None:
        deadline = time.monotonic() + _DRAIN_DEADLINE_S
        while any(self.engine.stats()[k] for k in ("running", "waiting")):
            if time.monotonic() > deadline:
                left = {k: self.engine.stats()[k] for k in ("running", "waiting")}
                raise VLLMError(
                    f"a wait pause found requests after {_DRAIN_DEADLINE_S}s: {left}", 500
                )
            await asyncio.sleep(_DRAIN_POLL_S)

    async def resume(self) -> None:
        """``/resume``: the scheduler runs again, whatever is asleep."""
        # vllm: v1/engine/core.py EngineCore.resume_scheduler (sets UNPAUSED, checks nothing)
        await self.engine.continue_generation()

    async def reset_prefix_cache(self) -> bool:
        """``/reset_prefix_cache``: false while requests hold KV blocks."""
        # vllm: v1/core/block_pool.py BlockPool.reset_prefix_cache (False unless every block
        # but the null block is free)
        try:
            await self.engine.flush_cache(0)
        except EngineRejected:
            return False
        return True

    # ------------------------------------------------------------------ sleep

    async def sleep(self, level: int, mode: str) -> None:
        """``/sleep?level=&mode=``: pause (the mode), then at level 1 the weights go to host
        memory and the KV cache is dropped; at level 2 both are dropped."""
        # vllm: v1/engine/core.py EngineCore.sleep (pause_scheduler, then executor.sleep(level))
        if level not in (0, 1, 2):
            raise VLLMError(f"level must be 0, 1 or 2, got {level!r}", 400)
        # vllm: EngineCore.sleep pauses with clear_cache=(level >= 1)
        await self.pause(mode, clear=level >= 1)
        if level >= 1 and "weights" not in self.sleeping:
            # vllm: v1/executor/abstract.py Executor.sleep (a second sleep only warns);
            # v1/worker/gpu_worker.py Worker.sleep: level 1 offloads the weights to host
            # memory, level 2 keeps only the buffers, so the weights come back uninitialised.
            self.engine.set_weights_cpu_backup(level == 1)
            # device_allocator/cumem.py CuMemAllocator.sleep skips what is asleep already (the
            # KV cache, after a wake of the weights alone).
            await self.engine.release_memory_occupation(
                [t for t in SLEEP_TAGS if t not in self.sleeping]
            )
            self.sleeping = set(SLEEP_TAGS)
            self.level = level
        # vllm: v1/engine/async_llm.py AsyncLLM.sleep -> record_sleep_state(1, level)
        self.sleep_state = {"sleep": 1, "level": level}

    async def wake_up(self, tags: list[str] | None) -> bool:
        """``/wake_up?tags=``: wake the tags named (all when none); once nothing is asleep the
        scheduler resumes. Returns whether the engine is fully awake."""
        # vllm: v1/engine/core.py EngineCore.wake_up; v1/executor/abstract.py Executor.wake_up
        # (nothing asleep, or a tag not asleep: a warning, nothing woken)
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if (tags is None or tags) and self.sleeping:
            wanted = sorted(self.sleeping) if not tags else list(dict.fromkeys(tags))
            if all(t in self.sleeping for t in wanted):
                await self.engine.resume_memory_occupation(wanted)
                self.sleeping -= set(wanted)
        fully_awake = not self.sleeping
        if fully_awake:
            await self.resume()
            self.sleep_state = {"sleep": 0, "level": 0}
        return fully_awake

    @property
    def paused(self) -> bool:
        """``/is_paused``: paused, or draining for a wait pause (vLLM's PAUSED_NEW)."""
        # vllm: v1/engine/core.py EngineCore.is_scheduler_paused (pause_state != UNPAUSED)
        return self.engine.paused or self._draining

    def is_sleeping(self) -> bool:
        """``/is_sleeping``: paused, or memory asleep (``EngineCore.is_sleeping``)."""
        return self.paused or bool(self.sleeping)

    def memory(self) -> dict[str, Any]:
        """Stand-in only: the device bytes per tag (``SimulatedEngine.memory``) and the host
        bytes holding offloaded weights (level 1)."""
        host = self.weight_bytes if "weights" in self.sleeping and self.level == 1 else 0
        return {"device": self.engine.memory(), "host": {"weights": host}}

    def sleep_gauges(self) -> dict[str, int]:
        """``vllm:engine_sleep_state`` by state (``v1/metrics/loggers.py record_sleep_state``)."""
        asleep, level = self.sleep_state["sleep"], self.sleep_state["level"]
        return {
            "awake": 0 if asleep else 1,
            "weights_offloaded": int(bool(asleep) and level == 1),
            "discard_all": int(bool(asleep) and level == 2),
        }

    # ------------------------------------------------------------------ weights

    async def reload_weights(self, weights_path: object) -> None:
        """``/collective_rpc reload_weights {"weights_path"}``: reload in place. A path that
        holds no checkpoint fails after the layers were prepared for loading, and the model is
        left half loaded: the next forward pass kills the engine."""
        # vllm: model_executor/model_loader/reload/inplace.py reload_weights
        if not isinstance(weights_path, str) or not weights_path:
            raise VLLMError(f"weights_path must be a non-empty string, got {weights_path!r}")
        if not await asyncio.to_thread(os.path.isdir, weights_path):
            reason = f"reload_weights({weights_path!r}) failed: no checkpoint at that path"
            self.broken = reason
            self.engine.set_forward_fault(reason)
            raise VLLMError(f"{reason}; the model is left half loaded")
        await self._write("reload_weights", weights_path)
        self.weights_source = weights_path

    async def _write(self, op: str, source: str) -> None:
        try:
            await self.engine.update_weights_from_disk(
                source, weight_version=None, flush_cache=False, abort_all_requests=False
            )
        except EngineRejected as exc:
            raise VLLMError(f"{op} failed: {exc.message}") from None
        self.broken = None
        self.engine.set_forward_fault(None)

    async def checksums(self) -> dict[str, str]:
        """``/weight_checker {"action": "checksum"}``: sha256 per tensor, of what they hold."""
        # vllm: entrypoints/rl/online/api_router.py weight_checker
        source = self.weights_source if self.engine.weights_valid else "uninitialised"
        if self.broken is not None:
            source = f"half loaded: {self.broken}"
        return {name: hashlib.sha256(f"{source}\0{name}".encode()).hexdigest() for name in TENSORS}

    async def update_weight_version(self, version: str) -> None:
        """``/update_weight_version``: a label; nothing is aborted."""
        # vllm: v1/engine/async_llm.py AsyncLLM.update_weight_version
        await self.engine.update_weight_version(version, abort_all_requests=False)

    # ------------------------------------------------------------------ weight transfer

    def _check_transfer(self) -> None:
        # vllm: v1/worker/gpu_worker.py Worker._check_weight_transfer_engine
        if not self.weight_transfer:
            raise VLLMError(NOT_CONFIGURED)

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """``/init_weight_transfer_engine {"init_info"}`` (the stand-in forms no group)."""
        # vllm: v1/worker/gpu_worker.py Worker.init_weight_transfer_engine
        self._check_transfer()
        self.transfer_init = dict(init_info)

    async def start_weight_update(self) -> None:
        """``/start_weight_update``: open the session (a second start fails)."""
        # vllm: v1/worker/gpu_worker.py Worker._start_weight_update
        self._check_transfer()
        if self.session_active:
            raise VLLMError(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        self.session_active = True

    async def update_weights(self, update_info: object) -> None:
        """``/update_weights {"update_info"}``: one chunk, loaded at once (a failed chunk
        ends the session)."""
        # vllm: v1/worker/gpu_worker.py Worker.update_weights
        self._check_transfer()
        if not self.session_active:
            raise VLLMError("start_weight_update must be called before update_weights.")
        self.transfers += 1
        try:
            await self._write("update_weights", f"transfer-{self.transfers}")
        except VLLMError:
            self.session_active = False
            raise
        self.weights_source = f"transfer-{self.transfers}"

    async def finish_weight_update(self, weight_version: str | None) -> None:
        """``/finish_weight_update {"weight_version"}``: close the session, then set the
        version when one is given."""
        # vllm: v1/worker/gpu_worker.py Worker.finish_weight_update;
        # v1/engine/async_llm.py AsyncLLM.finish_weight_update
        self._check_transfer()
        if not self.session_active:
            raise VLLMError("finish_weight_update called without a matching start_weight_update.")
        self.session_active = False
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    # ------------------------------------------------------------------ requests

    async def abort(self, request_ids: list[str] | None) -> int:
        """``/abort_requests``: the requests by the ids vLLM knows them by, or every one."""
        # vllm: entrypoints/rl/online/api_router.py abort_requests (the count answered is the
        # ids asked, or every request tracked)
        if request_ids:
            for rid in request_ids:
                with contextlib.suppress(EngineRejected):
                    await self.engine.abort_request(str(rid))
            return len(request_ids)
        count = sum(self.engine.stats()[k] for k in ("running", "waiting"))
        await self.engine.abort_request("", abort_all=True)
        return count

    def state(self) -> dict[str, Any]:
        """Stand-in only: what vLLM keeps to itself, with the simulated engine's state."""
        return {
            **self.engine.state(),
            "sleeping_tags": sorted(self.sleeping),
            "sleep_level": self.level,
            "broken": self.broken,
            "weights_source": self.weights_source,
            "weight_transfer": self.weight_transfer,
            "weight_update_active": self.session_active,
        }


__all__ = [
    "NOT_CONFIGURED",
    "SLEEP_TAGS",
    "TENSORS",
    "VLLM_VERSION",
    "VLLMEngineModel",
    "VLLMError",
]
