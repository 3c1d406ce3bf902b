"""The phase runner: every engine call of the lifecycle is planned, guarded, sent and settled here.

A ``Plan`` names one operation and the engines it goes to, across any number of groups.
``issue`` checks the operation's guard on *every* target before it sends to *any* (all or
nothing), records the intent of calls that must not repeat, lets the journal write it (the
bus's ``RecordsChanged``), then sends each call through the engine seam without waiting.
``PhaseRunner.run`` is one phase: issue, gather every call with one deadline (the barrier), keep
the calls that missed it as stragglers, write each outcome into the ledger, then publish
``PhaseSettled`` (metrics, timeline, the generation client) and ``RecordsChanged``.
``PhaseRunner.ask`` sends the reads the server makes beside the lifecycle. Which targets
an operation has by default, which guard protects it, whether its intent is recorded and whether
the engine must show who it is first are its command's (``core/commands``), not choices each
caller makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.commands import EngineCommand, Observe, ReadWorkerUrl
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import PhaseFailed
from rollout_lifecycle.contract.identity import PROOF_WINDOW, disagreement
from rollout_lifecycle.contract.ops import CHECKED, FENCED, RUN, Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome, ok_outcome
from rollout_lifecycle.contract.seam import Landed
from rollout_lifecycle.contract.values import PauseMode, Tag
from rollout_lifecycle.core.bus import RECORDS_CHANGED, Bus, RecordsChanged
from rollout_lifecycle.core.commands import COMMANDS
from rollout_lifecycle.core.config import DeadEnginePolicy
from rollout_lifecycle.core.ledger import EngineRecord, GroupRecords, InFlight, default_targets
from rollout_lifecycle.core.states import Phase, ServerState

#: The operations as module globals: the ledger and the runner compare them once per engine
#: per phase, and a global is read several times faster than an ``Op`` member.
_FLUSH, _RELEASE = Op.FLUSH, Op.RELEASE
_OBSERVE = Op.OBSERVE
#: The observation after a checked call lost its connection.
_LOOK = Observe()
_OK, _RESTARTED, _UNREACHABLE = Outcome.OK, Outcome.RESTARTED, Outcome.UNREACHABLE
_FAILED = EngineOutcome(Outcome.NOT_ATTEMPTED)
#: What an answered observation proved: the engine's incarnation (``EngineRecord.answered``).
_IDENTIFIED = (None, None, True)


@dataclass(frozen=True)
class Plan:
    """One command for a set of engines, possibly of several groups; nothing sent yet."""

    command: EngineCommand
    targets: tuple[EngineRecord, ...]

    @classmethod
    def over(cls, groups: Iterable[GroupRecords], command: EngineCommand) -> Plan:
        """``command`` to the default targets (``default_targets``) of every group of
        ``groups``."""
        return cls(command, targets_of(groups, command.op))

    @property
    def op(self) -> Op:
        """The command's operation."""
        return self.command.op

    @property
    def tags(self) -> tuple[Tag, ...]:
        """The memory tags the command moves (a release's or resume's)."""
        return self.command.tags

    @property
    def mode(self) -> PauseMode | None:
        """The pause mode (a pause's)."""
        return self.command.mode

    def check(self) -> None:
        """Run the command's guard on every target; raises ``IllegalEngineOp`` at the first
        refusal."""
        guard(self.op, self.targets, self.tags)


def guard(op: Op, targets: Iterable[EngineRecord], tags: tuple[Tag, ...] = ()) -> None:
    """Run ``op``'s guard (with ``tags``, for a release or resume) on every record of
    ``targets``; ``IllegalEngineOp`` at the first refusal, before anything is sent."""
    cmd = COMMANDS[op]
    for record in targets:
        record.check(cmd, tags)


def targets_of(groups: Iterable[GroupRecords], op: Op) -> tuple[EngineRecord, ...]:
    """The default targets (``default_targets``) of ``op`` in every group of ``groups``."""
    return tuple(r for g in groups for r in default_targets(g, op))


def guard_groups(groups: Iterable[GroupRecords], op: Op, tags: tuple[Tag, ...] = ()) -> None:
    """``guard`` over the default targets of ``op`` in every group of ``groups``."""
    guard(op, targets_of(groups, op), tags)


@dataclass(eq=False, slots=True)
class PendingCall:
    """One engine call that has been issued and not yet gathered (a view of ``Calls``)."""

    record: EngineRecord
    op: Op
    tags: tuple[Tag, ...]
    mode: PauseMode | None
    ref: Awaitable[Any]
    start: float


class Calls:
    """Engine calls issued together and not yet gathered, as parallel lists.

    Issuing a call adds no object of its own (only the engine's future), so that a phase of
    thousands of calls gives CPython's collector nothing more to count or walk; iterating
    gives ``PendingCall`` views, for the paths that are not per-engine-per-phase.
    """

    __slots__ = (
        "expects",
        "handles",
        "modes",
        "ops",
        "proven",
        "records",
        "refs",
        "sent",
        "starts",
        "tags",
    )

    def __init__(self) -> None:
        self.records: list[EngineRecord] = []
        self.ops: list[Op] = []
        self.tags: list[tuple[Tag, ...]] = []
        self.modes: list[PauseMode | None] = []
        self.refs: list[Awaitable[Any]] = []
        self.starts: list[float] = []
        #: The handle each call went to (a record may get a replacement while it flies).
        self.handles: list[Any] = []
        #: What each checked call's engine had to show first (None: sent plain).
        self.expects: list[tuple[str | None, bool | None, bool] | None] = []
        #: Whether each call went to a process its record had proven (``proven_until``).
        self.proven: list[bool] = []
        #: When the calls were sent, by the loop's clock (before the first of them).
        self.sent: list[float] = []

    @classmethod
    def join(cls, parts: Iterable[Calls]) -> Calls:
        """One batch of the calls of ``parts``, in order."""
        joined = cls()
        for part in parts:
            for name in cls.__slots__:
                getattr(joined, name).extend(getattr(part, name))
        return joined

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[PendingCall]:
        columns = (self.records, self.ops, self.tags, self.modes, self.refs, self.starts)
        for record, op, tags, mode, ref, start in zip(*columns, strict=True):
            yield PendingCall(record, op, tags, mode, ref, start)


def issue(
    plan: Plan,
    before_send: Callable[[], None] | None = None,
    fence: list[Any] | None = None,
) -> Calls:
    """Send ``plan``: every guard passes, on every target of every group, before the first
    call is sent; the intent of calls that must not repeat is recorded and ``before_send``
    (the journal) runs before any is sent, and a ``before_send`` that raises sends nothing.
    With a ``fence`` (a cluster lease's ``[scope, epoch]``), every call carries it and the
    engine host refuses it if a newer lease has acted on the engine (``EngineHost.fenced``)."""
    plan.check()
    op, chosen = plan.op, list(plan.targets)
    cmd = COMMANDS[op]
    now = asyncio.get_running_loop().time()
    checked, part, tags, mode = cmd.checked, cmd.part, plan.tags, plan.mode
    # One pass over the targets (at thousands of engines each pass over their records costs
    # a cache miss per record): what each engine must show before a checked call, whether its
    # process is proven, and the intent, each record's expectation taken before its own intent
    # changes it (a continue's intent makes the pause state unknown).
    expects: list[tuple[str | None, bool | None, bool] | None] = []
    proven: list[bool] = []
    for record in chosen:
        expects.append(record.expect(op, now) if checked else None)
        proven.append(now < record.proven_until)
        if part is not None:
            record.intend(op, tags, mode)
    if chosen and part is not None and before_send is not None:
        try:
            before_send()
        except BaseException:
            for record in chosen:
                record.undo_intent()
            raise
    calls = Calls()
    refs, starts, handles, command = calls.refs, calls.starts, calls.handles, plan.command
    carried = command.wire  # what the engine host's ``run`` takes, the same for every engine
    kind: type | None = None
    send: Callable[[Any, str, tuple[Any, ...]], Awaitable[Any]] | None = None
    for i, record in enumerate(chosen):
        handle = record.handle
        if type(handle) is not kind:  # (a plan's handles are nearly always of one kind)
            kind, send = type(handle), seam.seam_for(handle).send
        assert send is not None
        starts.append(time.monotonic())
        handles.append(handle)
        expect = expects[i]
        if fence is not None:  # (under a cluster lease: the engine host checks its epoch first)
            via = (RUN, *carried) if expect is None else (CHECKED, expect, *carried)
            refs.append(send(handle, FENCED, (fence, *via)))
        elif expect is None:
            refs.append(send(handle, RUN, carried))
        else:  # the engine shows who it is before the command is carried out (EngineHost.checked)
            refs.append(send(handle, CHECKED, (expect, *carried)))
    calls.records = chosen
    calls.expects, calls.proven, calls.sent = expects, proven, [now] * len(chosen)
    calls.ops = [op] * len(chosen)
    calls.tags = [plan.tags] * len(chosen)
    calls.modes = [plan.mode] * len(chosen)
    return calls


@dataclass
class PhaseResult:
    """What one phase came to: each engine's outcome and what observers record of it."""

    phase: Phase
    outcomes: dict[str, EngineOutcome]
    start: float
    seconds: float
    #: The timeline's record of the engine calls, six flat fields per call.
    spans: list[str | float] = field(default_factory=list)
    #: The slowest engine call: (engine id, seconds).
    slowest: tuple[str, float] | None = None
    #: For a phase that flushes, the flush attempts beyond the first.
    retries: int | None = None
    #: The calls and what became of each (for ``value``).
    calls: Calls = field(default_factory=Calls)
    landed: Landed | None = None
    #: The engines a call found restarted (another process at the address), with the
    #: incarnation each showed.
    restarted: dict[str, str | None] = field(default_factory=dict)
    #: The engines whose outcome is not ``ok``, in the order their calls were issued (taken
    #: as the calls settle: the phase's success and its lost connections are read from it, not
    #: from another pass over every outcome).
    failed: list[str] = field(default_factory=list)

    def value(self, engine: str) -> Any:
        """What ``engine``'s call returned (None if it failed or was not in the phase)."""
        if not self.outcomes.get(engine, _FAILED).ok:
            return None
        return self.answer(engine)

    def answer(self, engine: str) -> Any:
        """What ``engine``'s call answered, whatever the phase made of it (a report that
        disagrees with the record included); None if it raised or was not in the phase."""
        if self.landed is None:
            return None
        for i, record in enumerate(self.calls.records):
            if record.id == engine:
                return self.landed.values[i] if self.landed.errors[i] is None else None
        return None


@dataclass(frozen=True)
class PhaseSettled:
    """A phase settled (every call answered or missed its deadline): an event of the server's
    bus (``core.bus``)."""

    result: PhaseResult


class Gate(Protocol):
    """Runs before a phase is issued (and may refuse it: nothing is sent) and after it settles."""

    async def before(self, plan: Plan) -> None: ...

    async def after(self, plan: Plan, result: PhaseResult) -> None: ...


class PhaseRunner:
    """Runs phases over a server's engines: issue, barrier, stragglers, ledger, events."""

    def __init__(
        self,
        name: str,
        dead_engines: DeadEnginePolicy,
        bus: Bus,
        proof_window: float = PROOF_WINDOW,
    ) -> None:
        self._name = name
        #: How long an answer proves the process that gave it (``LifecycleConfig``).
        self.proof_window = proof_window
        self._skip_dead = dead_engines is DeadEnginePolicy.SKIP
        #: The server's events (``core.bus``): the runner publishes ``PhaseSettled`` and
        #: ``RecordsChanged`` there, its clients what they find (``WeightsVerified``).
        self.bus = bus
        #: Runs around every phase with engines (``core/router_sync.RouterSync``), if bound.
        self.gate: Gate | None = None
        #: The fence every command carries while a cluster lease is held (``core/claims``).
        self.fence: list[Any] | None = None

    def issue(self, plan: Plan) -> Calls:
        """``issue(plan)``, the records published (``RecordsChanged``: the journal) before any
        call is sent."""
        return issue(
            plan, self._records_changed if self.bus.has(RecordsChanged) else None, self.fence
        )

    def _records_changed(self) -> None:
        self.bus.publish(RECORDS_CHANGED)

    async def run(self, phase: Phase, plan: Plan, deadline: float) -> PhaseResult:
        """Issue ``plan`` and settle it as ``phase`` (between the gate's ``before`` and
        ``after``, when one is bound: a router in front of the fleet).

        A call of an earlier phase still in flight on a target (a straggler) first gets up to
        ``deadline`` to land when it could still matter (``matters``): a late pause after a
        continue leaves an engine paused behind a ledger that says serving; one after a flush
        leaves the release to follow on an engine not flushed since its last pause. If one that
        matters has still not landed, nothing is sent to any target and every target's outcome
        is ``not_attempted``.
        """
        # (a straggler is a call that missed its phase's deadline and may still land: its
        # engine's record holds it, ``EngineRecord.in_flight``)
        busy = await self._still_in_flight(plan, deadline)
        if busy:
            return self._not_sent(phase, plan, busy)
        gate = self.gate
        if gate is None or not plan.targets:
            result = await self.settle(phase, self.issue(plan), deadline)
            await self._after_drops(plan, result, deadline)
            return result
        await gate.before(plan)
        result = await self.settle(phase, self.issue(plan), deadline)
        await self._after_drops(plan, result, deadline)
        await gate.after(plan, result)
        return result

    async def _after_drops(self, plan: Plan, result: PhaseResult, deadline: float) -> None:
        """Look again at the engines whose checked call lost its connection: a process that
        restarted under the call leaves a new one at the address, and then the record describes
        the new process (what was uncertain of the old one is gone with it); one that died is
        found dead at once."""
        if not result.failed or not COMMANDS[plan.op].checked:
            return
        outcomes = result.outcomes
        dropped = tuple(
            r
            for r in plan.targets
            if outcomes[r.id].outcome is _UNREACHABLE and r.alive and r.in_flight is None
        )
        if not dropped:
            return
        look = await self.settle(
            Phase.OBSERVE_AFTER_DROP, self.issue(Plan(_LOOK, dropped)), deadline
        )
        for record in dropped:
            out = look.outcomes[record.id]
            if out.outcome is _RESTARTED:
                record.learn(_RESTARTED, look.restarted[record.id])
                before = result.outcomes[record.id]
                result.outcomes[record.id] = EngineOutcome(
                    _RESTARTED, f"{before.detail}; then {out.detail}", before.duration_s
                )
                result.restarted[record.id] = look.restarted[record.id]
        if look.restarted:
            self.bus.publish(RECORDS_CHANGED)

    async def ask(
        self, command: EngineCommand, records: Sequence[EngineRecord], deadline: float
    ) -> dict[str, Any]:
        """What each engine of ``records`` answers to the read ``command`` within ``deadline``, by
        engine id; one that fails (a dead one), cannot take ``op`` or does not answer in time is
        left out (a late call is cancelled). For what the server reads beside the lifecycle (the
        router binding's and the claims' worker URLs, the memory metrics): sent through the seam
        like a phase's calls, but no phase: a read changes no record, so nothing is settled or
        published. The caller chooses the records: the worker URL of an in-process engine
        recorded dead is still read (its address stays this server's to claim and to take out
        of the router), the memory of the live engines only."""
        if not command.reads:
            raise ValueError(f"ask() sends reads only, not {command.op.value!r}")
        sent: list[tuple[EngineRecord, Awaitable[Any]]] = []
        for record in records:
            with contextlib.suppress(Exception):  # a handle that cannot take it answers nothing
                sent.append((record, seam.command(record.handle, command)))
        if not sent:
            return {}
        landed = await seam.wait([ref for _, ref in sent], deadline)
        answers: dict[str, Any] = {}
        for i, (record, ref) in enumerate(sent):
            if landed.ends[i] is None:
                seam.cancel(ref, landed.late[i])
            elif landed.errors[i] is None:
                answers[record.id] = landed.values[i]
        return answers

    async def require(self, phase: Phase, plan: Plan, deadline: float) -> PhaseResult:
        """``run``, raising ``PhaseFailed`` unless the phase succeeded (``succeeded``)."""
        result = await self.run(phase, plan, deadline)
        if result.failed and not self.succeeded(result.outcomes):
            raise PhaseFailed(phase, result.outcomes, ServerState.FAILED.value)
        return result

    def succeeded(self, outcomes: Mapping[str, EngineOutcome]) -> bool:
        """Every engine succeeded, or (``DeadEnginePolicy.SKIP``) was found dead; and every
        group the phase reached has an engine that succeeded: no success on nothing."""
        if all(o.outcome is _OK for o in outcomes.values()):
            return True  # (every group reached has an engine that succeeded)
        reached: set[str] = set()
        succeeded: set[str] = set()
        for engine, o in outcomes.items():
            group = engine.rpartition("/")[0]
            reached.add(group)
            if o.ok:
                succeeded.add(group)
            elif not (self._skip_dead and o.outcome is Outcome.DEAD):
                return False
        return succeeded == reached

    async def landed(
        self, records: Sequence[EngineRecord], timeout: float, op: Op
    ) -> list[EngineRecord]:
        """Give the calls still in flight on ``records`` that would matter to a call of ``op``
        (``EngineRecord.busy_for``) up to ``timeout`` to land; the records with none left."""
        late = [r.in_flight.future for r in records if r.in_flight and r.in_flight.matters_to(op)]
        if late:
            await asyncio.wait(late, timeout=timeout)
        return [r for r in records if not r.busy_for(op)]

    async def _still_in_flight(self, plan: Plan, deadline: float) -> set[str]:
        """The targets of ``plan`` with a call in flight that matters to it after up to
        ``deadline``."""
        waiting = [r for r in plan.targets if r.busy_for(plan.op)]
        if not waiting:
            return set()
        ready = await self.landed(waiting, deadline, plan.op)
        return {r.id for r in waiting} - {r.id for r in ready}

    def _not_sent(self, phase: Phase, plan: Plan, busy: set[str]) -> PhaseResult:
        """The result of a phase held back by calls still in flight on ``busy``."""
        held = EngineOutcome(Outcome.NOT_ATTEMPTED, "an earlier call is still in flight")
        spared = EngineOutcome(
            Outcome.NOT_ATTEMPTED, "not sent: another engine's earlier call is in flight"
        )
        outcomes = {r.id: held if r.id in busy else spared for r in plan.targets}
        logger().warning("phase.not_sent", server=self._name, phase=phase, in_flight=sorted(busy))
        result = PhaseResult(phase, outcomes, time.monotonic(), 0.0, failed=list(outcomes))
        self.observe(result)
        return result

    def observe(self, result: PhaseResult) -> None:
        """Publish that ``result``'s phase settled (also for time spent outside engine calls)."""
        self.bus.publish(PhaseSettled(result))

    async def settle(self, phase: Phase, calls: Calls, deadline: float) -> PhaseResult:
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
        # One wait for the whole phase: per-call futures cost more than the rest of the
        # bookkeeping at thousands of engines.
        landed = await seam.wait(calls.refs, deadline)
        result = PhaseResult(phase, {}, start, 0.0, calls=calls, landed=landed)
        outcomes, spans, failed = result.outcomes, result.spans, result.failed
        slowest_id: str | None = None
        slowest_s = -1.0
        retries: int | None = None
        window = self.proof_window
        ends, values, errors = landed.ends, landed.values, landed.errors
        expects, proven, sent = calls.expects, calls.proven, calls.sent
        columns = (calls.records, calls.ops, calls.tags, calls.modes, calls.starts, calls.handles)
        for i, (record, op, tags, mode, began, sent_to) in enumerate(zip(*columns, strict=True)):
            # ``recover()`` may have given the record a replacement while the call flew: what
            # became of the call is the retired engine's, not the replacement's
            current = record.handle is sent_to
            seen: str | None = None  # the incarnation the engine showed
            declared: Any = None  # and, with it, what its driver declares it can do
            end = ends[i]
            if end is None:
                end = time.monotonic()
                out = EngineOutcome(
                    Outcome.TIMED_OUT, f"no answer within {deadline:g}s", end - began
                )
                if current:
                    self._straggler(record, op, landed.late[i])
            elif (exc := errors[i]) is None:
                out = ok_outcome(end - began)
                if expects[i] is not None:
                    seen, values[i], declared = _checked_value(values[i])
                elif op is _OBSERVE:
                    out, seen, declared = judge(record, values[i], out.duration_s)
            else:
                out = seam.classify(exc, end - began)
                if out.outcome is _RESTARTED:
                    seen = getattr(seam.unwrap(exc), "found", None)
            outcome = out.outcome
            if outcome is not _OK:
                failed.append(record.id)
                if outcome is _RESTARTED:
                    result.restarted[record.id] = seen
            if op is _FLUSH:
                attempts = values[i] if outcome is _OK else None
                retries = (retries or 0) + (max(attempts - 1, 0) if type(attempts) is int else 0)
            if out.duration_s > slowest_s:
                slowest_id, slowest_s = record.id, out.duration_s
            spans += (record.id, record.group, op._value_, began, end, outcome._value_)
            if current:
                record.apply(op, tags, mode, out, seen, declared)
                if op is _RELEASE and outcome is _OK and values[i] is True:
                    record.lost_weights()  # (the host's answer: weights' values gone)
                expected = _IDENTIFIED if op is _OBSERVE else expects[i]
                record.answered(op, out, expected, proven[i], sent[i] + window)
            outcomes[record.id] = out
            if debug:
                log.debug(
                    "engine_call.end",
                    group=record.group,
                    engine=record.id,
                    op=op,
                    outcome=outcome.value,
                    detail=out.detail or None,
                    duration_s=round(out.duration_s, 6),
                )
        if calls:  # the phase begins with its first engine call, issued before the gather
            start = min(start, calls.starts[0])
        result.start, result.seconds = start, time.monotonic() - start
        result.slowest = None if slowest_id is None else (slowest_id, slowest_s)
        result.retries = retries
        self.observe(result)
        self.bus.publish(RECORDS_CHANGED)
        log.info(
            "phase.end",
            engines=len(calls),
            outcome="ok" if not failed else "failed",
            failed_engines=sorted(failed) or None,
            duration_s=round(result.seconds, 6),
        )
        return result

    def _straggler(self, record: EngineRecord, op: Op, future: asyncio.Future[Any]) -> None:
        """Keep the call of ``op`` that missed its deadline on ``record`` (``future`` lands when
        it does), so that nothing is sent to this engine before it has (see ``landed``). One
        still flying from before (a read, or a repeat of this call) is waited for with it, and a
        call that is not a read keeps deciding what must wait."""
        earlier = record.in_flight
        late_op = op
        if earlier is not None:
            future = asyncio.gather(earlier.future, future, return_exceptions=True)
            if COMMANDS[op].reads:
                late_op = earlier.op
        flying = record.flies(late_op, future)
        future.add_done_callback(functools.partial(self._forget_straggler, record, flying))

    def _forget_straggler(
        self, record: EngineRecord, flying: InFlight, future: asyncio.Future[Any]
    ) -> None:
        record.landed_late(flying)


class WorkerUrls:
    """Each engine's worker URL (``Op.WORKER_URL``: the address a router lists it at and its
    claim locks), asked once per engine through ``PhaseRunner.ask``; None for an engine that
    has none. An engine that does not answer now (dead, too slow) is asked again next time."""

    def __init__(self, runner: PhaseRunner, deadline: float) -> None:
        self._runner = runner
        self._deadline = deadline
        #: By handle identity (a replacement is asked anew).
        self._urls: dict[Hashable, str | None] = {}

    async def of(self, records: Sequence[EngineRecord]) -> dict[str, str | None]:
        """The worker URL of each of ``records``, by engine id (None: none, or not known yet)."""
        keys = [r.key for r in records]
        missing = [r for r, key in zip(records, keys, strict=True) if key not in self._urls]
        if missing:
            found = await self._runner.ask(ReadWorkerUrl(), missing, self._deadline)
            for record, key in zip(records, keys, strict=True):
                if record.id in found:
                    url = found[record.id]
                    self._urls[key] = url if isinstance(url, str) else None
        return {r.id: self._urls.get(key) for r, key in zip(records, keys, strict=True)}

    @property
    def deadline(self) -> float:
        """Seconds an engine is given to answer the read."""
        return self._deadline

    def unread(self, records: Sequence[EngineRecord]) -> list[str]:
        """The ids of ``records`` whose worker URL is not known: asked (``of``) and not
        answered, unlike an engine that answered it has none."""
        return [r.id for r in records if r.key not in self._urls]


def _checked_value(value: Any) -> tuple[str | None, Any, Any]:
    """A checked call's answer (``(incarnation, result, capabilities)``,
    ``EngineHost.checked``) split."""
    if type(value) in (list, tuple) and len(value) == 3:
        seen = value[0]
        return (seen if isinstance(seen, str) else None), value[1], value[2]
    return None, value, None


def judge(record: EngineRecord, observed: Any, took: float = 0.0) -> tuple[EngineOutcome, Any, Any]:
    """What an engine's report of itself (``Op.OBSERVE``) says against its record: ``ok``, or
    ``restarted`` / ``conflict`` naming both views (``core/identity.disagreement``); the
    incarnation it showed, and what its driver declared with it (``EngineHost.observe``)."""
    if not isinstance(observed, Mapping):
        return EngineOutcome(Outcome.ERROR, f"observe answered {observed!r}", took), None, None
    seen, declared = observed.get("incarnation"), observed.get("capabilities")
    found = disagreement(record.observed(), observed)
    if found is None:
        return EngineOutcome(_OK, "", took), seen, declared
    verdict, records, reported = found
    detail = f"the records hold {records}, the engine reports {reported}"
    return EngineOutcome(verdict, detail, took), seen, declared


def _debug_enabled(log: Any) -> bool:
    """Whether ``log`` emits debug events (a logger that cannot tell is taken to emit them)."""
    check = getattr(log, "is_enabled_for", None)
    return True if check is None else bool(check(logging.DEBUG))


__all__ = [
    "Calls",
    "PendingCall",
    "PhaseResult",
    "PhaseRunner",
    "PhaseSettled",
    "Plan",
    "WorkerUrls",
    "issue",
]
