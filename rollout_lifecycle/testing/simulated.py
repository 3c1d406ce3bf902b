"""A simulated SGLang 0.5.23 engine that keeps SGLang's lifecycle contract, fatal misuse included.

Tests, demos and benchmarks drive it instead of a GPU server; misuse kills it as it kills SGLang.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.backends.sglang.api import (
    FLUSH_FAILED,
    FLUSH_TIMED_OUT,
    WEIGHTS_WRITTEN_FLUSH_FAILED,
)
from rollout_lifecycle.backends.sglang.client import data_parallel, serving_as
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.exceptions import EngineUnreachable, InvalidArgument
from rollout_lifecycle.contract.fingerprint import SIMULATED_SCHEME
from rollout_lifecycle.contract.values import (
    DEFAULT_GROUP_NAME,
    PauseMode,
    Tag,
    check_flag,
    check_int,
)
from rollout_lifecycle.testing.sim_calls import SimCalls
from rollout_lifecycle.testing.sim_control import SimControl
from rollout_lifecycle.testing.sim_scheduler import SimScheduler
from rollout_lifecycle.testing.sim_state import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_MEMORY_BYTES,
    DEFAULT_WEIGHT_VERSION,
    SIM_VERSION,
    SimState,
)
from rollout_lifecycle.testing.sim_weights import SimWeights


class SimulatedEngine:
    """One simulated SGLang server: generation that takes time, memory per tag, the lifecycle.

    Runs on the asyncio loop of its first caller (a scheduler task started lazily); no threads.
    A fatal misuse (see docs/sglang-contract.md) kills it: in-flight generates and
    every later call raise ``EngineDead``.
    """

    # Its parts, each given what it works on: the state the server holds and reports, the
    # scheduler of its requests, the front end that takes each control call, and the weight
    # and lifecycle calls. This class is the engine's face and delegates to them.

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
        dp_size: int = 1,
        gpu_memory_bytes: int | None = None,
        check_model_paths: bool = False,
        packed_weights: bool = False,
        model_path: str | None = None,
        disaggregation_mode: str = "null",
        disaggregation_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
    ) -> None:
        self._state = SimState(
            label,
            token_latency=token_latency,
            op_latency=op_latency,
            seed=seed,
            memory_bytes=memory_bytes,
            weight_version=weight_version,
            weights_cpu_backup=weights_cpu_backup,
            dp_dummy_batches=dp_dummy_batches,
            health_timeout=health_timeout,
            max_running=max_running,
            dp_size=dp_size,
            gpu_memory_bytes=gpu_memory_bytes,
            check_model_paths=check_model_paths,
            packed_weights=packed_weights,
            model_path=model_path,
            disaggregation_mode=disaggregation_mode,
            disaggregation_bootstrap_port=disaggregation_bootstrap_port,
        )
        self._scheduler = SimScheduler(self._state)
        declared = type(self).capabilities
        if dp_size > 1:
            declared = data_parallel(dp_size, declared)
        if disaggregation_mode != "null":
            declared = serving_as(declared, disaggregation_mode, disaggregation_bootstrap_port)
        self.capabilities = declared

    # The call parts hold nothing but the state and the scheduler, so each is made for the
    # call it takes and dropped with it. A fleet of thousands of in-process engines would
    # otherwise keep three more objects per engine for every full collection to visit.

    @property
    def _control(self) -> SimControl:
        state, scheduler = self._state, self._scheduler
        return SimControl(state, scheduler, SimCalls(state, scheduler))

    @property
    def _weights(self) -> SimWeights:
        state, scheduler = self._state, self._scheduler
        return SimWeights(state, scheduler, SimCalls(state, scheduler))

    # ----------------------------------------------------------------------------- properties

    #: What the simulator can do: SGLang's abilities, each tag on its own; its fingerprints
    #: digest what it records it holds (``SIMULATED_SCHEME``). One made with ``dp_size`` above
    #: 1 declares what a data-parallel SGLang server can do, one with a
    #: ``disaggregation_mode`` the half it serves as (``__init__``).
    capabilities: Capabilities = Capabilities("simulated", fingerprint_scheme=SIMULATED_SCHEME)

    @property
    def label(self) -> str:
        """The engine's name in errors and history."""
        return self._state.label

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks it reports (``/server_info`` ``dp_size``)."""
        return self._state.dp_size

    @property
    def dead(self) -> bool:
        """True once a fatal misuse has killed the engine."""
        return self._state.dead

    @property
    def paused(self) -> bool:
        """Whether generation is paused (introspection; the server shows it only as /ready 503)."""
        return self._state.paused

    def hold_arrivals(self, hold: bool) -> None:
        """Hold new requests in the front end while the scheduler runs on (``hold`` True), or
        let them reach it (unless paused): a drain, for models of engines that have one (the
        vLLM stand-in's wait pause). SGLang has no such state."""
        self._scheduler.hold_arrivals(hold)

    @property
    def pause_mode(self) -> str | None:
        """The mode of the current pause, or None (introspection)."""
        return self._state.pause_value()

    @property
    def released_tags(self) -> list[str]:
        """The memory tags released now, in tag order (introspection; SGLang tracks none)."""
        return self._state.released_tags()

    @property
    def weights_valid(self) -> bool:
        """False while the weights hold garbage (resumed without a CPU backup, not rewritten)."""
        return self._state.weights_valid

    @property
    def flush_pending(self) -> bool:
        """Whether a flush with a timeout is deferred, waiting for idleness (introspection)."""
        return self._state.flush_pending

    @property
    def weight_update_session_open(self) -> bool:
        """Whether a begin/end weight-update session is open (introspection)."""
        return self._state.session_open

    @property
    def death_reason(self) -> str | None:
        """What killed the engine, or None while it lives."""
        return self._state.death_reason

    # ----------------------------------------------------------------------------- introspection

    def memory(self) -> dict[str, int]:
        """Resident bytes per tag; a dead engine's process holds none."""
        return self._state.memory()

    def set_external_memory(self, nbytes: int) -> None:
        """Say how many bytes other processes (the trainer) hold on this engine's GPU."""
        self._state.set_external_memory(nbytes)

    def history(self) -> list[dict[str, Any]]:
        """Every lifecycle call that has returned (or raised), in order of start; a copy."""
        return self._state.history()

    def take_history(self) -> list[dict[str, Any]]:
        """``history()``, and forget what it returns; calls still running stay for a later take.

        A long run that checks its engines round by round takes each round's calls as it goes,
        so the engine's memory, and the work of keeping it, stays flat instead of growing with
        the run.
        """
        return self._state.take_history()

    def state(self) -> dict[str, Any]:
        """What SGLang keeps to itself (its ``/server_info`` shows none of it), for tests:
        label, dead, paused and the pause mode, released tags, whether the weights are valid,
        a deferred flush, an open weight-update session, the lifecycle calls in flight."""
        return self._state.state()

    def stats(self) -> dict[str, int]:
        """Counters of the work done so far and the current queues."""
        return self._state.stats()

    def server_args(self) -> dict[str, Any]:
        """The resolved server arguments this engine stands for (a subset of SGLang's)."""
        return self._state.server_args()

    def output_so_far(self, rid: str) -> list[int] | None:
        """The tokens the request ``rid`` has generated so far (a copy), or None once it is no
        longer in flight: what a streaming front end sends as they come."""
        req = self._state.in_flight.get(rid)
        return None if req is None else list(req.output)

    def set_forward_fault(self, reason: str | None) -> None:
        """With a ``reason``, the next forward pass kills the engine (weights a backend left
        half loaded); None lifts it. No SGLang call sets one."""
        if reason is not None and (not isinstance(reason, str) or not reason):
            raise InvalidArgument(f"reason must be a non-empty string or None, got {reason!r}")
        self._state.forward_fault = reason
        self._state.notify()

    def set_weights_cpu_backup(self, backup: bool) -> None:
        """Whether a later release of the weights keeps a host copy (a resume restores them)
        or not (a resume leaves garbage until a weight write): ``weights_cpu_backup`` changed
        for the releases that follow."""
        self._state.weights_cpu_backup = check_flag("backup", backup)

    def _die(self, reason: str) -> None:
        """Kill the engine as a crash of its process would (the stand-in's injected deaths)."""
        self._scheduler.die(reason)

    # ----------------------------------------------------------------------------- generation

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``: runs to completion, or returns early with finish reason abort."""
        return await self._scheduler.generate(request)

    # ----------------------------------------------------------------------------- lifecycle

    async def pause_generation(self, mode: PauseMode | str) -> None:
        """``POST /pause_generation``: abort, retract or freeze in-flight requests; then paused."""
        await self._control.pause_generation(mode)

    async def continue_generation(self) -> None:
        """``POST /continue_generation``: let the scheduler run again (harmless if not paused).

        Requests the front end held while paused go to the scheduler now, behind the ones it
        already had."""
        await self._control.continue_generation()

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
        await self._control.flush_cache(timeout)

    async def release_memory_occupation(self, tags: Sequence[Tag | str] | None) -> None:
        """``POST /release_memory_occupation``; empty tags mean all three."""
        await self._control.release_memory_occupation(tags)

    async def resume_memory_occupation(self, tags: Sequence[Tag | str] | None) -> None:
        """``POST /resume_memory_occupation``; empty tags mean all three."""
        await self._control.resume_memory_occupation(tags)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request``: with one tokenizer worker, ``rid`` must be a live request's
        id exactly; ``rid=""`` without ``abort_all`` does nothing; ``abort_all`` aborts every
        request the scheduler holds."""
        await self._control.abort_request(rid, abort_all)

    async def health(self) -> None:
        """``GET /health_generate``: a real one-token generation; 503 if it does not finish."""
        await self._control.health()

    async def weight_version(self) -> str:
        """The served weight version (``GET /model_info``): ``"default"`` until an update that
        succeeded as a whole (or ``update_weight_version``) names another."""
        return await self._control.weight_version()

    async def ready(self) -> bool:
        """``GET /ready``: True only when not paused and healthy (a health check that timed
        out marks the server unhealthy until one succeeds)."""
        return await self._control.ready()

    async def ping(self) -> bool:
        """``GET /ping``: True while healthy, paused or not (a health check that timed out
        marks the server unhealthy until one succeeds)."""
        return await self._control.ping()

    def observe(
        self, *, paused: bool = True, identify: bool = True, purpose: str | None = None
    ) -> Awaitable[dict[str, Any]]:
        """What SGLang says of itself, read in one call (``EngineHost.observe``): the
        incarnation its ``/server_info`` names, and whether it is paused as ``/ping`` and
        ``/ready`` tell it (nothing while unhealthy). ``purpose`` marks a read made to check
        the engine in the history (``check_of``)."""
        # (the control's coroutine handed back: one less per read, thousands per phase)
        return self._control.observe(paused=paused, identify=identify, purpose=purpose)

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info`` in SGLang's shape: the resolved server arguments (keys
        included), ``launch_command``, ``version`` and one ``internal_states`` entry per DP rank
        with ``memory_usage`` as measured at load. Nothing in it says paused or released:
        ``ready()`` and the introspection properties do."""
        return await self._control.server_info()

    # ----------------------------------------------------------------------------- weights

    async def begin_weight_update(self, selector: str = "all") -> None:
        """``POST /begin_weight_update``: open a session (400 if one is open)."""
        await self._weights.begin_weight_update(selector)

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update``: close the session (400 if none is open)."""
        await self._weights.end_weight_update()

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
    ) -> None:
        """``POST /update_weights_from_disk`` (needs no session)."""
        await self._weights.update_weights_from_disk(
            model_path,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
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
        await self._weights.update_weights_from_tensor(
            payload,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            selector=selector,
        )

    async def weight_fingerprint(self) -> dict[str, Any]:
        """``POST /weights_checker {"action": "checksum"}``: a digest per tensor held."""
        return await self._weights.weight_fingerprint()

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
        await self._weights.init_weights_update_group(
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name=group_name,
            backend=backend,
        )

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """``POST /destroy_weights_update_group``; 400 for a group that does not exist."""
        await self._weights.destroy_weights_update_group(group_name)

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
        await self._weights.update_weights_from_distributed(
            names,
            dtypes,
            shapes,
            group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            load_format=load_format,
            selector=selector,
        )

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = True) -> None:
        """``POST /update_weight_version``; SGLang's default aborts every request the scheduler
        holds (the front end's, held while paused, are out of its reach)."""
        await self._weights.update_weight_version(version, abort_all_requests=abort_all_requests)

    # ----------------------------------------------------------------------------- the process

    async def restart(self) -> None:
        """The server process is restarted at the same place: a fresh server answers there
        ``PROOF_WINDOW`` seconds after the old one's last call at the soonest.

        Every request in flight is lost as a dropped connection (``EngineUnreachable``), the
        calls in flight fail, and the engine starts over as SGLang does: every tag resident, not
        paused, the initial weights and version, no session, a new incarnation in
        ``server_info()``. A dead engine comes back. The history and counters run on (a
        ``restart`` entry marks the moment; ``stats()["restarts"]`` counts them).
        """
        state = self._state
        await state.new_process_may_answer()
        entry = state.record("restart", outcome="ok")
        for req in state.in_flight.values():
            if not req.future.done():
                req.future.set_exception(
                    EngineUnreachable(
                        state.label, "generate", "connection dropped: the server restarted"
                    )
                )
        state.in_flight.clear()
        await self._scheduler.stop()
        state.notify()
        state.start_process()
        state.closed = False
        state.counts["restarts"] += 1
        entry["end"] = time.monotonic()

    def lose_rank(self, rank: int) -> None:
        """The process of data-parallel rank ``rank`` dies while the rest of the server lives
        on, as a killed SGLang ``scheduler_DP1`` leaves it: the front end still answers
        ``/ping``, ``/ready`` and ``/model_info``; every call that needs the ranks
        (``/server_info`` and every lifecycle and weight call) waits for an answer that never
        comes. Generate requests are not dealt to ranks here: they run on. Until a restart."""
        state = self._state
        self._check_rank(rank)
        state.lost_ranks[rank] = None
        entry = state.record("lose_rank", outcome="ok", rank=rank)
        entry["end"] = entry["start"]

    def slow_rank(self, rank: int, seconds: float) -> None:
        """Data-parallel rank ``rank`` takes ``seconds`` to answer every call that waits for
        every rank (a pause, a flush, a release, ``/server_info``: those ``lose_rank`` would
        hang), so the server answers them that much later; 0 makes it as fast as the rest.
        Until a restart."""
        state = self._state
        self._check_rank(rank)
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
            raise InvalidArgument(f"seconds must be a number >= 0, got {seconds!r}")
        if seconds:
            state.slow_ranks[rank] = float(seconds)
        else:
            state.slow_ranks.pop(rank, None)
        entry = state.record("slow_rank", outcome="ok", rank=rank, seconds=seconds)
        entry["end"] = entry["start"]

    def _check_rank(self, rank: object) -> None:
        """Refuse a rank this server does not have."""
        ranks = self._state.dp_size
        if not isinstance(rank, int) or not 0 <= rank < ranks:
            raise InvalidArgument(f"rank must be one of the {ranks} ranks, got {rank!r}")

    async def close(self) -> None:
        """Stop the scheduler; in-flight generates get ``EngineDead``. Idempotent, never raises."""
        state = self._state
        entry = state.record("close", outcome="ok")
        if not state.closed:
            state.closed = True
            self._scheduler.drop_all("engine closed")
            state.notify()
            await self._scheduler.stop()
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
