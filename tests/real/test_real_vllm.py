"""vLLM 0.32.0's contract and the library's cycle on a real vLLM server (CPU build, tiny model):
each row of ``docs/vllm-contract.md`` marked "real server" names a test here.

Two servers for the session: one with an API key (which guards the OpenAI routes only, as the
first test shows) and one that the other tests drive, restart and reload. Requests are held in
flight by their length; a test waits until the server holds them (``GET /load``) or a streamed
one has decoded a token before it acts, and fails at once if one ended first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from core.test_identity import once
from real.checkpoints import rewrite_weights, trainer_fingerprint, trainer_logprobs
from real.lifecycle_checks import assert_reads_then_the_pause, routes_around_a_rollout
from real.servers import (
    LONG_CONTEXT,
    VLLM_CPU_FLAGS,
    RealServer,
    RealSGLang,
    RealVLLM,
    RealVLLMServer,
    running_in_group,
    slowed,
)
from real.vllm_models import API_KEY
from wire.helpers import held

from rollout_lifecycle import (
    DeadEnginePolicy,
    Deadlines,
    EngineGroup,
    EngineState,
    Fingerprint,
    FromDisk,
    LaunchedVLLMEngine,
    LifecycleConfig,
    Outcome,
    PauseMode,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    StaleWeights,
    WeightsNotVerified,
    free_port,
)
from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine
from rollout_lifecycle.contract.exceptions import EngineRejected, IllegalEngineOp
from rollout_lifecycle.contract.identity import PROOF_WINDOW
from rollout_lifecycle.contract.values import ALL_TAGS, Tag
from rollout_lifecycle.core.verify import BLIND, UNCHANGED
from rollout_lifecycle.testing.sse import asse_events
from rollout_lifecycle.testing.waits import until
from rollout_lifecycle.trainer import GPT2_CONV1D_WEIGHTS

pytestmark = pytest.mark.real_vllm

#: Long enough (seconds here: ~450 tokens/s) that a request is seen running before it ends.
TOKENS = 3000
#: How vLLM's driver refuses a release of the weights without the KV cache.
NOT_WITHOUT_KV = r"vllm cannot release tags \['weights'\] without \['kv_cache'\]"
#: SGLang on a CPU decodes tens of tokens a second.
SGLANG_TOKENS = 150
#: Seconds the mixed fleet's SGLang server sleeps in every batch while a cycle is staged
#: (``slowed``): its requests then last over 150 * 0.5 = 75 s. At full speed they lasted a few
#: seconds, and on a loaded CI machine they ended while the test still waited for the vLLM
#: server's requests (it then waited 300 s for two SGLang requests that were gone).
SGLANG_STEP_S = 0.5


@pytest.fixture(scope="session")
def mixed_sglang(real_sglang: RealSGLang, real_vllm: RealVLLM) -> Iterator[RealServer]:
    """A real SGLang server for the mixed fleet, serving the vLLM servers' model."""
    env = dataclasses.replace(real_sglang, model=real_vllm.model)
    server = RealServer(env).start().wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def other_weights(real_vllm: RealVLLM, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint of the same shapes with every weight changed: it generates differently."""
    folder = tmp_path_factory.mktemp("other-weights")
    return rewrite_weights(real_vllm, folder, "t = {k: v * 1.7 + 0.01 for k, v in t.items()}")


@pytest.fixture(autouse=True)
async def left_serving(vllm_servers: list[RealVLLMServer]) -> AsyncIterator[None]:
    """Every test leaves both servers awake and generating, also when it failed half-way."""
    yield
    for server in vllm_servers:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as raw:
            if 'sleep_state="awake"} 0.0' in (await raw.get("/metrics")).text:
                await raw.post("/wake_up")
            await raw.post("/resume")


@pytest.fixture
async def engine(vllm_servers: list[RealVLLMServer]) -> AsyncIterator[VLLMHTTPEngine]:
    """A client of the server without a key."""
    client = VLLMHTTPEngine(vllm_servers[1].url)
    yield client
    await client.close()


def request(tokens: int = TOKENS) -> dict[str, Any]:
    return {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }


async def load(url: str) -> int:
    """The requests the server holds from arrival to answer (``GET /load``, with
    ``--enable-server-load-tracking``), counted by the API server itself."""
    # vllm: entrypoints/serve/instrumentator/basic.py get_server_load_metrics
    async with httpx.AsyncClient(timeout=30) as client:
        count: int = (await client.get(f"{url}/load")).json()["server_load"]
    return count


async def holding(url: str, n: int, jobs: list[asyncio.Future[Any]]) -> None:
    """Wait until the server holds ``n`` requests (a fact, not a sleep); fail at once if one of
    ``jobs`` ended first."""

    async def enough() -> bool:
        ended = [job for job in jobs if job.done()]
        if ended:
            raise AssertionError(f"a request ended before {n} were held: {ended[0]!r}")
        return await load(url) >= n

    await until(enough, deadline=300, every=0.02, what=f"{n} requests held by {url}")


class Streamed:
    """One streamed completion: ``decoding`` is set once its first token arrived (the request
    is then running in the scheduler), ``done`` holds its finish reason and token count."""

    def __init__(self, url: str) -> None:
        self.decoding = asyncio.Event()
        self.done = asyncio.ensure_future(self._run(url))

    async def _run(self, url: str) -> tuple[str | None, int]:
        body = {"prompt": [1, 2, 3, 4], "max_tokens": TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": True, "return_token_ids": True}  # fmt: skip
        tokens, reason = 0, None
        client = httpx.AsyncClient(timeout=600)
        sent = client.stream("POST", f"{url}/v1/completions", json=body)
        async with client, sent as answer:
            async for event in asse_events(answer.aiter_bytes()):
                choice = event["choices"][0]
                tokens += len(choice.get("token_ids") or [])
                reason = choice.get("finish_reason") or reason
                if tokens:
                    self.decoding.set()
        return reason, tokens

    async def started(self) -> None:
        waiting = asyncio.ensure_future(self.decoding.wait())
        await asyncio.wait([waiting, self.done], timeout=300, return_when="FIRST_COMPLETED")
        waiting.cancel()
        assert self.decoding.is_set(), f"the stream never decoded: {self.done!r}"


async def both_held(client: httpx.AsyncClient) -> bool:
    return await held(client) >= 2


async def paused(url: str) -> bool:
    async with httpx.AsyncClient(timeout=10) as client:
        answer: bool = (await client.get(f"{url}/is_paused")).json()["is_paused"]
    return answer


# ------------------------------------------------------------------ the contract


async def test_the_attach_check_reads_the_version_and_the_key_guards_no_lifecycle_route(
    vllm_servers: list[RealVLLMServer],
) -> None:
    keyed = VLLMHTTPEngine(vllm_servers[0].url, api_key=API_KEY)
    assert await keyed.check_version() == "0.32.0"
    url = vllm_servers[0].url
    async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
        # The OpenAI API wants the key ...
        assert (await raw.post("/v1/completions", json={"prompt": [1]})).status_code == 401
        # ... and the lifecycle routes answer without one.
        assert (await raw.post("/pause", params={"mode": "keep"})).status_code == 200
        assert (await raw.get("/is_paused")).json() == {"is_paused": True}
        assert (await raw.post("/resume")).status_code == 200
        assert (await raw.get("/is_paused")).json() == {"is_paused": False}
    found = await keyed.observe()
    assert found["paused"] is False and isinstance(found["incarnation"], str)
    await keyed.close()


async def test_the_flush_is_refused_while_a_request_holds_blocks_and_accepted_once_paused(
    engine: VLLMHTTPEngine, vllm_servers: list[RealVLLMServer]
) -> None:
    stream = Streamed(vllm_servers[1].url)
    await stream.started()
    with pytest.raises(EngineRejected, match="success=false") as refused:
        await engine.flush_cache(0)
    assert refused.value.status == 400
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0)
    assert not stream.done.done()  # kept, frozen
    await engine.continue_generation()
    assert await asyncio.wait_for(stream.done, 300) == ("length", TOKENS)


async def test_an_abort_pause_answers_the_running_request_with_its_partial_output(
    engine: VLLMHTTPEngine, vllm_servers: list[RealVLLMServer]
) -> None:
    stream = Streamed(vllm_servers[1].url)
    await stream.started()
    await engine.pause_generation(PauseMode.ABORT)
    reason, tokens = await asyncio.wait_for(stream.done, 300)
    assert reason == "abort" and 0 < tokens < TOKENS
    await engine.continue_generation()


async def test_an_abort_by_request_id_ends_that_request_and_no_other(
    engine: VLLMHTTPEngine, vllm_servers: list[RealVLLMServer]
) -> None:
    """Two requests decoding with the library's request ids; an abort of one id answers that
    one with ``abort`` and part of its tokens, and the other runs on to full length."""
    url = vllm_servers[1].url
    jobs = [
        asyncio.ensure_future(engine.generate(dict(request(), rid=f"by-id-{i}"))) for i in (0, 1)
    ]
    await holding(url, 2, jobs)
    await engine.abort_request("by-id-0")
    aborted, kept = await asyncio.wait_for(asyncio.gather(*jobs), 300)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < TOKENS
    assert kept["meta_info"]["finish_reason"]["type"] == "length"
    assert len(kept["output_ids"]) == TOKENS


async def test_return_logprob_answers_the_raw_models_logprob_of_each_output_token(
    engine: VLLMHTTPEngine,
) -> None:
    """``return_logprob`` goes out as ``logprobs: 0`` and comes back as SGLang's
    ``[logprob, token_id, None]`` per output token. They are the raw model's (vLLM's default
    ``raw_logprobs``): a temperature with a top-k of 1, which samples the greedy tokens, leaves
    each token's logprob as the greedy request's."""

    def asked(**params: Any) -> dict[str, Any]:
        sampling = {"max_new_tokens": 8, "ignore_eos": True, **params}
        return {"input_ids": [1, 2, 3, 4], "sampling_params": sampling, "return_logprob": True}

    greedy = await engine.generate(asked(temperature=0))
    entries = greedy["meta_info"]["output_token_logprobs"]
    assert len(entries) == len(greedy["output_ids"]) == 8
    assert [token for _, token, _ in entries] == greedy["output_ids"]
    assert all(math.isfinite(lp) and lp <= 0 and text is None for lp, _, text in entries)
    tempered = await engine.generate(asked(temperature=0.5, top_k=1))
    assert tempered["output_ids"] == greedy["output_ids"]
    found = [lp for lp, *_ in tempered["meta_info"]["output_token_logprobs"]]
    assert found == pytest.approx([lp for lp, *_ in entries], abs=1e-4)


async def test_a_full_wake_continues_generation_so_the_client_holds_the_kv_wake_back(
    engine: VLLMHTTPEngine,
) -> None:
    url = engine.url
    async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
        # vLLM itself: a wake that makes the engine whole again also resumes the scheduler.
        await raw.post("/pause", params={"mode": "keep"})
        await raw.post("/sleep", params={"level": 1, "mode": "keep"})
        assert (await raw.post("/wake_up", params={"tags": "weights"})).json()["status"] == (
            "sleeping"
        )
        assert await paused(url)
        assert (await raw.post("/wake_up", params={"tags": "kv_cache"})).json()["status"] == (
            "awake"
        )
        assert not await paused(url)
    # The client: both resumes leave the engine paused; the continue wakes the KV cache.
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0)
    await engine.release_memory_occupation(list(ALL_TAGS))
    await engine.resume_memory_occupation([Tag.WEIGHTS])
    await engine.resume_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
    assert await paused(url)
    await engine.continue_generation()
    assert not await paused(url)


async def test_a_continue_with_the_weights_asleep_is_refused_and_the_engine_stays_paused(
    engine: VLLMHTTPEngine,
) -> None:
    # Another process slept the engine after its pause: the KV cache's wake leaves the weights
    # asleep, vLLM answers "sleeping" and keeps its scheduler paused, and the client sends no
    # /resume, which would run it on memory that is not there.
    url = engine.url
    await engine.pause_generation(PauseMode.RETRACT)
    async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
        assert (await raw.post("/sleep", params={"level": 1, "mode": "keep"})).status_code == 200
    with pytest.raises(IllegalEngineOp, match="not fully awake: its weights are still asleep"):
        await engine.continue_generation()
    assert await paused(url)
    await engine.resume_memory_occupation([Tag.WEIGHTS])
    await engine.continue_generation()
    assert not await paused(url)
    assert len((await engine.generate(request(8)))["output_ids"]) == 8


async def test_a_release_of_the_kv_cache_alone_sleeps_both_and_wakes_the_weights_back(
    engine: VLLMHTTPEngine,
) -> None:
    url = engine.url
    with pytest.raises(IllegalEngineOp, match=NOT_WITHOUT_KV):
        await engine.release_memory_occupation([Tag.WEIGHTS])
    before = (await engine.weight_fingerprint())["tensors"]
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.release_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
    assert (await engine.weight_fingerprint())[
        "tensors"
    ] == before  # level 1: back from host memory
    async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
        assert (await raw.get("/is_sleeping")).json()["is_sleeping"]
        # Only the KV cache was asleep: its wake alone makes the engine whole (and resumes it).
        woken = await raw.post("/wake_up", params={"tags": "kv_cache"})
        assert woken.json()["status"] == "awake", woken.text
    assert not await paused(url)
    assert len((await engine.generate(request(8)))["output_ids"]) == 8


# ------------------------------------------------------------------ weights


async def test_a_reload_with_new_weights_changes_the_checksums_and_the_output(
    vllm_servers: list[RealVLLMServer], real_vllm: RealVLLM, other_weights: str
) -> None:
    engine = VLLMHTTPEngine(vllm_servers[1].url)
    try:
        before = (await engine.weight_fingerprint())["tensors"]
        first = await engine.generate(request(8))
        await engine.update_weights_from_disk(
            other_weights, weight_version="other", flush_cache=True, abort_all_requests=False
        )
        assert await engine.weight_version() == "other"
        after = (await engine.weight_fingerprint())["tensors"]
        assert before.keys() == after.keys() and before != after
        second = await engine.generate(request(8))
        assert first["output_ids"] != second["output_ids"]
        await engine.update_weights_from_disk(
            real_vllm.model, weight_version="base", flush_cache=True, abort_all_requests=False
        )
        assert (await engine.weight_fingerprint())["tensors"] == before
        assert (await engine.generate(request(8)))["output_ids"] == first["output_ids"]
    finally:
        await engine.close()


async def test_a_failed_reload_leaves_the_engine_alive_and_refuses_what_would_run_the_model(
    vllm_servers: list[RealVLLMServer], real_vllm: RealVLLM
) -> None:
    engine = VLLMHTTPEngine(vllm_servers[1].url)
    try:
        await engine.pause_generation(PauseMode.RETRACT)
        with pytest.raises(EngineRejected, match="/no/such/checkpoint") as failed:
            await engine.update_weights_from_disk(
                "/no/such/checkpoint", weight_version=None, flush_cache=False,
                abort_all_requests=False,
            )  # fmt: skip
        assert "unusable until a reload succeeds" in str(failed.value)
        for refused in (
            engine.continue_generation(),
            engine.generate(request(4)),
            engine.resume_memory_occupation([Tag.KV_CACHE]),
        ):
            with pytest.raises(IllegalEngineOp, match="a reload failed"):
                await refused
        assert await engine.ping() and await paused(engine.url)  # alive, nothing ran
        await engine.update_weights_from_disk(
            real_vllm.model, weight_version=None, flush_cache=True, abort_all_requests=False
        )
        assert engine.broken is None
        await engine.continue_generation()
        assert len((await engine.generate(request(4)))["output_ids"]) == 4
    finally:
        await engine.close()


# ------------------------------------------------------------------ the library's cycle


async def test_the_default_cycle_keeps_every_decoding_request_on_a_real_vllm_server(
    vllm_servers: list[RealVLLMServer], real_vllm: RealVLLM, other_weights: str
) -> None:
    """offload, onload weights, a reload of new weights, onload KV with four requests decoding:
    every request finishes full length, the engine serves the new version and weights. Between
    the KV resume and the continue the record says the KV cache sleeps (``kv_asleep``, the
    driver's declared ``kv_wakes_at_continue``), and so does the server's own sleep gauge."""
    url = vllm_servers[1].url
    engine = VLLMHTTPEngine(url)
    server = RolloutServer([EngineGroup("vllm", [engine])], config=LifecycleConfig())
    before_continue: list[tuple[list[EngineState], bool]] = []

    async def at_continue(_: object) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
            awake = 'sleep_state="awake"} 1.0' in (await raw.get("/metrics")).text
        before_continue.append(([r.state for r in server.fleet.records()], awake))

    server.on("before_continue", at_continue)
    try:
        traffic = [asyncio.ensure_future(server.generate(request())) for _ in range(4)]
        await holding(url, 4, traffic)
        await server.offload()
        assert await paused(url) and not any(t.done() for t in traffic)
        await server.onload_weights()
        await server.update_weights(FromDisk(other_weights), version="step-1")
        await server.onload_kv()
        answers = await asyncio.wait_for(asyncio.gather(*traffic), 600)
        assert [len(a["output_ids"]) for a in answers] == [TOKENS] * 4
        assert {a["meta_info"]["finish_reason"]["type"] for a in answers} == {"length"}
        assert await engine.weight_version() == "step-1" and not await paused(url)
        assert before_continue == [([EngineState.KV_ASLEEP], False)]
        assert [r.state for r in server.fleet.records()] == [EngineState.SERVING]
    finally:
        await engine.close()


async def test_an_abort_cycle_resubmits_every_request_the_pause_aborted_to_full_length(
    vllm_servers: list[RealVLLMServer], real_vllm: RealVLLM
) -> None:
    """The abort pause answers the four decoding requests with their partial output; the
    generation client holds them while offloaded and resubmits each once serving again, so each
    ends full length with one answer."""
    url = vllm_servers[1].url
    engine = VLLMHTTPEngine(url)
    config = LifecycleConfig(pause_mode=PauseMode.ABORT)
    server = RolloutServer([EngineGroup("vllm", [engine])], config=config)
    try:
        sent = [dict(request(), rid=f"vllm-abort-{i}") for i in range(4)]
        traffic = [asyncio.ensure_future(server.generate(body)) for body in sent]
        await holding(url, 4, traffic)
        await server.offload()
        await server.onload_weights()
        await server.update_weights(FromDisk(real_vllm.model), version="abort-1")
        await server.onload_kv()
        answers = await asyncio.wait_for(asyncio.gather(*traffic), 600)
        assert [len(a["output_ids"]) for a in answers] == [TOKENS] * 4
        assert {a["meta_info"]["finish_reason"]["type"] for a in answers} == {"length"}
        assert all(a["meta_info"]["num_resubmissions"] >= 1 for a in answers)
        stats = server.generation.stats()
        assert (stats["submitted"], stats["completed"], stats["failed"]) == (4, 4, 0)
        assert await engine.weight_version() == "abort-1"
    finally:
        await engine.close()


async def test_the_launcher_starts_a_real_vllm_server_runs_the_cycle_on_it_and_stops_it(
    real_vllm: RealVLLM,
) -> None:
    """``LaunchedVLLMEngine`` starts vLLM with dev mode (its attach check passes), the first
    call starts it, the library's cycle runs on it, and ``close()`` ends its process group."""
    engine = LaunchedVLLMEngine(
        real_vllm.model,
        port=free_port(),
        python=real_vllm.python,
        extra_args=[*VLLM_CPU_FLAGS, *LONG_CONTEXT],
        env=real_vllm.child_env(),
    )
    server = RolloutServer([EngineGroup("launched", [engine])])
    try:
        assert len((await server.generate(request(8)))["output_ids"]) == 8
        await server.offload()
        assert await paused(engine.url)
        await server.onload_weights()
        await server.update_weights(FromDisk(real_vllm.model), version="launched-1")
        await server.onload_kv()
        assert await engine.weight_version() == "launched-1"
        assert len((await server.generate(request(8)))["output_ids"]) == 8
        pid = engine.pid
    finally:
        await engine.close()
    assert pid is not None and engine.returncode is not None
    # The whole group ends (the engine core is a child of the API server); a zombie that
    # nobody has reaped yet is not running.
    await until(
        lambda: not running_in_group(pid), deadline=60, every=0.2, what=f"group {pid} ended"
    )


S = ServerState
#: A restart of a vLLM server takes tens of seconds, more on a loaded machine.
RESTART_CONFIG = LifecycleConfig(
    deadlines=Deadlines(pause=60, flush=60, release=60, resume=60, continue_=60, probe=30)
)


@pytest.mark.parametrize(
    ("boundary", "phase"), [("after_pause", "release"), ("after_release", "resume_weights")]
)
async def test_a_server_restarted_mid_cycle_is_never_acted_on_and_recover_brings_it_back(
    vllm_servers: list[RealVLLMServer], real_vllm: RealVLLM, boundary: str, phase: str
) -> None:
    """The vLLM server restarts at its URL after the pause (before the flush) or after the
    release: the next call sees another process there and acts on nothing; the record learns a
    fresh server; ``recover()`` and a cycle bring it back with the fleet's weights."""
    victim = vllm_servers[1]
    engine = VLLMHTTPEngine(victim.url)
    server = RolloutServer([EngineGroup("vllm", [engine])], RESTART_CONFIG)
    try:
        before = (await engine.observe())["incarnation"]
        with pytest.raises(PhaseFailed) as failed:
            if boundary == "after_pause":
                server.on("before_flush", once(lambda: asyncio.to_thread(victim.restart)))
                await server.offload()
            else:
                await server.offload()
                await asyncio.to_thread(victim.restart)
                await server.onload_weights()
        error = failed.value
        assert error.phase == phase and error.failed_engines == ["vllm/0"]
        assert error.outcomes["vllm/0"].outcome is Outcome.RESTARTED
        assert server.state is S.FAILED and victim.alive()
        record = server.snapshot().engines()["vllm/0"]
        assert record.stale and record.incarnation != before
        assert record.incarnation == (await engine.observe())["incarnation"]
        await server.recover(lambda engine_id: server.engines()[engine_id])
        if server.state is S.RELEASED:
            await server.onload_weights()
        elif server.state is S.SERVING:
            await server.pause()
        await server.update_weights(FromDisk(real_vllm.model), version="recovered")
        await (server.onload() if server.state is not S.SERVING else server.resume())
        assert server.state is S.SERVING and not await paused(victim.url)
        assert await engine.weight_version() == "recovered"
        assert len((await server.generate(request(8)))["output_ids"]) == 8
    finally:
        await engine.close()


async def test_renewed_proofs_let_the_pause_after_a_rollout_go_out_without_a_read(
    vllm_servers: list[RealVLLMServer],
) -> None:
    """``renew_proofs`` on vLLM: its incarnation (the API server's start time in ``/metrics``)
    reads the same on every read of one process, so the reads while it serves keep it proven,
    and the pause after a rollout of several proof windows is the first request each server
    gets from the offload."""
    engines = [VLLMHTTPEngine(s.url) for s in vllm_servers]
    config = LifecycleConfig(deadlines=RESTART_CONFIG.deadlines, renew_proofs=True)
    server = RolloutServer([EngineGroup("vllm", engines)], config)
    try:
        routes = await routes_around_a_rollout(server, engines, 3 * PROOF_WINDOW)
        # the incarnation's reads every half window while serving, and the pause first
        assert_reads_then_the_pause(routes, {"/version", "/metrics"}, 8, "/pause")
        assert server.state is S.DRAINED
    finally:
        if server.state is S.DRAINED:
            await server.resume()
        await asyncio.gather(*(e.close() for e in engines))


#: The mixed fleet's cycles, each with requests decoding on both servers.
MIXED_CYCLES = 10


async def test_a_mixed_sglang_and_vllm_fleet_runs_ten_cycles_with_traffic_and_loses_nothing(
    vllm_servers: list[RealVLLMServer],
    real_vllm: RealVLLM,
    mixed_sglang: RealServer,
) -> None:
    """One server, an SGLang group and a vLLM group, traffic through its generation client: each
    cycle starts with requests decoding on both servers, every barrier spans both kinds, and
    every request finishes full length on the cycle's weights."""
    vllm = VLLMHTTPEngine(vllm_servers[1].url)
    sglang = SGLangHTTPEngine(mixed_sglang.url)
    server = RolloutServer([EngineGroup("sglang", [sglang]), EngineGroup("vllm", [vllm])])
    try:
        async with httpx.AsyncClient(base_url=mixed_sglang.url, timeout=30) as client:
            for step in range(MIXED_CYCLES):
                async with slowed([mixed_sglang.url], SGLANG_STEP_S):
                    traffic = [
                        *(
                            asyncio.ensure_future(server.generate(request(), "vllm"))
                            for _ in range(2)
                        ),
                        *(
                            asyncio.ensure_future(server.generate(request(SGLANG_TOKENS), "sglang"))
                            for _ in range(2)
                        ),
                    ]
                    await holding(vllm_servers[1].url, 2, traffic)
                    await until(
                        lambda: both_held(client), deadline=300, what="two requests held by SGLang"
                    )
                    await server.offload()
                await server.onload_weights()
                await server.update_weights(FromDisk(real_vllm.model), version=f"mixed-{step}")
                await server.onload_kv()
                answers = await asyncio.wait_for(asyncio.gather(*traffic), 600)
                lengths = [len(a["output_ids"]) for a in answers]
                assert lengths == [TOKENS] * 2 + [SGLANG_TOKENS] * 2, step
                assert (
                    await vllm.weight_version()
                    == await sglang.weight_version()
                    == (f"mixed-{step}")
                )
        stats = server.generation.stats()
        print(f"{MIXED_CYCLES} mixed cycles: {stats}")
        sent = 4 * MIXED_CYCLES
        assert (stats["submitted"], stats["completed"], stats["failed"]) == (sent, sent, 0)
    finally:
        await vllm.close()
        await sglang.close()


async def greedy_logprob_gap(
    engine: VLLMHTTPEngine, real_sglang: RealSGLang, checkpoint: str
) -> float:
    """The largest difference between the engine's log-probabilities of its greedy tokens and
    the trainer's under ``checkpoint``."""
    out = await engine.generate({**request(8), "return_logprob": True})
    served = [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]
    mine = trainer_logprobs(real_sglang, checkpoint, request()["input_ids"], out["output_ids"])
    return max(abs(a - b) for a, b in zip(served, mine, strict=True))


async def test_on_a_cpu_a_reload_is_refused_by_verification_and_rightly_so(
    vllm_servers: list[RealVLLMServer],
    real_vllm: RealVLLM,
    real_sglang: RealSGLang,
    other_weights: str,
) -> None:
    """vLLM on a CPU computes its linear layers with copies packed at start-up and reports
    their weights as empty: a reload from disk passes every tensor the checksum reads, yet the
    engines then compute with other weights than the checkpoint's (their log-probabilities
    are not the trainer's, as they are before it). Verification refuses such a fingerprint,
    naming the tensors it cannot see, and the engines stay paused until a push the caller
    does not verify; the servers are left on the tier's model."""
    first, second = vllm_servers
    engines = [VLLMHTTPEngine(first.url, api_key=API_KEY), VLLMHTTPEngine(second.url)]
    server = RolloutServer([EngineGroup("vllm", engines)])
    want = trainer_fingerprint(real_sglang, other_weights, "vllm")
    linear = tuple(n for n in sorted(want.tensors) if n.endswith(GPT2_CONV1D_WEIGHTS))
    try:
        assert await greedy_logprob_gap(engines[1], real_sglang, real_vllm.model) < 1e-4
        await server.pause()
        with pytest.raises(WeightsNotVerified) as caught:
            await server.update_weights(FromDisk(other_weights), "other", expected=want)
        assert caught.value.problems == {"vllm/0": BLIND, "vllm/1": BLIND}
        assert caught.value.tensors["vllm/1"] == linear and len(linear) == 8
        with pytest.raises(StaleWeights, match="vllm/1"):
            await server.resume()
        # Every tensor the checksum reads is the checkpoint's; what it computes is not.
        held = Fingerprint.from_wire(await engines[1].weight_fingerprint())
        assert held.differing(want) == () and held.blind == linear
        await engines[1].continue_generation()
        gap = await greedy_logprob_gap(engines[1], real_sglang, other_weights)
        print(f"after a reload, vLLM's greedy log-probabilities differ by up to {gap:.3f}")
        assert gap > 0.1
        await engines[1].pause_generation(PauseMode.ABORT)
        await server.update_weights(FromDisk(real_vllm.model), "base", verify=False)
        await server.resume()
        assert await greedy_logprob_gap(engines[1], real_sglang, real_vllm.model) < 1e-4
    finally:
        for engine in engines:
            await engine.close()


async def test_a_mixed_fleet_is_verified_per_group_and_goes_on_without_what_it_cannot_verify(
    vllm_servers: list[RealVLLMServer],
    real_vllm: RealVLLM,
    real_sglang: RealSGLang,
    mixed_sglang: RealServer,
    other_weights: str,
) -> None:
    """SGLang and vLLM hash differently: each group is checked against the fingerprint of its
    own scheme, and a wrong checkpoint is caught on both. The vLLM engine on a CPU cannot be
    verified (its checksum cannot see its linear weights); with ``unverified_engines=SKIP`` the
    fleet goes on with the SGLang engine serving and the vLLM one paused, out of the router."""
    vllm = VLLMHTTPEngine(vllm_servers[1].url)
    sglang = SGLangHTTPEngine(mixed_sglang.url)
    config = LifecycleConfig(unverified_engines=DeadEnginePolicy.SKIP)
    groups = [EngineGroup("sglang", [sglang]), EngineGroup("vllm", [vllm])]
    server = RolloutServer(groups, config=config)
    other = [
        trainer_fingerprint(real_sglang, other_weights, "sglang"),
        trainer_fingerprint(real_sglang, other_weights, "vllm"),
    ]
    try:
        await server.offload()
        await server.onload_weights()
        with pytest.raises(WeightsNotVerified) as caught:
            await server.update_weights(FromDisk(real_vllm.model), "base", expected=other)
        # the tier's model again: not what the SGLang engine was told to expect (every tensor
        # differs from the expected fingerprint, so the verdict goes on with the dtype hint)
        assert caught.value.problems["sglang/0"].startswith(UNCHANGED + " in every tensor")
        assert caught.value.problems["vllm/0"] == BLIND
        await server.update_weights(FromDisk(other_weights), "other", expected=other)
        await server.onload_kv()
        snapshot = server.snapshot().engines()
        assert snapshot["vllm/0"].unverified and not snapshot["sglang/0"].unverified
        out = await server.generate(request(2), "sglang")
        assert out["meta_info"]["weight_version"] == "other"
        assert (await vllm.observe())["paused"] is True
        await server.pause()
        await server.update_weights(FromDisk(real_vllm.model), "base", verify=False)
        await server.resume()
        assert (await vllm.observe())["paused"] is False
    finally:
        await vllm.close()
        await sglang.close()
