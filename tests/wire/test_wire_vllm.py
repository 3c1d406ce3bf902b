"""vLLM 0.32.0's contract, side by side: each scenario runs on the vLLM stand-in and on the keyless
real vLLM server (``real_vllm``), with the same assertions, through the library's client
(``VLLMHTTPEngine``) and raw calls. A scenario waits on facts (a streamed token), never on time.
The stand-in-only scenarios at the end show what a CPU server cannot: the memory ``/sleep``
frees, the weights a level-2 sleep loses, the weight-transfer session, and the death on the
forward pass after a failed reload.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from wire.conftest import contract_model_dir, vllm_standin
from wire.helpers import CALL_TIMEOUT, Streamed, VLLMTarget, through_a_stall

from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine
from rollout_lifecycle.contract.exceptions import EngineRejected, IllegalEngineOp
from rollout_lifecycle.contract.values import PauseMode, Tag
from rollout_lifecycle.testing.standin import DEATH_EXIT_CODE, VLLMStandInServer
from rollout_lifecycle.testing.waits import until

NOT_CONFIGURED = "Weight transfer not configured"


@pytest.fixture
async def client(vllm_target: VLLMTarget) -> AsyncIterator[VLLMHTTPEngine]:
    engine = VLLMHTTPEngine(vllm_target.url)
    yield engine
    await engine.close()


@pytest.fixture
async def raw(vllm_target: VLLMTarget) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=vllm_target.url, timeout=CALL_TIMEOUT, trust_env=False
    ) as http:
        yield http


async def is_paused(raw: httpx.AsyncClient) -> bool:
    paused: bool = (await raw.get("/is_paused")).json()["is_paused"]
    return paused


def short(tokens: int = 4) -> dict[str, object]:
    return {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": tokens}}


# ------------------------------------------------------------------ side by side


async def test_the_attach_check_reads_the_version_and_the_pause_routes(
    client: VLLMHTTPEngine, raw: httpx.AsyncClient
) -> None:
    assert await client.check_version() == "0.32.0"
    found = await client.observe()
    assert found["paused"] is False and isinstance(found["incarnation"], str)
    assert (await raw.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    assert await is_paused(raw)
    assert (await raw.post("/resume")).json() == {"status": "resumed"}
    assert not await is_paused(raw)


async def test_a_keep_pause_freezes_a_running_request_and_it_ends_full_length_after_resume(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine, raw: httpx.AsyncClient
) -> None:
    stream = await Streamed(vllm_target.url, vllm_target.tokens).started()
    await client.pause_generation(PauseMode.RETRACT)  # /pause?mode=keep
    assert await is_paused(raw) and not stream.done.done()
    await client.continue_generation()
    assert await stream.result() == ("length", vllm_target.tokens)


async def test_a_wait_pause_answers_once_the_running_request_has_ended_full_length(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine, raw: httpx.AsyncClient
) -> None:
    stream = await Streamed(vllm_target.url, vllm_target.tokens).started()
    await client.pause_generation(PauseMode.WAIT)  # /pause?mode=wait
    assert await is_paused(raw)
    # Nothing holds a KV block when it answers: the flush a running request refuses passes.
    assert (await raw.post("/reset_prefix_cache")).json() == {"success": True}
    assert await stream.result() == ("length", vllm_target.tokens), "ended without a resume"
    await client.continue_generation()


async def test_a_request_sent_during_a_wait_pause_is_queued_until_the_resume(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine, raw: httpx.AsyncClient
) -> None:
    running = await Streamed(vllm_target.url, vllm_target.tokens).started()
    pausing = asyncio.ensure_future(client.pause_generation(PauseMode.WAIT))
    await until(lambda: is_paused(raw), what="the wait pause to begin", deadline=CALL_TIMEOUT)
    late = Streamed(vllm_target.url, 8)
    await asyncio.wait_for(pausing, CALL_TIMEOUT)
    assert await running.result() == ("length", vllm_target.tokens)
    assert not late.decoding.is_set(), "a request sent while draining is queued, not run"
    await client.continue_generation()
    assert await late.result() == ("length", 8)


async def test_an_abort_pause_answers_the_running_request_with_its_partial_output(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine
) -> None:
    stream = await Streamed(vllm_target.url, vllm_target.tokens).started()
    await client.pause_generation(PauseMode.ABORT)
    reason, tokens = await stream.result()
    assert reason == "abort" and 0 < tokens < vllm_target.tokens
    await client.continue_generation()


async def test_the_flush_is_refused_while_a_request_holds_blocks_and_accepted_once_paused(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine, raw: httpx.AsyncClient
) -> None:
    stream = await Streamed(vllm_target.url, vllm_target.tokens).started()
    assert (await raw.post("/reset_prefix_cache")).json() == {"success": False}
    with pytest.raises(EngineRejected, match="success=false") as refused:
        await client.flush_cache(0)
    assert refused.value.status == 400
    await client.pause_generation(PauseMode.RETRACT)
    assert (await raw.post("/reset_prefix_cache")).json() == {"success": True}
    await client.flush_cache(0)
    assert not stream.done.done()
    await client.continue_generation()
    assert await stream.result() == ("length", vllm_target.tokens)


async def test_a_sleep_then_a_wake_of_the_weights_stays_paused_and_the_kv_wake_continues(
    vllm_target: VLLMTarget, raw: httpx.AsyncClient
) -> None:
    """A request kept through the sleep: the weights' wake leaves the engine paused and the
    request frozen; the KV cache's wake makes it whole, resumes it, and the request ends."""
    stream = await Streamed(vllm_target.url, vllm_target.tokens).started()
    await raw.post("/pause", params={"mode": "keep"})
    slept = await raw.post("/sleep", params={"level": 1, "mode": "keep"})
    assert slept.json() == {"status": "sleeping", "level": 1}
    metrics = (await raw.get("/metrics")).text
    assert 'sleep_state="awake"} 0.0' in metrics
    assert 'sleep_state="weights_offloaded"} 1.0' in metrics
    assert (await raw.get("/is_sleeping")).json() == {"is_sleeping": True}
    woke = await raw.post("/wake_up", params={"tags": "weights"})
    assert woke.json() == {"status": "sleeping", "tags": ["weights"]}
    assert await is_paused(raw) and not stream.done.done()
    woke = await raw.post("/wake_up", params={"tags": "kv_cache"})
    assert woke.json() == {"status": "awake", "tags": ["kv_cache"]}
    assert not await is_paused(raw)
    assert 'sleep_state="awake"} 1.0' in (await raw.get("/metrics")).text
    assert await stream.result() == ("length", vllm_target.tokens)


async def test_a_failed_reload_leaves_the_engine_alive_and_the_client_refuses_a_forward_pass(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine, raw: httpx.AsyncClient
) -> None:
    await client.pause_generation(PauseMode.RETRACT)
    try:
        with pytest.raises(EngineRejected, match="/no/such/checkpoint") as failed:
            await client.update_weights_from_disk(
                "/no/such/checkpoint", weight_version=None, flush_cache=False,
                abort_all_requests=False,
            )  # fmt: skip
        assert failed.value.status == 500
        assert "unusable until a reload succeeds" in str(failed.value)
        for refused in (
            client.continue_generation(),
            client.generate(short()),
            client.resume_memory_occupation([Tag.KV_CACHE]),
        ):
            with pytest.raises(IllegalEngineOp, match="a reload failed"):
                await refused
        assert await client.ping() and await is_paused(raw)  # alive, nothing ran
        assert not vllm_target.exited(0)
    finally:
        # A good reload makes the weights whole again (the real server must not die).
        await client.update_weights_from_disk(
            vllm_target.model_path, weight_version=None, flush_cache=True,
            abort_all_requests=False,
        )  # fmt: skip
    assert client.broken is None
    await client.continue_generation()
    assert len((await client.generate(short()))["output_ids"]) == 4


async def test_a_weight_version_set_is_the_version_read_back(
    client: VLLMHTTPEngine, raw: httpx.AsyncClient
) -> None:
    for version in (f"contract-{uuid.uuid4().hex[:8]}", "contract-second"):
        answer = await raw.post("/update_weight_version", json={"new_version": version})
        assert answer.json() == {"success": True, "new_version": version}
        assert (await raw.get("/weight_info")).json() == {"weight_version": version}
        assert await client.weight_version() == version
    await client.update_weight_version("contract-client", abort_all_requests=False)
    assert await client.weight_version() == "contract-client"


async def test_an_abort_by_request_id_ends_that_request_and_no_other(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine
) -> None:
    rids = [f"by-id-{uuid.uuid4().hex[:8]}-{i}" for i in (0, 1)]
    streams = [Streamed(vllm_target.url, vllm_target.tokens, rid) for rid in rids]
    for stream in streams:
        await stream.started()
    await client.abort_request(rids[0])  # {"request_ids": ["cmpl-<rid>-0"]}
    reason, tokens = await streams[0].result()
    assert reason == "abort" and 0 < tokens < vllm_target.tokens
    assert await streams[1].result() == ("length", vllm_target.tokens)


async def test_a_call_the_client_may_not_repeat_survives_a_stall_past_the_keep_alive(
    vllm_target: VLLMTarget, client: VLLMHTTPEngine
) -> None:
    """vLLM's server runs uvicorn on uvloop too (``entrypoints/cli/serve.py``
    ``uvloop.run(run_server(args))``): a stall past its keep-alive must not drop a call the
    client sends once (an abort here; a sleep or a wake in a lifecycle step)."""
    await through_a_stall(vllm_target, client)


async def test_the_weight_update_session_answers_500_without_a_weight_transfer_config(
    vllm_target: VLLMTarget,
) -> None:
    for path, body in (("/start_weight_update", None), ("/finish_weight_update", {})):
        # vLLM drops the connection behind such a 500: each call gets a connection of its own.
        async with httpx.AsyncClient(base_url=vllm_target.url, timeout=CALL_TIMEOUT) as once:
            answer = await once.post(path, json=body)
        assert answer.status_code == 500 and NOT_CONFIGURED in answer.text, (path, answer.text)
    session = VLLMHTTPEngine(vllm_target.url, weight_transfer=True)
    try:
        with pytest.raises(EngineRejected, match=NOT_CONFIGURED):
            await session.begin_weight_update()
    finally:
        await session.close()


# ------------------------------------------------------------------ stand-in only


@pytest.fixture
def standin() -> Iterator[VLLMStandInServer]:
    """A vLLM stand-in this test owns (it may kill it)."""
    server = vllm_standin()
    try:
        yield server
    finally:
        server.stop()


async def test_the_key_guards_the_openai_routes_and_no_lifecycle_route() -> None:
    server = vllm_standin(api_key="contract-key")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=CALL_TIMEOUT) as raw:
            assert (await raw.post("/v1/completions", json={"prompt": [1]})).status_code == 401
            assert (await raw.post("/pause", params={"mode": "keep"})).status_code == 200
            assert (await raw.post("/resume")).status_code == 200
        keyed = VLLMHTTPEngine(server.url, api_key="contract-key")
        assert len((await keyed.generate(short()))["output_ids"]) == 4
        await keyed.close()
    finally:
        server.stop()


async def test_a_level_1_sleep_moves_the_weights_to_host_memory_and_frees_the_kv_cache(
    standin: VLLMStandInServer,
) -> None:
    engine = VLLMHTTPEngine(standin.url)
    try:
        before = standin.memory()
        assert before["device"]["weights"] > 0 and before["device"]["kv_cache"] > 0
        first = await engine.generate(short(8))
        await engine.pause_generation(PauseMode.RETRACT)
        await engine.release_memory_occupation([Tag.WEIGHTS, Tag.KV_CACHE])  # level 1
        asleep = standin.memory()
        assert asleep["device"]["weights"] == asleep["device"]["kv_cache"] == 0
        assert asleep["host"]["weights"] == before["device"]["weights"]
        await engine.resume_memory_occupation([Tag.WEIGHTS, Tag.KV_CACHE])
        await engine.continue_generation()
        assert standin.memory() == before
        assert (await engine.generate(short(8)))["output_ids"] == first["output_ids"]
    finally:
        await engine.close()


async def test_a_level_2_sleep_drops_the_weights_and_a_wake_without_a_push_serves_garbage(
    standin: VLLMStandInServer,
) -> None:
    """vLLM keeps only the buffers through a level-2 sleep (``Worker.sleep``): woken without a
    push, the weights are not the old ones (other checksums, other output) until a reload. The
    client refuses what would serve them; sent past it, the engine serves garbage."""
    engine = VLLMHTTPEngine(standin.url, sleep_level=2)
    try:
        sums, first = (
            (await engine.weight_fingerprint())["tensors"],
            await engine.generate(short(8)),
        )
        assert await raw_output(standin.url) == first["output_ids"]  # the same request
        await engine.pause_generation(PauseMode.RETRACT)
        await engine.release_memory_occupation([Tag.WEIGHTS, Tag.KV_CACHE])
        asleep = standin.memory()
        assert asleep["device"]["weights"] == 0 and asleep["host"]["weights"] == 0
        await engine.resume_memory_occupation([Tag.WEIGHTS])
        for refused in (
            engine.resume_memory_occupation([Tag.KV_CACHE]),
            engine.continue_generation(),
            engine.generate(short(8)),
        ):
            with pytest.raises(IllegalEngineOp, match="level-2 sleep discarded them"):
                await refused
        async with httpx.AsyncClient(base_url=standin.url, timeout=30) as raw:
            await raw.post("/wake_up", params={"tags": "kv_cache"})
            await raw.post("/resume")
        assert (await engine.weight_fingerprint())["tensors"] != sums
        assert await raw_output(standin.url) != first["output_ids"]
        await engine.pause_generation(PauseMode.RETRACT)
        await engine.update_weights_from_disk(
            contract_model_dir(), weight_version="pushed", flush_cache=True,
            abort_all_requests=False,
        )  # fmt: skip
        await engine.continue_generation()
        assert (await engine.weight_fingerprint())["tensors"] == sums
        assert (await engine.generate(short(8)))["output_ids"] == first["output_ids"]
    finally:
        await engine.close()


async def raw_output(url: str) -> list[int]:
    """The tokens a short greedy completion sent past the client comes back with."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as raw:
        answer = await raw.post(
            "/v1/completions",
            json={"prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True},
        )  # fmt: skip
        answer.raise_for_status()
        return list(answer.json()["choices"][0]["token_ids"])


async def test_a_weight_transfer_session_sets_new_weights_and_its_version() -> None:
    server = vllm_standin(weight_transfer=True)
    engine = VLLMHTTPEngine(server.url, weight_transfer=True)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=CALL_TIMEOUT) as raw:
            before = (await engine.weight_fingerprint())["tensors"]
            init = await raw.post("/init_weight_transfer_engine", json={"init_info": {}})
            assert init.status_code == 200, init.text
            chunk = {"update_info": {"names": ["lm_head.weight"]}}
            early = await raw.post("/update_weights", json=chunk)
            assert early.status_code == 500 and "must be called before" in early.text
            await engine.begin_weight_update()
            again = await raw.post("/start_weight_update")
            assert again.status_code == 500 and "already active" in again.text
            assert (await raw.post("/update_weights", json=chunk)).status_code == 200
            done = await raw.post("/finish_weight_update", json={"weight_version": "t-1"})
            assert done.json() == {"message": "Weight update finished"}
            assert await engine.weight_version() == "t-1"
            assert (await engine.weight_fingerprint())["tensors"] != before
            with pytest.raises(EngineRejected, match="without a matching start"):
                await engine.end_weight_update()
    finally:
        await engine.close()
        server.stop()


async def test_the_forward_pass_after_a_failed_reload_kills_the_engine(
    standin: VLLMStandInServer,
) -> None:
    """What the client keeps its users from: the engine runs once more after a failed reload
    and dies on its next forward pass, dropping the request's connection."""
    async with httpx.AsyncClient(base_url=standin.url, timeout=CALL_TIMEOUT) as raw:
        body = {"method": "reload_weights", "kwargs": {"weights_path": "/no/such/checkpoint"}}
        failed = await raw.post("/collective_rpc", json=body)
        assert failed.status_code == 500 and "/no/such/checkpoint" in failed.text
        assert (await raw.get("/health")).status_code == 200  # alive until a forward pass
        with pytest.raises(httpx.TransportError):
            await raw.post("/v1/completions", json={"prompt": [1], "max_tokens": 4})
    assert standin.wait_dead(CALL_TIMEOUT) and standin.returncode == DEATH_EXIT_CODE
    assert "forward pass ran on unusable weights" in standin.stderr_text()
