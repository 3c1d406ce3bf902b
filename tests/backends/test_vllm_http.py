"""``VLLMHTTPEngine``: how each lifecycle call lands on vLLM's routes, shown against a recording
transport that answers as vLLM 0.32.0 does (``tests/real/test_real_vllm.py`` shows the same
against a real server)."""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_lifecycle import (
    EngineGroup,
    EngineState,
    Fingerprint,
    FromDisk,
    FromDistributed,
    FromTensor,
    LifecycleConfig,
    RolloutServer,
    ServerSnapshot,
    ServerState,
    SGLangHTTPEngine,
    StaleWeights,
)
from rollout_lifecycle.backends.engine import EngineHost
from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine, vllm_http_factory
from rollout_lifecycle.contract.commands import ReadSleeping
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.fingerprint import SGLANG_SCHEME, SIMULATED_SCHEME, VLLM_SCHEME
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.contract.seam import classify
from rollout_lifecycle.contract.values import ALL_TAGS, PauseMode, Tag
from rollout_lifecycle.core.bus import Bus
from rollout_lifecycle.core.config import DeadEnginePolicy
from rollout_lifecycle.core.runner import PhaseRunner
from rollout_lifecycle.testing.simulated import SimulatedEngine
from rollout_lifecycle.testing.standin.app import create_app
from rollout_lifecycle.testing.standin.vllm_app import create_vllm_app

URL = "http://127.0.0.1:8000"
#: How vLLM's driver refuses a release of the weights without the KV cache.
NOT_WITHOUT_KV = r"vllm cannot release tags \['weights'\] without \['kv_cache'\]"
Answer = Callable[[httpx.Request], httpx.Response]


class FakeVLLM:
    """Records every request (method, path, query) and answers as vLLM 0.32.0 does."""

    def __init__(self, **answers: Answer) -> None:
        self.sent: list[tuple[str, str, str]] = []
        self.bodies: list[Any] = []
        self.headers: list[httpx.Headers] = []
        self.answers = answers
        self.version = "0.32.0"
        self.reset_answers: list[bool] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.sent.append((request.method, path, request.url.query.decode()))
        self.bodies.append(json.loads(request.content) if request.content else None)
        self.headers.append(request.headers)
        name = path.strip("/").replace("/", "_")
        if name in self.answers:
            return self.answers[name](request)
        if path == "/version":
            return httpx.Response(200, json={"version": self.version})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": False})
        if path == "/reset_prefix_cache":
            ok = self.reset_answers.pop(0) if self.reset_answers else True
            return httpx.Response(200, json={"success": ok})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "default"})
        if path == "/wake_up":  # (as vLLM answers once nothing is asleep: it resumes too)
            return httpx.Response(200, json={"status": "awake", "tags": None})
        if path == "/v1/completions":
            return httpx.Response(200, json=_completion())
        if path == "/update_weight_version":
            return httpx.Response(200, json={"success": True, "new_version": "x"})
        if path == "/abort_requests":
            return httpx.Response(200, json={"status": "aborted", "aborted": 0})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        status = {"/pause": "paused", "/resume": "resumed", "/sleep": "sleeping"}[path]
        return httpx.Response(200, json={"status": status})

    def calls(self) -> list[str]:
        """The lifecycle calls sent, attach-check reads left out."""
        return [
            f"{method} {path}" + (f"?{query}" if query else "")
            for method, path, query in self.sent
            if path not in ("/version", "/is_paused")
        ]


def _completion(
    ids: tuple[int, ...] = (5, 6), reason: str = "length", logprobs: Any = None
) -> dict[str, Any]:
    choice = {"text": "ab", "token_ids": list(ids), "finish_reason": reason, "logprobs": logprobs}
    return {
        "id": "cmpl-1",
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)},
    }


def _logprobs(*values: Any) -> dict[str, Any]:
    """A choice's ``logprobs`` as vLLM 0.32.0 answers ``logprobs: 0`` (tokens "a", "b")."""
    tokens = [chr(ord("a") + i) for i in range(len(values))]
    return {
        "text_offset": list(range(len(values))),
        "token_logprobs": list(values),
        "tokens": tokens,
        "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)],
    }


def answering(completion: dict[str, Any]) -> FakeVLLM:
    return FakeVLLM(v1_completions=lambda r: httpx.Response(200, json=completion))


def engine(fake: FakeVLLM, **options: Any) -> VLLMHTTPEngine:
    return VLLMHTTPEngine(URL, transport=httpx.MockTransport(fake), **options)


def mixed_pair(
    vllm_name: str = "vllm",
) -> tuple[SimulatedEngine, VLLMHTTPEngine, SimulatedEngine, SGLangHTTPEngine]:
    """A vLLM stand-in and an SGLang stand-in, each over its own simulated engine, and the
    client of each: ``(vllm_sim, vllm, sglang_sim, sglang)``."""
    vllm_sim = SimulatedEngine(vllm_name, token_latency=0.001)
    vllm = VLLMHTTPEngine(URL, transport=httpx.ASGITransport(app=create_vllm_app(vllm_sim)))
    sglang_sim = SimulatedEngine("sglang", token_latency=0.001)
    sglang = SGLangHTTPEngine(
        "http://127.0.0.1:30000", transport=httpx.ASGITransport(app=create_app(sglang_sim))
    )
    return vllm_sim, vllm, sglang_sim, sglang


@pytest.mark.parametrize(
    ("mode", "sent"),
    [
        (PauseMode.RETRACT, "keep"),
        (PauseMode.IN_PLACE, "keep"),
        (PauseMode.ABORT, "abort"),
        (PauseMode.WAIT, "wait"),
    ],
)
async def test_a_pause_is_vllms_keep_abort_or_wait(mode: PauseMode, sent: str) -> None:
    fake = FakeVLLM()
    await engine(fake).pause_generation(mode)
    assert fake.calls() == [f"POST /pause?mode={sent}"]


async def test_the_attach_check_refuses_an_old_vllm_and_one_without_dev_mode() -> None:
    old = FakeVLLM()
    old.version = "0.31.2"
    with pytest.raises(IllegalEngineOp, match=r"vLLM '0\.31\.2'; this client needs vLLM >= 0\.32"):
        await engine(old).pause_generation(PauseMode.RETRACT)
    assert old.calls() == []
    plain = FakeVLLM(is_paused=lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    with pytest.raises(IllegalEngineOp, match="VLLM_SERVER_DEV_MODE=1"):
        await engine(plain).pause_generation(PauseMode.RETRACT)
    assert plain.calls() == []


async def test_a_busy_flush_is_a_400_refusal_and_a_flush_with_a_wait_asks_again() -> None:
    fake = FakeVLLM()
    fake.reset_answers = [False]
    with pytest.raises(EngineRejected, match="success=false") as refused:
        await engine(fake).flush_cache(0)
    assert refused.value.status == 400
    fake.reset_answers = [False, False, True]
    await engine(fake).flush_cache(30)
    assert fake.calls().count("POST /reset_prefix_cache") == 1 + 3


async def test_a_release_sleeps_with_keep_and_the_kv_cache_alone_wakes_the_weights_back() -> None:
    fake = FakeVLLM()
    with pytest.raises(IllegalEngineOp, match=NOT_WITHOUT_KV):
        await engine(fake).release_memory_occupation([Tag.WEIGHTS])
    assert fake.calls() == []
    await engine(fake).release_memory_occupation(list(ALL_TAGS))
    await engine(fake, sleep_level=2).release_memory_occupation([Tag.WEIGHTS, Tag.KV_CACHE])
    assert fake.calls() == ["POST /sleep?level=1&mode=keep", "POST /sleep?level=2&mode=keep"]
    await engine(fake).release_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
    assert fake.calls()[2:] == ["POST /sleep?level=1&mode=keep", "POST /wake_up?tags=weights"]
    level_2 = engine(fake, sleep_level=2)
    await level_2.release_memory_occupation([Tag.KV_CACHE])
    with pytest.raises(IllegalEngineOp, match="level-2 sleep discarded them"):
        await level_2.continue_generation()


async def test_a_kv_release_whose_weights_wake_fails_after_the_sleep_is_no_refusal() -> None:
    # The sleep landed, so both are asleep: a refusal (nothing done) would be a false record.
    fake = FakeVLLM(wake_up=lambda r: httpx.Response(500, json={"error": "out of memory"}))
    with pytest.raises(EngineError, match="slept, then the weights' wake failed") as failed:
        await engine(fake).release_memory_occupation([Tag.KV_CACHE])
    assert type(failed.value) is EngineError
    assert classify(failed.value).outcome is Outcome.ERROR  # effect unknown: tags uncertain


async def test_the_kv_cache_wakes_with_the_continue_and_not_before() -> None:
    fake = FakeVLLM()
    client = engine(fake)
    await client.resume_memory_occupation([Tag.WEIGHTS])
    await client.resume_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
    assert fake.calls() == ["POST /wake_up?tags=weights"]
    await client.continue_generation()
    # the wake that leaves nothing asleep resumes the scheduler (vllm: EngineCore.wake_up): no
    # /resume after it, which would wait for the first step the wake started
    assert fake.calls()[1:] == ["POST /wake_up?tags=kv_cache"]


async def test_every_continue_wakes_the_kv_cache_even_from_a_new_client() -> None:
    # A ctl run may record the KV cache's resume and a later run (a new client) continue.
    fake = FakeVLLM()
    await engine(fake).continue_generation()
    await engine(fake).continue_generation()
    assert fake.calls() == ["POST /wake_up?tags=kv_cache"] * 2


async def test_a_continue_whose_wake_leaves_weights_asleep_is_refused_and_resumes_nothing() -> None:
    # Another process slept the weights: the KV cache's wake answers "sleeping" and vLLM did not
    # resume the scheduler; a /resume would run it on memory that is not there.
    fake = FakeVLLM(wake_up=lambda r: httpx.Response(200, json={"status": "sleeping"}))
    with pytest.raises(IllegalEngineOp, match="not fully awake: its weights are still asleep"):
        await engine(fake).continue_generation()
    assert fake.calls() == ["POST /wake_up?tags=kv_cache"]


async def test_a_level_2_release_refuses_every_forward_pass_until_weights_are_pushed() -> None:
    fake = FakeVLLM()
    client = engine(fake, sleep_level=2)
    await client.release_memory_occupation(list(ALL_TAGS))
    await client.resume_memory_occupation([Tag.WEIGHTS])
    assert client.broken is not None and "level-2 sleep discarded them" in client.broken
    for refused in (
        client.resume_memory_occupation([Tag.KV_CACHE]),
        client.continue_generation(),
        client.generate({"input_ids": [1]}),
    ):
        with pytest.raises(IllegalEngineOp, match="level-2 sleep discarded them"):
            await refused
    assert fake.calls() == ["POST /sleep?level=2&mode=keep", "POST /wake_up?tags=weights"]
    await client.update_weights_from_disk(
        "/step-2", weight_version="v2", flush_cache=False, abort_all_requests=False
    )
    assert client.broken is None
    await client.continue_generation()
    assert fake.calls()[-1:] == ["POST /wake_up?tags=kv_cache"]


async def test_a_level_2_release_waits_for_a_weight_transfer_session_and_its_version() -> None:
    fake = FakeVLLM(
        start_weight_update=lambda r: httpx.Response(200, json={}),
        finish_weight_update=lambda r: httpx.Response(200, json={}),
    )
    client = engine(fake, sleep_level=2, weight_transfer=True)
    await client.release_memory_occupation(list(ALL_TAGS))
    await client.begin_weight_update()
    await client.end_weight_update()
    # The session also ends after a push that raised: only the version set after it vouches.
    assert client.broken is not None
    with pytest.raises(IllegalEngineOp, match="level-2 sleep discarded them"):
        await client.continue_generation()
    await client.update_weight_version("step-3", abort_all_requests=False)
    assert client.broken is None
    await client.continue_generation()


async def test_a_level_2_release_whose_answer_is_lost_still_marks_the_weights() -> None:
    lost = FakeVLLM(sleep=lambda r: httpx.Response(502, text="proxy lost it"))
    client = engine(lost, sleep_level=2, retries=0)
    with pytest.raises(EngineUnreachable):
        await client.release_memory_occupation(list(ALL_TAGS))
    assert client.broken is not None and "level-2 sleep discarded them" in client.broken


async def test_a_level_1_release_keeps_the_weights_usable() -> None:
    client = engine(FakeVLLM())
    await client.release_memory_occupation(list(ALL_TAGS))
    assert client.broken is None


async def test_a_failed_reload_refuses_every_forward_pass_until_a_reload_succeeds() -> None:
    broken = FakeVLLM(
        collective_rpc=lambda r: httpx.Response(500, json={"error": {"message": "no such file"}})
    )
    client = engine(broken)
    with pytest.raises(EngineRejected, match=r"reload from '/bad' failed .*no such file"):
        await client.update_weights_from_disk(
            "/bad", weight_version="v1", flush_cache=True, abort_all_requests=False
        )
    assert broken.calls() == ["POST /collective_rpc"]  # no version, no flush after it
    for refused in (
        client.continue_generation(),
        client.generate({"input_ids": [1]}),
        client.resume_memory_occupation([Tag.KV_CACHE]),
    ):
        with pytest.raises(IllegalEngineOp, match="a reload failed"):
            await refused
    assert broken.calls() == ["POST /collective_rpc"]
    del broken.answers["collective_rpc"]
    await client.update_weights_from_disk(
        "/good", weight_version="v2", flush_cache=True, abort_all_requests=True
    )
    assert client.broken is None
    assert broken.calls()[1:] == [
        "POST /abort_requests",
        "POST /collective_rpc",
        "POST /update_weight_version",
        "POST /reset_prefix_cache",
    ]
    reload_body = broken.bodies[-3]
    assert reload_body == {"method": "reload_weights", "kwargs": {"weights_path": "/good"}}
    await client.continue_generation()


async def test_a_generate_goes_out_as_a_completion_and_comes_back_in_sglangs_shape() -> None:
    fake = FakeVLLM()
    client = engine(fake, api_key="sk-test", model="tiny")
    answer = await client.generate(
        {"input_ids": [1, 2, 3], "rid": "r-7",
         "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    )  # fmt: skip
    assert fake.bodies[-1] == {
        "prompt": [1, 2, 3], "return_token_ids": True, "model": "tiny", "max_tokens": 2,
        "temperature": 0, "ignore_eos": True, "request_id": "r-7",
    }  # fmt: skip
    assert answer == {
        "text": "ab",
        "output_ids": [5, 6],
        "meta_info": {
            "id": "cmpl-1",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
        },
    }
    # The key goes to the OpenAI route only; vLLM asks none of its lifecycle routes.
    await client.pause_generation(PauseMode.RETRACT)
    keyed = [
        p for (_, p, _), h in zip(fake.sent, fake.headers, strict=True) if "authorization" in h
    ]
    assert keyed == ["/v1/completions"]
    with pytest.raises(InvalidArgument, match=r"sampling_params vLLM is not sent: \['regex'\]"):
        await client.generate({"text": "x", "sampling_params": {"regex": "a+"}})


async def test_vllms_default_version_reads_as_none_and_a_set_one_as_itself() -> None:
    fake = FakeVLLM()
    assert await engine(fake).weight_version() is None
    fake.answers["weight_info"] = lambda r: httpx.Response(200, json={"weight_version": "v3"})
    assert await engine(fake).weight_version() == "v3"


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match="sleep_level must be 1 or 2, got 3"):
        VLLMHTTPEngine(URL, sleep_level=3)
    with pytest.raises(InvalidArgument, match="label and url must not contain a key"):
        VLLMHTTPEngine(URL, api_key="sk-secret", label="sk-secret")
    factory = vllm_http_factory(URL, api_key="sk-secret")
    assert "sk-secret" not in repr(factory) and factory().url == URL


async def test_an_abort_names_the_id_vllm_gave_the_completion_sent_with_that_rid() -> None:
    fake = FakeVLLM()
    client = engine(fake)
    await client.generate({"input_ids": [1], "rid": "r-7"})
    await client.abort_request("r-7")
    await client.abort_request(abort_all=True)
    await client.abort_request("")  # no id: nothing to abort, nothing sent
    assert fake.bodies[-3]["request_id"] == "r-7"
    assert fake.bodies[-2:] == [{"request_ids": ["cmpl-r-7-0"]}, {}]


async def test_a_generate_with_return_logprob_asks_logprobs_0_and_answers_sglangs_entries() -> None:
    fake = answering(_completion(logprobs=_logprobs(-0.5, -9999.0)))
    client = engine(fake)
    answer = await client.generate({"input_ids": [1, 2, 3], "return_logprob": True})
    assert fake.bodies[-1] == {"prompt": [1, 2, 3], "return_token_ids": True, "logprobs": 0}
    # SGLang's meta_info.output_token_logprobs: [logprob, token_id, text or None] per token.
    assert answer["meta_info"]["output_token_logprobs"] == [[-0.5, 5, None], [-9999.0, 6, None]]
    assert [lp for lp, *_ in answer["meta_info"]["output_token_logprobs"]] == [-0.5, -9999.0]
    # Not asked (or asked with SGLang's values that ask for nothing): nothing sent, none back.
    for request in (
        {"input_ids": [1]},
        {"input_ids": [1], "return_logprob": False, "top_logprobs_num": 0},
        {"input_ids": [1], "logprob_start_len": -1, "token_ids_logprob": None},
    ):
        answer = await client.generate(request)
        assert "logprobs" not in fake.bodies[-1]
        assert "output_token_logprobs" not in answer["meta_info"]


@pytest.mark.parametrize(
    ("logprobs", "why"),
    [
        (None, r"no logprobs\.token_logprobs with one per output token \(2\), got None"),
        ({"tokens": ["a", "b"]}, "no logprobs.token_logprobs"),
        (_logprobs(-0.5), r"no logprobs\.token_logprobs .* \(2\), got \{'text_offset'"),
        (_logprobs(-0.5, None), r"a token logprob is no number: \[-0\.5, None\]"),
        (_logprobs(-0.5, "-1"), "a token logprob is no number"),
    ],
)
async def test_a_completion_without_the_logprobs_asked_for_is_garbage(
    logprobs: Any, why: str
) -> None:
    client = engine(answering(_completion(logprobs=logprobs)))
    with pytest.raises(EngineError, match=f"garbage answer from /v1/completions: {why}"):
        await client.generate({"input_ids": [1], "return_logprob": True})


@pytest.mark.parametrize(
    ("request_", "refusal"),
    [
        ({"return_logprob": "yes"}, "return_logprob must be a bool, got 'yes'"),
        ({"return_logprob": 1}, "return_logprob must be a bool, got 1"),
        ({"return_logprob": None}, "return_logprob must be a bool, got None"),
        (
            {"return_logprob": True, "top_logprobs_num": 5},
            r"output_token_logprobs only \(return_logprob\); top_logprobs_num=5 is not served",
        ),
        ({"return_logprob": True, "logprob_start_len": 0}, "logprob_start_len=0 is not served"),
        ({"return_text_in_logprobs": True}, "return_text_in_logprobs=True is not served"),
        ({"token_ids_logprob": [7]}, r"token_ids_logprob=\[7\] is not served"),
    ],
)
async def test_a_logprob_request_it_cannot_answer_is_refused_by_name_and_not_sent(
    request_: dict[str, Any], refusal: str
) -> None:
    fake = FakeVLLM()
    with pytest.raises(InvalidArgument, match=refusal):
        await engine(fake).generate({"input_ids": [1], **request_})
    assert fake.sent == []


async def test_the_vllm_standin_answers_logprobs_in_the_shape_the_client_reads() -> None:
    sim = SimulatedEngine("vllm-logprobs", token_latency=0.001)
    transport = httpx.ASGITransport(app=create_vllm_app(sim))
    client = VLLMHTTPEngine(URL, transport=transport)
    try:
        request = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 6},
                   "return_logprob": True}  # fmt: skip
        answer = await client.generate(request)
        entries = answer["meta_info"]["output_token_logprobs"]
        assert [token for _, token, _ in entries] == answer["output_ids"]
        assert len(entries) == 6 and all(-10 < lp < 0 and text is None for lp, _, text in entries)
        assert (await client.generate(request))["meta_info"]["output_token_logprobs"] == entries
        async with httpx.AsyncClient(transport=transport, base_url=URL) as raw:
            body = {"prompt": [1, 2], "max_tokens": 3, "logprobs": 0}
            found = (await raw.post("/v1/completions", json=body)).json()["choices"][0]
            # vLLM 0.32.0's keys (protocol.py CompletionLogProbs), the sampled token's alone
            assert sorted(found["logprobs"]) == ["text_offset", "token_logprobs", "tokens",
                                                 "top_logprobs"]  # fmt: skip
            assert [len(top) for top in found["logprobs"]["top_logprobs"]] == [1, 1, 1]
            refused = await raw.post("/v1/completions", json={**body, "logprobs": 2})
            assert refused.status_code == 400 and "logprobs 0" in refused.text
    finally:
        await client.close()
        await sim.close()


async def test_a_read_added_as_a_command_reaches_each_backend_through_the_runner() -> None:
    """``ReadSleeping`` (``Op.IS_SLEEPING``) was added in two files, the operation and its
    command: the runner sends it through the engine host's ``run`` to the vLLM client's own
    ``is_sleeping`` (``/is_sleeping``), which tells what the engine really did; SGLang's client
    has no such read, refuses it (501), and is left out of the answers."""
    _, vllm, _, sglang = mixed_pair("vllm-sleepy")
    server = RolloutServer([EngineGroup("vllm", [vllm]), EngineGroup("sglang", [sglang])])
    records = list(server.fleet.records())
    runner = PhaseRunner("read", DeadEnginePolicy.FAIL, Bus())
    assert await runner.ask(ReadSleeping(), records, 5.0) == {"vllm/0": False}
    await server.offload()
    assert await runner.ask(ReadSleeping(), records, 5.0) == {"vllm/0": True}
    await server.onload()
    assert await runner.ask(ReadSleeping(), records, 5.0) == {"vllm/0": False}
    with pytest.raises(EngineRejected, match="does not support it") as refused:
        await EngineHost(sglang).run(*ReadSleeping().wire)
    assert refused.value.status == 501
    for client in (vllm, sglang):
        await client.close()


async def test_weights_a_level_2_release_discarded_are_the_records_and_outlive_the_client(
    tmp_path: Path,
) -> None:
    """The release answers that the weights' values are gone; the ledger keeps it
    (``weights_lost``, in the snapshot), so a process that adopts the journal with a new client
    (which knows nothing of the sleep) refuses the continue until a push reaches the engine,
    even though the engine still reports the expected version."""
    sim = SimulatedEngine("vllm-level-2", token_latency=0.001)
    app = create_vllm_app(sim)

    def client() -> VLLMHTTPEngine:
        return VLLMHTTPEngine(URL, sleep_level=2, transport=httpx.ASGITransport(app=app))

    first = RolloutServer([EngineGroup("vllm", [client()])])
    await first.offload()
    await first.onload_weights()
    await first.update_weights(FromDisk(str(tmp_path)), "v1")
    await first.onload_kv()
    assert not first.snapshot().engines()["vllm/0"].weights_lost  # the push replaced them
    await first.offload()
    saved = first.snapshot()
    assert saved.engines()["vllm/0"].weights_lost and saved.engines()["vllm/0"].stale
    continues = [e for e in sim.history() if e["op"] == "continue_generation"]

    second = RolloutServer([EngineGroup("vllm", [client()])])  # a new process, a new client
    second.adopt(ServerSnapshot.from_dict(json.loads(json.dumps(saved.to_dict()))))
    with pytest.raises(StaleWeights) as stale:
        await second.onload()
    assert stale.value.expected == "v1" and list(stale.value.engines) == ["vllm/0"]
    assert second.fleet.get([EngineState.WAITING]) == list(second.fleet.records())
    assert [e for e in sim.history() if e["op"] == "continue_generation"] == continues
    await second.update_weights(FromDisk(str(tmp_path)), "v2")
    await second.resume()
    assert second.fleet.by_state()[EngineState.SERVING] == 1
    assert not second.snapshot().engines()["vllm/0"].weights_lost
    assert len([e for e in sim.history() if e["op"] == "continue_generation"]) > len(continues)
    await sim.close()


async def test_a_vllm_kv_cache_is_asleep_until_the_continue_and_its_record_says_so() -> None:
    """vLLM's driver declares that its continue wakes the KV cache: between the KV resume and
    the continue the record says ``kv_asleep`` (the vLLM stand-in's KV cache is still asleep
    then), where an SGLang engine of the same fleet, which resumed it, is ``drained``; the
    continue wakes it and both serve."""
    vllm_sim, vllm, sglang_sim, sglang = mixed_pair()
    server = RolloutServer([EngineGroup("vllm", [vllm]), EngineGroup("sglang", [sglang])])
    seen: list[dict[str, Any]] = []

    async def before_continue(_: object) -> None:
        seen.append(
            {
                "vllm": server.fleet.get([EngineState.KV_ASLEEP]),
                "drained": server.fleet.get([EngineState.DRAINED]),
                "asleep": vllm_sim.state()["released_tags"],
                "sglang": sglang_sim.state()["released_tags"],
                "saved": server.snapshot().engines()["vllm/0"],
            }
        )

    server.on("before_continue", before_continue)
    await server.offload()
    await server.onload()
    (at,) = seen
    assert [r.id for r in at["vllm"]] == ["vllm/0"] and [r.id for r in at["drained"]] == [
        "sglang/0"
    ]
    assert at["asleep"] == ["kv_cache"] and at["sglang"] == []  # what each engine really holds
    assert at["saved"].kv_asleep and at["saved"].state is EngineState.KV_ASLEEP
    assert at["saved"].capabilities["family"] == "vllm"
    assert server.fleet.by_state()[EngineState.SERVING] == 2
    assert vllm_sim.state()["released_tags"] == [] and not vllm_sim.state()["paused"]
    for client in (vllm, sglang):
        await client.close()


async def test_fingerprints_come_in_each_drivers_declared_scheme_and_a_write_plans_with_it(
    tmp_path: Path,
) -> None:
    """Each client's fingerprint is in the scheme its driver declares; a verified write whose
    ``expected`` fingerprint is in a scheme neither engine of a mixed fleet hashes in is
    refused before anything is sent, naming each family's scheme; one per engine scheme goes."""
    vllm_sim, vllm, sglang_sim, sglang = mixed_pair()
    server = RolloutServer([EngineGroup("vllm", [vllm]), EngineGroup("sglang", [sglang])])
    await server.pause()
    await server.update_weights(FromDisk(str(tmp_path)), "v1")
    prints = {}
    for client in (vllm, sglang):
        found = Fingerprint.from_wire(await client.weight_fingerprint())
        assert found.scheme == client.capabilities.fingerprint_scheme
        prints[client.capabilities.family] = found
    assert prints["vllm"].scheme == VLLM_SCHEME and prints["sglang"].scheme == SGLANG_SCHEME
    sent = [len(s.history()) for s in (vllm_sim, sglang_sim)]
    with pytest.raises(InvalidArgument) as refused:
        foreign = Fingerprint(SIMULATED_SCHEME, prints["vllm"].tensors)
        await server.update_weights(FromDisk(str(tmp_path)), "v2", expected=foreign)
    assert "(the engines' schemes: 'sglang-sha256-64' (1 sglang); 'sha256' (1 vllm))" in str(
        refused.value
    )
    assert [len(s.history()) for s in (vllm_sim, sglang_sim)] == sent
    # what they hold, expected in each one's scheme: the write goes and both pass
    await server.update_weights(FromDisk(str(tmp_path)), "v2", expected=list(prints.values()))
    assert not any(r.unverified for r in server.snapshot().engines().values())
    await server.resume()
    assert server.state is ServerState.SERVING
    for client in (vllm, sglang):
        await client.close()


async def test_a_weight_write_the_vllm_driver_does_not_carry_is_refused_before_sending() -> None:
    """vLLM's driver writes weights only by a reload from disk: a tensor or collective push to
    a fleet with a vLLM engine is refused before any engine is sent anything, naming the
    engine, what the push sends and what the driver carries; the fleet stays drained, and an
    SGLang engine alone takes the same push."""
    vllm_sim, vllm, sglang_sim, sglang = mixed_pair()
    server = RolloutServer([EngineGroup("vllm", [vllm]), EngineGroup("sglang", [sglang])])
    await server.pause()
    sent = [len(s.history()) for s in (vllm_sim, sglang_sim)]
    collective = FromDistributed(["w"], ["float32"], [[1]], "g")
    tensors = FromTensor([base64.b64encode(pickle.dumps([("w", 1.0)])).decode()])
    for push, op in ((tensors, "tensor"), (collective, "distributed")):
        with pytest.raises(IllegalEngineOp) as refused:
            await server.update_weights(push, "v1")
        assert refused.value.engine == "vllm/0" and refused.value.op == "update_weights"
        assert refused.value.reason.startswith(
            f"{type(push).__name__} sends ['update_weights_from_{op}'], which the vllm driver "
            f"does not carry (it writes weights by ['update_weights_from_disk'])"
        )
    assert [len(s.history()) for s in (vllm_sim, sglang_sim)] == sent
    assert server.state is ServerState.DRAINED
    await server.resume()
    alone = RolloutServer([EngineGroup("sglang", [sglang])])
    await alone.pause()
    await alone.update_weights(tensors, "v1")
    assert [e["op"] for e in sglang_sim.history()].count("update_weights_from_tensor") == 1
    for client in (vllm, sglang):
        await client.close()


async def test_a_release_vllm_cannot_make_is_refused_before_anything_is_paused() -> None:
    """With ``release_tags`` naming the weights without the KV cache, an offload of a fleet
    with a vLLM engine is refused before any engine is paused: the driver's capabilities are
    read at first contact, with its incarnation; the refusal names the engine, the family and
    the fix, and the server still serves."""
    sim = SimulatedEngine("vllm", token_latency=0.001)
    app = create_vllm_app(sim)
    client = VLLMHTTPEngine(URL, transport=httpx.ASGITransport(app=app))
    server = RolloutServer(
        [EngineGroup("vllm", [client])], LifecycleConfig(release_tags=[Tag.WEIGHTS])
    )
    with pytest.raises(IllegalEngineOp, match=rf"vllm/0.*{NOT_WITHOUT_KV}"):
        await server.offload()
    assert server.state.value == "serving"
    assert not [e for e in sim.history() if e["op"] == "pause_generation"]
    assert not sim.state()["paused"]
    assert server.fleet.by_state()[EngineState.SERVING] == 1
    # A journal written before engines declared capabilities names the process, not them: a
    # server that adopts it reads them before its first call all the same.
    saved = server.snapshot().to_dict()
    (engine,) = saved["groups"][0]["engines"]
    assert engine["incarnation"] is not None and engine["capabilities"]["family"] == "vllm"
    del engine["capabilities"]
    again = VLLMHTTPEngine(URL, transport=httpx.ASGITransport(app=app))  # the same process
    adopter = RolloutServer(
        [EngineGroup("vllm", [again])], LifecycleConfig(release_tags=[Tag.WEIGHTS])
    )
    adopter.adopt(ServerSnapshot.from_dict(json.loads(json.dumps(saved))))
    assert next(iter(adopter.fleet.records())).capabilities is None
    with pytest.raises(IllegalEngineOp, match=NOT_WITHOUT_KV):
        await adopter.offload()
    assert not [e for e in sim.history() if e["op"] == "pause_generation"]
    for one in (client, again):
        await one.close()


#: vLLM 0.32.0's answer once an engine core died (create_error_response of EngineDeadError).
ENGINE_CORE_DIED = httpx.Response(
    500,
    json={
        "error": {
            "message": "EngineCore encountered an issue. See stack trace (above) for the root "
            "cause.",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    },
)


async def test_a_server_whose_engine_core_died_is_dead_and_its_requests_go_elsewhere() -> None:
    dead = FakeVLLM(v1_completions=lambda r: ENGINE_CORE_DIED)
    with pytest.raises(EngineDead, match=r"its engine core died \(vLLM's EngineDeadError\)"):
        await engine(dead).generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    other = FakeVLLM(v1_completions=lambda r: httpx.Response(500, json={"error": {"message": "x"}}))
    with pytest.raises(EngineRejected):  # another 500 is a refusal, as before
        await engine(other).generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    # through the generation client: sent again to the engine that lives, answered there
    alive = FakeVLLM()
    second = VLLMHTTPEngine("http://127.0.0.1:8001", transport=httpx.MockTransport(alive))
    server = RolloutServer([EngineGroup("vllm", [engine(dead), second])])
    answers = [
        await server.generate({"input_ids": [i], "sampling_params": {"max_new_tokens": 2}})
        for i in range(4)
    ]
    assert [a["output_ids"] for a in answers] == [[5, 6]] * 4
    assert server.generation.stats()["failed"] == 0
    assert server.generation.stats()["engine_deaths"] >= 1
