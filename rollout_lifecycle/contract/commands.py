"""Engine commands as typed values: what the lifecycle asks of one engine, one frozen dataclass
per operation (``Pause(mode)``, ``Release(tags)``, ``SetVersion(version)``, ...).

A command is checked once, where it is made: a pause mode is a ``PauseMode``, tags are known
memory tags, none twice, a version a non-empty string. From there it travels unchanged: the
reconciler and the weight paths make it, a ``Plan`` carries it to its engines, and the phase
runner hands it to the engine seam, which sends its ``wire`` form (its operation's name and
its ``args``, the plain values its ``EngineHost`` method takes) to the host's one generic
method, ``EngineHost.run``. What a command means to an engine's record (its guard, its
intent, its effect) is its operation's, in ``core/commands``; how it goes on a server's wire is
the backend's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.values import (
    PauseMode,
    Tag,
    check_name,
    check_seconds,
    check_strings,
    member,
    parse_tags,
)


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """One operation for one engine, with its arguments."""

    #: The operation (its value names the ``EngineHost`` method, or failing that the
    #: backend's, that carries it out: ``EngineHost.run``).
    op: ClassVar[Op]
    #: It only reads the engine (``PhaseRunner.ask`` sends reads only).
    reads: ClassVar[bool] = False

    @property
    def args(self) -> tuple[Any, ...]:
        """The ``EngineHost`` method's arguments, as plain values."""
        return ()

    @property
    def wire(self) -> tuple[Any, ...]:
        """How the command crosses the engine seam: its operation's name, then its ``args``
        (``EngineHost.run(op, *args)``). Plain values: Ray sends them by its fast path, where
        an object of a class of its own would be pickled on every call."""
        return (self.op._value_, *self.args)

    @property
    def tags(self) -> tuple[Tag, ...]:
        """The memory tags the command moves (a release's or a resume's); else none."""
        return ()

    @property
    def mode(self) -> PauseMode | None:
        """The pause mode (a pause's); else None."""
        return None


# -- the lifecycle's moves ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pause(EngineCommand):
    """Pause generation in ``mode``."""

    op: ClassVar[Op] = Op.PAUSE
    mode: PauseMode = field()  # (a field where the base has a property: ``field()`` says so)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", member(PauseMode, self.mode, "pause mode"))

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.mode.value,)


@dataclass(frozen=True, slots=True)
class Continue(EngineCommand):
    """Continue generation."""

    op: ClassVar[Op] = Op.CONTINUE


@dataclass(frozen=True, slots=True)
class Flush(EngineCommand):
    """The idle barrier: flush the prefix cache, asking again every ``retry_interval`` seconds
    while the engine is busy, for up to ``deadline`` seconds (0: one attempt)."""

    op: ClassVar[Op] = Op.FLUSH
    deadline: float
    retry_interval: float

    def __post_init__(self) -> None:
        check_seconds("flush deadline", self.deadline, positive=False)
        check_seconds("flush retry_interval", self.retry_interval, positive=False)

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.deadline, self.retry_interval)


@dataclass(frozen=True, slots=True)
class _Memory(EngineCommand):
    """A release or resume of some memory tags."""

    tags: tuple[Tag, ...] = field()
    #: The host method's arguments, made once (a plan sends them to every engine).
    _args: tuple[Any, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tags = parse_tags(self.tags, what=f"{self.op.value} tags")
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "_args", ([t.value for t in tags],))

    @property
    def args(self) -> tuple[Any, ...]:
        return self._args


@dataclass(frozen=True, slots=True)
class Release(_Memory):
    """Release the memory of ``tags`` (the engine paused and idle)."""

    op: ClassVar[Op] = Op.RELEASE


@dataclass(frozen=True, slots=True)
class Resume(_Memory):
    """Take the memory of ``tags`` back."""

    op: ClassVar[Op] = Op.RESUME


# -- weights --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BeginUpdate(EngineCommand):
    """Open a weight-update session."""

    op: ClassVar[Op] = Op.BEGIN_UPDATE


@dataclass(frozen=True, slots=True)
class EndUpdate(EngineCommand):
    """Close the weight-update session."""

    op: ClassVar[Op] = Op.END_UPDATE


@dataclass(frozen=True, slots=True)
class SetVersion(EngineCommand):
    """Label the loaded weights ``version`` (no request is aborted)."""

    op: ClassVar[Op] = Op.SET_VERSION
    version: str

    def __post_init__(self) -> None:
        check_name("weight version", self.version)

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.version,)


def _version(version: str | None) -> None:
    if version is not None:
        check_name("weight version", version)


@dataclass(frozen=True, slots=True)
class UpdateFromDisk(EngineCommand):
    """Load the weights at ``model_path`` (labelled ``version``, if given); the engine's cache
    is not flushed (the lifecycle flushes every engine once all have the weights)."""

    op: ClassVar[Op] = Op.UPDATE_FROM_DISK
    model_path: str
    version: str | None = None

    def __post_init__(self) -> None:
        check_name("model_path", self.model_path)
        _version(self.version)

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.model_path, self.version, False)


@dataclass(frozen=True, slots=True)
class UpdateFromTensor(EngineCommand):
    """Write serialized tensors (one base64 string per tensor-parallel rank)."""

    op: ClassVar[Op] = Op.UPDATE_FROM_TENSOR
    payload: tuple[str, ...]
    version: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload", check_strings("payload", self.payload))
        _version(self.version)

    @property
    def args(self) -> tuple[Any, ...]:
        return (list(self.payload), self.version, False)


@dataclass(frozen=True, slots=True)
class UpdateFromDistributed(EngineCommand):
    """Receive the tensors ``names`` (of ``dtypes`` and ``shapes``) over collective group
    ``group_name``, which the trainer broadcasts meanwhile."""

    op: ClassVar[Op] = Op.UPDATE_FROM_DISTRIBUTED
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    version: str | None = None
    load_format: str | None = None

    def __post_init__(self) -> None:
        _version(self.version)

    @property
    def args(self) -> tuple[Any, ...]:
        shapes = [list(s) for s in self.shapes]
        return (list(self.names), list(self.dtypes), shapes, self.group_name, self.version, False,
                self.load_format)  # fmt: skip


@dataclass(frozen=True, slots=True)
class JoinGroup(EngineCommand):
    """Join collective group ``group_name`` as rank ``rank_offset`` (its first) of
    ``world_size``, at ``master_address:master_port`` over ``backend``."""

    op: ClassVar[Op] = Op.INIT_UPDATE_GROUP
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "nccl"

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.master_address, self.master_port, self.rank_offset, self.world_size,
                self.group_name, self.backend)  # fmt: skip


@dataclass(frozen=True, slots=True)
class LeaveGroup(EngineCommand):
    """Leave collective group ``group_name``."""

    op: ClassVar[Op] = Op.DESTROY_UPDATE_GROUP
    group_name: str

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.group_name,)


# -- reads ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observe(EngineCommand):
    """Who the engine is and whether it says it is paused (``{"incarnation", "paused"}``):
    the pause state read only with ``paused``, the incarnation only with ``identify``;
    ``purpose`` marks the reads."""

    op: ClassVar[Op] = Op.OBSERVE
    reads: ClassVar[bool] = True
    paused: bool = True
    purpose: str = "observe"
    identify: bool = True

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.paused, self.purpose, self.identify)


@dataclass(frozen=True, slots=True)
class ReadServerInfo(EngineCommand):
    """The server's own description of itself (the liveness probe safe while paused)."""

    op: ClassVar[Op] = Op.SERVER_INFO
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadVersion(EngineCommand):
    """The version of the loaded weights."""

    op: ClassVar[Op] = Op.WEIGHT_VERSION
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadFingerprint(EngineCommand):
    """The digest of every tensor the engine holds (``contract/fingerprint``)."""

    op: ClassVar[Op] = Op.FINGERPRINT
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadWorkerUrl(EngineCommand):
    """The URL a router sends the engine's traffic to."""

    op: ClassVar[Op] = Op.WORKER_URL
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadMemory(EngineCommand):
    """The engine's resident memory, by tag."""

    op: ClassVar[Op] = Op.MEMORY
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadSleeping(EngineCommand):
    """Whether the engine says it is paused or any of its memory asleep (vLLM's
    ``/is_sleeping``: what it really did, where the record follows the lifecycle's steps)."""

    op: ClassVar[Op] = Op.IS_SLEEPING
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadLabel(EngineCommand):
    """The engine's name in errors and events."""

    op: ClassVar[Op] = Op.LABEL
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadHistory(EngineCommand):
    """The calls the engine recorded (a simulated engine's; a real server has none)."""

    op: ClassVar[Op] = Op.HISTORY
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadState(EngineCommand):
    """What the engine says of its own state (a simulated engine's)."""

    op: ClassVar[Op] = Op.STATE
    reads: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ReadStats(EngineCommand):
    """The engine's counters (a simulated engine's)."""

    op: ClassVar[Op] = Op.STATS
    reads: ClassVar[bool] = True


# -- requests and the end -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Generate(EngineCommand):
    """One generate request, in SGLang's shape, run to its answer."""

    op: ClassVar[Op] = Op.GENERATE
    request: dict[str, Any]

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.request,)


@dataclass(frozen=True, slots=True)
class Abort(EngineCommand):
    """Abort the request whose id is exactly ``rid`` (every request with ``abort_all``)."""

    op: ClassVar[Op] = Op.ABORT
    rid: str = ""
    abort_all: bool = False

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.rid, self.abort_all)


@dataclass(frozen=True, slots=True)
class Close(EngineCommand):
    """Close the engine's backend (a launched server stops)."""

    op: ClassVar[Op] = Op.CLOSE


def _kinds(base: type[EngineCommand]) -> list[type[EngineCommand]]:
    found = []
    for kind in base.__subclasses__():
        found += [kind, *_kinds(kind)]
    return found


#: Every kind of command, by its operation (a base of kinds, such as a memory move, is none).
KINDS: dict[Op, type[EngineCommand]] = {k.op: k for k in _kinds(EngineCommand) if "op" in vars(k)}
#: The operations that only read the engine.
READ_OPS: frozenset[Op] = frozenset(op for op, kind in KINDS.items() if kind.reads)


__all__ = [
    "KINDS",
    "READ_OPS",
    "Abort",
    "BeginUpdate",
    "Close",
    "Continue",
    "EndUpdate",
    "EngineCommand",
    "Flush",
    "Generate",
    "JoinGroup",
    "LeaveGroup",
    "Observe",
    "Pause",
    "ReadFingerprint",
    "ReadHistory",
    "ReadLabel",
    "ReadMemory",
    "ReadServerInfo",
    "ReadSleeping",
    "ReadState",
    "ReadStats",
    "ReadVersion",
    "ReadWorkerUrl",
    "Release",
    "Resume",
    "SetVersion",
    "UpdateFromDisk",
    "UpdateFromDistributed",
    "UpdateFromTensor",
]
