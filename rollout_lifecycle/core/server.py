"""``RolloutServer``: drives engine groups through the lifecycle states with server-wide barriers.

Each public call is a sequence of transitions of one ``transitions.AsyncMachine`` built from
``TRANSITIONS``. Every transition runs one or two *phases*; a phase issues one call per targeted
engine (through the groups, which guard each call) and gathers all of them, with a deadline,
before anything else happens. Calls are serialized, and a cancelled caller never abandons a phase
in flight: the phase settles, the server stops at that boundary, then ``CancelledError``
propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import functools
import inspect
import logging
import time
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Hashable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from transitions.extensions.asyncio import AsyncMachine

from rollout_lifecycle.backends.engine import EngineHost
from rollout_lifecycle.backends.gather import gather_calls
from rollout_lifecycle.backends.hosted import HostedEngine
from rollout_lifecycle.core.config import (
    WEIGHT_TAGS,
    DeadEnginePolicy,
    LifecycleConfig,
    PauseMode,
    Tag,
)
from rollout_lifecycle.core.events import logger
from rollout_lifecycle.core.exceptions import (
    HookFailed,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    PhaseFailed,
    StaleWeights,
)
from rollout_lifecycle.core.generation import GenerationClient
from rollout_lifecycle.core.group import (
    Calls,
    EngineGroup,
    EngineRecord,
    EngineSnapshot,
    _as_handle,
    engine_identity,
    send_to_engine,
)
from rollout_lifecycle.core.outcome import EngineOutcome, Outcome, classify
from rollout_lifecycle.core.states import TRANSITIONS, ServerState, sources_of
from rollout_lifecycle.core.timeline import EngineCalls, Timeline, _CallRecord

T = TypeVar("T")
S = ServerState

Hook = Callable[["LifecycleEvent"], Any]
#: Receives the server's snapshot whenever its records change (see ``RolloutServer``).
Journal = Callable[["ServerSnapshot"], None]
#: Makes a replacement engine for an engine id (``"group/index"``); may be async.
EngineFactory = Callable[[str], Any]
WeightPush = Callable[["WeightUpdate"], Any]

#: Phases with ``before_<phase>`` / ``after_<phase>`` hook events, in the order a cycle runs them.
HOOK_PHASES: tuple[str, ...] = (
    "pause",
    "flush",
    "release",
    "resume_weights",
    "update_weights",
    "resume_kv",
    "continue",
)
#: The events hooks can subscribe to: entering each state, and before / after each phase.
HOOK_EVENTS: tuple[str, ...] = (
    *(s.value for s in ServerState),
    *(f"{when}_{phase}" for phase in HOOK_PHASES for when in ("before", "after")),
)


@dataclass(frozen=True)
class LifecycleEvent:
    """What a hook receives: the event, the state entered and the one left."""

    event: str
    state: ServerState
    previous: ServerState
    server: RolloutServer
    #: The phase, for ``before_<phase>`` / ``after_<phase>`` events.
    phase: str | None = None


@dataclass(frozen=True)
class WeightUpdate:
    """What a weight-push callable receives: the version and the engines to write to."""

    version: str | None
    #: Engine id -> engine handle, for every live engine whose weights are being written.
    engines: Mapping[str, Any]


@dataclass(frozen=True)
class GroupSnapshot:
    """One group's engines at one moment."""

    name: str
    needs_offload: bool
    engines: tuple[EngineSnapshot, ...]


@dataclass(frozen=True)
class ServerSnapshot:
    """The server's aggregate state and what it knows of every engine."""

    name: str
    state: ServerState
    groups: tuple[GroupSnapshot, ...]

    def engines(self) -> dict[str, EngineSnapshot]:
        """Every engine's snapshot by id."""
        return {e.id: e for g in self.groups for e in g.engines}

    def in_flight(self) -> bool:
        """Whether a live engine's record shows a call without an answer (uncertain tags, a
        pause or a weight-update session unknown): taken mid-call, or left by a failed one."""
        return any(
            e.alive and (e.uncertain or e.pause_unknown or e.session_unknown)
            for g in self.groups
            for e in g.engines
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for logging or JSON."""
        out = asdict(self)
        out["state"] = self.state.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerSnapshot:
        """The snapshot ``to_dict()`` gave (read back from JSON, say); ``InvalidArgument`` if
        ``data`` is not one."""
        engine = EngineSnapshot.from_dict
        try:
            groups = tuple(
                GroupSnapshot(g["name"], g["needs_offload"], tuple(map(engine, g["engines"])))
                for g in data["groups"]
            )
            snapshot = cls(data["name"], ServerState(data["state"]), groups)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"not a server snapshot: {type(exc).__name__}: {exc}") from None
        if not isinstance(snapshot.name, str) or not all(
            isinstance(g.name, str) and isinstance(g.needs_offload, bool) for g in groups
        ):
            raise InvalidArgument("not a server snapshot: a name or needs_offload is mistyped")
        return snapshot


@dataclass(eq=False)
class _Operation:
    """One public call in progress; ``cancelled`` asks it to stop at the next phase boundary."""

    call: str
    cancelled: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    #: Phases whose ``before_`` hooks ran in the transition in progress (their ``after_``
    #: hooks run once it completes).
    phases: list[str] = field(default_factory=list)
    #: The user code (hooks, weight push, factory) this operation is waiting for: cancelling
    #: the operation cancels it.
    running: set[asyncio.Future[Any]] = field(default_factory=set)


@dataclass(eq=False)
class _Scope:
    """One run of user code (a hook, weight push or factory) inside an operation.

    A call to the server made while it runs is part of the operation (it runs inline, since
    the operation holds the lock, one at a time per scope); once the user code has returned
    or was stopped, a call from a task it left behind is a call of its own, serialized behind
    the operation. Calls still running inline when the user code returns finish before the
    operation goes on.
    """

    closed: bool = False
    #: The task running async user code: it has returned once the task is done (even before
    #: the operation has resumed to notice).
    task: asyncio.Future[Any] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: dict[asyncio.Future[Any], _Operation] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        """Whether the user code is still running."""
        return not self.closed and (self.task is None or not self.task.done())


_Current = tuple["RolloutServer", _Operation, _Scope | None]
_CURRENT: contextvars.ContextVar[_Current | None] = contextvars.ContextVar(
    "rollout_lifecycle_current_operation", default=None
)


class _HookCancelled(HookFailed):
    """User code was cancelled because its operation was: the call stops at the last
    boundary it completed and its caller sees ``CancelledError``."""


def _cancel(op: _Operation) -> None:
    """Ask ``op`` to stop at its next boundary, and cancel the user code it waits for."""
    op.cancelled = True
    for task in list(op.running):
        task.cancel()


class _Machine:
    """The model the state machine runs on; phase callbacks delegate to the server."""

    state: str

    def __init__(self, server: RolloutServer) -> None:
        self._server = server

    async def _phase_drain(self, event: Any) -> None:
        await self._server._drain(event.kwargs["groups"])

    async def _phase_release(self, event: Any) -> None:
        await self._server._release()

    async def _phase_restore_weights(self, event: Any) -> None:
        await self._server._restore("weights")

    async def _phase_restore_kv(self, event: Any) -> None:
        await self._server._restore("kv")

    async def _phase_write_weights(self, event: Any) -> None:
        await self._server._write_weights(event.kwargs["push"], event.kwargs["version"])

    async def _phase_continue(self, event: Any) -> None:
        await self._server._continue()

    def _settles_in_serving(self, event: Any) -> bool:
        return self._server._settled_state() is S.SERVING

    def _settles_in_drained(self, event: Any) -> bool:
        return self._server._settled_state() is S.DRAINED

    def _settles_in_released(self, event: Any) -> bool:
        return self._server._settled_state() is S.RELEASED

    def _settles_in_weights_restored(self, event: Any) -> bool:
        return self._server._settled_state() is S.WEIGHTS_RESTORED


class RolloutServer:
    """Coordinates engine groups through ``serving -> ... -> released -> ... -> serving``.

    All lifecycle calls are coroutines. See ``docs/design.md`` for the states and the
    invariants every call keeps.

    ``journal``, if given, is called with ``snapshot()`` (synchronously, on the server's loop)
    whenever the records change: after the intent of calls that must not repeat is recorded
    and before they are sent (a release or resume leaves its tags uncertain, a pause or
    continue leaves the engine paused unknown), after every phase settles, and after every
    state change. Kept durably (``rollout-lifecycle ctl`` writes it to its state file), it
    survives a process killed at any instant, SIGKILL included: ``adopt()`` of the last entry
    refuses every call an engine might not survive until ``recover()`` or a restart settles
    it. A journal that raises before a send stops the call with nothing sent.
    """

    def __init__(
        self,
        groups: Sequence[EngineGroup],
        config: LifecycleConfig | None = None,
        *,
        name: str = "rollout",
        journal: Journal | None = None,
    ) -> None:
        if isinstance(groups, EngineGroup) or not isinstance(groups, Sequence):
            raise InvalidArgument(f"groups must be a sequence of EngineGroup, got {groups!r}")
        if not groups:
            raise InvalidArgument("a RolloutServer needs at least one EngineGroup")
        names: set[str] = set()
        owners: dict[Hashable, str] = {}
        for group in groups:
            if not isinstance(group, EngineGroup):
                raise InvalidArgument(f"expected an EngineGroup, got {group!r}")
            if group.name in names:
                raise InvalidArgument(f"two groups are named {group.name!r}")
            names.add(group.name)
            for record in group.records:
                key = engine_identity(record.handle)
                if key in owners:
                    raise InvalidArgument(
                        f"engine {record.id} is also engine {owners[key]}; an engine belongs "
                        f"to one group, once"
                    )
                owners[key] = record.id
        if config is None:
            config = LifecycleConfig()
        if not isinstance(config, LifecycleConfig):
            raise InvalidArgument(f"config must be a LifecycleConfig, got {config!r}")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"server name must be a non-empty string, got {name!r}")
        if journal is not None and not callable(journal):
            raise InvalidArgument(f"journal must be callable or None, got {journal!r}")
        self._journal = journal
        if journal is not None:
            for group in groups:
                group._before_send = self._write_journal
        self._name = name
        self._groups = tuple(groups)
        self._by_name = {g.name: g for g in self._groups}
        self._config = config
        self._hooks: dict[str, list[Hook]] = {e: [] for e in HOOK_EVENTS}
        self._lock = asyncio.Lock()
        #: Calls that missed their phase's deadline and may still land, by engine id.
        self._stragglers: dict[str, asyncio.Future[Any]] = {}
        self._metrics: dict[str, float] = {}
        #: The engine behind each ``..._slowest_s`` metric of the last call of each kind.
        self._slowest: dict[str, str] = {}
        self._timeline = Timeline(config.timeline_calls, name=name)
        #: The public call in progress, as the timeline records it, and the slowest engine of
        #: each of its phases (set under the lock, so one at a time).
        self._trace: _CallRecord | None = None
        self._call_slowest: dict[str, str] = {}
        self._expected_version: str | None = None
        self._generation: GenerationClient | None = None
        self._last_outcomes: dict[str, EngineOutcome] = {}
        self._model = _Machine(self)
        self._machine = AsyncMachine(
            model=self._model,
            states=[s.value for s in ServerState],
            transitions=[_plain(row) for row in TRANSITIONS],
            initial=S.SERVING.value,
            auto_transitions=False,
            send_event=True,
        )

    def __repr__(self) -> str:
        return f"RolloutServer({self._name!r}, state={self.state.value!r}, groups={self._groups!r})"

    # -- inspection ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The server's name (in every event it emits)."""
        return self._name

    @property
    def config(self) -> LifecycleConfig:
        """The lifecycle configuration."""
        return self._config

    @property
    def groups(self) -> tuple[EngineGroup, ...]:
        """The engine groups, in order."""
        return self._groups

    @property
    def state(self) -> ServerState:
        """The aggregate state."""
        return ServerState(self._model.state)

    @property
    def expected_version(self) -> str | None:
        """The version of the last versioned weight update; generation continues only on
        engines that report it."""
        return self._expected_version

    @property
    def metrics(self) -> dict[str, float]:
        """The metrics of the last completed call of each kind: one flat dict of plain numbers
        a trainer can log as is. Each call also returns its own metrics (the same keys).

        Keys are ``lifecycle/<call>/<name>``. ``<call>`` is the public call (``offload``,
        ``onload_weights``, ``update_weights``, ``onload_kv``, ``onload``, ``pause``,
        ``resume``, ``reset``, ``recover``; a call made from a hook keeps its own name).
        ``<name>`` is one of:

        - ``total_s``: the whole call, in seconds;
        - ``<phase>_s``: one phase, from its first engine call to its barrier (every engine
          answered or the deadline passed), summed if the phase ran more than once. ``<phase>``
          is the name in the ``phase.*`` events and hooks (``pause``, ``flush``, ``release``,
          ``continue``, ``begin_weight_update``, ``end_weight_update``,
          ``update_weight_version``, ``flush_after_update``, ``check_versions``,
          ``recover_*``, ...), except three shorter ones: ``weights`` (``resume_weights``),
          ``kv`` (``resume_kv``) and ``update`` (the weight push);
        - ``<phase>_slowest_s``: the slowest single engine call of the phase;
          ``slowest_engines`` names the engine (an id is not a number);
        - ``<phase>_retries``: for a phase that flushes, the flush attempts beyond the first,
          summed over the engines whose flush passed (each a 400 "not idle yet");
        - ``<tag>_bytes_before`` / ``<tag>_bytes_after``: with
          ``LifecycleConfig(memory_metrics=True)``, the resident bytes of each memory tag
          summed over the live engines that account memory, before and after the call.

        For example ``lifecycle/offload/pause_s``, ``lifecycle/offload/flush_retries``,
        ``lifecycle/onload_kv/kv_slowest_s``, ``lifecycle/offload/kv_cache_bytes_after``.
        """
        return dict(self._metrics)

    @property
    def slowest_engines(self) -> dict[str, str]:
        """The engine id behind each ``lifecycle/<call>/<phase>_slowest_s`` metric (same key),
        for the last completed call of each kind."""
        return dict(self._slowest)

    @property
    def timeline(self) -> Timeline:
        """Every call, phase and engine call of the last ``LifecycleConfig.timeline_calls``
        calls as spans: ``timeline.spans()``, ``timeline.export_chrome_trace(path)``,
        ``timeline.plot_gantt(path)``, ``timeline.clear()``."""
        return self._timeline

    def snapshot(self) -> ServerSnapshot:
        """The state and what the server knows of every engine."""
        return ServerSnapshot(
            name=self._name,
            state=self.state,
            groups=tuple(
                GroupSnapshot(g.name, g.needs_offload, tuple(r.snapshot() for r in g.records))
                for g in self._groups
            ),
        )

    def adopt(self, snapshot: ServerSnapshot) -> None:
        """Take over engines in the state a ``snapshot()`` recorded, without calling them.

        For a process that drives engines an earlier process left in some state (the
        ``rollout-lifecycle ctl`` command does): the groups must be the snapshot's (names,
        order, ``needs_offload``, engine ids). Every record takes the snapshot's knowledge
        (paused, flushed, released and uncertain tags, alive, stale) and the server enters the
        snapshot's state, so every guard applies as if this server had made those calls. The
        records must imply that state (``failed`` takes any). A snapshot a ``journal`` took
        mid-call (records with a call in flight: uncertain tags, a pause or session unknown)
        is adopted as ``failed``, whatever its state: that process died with calls unanswered.
        Raises ``InvalidArgument``, changing nothing, when the records imply another state, a
        ``pausing`` snapshot has no call in flight, or a call is in progress.
        """
        if not isinstance(snapshot, ServerSnapshot):
            raise InvalidArgument(f"expected a ServerSnapshot, got {snapshot!r}")
        if self._lock.locked():
            raise InvalidArgument("cannot adopt a snapshot while a lifecycle call is in progress")
        ours = [(g.name, g.needs_offload, [r.id for r in g.records]) for g in self._groups]
        theirs = [(g.name, g.needs_offload, [e.id for e in g.engines]) for g in snapshot.groups]
        if ours != theirs:
            raise InvalidArgument(f"the snapshot's groups {theirs} are not this server's {ours}")
        state = snapshot.state
        in_flight = snapshot.in_flight()
        if state is S.PAUSING and not in_flight:
            raise InvalidArgument("a snapshot taken in 'pausing' (mid-call) cannot be adopted")
        records = [r for g in self._groups for r in g.records]
        saved = [{k: copy.copy(v) for k, v in vars(r).items()} for r in records]
        engines = [e for g in snapshot.groups for e in g.engines]
        try:
            for record, engine in zip(records, engines, strict=True):
                record.load(engine)
            implied = self._settled_state()
            if state not in (S.FAILED, implied) and in_flight:
                state = S.FAILED
            if state not in (S.FAILED, implied) and (state, implied) != (S.KV_RESTORED, S.DRAINED):
                shown = "no single state" if implied is None else repr(implied.value)
                raise InvalidArgument(
                    f"the snapshot's engine records imply {shown}, not its state {state.value!r}"
                )
        except BaseException:
            for record, values in zip(records, saved, strict=True):
                vars(record).update(values)
            raise
        self._machine.set_state(state.value)

    def _write_journal(self) -> None:
        if self._journal is not None:
            self._journal(self.snapshot())

    def engines(self) -> dict[str, Any]:
        """Engine id -> handle, for every engine."""
        return {r.id: r.handle for g in self._groups for r in g.records}

    async def generate(
        self, request: dict[str, Any], *, group: str | None = None
    ) -> dict[str, Any]:
        """Run one generate request to completion on a serving engine (least outstanding first).

        Held while the server is not serving (or, for a group that keeps its memory, while its
        engines are paused); an aborted request is resubmitted as prompt + partial output, so
        the caller gets one complete answer. ``meta_info`` adds ``num_resubmissions``,
        ``num_retractions`` and ``engines``. Not serialized with lifecycle calls.
        """
        return await self.generation.generate(request, group=group)

    async def generate_batch(
        self, requests: Sequence[dict[str, Any]], *, group: str | None = None
    ) -> list[dict[str, Any]]:
        """``generate`` for many requests at once; answers in request order."""
        return await self.generation.generate_batch(requests, group=group)

    @property
    def generation(self) -> GenerationClient:
        """The server's generation client (created on first use)."""
        if self._generation is None:
            self._generation = GenerationClient(self)
        return self._generation

    async def probe(self) -> dict[str, EngineOutcome]:
        """Probe every live engine's liveness without generating; dead ones are marked dead.

        Not serialized with lifecycle calls: it changes no state but an engine's ``alive`` flag,
        so it can run while a long transition is in flight.
        """
        calls = Calls.join(g.probe() for g in self._groups)
        return await self._settle("probe", calls, self._config.deadlines.probe)

    # -- hooks --------------------------------------------------------------------------------

    def on(self, event: str | ServerState, hook: Hook) -> Callable[[], None]:
        """Call ``hook(LifecycleEvent)`` (sync or async) on ``event``; returns its remover.

        Events: a state's name (entering it), ``before_<phase>`` and ``after_<phase>`` for the
        phases of ``HOOK_PHASES``. Order within a transition: ``before_<phase>`` hooks run just
        before the phase's first engine call is sent; once the transition has completed (the
        state changed) the ``after_<phase>`` hooks of its phases run in phase order, then the
        hooks of the state entered. Hooks of one event run in registration order. A hook that
        raises stops the call with ``HookFailed`` and leaves the server in the last state it
        completed (a ``before_`` hook's phase sends nothing; a drain refused by a hook
        continues what it paused and returns to ``serving``). Hooks may call the server.
        """
        key = event.value if isinstance(event, ServerState) else event
        if key not in self._hooks:
            raise InvalidArgument(f"unknown event {event!r}; events: {', '.join(HOOK_EVENTS)}")
        if not callable(hook):
            raise InvalidArgument(f"hook for {key!r} must be callable, got {hook!r}")
        self._hooks[key].append(hook)

        def remove() -> None:
            if hook in self._hooks[key]:
                self._hooks[key].remove(hook)

        return remove

    # -- public lifecycle ---------------------------------------------------------------------

    async def offload(self) -> dict[str, float]:
        """Pause and drain the offloaded groups, then release their memory.

        ``serving -> pausing -> drained -> released`` (from ``drained`` only the release runs).
        A no-op in ``released``.
        """
        if self._config.pause_mode is PauseMode.IN_PLACE:
            raise InvalidArgument(
                "offload() cannot use pause_mode 'in_place': requests keep their KV cache and "
                "releasing memory under them kills the engine; use 'retract' or 'abort'"
            )
        return await self._serialized("offload", self._offload)

    async def onload_weights(self) -> dict[str, float]:
        """Resume the weights (``released -> weights_restored``); KV stays released."""
        return await self._serialized("onload_weights", self._onload_weights)

    async def update_weights(
        self, push: WeightPush, version: str | None = None
    ) -> dict[str, float]:
        """Write weights while they are resident and generation is paused.

        Legal in ``drained``, ``weights_restored`` and ``kv_restored``. Opens a weight-update
        session on every engine, calls ``push(WeightUpdate)`` (sync or async), closes the
        session, sets ``version`` (never aborting a request), and flushes the prefix cache where
        the KV cache is resident. Engines still serving (groups that do not offload) are paused
        around the write and continued after it.
        """
        if not callable(push):
            raise InvalidArgument(f"push must be callable, got {push!r}")
        if version is not None and (not isinstance(version, str) or not version.strip()):
            raise InvalidArgument(f"version must be a non-empty string or None, got {version!r}")
        return await self._serialized("update_weights", lambda: self._update_weights(push, version))

    async def onload_kv(self) -> dict[str, float]:
        """Resume the KV cache, then continue generation.

        ``weights_restored -> kv_restored -> serving``.
        """
        return await self._serialized("onload_kv", self._onload_kv)

    async def onload(self) -> dict[str, float]:
        """Everything ``offload`` undid: weights, then KV, then continue. A no-op in ``serving``.

        From ``drained`` (nothing released) it only continues generation.
        """
        return await self._serialized("onload", self._onload)

    async def pause(self) -> dict[str, float]:
        """Pause and drain every group (``serving -> pausing -> drained``); nothing is released."""
        return await self._serialized("pause", self._pause_all)

    async def resume(self) -> dict[str, float]:
        """Continue generation from ``drained`` or ``kv_restored``."""
        return await self._serialized("resume", self._resume)

    async def reset(self) -> ServerState:
        """Leave ``failed`` for the state the engines' records imply, after inspection.

        Raises ``IllegalTransition`` when the records are not consistent with any state (for
        example engines holding different tags, or a tag in an unknown state).
        """

        async def body() -> None:
            self._require("reset")
            if self._settled_state() is None:
                raise IllegalTransition("reset", self.state.value, [S.FAILED.value])
            await self._advance("reset")

        await self._serialized("reset", body)
        return self.state

    async def recover(self, factory: EngineFactory) -> dict[str, EngineOutcome]:
        """Replace dead engines, and engines whose memory state is unknown, through ``factory``.

        Each replacement is brought to the memory state of its group in the server's current
        state (paused and flushed, released tags released) before it rejoins, and counts as
        stale until it receives weights. From ``failed`` the server then settles in the state
        the engines imply. Returns the outcome of bringing up each replacement.
        """
        if not callable(factory):
            raise InvalidArgument(f"factory must be callable, got {factory!r}")
        outcomes: dict[str, EngineOutcome] = {}

        async def body() -> None:
            outcomes.update(await self._recover(factory))

        await self._serialized("recover", body)
        return outcomes

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[RolloutServer]:
        """Pause every group for the body (a non-colocated weight sync), then continue."""
        await self.pause()
        try:
            yield self
        finally:
            if self.state is not S.FAILED:
                await self.resume()

    @asynccontextmanager
    async def offloaded(self) -> AsyncIterator[RolloutServer]:
        """Offload on enter; on exit restore weights, run hooks, restore KV and continue.

        The exit runs even when the body raises, so engines never stay released by accident.
        """
        await self.offload()
        try:
            yield self
        finally:
            if self.state is not S.FAILED:
                await self.onload()

    # -- call bodies (run under the lock) -----------------------------------------------------

    async def _offload(self) -> None:
        state = self.state
        if state is S.RELEASED:
            return
        if state not in (S.SERVING, S.DRAINED):
            raise IllegalTransition(
                "offload", state.value, [S.SERVING.value, S.DRAINED.value, S.RELEASED.value]
            )
        groups = self._offload_groups()
        self._preflight_offload(groups)
        if state is S.SERVING:
            await self._pause_and_drain(groups)
        await self._advance("release")

    async def _onload_weights(self) -> None:
        if self.state is S.WEIGHTS_RESTORED:
            return
        self._require("restore_weights", call="onload_weights")
        await self._advance("restore_weights")

    async def _update_weights(self, push: WeightPush, version: str | None) -> None:
        self._require("write_weights", call="update_weights")
        await self._advance("write_weights", push=push, version=version)

    async def _onload_kv(self) -> None:
        if self.state is not S.KV_RESTORED:
            self._require("restore_kv", call="onload_kv")
            await self._advance("restore_kv")
        await self._advance("resume")

    async def _onload(self) -> None:
        state = self.state
        if state is S.SERVING:
            return
        if state not in (S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED):
            raise IllegalTransition(
                "onload",
                state.value,
                [s.value for s in (S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED)],
            )
        if state is S.RELEASED:
            await self._advance("restore_weights")
        if self.state is S.WEIGHTS_RESTORED:
            await self._advance("restore_kv")
        await self._advance("resume")

    async def _pause_all(self) -> None:
        if self.state is S.DRAINED:
            return
        self._require("pause")
        await self._pause_and_drain(self._groups)

    async def _pause_and_drain(self, groups: Sequence[EngineGroup]) -> None:
        try:
            await self._advance("pause")  # a 'pausing' hook may refuse before anything is sent
            await self._advance("drain", groups=groups)
        except HookFailed:
            if self.state is S.PAUSING:  # the hook stopped the drain; what it paused is continued
                await self._fire("abandon")
            raise

    async def _resume(self) -> None:
        if self.state is S.SERVING:
            return
        self._require("resume")
        await self._advance("resume")

    async def _recover(self, factory: EngineFactory) -> dict[str, EngineOutcome]:
        broken = [r for g in self._groups for r in g.records if not r.alive or r.uncertain]
        state = self.state
        skip = {r.id for r in broken}
        target = self._settled_state(skip=skip) if state is S.FAILED else state
        if target is None and state is S.FAILED:
            target = self._majority_state(skip)
        if target is None or target in (S.PAUSING, S.KV_RESTORED):
            raise IllegalTransition(
                "recover",
                state.value,
                [S.SERVING.value, S.DRAINED.value, S.RELEASED.value, S.WEIGHTS_RESTORED.value],
            )
        replacements: list[tuple[EngineRecord, Any]] = []
        deadline = self._config.deadlines.startup
        for record in broken:  # every replacement exists before anything is retired
            engine = await self._run_user("recover", factory, record.id, deadline, wrap=False)
            replacements.append((record, engine))
        self._check_replacements(replacements)
        log = logger().bind(server=self._name, call="recover")
        retired = []
        for record, engine in replacements:
            old = self._group_of(record).replace(record, engine)
            log.info("engine.replaced", engine=record.id, target=target.value)
            if engine_identity(old) != engine_identity(record.handle):
                retired.append(old)  # (a server restarted at the same URL is not stopped)
        self._write_journal()
        for old in retired:
            await _retire(old, self._config.deadlines.probe)
        outcomes = await self._bring_up([r for r, _ in replacements], target)
        outcomes.update(await self._heal(target, skip))
        if not self._succeeded(outcomes):
            if state is not S.FAILED:
                await self._fire("fail")
            raise PhaseFailed("recover", outcomes, S.FAILED.value)
        if state is S.FAILED:
            await self._advance("reset")
            if self.state is S.FAILED:
                raise IllegalTransition("recover", S.FAILED.value, [])  # records still disagree
        return outcomes

    def _check_replacements(self, replacements: Sequence[tuple[EngineRecord, Any]]) -> None:
        """Refuse, before anything is retired, replacements that are engines of this server
        already (other than the one each replaces) or that two factory calls returned."""
        replaced = {r.id for r, _ in replacements}
        taken = {
            engine_identity(r.handle): r.id
            for g in self._groups
            for r in g.records
            if r.id not in replaced
        }
        for record, engine in replacements:
            key = engine_identity(_as_handle(engine, record.group, 0))
            if key in taken:
                raise InvalidArgument(
                    f"the replacement for {record.id} is engine {taken[key]} already; "
                    f"the factory must return a new engine"
                )
            taken[key] = f"the replacement for {record.id}"

    def _check_live(self, call: str) -> None:
        """Refuse a lifecycle call when a group has no live engine: it would succeed on
        nothing. ``recover()`` and ``reset()`` are how such a fleet comes back."""
        if call in ("recover", "reset"):
            return
        for group in self._groups:
            if not group.live():
                raise IllegalEngineOp(
                    f"group {group.name!r}",
                    call,
                    f"all {len(group.records)} engines of the group are dead; recover() "
                    f"replaces them",
                )

    def _majority_state(self, skip: Collection[str]) -> ServerState | None:
        """After a phase failed part-way, the state most offloaded engines are in."""
        offload = [r for g in self._offload_groups() for r in g.live() if r.id not in skip]
        if not offload:
            return S.SERVING
        held = Counter(frozenset(r.released) for r in offload).most_common()
        top = [h for h, n in held if n == held[0][1]]
        tags = min(top, key=len)  # on a tie, the most restored
        if not tags:
            # A drain that did not complete (paused, never flushed) is undone, not finished.
            drained = sum(r.paused and r.flushed for r in offload)
            return S.DRAINED if drained * 2 > len(offload) else S.SERVING
        for state in (S.RELEASED, S.WEIGHTS_RESTORED):
            if set(tags) == set(_released_in(state, self._config.release_tags)):
                return state
        return None

    async def _heal(self, target: ServerState, skip: Collection[str]) -> dict[str, EngineOutcome]:
        """Move healthy engines that a part-way failure left behind (or ahead) to ``target``.

        Resumes what is released beyond the target, pauses, flushes and releases what is
        short of it, and continues engines left paused in a serving fleet (once a late pause
        has landed).
        """
        deadlines = self._config.deadlines
        tags = set(_released_in(target, self._config.release_tags))
        healthy = [r for g in self._groups for r in g.live() if r.id not in skip]
        outcomes: dict[str, EngineOutcome] = {}
        ahead = [r for r in healthy if r.released - tags]
        for extra in {frozenset(r.released - tags) for r in ahead}:
            group_tags = tuple(t for t in self._config.release_tags if t in extra)
            chosen = [r for r in ahead if r.released - tags == extra]
            outcomes.update(
                await self._step(
                    "recover_resume", chosen, "resume_memory_occupation",
                    [t.value for t in group_tags], deadline=deadlines.resume, tags=group_tags,
                    check=lambda r, t=group_tags: r.check_resume(t),
                )
            )  # fmt: skip
        drains = target in (S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED)
        in_place = self._config.pause_mode is PauseMode.IN_PLACE
        short = [
            r
            for r in healthy
            if (
                self._group_of(r).needs_offload
                and (
                    tags - r.released
                    # short of the drain: not paused, paused without an answer, or not flushed
                    or (drains and (not r.paused or r.pause_unknown or not (r.flushed or in_place)))
                )
            )
            # a replacement without the weights that an earlier bring-up could not pause
            or (r.stale and (not r.paused or r.pause_unknown))
        ]
        if short:
            outcomes.update(await self._bring_up(short, target, fresh=False))
        if target in (S.RELEASED, S.WEIGHTS_RESTORED):
            # groups that keep their memory serve here (a failed release may have left the
            # ones ``pause()`` paused)
            outcomes.update(await self._continue_keepers())
        if target is S.SERVING:
            # (a replacement without the weights stays paused: it waits for an update)
            stuck = [r for r in healthy if r.paused and not (r.released | r.uncertain or r.stale)]
            stuck = await self._landed(stuck, deadlines.pause)
            outcomes.update(
                await self._step(
                    "recover_continue", stuck, "continue_generation", deadline=deadlines.continue_
                )
            )
        return outcomes

    async def _step(
        self,
        phase: str,
        chosen: Sequence[EngineRecord],
        op: str,
        *args: Any,
        deadline: float,
        **kw: Any,
    ) -> dict[str, EngineOutcome]:
        """Issue ``op`` to the ``chosen`` engines (guarded) and settle them as one phase."""
        return await self._settle(phase, self._issue_to(chosen, op, args, **kw), deadline)

    def _issue_to(
        self, chosen: Sequence[EngineRecord], op: str, args: tuple[Any, ...] = (), **kw: Any
    ) -> Calls:
        """Issue ``op`` to the ``chosen`` engines through their groups' guards; do not wait."""
        return Calls.join(
            g._issue([r for r in chosen if r.group == g.name], op, args, **kw) for g in self._groups
        )

    async def _bring_up(
        self, records: Sequence[EngineRecord], target: ServerState, *, fresh: bool = True
    ) -> dict[str, EngineOutcome]:
        """Bring engines to ``target``'s memory state, phase by phase, each phase a barrier:
        fresh ones (serving, all memory resident) are probed first; an engine whose last pause
        or continue did not answer is paused again; a held tag is never released again. The
        first phase that fails anywhere stops the bring-up (a later ``recover()`` finishes it).

        A replacement without the fleet's weights (stale) is paused even where its group
        serves: it waits for a weight update instead of generating on its initial weights.
        """
        deadlines = self._config.deadlines
        outcomes: dict[str, EngineOutcome] = {}

        async def step(
            phase: str, chosen: list[EngineRecord], op: str, *args: Any, deadline: float, **kw: Any
        ) -> list[EngineRecord] | None:
            got = await self._step(phase, chosen, op, *args, deadline=deadline, **kw)
            outcomes.update(got)
            if not self._succeeded(got):
                return None
            return [r for r in chosen if got[r.id].ok]

        up = list(records)
        if fresh:
            probed = await step("recover_probe", up, "server_info", deadline=deadlines.startup)
            if probed is None:
                return outcomes
            up = probed
        mode = self._config.pause_mode
        to_pause = [
            r
            for r in up
            if (_paused_in(target, self._group_of(r)) or r.stale)
            and (not r.paused or r.pause_unknown)
        ]
        await self._landed(to_pause, deadlines.pause)  # a pause in flight lands before another
        newly = await step(
            "recover_pause",
            to_pause,
            "pause_generation",
            mode.value,
            mode=mode,
            deadline=deadlines.pause,
        )
        if newly is None:
            return outcomes
        asked = {r.id for r in to_pause}
        paused = [r for r in up if r.paused and r.id not in asked] + newly
        if mode is not PauseMode.IN_PLACE:
            flushed = await step(
                "recover_flush",
                [r for r in paused if not r.flushed],
                "flush_cache",
                deadlines.flush,
                self._config.flush_retry_interval,
                deadline=deadlines.flush + deadlines.probe,
            )
            if flushed is None:
                return outcomes
            paused = [r for r in paused if r.flushed]
        all_tags = _released_in(target, self._config.release_tags)
        for missing in {tuple(t for t in all_tags if t not in r.released) for r in paused}:
            chosen = [
                r
                for r in paused
                if self._group_of(r).needs_offload
                and tuple(t for t in all_tags if t not in r.released) == missing
            ]
            if not missing or not chosen:
                continue
            released = await step(
                "recover_release",
                chosen,
                "release_memory_occupation",
                [t.value for t in missing],
                tags=missing,
                deadline=deadlines.release,
                check=lambda r, t=missing: r.check_release(t),
            )
            if released is None:
                return outcomes
        return outcomes

    # -- transitions --------------------------------------------------------------------------

    def _require(self, trigger: str, *, call: str | None = None) -> None:
        allowed = sources_of(trigger)
        if self.state not in allowed:
            raise IllegalTransition(call or trigger, self.state.value, [s.value for s in allowed])

    async def _advance(self, trigger: str, **kwargs: Any) -> None:
        """Fire one transition: run its phase, change state, run the hooks of the new state."""
        current = _CURRENT.get()
        previous = self.state
        # ``pausing`` only leads into the drain: a cancelled call never stops there.
        if current is not None and current[1].cancelled and previous is not S.PAUSING:
            raise asyncio.CancelledError(f"cancelled before {trigger}")
        if current is not None and self.state not in sources_of(trigger):
            # a hook (or a call it made) moved the server on: refused, never a raw machine error
            self._require(trigger, call=f"{current[1].call} ({trigger})")
        log = logger().bind(server=self._name, transition=trigger)
        log.debug("transition.start", state=previous.value)
        phases: list[str] = []
        if current is not None:
            current[1].phases = phases
        try:
            await self._fire(trigger, **kwargs)
        except (IllegalEngineOp, InvalidArgument, HookFailed, StaleWeights):
            raise  # refused before any engine was touched, or the user's code: no failure
        except BaseException as exc:
            if previous is not S.FAILED and not isinstance(exc, asyncio.CancelledError):
                await self._fire("fail")
                self._write_journal()
                log.warning("transition.failed", state=previous.value, error=str(exc))
                await self._run_hooks(S.FAILED.value, S.FAILED, previous)
            raise
        self._write_journal()
        state = self.state
        log.info("state.enter", state=state.value, previous=previous.value)
        for phase in phases:
            await self._run_hooks(f"after_{phase}", state, previous, phase)
        if state is not previous:
            await self._run_hooks(state.value, state, previous)

    async def _fire(self, trigger: str, **kwargs: Any) -> None:
        # transitions adds one coroutine method per trigger to the model. It answers False when
        # the transition did not happen: the conditions of ``reset`` did not hold (the caller
        # checks the state), or a CancelledError reached a phase and transitions swallowed it,
        # which leaves calls unsettled: that must fail the transition, never pass for success.
        done = await getattr(self._model, trigger)(**kwargs)
        if not done and trigger != "reset":
            raise LifecycleError(f"transition {trigger!r} was interrupted inside a phase")

    async def _run_hooks(
        self, event: str, state: ServerState, previous: ServerState, phase: str | None = None
    ) -> None:
        for hook in list(self._hooks[event]):
            info = LifecycleEvent(event, state, previous, self, phase)
            await self._run_user(event, hook, info, self._config.deadlines.hook)

    async def _run_user(
        self,
        event: str,
        fn: Callable[[Any], Any],
        arg: Any,
        deadline: float,
        *,
        wrap: bool = True,
        grace: float | None = -1.0,
    ) -> Any:
        """Run user code (a hook, the weight push, a ``recover()`` factory) inside the
        operation in progress, in a ``_Scope`` of its own; its result.

        An awaitable it returns runs as a task bounded by ``deadline`` and cancelled when the
        operation is. Whatever it raises, ``BaseException`` included, becomes ``HookFailed``
        (``KeyboardInterrupt`` propagates as it is; with ``wrap=False`` an ``Exception``
        does too); a cancellation of the operation becomes ``_HookCancelled``. Past its
        deadline it is cancelled and given ``grace`` seconds to stop (the probe deadline by
        default; ``None`` waits for it: a weight push must not write after its session
        closed). A sync callable runs on the loop and cannot be bounded: it must not block.
        """
        if grace is not None and grace < 0:
            grace = self._config.deadlines.probe
        current = _CURRENT.get()
        op = current[1] if current is not None and current[0] is self else _Operation(event)
        scope = _Scope()
        name = getattr(fn, "__qualname__", repr(fn))
        task: asyncio.Future[Any] | None = None
        stopped = ""
        token = _CURRENT.set((self, op, scope))
        try:
            try:
                result = fn(arg)
                if inspect.isawaitable(result):
                    # created here, the task's context carries the scope
                    task = scope.task = asyncio.ensure_future(_captured(result))
            finally:
                _CURRENT.reset(token)
            if task is not None:
                op.running.add(task)
                try:
                    done, _ = await asyncio.wait([task], timeout=deadline)
                finally:
                    op.running.discard(task)
                if not done:
                    stopped = f"did not return within {deadline:g}s and was cancelled"
                    task.cancel()
                    # a hook that ignores its cancellation is left behind
                    await asyncio.wait([task], timeout=grace)
                    raise TimeoutError(stopped)
                caught, result = task.result()
                if caught is not None:
                    raise caught
            return result
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if task is not None and not task.done():  # this task itself was cancelled
                task.cancel()
                raise
            if isinstance(exc, asyncio.CancelledError) and op.cancelled:
                raise _HookCancelled(event, name, self.state.value, "was cancelled") from exc
            if not wrap and isinstance(exc, Exception) and not stopped:
                raise
            logger().warning(
                "hook.failed", server=self._name, hook_event=event, hook=name, error=repr(exc)
            )
            raise HookFailed(event, name, self.state.value, stopped or "raised") from exc
        finally:
            scope.closed = True
            # calls it made that still run are part of it: they finish (or stop at their next
            # boundary, if the operation was cancelled) before the operation goes on
            while scope.calls:
                if op.cancelled:
                    for nested in scope.calls.values():
                        _cancel(nested)
                await asyncio.wait(list(scope.calls))

    async def _before(self, phase: str) -> None:
        """Run the ``before_<phase>`` hooks; the phase's ``after_`` hooks follow the transition."""
        state = self.state
        await self._run_hooks(f"before_{phase}", state, state, phase)
        current = _CURRENT.get()
        if current is not None:
            current[1].phases.append(phase)

    async def _serialized(self, call: str, body: Callable[[], Awaitable[None]]) -> dict[str, float]:
        current = _CURRENT.get()
        scope = current[2] if current is not None and current[0] is self else None
        if scope is not None and scope.open:
            # Made from a hook, weight push or factory while it runs: part of the operation
            # that called it, which holds the lock. Cancelling the nested call stops it at its
            # next phase boundary, like any call.
            assert current is not None
            op = _Operation(call, metrics=current[1].metrics)
            task: asyncio.Future[dict[str, float]] = asyncio.ensure_future(
                self._inline(op, scope, body)
            )
            scope.calls[task] = op
            task.add_done_callback(lambda t: scope.calls.pop(t, None))
        else:
            # Everything else, including a task that user code started and left running after
            # it returned, waits for the lock.
            op = _Operation(call)
            task = asyncio.ensure_future(self._locked(op, body))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Settle what is in flight before letting go: the operation stops at the next phase
            # boundary (its running hook is cancelled), and the caller sees CancelledError only
            # once state is exact again.
            _cancel(op)
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                logger().warning(
                    "call.cancelled_with_error",
                    server=self._name,
                    call=call,
                    error=str(task.exception()),
                )
            raise

    async def _inline(
        self, op: _Operation, scope: _Scope, body: Callable[[], Awaitable[None]]
    ) -> dict[str, float]:
        async with scope.lock:
            if op.cancelled:
                raise asyncio.CancelledError(f"{op.call} cancelled before it started")
            token = _CURRENT.set((self, op, None))
            try:
                self._check_live(op.call)
                await body()
            except _HookCancelled as exc:
                raise asyncio.CancelledError(str(exc)) from exc
            finally:
                _CURRENT.reset(token)
        return {}

    async def _locked(
        self, op: _Operation, body: Callable[[], Awaitable[None]]
    ) -> dict[str, float]:
        async with self._lock:
            if op.cancelled:
                raise asyncio.CancelledError(f"{op.call} cancelled before it started")
            memory = self._config.memory_metrics
            before = await self._resident_bytes() if memory else {}
            token = _CURRENT.set((self, op, None))
            start = time.monotonic()
            self._trace = self._timeline.begin_call(op.call, start)
            self._call_slowest = {}
            log = logger().bind(server=self._name, call=op.call)
            log.info("call.start", state=self.state.value)
            outcome = "error"
            try:
                self._check_live(op.call)
                await body()
                outcome = "ok"
            except _HookCancelled as exc:
                outcome = "cancelled"
                raise asyncio.CancelledError(str(exc)) from exc
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                _CURRENT.reset(token)
                end = time.monotonic()
                total = end - start
                op.metrics[f"lifecycle/{op.call}/total_s"] = total
                Timeline.end_call(self._trace, end, outcome)
                self._trace = None
                log.info(
                    "call.end", state=self.state.value, outcome=outcome, duration_s=round(total, 6)
                )
            if memory:
                after = await self._resident_bytes()
                for when, found in (("before", before), ("after", after)):
                    for tag, nbytes in found.items():
                        op.metrics[f"lifecycle/{op.call}/{tag}_bytes_{when}"] = nbytes
            self._metrics.update(op.metrics)
            self._slowest.update(self._call_slowest)
            return dict(op.metrics)

    async def _resident_bytes(self) -> dict[str, int]:
        """Resident bytes per memory tag, summed over the live engines that account memory
        (``EngineHost.memory``); an engine that does not answer within the probe deadline, or
        answers nothing, is left out. Sent outside any phase: no engine's record changes."""
        futures: list[asyncio.Future[Any]] = []
        for group in self._groups:
            for record in group.live():
                with contextlib.suppress(Exception):  # a handle without memory() reports none
                    futures.append(asyncio.ensure_future(send_to_engine(record.handle, "memory")))
        if not futures:
            return {}
        done, pending = await asyncio.wait(futures, timeout=self._config.deadlines.probe)
        for future in pending:
            future.cancel()
        totals: dict[str, int] = {}
        for future in done:
            found = None if future.cancelled() or future.exception() else future.result()
            if isinstance(found, Mapping):
                for tag, nbytes in found.items():
                    if isinstance(tag, str) and type(nbytes) is int:
                        totals[tag] = totals.get(tag, 0) + nbytes
        return totals

    # -- phases (called by the machine) -------------------------------------------------------

    def _group_of(self, record: EngineRecord) -> EngineGroup:
        return self._by_name[record.group]

    def _offload_groups(self) -> tuple[EngineGroup, ...]:
        return tuple(g for g in self._groups if g.needs_offload)

    def _preflight_offload(self, groups: Sequence[EngineGroup]) -> None:
        tags = self._config.release_tags
        for group in groups:
            for record in group.live():
                held = [t.value for t in tags if t in record.released | record.uncertain]
                if held:
                    raise IllegalEngineOp(
                        record.id,
                        "release_memory_occupation",
                        f"tags {held} are already released or unknown",
                    )
        if self._config.dead_engines is DeadEnginePolicy.FAIL:
            dead = [r.id for g in groups for r in g.records if not r.alive]
            if dead:
                raise IllegalEngineOp(
                    ", ".join(dead), "offload", "engines are dead; recover() them first"
                )

    async def _drain(self, groups: Sequence[EngineGroup]) -> None:
        mode = self._config.pause_mode
        await self._before("pause")
        calls = Calls.join(g.pause_generation(mode) for g in groups)
        outcomes = await self._settle("pause", calls, self._config.deadlines.pause)
        if not self._succeeded(outcomes):
            await self._undo_pause()
            raise PhaseFailed("pause", self._with_unattempted(outcomes), S.FAILED.value)
        if mode is PauseMode.IN_PLACE:
            return  # requests keep their KV cache: flush would be refused, and is not needed
        try:
            await self._before("flush")
        except HookFailed:
            if not await self._undo_pause(always=True):
                raise PhaseFailed(
                    "continue_after_hook", self._last_outcomes, S.FAILED.value
                ) from None
            raise
        deadlines = self._config.deadlines
        interval = self._config.flush_retry_interval
        calls = Calls.join(g.flush_cache(deadlines.flush, interval) for g in groups)
        # The engine retries internally until the flush deadline; the barrier allows a margin
        # for the last attempt's answer to arrive.
        outcomes = await self._settle("flush", calls, deadlines.flush + deadlines.probe)
        if not self._succeeded(outcomes):
            await self._undo_pause()
            raise PhaseFailed("flush", outcomes, S.FAILED.value)

    async def _undo_pause(self, *, always: bool = False) -> bool:
        """Continue the engines a drain paused (nothing is released); True if none stays paused.

        After a failed drain this follows ``continue_on_failure``; ``always`` is for a drain a
        hook refused, which must return to ``serving``.
        """
        if not (always or self._config.continue_on_failure):
            return False
        deadline = self._config.deadlines.continue_
        targets = [
            r
            for g in self._groups
            for r in g.live()
            if r.paused and not (r.released | r.uncertain or r.stale)
        ]
        # A pause that missed its deadline may still land and would overtake a continue sent
        # before it: such calls get until the deadline, and an engine whose pause is still in
        # flight is left paused (as recorded) for recover() to continue once it has landed.
        targets = await self._landed(targets, deadline)
        calls = self._issue_to(targets, "continue_generation")
        self._last_outcomes = await self._settle("continue_after_failure", calls, deadline)
        return self._succeeded(self._last_outcomes) and not any(
            r.paused and not r.stale for g in self._groups for r in g.live()
        )

    async def _release(self) -> None:
        tags = self._config.release_tags
        groups = self._offload_groups()
        for group in groups:
            group.preflight("release_memory_occupation", tags)
        await self._before("release")
        calls = Calls.join(g.release_memory(tags) for g in groups)
        outcomes = await self._settle("release", calls, self._config.deadlines.release)
        if not self._succeeded(outcomes):
            raise PhaseFailed("release", outcomes, S.FAILED.value)
        # Groups that keep their memory serve while the others are offloaded, also when
        # ``pause()`` paused them before this release.
        outcomes = await self._continue_keepers()
        if not self._succeeded(outcomes):
            raise PhaseFailed("continue_keepers", outcomes, S.FAILED.value)

    def _paused_keepers(self) -> list[EngineRecord]:
        """The paused live engines, with every tag resident, of the groups that keep their
        memory."""
        return [
            r
            for g in self._groups
            if not g.needs_offload
            for r in g.live()
            if r.paused and not (r.released | r.uncertain)
        ]

    async def _landed(self, records: Sequence[EngineRecord], timeout: float) -> list[EngineRecord]:
        """Give calls that missed an earlier deadline on ``records`` up to ``timeout`` to land;
        the records with no such call still in flight."""
        late = [self._stragglers[r.id] for r in records if r.id in self._stragglers]
        if late:
            await asyncio.wait(late, timeout=timeout)
        return [r for r in records if r.id not in self._stragglers]

    async def _continue_keepers(self) -> dict[str, EngineOutcome]:
        """Continue the paused engines of the groups that keep their memory, except those
        without the expected weights (they stay paused until an update reaches them)."""
        keepers = self._paused_keepers()
        if keepers:
            # a continue must not be overtaken by a pause still in flight
            landed = await self._landed(keepers, self._config.deadlines.pause)
            lacking = await self._lacking_weights(keepers)
            ready = [r for r in landed if r.id not in lacking]
            return await self._step(
                "continue_keepers",
                ready,
                "continue_generation",
                deadline=self._config.deadlines.continue_,
                check=EngineRecord.check_continue,
            )
        return {}

    async def _restore(self, which: str) -> None:
        released = self._config.release_tags
        if which == "weights":
            tags = tuple(t for t in released if t in WEIGHT_TAGS)
        else:
            tags = tuple(t for t in released if t not in WEIGHT_TAGS)
        groups = self._offload_groups()
        for group in groups:
            if tags:
                group.preflight("resume_memory_occupation", tags)
        await self._before(f"resume_{which}")
        if not tags:
            return
        calls = Calls.join(g.resume_memory(tags) for g in groups)
        outcomes = await self._settle(f"resume_{which}", calls, self._config.deadlines.resume)
        if not self._succeeded(outcomes):
            raise PhaseFailed(f"resume_{which}", outcomes, S.FAILED.value)

    async def _continue(self) -> None:
        for group in self._groups:
            group.preflight("continue_generation")
        targets = [r for g in self._groups for r in g.live() if r.paused]
        await self._check_versions(targets)
        await self._before("continue")
        await self._await_stragglers("continue", targets)
        calls = Calls.join(g.continue_generation() for g in self._groups)
        outcomes = await self._settle("continue", calls, self._config.deadlines.continue_)
        if not self._succeeded(outcomes):
            raise PhaseFailed("continue", outcomes, S.FAILED.value)

    async def _await_stragglers(self, phase: str, targets: Sequence[EngineRecord]) -> None:
        """Let calls that missed an earlier deadline on ``targets`` land (bounded by the pause
        deadline) before a continue is sent: a late pause would overtake it and leave the engine
        paused behind a ledger that says serving. Fails the phase, sending nothing, for an
        engine whose call is still in flight."""
        landed = {r.id for r in await self._landed(targets, self._config.deadlines.pause)}
        busy = {
            r.id: EngineOutcome(Outcome.NOT_ATTEMPTED, "an earlier call is still in flight")
            for r in targets
            if r.id not in landed
        }
        if busy:
            raise PhaseFailed(phase, busy, S.FAILED.value)

    async def _check_versions(self, targets: Sequence[EngineRecord]) -> None:
        """Refuse to continue engines without the expected weights (``StaleWeights``).

        An engine must report the version of the last versioned update, and a replacement must
        have received an update since it joined. Nothing is continued when one lacks them.
        """
        stale = await self._lacking_weights(targets)
        if stale:
            raise StaleWeights(self._expected_version, stale)

    async def _lacking_weights(self, targets: Sequence[EngineRecord]) -> dict[str, str | None]:
        """The engines of ``targets`` without the expected weights, with the version each
        reports (None for a replacement that has received no update)."""
        expected = self._expected_version
        stale: dict[str, str | None] = {r.id: None for r in targets if r.stale}
        if expected is not None and targets:
            calls = self._issue_to(targets, "weight_version")
            outcomes = await self._settle("check_versions", calls, self._config.deadlines.probe)
            for call in calls:
                record = call.record
                if not outcomes[record.id].ok:
                    raise PhaseFailed("check_versions", outcomes, S.FAILED.value)
                found = await call.ref  # settled: returns at once
                if found == expected:
                    stale.pop(record.id, None)
                    record.stale = False
                else:
                    stale[record.id] = found
        return stale

    async def _write_weights(self, push: WeightPush, version: str | None) -> None:
        deadlines = self._config.deadlines
        for group in self._groups:
            group.preflight("update_weights")
        await self._before("update_weights")
        if version is not None:
            # From here on generation continues only on engines that report this version.
            self._expected_version = version
        # Engines still serving (groups that keep their memory) are paused around the write.
        serving = [r for g in self._groups for r in g.live() if not r.paused]
        if serving:
            mode = self._config.pause_mode
            calls = self._issue_to(serving, "pause_generation", (mode.value,), mode=mode)
            await self._require_all("pause_for_update", calls, deadlines.pause)
        # A session that an earlier update left open (its begin or end did not complete) is
        # closed first, or this begin would be refused with "a weight update session is open".
        left_open = [r for g in self._groups for r in g.live() if r.session_unknown]
        if left_open:
            outcomes = await self._close_sessions("close_weight_update", left_open)
            if any(r.session_unknown for r in left_open if r.alive):
                raise PhaseFailed("close_weight_update", outcomes, S.FAILED.value)
        calls = Calls.join(g.begin_weight_update() for g in self._groups)
        outcomes = await self._settle("begin_weight_update", calls, deadlines.weight_update)
        if not self._succeeded(outcomes):
            # Close the sessions that did (or may have) opened, or every later update would be
            # refused with "a weight update session is open".
            opened = [
                c.record
                for c in calls
                if c.record.alive
                and outcomes[c.record.id].outcome not in (Outcome.REJECTED, Outcome.REFUSED)
            ]
            await self._close_sessions("end_weight_update", opened)
            raise PhaseFailed("begin_weight_update", outcomes, S.FAILED.value)
        engines = {r.id: r.handle for g in self._groups for r in g.live()}
        try:
            await self._call_push(push, WeightUpdate(version, engines))
        finally:
            calls = Calls.join(g.end_weight_update() for g in self._groups)
            await self._require_all("end_weight_update", calls, deadlines.weight_update)
        if version is not None:
            calls = Calls.join(g.update_weight_version(version) for g in self._groups)
            await self._require_all("update_weight_version", calls, deadlines.weight_update)
        else:
            for group in self._groups:
                for record in group.live():
                    record.stale = False  # unversioned: having been written to is all we know
        # The prefix cache holds KV computed with the old weights: drop it wherever the KV
        # cache is resident (a released KV cache comes back empty).
        resident = [
            r
            for g in self._groups
            for r in g.live()
            if not (r.released | r.uncertain) and r.pause_mode is not PauseMode.IN_PLACE
        ]
        interval = self._config.flush_retry_interval
        calls = self._issue_to(resident, "flush_cache", (deadlines.flush, interval))
        await self._require_all("flush_after_update", calls, deadlines.flush + deadlines.probe)
        # Only a complete write continues what it paused, and only on the expected weights; on
        # any failure those engines stay paused until the next continue checks them again.
        resumed = [r for r in serving if r.alive and r.paused]
        if self.state is not S.DRAINED:
            # Outside 'drained' the groups that keep their memory serve: an earlier write that
            # failed left them paused, and this complete one continues them.
            chosen = {r.id for r in resumed}
            resumed += [r for r in self._paused_keepers() if r.id not in chosen]
        if resumed:
            await self._check_versions(resumed)
            await self._await_stragglers("continue_after_update", resumed)
            calls = self._issue_to(
                resumed, "continue_generation", check=EngineRecord.check_continue
            )
            await self._require_all("continue_after_update", calls, deadlines.continue_)

    async def _close_sessions(
        self, phase: str, records: Sequence[EngineRecord]
    ) -> dict[str, EngineOutcome]:
        """End the weight-update sessions that may be open on ``records``.

        A begin still in flight would open its session after the end: it gets until the
        deadline to land, and an engine whose begin still has not answered keeps its session
        marked unknown for the next update to close. Ending a session that is not open is a
        harmless 400, which the ledger reads as closed.
        """
        deadline = self._config.deadlines.weight_update
        for record in records:
            record.session_unknown = True
        ready = await self._landed(records, deadline)
        calls = self._issue_to(ready, "end_weight_update")
        return await self._settle(phase, calls, deadline)

    async def _call_push(self, push: WeightPush, update: WeightUpdate) -> None:
        start = time.monotonic()
        try:
            await self._run_user(
                "update_weights", push, update, self._config.deadlines.weight_update, grace=None
            )
        finally:
            self._record_metric("push", time.monotonic() - start)

    async def _require_all(self, phase: str, calls: Calls, deadline: float) -> None:
        outcomes = await self._settle(phase, calls, deadline)
        if not self._succeeded(outcomes):
            raise PhaseFailed(phase, outcomes, S.FAILED.value)

    # -- gathering ----------------------------------------------------------------------------

    def _succeeded(self, outcomes: Mapping[str, EngineOutcome]) -> bool:
        """Every engine succeeded, or (``DeadEnginePolicy.SKIP``) was found dead; and every
        group the phase reached has an engine that succeeded: no success on nothing."""
        skip_dead = self._config.dead_engines is DeadEnginePolicy.SKIP
        reached: set[str] = set()
        succeeded: set[str] = set()
        for engine, o in outcomes.items():
            group = engine.rpartition("/")[0]
            reached.add(group)
            if o.ok:
                succeeded.add(group)
            elif not (skip_dead and o.outcome is Outcome.DEAD):
                return False
        return succeeded == reached

    def _with_unattempted(self, outcomes: dict[str, EngineOutcome]) -> dict[str, EngineOutcome]:
        out = dict(outcomes)
        for group in self._groups:
            for record in group.records:
                if record.id not in out and not record.alive:
                    out[record.id] = EngineOutcome(Outcome.NOT_ATTEMPTED, "engine already dead")
        return out

    def _record_metric(
        self,
        phase: str,
        seconds: float,
        *,
        start: float | None = None,
        calls: EngineCalls = (),
        slowest: tuple[str, float] | None = None,
        retries: int | None = None,
    ) -> None:
        """Add a phase to the metrics of the call in progress and its spans to the timeline.

        ``calls`` are the phase's engine calls, ``slowest`` the (engine, seconds) of the
        slowest of them, ``retries`` the flush attempts beyond the first (flush phases only).
        A phase outside any call (``probe()``) is a call of its own on the timeline.
        """
        begin = time.monotonic() - seconds if start is None else start
        current = _CURRENT.get()
        if current is None or current[0] is not self:
            trace = self._timeline.begin_call(phase, begin)
            if trace is not None:
                Timeline.add_phase(
                    trace, phase, phase, self._model.state, begin, begin + seconds, calls
                )
                Timeline.end_call(trace, begin + seconds, "ok")
            return
        op = current[1]
        prefix = f"lifecycle/{op.call}/{_METRIC_NAMES.get(phase, phase)}"
        metrics = op.metrics
        metrics[prefix + "_s"] = metrics.get(prefix + "_s", 0.0) + seconds
        if slowest is not None:
            key = prefix + "_slowest_s"
            if slowest[1] >= metrics.get(key, -1.0):
                metrics[key] = slowest[1]
                self._call_slowest[key] = slowest[0]
        if retries is not None:
            key = prefix + "_retries"
            metrics[key] = metrics.get(key, 0) + retries
        if self._trace is not None:
            Timeline.add_phase(
                self._trace, phase, op.call, self._model.state, begin, begin + seconds, calls
            )

    async def _settle(self, phase: str, calls: Calls, deadline: float) -> dict[str, EngineOutcome]:
        """Gather every call of a phase (the barrier), each bounded by ``deadline``."""
        log = logger().bind(server=self._name, phase=phase)
        start = time.monotonic()
        log.info("phase.start", engines=len(calls), deadline_s=deadline)
        # Per-engine events cost more than the rest of a phase's bookkeeping: build them only
        # when someone listens at debug level.
        debug = _debug_enabled(log)
        if debug:
            for call in calls:
                log.debug(
                    "engine_call.start", group=call.record.group, engine=call.record.id, op=call.op
                )
        # One wait for the whole phase (see _gather): per-call futures cost more than the rest
        # of the bookkeeping at thousands of engines.
        landed = await gather_calls(calls.refs, deadline)
        outcomes: dict[str, EngineOutcome] = {}
        # The timeline's record of the engine calls (flat: this loop runs once per engine per
        # phase, and makes only the outcome), the slowest call, and the flush attempts beyond
        # the first.
        spans: list[str | float] = []
        slowest: tuple[str, float] | None = None
        retries: int | None = None
        columns = (calls.records, calls.ops, calls.tags, calls.modes, calls.starts)
        for i, (record, op, tags, mode, began) in enumerate(zip(*columns, strict=True)):
            landed_at = landed.ends[i]
            if landed_at is None:
                end = time.monotonic()
                future = landed.late[i]
                out = EngineOutcome(
                    Outcome.TIMED_OUT, f"no answer within {deadline:g}s", end - began
                )
                # The call may still land; keep it, so that nothing is sent to this engine
                # before it has (see _undo_pause).
                self._stragglers[record.id] = future
                future.add_done_callback(functools.partial(self._forget_straggler, record.id))
            else:
                end = landed_at
                took = end - began
                exc = landed.errors[i]
                out = EngineOutcome(Outcome.OK, "", took) if exc is None else classify(exc, took)
            if op == "flush_cache":
                attempts = landed.values[i] if out.outcome is Outcome.OK else None
                retries = (retries or 0) + (max(attempts - 1, 0) if type(attempts) is int else 0)
            if slowest is None or out.duration_s > slowest[1]:
                slowest = (record.id, out.duration_s)
            spans += (record.id, record.group, op, began, end, out.outcome.value)
            record.apply(op, tags, mode, out)
            outcomes[record.id] = out
            if debug:
                log.debug(
                    "engine_call.end",
                    group=record.group,
                    engine=record.id,
                    op=op,
                    outcome=out.outcome.value,
                    detail=out.detail or None,
                    duration_s=round(out.duration_s, 6),
                )
        if calls:  # the phase begins with its first engine call, issued before the gather
            start = min(start, calls.starts[0])
        took = time.monotonic() - start
        self._record_metric(phase, took, start=start, calls=spans, slowest=slowest, retries=retries)
        self._write_journal()
        bad = sorted(k for k, v in outcomes.items() if not v.ok)
        log.info(
            "phase.end",
            engines=len(calls),
            outcome="ok" if not bad else "failed",
            failed_engines=bad or None,
            duration_s=round(took, 6),
        )
        return outcomes

    def _forget_straggler(self, engine: str, future: asyncio.Future[Any]) -> None:
        if self._stragglers.get(engine) is future:
            del self._stragglers[engine]

    # -- reset --------------------------------------------------------------------------------

    def _settled_state(self, skip: Collection[str] = ()) -> ServerState | None:
        """The state the records of the live engines (but ``skip``) imply; None if they disagree.

        ``drained`` stands for every offloaded engine paused and idle, whether or not the
        groups that keep their memory are paused too (both ``pause()`` and ``offload()`` reach
        it); those groups must agree among themselves.
        """
        live = [r for g in self._groups for r in g.live() if r.id not in skip]
        if any(r.uncertain for r in live):
            return None
        if any(r.stale and not r.paused for r in live):
            return None  # a replacement that could not be brought up: recover() pauses it
        # Replacements without the weights, held paused while their groups serve.
        waiting = {r.id for r in live if r.stale and r.paused and not r.released}
        offload = [r for g in self._offload_groups() for r in g.live() if r.id not in skip]
        others = [r for r in live if self._group_of(r).needs_offload is False]
        released = {frozenset(r.released) for r in offload} or {frozenset()}
        if len(released) != 1 or any(r.released for r in others):
            return None
        if len({r.paused for r in others if r.id not in waiting}) > 1:
            return None
        (held,) = released
        idle = all(r.paused and (r.flushed or r.pause_mode is PauseMode.IN_PLACE) for r in offload)
        if not held:
            if not any(r.paused for r in live if r.id not in waiting):
                return S.SERVING
            return S.DRAINED if idle else None
        if not idle:
            return None  # (groups that keep their memory may be paused: a write that failed)
        tags = set(self._config.release_tags)
        if held == tags:
            return S.RELEASED
        if held == tags - set(WEIGHT_TAGS):
            return S.WEIGHTS_RESTORED
        return None


#: Metric names of the phases whose event names are longer: ``lifecycle/onload/weights_s``.
_METRIC_NAMES = {"resume_weights": "weights", "resume_kv": "kv", "push": "update"}


def _paused_in(state: ServerState, group: EngineGroup) -> bool:
    """Whether an engine of ``group`` is paused when the server is settled in ``state``."""
    if state is S.SERVING:
        return False
    return group.needs_offload or state is S.DRAINED


def _released_in(state: ServerState, release_tags: Sequence[Tag]) -> tuple[Tag, ...]:
    """The tags an offloaded engine holds released when the server is settled in ``state``."""
    if state is S.RELEASED:
        return tuple(release_tags)
    if state is S.WEIGHTS_RESTORED:
        return tuple(t for t in release_tags if t not in WEIGHT_TAGS)
    return ()


async def _retire(handle: Any, deadline: float) -> None:
    """Best effort to stop an engine that was replaced (it may be dead already).

    A live one first aborts its requests, so each returns with its partial output (and a
    generation client resubmits it) instead of being dropped with the engine. An engine actor
    closes its backend (a launched SGLang server is stopped with its process group) before the
    actor is killed.
    """
    with contextlib.suppress(Exception):
        await asyncio.wait_for(
            _awaitable(send_to_engine(handle, "pause_generation", ("abort",))), deadline
        )
    if isinstance(handle, EngineHost):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.close(), deadline)
        return
    if isinstance(handle, HostedEngine):  # its actor hosts other engines: close this one only
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_awaitable(send_to_engine(handle, "close")), deadline)
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(_awaitable(send_to_engine(handle, "close")), deadline)
    try:
        import ray

        ray.kill(handle, no_restart=True)
    except Exception:  # a dead actor may refuse to be killed again: nothing left to stop
        logger().debug("engine.retire_failed", handle=repr(handle))


def _plain(row: Mapping[str, Any]) -> dict[str, Any]:
    """A transitions row with state enums turned into their names."""

    def name(value: Any) -> Any:
        if isinstance(value, list):
            return [name(v) for v in value]
        return value.value if isinstance(value, ServerState) else value

    return {k: name(v) for k, v in row.items()}


async def _awaitable(result: Awaitable[T]) -> T:
    return await result


async def _captured(result: Awaitable[T]) -> tuple[BaseException | None, T | None]:
    """Await user code's awaitable, handing back what it raised instead of raising it: a
    ``SystemExit`` raised in a task would otherwise leave through the event loop itself."""
    try:
        return None, await result
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        return exc, None


def _debug_enabled(log: Any) -> bool:
    """Whether ``log`` emits debug events (a logger that cannot tell is taken to emit them)."""
    check = getattr(log, "is_enabled_for", None)
    return True if check is None else bool(check(logging.DEBUG))


__all__ = [
    "HOOK_EVENTS",
    "GroupSnapshot",
    "LifecycleError",
    "LifecycleEvent",
    "RolloutServer",
    "ServerSnapshot",
    "WeightUpdate",
]
