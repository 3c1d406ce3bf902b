"""In-process fleets for tests of code built on the library: simulated engines (plain, or behind
a fault injector), the calls an engine received, and a weight push that writes nothing."""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_lifecycle.backends.engine import EngineHost
from rollout_lifecycle.backends.weights import FromDisk
from rollout_lifecycle.contract.exceptions import EngineClaimed, LeaseLost, PhaseFailed
from rollout_lifecycle.contract.push import WeightUpdate
from rollout_lifecycle.core.server import RolloutServer
from rollout_lifecycle.core.states import ServerState
from rollout_lifecycle.testing.barriers import calls_received
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.simulated import SimulatedEngine


def simulated_engines(
    count: int, label: str = "e", *, token_latency: float = 0.001, **options: Any
) -> list[SimulatedEngine]:
    """``count`` simulated engines labelled ``{label}0``, ``{label}1``, ...; a token every
    millisecond unless ``token_latency`` says otherwise; ``options`` go to each engine."""
    return [
        SimulatedEngine(f"{label}{i}", token_latency=token_latency, **options) for i in range(count)
    ]


def faulty_engines(count: int, label: str = "f", **options: Any) -> list[FaultyEngine]:
    """``simulated_engines`` each behind a ``FaultyEngine`` (faults armed per call)."""
    return [FaultyEngine(e) for e in simulated_engines(count, label, **options)]


def simulated(engine: object) -> SimulatedEngine:
    """The simulated engine itself, behind an engine host, a fault injector, both, or none."""
    inner = engine.backend if isinstance(engine, EngineHost) else engine
    inner = inner.inner if isinstance(inner, FaultyEngine) else inner
    if not isinstance(inner, SimulatedEngine):
        raise TypeError(f"{engine!r} is not a simulated engine")
    return inner


def received_ops(engine: object) -> list[str]:
    """The names of the calls the engine received as the library made them, in order
    (``calls_received``: the reads that check a call are folded into it)."""
    return [str(e["op"]) for e in calls_received(simulated(engine).history())]


#: The calls that only read an engine (what a check, a probe or a survey sends).
READS = frozenset({"observe", "server_info", "ping", "ready", "model_info"})


def received_changes(engine: object) -> list[str]:
    """``received_ops`` without the reads: the calls that could change the engine."""
    return [op for op in received_ops(engine) if op not in READS]


async def no_push(update: WeightUpdate) -> None:
    """A weight push that writes nothing (the version still changes)."""


def push_reaching(path: str, *ids: str) -> Callable[[WeightUpdate], Awaitable[None]]:
    """A push from disk (``FromDisk(path)``) that reaches the engines ``ids`` alone: what a
    transfer that failed silently on the others leaves behind."""

    async def push(update: WeightUpdate) -> None:
        reached = {k: v for k, v in update.engines.items() if k in ids}
        await FromDisk(path)(WeightUpdate(update.version, reached))

    return push


def pickled_tensors(*names: str) -> list[str]:
    """A ``FromTensor`` payload an SGLang server unpickles without dying (a plain pickle of
    ``(name, values)`` pairs; one TP rank), for simulated engines and the stand-in, which
    digest its text."""
    return [base64.b64encode(pickle.dumps([(name, [0.0]) for name in names])).decode("ascii")]


#: The public calls that bring a server from ``serving`` to each state it can be settled in
#: outside ``failed`` and ``kv_restored`` (which continues as it is reached).
ROUTES: dict[ServerState, tuple[str, ...]] = {
    ServerState.SERVING: (),
    ServerState.DRAINED: ("pause",),
    ServerState.RELEASED: ("offload",),
    ServerState.WEIGHTS_RESTORED: ("offload", "onload_weights"),
}


async def bring_to(server: RolloutServer, state: ServerState) -> None:
    """Bring a serving ``server`` to ``state`` through the public calls of ``ROUTES``."""
    for call in ROUTES[state]:
        await getattr(server, call)()
    if server.state is not state:
        raise AssertionError(f"{ROUTES[state]} left {server.name!r} in {server.state.value!r}")


async def raced_cycle(server: RolloutServer, retries: int = 200, every: float = 0.05) -> str:
    """One offload and onload by a controller racing another over the same engines, as a
    word: ``"cycled"``; ``"claimed"`` (the other held the engines: the offload was refused, or
    the onload ``retries`` times, ``every`` seconds apart); ``"lease lost"``; or ``"refused: "``
    and the outcomes of a phase that failed (its pause found the engines paused, say). A claim
    lasts one call: the other may claim the engines between the two calls, and a refused
    onload sent nothing and left the server released, so it is tried again, as a user would."""
    try:
        await server.offload()
        for _ in range(retries):
            try:
                await server.onload()
                return "cycled"
            except EngineClaimed:
                await asyncio.sleep(every)
        return "claimed"
    except EngineClaimed:
        return "claimed"
    except LeaseLost:
        return "lease lost"
    except PhaseFailed as exc:
        return "refused: " + ", ".join(sorted({o.outcome.value for o in exc.outcomes.values()}))


__all__ = [
    "READS",
    "ROUTES",
    "bring_to",
    "faulty_engines",
    "no_push",
    "pickled_tensors",
    "push_reaching",
    "raced_cycle",
    "received_changes",
    "received_ops",
    "simulated",
    "simulated_engines",
]
