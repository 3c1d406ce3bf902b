"""What each engine operation means to the lifecycle, declared once, as a typed ``Command``.

A command says, for its operation: the guard every target passes before anything is sent, the
engines it goes to when the caller names none, whether it only reads the engine, whether the
engine must show who it is first (``CHECKED_OPS``), which part of the engine's record it changes
(the memory tags, the pause, the weight-update session; that part's *intent* is recorded before
the call is sent, and is all that is known of the call when it never answers), and what it does
to the record once it lands or is refused. ``EngineRecord`` and the phase runner look commands
up here; neither spells out an operation's meaning in a branch of its own.

How a command goes on the wire is the engine's business: the operation's name is the
``EngineHost`` method that carries it, and each backend maps that method to its server's
endpoint (``backends.sglang_api`` for SGLang).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_lifecycle.contract.ops import CHECKED_OPS, Op
from rollout_lifecycle.contract.outcome import SESSION_OPEN
from rollout_lifecycle.contract.values import PauseMode, Tag

if TYPE_CHECKING:
    from rollout_lifecycle.contract.outcome import EngineOutcome
    from rollout_lifecycle.core.ledger import EngineRecord, GroupRecords

Tags = tuple[Tag, ...]


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


Intent = _TagsIntent | _PauseIntent | _SessionIntent


class Part:
    """A part of an engine's record that some commands change: ``unknown`` is what the record
    holds while such a call may or may not have landed; ``intend`` records that before the call
    is sent and returns how to forget it (``saved``: the part as it was)."""

    def unknown(self, record: EngineRecord, op: Op, tags: Tags, mode: PauseMode | None) -> None:
        raise NotImplementedError

    def saved(self, record: EngineRecord, tags: Tags) -> Intent:
        raise NotImplementedError

    def intend(self, record: EngineRecord, op: Op, tags: Tags, mode: PauseMode | None) -> Intent:
        intent = self.saved(record, tags)
        self.unknown(record, op, tags, mode)
        return intent


class _Memory(Part):
    def unknown(self, record: EngineRecord, op: Op, tags: Tags, mode: PauseMode | None) -> None:
        # Neither a release nor a resume of these tags is safe now.
        record.uncertain.update(tags)

    def saved(self, record: EngineRecord, tags: Tags) -> Intent:
        return _TagsIntent(frozenset(t for t in tags if t not in record.uncertain))


class _Pause(Part):
    def unknown(self, record: EngineRecord, op: Op, tags: Tags, mode: PauseMode | None) -> None:
        # Counted as paused, so that it is continued (harmless if it never paused) and never
        # taken for serving; a flush alone never makes it releasable.
        record.paused, record.flushed, record.pause_unknown = True, False, True
        if op is Op.PAUSE:
            record.pause_mode = mode

    def saved(self, record: EngineRecord, tags: Tags) -> Intent:
        return _PauseIntent(record.paused, record.pause_mode, record.flushed, record.pause_unknown)


class _Session(Part):
    def unknown(self, record: EngineRecord, op: Op, tags: Tags, mode: PauseMode | None) -> None:
        record.session_unknown = True

    def saved(self, record: EngineRecord, tags: Tags) -> Intent:
        return _SessionIntent(record.session_unknown)


MEMORY, PAUSE, SESSION = _Memory(), _Pause(), _Session()


# -- effects: what a call that landed (or was refused) means -------------------------------------


def _paused(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    record.paused, record.pause_mode, record.flushed = True, mode, False
    record.pause_unknown = False


def _continued(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    record.paused, record.pause_mode, record.flushed = False, None, False
    record.pause_unknown = False


def _flushed(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    record.flushed = True


def _released(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    record.released.update(tags)


def _resumed(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    record.released.difference_update(tags)


def _session_opened(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    # Open until its end lands: a journal written meanwhile (a push in progress) says so, and
    # a process killed before the end leaves records that close it before anything else.
    record.session_unknown = True


def _session_closed(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    record.session_unknown = False


def _begin_refused(record: EngineRecord, out: EngineOutcome) -> None:
    # "A session is already open": one this record did not know of (left by a controller
    # that died without a journal, say); it is closed before the next begin.
    if out.status == SESSION_OPEN:
        record.session_unknown = True


def _end_refused(record: EngineRecord, out: EngineOutcome) -> None:
    # SGLang answers 400 when no session is open: then none is. Any other refusal leaves the
    # session it should have closed open.
    record.session_unknown = out.status != 400


def _nothing(record: EngineRecord, tags: Tags, mode: PauseMode | None) -> None:
    return None


# -- guards and default targets ------------------------------------------------------------------


def _alive(op: Op) -> Callable[[EngineRecord, Tags], None]:
    return lambda record, tags: record.check_alive(op)


def _every_live(group: GroupRecords) -> list[EngineRecord]:
    return [r for r in group.records if r.alive]


def _offloading(group: GroupRecords) -> list[EngineRecord]:
    """Memory calls go to the groups that offload only."""
    return _every_live(group) if group.needs_offload else []


def _paused_ones(group: GroupRecords) -> list[EngineRecord]:
    return [r for r in group.records if r.alive and r.paused]


# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Command:
    """One operation's meaning to the lifecycle (see the module's docstring)."""

    op: Op
    #: The check every target passes before anything is sent (``IllegalEngineOp`` if not).
    guard: Callable[[EngineRecord, Tags], None]
    #: The engines of a group it goes to when the caller names none.
    targets: Callable[[GroupRecords], list[EngineRecord]] = _every_live
    #: The part of the record it changes (its intent is recorded before it is sent); None for
    #: a call whose effect needs no intent.
    part: Part | None = None
    #: What a call that landed does to the record.
    landed: Callable[[EngineRecord, Tags, PauseMode | None], None] = _nothing
    #: What a refused call says beyond "nothing happened", if anything.
    refused: Callable[[EngineRecord, EngineOutcome], None] | None = None
    #: It only reads the engine: landing late it changes nothing a later call relies on.
    reads: bool = False

    @property
    def checked(self) -> bool:
        """The engine shows it is the process its record describes before this is carried out
        (``EngineHost.checked``)."""
        return self.op in CHECKED_OPS


def _table() -> dict[Op, Command]:
    """Every operation's command; one with no meaning of its own is a plain call to a live
    engine."""
    weights = lambda record, tags: record.check_write_weights()  # noqa: E731
    commands = [
        Command(Op.PAUSE, _alive(Op.PAUSE), part=PAUSE, landed=_paused),
        Command(
            Op.CONTINUE,
            lambda record, tags: record.check_continue(),
            _paused_ones,
            PAUSE,
            _continued,
        ),
        Command(Op.FLUSH, _alive(Op.FLUSH), _paused_ones, landed=_flushed),
        Command(
            Op.RELEASE,
            lambda record, tags: record.check_release(tags),
            _offloading,
            MEMORY,
            _released,
        ),
        Command(
            Op.RESUME,
            lambda record, tags: record.check_resume(tags),
            _offloading,
            MEMORY,
            _resumed,
        ),
        Command(
            Op.BEGIN_UPDATE,
            weights,
            part=SESSION,
            landed=_session_opened,
            refused=_begin_refused,
        ),
        Command(Op.END_UPDATE, weights, part=SESSION, landed=_session_closed, refused=_end_refused),
        Command(Op.SET_VERSION, weights),
    ]
    reads = (
        Op.WEIGHT_VERSION,
        Op.FINGERPRINT,
        Op.SERVER_INFO,
        Op.OBSERVE,
        Op.MEMORY,
        Op.STATE,
        Op.STATS,
        Op.WORKER_URL,
    )
    commands += [Command(op, _alive(op), reads=True) for op in (*reads, Op.HISTORY, Op.LABEL)]
    declared = {c.op for c in commands}
    commands += [Command(op, _alive(op)) for op in Op if op not in declared]
    return {c.op: c for c in commands}


#: Every operation's command. An ``Op`` hashes as its name, so a name looks one up too
#: (``command`` refuses a name that is no operation, never ignoring a typo).
_TABLE = _table()
COMMANDS: Mapping[Op, Command] = _TABLE
_BY_NAME: Mapping[str, Command] = {op.value: c for op, c in _TABLE.items()}


def command(op: Op | str) -> Command:
    """The command of ``op`` (an ``Op`` or its name); ``ValueError`` for a name that is no
    operation."""
    found = _BY_NAME.get(op)
    if found is None:
        raise ValueError(f"{op!r} is not an engine operation")
    return found


__all__ = ["COMMANDS", "MEMORY", "PAUSE", "SESSION", "Command", "Intent", "Part", "command"]
