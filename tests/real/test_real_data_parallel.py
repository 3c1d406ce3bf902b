"""A real SGLang 0.5.23 server with two data-parallel ranks (``--dp-size 2``: a scheduler
process per rank behind one URL, a data-parallel controller between) through the colocated
cycle on this CPU: five cycles with requests decoding on both ranks lose nothing, every request
the retract pause found is retracted and finishes full length, and each cycle's weights are
verified against the trainer's fingerprint (the ranks are replicas: they must agree). A tensor
push, which the server refuses on more than one rank, is refused by the library unsent. A rank's
process killed mid-cycle leaves the server half-alive (its front end answers ``/ping``, every call
that needs the ranks hangs): the library names it unhealthy before it sends it anything, and
``recover()`` brings a whole new server back, the requests it held resubmitted and finished."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from real.checkpoints import trainer_fingerprint
from real.servers import DP_RANKS, RealServer, RealServerPool, RealSGLang, slowed
from real.test_real_lifecycle import (
    SLOW_STEP_S,
    TOKENS,
    admitted,
    assert_full,
    assert_invariants,
    assert_retracted,
    assert_serving,
    post_generate,
    request,
)

from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    FromTensor,
    IllegalEngineOp,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
)

pytestmark = pytest.mark.real_sglang

RANKS = DP_RANKS
CYCLES = 5
#: Requests per cycle: the controller deals them out in turn (round robin), two per rank.
REQUESTS = 2 * RANKS
#: A tensor write's payload (a pickle of named values, as the library's checks want it).
PAYLOAD = [base64.b64encode(pickle.dumps([("w", 1.0)])).decode()]


@pytest.fixture(scope="module", autouse=True)
def _dropped_after(real_pool: RealServerPool) -> Iterator[None]:
    """The module's two-rank server is stopped when it ends: kept, its memory (with the pool's
    and the servers the next modules start) left Ray's memory monitor killing their actors."""
    yield
    real_pool.drop_data_parallel()


@pytest.fixture
def dp_server(real_pool: RealServerPool) -> Iterator[RealServer]:
    """The pool's two-rank server (the wire suite's lifecycle scenarios start it again), frozen
    between uses."""
    yield real_pool.data_parallel()
    real_pool.park_data_parallel()


async def test_five_cycles_with_requests_on_both_ranks_lose_nothing_and_verify_the_weights(
    dp_server: RealServer, real_sglang: RealSGLang
) -> None:
    url, model = dp_server.url, real_sglang.model
    expected = await asyncio.to_thread(trainer_fingerprint, real_sglang, model, "sglang")
    engine = SGLangHTTPEngine(url)
    # the timeline keeps every call of the five cycles, for the invariants' check at the end
    config = LifecycleConfig(timeline_calls=4 * CYCLES)
    server = RolloutServer([EngineGroup("dp", [engine])], config)
    started, answered = time.monotonic(), 0
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            for cycle in range(1, CYCLES + 1):
                version = f"dp-v{cycle}"
                async with slowed([url], SLOW_STEP_S):
                    traffic = [
                        asyncio.ensure_future(post_generate(client, url, request(10 * cycle + i)))
                        for i in range(REQUESTS)
                    ]
                    await admitted([url], traffic)
                    await server.offload()
                    unanswered = [i for i, r in enumerate(traffic) if not r.done()]
                    await server.onload_weights()
                    await server.update_weights(FromDisk(model), version, expected=expected)
                    await server.onload_kv()
                answers: list[dict[str, Any]] = await asyncio.wait_for(
                    asyncio.gather(*traffic), timeout=600
                )
                answered += len(answers)
                assert_full(answers, TOKENS)
                assert_retracted(answers, unanswered)
                assert sorted(a["meta_info"]["dp_rank"] for a in answers) == [0, 0, 1, 1]
                assert {a["meta_info"]["weight_version"] for a in answers} == {version}
                record = server.snapshot().engines()["dp/0"]
                assert not record.unverified and record.capabilities is not None
                assert record.capabilities["ranks"] == RANKS
                assert record.capabilities["worker_type"] == "regular"
        print(f"{answered} answered of {CYCLES * REQUESTS}, {time.monotonic() - started:.0f} s")
        assert answered == CYCLES * REQUESTS
        assert server.state is ServerState.SERVING
        assert_invariants(server, cycles=CYCLES)
        await assert_serving(dp_server, f"dp-v{CYCLES}")
    finally:
        await engine.close()


async def test_a_tensor_push_is_refused_unsent_and_the_server_answers_500_to_one_sent_raw(
    dp_server: RealServer,
) -> None:
    """The library knows from ``/server_info`` (``dp_size: 2``) what the server refuses and
    sends nothing; the same write sent by hand gets SGLang's 500 (an assert in its tokenizer
    manager), and the server stays up and unchanged."""
    engine = SGLangHTTPEngine(dp_server.url)
    server = RolloutServer([EngineGroup("dp", [engine])])
    try:
        before = await engine.weight_version()
        await server.pause()
        with pytest.raises(IllegalEngineOp, match=r"data-parallel SGLang server \(dp_size 2\)"):
            await server.update_weights(FromTensor(PAYLOAD), "never")
        await server.resume()
        async with httpx.AsyncClient(base_url=dp_server.url, timeout=60) as raw:
            answer = await raw.post(
                "/update_weights_from_tensor",
                json={"serialized_named_tensors": PAYLOAD, "flush_cache": False},
            )
            assert (answer.status_code, answer.text) == (500, "Internal Server Error")
        assert await engine.weight_version() == before
        await assert_serving(dp_server, before or "")
    finally:
        await engine.close()


async def test_a_rank_killed_mid_cycle_is_named_unhealthy_and_recover_brings_a_whole_new_server(
    dp_server: RealServer, real_servers: list[RealServer], real_sglang: RealSGLang
) -> None:
    """A fleet of a single-rank server and the two-rank one, six requests decoding through the
    library's generation client; after the offload the scheduler of rank 1 is killed. The
    resume names the two-rank server dead (unhealthy: it answers ``/ping``, its ranks do not),
    and nothing is sent to it; ``recover()`` replaces it by a whole new server at its address
    (every process of the old one stopped), whose weights are then pushed and verified with
    the other's; every request, those the half-alive server held included, finishes full
    length."""
    shared, model = real_servers[0], real_sglang.model
    urls = [shared.url, dp_server.url]
    expected = await asyncio.to_thread(trainer_fingerprint, real_sglang, model, "sglang")
    engines = [SGLangHTTPEngine(url) for url in urls]
    made: list[SGLangHTTPEngine] = []
    server = RolloutServer([EngineGroup("actor", engines)])

    def restart(engine_id: str) -> SGLangHTTPEngine:
        assert engine_id == "actor/1"
        # the paused single-rank server busy-polls a core: frozen while the new one starts
        dp_server.restart(hold=[shared])
        made.append(SGLangHTTPEngine(dp_server.url))
        return made[-1]

    try:
        async with slowed(urls, SLOW_STEP_S):
            traffic = [
                asyncio.ensure_future(server.generation.generate(request(40 + i))) for i in range(6)
            ]
            await admitted(urls, traffic)
            await server.offload()
        os.kill(dp_server.process_titled("sglang::scheduler_DP1"), signal.SIGKILL)
        with pytest.raises(PhaseFailed) as failed:
            await server.onload_weights()
        outcomes = failed.value.outcomes
        assert outcomes["actor/0"].ok, outcomes
        half = outcomes["actor/1"]
        assert half.outcome is Outcome.DEAD, half
        assert half.detail.startswith("unhealthy: the server answers /ping"), half.detail
        assert "each of its 2 data-parallel ranks" in half.detail
        assert dp_server.alive()  # half-alive: its launcher and front end live on
        assert not any(t.done() for t in traffic)
        await server.recover(lambda engine_id: asyncio.to_thread(restart, engine_id))
        assert len(made) == 1 and server.state is ServerState.WEIGHTS_RESTORED
        await server.update_weights(FromDisk(model), "dp-recovered", expected=expected)
        await server.onload_kv()
        answers = await asyncio.wait_for(asyncio.gather(*traffic), timeout=600)
        assert_full(answers, TOKENS)
        resubmitted = [a["meta_info"].get("num_resubmissions", 0) for a in answers]
        print(f"{len(answers)} of {len(traffic)} answered; resubmissions {resubmitted}")
        assert sum(resubmitted) >= 1  # (the requests the old two-rank server held)
        records = server.snapshot().engines()
        assert all(r.alive and not r.stale and not r.unverified for r in records.values())
        assert records["actor/1"].capabilities is not None
        assert records["actor/1"].capabilities["ranks"] == RANKS
        await assert_serving(dp_server, "dp-recovered")
        await assert_serving(shared, "dp-recovered")
    finally:
        server.generation.close()
        for engine in [*engines, *made]:
            await engine.close()
