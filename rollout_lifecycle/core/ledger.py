"""The fleet ledger: what the server knows of every engine, the guards, and the memory targets.

An ``EngineRecord`` is one engine's entry: paused or not, which memory tags are released or in
an unknown state, whether it passed the idle barrier since its last pause, alive or dead. Its
``check_*`` guards refuse a call that would kill the engine before it is sent; ``intend`` and
``apply`` record what a call may have done and what it did. ``target`` is the one table from a
server state to the memory state each engine should be in; ``Fleet`` answers every question
the server, recovery, ``adopt`` and the generation client ask of the records, from that table.
Nothing here sends a call.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Protocol

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.enums import ValueEnum
from rollout_lifecycle.contract.exceptions import IllegalEngineOp, InvalidArgument
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import SESSION_OPEN, EngineOutcome, Outcome
from rollout_lifecycle.contract.values import (
    ALL_TAGS,
    WEIGHT_TAGS,
    PauseMode,
    Tag,
    parse_tags,
)
from rollout_lifecycle.core.commands import (
    COMMANDS,
    Command,
    Effect,
    Guard,
    Part,
    Refusal,
    Targets,
    command,
)
from rollout_lifecycle.core.states import ServerState

S = ServerState

#: The operations as module globals: the ledger and the runner compare them once per engine
#: per phase, and a global is read several times faster than an ``Op`` member.
_PAUSE, _CONTINUE = Op.PAUSE, Op.CONTINUE
_RELEASE, _RESUME, _SET_VERSION = Op.RELEASE, Op.RESUME, Op.SET_VERSION
_DEAD, _RESTARTED, _CONFLICT = Outcome.DEAD, Outcome.RESTARTED, Outcome.CONFLICT
_OK = Outcome.OK
#: The commands' named values, read on every engine call (a global is read faster than a member).
_ALIVE, _CONTINUE_GUARD, _RELEASE_GUARD = Guard.ALIVE, Guard.CONTINUE, Guard.RELEASE
_RESUME_GUARD, _MEMORY, _PAUSE_PART = Guard.RESUME, Part.MEMORY, Part.PAUSE
_PAUSED, _CONTINUED, _FLUSHED = Effect.PAUSED, Effect.CONTINUED, Effect.FLUSHED
_RELEASED, _RESUMED = Effect.RELEASED, Effect.RESUMED
_OPENED, _CLOSED, _BEGIN = Effect.SESSION_OPENED, Effect.SESSION_CLOSED, Refusal.BEGIN
_ON_PAUSED, _ON_OFFLOADING = Targets.PAUSED, Targets.OFFLOADING

#: The operations that set the pause state whatever it was.
_PAUSING = frozenset({Op.PAUSE, Op.CONTINUE})
#: Outcomes that are an answer of the process the call reached (or no call at all).
_ANSWERED = frozenset({Outcome.REJECTED, Outcome.REFUSED, Outcome.NOT_ATTEMPTED})

#: Outcomes after which an engine may or may not have carried out the call.
_EFFECT_UNKNOWN = frozenset({Outcome.TIMED_OUT, Outcome.UNREACHABLE, Outcome.ERROR})


def _tag_list(tags: Collection[Tag]) -> list[str]:
    return [t.value for t in tags]


# -- the one state an engine's facts add up to -------------------------------------------------


class EngineState(ValueEnum):
    """What an engine's record says it is: one value derived from its facts (``engine_state``),
    never stored. The fleet is indexed by it (``Fleet.get``, ``Fleet.count``), and every
    question about which engines serve, continue or are replaced is a set of these.

    In order of precedence: what is known of an engine's life and memory comes before its
    weights, its weights before its pause state."""

    #: Known dead: nothing is sent to it; ``recover()`` replaces it.
    DEAD = "dead"
    #: Holds memory tags in an unknown state (a release or resume that did not answer, or
    #: another controller's doing): no call that could kill it is sent; ``recover()`` replaces
    #: it.
    UNCERTAIN = "uncertain"
    #: Without the fleet's weights and not paused (found restarted, or a replacement not brought
    #: up): generation on it would use other weights.
    STALE = "stale"
    #: Holds some of its memory released (paused).
    RELEASED = "released"
    #: All memory resident, without the fleet's weights, held paused until a push reaches it.
    WAITING = "waiting"
    #: The fleet's weights resident and paused; its KV cache was resumed, but its driver wakes
    #: the KV cache only at the continue (``Capabilities.kv_wakes_at_continue``: vLLM), so
    #: until then it is asleep.
    KV_ASLEEP = "kv_asleep"
    #: All memory resident, the fleet's weights, paused, not known to be idle (a pause without
    #: its flush yet, or a pause or continue that did not answer).
    PAUSED = "paused"
    #: All memory resident, the fleet's weights, paused and idle (flushed since its pause, or
    #: paused in place).
    DRAINED = "drained"
    #: All memory resident, the fleet's weights, not paused: it takes generate requests.
    SERVING = "serving"


_E = EngineState
_SERVING_STATE = EngineState.SERVING
#: The states of an engine not known to be dead.
LIVE_STATES = frozenset(EngineState) - {EngineState.DEAD}
#: The states of the engines ``recover()`` replaces.
BROKEN_STATES = frozenset({EngineState.DEAD, EngineState.UNCERTAIN})
#: Paused with every tag resident (or, for a driver whose continue wakes the KV cache, resumed)
#: and the fleet's weights: a continue may be sent.
CONTINUABLE_STATES = frozenset({EngineState.KV_ASLEEP, EngineState.PAUSED, EngineState.DRAINED})


class EngineFacts(Protocol):
    """The facts an engine's state is derived from (a record's, or a snapshot's: tags and the
    pause mode may be members or their values)."""

    @property
    def alive(self) -> bool: ...

    @property
    def uncertain(self) -> Collection[object]: ...

    @property
    def stale(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    @property
    def released(self) -> Collection[object]: ...

    @property
    def pause_unknown(self) -> bool: ...

    @property
    def flushed(self) -> bool: ...

    @property
    def pause_mode(self) -> object: ...

    @property
    def kv_asleep(self) -> bool: ...


def is_idle(facts: EngineFacts) -> bool:
    """Paused and known to be idle: flushed since its pause, or paused in place (its requests
    hold their KV but make no progress); never on the strength of a pause or continue that did
    not answer."""
    return (
        facts.paused
        and not facts.pause_unknown
        and (facts.flushed or facts.pause_mode == PauseMode.IN_PLACE)
    )


def engine_state(facts: EngineFacts) -> EngineState:
    """The state ``facts`` add up to."""
    if not facts.alive:
        return _E.DEAD
    if facts.uncertain:
        return _E.UNCERTAIN
    if facts.stale and not facts.paused:
        return _E.STALE
    if facts.released:
        return _E.RELEASED
    if facts.stale:
        return _E.WAITING
    if facts.kv_asleep:
        return _E.KV_ASLEEP
    if not facts.paused and not facts.pause_unknown:
        return _E.SERVING
    return _E.DRAINED if is_idle(facts) else _E.PAUSED


# -- intents: what a call in flight leaves in its engine's record --------------------------------


@dataclass(frozen=True, slots=True)
class _TagsIntent:
    """A release or resume in flight: ``added`` became uncertain with it."""

    added: frozenset[Tag]

    def undo(self, record: EngineRecord) -> None:
        record.uncertain.difference_update(self.added)


@dataclass(frozen=True, slots=True)
class _PauseIntent:
    """A pause or continue in flight: the pause fields as they were before it."""

    paused: bool
    pause_mode: PauseMode | None
    flushed: bool
    pause_unknown: bool

    def undo(self, record: EngineRecord) -> None:
        record.paused, record.pause_mode = self.paused, self.pause_mode
        record.flushed, record.pause_unknown = self.flushed, self.pause_unknown


@dataclass(frozen=True, slots=True)
class _SessionIntent:
    """A weight-update session's begin or end in flight: whether one was open unknown before."""

    session_unknown: bool

    def undo(self, record: EngineRecord) -> None:
        record.session_unknown = self.session_unknown


_Intent = _TagsIntent | _PauseIntent | _SessionIntent


@functools.cache
def _intent(kind: type[_Intent], *held: Any) -> _Intent:
    """The intent ``kind(*held)``, one shared object per value: intents are immutable, and a
    phase puts one in every target's record, so a fleet of 10,000 engines in flight holds a
    handful of them, not 10,000 objects for the collector to promote and walk."""
    return kind(*held)


@functools.cache
def _tags_intent(added: tuple[Tag, ...]) -> _Intent:
    """``_TagsIntent`` of ``added``, shared as ``_intent`` shares the others."""
    return _intent(_TagsIntent, frozenset(added))


@dataclass(frozen=True)
class EngineSnapshot:
    """What the server knows about one engine at one moment."""

    id: str
    group: str
    alive: bool
    paused: bool
    pause_mode: str | None
    flushed: bool
    released: tuple[str, ...]
    uncertain: tuple[str, ...]
    last_op: str | None
    last_outcome: str | None
    stale: bool
    #: A pause or continue did not answer: the engine may be paused or serving.
    pause_unknown: bool = False
    #: A weight-update session may be open (opened and not yet closed, or its begin or end
    #: did not complete).
    session_unknown: bool = False
    #: The process the record describes (None: not seen yet).
    incarnation: str | None = None
    #: Failed the verification of the last write (``core/verify``); stale until a write.
    unverified: bool = False
    #: A release discarded the weights' values (vLLM's level-2 sleep); stale until a write.
    weights_lost: bool = False
    #: Its KV cache was resumed and sleeps until the continue wakes it (``KV_ASLEEP``).
    kv_asleep: bool = False
    #: What its driver declared it can do (``Capabilities.to_wire``); None until read.
    capabilities: dict[str, Any] | None = None

    @property
    def state(self) -> EngineState:
        """The state these facts add up to (``EngineState``)."""
        return engine_state(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineSnapshot:
        """The snapshot whose ``asdict`` gave ``data`` (JSON lists stand for the tuples);
        unknown keys are ignored, a missing or mistyped field raises ``InvalidArgument``."""
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"an engine snapshot must be a mapping, got {data!r}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING:
                    raise InvalidArgument(f"engine snapshot lacks {f.name!r}")
                continue
            value = data[f.name]
            kind = str(f.type)
            if kind == "tuple[str, ...]" and isinstance(value, list | tuple):
                value = tuple(value)
                ok = all(isinstance(v, str) for v in value)
            elif kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "dict[str, Any] | None":  # (capabilities: checked as they load)
                ok = value is None or isinstance(value, Mapping)
                if ok and value is not None:
                    try:
                        value = Capabilities.from_wire(value).to_wire()
                    except InvalidArgument as exc:
                        raise InvalidArgument(f"engine snapshot field {f.name!r}: {exc}") from None
            else:
                ok = isinstance(value, str) or (value is None and kind == "str | None")
            if not ok:
                raise InvalidArgument(f"engine snapshot field {f.name!r} is {kind}, got {value!r}")
            values[f.name] = value
        return cls(**values)


@dataclass(eq=False)
class EngineRecord:
    """The ledger entry of one engine: the server's knowledge of its state, and the guards."""

    id: str
    group: str
    handle: Any
    alive: bool = True
    paused: bool = False
    pause_mode: PauseMode | None = None
    #: Passed the idle barrier (a successful flush) since it was last paused.
    flushed: bool = False
    released: set[Tag] = field(default_factory=set)
    #: Tags whose release or resume did not answer in time: the engine may or may not hold them.
    uncertain: set[Tag] = field(default_factory=set)
    last_op: str | None = None
    last_outcome: EngineOutcome | None = None
    #: Without the fleet's weights: a replacement no weight update has reached yet, or an engine
    #: found reporting another version than the expected one when it was to be continued (a
    #: push that failed under it). It waits paused for an update.
    stale: bool = False
    #: A pause or continue did not answer: whether the engine is paused is not known. It is
    #: recorded as paused and not flushed, so it is continued or paused again before anything
    #: else, and never released on the strength of an old flush.
    pause_unknown: bool = False
    #: A weight-update session may be open: from its begin until its end lands, or a begin or
    #: end that did not complete. The next update, ``reset()`` and ``recover()`` close it first.
    session_unknown: bool = False
    #: The process this record describes (``contract/identity``): recorded from the first answer
    #: that names it, checked before every call in ``CHECKED_OPS``. None until then.
    incarnation: str | None = None
    #: The engine failed the verification of the last weight write (``core/verify``): it is
    #: stale whatever version it reports, until a later write reaches it.
    unverified: bool = False
    #: A release discarded the values of its weights (its engine said so: vLLM's level-2 sleep
    #: keeps no copy, and a wake brings back their memory, not their values): stale whatever
    #: version it reports, until a write reaches it. A continue before that would run a forward
    #: pass on whatever the memory holds.
    weights_lost: bool = False
    #: What the engine's driver declares it can do (``contract/capabilities``), read with its
    #: incarnation at first contact. None until then: the lifecycle plans without them, and the
    #: engine refuses what it cannot do.
    capabilities: Capabilities | None = None
    #: The KV cache was resumed, and the driver wakes it only at the continue
    #: (``Capabilities.kv_wakes_at_continue``): asleep until then (``EngineState.KV_ASLEEP``).
    kv_asleep: bool = False
    #: What the call in flight left unknown, and how to forget it if it is refused.
    _intent: _Intent | None = field(default=None, repr=False)
    #: A call that missed its phase's deadline and may still land (the phase runner's), and
    #: its operation: nothing that it would matter to is sent to this engine before it lands.
    in_flight: InFlight | None = field(default=None, repr=False, compare=False)
    #: Until when (the loop's clock) a call sent reaches the process this record describes:
    #: its last answer, to a call sent while the process was proven, proves it for
    #: ``LifecycleConfig.proof_window`` seconds from that call's send (no engine restarts
    #: faster; ``contract/identity.PROOF_WINDOW``). Not part of a snapshot: another process's
    #: clock is not this one's.
    proven_until: float = field(default=0.0, repr=False, compare=False)
    #: Another controller may have acted on the engine since its last answer: this server's
    #: claims were let go in between and cannot tell that nobody else took them
    #: (``core/claims``). A checked call then reads the engine's pause state again.
    unwatched: bool = field(default=True, repr=False, compare=False)
    #: The handle whose engine ``key`` names, and that key (``key``'s cache).
    _keyed: tuple[Any, Hashable] | None = field(default=None, repr=False, compare=False)
    #: The expectation of a check on the pause state alone (``expect``), kept for the next.
    _expected: tuple[str | None, bool | None, bool] | None = field(
        default=None, repr=False, compare=False
    )
    #: And the last other one (``expect``), kept for the next alike.
    _identifying: tuple[str | None, bool | None, bool] | None = field(
        default=None, repr=False, compare=False
    )
    #: The other members of the unit this engine belongs to (``EngineGroup(unit=N)``): servers
    #: that live, serve and are replaced together. Empty for an engine that is a unit alone. Set
    #: once by its group; a slot keeps its mates when its engine is replaced.
    mates: tuple[EngineRecord, ...] = field(default=(), repr=False, compare=False)
    #: Every member of that unit in group order, this one included (``unit``); set with
    #: ``mates`` by ``joins``.
    _members: tuple[EngineRecord, ...] = field(default=(), repr=False, compare=False)
    #: Found restarted while the other members of its unit were not: a fresh process in a unit
    #: whose others kept the old one's state, so the unit is unhealthy until ``recover()``
    #: replaces it whole (a replacement's record is not: its whole unit is new).
    parted: bool = False

    @property
    def key(self) -> Hashable:
        """What makes this record's engine one engine, however it is reached
        (``contract.seam.identity`` of its handle): the server's URL, the Ray actor, the
        in-process backend. Worked out once per handle; a replacement's is its own."""
        keyed = self._keyed
        if keyed is None or keyed[0] is not self.handle:
            keyed = self._keyed = (self.handle, seam.identity(self.handle))
        return keyed[1]

    def busy_for(self, op: Op) -> bool:
        """Whether the call still in flight on this engine would matter to a call of ``op``
        sent now: every one does but a read, or a call of ``op`` itself (a pause sent again);
        and to a read, none does."""
        late = self.in_flight
        return late is not None and late.matters_to(op)

    @property
    def state(self) -> EngineState:
        """The state this record's facts add up to (``EngineState``)."""
        return engine_state(self)

    @property
    def serves(self) -> bool:
        """Whether the engine may take generate requests, as far as its record says: its state
        is ``serving`` (alive, known to be unpaused, all its memory resident, holding the
        fleet's weights: a fresh server is stale until an update reaches it, versioned or not).
        ``Fleet.serves`` adds what the server's state allows; the generation client adds the
        deaths it saw."""
        return self.state is _SERVING_STATE

    @property
    def idle(self) -> bool:
        """Paused and known to be idle (``is_idle``)."""
        return is_idle(self)

    @property
    def unit(self) -> tuple[EngineRecord, ...]:
        """The records of this engine's unit, in group order (this one alone when it is a
        unit by itself)."""
        return self._members or (self,)

    @property
    def unit_name(self) -> str:
        """How messages name this engine's unit: ``group/first-last`` (its own id alone)."""
        if not self.mates:
            return self.id
        members = self.unit
        return f"{members[0].id}-{members[-1].id.rpartition('/')[2]}"

    def joins(self, unit: Sequence[EngineRecord]) -> None:
        """This engine is a member of ``unit`` (its group's records, in order, this one among
        them): the others are its ``mates`` from now on."""
        if self not in unit:
            raise InvalidArgument(f"engine {self.id} is not a member of the unit it joins")
        self._members = tuple(unit)
        self.mates = tuple(m for m in unit if m is not self)

    @property
    def breaks_unit(self) -> bool:
        """Whether this engine makes its unit unhealthy: dead, holding tags in an unknown state,
        or restarted apart from the others (``parted``)."""
        return self.parted or self.state in BROKEN_STATES

    def broken_mate(self) -> EngineRecord | None:
        """The first other member of this engine's unit that makes the unit unhealthy
        (``breaks_unit``); None while every other member is whole."""
        return next((m for m in self.mates if m.breaks_unit), None)

    @property
    def held_by_unit(self) -> bool:
        """Whether this engine is held paused for its unit: the unit is unhealthy (it or
        another member ``breaks_unit``) and only ``recover()`` brings it back."""
        return self.parted or self.broken_mate() is not None

    # -- guards: each raises before a call that would kill the engine is sent ------------------

    def _refuse(self, op: Op, reason: str) -> IllegalEngineOp:
        return IllegalEngineOp(self.id, op.value, reason)

    def check(self, cmd: Command, tags: Sequence[Tag]) -> None:
        """Run ``cmd``'s guard (``IllegalEngineOp`` if it refuses ``cmd`` with ``tags``)."""
        guard = cmd.guard
        if guard is _ALIVE:
            # (here and in the guards below, ``check_alive`` is called only to refuse: each runs
            # twice per engine per phase, and the call costs more than the test)
            if not self.alive:
                self.check_alive(cmd.op)
        elif guard is _CONTINUE_GUARD:
            self.check_continue()
        elif guard is _RELEASE_GUARD:
            self.check_release(tags)
        elif guard is _RESUME_GUARD:
            self.check_resume(tags)
        else:
            self.check_write_weights()

    def check_alive(self, op: Op) -> None:
        """Refuse any call to an engine known to be dead."""
        if not self.alive:
            raise self._refuse(op, "the engine is dead")

    def check_release(self, tags: Sequence[Tag]) -> None:
        """Release only a paused, flushed (idle) engine, never a tag twice, and only tags its
        driver can release together (``Capabilities.release_refusal``)."""
        op = _RELEASE
        if not self.alive:
            self.check_alive(op)
        refusal = self.release_refusal(tags)
        if refusal is not None:
            raise self._refuse(op, refusal)
        if self.uncertain:
            raise self._refuse(op, f"tags {_tag_list(self.uncertain)} are in an unknown state")
        if not self.paused:
            raise self._refuse(op, "the engine is not paused (release would hit live requests)")
        if self.pause_unknown:
            raise self._refuse(op, "its last pause or continue did not answer: pause it again")
        if self.pause_mode is PauseMode.IN_PLACE:
            raise self._refuse(op, "paused in_place: requests still hold their KV cache")
        if not self.flushed:
            raise self._refuse(op, "the engine has not passed a flush since it was paused")
        released = self.released
        if released and not released.isdisjoint(tags):
            twice = [t.value for t in tags if t in released]
            raise self._refuse(op, f"tags {twice} are already released (double release kills)")

    def release_refusal(self, tags: Collection[Tag]) -> str | None:
        """Why the engine's driver cannot release ``tags`` (its declared capabilities); None
        when it can, or before its capabilities are known (it then refuses by itself)."""
        caps = self.capabilities
        return None if caps is None else caps.release_refusal(tags)

    def check_resume(self, tags: Sequence[Tag]) -> None:
        """Resume only tags that are released."""
        op = _RESUME
        if not self.alive:
            self.check_alive(op)
        if self.uncertain:
            raise self._refuse(op, f"tags {_tag_list(self.uncertain)} are in an unknown state")
        if not self.released.issuperset(tags):
            missing = [t.value for t in tags if t not in self.released]
            raise self._refuse(op, f"tags {missing} are not released (resuming them kills)")

    def check_continue(self) -> None:
        """Continue generation only on fully resident memory."""
        op = _CONTINUE
        if not self.alive:
            self.check_alive(op)
        if self.released or self.uncertain:
            held = sorted(t.value for t in self.released | self.uncertain)
            raise self._refuse(op, f"tags {held} are released; generation would run on them")
        if self.parted:
            raise self._refuse(
                op,
                f"it restarted apart from its unit {self.unit_name}, which is unhealthy; "
                f"recover() replaces the unit whole",
            )
        for mate in self.mates:  # a unit continues as one, once every member has its memory
            if not mate.alive:
                raise self._refuse(
                    op,
                    f"its unit {self.unit_name} is unhealthy: member {mate.id} is dead; a unit "
                    f"continues only whole, recover() replaces it",
                )
            lacking = sorted(t.value for t in mate.released | mate.uncertain)
            if lacking:
                raise self._refuse(
                    op,
                    f"member {mate.id} of its unit {self.unit_name} holds tags {lacking} "
                    f"released; a unit continues only once every member has its memory back",
                )

    def check_write_weights(self) -> None:
        """Write weights only when they are resident."""
        op = _SET_VERSION
        self.check_alive(op)
        if Tag.WEIGHTS in self.released or Tag.WEIGHTS in self.uncertain:
            raise self._refuse(op, "weights are released; writing them is an illegal access")

    # -- identity ----------------------------------------------------------------------------

    def expect(self, op: Op, now: float) -> tuple[str | None, bool | None, bool] | None:
        """What the engine must show before ``op`` (one of ``CHECKED_OPS``) is sent at ``now``
        (the loop's clock): ``(incarnation, paused, identify)``, or None when nothing need be
        read.

        Nothing, while its last answer proves the process (``proven_until``) and no other
        controller can have acted since (not ``unwatched``). Otherwise the pause state the
        record holds, where it holds one (a pause or continue that did not answer leaves it
        open): one another controller continued would hit live requests or run on released
        memory; one it paused has likely been released by it too. Where the process is not
        proven, the pause state proves it wherever the record says paused: a new process at the
        address is not paused. Elsewhere (a pause of a serving engine, an unknown pause state,
        a pause sent again) the incarnation is read (``identify``), as by the first checked
        call of an engine whose incarnation (or driver's capabilities, read with it) the record
        does not know yet.

        An engine of several processes (its driver declares ``ranks`` above 1) is read before
        every call, proven or not: an answer proves the process at the address, not that each
        of its ranks lives on, and its driver's read tells a server that lost one."""
        proven = now < self.proven_until
        caps = self.capabilities
        if proven and not self.unwatched and (caps is None or caps.ranks == 1):
            return None  # (first: the calls of a cycle's phases after its first)
        several = caps is not None and caps.ranks > 1
        paused = None if self.pause_unknown or (op is _PAUSE and self.paused) else self.paused
        identify = (
            self.incarnation is None
            or caps is None  # (read with the incarnation: once per process)
            or (not proven and paused is not True)
        )
        if paused is None and not identify and not several:
            return None
        # A check on the pause state alone is the one every phase after the pause asks for:
        # the same tuple while the incarnation holds. A phase holds one expectation per engine
        # until it settles, and at thousands of engines every object a phase allocates and
        # keeps brings the next full collection nearer, whose cost grows with the fleet
        # (benchmarks/README.md, section 11). (Tuples of plain values: the collector stops
        # tracking them.)
        if paused is True and not identify:
            found = self._expected
            if found is None or found[0] is not self.incarnation:
                found = self._expected = (self.incarnation, True, False)
            return found
        # The other one a fleet asks for again and again: the pause of a serving engine after a
        # rollout (its last answer too old to prove it), which reads the incarnation.
        found = self._identifying
        if (
            found is None
            or found[0] is not self.incarnation
            or found[1] is not paused
            or found[2] is not identify
        ):
            found = self._identifying = (self.incarnation, paused, identify)
        return found

    def answered(
        self,
        op: Op,
        out: EngineOutcome,
        expected: Sequence[Any] | None,
        proven: bool,
        until: float,
    ) -> None:
        """What an answer says of the process behind this record (``proven_until``,
        ``unwatched``): an answer to a call sent while the process was proven, or whose check
        proved it (its incarnation, or a pause state only it can have), proves it until
        ``until``; an answer that did not come (no answer, a dropped connection, a death, another
        process) proves nothing further. A check that read the pause state, and a pause or
        continue that landed, leave nothing another controller did unseen."""
        if out.outcome is _OK:
            if proven or (expected is not None and (expected[2] or expected[1] is True)):
                self.proven_until = until
            if (expected is not None and expected[1] is not None) or op in _PAUSING:
                self.unwatched = False
        elif out.outcome not in _ANSWERED:
            self.proven_until = 0.0

    def renewed(self, seen: Any, until: float) -> bool:
        """A renewal's read (``core/renewal``) showed ``seen``: when it is the incarnation this
        record holds, of a live engine, the process is proven until ``until`` (that read's send
        plus the window) and True. Anything else proves nothing and changes nothing: the next
        checked call reads the engine itself and takes in what it shows."""
        if not self.alive or self.incarnation is None or seen != self.incarnation:
            return False
        if until > self.proven_until:
            self.proven_until = until
        return True

    def observed(self) -> list[Any]:
        """What a probe compares the engine's report with: its incarnation, and the pause
        state the record holds (unless a pause or continue did not answer)."""
        return [self.incarnation, None if self.pause_unknown else self.paused]

    def learn(self, verdict: Outcome, incarnation: str | None) -> None:
        """Take in what the engine showed of itself against this record (``contract/identity``):
        after ``RESTARTED`` the record describes the new process (``restart``); after
        ``CONFLICT`` (the engine is not paused as recorded: another controller may drive it)
        nothing is known of it but that it answers: its pause state and every tag are
        unknown, so no call that could kill it is sent (SGLang reports no released tags) and
        ``recover()`` replaces it (a server restarted in its place is taken as fresh)."""
        if verdict is _RESTARTED:
            self.restart(incarnation)
        elif verdict is _CONFLICT:
            self.paused, self.flushed, self.pause_unknown = True, False, True
            self.uncertain.update(ALL_TAGS)

    def met(self, incarnation: str | None, declared: Any = None) -> None:
        """The engine showed ``incarnation`` at first contact (``core/claims``; a replacement's
        first read, ``core/recovery``), and its driver ``declared`` its capabilities: the
        record names its process from now on (an incarnation already known is kept: its checks
        decide; None names none)."""
        if self.incarnation is None:
            self.incarnation = incarnation
        if declared is not None and incarnation is not None and incarnation == self.incarnation:
            self.declares(declared)

    def declares(self, declared: Any) -> None:
        """The engine's driver declared ``declared`` (``Capabilities.to_wire``) with the
        incarnation the record names: they are the process's. Garbage is not taken (the
        record plans without them, as before a first contact)."""
        try:
            self.capabilities = Capabilities.from_wire(declared)
        except InvalidArgument:
            self.capabilities = None

    def restart(self, incarnation: str | None) -> None:
        """The process at this engine's address is a new one: the record describes a fresh
        server (alive, serving, all memory resident, stale until it receives the fleet's
        weights); what was uncertain of the old process is gone with it."""
        self.renew(self.handle)
        self.incarnation = incarnation
        self.parted = bool(self.mates)

    # -- effects of calls ------------------------------------------------------------------------

    def intend(self, op: Op, tags: Sequence[Tag], mode: PauseMode | None) -> None:
        """Record, before ``op`` is sent, what stays unknown until it answers (its command's
        ``part``): the tags of a release or resume become uncertain, a pause or continue leaves
        the engine paused unknown, a weight-update session may be open. A process that dies
        with the call in flight leaves this record, which refuses the call that could kill the
        engine; the outcome (``apply``) replaces it."""
        # (``command`` names what is no operation; the table at once, once per engine per phase)
        cmd = COMMANDS.get(op) or command(op)
        part = cmd.part
        if part is not None:
            self._intent = self._saved(part, tags)
            self._unknown(part, cmd.op, tags, mode)

    def _saved(self, part: Part, tags: Sequence[Tag]) -> _Intent:
        """What ``part`` holds now, to be restored if the call is refused."""
        if part is _MEMORY:
            uncertain = self.uncertain
            added = tuple(t for t in tags if t not in uncertain) if uncertain else tuple(tags)
            return _tags_intent(added)
        if part is _PAUSE_PART:
            return _intent(
                _PauseIntent, self.paused, self.pause_mode, self.flushed, self.pause_unknown
            )
        return _intent(_SessionIntent, self.session_unknown)

    def _unknown(self, part: Part, op: Op, tags: Sequence[Tag], mode: PauseMode | None) -> None:
        """What ``part`` holds while a call that changes it may or may not have landed."""
        if part is _MEMORY:
            # Neither a release nor a resume of these tags is safe now.
            self.uncertain.update(tags)
        elif part is _PAUSE_PART:
            # Counted as paused, so that it is continued (harmless if it never paused) and never
            # taken for serving; a flush alone never makes it releasable.
            self.paused, self.flushed, self.pause_unknown = True, False, True
            if op is _PAUSE:
                self.pause_mode = mode
        else:
            self.session_unknown = True

    def _landed(self, effect: Effect, tags: Sequence[Tag], mode: PauseMode | None) -> None:
        """What a call that landed does to the record."""
        if effect is _PAUSED:
            self.paused, self.pause_mode, self.flushed = True, mode, False
            self.pause_unknown = False
        elif effect is _CONTINUED:
            self.paused, self.pause_mode, self.flushed = False, None, False
            self.pause_unknown = self.kv_asleep = False
        elif effect is _FLUSHED:
            self.flushed = True
        elif effect is _RELEASED:
            self.released.update(tags)
            self.kv_asleep = False  # (the released tags say it now)
        elif effect is _RESUMED:
            self.released.difference_update(tags)
            caps = self.capabilities
            if caps is not None and caps.kv_wakes_at_continue and Tag.KV_CACHE in tags:
                self.kv_asleep = True
        elif effect is _OPENED:
            # Open until its end lands: a journal written meanwhile (a push in progress) says
            # so, and a process killed before the end leaves records that close it before
            # anything else.
            self.session_unknown = True
        elif effect is _CLOSED:
            self.session_unknown = False

    def _refused(self, refusal: Refusal, out: EngineOutcome) -> None:
        """What a refused call says beyond "nothing happened"."""
        if refusal is _BEGIN:
            # "A session is already open": one this record did not know of (left by a
            # controller that died without a journal, say); it is closed before the next begin.
            if out.status == SESSION_OPEN:
                self.session_unknown = True
        else:
            # SGLang answers 400 when no session is open: then none is. Any other refusal
            # leaves the session it should have closed open.
            self.session_unknown = out.status != 400

    def undo_intent(self) -> None:
        """Forget what ``intend`` recorded: the call was refused and did nothing."""
        intent, self._intent = self._intent, None
        if intent is not None:
            intent.undo(self)

    def apply(
        self,
        op: Op,
        tags: Sequence[Tag],
        mode: PauseMode | None,
        out: EngineOutcome,
        incarnation: str | None = None,
        declared: Any = None,
    ) -> None:
        """Record what a settled call means for this engine (its command's effects);
        ``incarnation`` is the one the engine showed (a checked call that passed, or the new
        process that refused it), and ``declared`` what its driver declared with it
        (``Capabilities.to_wire``)."""
        cmd = COMMANDS.get(op) or command(op)  # (as in ``intend``)
        self.last_op = cmd.op._value_
        self.last_outcome = out
        outcome = out.outcome  # (read once: ``EngineOutcome.ok`` is a call, once per engine)
        if outcome is _OK:  # (first: nearly every call of every phase)
            if incarnation is not None and (self.incarnation is None or cmd.checked):
                self.incarnation = incarnation  # (a read names the process only the first time)
                if declared is not None and self.capabilities is None:
                    self.declares(declared)  # (a process's, read once: a restart forgets them)
            # The answer replaces the intent: its effect sets every field the intent left
            # unknown (``undo_intent``, inline: once per engine per phase).
            intent, self._intent = self._intent, None
            if intent is not None:
                intent.undo(self)
            self._landed(cmd.landed, tags, mode)
            return
        if outcome is _DEAD:
            self._intent = None
            self.alive = False
            return
        if outcome is _RESTARTED or outcome is _CONFLICT:
            # (a probe's verdict is its caller's to learn, under the server's lock: a probe
            # runs beside the calls that change the records)
            if cmd.checked:
                self.undo_intent()  # nothing was sent
                self.learn(outcome, incarnation)
                self.last_op, self.last_outcome = cmd.op._value_, out
            return
        if outcome in _EFFECT_UNKNOWN:
            # No answer, a dropped connection or garbage: the call may or may not have landed.
            self._intent = None
            if cmd.part is not None:
                self._unknown(cmd.part, cmd.op, tags, mode)
            return
        # Refused: the call did nothing, and the intent goes.
        self.undo_intent()
        if cmd.refused is not None:
            self._refused(cmd.refused, out)

    # -- what the lifecycle learns beyond a call's own effect -----------------------------------

    def flies(self, op: Op, future: Any) -> InFlight:
        """A call of ``op`` missed its phase's deadline and may still land (``future``): nothing
        it would matter to is sent to this engine before it lands (``busy_for``)."""
        self.in_flight = flying = InFlight(op, future)
        return flying

    def landed_late(self, flying: InFlight) -> None:
        """The call ``flying`` (``flies``) has landed or failed: it no longer holds anything
        back, unless a later call in flight has taken its place."""
        if self.in_flight is flying:
            self.in_flight = None

    def lost_sight(self) -> None:
        """Another controller may have acted on the engine since its last answer (this server's
        claim on it lapsed in between): a checked call reads its pause state again."""
        self.unwatched = True

    def may_hold_session(self) -> None:
        """A weight-update session may be open on the engine (an end is about to close it; one
        that does not land leaves it so for the next update)."""
        self.session_unknown = True

    def lacks_weights(self) -> None:
        """The engine does not hold the fleet's weights (it reports others, or what a push
        wrote is not known): it waits paused for an update, as a replacement does."""
        self.stale = True

    def holds_weights(self) -> None:
        """The engine reports the fleet's weights and passed their verification."""
        self.stale = False

    @property
    def needs_write(self) -> bool:
        """Whether only a weight write can make the engine hold the fleet's weights, whatever
        version it reports: it failed the last write's verification, or a release discarded
        its weights."""
        return self.unverified or self.weights_lost

    def written(self, *, versioned: bool) -> None:
        """A weight write reached the engine: what it failed or lost is overwritten (it is
        verified again); after an unversioned write, having been written to is all that is
        known."""
        self.unverified = self.weights_lost = False
        if not versioned:
            self.stale = False

    def lost_weights(self) -> None:
        """A release discarded the engine's weights (its answer said so): stale until a write
        reaches it."""
        self.stale = self.weights_lost = True

    def failed_verification(self) -> None:
        """The engine failed the verification of the last write (``core/verify``): stale,
        whatever version it reports, until a later write reaches it."""
        self.stale = self.unverified = True

    def kept(self, saved: EngineSnapshot) -> None:
        """The process ``saved`` described came back (a factory handed it back): its record is
        ``saved``, alive."""
        self.load(saved)
        self.alive = True

    def renew(self, handle: Any) -> None:
        """A new engine takes this slot: alive, serving, all memory resident, stale until it
        receives the fleet's weights."""
        self.handle = handle
        self.alive, self.paused, self.pause_mode, self.flushed = True, False, None, False
        self.pause_unknown = self.session_unknown = False
        self.released.clear()
        self.uncertain.clear()
        self.last_op, self.last_outcome, self.stale = None, None, True
        self.incarnation, self.unverified, self.weights_lost = None, False, False
        self.capabilities, self.kv_asleep = None, False
        self.proven_until, self.unwatched = 0.0, True
        self._intent = None
        self.parted = False

    def snapshot(self) -> EngineSnapshot:
        """An immutable copy of this record."""
        order = {t: i for i, t in enumerate(Tag)}
        return EngineSnapshot(
            id=self.id,
            group=self.group,
            alive=self.alive,
            paused=self.paused,
            pause_mode=self.pause_mode.value if self.pause_mode else None,
            flushed=self.flushed,
            released=tuple(t.value for t in sorted(self.released, key=order.__getitem__)),
            uncertain=tuple(t.value for t in sorted(self.uncertain, key=order.__getitem__)),
            last_op=self.last_op,
            last_outcome=str(self.last_outcome) if self.last_outcome else None,
            stale=self.stale,
            pause_unknown=self.pause_unknown,
            session_unknown=self.session_unknown,
            incarnation=self.incarnation,
            unverified=self.unverified,
            weights_lost=self.weights_lost,
            kv_asleep=self.kv_asleep,
            capabilities=None if self.capabilities is None else self.capabilities.to_wire(),
        )

    def load(self, snapshot: EngineSnapshot) -> None:
        """Take over what ``snapshot`` recorded of this engine (in an earlier process, say).

        Raises ``InvalidArgument``, changing nothing, when it is another engine's or names an
        unknown pause mode or tag. The last outcome keeps its text, not its duration.
        """
        if (snapshot.id, snapshot.group) != (self.id, self.group):
            raise InvalidArgument(f"snapshot of engine {snapshot.id} cannot load into {self.id}")
        mode = None
        if snapshot.pause_mode is not None:
            try:
                mode = PauseMode(snapshot.pause_mode)
            except ValueError:
                raise InvalidArgument(
                    f"engine {self.id}: unknown pause mode {snapshot.pause_mode!r}"
                ) from None
        released = set(parse_tags(snapshot.released)) if snapshot.released else set()
        uncertain = set(parse_tags(snapshot.uncertain)) if snapshot.uncertain else set()
        caps = snapshot.capabilities
        capabilities = None if caps is None else Capabilities.from_wire(caps)
        last = None
        if snapshot.last_outcome is not None:
            head, _, detail = snapshot.last_outcome.partition(" (")
            if head in {o.value for o in Outcome}:
                last = EngineOutcome(Outcome(head), detail.removesuffix(")"))
        self.alive, self.paused, self.pause_mode = snapshot.alive, snapshot.paused, mode
        self.flushed, self.released, self.uncertain = snapshot.flushed, released, uncertain
        self.last_op, self.last_outcome, self.stale = snapshot.last_op, last, snapshot.stale
        self.pause_unknown = snapshot.pause_unknown
        self.session_unknown = snapshot.session_unknown
        self.incarnation = snapshot.incarnation
        self.unverified = snapshot.unverified
        self.weights_lost = snapshot.weights_lost
        self.capabilities, self.kv_asleep = capabilities, snapshot.kv_asleep
        self.proven_until, self.unwatched = 0.0, True  # (what another process saw)
        self._intent = None


@dataclass(eq=False, slots=True)
class InFlight:
    """A call of ``op`` that missed its phase's deadline and may still land (``future``)."""

    op: Op
    future: Any

    def matters_to(self, op: Op) -> bool:
        """See ``EngineRecord.busy_for``."""
        late = self.op
        return late is not op and not command(late).reads and not command(op).reads


# -- the memory target of each server state ------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The memory state an engine is in when the server is settled in some state."""

    #: Paused (generation stopped): what bringing an engine to this state leaves it (for a
    #: group that keeps its memory in ``drained``, what ``pause()`` leaves; ``offload()``
    #: stopped there left it serving: ``held`` says which one binds).
    paused: bool
    #: The tags it holds released, in release order.
    released: tuple[Tag, ...]
    #: The lifecycle holds the engine out of serving here, whatever its record says: true
    #: wherever ``paused`` is, but for a group that keeps its memory in ``drained``.
    held: bool


def target(state: ServerState, needs_offload: bool, release_tags: Sequence[Tag]) -> Target | None:
    """The memory state of an engine of a group (that offloads, or keeps its memory) when the
    server is settled in ``state``; None for ``pausing`` and ``failed``, which imply none.

    The one encoding of the lifecycle's memory states: ``serving`` holds everything and
    generates; ``drained`` is paused and idle everywhere; ``released`` releases every release
    tag of the groups that offload while the others serve; ``weights_restored`` has the
    weights back; ``kv_restored`` has everything back, the offloaded groups still paused.
    Everything below that speaks of states (which serve, which recovery drains, in which the
    groups that keep their memory are continued) is derived from it.
    """
    if state is S.SERVING:
        return Target(False, (), held=False)
    if state is S.DRAINED:
        return Target(True, (), held=needs_offload)
    if state not in (S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED):
        return None
    if not needs_offload:
        return Target(False, (), held=False)
    if state is S.RELEASED:
        return Target(True, tuple(release_tags), held=True)
    if state is S.WEIGHTS_RESTORED:
        return Target(True, tuple(t for t in release_tags if t not in WEIGHT_TAGS), held=True)
    return Target(True, (), held=True)


def _states(holds: Callable[[Target, Target], bool]) -> tuple[ServerState, ...]:
    """The states that imply a memory state in which ``holds(offloaded, kept)``: the targets of
    a group that offloads and of one that keeps its memory (every tag a release tag)."""
    out = []
    for state in S:
        offloaded, kept = target(state, True, ALL_TAGS), target(state, False, ALL_TAGS)
        if offloaded is not None and kept is not None and holds(offloaded, kept):
            out.append(state)
    return tuple(out)


#: The states that imply a memory state: those ``recover()`` can bring a fleet to.
SETTLED_STATES = _states(lambda offloaded, kept: True)
#: The states in which the groups that offload are paused and idle (a drain is behind them).
DRAINED_STATES = _states(lambda offloaded, kept: offloaded.paused)
#: The states in which the groups that keep their memory serve while the others are held.
KEEPERS_SERVE = frozenset(_states(lambda offloaded, kept: offloaded.held and not kept.paused))
#: The states that release something (``settled_state`` tells them apart by what is released).
_RELEASE_STATES = _states(lambda offloaded, kept: bool(offloaded.released))


def may_serve(state: ServerState, needs_offload: bool) -> bool:
    """Whether the server's state lets an engine of such a group take generate requests (its
    record must as well: ``Fleet.serves``). Where the state implies a memory state, unless its
    target holds the group (``Target.held``); in ``pausing`` only the groups that keep their
    memory (the others are being drained); in ``failed``, which implies no memory state, the
    records decide: a drain that failed continues what it paused, so that serving goes on."""
    goal = target(state, needs_offload, ())
    if goal is not None:
        return not goal.held
    return state is S.FAILED or not needs_offload


class GroupRecords(Protocol):
    """What the ledger needs of a group: its name, its policy, its records."""

    @property
    def name(self) -> str: ...

    @property
    def needs_offload(self) -> bool: ...

    @property
    def records(self) -> tuple[EngineRecord, ...]: ...


def default_targets(group: GroupRecords, op: Op) -> list[EngineRecord]:
    """The engines of ``group`` that ``op`` goes to when the caller names none (its command's
    ``targets``): memory calls to the groups that offload, continue and flush to the paused
    engines, the rest to every live engine."""
    targets = command(op).targets
    if targets is _ON_PAUSED:
        if op is _CONTINUE:
            # (the members of an unhealthy unit stay paused: recover() replaces the unit)
            return [r for r in group.records if r.alive and r.paused and not r.held_by_unit]
        return [r for r in group.records if r.alive and r.paused]
    if targets is _ON_OFFLOADING and not group.needs_offload:
        return []
    return [r for r in group.records if r.alive]


class Fleet:
    """The records of every engine of a server's groups, and the named queries over them."""

    def __init__(self, groups: Sequence[GroupRecords], release_tags: Sequence[Tag]) -> None:
        self._groups = tuple(groups)
        self._release_tags = tuple(release_tags)
        self._offloads = {g.name: g.needs_offload for g in self._groups}

    @property
    def groups(self) -> tuple[GroupRecords, ...]:
        """The groups, in order."""
        return self._groups

    def records(self) -> list[EngineRecord]:
        """Every record, dead or alive, in group order."""
        return [r for g in self._groups for r in g.records]

    def get(
        self,
        states: Iterable[EngineState] | None = None,
        *,
        skip: Collection[str] = (),
        offloading: bool | None = None,
    ) -> list[EngineRecord]:
        """The records whose state is one of ``states`` (every state when None), in group
        order; but those whose id is in ``skip``; with ``offloading`` true or false, only the
        groups that offload or only those that keep their memory."""
        wanted = None if states is None else frozenset(states)
        offloads = self._offloads
        return [
            r
            for g in self._groups
            if offloading is None or offloads[g.name] is offloading
            for r in g.records
            if (wanted is None or r.state in wanted) and r.id not in skip
        ]

    def count(self, states: Iterable[EngineState] | None = None) -> int:
        """How many engines are in one of ``states`` (all when None)."""
        return len(self.get(states))

    def by_state(self) -> dict[EngineState, int]:
        """How many engines are in each state (every state named, zeros included)."""
        counts = Counter(r.state for r in self.records())
        return {state: counts[state] for state in EngineState}

    def live(self, skip: Collection[str] = ()) -> list[EngineRecord]:
        """The records of the engines not known to be dead (but those in ``skip``)."""
        return self.get(LIVE_STATES, skip=skip)

    def offloads(self, record: EngineRecord) -> bool:
        """Whether ``record``'s group offloads (its GPUs are shared with the trainer)."""
        return self._offloads[record.group]

    def offloaded(self, skip: Collection[str] = ()) -> list[EngineRecord]:
        """The live records of the groups that offload."""
        return self.get(LIVE_STATES, skip=skip, offloading=True)

    def broken(self, also: Iterable[EngineRecord] = ()) -> list[EngineRecord]:
        """The engines ``recover()`` replaces: dead, or holding tags in an unknown state, and
        every member of their units (and of the units of ``also``: members found restarted),
        in group order. A unit is replaced whole, never one member."""
        records = self.records()
        seeds = [r for r in records if r.breaks_unit] + list(also)
        out = {m.id for r in seeds for m in r.unit}
        return [r for r in records if r.id in out]

    def unhealthy_units(self) -> dict[str, str]:
        """Each unit of several servers that cannot serve whole (a member dead, or holding
        tags in an unknown state), by ``unit_name``, with why."""
        out: dict[str, str] = {}
        for record in self.records():
            if record.mates and record.unit_name not in out:
                bad = [m for m in record.unit if m.breaks_unit]
                if bad:
                    said = ", ".join(
                        f"{m.id} {'restarted apart' if m.parted else m.state.value}" for m in bad
                    )
                    out[record.unit_name] = f"{said}; recover() replaces the unit whole"
        return out

    def dead_groups(self) -> list[GroupRecords]:
        """The groups none of whose engines is alive."""
        return [g for g in self._groups if not any(r.alive for r in g.records)]

    def check_live(self, call: str) -> None:
        """Refuse a lifecycle call when a group has no live engine: it would succeed on
        nothing. ``recover()`` and ``reset()`` are how such a fleet comes back."""
        if call in ("recover", "reset"):
            return
        for group in self.dead_groups():
            raise IllegalEngineOp(
                f"group {group.name!r}",
                call,
                f"all {len(group.records)} engines of the group are dead; recover() replaces them",
            )

    def serves(self, record: EngineRecord, state: ServerState) -> bool:
        """Whether ``record``'s engine may take generate requests with the server in ``state``:
        its record says it can (``EngineRecord.serves``) and the state lets its group
        (``may_serve``), and so do those of every other member of its unit: a unit serves whole
        or not at all. The one predicate the generation client routes by and the router binding
        registers by."""
        if not record.serves or not may_serve(state, self._offloads[record.group]):
            return False
        return all(m.serves for m in record.mates)

    def target(self, record: EngineRecord, state: ServerState) -> Target | None:
        """The memory state ``record`` should be in when the server is settled in ``state``."""
        return target(state, self._offloads[record.group], self._release_tags)

    def settled_state(self, skip: Collection[str] = ()) -> ServerState | None:
        """The state the records of the live engines (but ``skip``) imply; None if they disagree.

        ``drained`` stands for every offloaded engine paused and idle, whether or not the
        groups that keep their memory are paused too (both ``pause()`` and ``offload()`` reach
        it); those groups must agree among themselves.
        """
        live = self.live(skip)
        states = {r.state for r in live}
        if _E.UNCERTAIN in states:
            return None
        if _E.STALE in states:
            return None  # a replacement that could not be brought up: recover() pauses it
        # Replacements without the weights, and the members of units that are not whole, held
        # paused while their groups serve.
        waiting = {r.id for r in live if r.state is _E.WAITING or r.held_by_unit}
        offload = [r for r in live if self._offloads[r.group]]
        others = [r for r in live if not self._offloads[r.group]]
        released = {frozenset(r.released) for r in offload} or {frozenset()}
        if len(released) != 1 or any(r.released for r in others):
            return None
        if len({r.paused for r in others if r.id not in waiting}) > 1:
            return None
        (held,) = released
        idle = all(r.idle for r in offload)
        if not held:
            if not any(r.paused for r in live if r.id not in waiting):
                return S.SERVING
            return S.DRAINED if idle else None
        if not idle:
            return None  # (groups that keep their memory may be paused: a write that failed)
        return self._state_releasing(held)

    def unsettled(self) -> list[str]:
        """Why the live records imply no single state, in words, engine by engine (empty when
        they imply one): what ``reset()`` names when it refuses."""
        if self.settled_state() is not None:
            return []
        live = self.live()
        out = [
            f"{r.id} holds {_tag_list(r.uncertain)} in an unknown state"
            for r in live
            if r.uncertain
        ]
        out += [
            f"{r.id} is a fresh server without the fleet's weights that is not paused (found "
            f"restarted, or a replacement not brought up)"
            for r in live
            if r.stale and not r.paused
        ]
        offload = [r for r in live if self._offloads[r.group]]
        if len({frozenset(r.released) for r in offload}) > 1:
            held = ", ".join(f"{r.id} {_tag_list(r.released)}" for r in offload)
            out.append(f"the engines that offload hold different tags released ({held})")
        out += [
            f"{r.id} keeps its memory but holds {_tag_list(r.released)} released"
            for r in live
            if not self._offloads[r.group] and r.released
        ]
        out += [
            f"{r.id} is paused without a flush since its pause (a drain that did not complete)"
            for r in offload
            if r.paused and not r.idle
        ]
        return out or ["the engines' pause states disagree"]

    def implies(self, state: ServerState) -> bool:
        """Whether the records are those of a server settled in ``state``: the state they
        imply (``settled_state``), or ``kv_restored`` where they settle as ``drained`` (both
        hold every engine paused with all memory resident); ``failed`` takes any records."""
        implied = self.settled_state()
        return state in (S.FAILED, implied) or (state, implied) == (S.KV_RESTORED, S.DRAINED)

    def majority_state(self, skip: Collection[str]) -> ServerState | None:
        """After a phase failed part-way, the state most offloaded engines are in."""
        offload = self.offloaded(skip)
        if not offload:
            return S.SERVING
        held = Counter(frozenset(r.released) for r in offload).most_common()
        top = [h for h, n in held if n == held[0][1]]
        tags = min(top, key=len)  # on a tie, the most restored
        if not tags:
            # A drain that did not complete (paused, never flushed) is undone, not finished.
            drained = sum(r.paused and r.flushed for r in offload)
            return S.DRAINED if drained * 2 > len(offload) else S.SERVING
        return self._state_releasing(tags)

    def _state_releasing(self, held: Collection[Tag]) -> ServerState | None:
        """The state in which the offloaded engines hold exactly ``held`` released."""
        for state in _RELEASE_STATES:
            goal = target(state, True, self._release_tags)
            if goal is not None and set(goal.released) == set(held):
                return state
        return None


__all__ = [
    "BROKEN_STATES",
    "CONTINUABLE_STATES",
    "DRAINED_STATES",
    "KEEPERS_SERVE",
    "LIVE_STATES",
    "SETTLED_STATES",
    "EngineFacts",
    "EngineRecord",
    "EngineSnapshot",
    "EngineState",
    "Fleet",
    "GroupRecords",
    "Target",
    "engine_state",
    "is_idle",
    "may_serve",
    "target",
]
