"""Proofs renewed while serving (``LifecycleConfig.renew_proofs``, ``core/renewal``): the pause
after a rollout goes out without a read first, a restart while serving is still found before
anything is sent to the new process, and nothing is read outside ``serving`` or during a call.
Every test runs on virtual time (``looptime``) and reads the engines' histories."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    InvalidArgument,
    LifecycleConfig,
    LifecycleEvent,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
)
from rollout_lifecycle.contract.identity import PROOF_WINDOW
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import no_push
from rollout_lifecycle.testing.fleets import simulated_engines as sims

RENEW = LifecycleConfig(renew_proofs=True)
#: A rollout: many proof windows of serving between the onload and the offload (ending between
#: two rounds, which come every half window).
ROLLOUT_S = 5.25 * PROOF_WINDOW


async def serving(
    config: LifecycleConfig, engines: list[Any] | None = None
) -> tuple[RolloutServer, list[Any]]:
    """A server of ``engines`` (two simulated ones by default) back in ``serving`` after one
    cycle (their incarnations known)."""
    engines = sims(2) if engines is None else engines
    server = RolloutServer([EngineGroup("actor", engines)], config)
    await server.offload()
    await server.onload_weights()
    await server.update_weights(no_push, version="v1")
    await server.onload_kv()
    assert server.state is ServerState.SERVING
    return server, engines


def mark(engines: list[Any]) -> list[int]:
    """Where each engine's history stands now (the simulator's clock is not the loop's)."""
    return [len(e.history()) for e in engines]


def since(engine: SimulatedEngine, at: int) -> list[dict[str, Any]]:
    return engine.history()[at:]


def reads(calls: list[dict[str, Any]], purpose: str) -> int:
    """How many of ``calls`` are reads for ``purpose`` (``check_of``)."""
    return sum(c.get("check_of") == purpose for c in calls)


def ops(calls: list[dict[str, Any]]) -> list[str]:
    """The calls' operations, each read named by what it was for."""
    return [f"read:{c['check_of']}" if "check_of" in c else c["op"] for c in calls]


@pytest.mark.looptime
@pytest.mark.parametrize("renew", [True, False])
async def test_after_a_rollout_the_pause_reads_nothing_first_only_when_renewed(
    renew: bool,
) -> None:
    server, engines = await serving(LifecycleConfig(renew_proofs=renew))
    began = mark(engines)
    await asyncio.sleep(ROLLOUT_S)  # the rollout (virtual time)
    offload = mark(engines)
    await server.offload()
    for engine, b, o in zip(engines, began, offload, strict=True):
        during, after = since(engine, b)[: o - b], since(engine, o)
        if renew:
            # a read every half window while serving ...
            assert ops(during) == ["read:renew"] * int(ROLLOUT_S / (PROOF_WINDOW / 2))
            # ... so that the pause goes out at once
            assert ops(after)[0] == "pause_generation"
        else:
            assert during == []
            assert ops(after)[:2] == ["read:pause_generation", "pause_generation"]
    assert server.state is ServerState.RELEASED


@pytest.mark.looptime
async def test_no_renewal_outside_serving_or_during_a_call() -> None:
    server, engines = await serving(RENEW)
    await server.offload()
    released = mark(engines)
    await asyncio.sleep(ROLLOUT_S)  # training: the server is released
    assert all(since(e, at) == [] for e, at in zip(engines, released, strict=True))
    entered: list[list[int]] = []
    left: list[list[int]] = []

    async def long_hook(event: LifecycleEvent) -> None:
        # (the hooks of the state entered run inside the call, under its lock)
        entered.append(mark(engines))
        await asyncio.sleep(ROLLOUT_S)  # a call that serves for several rounds
        left.append(mark(engines))

    remove = server.on(ServerState.SERVING, long_hook)
    await server.onload()
    remove()
    assert server.state is ServerState.SERVING and entered and left
    assert entered == left  # nothing read while the call ran
    await asyncio.sleep(ROLLOUT_S)  # once it has ended, the rounds read again
    assert all(reads(since(e, at), "renew") >= 4 for e, at in zip(engines, left[0], strict=True))


@pytest.mark.looptime
async def test_a_restart_while_serving_is_not_renewed_and_the_pause_finds_it() -> None:
    old_process, other = sims(2)
    front = FaultyEngine(old_process)  # (refuses the reads while the process is down)
    server, _ = await serving(RENEW, [front, other])
    old = server.snapshot().engines()["actor/0"].incarnation
    # the process goes down: its reads are refused, then a new one answers at the address
    front.arm("server_info", "reject", count=1_000)
    await old_process.restart()  # (PROOF_WINDOW after the old one's last answer)
    front.disarm()
    restarted = mark([old_process, other])
    await asyncio.sleep(ROLLOUT_S)
    # the rounds read the new process and prove nothing by it: the record is unchanged
    assert reads(since(old_process, restarted[0]), "renew") >= 4
    assert server.snapshot().engines()["actor/0"].incarnation == old
    assert any(c["injected"] == "reject" and c.get("check_of") == "renew" for c in front.calls)
    offload = mark([old_process, other])
    with pytest.raises(PhaseFailed) as err:
        await server.offload()
    assert err.value.phase == "pause" and err.value.failed_engines == ["actor/0"]
    assert err.value.outcomes["actor/0"].outcome is Outcome.RESTARTED
    # the pause read the new process first (its incarnation, and the pause state from
    # ``/ping`` and ``/ready``) and was not sent: what follows is the fresh server's own
    # handling, as without renewal ...
    assert ops(since(old_process, offload[0]))[:3] == ["read:pause_generation"] * 3
    # ... while the other engine, renewed, was paused without a read
    assert ops(since(other, offload[1]))[0] == "pause_generation"


def test_renewal_needs_a_proof_window() -> None:
    with pytest.raises(InvalidArgument, match="renew_proofs=True needs a proof_window above 0"):
        LifecycleConfig(renew_proofs=True, proof_window=0)
    with pytest.raises(InvalidArgument, match="renew_proofs"):
        LifecycleConfig(renew_proofs="yes")  # type: ignore[arg-type]
