"""The engine operations, declared once: their wire names and the kinds the ledger tells apart.

Every engine call the library sends is an ``Op``. Its value is the name of the ``EngineHost``
method (and of the Ray actor method) that carries it out, so ``Op.PAUSE == "pause_generation"``
and the history an engine records compares equal to the enum. What each operation means to the
lifecycle (its guard, targets, intent and effect on an engine's record) is its command, in
``core/commands``; which operations the engine host checks before carrying them out is here,
since both sides of the seam read it.
"""

from __future__ import annotations

from rollout_lifecycle.contract.enums import ValueEnum


class Op(ValueEnum):
    """One engine operation; the value is its wire (method) name."""

    PAUSE = "pause_generation"
    CONTINUE = "continue_generation"
    FLUSH = "flush_cache"
    RELEASE = "release_memory_occupation"
    RESUME = "resume_memory_occupation"
    BEGIN_UPDATE = "begin_weight_update"
    END_UPDATE = "end_weight_update"
    SET_VERSION = "update_weight_version"
    WEIGHT_VERSION = "weight_version"
    #: The digest of every tensor the engine holds (``contract/fingerprint``), as plain values.
    FINGERPRINT = "weight_fingerprint"
    SERVER_INFO = "server_info"
    #: Who the engine is and what it says of itself: ``{"incarnation", "paused"}``.
    OBSERVE = "observe"
    GENERATE = "generate"
    ABORT = "abort_request"
    UPDATE_FROM_DISK = "update_weights_from_disk"
    UPDATE_FROM_TENSOR = "update_weights_from_tensor"
    UPDATE_FROM_DISTRIBUTED = "update_weights_from_distributed"
    INIT_UPDATE_GROUP = "init_weights_update_group"
    DESTROY_UPDATE_GROUP = "destroy_weights_update_group"
    LABEL = "label"
    WORKER_URL = "worker_url"
    HISTORY = "history"
    MEMORY = "memory"
    STATE = "state"
    STATS = "stats"
    CLOSE = "close"
    #: Whether the engine says it is paused or any of its memory asleep (vLLM's
    #: ``/is_sleeping``); a backend without such a read refuses it.
    IS_SLEEPING = "is_sleeping"

    #: Hashed as its wire name, in C (``Enum`` hashes in Python): ledger tables are looked up
    #: once per engine per phase, and an ``Op`` and its name are one key.
    __hash__ = str.__hash__


#: Operations sent only once the engine has shown it is the process its record describes, and
#: (where it can tell) in the pause state the record holds (``EngineHost.checked``): sent to
#: another process, or behind another controller's back, they could kill it or lose work. (The
#: end of a weight-update session is not: sent to a new process it is a harmless 400, and the
#: version that follows it is checked.)
CHECKED_OPS = frozenset(
    {Op.PAUSE, Op.CONTINUE, Op.RELEASE, Op.RESUME, Op.BEGIN_UPDATE, Op.SET_VERSION}
)
#: The host method that carries out a command, as its wire form (``EngineHost.run(op, *args)``):
#: the one way the lifecycle's calls reach an engine.
RUN = "run"
#: The host method that carries out a checked command: ``checked(expect, op, *args)``.
CHECKED = "checked"
#: The host method that carries out a command sent under a cluster lease (``lease``):
#: ``fenced(fence, via, *args)``, where ``fence`` is ``[scope, epoch]`` and ``via`` is ``RUN`` or
#: ``CHECKED`` with their arguments; the host refuses an epoch older than one it has served.
FENCED = "fenced"


def as_op(name: str | Op) -> Op:
    """The operation named ``name``; ``ValueError`` for a name that is not one."""
    return name if isinstance(name, Op) else Op(name)


__all__ = [
    "CHECKED",
    "CHECKED_OPS",
    "FENCED",
    "RUN",
    "Op",
    "as_op",
]
