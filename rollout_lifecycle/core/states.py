"""The lifecycle states and the transition table, declared once as data.

The server's ``transitions.AsyncMachine`` runs on ``TRANSITIONS``; each row names the phase the
server runs before the state changes (``before``), so a phase that fails leaves the state where
it was. The Mermaid diagram is drawn from the same rows, so it cannot drift from the code.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class ServerState(str, Enum):
    """Aggregate state of a ``RolloutServer``; the values are part of the public API."""

    SERVING = "serving"
    PAUSING = "pausing"
    DRAINED = "drained"
    RELEASED = "released"
    WEIGHTS_RESTORED = "weights_restored"
    KV_RESTORED = "kv_restored"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


S = ServerState

#: Every transition the server can make. ``before`` is the server method that runs the phase.
#: ``write_weights`` is internal (``dest`` None): the state does not change while weights are
#: written, and it is only legal where the weights are resident (invariant 5 of docs/design.md).
TRANSITIONS: tuple[dict[str, Any], ...] = (
    {"trigger": "pause", "source": S.SERVING, "dest": S.PAUSING},
    # A hook refused the drain before anything was left paused: back to serving.
    {"trigger": "abandon", "source": S.PAUSING, "dest": S.SERVING},
    {"trigger": "drain", "source": S.PAUSING, "dest": S.DRAINED, "before": "_phase_drain"},
    {"trigger": "release", "source": S.DRAINED, "dest": S.RELEASED, "before": "_phase_release"},
    {
        "trigger": "restore_weights",
        "source": S.RELEASED,
        "dest": S.WEIGHTS_RESTORED,
        "before": "_phase_restore_weights",
    },
    {
        "trigger": "write_weights",
        "source": [S.DRAINED, S.WEIGHTS_RESTORED, S.KV_RESTORED],
        "dest": None,
        "before": "_phase_write_weights",
    },
    {
        "trigger": "restore_kv",
        "source": S.WEIGHTS_RESTORED,
        "dest": S.KV_RESTORED,
        "before": "_phase_restore_kv",
    },
    {
        "trigger": "resume",
        "source": [S.DRAINED, S.KV_RESTORED],
        "dest": S.SERVING,
        "before": "_phase_continue",
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
            "conditions": "_settles_in_" + dest.value,
        }
        for dest in (S.SERVING, S.DRAINED, S.RELEASED, S.WEIGHTS_RESTORED)
    ),
)


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
