"""A data-parallel SGLang server (``--dp-size N``: N scheduler processes behind one URL) refuses
tensor and collective weight writes (sglang: tokenizer_control_mixin.py, an assert on
``dp_size == 1`` answered with a 500). The SGLang driver reads ``dp_size`` from ``/server_info``
with the incarnation and declares so (``data_parallel``), so the lifecycle refuses such a push
before anything is sent, and says why; the stand-in and the simulator report ``dp_size`` and
refuse those writes as the server does.

A data-parallel server one of whose rank processes died lives on half: its front end answers
``/ping``, and every call that needs the ranks waits for ever. The driver names it unhealthy
(``EngineUnhealthy``, counted dead) from a ``/server_info`` that does not answer while
``/ping`` does, before any lifecycle call is sent to it, and ``recover()`` replaces it whole;
a single-rank server whose ``/server_info`` is slow is only timed out."""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import Iterator

import pytest

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    EngineTimeout,
    EngineUnhealthy,
    FromDisk,
    FromDistributed,
    FromTensor,
    HTTPTimeouts,
    IllegalEngineOp,
    InvalidArgument,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
)
from rollout_lifecycle.backends.engine import EngineHost
from rollout_lifecycle.backends.sglang.client import SGLANG_CAPABILITIES, data_parallel
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.exceptions import EngineError
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.testing.simulated import SimulatedEngine
from rollout_lifecycle.testing.standin import StandInServer

PAYLOAD = [base64.b64encode(pickle.dumps([("w", 1.0)])).decode()]
TENSORS = FromTensor(PAYLOAD)
COLLECTIVE = FromDistributed(["w"], ["float32"], [[1]], "g")
WRITES = ("begin_weight_update", "update_weights_from_tensor", "update_weights_from_distributed")


@pytest.fixture
def dp_standin() -> Iterator[StandInServer]:
    server = StandInServer(token_latency=0.001, dp_size=2).start()
    yield server
    server.stop()


def sent_writes(server: StandInServer) -> list[str]:
    return [e["op"] for e in server.history() if e["op"] in WRITES]


async def test_the_driver_reads_the_ranks_with_the_incarnation_and_narrows_its_writes(
    dp_standin: StandInServer,
) -> None:
    client = SGLangHTTPEngine(dp_standin.url)
    try:
        assert client.capabilities is SGLANG_CAPABILITIES  # nothing read yet: one rank
        seen = await EngineHost(client).observe(paused=False, identify=True)
        declared = Capabilities.from_wire(seen["capabilities"])
        assert declared == data_parallel(2) and declared.ranks == 2
        assert declared.weight_writes == {Op.UPDATE_FROM_DISK}
        assert "dp_size 2" in declared.writes_limited_by
    finally:
        await client.close()


async def test_a_tensor_or_collective_push_to_a_data_parallel_server_is_refused_unsent(
    dp_standin: StandInServer,
) -> None:
    """Refused by the lifecycle before the write's first call, naming the engine, what the
    push sends and why the server cannot take it; the same fleet takes a push from disk."""
    client = SGLangHTTPEngine(dp_standin.url)
    server = RolloutServer([EngineGroup("dp", [client])])
    try:
        await server.pause()
        for push, op in ((TENSORS, "tensor"), (COLLECTIVE, "distributed")):
            with pytest.raises(IllegalEngineOp) as refused:
                await server.update_weights(push, "v1")
            assert refused.value.engine == "dp/0"
            assert f"sends ['update_weights_from_{op}']" in refused.value.reason
            assert "a data-parallel SGLang server (dp_size 2) refuses" in refused.value.reason
        assert sent_writes(dp_standin) == []
        assert server.state is ServerState.DRAINED
        await server.update_weights(FromDisk("/models/next"), "v1")
        await server.resume()
        assert await client.weight_version() == "v1"
        # its two ranks answer /weights_checker each, with the same weights: one fingerprint
        tensors = (await client.weight_fingerprint())["tensors"]
        assert tensors and not any(name.startswith(("dp", "tp")) for name in tensors)
    finally:
        await client.close()


async def test_the_client_alone_refuses_what_it_knows_the_server_refuses(
    dp_standin: StandInServer,
) -> None:
    """Once the attach check has read ``/server_info``, the client refuses a tensor write
    unsent; a client that has read nothing sends it, and the server answers with its 500 and
    stays up (the stand-in as SGLang 0.5.23)."""
    payload = PAYLOAD
    knows = SGLangHTTPEngine(dp_standin.url)
    blind = SGLangHTTPEngine(dp_standin.url, check_version=False)
    try:
        await knows.begin_weight_update()
        with pytest.raises(IllegalEngineOp, match="dp_size 2") as refused:
            await knows.update_weights_from_tensor(
                payload, weight_version="v1", flush_cache=False, abort_all_requests=False
            )
        assert refused.value.op == "update_weights_from_tensor"
        assert "update_weights_from_tensor" not in sent_writes(dp_standin)
        with pytest.raises(EngineError, match="answered 500"):
            await blind.update_weights_from_tensor(
                payload, weight_version="v1", flush_cache=False, abort_all_requests=False
            )
        await knows.end_weight_update()
        assert await asyncio.to_thread(dp_standin.alive)
    finally:
        await knows.close()
        await blind.close()


async def test_the_simulator_declares_and_refuses_as_a_data_parallel_server() -> None:
    engine = SimulatedEngine("dp", dp_size=2, token_latency=0.001)
    assert engine.capabilities.ranks == 2
    assert engine.capabilities.weight_writes == {Op.UPDATE_FROM_DISK}
    assert engine.capabilities.family == "simulated"
    assert SimulatedEngine("one").capabilities.ranks == 1
    assert (await engine.server_info())["dp_size"] == 2
    server = RolloutServer([EngineGroup("dp", [engine])])
    await server.pause()
    with pytest.raises(IllegalEngineOp, match="dp_size 2"):
        await server.update_weights(TENSORS, "v1")
    assert not [e for e in engine.history() if e["op"] in WRITES]


#: A probe timeout short enough for a test: the whole-server read gets half of it.
QUICK = HTTPTimeouts(probe=1.0)


def after(history: list[dict[str, object]], op: str) -> list[str]:
    """The ops the engine took after its first ``op``."""
    ops = [str(e["op"]) for e in history]
    return ops[ops.index(op) + 1 :]


def assert_unhealthy(failed: PhaseFailed) -> None:
    (outcome,) = failed.outcomes.values()
    assert outcome.outcome is Outcome.DEAD, outcome
    assert outcome.detail.startswith("unhealthy: the server answers /ping"), outcome.detail
    assert "each of its 2 data-parallel ranks" in outcome.detail


async def test_a_server_that_lost_a_rank_is_named_unhealthy_unsent_and_recovered_whole(
    dp_standin: StandInServer,
) -> None:
    client = SGLangHTTPEngine(dp_standin.url, timeouts=QUICK)
    fresh = StandInServer(token_latency=0.001, dp_size=2).start()
    made: list[SGLangHTTPEngine] = []
    server = RolloutServer([EngineGroup("dp", [client])])
    try:
        await server.offload()
        await asyncio.to_thread(dp_standin.lose_rank, 1)
        with pytest.raises(PhaseFailed) as failed:
            await server.onload_weights()
        assert_unhealthy(failed.value)
        assert server.state is ServerState.FAILED
        record = server.snapshot().engines()["dp/0"]
        assert not record.alive and record.last_outcome.startswith("dead (unhealthy")
        # nothing but the reads that found it: no resume reached the half-alive server
        taken = after(await asyncio.to_thread(dp_standin.history), "lose_rank")
        assert set(taken) <= {"server_info", "ping", "ready"}, taken

        def factory(engine_id: str) -> SGLangHTTPEngine:
            made.append(SGLangHTTPEngine(fresh.url, timeouts=QUICK))
            return made[-1]

        outcomes = await server.recover(factory)
        assert outcomes["dp/0"].ok and len(made) == 1
        # a whole new server, held out of serving until it has the fleet's weights
        assert server.snapshot().engines()["dp/0"].stale
        assert (await asyncio.to_thread(fresh.state))["paused"] is True
        await server.offload()
        await server.onload_weights()
        await server.update_weights(FromDisk("/models/next"), "v2")
        await server.onload_kv()
        assert server.state is ServerState.SERVING
        assert (await asyncio.to_thread(fresh.state))["paused"] is False
        assert await made[0].weight_version() == "v2"
    finally:
        await client.close()
        for engine in made:
            await engine.close()
        fresh.stop()


async def test_a_single_rank_server_slow_to_answer_its_state_is_timed_out_not_unhealthy(
    dp_standin: StandInServer,
) -> None:
    """Only a server of several ranks has a part that can be gone while the rest answers."""
    one = StandInServer(token_latency=0.001).start()
    clients = [SGLangHTTPEngine(url, timeouts=QUICK) for url in (one.url, dp_standin.url)]
    try:
        for client in clients:
            await client.server_info()  # (the attach read: the ranks are known)
        await asyncio.to_thread(one.inject, {"path": "/server_info", "kind": "delay", "seconds": 3})
        await asyncio.to_thread(dp_standin.lose_rank, 0)
        with pytest.raises(EngineTimeout) as slow:
            await clients[0].server_info()
        assert not isinstance(slow.value, EngineUnhealthy)
        with pytest.raises(EngineUnhealthy) as half:
            await EngineHost(clients[1]).observe(paused=True, identify=False)
        assert (half.value.ranks, half.value.waited) == (2, 0.5)
    finally:
        for client in clients:
            await client.close()
        one.stop()


async def test_the_simulator_that_lost_a_rank_is_unhealthy_and_recovered_whole() -> None:
    engine = SimulatedEngine("dp", dp_size=2, token_latency=0.001)
    server = RolloutServer([EngineGroup("dp", [engine])])
    await server.offload()
    engine.lose_rank(1)
    with pytest.raises(PhaseFailed) as failed:
        await server.onload_weights()
    assert_unhealthy(failed.value)
    assert after(engine.history(), "lose_rank") == ["observe"]
    replacement = SimulatedEngine("dp-new", dp_size=2, token_latency=0.001)
    assert (await server.recover(lambda _id: replacement))["dp/0"].ok
    assert replacement.paused  # held until it has the fleet's weights
    await server.pause()
    await server.update_weights(FromDisk("/models/next"), "v2")
    await server.resume()
    assert server.state is ServerState.SERVING and not replacement.paused
    with pytest.raises(Exception, match="rank must be one of the 2 ranks"):
        engine.lose_rank(2)


@pytest.mark.looptime
async def test_a_rank_slower_to_pause_holds_the_fleet_back_and_past_the_deadline_is_named() -> None:
    """A simulated two-rank server one of whose ranks is slow answers each call that waits for
    every rank that much later (``SimulatedEngine.slow_rank``): within the pause deadline the
    offload waits for it, no engine released before its pause answered; past it the pause is
    named timed out and nothing is released anywhere (virtual time)."""
    dp = SimulatedEngine("dp", dp_size=2, token_latency=0.001)
    single = SimulatedEngine("one", token_latency=0.001)
    config = LifecycleConfig(deadlines=Deadlines(pause=5.0))
    server = RolloutServer([EngineGroup("actor", [single, dp])], config)
    dp.slow_rank(1, 2.0)  # (twice within the deadline: the read that checks the pause waits too)
    await server.offload()
    paused = next(e["end"] for e in dp.history() if e["op"] == "pause_generation")
    released = [e["start"] for e in single.history() if e["op"] == "release_memory_occupation"]
    assert released and min(released) >= paused  # the slow rank held every release back
    await server.onload()
    dp.slow_rank(1, 8.0)  # past the pause deadline
    releases = [str(e["op"]) for e in single.history()].count("release_memory_occupation")
    with pytest.raises(PhaseFailed) as failed:
        await server.offload()
    assert failed.value.outcomes["actor/1"].outcome is Outcome.TIMED_OUT
    ops = [str(e["op"]) for e in single.history()]
    assert ops.count("release_memory_occupation") == releases  # none sent this time
    dp.slow_rank(1, 0)
    with pytest.raises(Exception, match="seconds must be a number >= 0"):
        dp.slow_rank(1, -1)


async def test_a_stand_in_rank_slower_to_pause_delays_what_waits_for_every_rank(
    dp_standin: StandInServer,
) -> None:
    client = SGLangHTTPEngine(dp_standin.url)
    try:
        await asyncio.to_thread(dp_standin.slow_rank, 1, 0.2)
        await client.pause_generation("retract")
        await client.weight_version()  # answered by the front end alone
        await asyncio.to_thread(dp_standin.slow_rank, 1, 0)
        await client.continue_generation()
        found = {
            str(e["op"]): e.get("detail")
            for e in await asyncio.to_thread(dp_standin.history)
            if e["op"] in ("pause_generation", "weight_version", "continue_generation")
        }
        assert found == {
            "pause_generation": "waits for slow rank 1",
            "weight_version": None,
            "continue_generation": None,
        }
        with pytest.raises(InvalidArgument, match="rank must be one of the 2 ranks, got 2"):
            await asyncio.to_thread(dp_standin.slow_rank, 2, 0.1)
    finally:
        await client.close()
