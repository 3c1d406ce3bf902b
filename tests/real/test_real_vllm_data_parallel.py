"""A real vLLM 0.32 server with two data-parallel ranks (``--data-parallel-size 2``: an engine
core process per rank, ``EngineCore_DP0`` and ``_DP1``, and a ``DPCoordinator``, behind one API
server) through the colocated cycle on this CPU: five cycles, each begun with requests decoding
on both ranks (the server's per-engine ``num_requests_running``), lose nothing, and every request
finishes full length on its cycle's version. (vLLM on a CPU cannot show its weights to a
checksum: ``test_real_vllm.py``; these cycles are not verified.) A rank's engine core killed
after an offload that kept requests on both ranks takes the whole server down (vLLM's
engine-core monitor shuts the API server down): the library names it dead, ``recover()`` brings
a whole new server back, and the requests the dead one held are sent to it again and finish."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from real.servers import RealVLLM, RealVLLMServer

from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
)
from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine
from rollout_lifecycle.testing.waits import until

pytestmark = pytest.mark.real_vllm

RANKS = 2
CYCLES = 5
#: Requests per cycle: the API server deals them to the ranks by their load, two each.
REQUESTS = 2 * RANKS
#: Long enough (~200 tokens/s a request here) that a request runs on well past the pause.
TOKENS = 3000
#: The requests of the test that kills a rank: shorter, as they are decoded again from the start.
KILLED_TOKENS = 1000
#: Offloads the kill test may stage before one freezes a request on every rank.
STAGINGS = 5
#: ``/metrics``: requests each engine core runs now (``engine`` is its data-parallel rank).
RUNNING = re.compile(r'^vllm:num_requests_running\{engine="(\d+)"[^}]*\} ([0-9.]+)$', re.M)


@pytest.fixture(scope="module")
def dp_vllm(real_vllm: RealVLLM) -> Iterator[RealVLLMServer]:
    server = RealVLLMServer(real_vllm, extra_args=("--data-parallel-size", str(RANKS)))
    server.start().wait_ready()
    yield server
    server.stop()


def request(i: int, tokens: int = TOKENS) -> dict[str, object]:
    return {
        "input_ids": [1, 2, 3, 4 + i],
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }


async def running_per_rank(url: str) -> dict[int, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"{url}/metrics")).text
    return {int(rank): float(n) for rank, n in RUNNING.findall(text)}


async def on_every_rank(
    url: str, traffic: list[asyncio.Future[Any]], send: Callable[[int], asyncio.Future[Any]]
) -> None:
    """Return once each rank runs a request (a fact, not a sleep). A request that ends first (a
    rank slow to start its share lets the other's finish) keeps its answer in ``traffic`` and
    another is sent in its place, so every rank is reached however fast the ranks run."""
    live = list(range(len(traffic)))  # the positions in ``traffic`` of the requests in play

    async def running() -> bool:
        for slot, i in enumerate(live):
            if traffic[i].done():
                live[slot] = len(traffic)
                traffic.append(send(len(traffic)))
        counts = await running_per_rank(url)
        return sorted(counts) == list(range(RANKS)) and all(counts.values())

    await until(running, deadline=300, every=0.05, what="a request running on every rank")


async def test_five_cycles_with_requests_on_both_ranks_lose_nothing(
    dp_vllm: RealVLLMServer, real_vllm: RealVLLM
) -> None:
    engine = VLLMHTTPEngine(dp_vllm.url)
    server = RolloutServer([EngineGroup("dp", [engine])])
    sent = 0
    try:
        for cycle in range(1, CYCLES + 1):
            version = f"vdp-{cycle}"

            def send(i: int) -> asyncio.Future[Any]:
                return asyncio.ensure_future(server.generate(request(i), "dp"))

            traffic = [send(i) for i in range(REQUESTS)]
            await on_every_rank(dp_vllm.url, traffic, send)
            await server.offload()  # (with a request running on each rank at the last read)
            sent += len(traffic)
            await server.onload_weights()
            await server.update_weights(FromDisk(real_vllm.model), version)
            await server.onload_kv()
            answers = await asyncio.wait_for(asyncio.gather(*traffic), 600)
            assert [len(a["output_ids"]) for a in answers] == [TOKENS] * len(traffic), cycle
            assert await engine.weight_version() == version
        stats = server.generation.stats()
        print(f"{CYCLES} cycles on {RANKS} ranks: {stats}")
        assert (stats["submitted"], stats["completed"], stats["failed"]) == (sent, sent, 0)
        assert server.state is ServerState.SERVING
    finally:
        await engine.close()


async def test_a_rank_killed_mid_cycle_takes_the_server_down_and_recover_brings_a_whole_one(
    dp_vllm: RealVLLMServer, real_vllm: RealVLLM, vllm_servers: list[RealVLLMServer]
) -> None:
    """Beside a single-rank server (the tier's shared one), so that the requests the dead
    server held have an engine to be sent to again (with none alive they would fail at once:
    ``NoLiveEngine``)."""
    engine, other = VLLMHTTPEngine(dp_vllm.url), VLLMHTTPEngine(vllm_servers[1].url)
    made: list[VLLMHTTPEngine] = []
    server = RolloutServer([EngineGroup("dp", [engine, other])])

    def restart(engine_id: str) -> VLLMHTTPEngine:
        dp_vllm.restart()  # every process of the old one stopped, a new one at its address
        made.append(VLLMHTTPEngine(dp_vllm.url))
        return made[-1]

    def send(i: int) -> asyncio.Future[Any]:
        return asyncio.ensure_future(server.generate(request(i, KILLED_TOKENS), "dp"))

    try:
        traffic = [send(i) for i in range(2 * REQUESTS)]  # (about half to each server)
        frozen: dict[int, float] = {}
        for staging in range(1, STAGINGS + 1):
            await on_every_rank(dp_vllm.url, traffic, send)
            await server.offload()  # (the requests kept in the ranks' schedulers, frozen)
            # A rank's last request may have ended between the read and the pause: what the
            # ranks hold frozen now is the fact the kill needs (their schedulers step no more).
            frozen = await running_per_rank(dp_vllm.url)
            if sorted(frozen) == list(range(RANKS)) and all(frozen.values()):
                print(f"requests frozen on every rank at offload {staging}: {frozen}")
                break
            await server.onload()  # (stage it again)
        else:
            pytest.fail(f"no offload of {STAGINGS} froze a request on every rank: {frozen}")
        kept = [job for job in traffic if not job.done()]
        os.kill(dp_vllm.process_titled("EngineCore_DP1"), signal.SIGKILL)
        # vLLM's engine-core monitor shuts the API server down: its port closes
        await until(
            lambda: asyncio.to_thread(_refused, dp_vllm.url),
            deadline=120,
            what="the API server to close its port",
            every=0.2,
        )
        with pytest.raises(PhaseFailed) as failed:
            await server.onload_weights()
        outcome = failed.value.outcomes["dp/0"]
        assert outcome.outcome is Outcome.DEAD, outcome
        assert failed.value.outcomes["dp/1"].ok
        await server.recover(lambda engine_id: asyncio.to_thread(restart, engine_id))
        assert len(made) == 1
        # (the other server resumed its weights before the failure: the fleet settles there)
        assert server.state is ServerState.WEIGHTS_RESTORED
        await server.update_weights(FromDisk(real_vllm.model), "vdp-recovered")
        await server.onload_kv()
        # the requests the dead server held (answered 500 EngineDeadError, or cut off) were
        # sent again to the new one, and finish there full length
        answers = await asyncio.wait_for(asyncio.gather(*traffic), 600)
        assert [len(a["output_ids"]) for a in answers] == [KILLED_TOKENS] * len(traffic)
        stats = server.generation.stats()
        routes = [job.result()["meta_info"]["engines"] for job in kept]
        print(f"a rank killed, {len(kept)} of {len(traffic)} requests kept: {stats}; {routes}")
        assert stats["failed"] == 0
        # every request the dead server kept was sent again, and finished, elsewhere
        held = [r for r in routes if r[0] == "dp/0"]
        assert held and all(len(r) >= 2 for r in held), routes
        assert await made[0].weight_version() == "vdp-recovered"
        assert server.state is ServerState.SERVING
    finally:
        for client in [engine, other, *made]:
            await client.close()


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=5)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False
