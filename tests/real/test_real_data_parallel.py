"""A real SGLang 0.5.23 server with two data-parallel ranks (``--dp-size 2``: a scheduler
process per rank behind one URL, a data-parallel controller between) through the colocated
cycle on this CPU: five cycles with requests decoding on both ranks lose nothing, every request
the retract pause found is retracted and finishes full length, and each cycle's weights are
verified against the trainer's fingerprint (the ranks are replicas: they must agree). A tensor
push, which the server refuses on more than one rank, is refused by the library unsent."""

from __future__ import annotations

import asyncio
import base64
import pickle
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from real.checkpoints import trainer_fingerprint
from real.servers import RealServer, RealSGLang, slowed
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
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
)

pytestmark = pytest.mark.real_sglang

RANKS = 2
#: SGLang binds each rank's OpenMP threads to the cores this names, one ``|``-separated set per
#: rank; unset, it wants a NUMA node per rank and asserts (sglang: numa_utils.py
#: init_threads_binding), and this machine has one.
DP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
CYCLES = 5
#: Requests per cycle: the controller deals them out in turn (round robin), two per rank.
REQUESTS = 2 * RANKS
#: A tensor write's payload (a pickle of named values, as the library's checks want it).
PAYLOAD = [base64.b64encode(pickle.dumps([("w", 1.0)])).decode()]


@pytest.fixture(scope="module")
def dp_server(real_sglang: RealSGLang) -> Iterator[RealServer]:
    server = RealServer(real_sglang, extra_args=("--dp-size", str(RANKS)), extra_env=DP_ENV)
    server.start().wait_ready()
    yield server
    server.stop()


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
