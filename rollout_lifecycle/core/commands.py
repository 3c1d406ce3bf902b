"""What each engine operation means to the lifecycle, declared once, as a typed ``Command``.

A command says, for its operation: the guard every target passes before anything is sent, the
engines it goes to when the caller names none, whether it only reads the engine, whether the
engine must show who it is first (``CHECKED_OPS``), which part of the engine's record it changes
(the memory tags, the pause, the weight-update session; that part's *intent* is recorded before
the call is sent, and is all that is known of the call when it never answers), and what it does
to the record once it lands or is refused. Each of those is named here, by a value; the record
(``core/ledger.EngineRecord``), the only writer of an engine's facts, carries each one out. The
phase runner and the record look commands up here; neither spells out an operation's meaning
in a branch of its own.

How a command goes on the wire is the engine's business: the operation's name is the
``EngineHost`` method that carries it, and each backend maps that method to its server's
endpoint (``backends.sglang.api`` for SGLang).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from rollout_lifecycle.contract.commands import READ_OPS
from rollout_lifecycle.contract.ops import CHECKED_OPS, Op


class Guard(enum.Enum):
    """The check every target of a command passes before anything is sent."""

    #: The engine is not known to be dead.
    ALIVE = "alive"
    #: Alive, all memory resident (generation would run on released memory).
    CONTINUE = "continue"
    #: Alive, paused, flushed, not paused in place, the tags not released already.
    RELEASE = "release"
    #: Alive, the tags released and none in an unknown state.
    RESUME = "resume"
    #: Alive, the weights resident.
    WRITE_WEIGHTS = "write_weights"


class Targets(enum.Enum):
    """The engines of a group a command goes to when the caller names none."""

    #: Every live engine.
    LIVE = "live"
    #: Every live engine of a group that offloads (memory calls).
    OFFLOADING = "offloading"
    #: Every live paused engine (continue, flush).
    PAUSED = "paused"


class Part(enum.Enum):
    """A part of an engine's record that some commands change: while such a call may or may not
    have landed, the part is unknown (``EngineRecord.intend``)."""

    #: The released tags: those of a release or resume in flight are uncertain.
    MEMORY = "memory"
    #: The pause: a pause or continue in flight leaves it paused, unknown, not flushed.
    PAUSE = "pause"
    #: The weight-update session: one may be open.
    SESSION = "session"


class Effect(enum.Enum):
    """What a call that landed does to the record."""

    NOTHING = "nothing"
    PAUSED = "paused"
    CONTINUED = "continued"
    FLUSHED = "flushed"
    RELEASED = "released"
    RESUMED = "resumed"
    #: A session is open until its end lands (a journal written meanwhile says so).
    SESSION_OPENED = "session_opened"
    SESSION_CLOSED = "session_closed"


class Refusal(enum.Enum):
    """What a refused call says beyond "nothing happened"."""

    #: A begin refused as "a session is already open": one the record did not know of.
    BEGIN = "begin"
    #: An end refused: 400 says none is open; any other refusal leaves it open.
    END = "end"


MEMORY, PAUSE, SESSION = Part.MEMORY, Part.PAUSE, Part.SESSION


# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Command:
    """One operation's meaning to the lifecycle (see the module's docstring)."""

    op: Op
    #: The check every target passes before anything is sent (``IllegalEngineOp`` if not).
    guard: Guard
    #: The engines of a group it goes to when the caller names none.
    targets: Targets = Targets.LIVE
    #: The part of the record it changes (its intent is recorded before it is sent); None for
    #: a call whose effect needs no intent.
    part: Part | None = None
    #: What a call that landed does to the record.
    landed: Effect = Effect.NOTHING
    #: What a refused call says beyond "nothing happened", if anything.
    refused: Refusal | None = None
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
    alive, weights, paused = Guard.ALIVE, Guard.WRITE_WEIGHTS, Targets.PAUSED
    commands = [
        Command(Op.PAUSE, alive, part=PAUSE, landed=Effect.PAUSED),
        Command(Op.CONTINUE, Guard.CONTINUE, paused, PAUSE, Effect.CONTINUED),
        Command(Op.FLUSH, alive, paused, landed=Effect.FLUSHED),
        Command(Op.RELEASE, Guard.RELEASE, Targets.OFFLOADING, MEMORY, Effect.RELEASED),
        Command(Op.RESUME, Guard.RESUME, Targets.OFFLOADING, MEMORY, Effect.RESUMED),
        Command(
            Op.BEGIN_UPDATE,
            weights,
            part=SESSION,
            landed=Effect.SESSION_OPENED,
            refused=Refusal.BEGIN,
        ),
        Command(
            Op.END_UPDATE,
            weights,
            part=SESSION,
            landed=Effect.SESSION_CLOSED,
            refused=Refusal.END,
        ),
        Command(Op.SET_VERSION, weights),
    ]
    # the reads are the typed commands' (``contract/commands``): a read added there is one here
    commands += [Command(op, alive, reads=True) for op in Op if op in READ_OPS]
    declared = {c.op for c in commands}
    commands += [Command(op, alive) for op in Op if op not in declared]
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


__all__ = [
    "COMMANDS",
    "MEMORY",
    "PAUSE",
    "SESSION",
    "Command",
    "Effect",
    "Guard",
    "Part",
    "Refusal",
    "Targets",
    "command",
]
