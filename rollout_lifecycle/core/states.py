"""The lifecycle states, the phases, the transition table and the call plans, declared once as
data.

The server's ``transitions.AsyncMachine`` runs on ``TRANSITIONS``; a transition with a phase
(``PHASED``) runs it before the state changes, so a phase that fails leaves the state where it
was. ``CALLS`` says, for each public call, the states it is legal in and the transitions it
fires from each, in order: each call declares its goal and where it is legal, and its
transitions are the path through ``TRANSITIONS`` that leads there. The Mermaid diagram is
drawn from the same rows, so it cannot drift.
"""

from __future__ import annotations

from typing import Any

from rollout_lifecycle.contract.enums import ValueEnum


class ServerState(ValueEnum):
    """Aggregate state of a ``RolloutServer``; the values are part of the public API."""

    SERVING = "serving"
    PAUSING = "pausing"
    DRAINED = "drained"
    RELEASED = "released"
    WEIGHTS_RESTORED = "weights_restored"
    KV_RESTORED = "kv_restored"
    FAILED = "failed"


class Phase(ValueEnum):
    """The name of every phase: a set of engine calls the server sends together and waits for
    (a barrier). Events (``phase.*``), hooks (``before_<phase>`` / ``after_<phase>`` for the
    phases of ``HOOK_PHASES``), metrics (``lifecycle/<call>/<metric>_s``), timeline spans and
    ``PhaseFailed`` name a phase by its value, which is part of the public API."""

    # The cycle's steps, in order (each with hooks).
    PAUSE = "pause"
    FLUSH = "flush"
    RELEASE = "release"
    RESUME_WEIGHTS = "resume_weights"
    UPDATE_WEIGHTS = "update_weights"
    RESUME_KV = "resume_kv"
    CONTINUE = "continue"
    # The weight write (``core/sessions``, ``core/verify``), in order.
    PAUSE_FOR_UPDATE = "pause_for_update"
    CLOSE_WEIGHT_UPDATE = "close_weight_update"
    BEGIN_WEIGHT_UPDATE = "begin_weight_update"
    FINGERPRINT_BEFORE = "fingerprint_before"
    #: The user's push itself (no engine call of the library's: a span and a metric).
    PUSH = "push"
    END_WEIGHT_UPDATE = "end_weight_update"
    UPDATE_WEIGHT_VERSION = "update_weight_version"
    FLUSH_AFTER_UPDATE = "flush_after_update"
    VERIFY_WEIGHTS = "verify_weights"
    CHECK_VERSIONS = "check_versions"
    CONTINUE_AFTER_UPDATE = "continue_after_update"
    # What a failure leaves to do, and the reads.
    CONTINUE_AFTER_FAILURE = "continue_after_failure"
    #: A drain's flush hook failed and the continue of what it paused failed too.
    CONTINUE_AFTER_HOOK = "continue_after_hook"
    PROBE = "probe"
    PROBE_AGAIN = "probe_again"
    OBSERVE_AFTER_DROP = "observe_after_drop"
    RESET_PROBE = "reset_probe"
    #: ``recover()`` as a whole (the ``PhaseFailed`` that sums it up).
    RECOVER = "recover"
    # recover(): the survey, the replacements' first read, and its reconciliation's steps.
    RECOVER_SURVEY = "recover_survey"
    RECOVER_PROBE = "recover_probe"
    RECOVER_RESUME = "recover_resume"
    RECOVER_PAUSE = "recover_pause"
    RECOVER_FLUSH = "recover_flush"
    RECOVER_RELEASE = "recover_release"
    RECOVER_CONTINUE = "recover_continue"
    # add_engines(): the joining engines' first read and their reconciliation's steps.
    JOIN_PROBE = "join_probe"
    JOIN_RESUME = "join_resume"
    JOIN_PAUSE = "join_pause"
    JOIN_FLUSH = "join_flush"
    JOIN_RELEASE = "join_release"
    JOIN_CONTINUE = "join_continue"
    # remove_engines(): the leaving engines drained, their requests handed back, released.
    LEAVE_PAUSE = "leave_pause"
    LEAVE_ABORT = "leave_abort"
    LEAVE_FLUSH = "leave_flush"
    LEAVE_RELEASE = "leave_release"
    # The reconciliation of the groups that keep their memory (their continue, mostly).
    RESUME_KEEPERS = "resume_keepers"
    PAUSE_KEEPERS = "pause_keepers"
    FLUSH_KEEPERS = "flush_keepers"
    RELEASE_KEEPERS = "release_keepers"
    CONTINUE_KEEPERS = "continue_keepers"

    @property
    def metric(self) -> str:
        """Its name in metric keys: its value, but three shorter ones (``weights``, ``kv``,
        ``update``)."""
        return _METRIC_NAMES.get(self, self.value)


_METRIC_NAMES = {Phase.RESUME_WEIGHTS: "weights", Phase.RESUME_KV: "kv", Phase.PUSH: "update"}

#: The phases with ``before_<phase>`` / ``after_<phase>`` hook events, in the order a cycle runs
#: them.
HOOK_PHASES: tuple[Phase, ...] = (
    Phase.PAUSE,
    Phase.FLUSH,
    Phase.RELEASE,
    Phase.RESUME_WEIGHTS,
    Phase.UPDATE_WEIGHTS,
    Phase.RESUME_KV,
    Phase.CONTINUE,
)

S = ServerState

#: Every transition the server can make. ``write_weights`` is internal (``dest`` None): the
#: state does not change while weights are written, and it is only legal where the weights are
#: resident (invariant 5 of docs/design.md).
TRANSITIONS: tuple[dict[str, Any], ...] = (
    {"trigger": "pause", "source": S.SERVING, "dest": S.PAUSING},
    # A hook refused the drain before anything was left paused, or the router could not take
    # the engines out before the pause: back to serving.
    {"trigger": "abandon", "source": S.PAUSING, "dest": S.SERVING},
    {"trigger": "drain", "source": S.PAUSING, "dest": S.DRAINED},
    {"trigger": "release", "source": S.DRAINED, "dest": S.RELEASED},
    {
        "trigger": "restore_weights",
        "source": S.RELEASED,
        "dest": S.WEIGHTS_RESTORED,
    },
    {
        "trigger": "write_weights",
        "source": [S.DRAINED, S.WEIGHTS_RESTORED, S.KV_RESTORED],
        "dest": None,
    },
    {
        "trigger": "restore_kv",
        "source": S.WEIGHTS_RESTORED,
        "dest": S.KV_RESTORED,
    },
    {
        "trigger": "resume",
        "source": [S.DRAINED, S.KV_RESTORED],
        "dest": S.SERVING,
    },
    {
        "trigger": "fail",
        "source": [s for s in S if s is not S.FAILED],
        "dest": S.FAILED,
    },
    # Leaving ``failed`` goes to the state the engines' recorded memory state implies.
    *(
        {
            "trigger": "reset",
            "source": S.FAILED,
            "dest": dest,
        }
        for dest in (S.SERVING, S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED)
    ),
)


#: The transitions that run a phase of engine calls before the state changes.
PHASED: tuple[str, ...] = (
    "drain",
    "release",
    "restore_weights",
    "write_weights",
    "restore_kv",
    "resume",
)


def destination(trigger: str, state: ServerState) -> ServerState | None:
    """Where ``trigger`` leads from ``state`` (``state`` itself for ``write_weights``); None
    when it is not legal there. ``reset`` is taken to lead to ``serving`` (its destination is
    decided by the engines' records)."""
    for row in TRANSITIONS:
        source = row["source"]
        if row["trigger"] == trigger and state in (
            source if isinstance(source, list) else [source]
        ):
            return state if row["dest"] is None else ServerState(row["dest"])
    return None


def sources_of(trigger: str) -> tuple[ServerState, ...]:
    """The states from which ``trigger`` is legal, in declaration order."""
    out: list[ServerState] = []
    for row in TRANSITIONS:
        if row["trigger"] != trigger:
            continue
        source = row["source"]
        for state in source if isinstance(source, list) else [source]:
            if state not in out:
                out.append(state)
    return tuple(out)


#: The transitions a call may chain toward its goal: those that move the state forward (not
#: ``fail``, the undo ``abandon``, the write in place, or ``reset``, which leaves ``failed``).
_FORWARD = ("pause", "drain", "release", "restore_weights", "restore_kv", "resume")


def _path(source: ServerState, goal: ServerState) -> tuple[str, ...]:
    """The transitions (``_FORWARD`` rows of ``TRANSITIONS``) that lead from ``source`` to
    ``goal``, fewest first; ``ValueError`` if none does."""
    paths: dict[ServerState, tuple[str, ...]] = {source: ()}
    frontier = [source]
    while frontier and goal not in paths:
        state = frontier.pop(0)
        for trigger in _FORWARD:
            dest = destination(trigger, state)
            if dest is not None and dest not in paths:
                paths[dest] = (*paths[state], trigger)
                frontier.append(dest)
    if goal not in paths:
        raise ValueError(f"no transitions lead from {source.value!r} to {goal.value!r}")
    return paths[goal]


def _toward(goal: ServerState, *legal: ServerState) -> dict[ServerState, tuple[str, ...]]:
    """The plan of a call that brings the server to ``goal`` from each state in ``legal``."""
    return {state: _path(state, goal) for state in legal}


def _in_place(trigger: str) -> dict[ServerState, tuple[str, ...]]:
    """The plan of a call that fires ``trigger`` alone, wherever it is legal."""
    return {state: (trigger,) for state in sources_of(trigger)}


#: Each public call: the states it is legal in, and the transitions it fires from each, in order
#: (an empty plan: the call has nothing to do there). A call names its goal and where it is
#: legal; the transitions that lead there are read from ``TRANSITIONS``. ``offload`` pauses and
#: drains only the groups that offload; ``pause`` all of them.
CALLS: dict[str, dict[ServerState, tuple[str, ...]]] = {
    "offload": _toward(S.RELEASED, S.SERVING, S.DRAINED, S.RELEASED),
    "onload_weights": _toward(S.WEIGHTS_RESTORED, S.RELEASED, S.WEIGHTS_RESTORED),
    "update_weights": _in_place("write_weights"),
    "onload_kv": _toward(S.SERVING, S.WEIGHTS_RESTORED, S.KV_RESTORED),
    "onload": _toward(
        S.SERVING, S.SERVING, S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED, S.KV_RESTORED
    ),
    "pause": _toward(S.DRAINED, S.SERVING, S.DRAINED),
    "resume": _toward(S.SERVING, S.SERVING, S.DRAINED, S.KV_RESTORED),
    "reset": _in_place("reset"),
}


def mermaid() -> str:
    """The state diagram as Mermaid text, drawn from ``TRANSITIONS``."""
    lines = ["stateDiagram-v2", f"    [*] --> {S.SERVING.value}"]
    seen: set[tuple[str, str, str]] = set()
    for row in TRANSITIONS:
        dest = row["dest"]
        source = row["source"]
        for src in source if isinstance(source, list) else [source]:
            target = src if dest is None else dest
            edge = (src.value, target.value, row["trigger"])
            if edge in seen:
                continue
            seen.add(edge)
            lines.append(f"    {edge[0]} --> {edge[1]}: {edge[2]}")
    return "\n".join(lines) + "\n"
