"""``RolloutServer``: the public face of the lifecycle, built from the core's parts.

The server owns one fleet ledger (``Fleet``), one phase runner (``PhaseRunner``), one state
machine (``Machine``) and the clients of those: the phases, the weight writer, recovery, hooks
and the metrics recorder. Each public call is serialized (``Serializer``), planned from the
``CALLS`` table and run transition by transition; every transition runs its phase through the
runner, once. See ``docs/design.md`` for the map of which module owns what.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout_lifecycle.contract.commands import Observe
from rollout_lifecycle.contract.exceptions import InvalidArgument, LifecycleError
from rollout_lifecycle.contract.fingerprint import Fingerprint
from rollout_lifecycle.contract.outcome import DISAGREEMENTS, EngineOutcome
from rollout_lifecycle.contract.push import WeightPush, WeightUpdate
from rollout_lifecycle.contract.values import PauseMode, check_name
from rollout_lifecycle.core.args import NO_ARGS, PhaseArgs
from rollout_lifecycle.core.bus import (
    RECORDS_CHANGED,
    Bus,
    RecordsChanged,
    StateEntered,
)
from rollout_lifecycle.core.claims import Claims, ClaimStore
from rollout_lifecycle.core.config import LifecycleConfig
from rollout_lifecycle.core.generation import GenerationClient
from rollout_lifecycle.core.group import EngineGroup, spellings
from rollout_lifecycle.core.hooks import HOOK_EVENTS, Hooks
from rollout_lifecycle.core.ledger import Fleet
from rollout_lifecycle.core.machine import Machine
from rollout_lifecycle.core.membership import Membership
from rollout_lifecycle.core.observe import Recorder
from rollout_lifecycle.core.parts import Parts, Versions
from rollout_lifecycle.core.phases import Phases
from rollout_lifecycle.core.recovery import EngineFactory, Recovery, UnitFactory
from rollout_lifecycle.core.renewal import Renewal
from rollout_lifecycle.core.router_sync import RouterSync, WorkerRouter
from rollout_lifecycle.core.runner import PhaseRunner, PhaseSettled, Plan, WorkerUrls
from rollout_lifecycle.core.scope import Serializer, current
from rollout_lifecycle.core.sessions import WeightWriter
from rollout_lifecycle.core.snapshots import GroupSnapshot, ServerSnapshot, adopt
from rollout_lifecycle.core.states import HOOK_PHASES, Phase, ServerState
from rollout_lifecycle.core.timeline import Timeline
from rollout_lifecycle.core.verify import Verification

S = ServerState
T = TypeVar("T")

#: Receives the server's snapshot whenever its records change (see ``RolloutServer``).
Journal = Callable[[ServerSnapshot], None]


@dataclass(frozen=True)
class LifecycleEvent:
    """What a hook receives: the event, the state entered and the one left."""

    event: str
    state: ServerState
    previous: ServerState
    server: RolloutServer
    #: The phase, for ``before_<phase>`` / ``after_<phase>`` events.
    phase: str | None = None


#: A hook (sync or async): see ``RolloutServer.on``.
Hook = Callable[[LifecycleEvent], Any]


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

    ``claims`` is where each call claims its engines (``core/claims``): by default
    ``HostClaims``, the controllers of this host; on a Ray cluster, ``ClusterClaims``
    (``lease``), a lease held in the cluster whose epoch every command carries, with
    ``ClusterJournal`` as the journal that a server started on any node adopts. One store per
    server.
    """

    def __init__(
        self,
        groups: Sequence[EngineGroup],
        config: LifecycleConfig | None = None,
        *,
        name: str = "rollout",
        journal: Journal | None = None,
        router: WorkerRouter | None = None,
        claims: ClaimStore | None = None,
    ) -> None:
        config = _check_arguments(groups, config, name, journal)
        if claims is not None and not callable(getattr(claims, "acquire", None)):
            raise InvalidArgument(
                f"claims must be a claim store (HostClaims, ClusterClaims) or None, got {claims!r}"
            )
        self._bus = bus = Bus()
        if journal is not None:
            bus.subscribe(RecordsChanged, lambda _: journal(self.snapshot()))
            for group in groups:
                group._before_send = self._write_journal
        self._name = name
        self._groups = tuple(groups)
        self._config = config
        self._generation: GenerationClient | None = None
        self._fleet = fleet = Fleet(self._groups, config.release_tags)
        self._hooks = hooks = Hooks(self, name, lambda: self.state, config.deadlines, self._event)
        self._runner = runner = PhaseRunner(name, config.dead_engines, bus, config.proof_window)
        self._recorder = recorder = Recorder(
            self, name, config, fleet, self._state, runner.ask, bus
        )
        bus.subscribe(PhaseSettled, lambda settled: recorder.phase(settled.result))
        urls = WorkerUrls(runner, config.deadlines.probe)
        self._router = None
        if router is not None:
            self._router = RouterSync(router, fleet, self._state, urls, name)
            bus.subscribe(StateEntered, self._router.entered)
        runner.gate = self._router
        self._versions = Versions()
        parts = Parts(
            name, fleet, runner, config, hooks, self._versions, self._write_journal, self._state
        )
        self._phases = phases = Phases(parts)
        self._writer = writer = WeightWriter(parts, phases)
        self._machine = machine = Machine(
            self,
            name,
            fleet,
            hooks,
            {
                "drain": phases.drain,
                "release": phases.release,
                "restore_weights": phases.restore_weights,
                "write_weights": writer.write,
                "restore_kv": phases.restore_kv,
                "resume": phases.continue_,
            },
            bus,
        )
        by_name = {g.name: g for g in self._groups}
        self._recovery = Recovery(parts, by_name, phases, machine)
        held = Claims(name, fleet.records, urls, runner, config.deadlines.probe, claims)
        self._membership = Membership(parts, by_name, phases, self._recovery, held, machine)
        self._serializer = Serializer(
            self,
            name,
            recorder,
            fleet.check_live,
            held.hold,
            None if self._router is None else self._router.check,
        )
        if config.renew_proofs:
            renewal = Renewal(
                name,
                runner,
                fleet.records,
                self._state,
                self._serializer.lock.locked,
                config.deadlines.probe,
            )
            bus.subscribe(StateEntered, renewal.entered)

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
    def fleet(self) -> Fleet:
        """The ledger of every engine's record, indexed by each engine's ``EngineState``:
        ``fleet.get(states=[EngineState.SERVING])``, ``fleet.count(states=...)``,
        ``fleet.by_state()`` (how many engines are in each state, to log beside ``metrics``)."""
        return self._fleet

    def _state(self) -> ServerState:
        return self._machine.state

    @property
    def state(self) -> ServerState:
        """The aggregate state."""
        return self._machine.state

    @property
    def expected_version(self) -> str | None:
        """The version of the last versioned weight update; generation continues only on
        engines that report it."""
        return self._versions.expected

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
        return dict(self._recorder.metrics)

    @property
    def slowest_engines(self) -> dict[str, str]:
        """The engine id behind each ``lifecycle/<call>/<phase>_slowest_s`` metric (same key),
        for the last completed call of each kind."""
        return dict(self._recorder.slowest)

    @property
    def timeline(self) -> Timeline:
        """Every call, phase and engine call of the last ``LifecycleConfig.timeline_calls``
        calls as spans: ``timeline.spans()``, ``timeline.export_chrome_trace(path)``,
        ``timeline.plot_gantt(path)``, ``timeline.clear()``."""
        return self._recorder.timeline

    def snapshot(self) -> ServerSnapshot:
        """The state and what the server knows of every engine."""
        return ServerSnapshot.of(self._name, self.state, self._fleet, self._versions)

    def adopt(self, snapshot: ServerSnapshot) -> None:
        """Take over engines in the state a ``snapshot()`` recorded, without calling them.

        For a process that drives engines an earlier process left in some state (the
        ``rollout-lifecycle ctl`` command does): the groups must be the snapshot's (names,
        order, ``needs_offload``, engine ids). Every record takes the snapshot's knowledge
        (paused, flushed, released and uncertain tags, alive, stale) and the server enters the
        snapshot's state, so every guard applies as if this server had made those calls. The
        records must imply that state (``failed`` takes any). A snapshot a ``journal`` took
        mid-call (records with a call in flight: uncertain tags, a pause unknown) whose records
        no longer imply its state is adopted as ``failed``: that process died with calls
        unanswered; so is one taken while a weight-update session may be open (a process
        killed in its push: ``core/snapshots.adopt``). The expected version carries over.
        Raises ``InvalidArgument``, changing nothing, when the records imply another state, a
        ``pausing`` snapshot has no call in flight, or a call is in progress.
        """
        if self._serializer.lock.locked():
            raise InvalidArgument("cannot adopt a snapshot while a lifecycle call is in progress")
        self._machine.set_state(adopt(self._fleet, snapshot))
        self._versions.expected, self._versions.interrupted = snapshot.versions()

    def _write_journal(self) -> None:
        self._bus.publish(RECORDS_CHANGED)

    @property
    def bus(self) -> Bus:
        """The server's internal events (``core/bus.py``), for the parts of the library that
        follow its lifecycle (the generation client)."""
        return self._bus

    def engines(self) -> dict[str, Any]:
        """Engine id -> handle, for every engine."""
        return {r.id: r.handle for r in self._fleet.records()}

    async def generate(self, request: dict[str, Any], group: str | None = None) -> dict[str, Any]:
        """Run one generate request to completion on a serving engine (least outstanding first).

        Held while the server is not serving (or, for a group that keeps its memory, while its
        engines are paused); an aborted request is resubmitted as prompt + partial output, so
        the caller gets one complete answer. ``meta_info`` adds ``num_resubmissions``,
        ``num_retractions`` and ``engines``. Not serialized with lifecycle calls.
        """
        return await self.generation.generate(request, group=group)

    async def generate_batch(
        self, requests: Sequence[dict[str, Any]], group: str | None = None
    ) -> list[dict[str, Any]]:
        """``generate`` for many requests at once; answers in request order."""
        return await self.generation.generate_batch(requests, group=group)

    @property
    def has_generation(self) -> bool:
        """Whether the generation client exists (``generation`` creates it)."""
        return self._generation is not None

    @property
    def generation(self) -> GenerationClient:
        """The server's generation client (created on first use)."""
        if self._generation is None:
            self._generation = GenerationClient(self)
        return self._generation

    async def probe(self) -> dict[str, EngineOutcome]:
        """Probe every live engine without generating: whether it answers, is still the process
        its record describes, and is paused as recorded (dead ones are marked dead).

        Not serialized with lifecycle calls, so it can run beside a long one; an engine found
        ``restarted`` or in ``conflict`` is looked at again under the lock once that call has
        ended (``Recovery.take_in``): its record learns what the engine shows, and the server
        becomes ``failed`` if the records then imply another state. Made from a hook, it
        leaves that to the call's own checks.
        """
        plan = Plan.over(self._groups, Observe())
        outcomes = (
            await self._runner.run(Phase.PROBE, plan, self._config.deadlines.probe)
        ).outcomes
        strange = [r for r in plan.targets if outcomes[r.id].outcome in DISAGREEMENTS]
        if strange and current(self) is None:
            outcomes.update(await self._run("probe", lambda: self._recovery.take_in(strange)))
        return outcomes

    async def sync_router(self) -> dict[str, list[str]]:
        """Bring the router (``router=``) in step with the engines that serve now: register
        those that serve, take out this fleet's other workers. Returns the worker URLs added
        and removed; ``RouterError`` when the router refuses or cannot be reached, or when an
        engine that serves does not answer the read of its worker URL (the others are synced
        first)."""
        sync = self._router
        if sync is None:
            raise InvalidArgument(f"server {self._name!r} has no router")
        return await self._run("sync_router", sync.sync)

    # -- hooks --------------------------------------------------------------------------------

    def _event(
        self, event: str, state: ServerState, previous: ServerState, phase: str | None
    ) -> LifecycleEvent:
        return LifecycleEvent(event, state, previous, self, phase)

    def on(self, event: str | ServerState, hook: Hook) -> Callable[[], None]:
        """Call ``hook(LifecycleEvent)`` (sync or async) on ``event``; returns its remover.

        Events: a state's name (entering it), ``before_<phase>`` and ``after_<phase>`` for the
        phases of ``HOOK_PHASES``. Order within a transition: ``before_<phase>`` hooks run just
        before the phase's first engine call is sent; once the transition has completed (the
        state changed) the ``after_<phase>`` hooks of its phases run in phase order, then the
        hooks of the state entered. Hooks of one event run in registration order. A hook that
        raises stops the call with ``HookFailed`` and leaves the server in the last state it
        completed (a ``before_`` hook's phase sends nothing; a drain refused by a hook
        continues what it paused and returns to ``serving``). Hooks may call the server (but
        for lifecycle calls from a ``before_`` hook, which runs inside a transition)."""
        return self._hooks.on(event, hook)

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
        args = PhaseArgs(groups=self._phases.offload_groups())
        return await self._perform("offload", args, self._phases.preflight_offload)

    async def onload_weights(self) -> dict[str, float]:
        """Resume the weights (``released -> weights_restored``); KV stays released."""
        return await self._perform("onload_weights")

    async def update_weights(
        self,
        push: WeightPush,
        version: str | None = None,
        *,
        verify: bool | None = None,
        expected: Fingerprint | Sequence[Fingerprint] | None = None,
        may_be_noop: bool = False,
    ) -> dict[str, float]:
        """Write weights while they are resident and generation is paused.

        Legal in ``drained``, ``weights_restored`` and ``kv_restored``. Opens a weight-update
        session on every engine, calls ``push(WeightUpdate)`` (sync or async), closes the
        session, sets ``version`` (never aborting a request), and flushes the prefix cache where
        the KV cache is resident. Engines still serving (groups that do not offload) are paused
        around the write and continued after it. ``verify`` (default
        ``LifecycleConfig.verify_weights``; ``expected`` implies it) checks each engine's weight
        fingerprint against its group's, its own before the push (unless ``may_be_noop``) and
        ``expected`` (``Fingerprint`` s, one per scheme; one in a scheme no engine's driver
        hashes in is refused before anything is sent): see ``core/verify``. A push that says
        it sends a write an engine's driver does not carry (``FromTensor`` to vLLM:
        ``Capabilities.weight_writes``) is refused before anything is sent, too.
        """
        wanted = (verify, expected, may_be_noop, self._config.verify_weights)
        args = _write_args(push, version, *wanted)
        return await self._perform("update_weights", args, lambda: self._writer.preflight(args))

    async def onload_kv(self) -> dict[str, float]:
        """Resume the KV cache, then continue generation.

        ``weights_restored -> kv_restored -> serving``.
        """
        return await self._perform("onload_kv")

    async def onload(self) -> dict[str, float]:
        """Everything ``offload`` undid: weights, then KV, then continue. A no-op in ``serving``.

        From ``drained`` (nothing released) it only continues generation.
        """
        return await self._perform("onload")

    async def pause(self) -> dict[str, float]:
        """Pause and drain every group (``serving -> pausing -> drained``); nothing is released."""
        return await self._perform("pause", PhaseArgs(groups=self._groups))

    async def resume(self) -> dict[str, float]:
        """Continue generation from ``drained`` or ``kv_restored``."""
        return await self._perform("resume")

    async def reset(self) -> ServerState:
        """Leave ``failed`` for the state the engines' records imply, after inspection.

        Where that state has the groups that keep their memory serve (``released``,
        ``weights_restored``, ``kv_restored``), their paused engines that report the expected
        weights are continued, as the release would have; a continue that fails raises
        ``PhaseFailed`` and the server is ``failed`` again. Raises ``IllegalTransition`` when the
        records are not consistent with any state (for example engines holding different tags,
        or a tag in an unknown state).
        """
        await self._serializer.run("reset", self._recovery.reset)
        return self.state

    async def recover(
        self, factory: EngineFactory | None = None, *, unit_factory: UnitFactory | None = None
    ) -> dict[str, EngineOutcome]:
        """Replace dead engines, and engines whose memory state is unknown, through ``factory``
        (called with the engine's id; may be async).

        A unit of several servers (``EngineGroup(unit=N)``) with such a member, or a member
        found restarted, is replaced whole through ``unit_factory``: called with the ids of its
        members, it returns one new engine per member, in that order; the members that still
        lived are retired. Each replacement is brought to the memory state of its group in the
        server's current state (paused and flushed, released tags released) before it rejoins,
        and counts as stale until it receives weights. From ``failed`` the server then settles
        in the state the engines imply. Returns the outcome of bringing up each replacement.
        """
        for name, fn in (("factory", factory), ("unit_factory", unit_factory)):
            if fn is not None and not callable(fn):
                raise InvalidArgument(f"{name} must be callable, got {fn!r}")
        if factory is None and unit_factory is None:
            raise InvalidArgument("recover() needs a factory, a unit_factory, or both")
        return await self._run("recover", lambda: self._recovery.recover(factory, unit_factory))

    async def add_engines(self, group: str, engines: Sequence[Any]) -> list[str]:
        """Engines join the group named ``group`` of a running fleet; their ids
        (``group/index``, the group's next indexes: an id is never given twice).

        In any settled state (not ``failed``): the engines are claimed, read (each must be a
        fresh server, not paused, or none joins: ``PhaseFailed``), and brought to their
        group's memory state in the server's state (released where the group is released; a
        step that fails leaves them in the fleet and the server ``failed``, for ``recover()``).
        Each is stale until the fleet's next weight push reaches it (verified where the push
        is): until then it waits paused, and only then does it serve, get requests and join
        the router. The engines must be new to the fleet; a group of units (``unit=N``)
        refuses them. See ``core/membership``.
        """
        return await self._run("add_engines", lambda: self._membership.add(group, engines))

    async def remove_engines(
        self, ids: Sequence[str], *, stop: bool = True
    ) -> dict[str, EngineOutcome]:
        """The engines ``ids`` leave the fleet; the outcome of every call sent to them.

        In any settled state (not ``failed``): each live one is taken out of the router and
        paused in abort mode, its requests aborted (the generation client resubmits them to the
        engines that stay: nothing is lost), flushed, and every memory tag it holds released;
        then they leave the records, and are stopped as ``recover()`` retires an engine (a Ray
        engine actor is killed), unless ``stop=False`` keeps them (paused, every tag released:
        resume the memory before anything continues one). A step that fails raises
        ``PhaseFailed`` with the server ``failed`` and the engines still the fleet's
        (``recover()``, then try again); a group keeps at least one engine. See
        ``core/membership``.
        """
        if not isinstance(stop, bool):
            raise InvalidArgument(f"stop must be a bool, got {stop!r}")
        return await self._run("remove_engines", lambda: self._membership.remove(ids, stop))

    def unhealthy_units(self) -> dict[str, str]:
        """Each unit of several servers (``EngineGroup(unit=N)``) that cannot serve whole,
        named ``group/first-last``, with why (a member dead, or holding tags in an unknown
        state): ``recover(unit_factory=...)`` replaces it."""
        return self._fleet.unhealthy_units()

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

    async def _perform(
        self, call: str, args: PhaseArgs = NO_ARGS, check: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """Run ``call``'s plan from the ``CALLS`` table under the lock, after ``check()`` when
        the plan has something to do."""

        async def body() -> None:
            if check is not None and self._machine.plan(call):
                check()
            await self._machine.perform(call, args)

        return await self._serializer.run(call, body)

    async def _run(self, call: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` as the public call ``call``, under the lock; what it returned."""
        done: list[T] = []

        async def body() -> None:
            done.append(await work())

        await self._serializer.run(call, body)
        return done[0]


def _write_args(
    push: object, version: str | None, verify: object, expected: object, noop: object, default: bool
) -> PhaseArgs:
    """``update_weights``' arguments checked, as its phase takes them."""
    if not callable(push):
        raise InvalidArgument(f"push must be callable, got {push!r}")
    if version is not None:
        check_name("version", version)
    spec = Verification.wanted(verify, expected, noop, default)
    return PhaseArgs(push=push, version=version, verify=spec)


def _check_arguments(
    groups: object, config: LifecycleConfig | None, name: str, journal: Journal | None
) -> LifecycleConfig:
    """``RolloutServer``'s arguments checked; the configuration (the default one for None)."""
    _check_groups(groups)
    if config is None:
        config = LifecycleConfig()
    if not isinstance(config, LifecycleConfig):
        raise InvalidArgument(f"config must be a LifecycleConfig, got {config!r}")
    check_name("server name", name)
    if journal is not None and not callable(journal):
        raise InvalidArgument(f"journal must be callable or None, got {journal!r}")
    return config


def _check_groups(groups: object) -> None:
    """Refuse anything but a non-empty sequence of groups with distinct names, and an engine
    in two groups (or twice in one)."""
    if isinstance(groups, EngineGroup) or not isinstance(groups, Sequence):
        raise InvalidArgument(f"groups must be a sequence of EngineGroup, got {groups!r}")
    if not groups:
        raise InvalidArgument("a RolloutServer needs at least one EngineGroup")
    names: set[str] = set()
    owners: dict[Hashable, Any] = {}
    for group in groups:
        if not isinstance(group, EngineGroup):
            raise InvalidArgument(f"expected an EngineGroup, got {group!r}")
        if group.name in names:
            raise InvalidArgument(f"two groups are named {group.name!r}")
        names.add(group.name)
        for record in group.records:
            key = record.key
            first = owners.get(key)
            if first is not None:
                raise InvalidArgument(
                    f"engine {record.id} is also engine {first.id} "
                    f"({spellings(first.handle, record.handle, key)}); an engine belongs to "
                    f"one group, once"
                )
            owners[key] = record


__all__ = [
    "HOOK_EVENTS",
    "HOOK_PHASES",
    "GroupSnapshot",
    "LifecycleError",
    "LifecycleEvent",
    "RolloutServer",
    "ServerSnapshot",
    "WeightUpdate",
]
