"""The public calls of a ``RolloutServer``, in one table.

``PUBLIC_CALLS`` names every public member of the async server: what kind of call it is, what
it does, which of its arguments is user code, whether ``SyncRolloutServer`` offers it and which
``ctl`` actions make it. ``LIFECYCLE_CALLS``, drawn from it, is what the scope refuses from user
code inside a step and what the sync facade lets join the operation in progress; ``ctl`` maps
its actions to calls through it, and ``calls_table`` draws the table in ``docs/design.md``. A
test checks both servers' members and signatures, ``ctl`` and the doc against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from rollout_lifecycle.core.states import CALLS


class CallKind(str, Enum):
    """How a public call relates to the lifecycle."""

    #: Fires transitions (its plan is in ``states.CALLS``) or replaces engines; serialized
    #: with every other lifecycle call, and refused from user code inside a step.
    LIFECYCLE = "lifecycle"
    #: A context manager around lifecycle calls.
    SCOPE = "scope"
    #: Sends generate requests; not serialized with lifecycle calls.
    GENERATION = "generation"
    #: Reads engines without changing them (a probe, a router sync); not serialized.
    ENGINE_READ = "engine_read"
    #: Reads or changes what the server keeps in process; sends nothing to an engine.
    LOCAL = "local"


@dataclass(frozen=True)
class PublicCall:
    """One public member of ``RolloutServer``."""

    name: str
    kind: CallKind
    #: One line: what the call does.
    summary: str
    #: The argument that is user code (a hook, a weight push, an engine factory; the sync
    #: facade runs a sync one in a worker thread of its own). A test checks it names one.
    user_code: str | None = None
    #: Whether ``SyncRolloutServer`` offers it (blocking, with a ``timeout`` where it may wait).
    sync: bool = True
    #: The ``rollout-lifecycle ctl`` actions that make this call.
    ctl: tuple[str, ...] = ()
    #: Where a lifecycle call without a plan in ``states.CALLS`` is legal, as the doc says it.
    legal: str = "any"

    @property
    def lifecycle(self) -> bool:
        """Whether the call fires transitions (serialized; refused inside a step)."""
        return self.kind is CallKind.LIFECYCLE


_L, _S, _G, _R, _P = (
    CallKind.LIFECYCLE,
    CallKind.SCOPE,
    CallKind.GENERATION,
    CallKind.ENGINE_READ,
    CallKind.LOCAL,
)

#: Every public member of ``RolloutServer``, by name.
PUBLIC_CALLS: dict[str, PublicCall] = {
    c.name: c
    for c in (
        PublicCall(
            "offload",
            _L,
            "pause and drain the offloaded groups, then release their memory",
            ctl=("offload",),
        ),
        PublicCall(
            "onload_weights",
            _L,
            "resume the weights; the KV cache stays released",
            ctl=("onload-weights",),
        ),
        PublicCall(
            "update_weights",
            _L,
            "write weights while they are resident and generation is paused",
            user_code="push",
        ),
        PublicCall(
            "onload_kv", _L, "resume the KV cache, then continue generation", ctl=("onload-kv",)
        ),
        PublicCall("onload", _L, "every restore an offload left to do, then continue"),
        PublicCall(
            "pause", _L, "pause and drain every group; nothing is released", ctl=("pause", "drain")
        ),
        PublicCall("resume", _L, "continue generation", ctl=("resume",)),
        PublicCall(
            "reset", _L, "leave failed for the state the engines' records imply", ctl=("reset",)
        ),
        PublicCall(
            "recover",
            _L,
            "replace dead and uncertain engines and bring the fleet to the state's target",
            user_code="factory",
        ),
        PublicCall(
            "add_engines",
            _L,
            "engines join a group: claimed, read, brought to its memory state, serving once "
            "the fleet's weights reach them",
            legal="any but `failed`",
        ),
        PublicCall(
            "remove_engines",
            _L,
            "engines leave the fleet: unrouted, paused, their requests handed back, released",
            legal="any but `failed`",
        ),
        PublicCall("paused", _S, "pause for the body, then resume"),
        PublicCall("offloaded", _S, "offload for the body, then onload (hooks included)"),
        PublicCall("generate", _G, "one request to its full answer, on serving engines only"),
        PublicCall("generate_batch", _G, "every request concurrently; answers in order"),
        PublicCall("probe", _R, "probe every live engine's liveness without generating"),
        PublicCall(
            "sync_router",
            _R,
            "register the engines that serve now with the bound router",
            sync=False,
        ),
        PublicCall("on", _P, "call a hook on an event; returns its remover", user_code="hook"),
        PublicCall("state", _P, "the aggregate state"),
        PublicCall("snapshot", _P, "the state and what the server knows of every engine"),
        PublicCall("unhealthy_units", _P, "the units of several servers that cannot serve whole"),
        PublicCall("metrics", _P, "timings of the last completed call of each kind"),
        PublicCall("expected_version", _P, "the version of the last versioned weight update"),
        PublicCall("name", _P, "the server's name"),
        PublicCall("config", _P, "the server's configuration", sync=False),
        PublicCall("groups", _P, "the engine groups", sync=False),
        PublicCall("fleet", _P, "the ledger: every engine's record", sync=False),
        PublicCall("slowest_engines", _P, "the slowest engine of each phase", sync=False),
        PublicCall("timeline", _P, "every phase and engine call, for plotting", sync=False),
        PublicCall("adopt", _P, "take over engines an earlier process recorded", sync=False),
        PublicCall("bus", _P, "the server's events, to subscribe to", sync=False),
        PublicCall("engines", _P, "every engine handle by id", sync=False),
        PublicCall("generation", _P, "the generation client", sync=False),
        PublicCall("has_generation", _P, "whether the generation client exists", sync=False),
    )
}

#: The calls that fire transitions.
LIFECYCLE_CALLS: frozenset[str] = frozenset(n for n, c in PUBLIC_CALLS.items() if c.lifecycle)


def calls_table() -> str:
    """The Markdown table of the lifecycle calls: the states each is legal in, the transitions
    it fires from each, and where it has nothing to do (``docs/design.md`` shows it)."""
    rows = [
        "| call | legal in | transitions it fires, by state | nothing to do in |",
        "|---|---|---|---|",
    ]
    for call in PUBLIC_CALLS.values():
        if not call.lifecycle:
            continue
        plans = CALLS.get(call.name)
        if plans is None:
            rows.append(f"| `{call.name}()` | {call.legal} | {call.summary} | |")
            continue
        legal = ", ".join(f"`{s.value}`" for s in plans)
        paths = "; ".join(f"`{s.value}`: {' -> '.join(plan)}" for s, plan in plans.items() if plan)
        idle = ", ".join(f"`{s.value}`" for s, plan in plans.items() if not plan)
        rows.append(f"| `{call.name}()` | {legal} | {paths} | {idle} |")
    return "\n".join(rows)


__all__ = ["LIFECYCLE_CALLS", "PUBLIC_CALLS", "CallKind", "PublicCall", "calls_table"]
