"""Engine groups and the per-engine ledger that guards every call.

An ``EngineGroup`` holds engine handles and a record of what each engine is known to hold:
paused or not, which memory tags are released, whether it passed the idle barrier since its last
pause, alive or dead. Group methods only *issue* work: each checks every targeted engine against
the SGLang contract first (raising ``IllegalEngineOp`` before anything is sent), then returns one
pending call per engine without waiting. The server gathers them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from rollout_lifecycle.backends.engine import EngineBackend, EngineHost
from rollout_lifecycle.backends.hosted import HostedEngine
from rollout_lifecycle.backends.http import url_identity
from rollout_lifecycle.core.config import PauseMode, Tag, parse_tags
from rollout_lifecycle.core.exceptions import IllegalEngineOp, InvalidArgument
from rollout_lifecycle.core.outcome import EngineOutcome, Outcome

#: Outcomes after which an engine may or may not have carried out the call.
_EFFECT_UNKNOWN = frozenset({Outcome.TIMED_OUT, Outcome.UNREACHABLE, Outcome.ERROR})
_MEMORY_OPS = ("release_memory_occupation", "resume_memory_occupation")
_PAUSE_OPS = ("pause_generation", "continue_generation")
_SESSION_OPS = ("begin_weight_update", "end_weight_update")


def _is_actor(handle: object) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return False
    return isinstance(handle, ActorHandle)


def _actor_key(actor: Any) -> str:
    actor_id = getattr(actor, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else f"object-{id(actor)}"


def engine_identity(handle: Any) -> Hashable:
    """What makes two handles the same engine: the server URL of an HTTP backend (normalised by
    ``url_identity``, so ``localhost`` and ``127.0.0.1`` are one), the backend object of an
    ``EngineHost``, the Ray actor of an actor handle, the actor and index of a ``HostedEngine``.
    """
    if isinstance(handle, EngineHost):
        backend = handle.backend
        url = getattr(backend, "url", None)
        if isinstance(url, str):
            try:
                return ("url", url_identity(url))
            except InvalidArgument:
                pass
        return ("object", id(backend))
    if isinstance(handle, HostedEngine):
        return ("hosted", _actor_key(handle.actor), handle.index)
    if _is_actor(handle):
        return ("actor", _actor_key(handle))
    if isinstance(handle, EngineBackend):
        return engine_identity(EngineHost(handle))
    return ("object", id(handle))


def _tag_list(tags: Iterable[Tag]) -> list[str]:
    return [t.value for t in tags]


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
    #: A weight-update session may be open (its begin or end did not complete).
    session_unknown: bool = False

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
    #: A replacement that has not received the fleet's weights yet.
    stale: bool = False
    #: A pause or continue did not answer: whether the engine is paused is not known. It is
    #: recorded as paused and not flushed, so it is continued or paused again before anything
    #: else, and never released on the strength of an old flush.
    pause_unknown: bool = False
    #: A begin or end of a weight-update session did not complete: a session may be open, and
    #: the next update closes it first.
    session_unknown: bool = False
    #: What ``intend`` changed for the call in flight, restored when it is refused outright.
    _undo: tuple[Any, ...] | None = field(default=None, repr=False)

    # -- guards: each raises before a call that would kill the engine is sent ------------------

    def _refuse(self, op: str, reason: str) -> IllegalEngineOp:
        return IllegalEngineOp(self.id, op, reason)

    def check_alive(self, op: str) -> None:
        """Refuse any call to an engine known to be dead."""
        if not self.alive:
            raise self._refuse(op, "the engine is dead")

    def check_release(self, tags: Sequence[Tag]) -> None:
        """Release only a paused, flushed (idle) engine, and never a tag twice."""
        op = "release_memory_occupation"
        self.check_alive(op)
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
        twice = [t.value for t in tags if t in self.released]
        if twice:
            raise self._refuse(op, f"tags {twice} are already released (double release kills)")

    def check_resume(self, tags: Sequence[Tag]) -> None:
        """Resume only tags that are released."""
        op = "resume_memory_occupation"
        self.check_alive(op)
        if self.uncertain:
            raise self._refuse(op, f"tags {_tag_list(self.uncertain)} are in an unknown state")
        missing = [t.value for t in tags if t not in self.released]
        if missing:
            raise self._refuse(op, f"tags {missing} are not released (resuming them kills)")

    def check_continue(self) -> None:
        """Continue generation only on fully resident memory."""
        op = "continue_generation"
        self.check_alive(op)
        held = sorted(t.value for t in self.released | self.uncertain)
        if held:
            raise self._refuse(op, f"tags {held} are released; generation would run on them")

    def check_write_weights(self) -> None:
        """Write weights only when they are resident."""
        op = "update_weights"
        self.check_alive(op)
        if Tag.WEIGHTS in self.released or Tag.WEIGHTS in self.uncertain:
            raise self._refuse(op, "weights are released; writing them is an illegal access")

    # -- effects of calls ------------------------------------------------------------------------

    def intend(self, op: str, tags: Sequence[Tag], mode: PauseMode | None) -> None:
        """Record, before ``op`` is sent, what stays unknown until it answers: the tags of a
        release or resume become uncertain, a pause or continue leaves the engine paused
        unknown, a weight-update session may be open. A process that dies with the call in
        flight leaves this record, which refuses the call that could kill the engine; the
        outcome (``apply``) replaces it."""
        if op in _MEMORY_OPS:
            self._undo = (frozenset(t for t in tags if t not in self.uncertain),)
            self.uncertain.update(tags)
        elif op in _PAUSE_OPS:
            self._undo = (self.paused, self.pause_mode, self.flushed, self.pause_unknown)
            self.paused, self.flushed, self.pause_unknown = True, False, True
            if op == "pause_generation":
                self.pause_mode = mode
        elif op in _SESSION_OPS:
            self._undo = (self.session_unknown,)
            self.session_unknown = True

    def _undo_intent(self, op: str) -> None:
        """Forget what ``intend`` recorded for ``op``: it was refused and did nothing."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        if op in _MEMORY_OPS:
            self.uncertain.difference_update(undo[0])
        elif op in _PAUSE_OPS:
            self.paused, self.pause_mode, self.flushed, self.pause_unknown = undo
        elif op in _SESSION_OPS:
            (self.session_unknown,) = undo

    def apply(
        self, op: str, tags: Sequence[Tag], mode: PauseMode | None, out: EngineOutcome
    ) -> None:
        """Record what a settled call means for this engine."""
        self.last_op = op
        self.last_outcome = out
        if out.outcome is Outcome.DEAD:
            self._undo = None
            self.alive = False
            return
        if out.outcome in _EFFECT_UNKNOWN:
            self._undo = None
            # No answer, a dropped connection or garbage: the call may or may not have landed.
            if op in ("release_memory_occupation", "resume_memory_occupation"):
                self.uncertain.update(tags)  # neither a release nor a resume of them is safe now
            elif op in ("pause_generation", "continue_generation"):
                # Count the engine as paused, so that it is continued (harmless if it never
                # paused) and never taken for serving; a flush alone never makes it releasable.
                self.paused, self.flushed, self.pause_unknown = True, False, True
                self.pause_mode = mode if op == "pause_generation" else self.pause_mode
            elif op in ("begin_weight_update", "end_weight_update"):
                self.session_unknown = True
            return
        if not out.ok:
            self._undo_intent(op)
            if op == "end_weight_update":
                # SGLang answers 400 when no session is open: then none is. Any other refusal
                # leaves the session it should have closed open.
                self.session_unknown = out.status != 400
            return
        if op in _MEMORY_OPS or op == "begin_weight_update":
            self._undo_intent(op)  # the answer replaces the intent
        self._undo = None
        if op == "pause_generation":
            self.paused, self.pause_mode, self.flushed = True, mode, False
            self.pause_unknown = False
        elif op == "flush_cache":
            self.flushed = True
        elif op == "release_memory_occupation":
            self.released.update(tags)
        elif op == "resume_memory_occupation":
            self.released.difference_update(tags)
        elif op == "continue_generation":
            self.paused, self.pause_mode, self.flushed = False, None, False
            self.pause_unknown = False
        elif op == "end_weight_update":
            self.session_unknown = False

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
        self._undo = None


@dataclass(eq=False, slots=True)
class PendingCall:
    """One engine call that has been issued and not yet gathered (a view of ``Calls``)."""

    record: EngineRecord
    op: str
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

    __slots__ = ("modes", "ops", "records", "refs", "starts", "tags")

    def __init__(self) -> None:
        self.records: list[EngineRecord] = []
        self.ops: list[str] = []
        self.tags: list[tuple[Tag, ...]] = []
        self.modes: list[PauseMode | None] = []
        self.refs: list[Awaitable[Any]] = []
        self.starts: list[float] = []

    @classmethod
    def join(cls, parts: Iterable[Calls]) -> Calls:
        """One batch of the calls of ``parts``, in order."""
        joined = cls()
        for part in parts:
            joined.extend(part)
        return joined

    def extend(self, other: Calls) -> None:
        """Append the calls of ``other``."""
        self.records += other.records
        self.ops += other.ops
        self.tags += other.tags
        self.modes += other.modes
        self.refs += other.refs
        self.starts += other.starts

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[PendingCall]:
        columns = (self.records, self.ops, self.tags, self.modes, self.refs, self.starts)
        for record, op, tags, mode, ref, start in zip(*columns, strict=True):
            yield PendingCall(record, op, tags, mode, ref, start)


class EngineGroup:
    """A set of engines that share a role and an offload policy.

    ``engines`` are Ray actor handles of ``EngineActor`` (production), ``EngineHost`` objects, or
    bare engine backends (in-process fleets; wrapped in an ``EngineHost``). Groups with
    ``needs_offload=False`` (GPUs not shared with the trainer) are never released.
    """

    def __init__(self, name: str, engines: Sequence[Any], needs_offload: bool = True) -> None:
        if not isinstance(name, str) or not name or "/" in name or name != name.strip():
            raise InvalidArgument(
                f"group name must be a non-empty string without '/' or surrounding spaces, "
                f"got {name!r}"
            )
        if not isinstance(needs_offload, bool):
            raise InvalidArgument(f"needs_offload must be a bool, got {needs_offload!r}")
        if isinstance(engines, str | bytes) or not isinstance(engines, Sequence):
            raise InvalidArgument(f"engines of group {name!r} must be a sequence, got {engines!r}")
        if not engines:
            raise InvalidArgument(f"group {name!r} has no engines")
        handles: list[Any] = []
        seen: dict[Hashable, int] = {}
        for index, engine in enumerate(engines):
            handle = _as_handle(engine, name, index)
            key = engine_identity(handle)
            if key in seen:
                raise InvalidArgument(
                    f"engine #{index} of group {name!r} is the same engine as engine "
                    f"#{seen[key]} ({_shown(key)})"
                )
            seen[key] = index
            handles.append(handle)
        #: Called after the intent of calls that must not repeat is recorded, before they are
        #: sent (``RolloutServer``'s journal).
        self._before_send: Callable[[], None] | None = None
        self._name = name
        self._needs_offload = needs_offload
        self._records = tuple(
            EngineRecord(id=f"{name}/{i}", group=name, handle=h) for i, h in enumerate(handles)
        )

    def __repr__(self) -> str:
        return (
            f"EngineGroup({self._name!r}, engines={len(self._records)}, "
            f"needs_offload={self._needs_offload})"
        )

    @property
    def name(self) -> str:
        """The group's name; engine ids are ``name/index``."""
        return self._name

    @property
    def needs_offload(self) -> bool:
        """True when the group's GPUs are shared with the trainer."""
        return self._needs_offload

    @property
    def engines(self) -> tuple[Any, ...]:
        """The engine handles, in order."""
        return tuple(r.handle for r in self._records)

    @property
    def records(self) -> tuple[EngineRecord, ...]:
        """The ledger entries of the group's engines."""
        return self._records

    def replace(self, record: EngineRecord, engine: Any) -> Any:
        """Put a new engine in ``record``'s slot, known to hold all its memory and to serve.

        Returns the old handle. The replacement counts as stale until it receives weights.
        """
        if record not in self._records:
            raise InvalidArgument(f"engine {record.id} is not in group {self._name!r}")
        index = self._records.index(record)
        handle = _as_handle(engine, self._name, index)
        key = engine_identity(handle)
        if any(engine_identity(r.handle) == key for r in self._records if r is not record):
            raise InvalidArgument(f"the replacement for {record.id} is already in the group")
        old = record.handle
        record.handle = handle
        record.alive, record.paused, record.pause_mode, record.flushed = True, False, None, False
        record.pause_unknown = record.session_unknown = False
        record.released.clear()
        record.uncertain.clear()
        record.last_op, record.last_outcome, record.stale = None, None, True
        record._undo = None
        return old

    def live(self) -> list[EngineRecord]:
        """Records of the engines not known to be dead."""
        return [r for r in self._records if r.alive]

    # -- issuing ------------------------------------------------------------------------------

    def _issue(
        self,
        targets: Iterable[EngineRecord],
        op: str,
        args: tuple[Any, ...] = (),
        *,
        tags: tuple[Tag, ...] = (),
        mode: PauseMode | None = None,
        check: Callable[[EngineRecord], None] | None = None,
    ) -> Calls:
        chosen = list(targets)
        for record in chosen:  # every guard passes before the first call is sent
            (check or (lambda r: r.check_alive(op)))(record)
        if chosen and (op in _MEMORY_OPS or op in _PAUSE_OPS or op in _SESSION_OPS):
            for record in chosen:
                record.intend(op, tags, mode)
            if self._before_send is not None:
                try:
                    self._before_send()
                except BaseException:
                    for record in chosen:
                        record._undo_intent(op)
                    raise
        calls = Calls()
        refs, starts = calls.refs, calls.starts
        for record in chosen:
            starts.append(time.monotonic())
            refs.append(send_to_engine(record.handle, op, args))
        calls.records = chosen
        calls.ops = [op] * len(chosen)
        calls.tags = [tags] * len(chosen)
        calls.modes = [mode] * len(chosen)
        return calls

    def preflight(self, op: str, tags: Sequence[Tag] = ()) -> None:
        """Run the guards of ``op`` on this group's targets without sending anything."""
        targets, check = self._plan(op, tuple(tags))
        for record in targets:
            check(record)

    def _plan(
        self, op: str, tags: tuple[Tag, ...]
    ) -> tuple[list[EngineRecord], Callable[[EngineRecord], None]]:
        live = self.live()
        if op == "release_memory_occupation":
            return (live if self._needs_offload else []), lambda r: r.check_release(tags)
        if op == "resume_memory_occupation":
            return (live if self._needs_offload else []), lambda r: r.check_resume(tags)
        if op == "continue_generation":
            return [r for r in live if r.paused], EngineRecord.check_continue
        if op == "flush_cache":
            return [r for r in live if r.paused], lambda r: r.check_alive(op)
        if op in ("update_weights", "begin_weight_update", "end_weight_update"):
            return live, EngineRecord.check_write_weights
        return live, lambda r: r.check_alive(op)

    def _run(
        self,
        op: str,
        args: tuple[Any, ...] = (),
        *,
        tags: tuple[Tag, ...] = (),
        mode: PauseMode | None = None,
        wire_op: str | None = None,
    ) -> Calls:
        targets, check = self._plan(op, tags)
        calls = self._issue(targets, wire_op or op, args, tags=tags, mode=mode, check=check)
        return calls

    def pause_generation(self, mode: PauseMode) -> Calls:
        """Pause every live engine."""
        return self._run("pause_generation", (mode.value,), mode=mode)

    def flush_cache(self, deadline: float, retry_interval: float) -> Calls:
        """Flush every paused engine, each retrying until ``deadline`` seconds pass."""
        return self._run("flush_cache", (deadline, retry_interval))

    def release_memory(self, tags: Sequence[Tag | str]) -> Calls:
        """Release ``tags`` on every engine (none when the group does not need offload)."""
        t = parse_tags(tags)
        return self._run("release_memory_occupation", (_tag_list(t),), tags=t)

    def resume_memory(self, tags: Sequence[Tag | str]) -> Calls:
        """Resume ``tags`` on every engine that released them."""
        t = parse_tags(tags)
        return self._run("resume_memory_occupation", (_tag_list(t),), tags=t)

    def continue_generation(self) -> Calls:
        """Continue generation on every paused engine."""
        return self._run("continue_generation")

    def begin_weight_update(self) -> Calls:
        """Open a weight-update session on every live engine."""
        return self._run("begin_weight_update")

    def end_weight_update(self) -> Calls:
        """Close the weight-update session on every live engine."""
        return self._run("end_weight_update")

    def probe(self) -> Calls:
        """Ask every live engine for its server info: the liveness probe that is safe while
        paused (a generating health check would hang on a paused engine)."""
        return self._run("server_info")

    def update_weight_version(self, version: str) -> Calls:
        """Set the weight version on every live engine, aborting nothing."""
        return self._run("update_weights", (version,), wire_op="update_weight_version")


def _shown(identity: Hashable) -> str:
    """An engine identity as a message shows it."""
    if isinstance(identity, tuple) and identity and identity[0] in ("url", "actor"):
        return f"{identity[0]} {identity[1]}"
    return "the same object"


def _as_handle(engine: Any, group: str, index: int) -> Any:
    if isinstance(engine, EngineHost | HostedEngine) or _is_actor(engine):
        return engine
    if isinstance(engine, EngineBackend):
        return EngineHost(engine)
    raise InvalidArgument(
        f"engine #{index} of group {group!r} is {type(engine).__name__!s}, not an engine actor "
        f"handle, a HostedEngine, an EngineHost or an engine backend"
    )


def send_to_engine(handle: Any, op: str, args: tuple[Any, ...] = ()) -> Awaitable[Any]:
    """Issue ``op(*args)`` to an engine handle (Ray actor, ``HostedEngine`` or ``EngineHost``);
    do not wait."""
    if isinstance(handle, EngineHost):
        task: Awaitable[Any] = asyncio.ensure_future(getattr(handle, op)(*args))
        return task
    if isinstance(handle, HostedEngine):
        hosted: Awaitable[Any] = handle.send(op, args)
        return hosted
    ref: Awaitable[Any] = getattr(handle, op).remote(*args)
    return ref
