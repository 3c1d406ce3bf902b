"""A simulated SGLang 0.5.23 engine that keeps SGLang's lifecycle contract, fatal misuse included.

Tests, demos and benchmarks drive it instead of a GPU server; misuse kills it as it kills SGLang.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.backends.sglang_api import (
    FLUSH_FAILED,
    FLUSH_TIMED_OUT,
    WEIGHTS_WRITTEN_FLUSH_FAILED,
)
from rollout_lifecycle.contract.exceptions import EngineRejected, EngineUnreachable, InvalidArgument
from rollout_lifecycle.contract.values import PauseMode, Tag, check_int
from rollout_lifecycle.testing.sim_state import (
    DEFAULT_MEMORY_BYTES,
    DEFAULT_WEIGHT_VERSION,
    GIB,
    KNOWN_TAGS,
    KV_BYTES_PER_TOKEN,
    RESUME_ORDER,
    SIM_VERSION,
    SimRequest,
    requested_tags,
    seconds_of,
)
from rollout_lifecycle.testing.sim_weights import SimWeights


class SimulatedEngine(SimWeights):
    """One simulated SGLang server: generation that takes time, memory per tag, the lifecycle.

    Runs on the asyncio loop of its first caller (a scheduler task started lazily); no threads.
    A fatal misuse (see docs/sglang-contract.md) kills it: in-flight generates and
    every later call raise ``EngineDead``.
    """

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
            if seconds_of(timeout) is None:
                raise EngineRejected(self._label, op, f"bad timeout {timeout!r}", 400)
            if timeout <= 0 or self._is_idle(ignore_waiting=False):
                self._flush_now(op)
                return
            self._flush_pending = True
            try:
                clock = asyncio.get_running_loop().time  # the clock the wait times out on
                deadline = clock() + timeout
                while not self._is_idle(ignore_waiting=False):
                    remaining = deadline - clock()
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
        async with self._op(op, requested_tags=requested_tags(tags)) as entry:
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
                if name not in KNOWN_TAGS:
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
        async with self._op(op, requested_tags=requested_tags(tags)) as entry:
            names = self._tag_names(op, tags)
            entry["tags"] = tuple(names)
            ordered = [t for t in RESUME_ORDER for name in names if name == t]
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

    async def health(self) -> None:
        """``GET /health_generate``: a real one-token generation; 503 if it does not finish."""
        op = "health"
        async with self._op(op):
            self._health_seq += 1
            self._counts["health_checks"] += 1
            loop = asyncio.get_running_loop()
            req = SimRequest(
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

    async def ping(self) -> bool:
        """``GET /ping``: True while healthy, paused or not (a health check that timed out
        marks the server unhealthy until one succeeds)."""
        # sglang: http_server.py sagemaker_health (200 when is_healthy(); unlike /ready, a
        # paused server answers 200)
        async with self._op("ping"):
            healthy = self._healthy
        return healthy

    async def observe(self, *, paused: bool = True, identify: bool = True) -> dict[str, Any]:
        """What SGLang says of itself, read in one call (``EngineHost.observe``): the
        incarnation its ``/server_info`` names, and whether it is paused as ``/ping`` and
        ``/ready`` tell it (nothing while unhealthy)."""
        async with self._op("observe"):
            found = {
                "incarnation": self._incarnation if identify else None,
                "paused": self._paused if paused and self._healthy else None,
            }
        return found

    async def restart(self) -> None:
        """The server process is restarted at the same place: a fresh server answers there.

        Every request in flight is lost as a dropped connection (``EngineUnreachable``), the
        calls in flight fail, and the engine starts over as SGLang does: every tag resident, not
        paused, the initial weights and version, no session, a new incarnation in
        ``server_info()``. A dead engine comes back. The history and counters run on (a
        ``restart`` entry marks the moment; ``stats()["restarts"]`` counts them).
        """
        entry = self._record("restart", outcome="ok")
        for req in self._in_flight.values():
            if not req.future.done():
                req.future.set_exception(
                    EngineUnreachable(
                        self._label, "generate", "connection dropped: the server restarted"
                    )
                )
        self._in_flight.clear()
        task, self._scheduler = self._scheduler, None
        if task is not None and not task.done():
            task.cancel()
            if task.get_loop() is asyncio.get_running_loop():
                await asyncio.wait({task})
        self._notify()
        self._start_process()
        self._closed = False
        self._counts["restarts"] += 1
        entry["end"] = time.monotonic()

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
            "random_seed": self._random_seed,
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
            "token_capacity": self._capacity[Tag.KV_CACHE.value] // KV_BYTES_PER_TOKEN,
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
                "startup_time": dict(self._startup_time),
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


__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_WEIGHT_VERSION",
    "FLUSH_FAILED",
    "FLUSH_TIMED_OUT",
    "MAX_FLEET",
    "SIM_VERSION",
    "WEIGHTS_WRITTEN_FLUSH_FAILED",
    "SimulatedEngine",
    "check_engine_options",
    "fleet_factories",
]
