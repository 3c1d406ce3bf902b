"""The library's colocated cycle end to end on real SGLang 0.5.23 servers (CPU), with requests
in flight: an in-process HTTP engine, Ray engine actors over shared servers, and an engine the
library launches itself inside an actor.

Each run checks what it can see: every answer (none lost, every one full length, retracted or
resubmitted as the pause mode says), the real server afterwards (alive, serving, the weight
version), the server's state and ``snapshot()`` after each call, and the barriers and the
contract's fatal misuses on the timeline of engine calls (``lifecycle_checks``).

Requests are held in flight by their length while the servers are slowed (``slowed``), and a
pause is sent only once the servers' schedulers run them all (``admitted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from real.lifecycle_checks import (
    engine_calls,
    histories,
    ledger_violations,
    phase_names,
    phase_overlaps,
)
from real.servers import CPU_FLAGS, RealServer, RealSGLang, slowed
from structlog.testing import capture_logs
from wire.helpers import running_all

from rollout_lifecycle import (
    ALL_TAGS,
    EngineGroup,
    FromDisk,
    LifecycleConfig,
    PauseMode,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    free_port,
    launched_sglang_factory,
    sglang_http_factory,
    start_engine_actor,
)
from rollout_lifecycle.testing import cycle_order_violations, released_ops

pytestmark = pytest.mark.real_sglang

S = ServerState
#: The acceptance scenario's request length.
TOKENS = 300
#: Requests a pause must find decoding on every engine (a retraction shows only on a request that
#: was running when the pause landed; a flush is refused only while one is). ``admitted`` waits
#: until the schedulers run them all, and fails if one finished first. Four per server fit its
#: KV cache (``--max-total-tokens 4096``) and the model's 2048 positions.
LONG = 900
#: Seconds a server's scheduler sleeps in every batch while a test stages a pause (``slowed``).
#: At full speed (up to ~400 tokens/s here) a LONG request lasts a few seconds, and on a loaded
#: machine the requests of one actor reached their server seconds after the other's, and a
#: pause through an actor took up to 5.5 s to land: a server finished its requests first.
#: Slowed, a LONG request lasts over 900 * 0.25 = 225 s, longer than ``admitted`` and the pause
#: may take together (deadlines of 120 s and 60 s): a server that runs its requests still runs
#: them when the pause lands, or the pause itself has failed. (TOKENS last 75 s so: enough for
#: one server the library calls in-process, where nothing staggers and a pause lands at once.)
SLOW_STEP_S = 0.25
ALL = tuple(t.value for t in ALL_TAGS)
KV_ONLY = ("kv_cache", "cuda_graph")

# The phases each call runs on these fleets (one group kind: every engine offloads).
OFFLOAD_PHASES = ["pause", "flush", "release"]
ONLOAD_WEIGHTS_PHASES = ["resume_weights"]
# In weights_restored the KV cache is released: nothing to flush after the write.
UPDATE_PHASES = [
    "begin_weight_update",
    "push",
    "end_weight_update",
    "update_weight_version",
    "flush_after_update",
]
ONLOAD_KV_PHASES = ["resume_kv", "check_versions", "continue"]


def request(i: int, tokens: int = TOKENS) -> dict[str, Any]:
    """A generate request of exactly ``tokens`` new tokens (random weights: no eos)."""
    return {
        "input_ids": [11 + i, 23, 5 + i, 42],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }


async def post_generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Any:
    answer = await client.post(f"{url}/generate", json=body)
    answer.raise_for_status()
    return answer.json()


async def admitted(
    urls: Sequence[str], traffic: Sequence[asyncio.Future[Any]], requests: int | None = None
) -> None:
    """Return once the servers run ``requests`` requests between them (by default one per
    future of ``traffic``), none waiting: then a pause finds each one decoding."""
    wanted = len(traffic) if requests is None else requests
    async with httpx.AsyncClient(timeout=60) as client:
        await running_all(client, traffic, wanted, urls=urls, deadline=120, every=0.05)


def assert_engines(server: RolloutServer, state: ServerState, **expected: Any) -> None:
    """The server is in ``state`` and every engine's snapshot has the ``expected`` fields."""
    snapshot = server.snapshot()
    assert server.state is state and snapshot.state is state
    for engine in snapshot.engines().values():
        seen = {k: getattr(engine, k) for k in expected}
        assert seen == expected, f"{engine.id}: {engine}"
        assert engine.alive and not engine.uncertain and not engine.pause_unknown
        assert not engine.session_unknown and not engine.stale
        assert engine.last_outcome == "ok", f"{engine.id}: {engine}"


async def cycle(
    server: RolloutServer,
    model: str,
    version: str,
    mode: PauseMode,
    traffic: Sequence[asyncio.Future[Any]] = (),
) -> list[int]:
    """offload -> onload_weights -> update_weights(FromDisk) -> onload_kv, asserting the state,
    the snapshot and the phases after each call. Returns the indexes of ``traffic`` still
    unanswered when the offload returned: by then every engine acknowledged the pause and two
    more calls (flush, release), so those requests were running or waiting at the pause."""
    await server.offload()
    unanswered = [i for i, request in enumerate(traffic) if not request.done()]
    assert phase_names(server, "offload") == OFFLOAD_PHASES
    assert_engines(
        server, S.RELEASED, paused=True, pause_mode=mode.value, flushed=True, released=ALL
    )
    await server.onload_weights()
    assert phase_names(server, "onload_weights") == ONLOAD_WEIGHTS_PHASES
    assert_engines(server, S.WEIGHTS_RESTORED, paused=True, pause_mode=mode.value, released=KV_ONLY)
    await server.update_weights(FromDisk(model), version=version)
    assert phase_names(server, "update_weights") == UPDATE_PHASES
    assert server.expected_version == version
    assert_engines(server, S.WEIGHTS_RESTORED, paused=True, pause_mode=mode.value, released=KV_ONLY)
    await server.onload_kv()
    assert phase_names(server, "onload_kv") == ONLOAD_KV_PHASES
    assert_engines(server, S.SERVING, paused=False, pause_mode=None, flushed=False, released=())
    return unanswered


def assert_retracted(answers: Sequence[dict[str, Any]], unanswered: Sequence[int]) -> None:
    """Every request the retract pause found unfinished was retracted, not aborted; at least
    one was (else the cycle showed nothing about the pause)."""
    assert unanswered, "every request finished before the pause; none was retracted"
    for i in unanswered:
        assert answers[i]["meta_info"]["num_retractions"] >= 1, (i, answers[i]["meta_info"])


def assert_invariants(server: RolloutServer, cycles: int) -> None:
    """Every invariant the test kit checks, on the timeline: barriers, one release per engine
    per cycle, the contract's fatal misuses, no overlapping phases, every engine call ok."""
    found = histories(server, ALL)
    assert set(found) == set(server.engines())
    assert cycle_order_violations(found) == []
    assert ledger_violations(found) == []
    assert phase_overlaps(server) == []
    for engine, history in found.items():
        assert len(released_ops(history)) == cycles, engine
        ops = [e["op"] for e in history]
        assert ops.count("pause_generation") == cycles, (engine, ops)
        assert ops.count("continue_generation") == cycles, (engine, ops)
        assert "health" not in ops and "health_generate" not in ops
    assert {s.outcome for s in engine_calls(server)} == {"ok"}


async def assert_serving(real: RealServer, version: str) -> None:
    """The real server is alive, ready (not paused), reports ``version`` and generates."""
    assert real.alive(), real.output()
    async with httpx.AsyncClient(timeout=120) as client:
        assert (await client.get(f"{real.url}/ready")).status_code == 200
        info = (await client.get(f"{real.url}/model_info")).json()
        assert info["weight_version"] == version
        answer = await post_generate(client, real.url, request(7, tokens=4))
    assert len(answer["output_ids"]) == 4


def tally(answers: Sequence[dict[str, Any]], sent: int, started: float) -> str:
    """One line for the log (``-rP``): what was sent, what came back, how it was kept."""
    meta = [a["meta_info"] for a in answers]
    return (
        f"sent={sent} completed={len(answers)} lost={sent - len(answers)} "
        f"resubmissions={[m.get('num_resubmissions', 0) for m in meta]} "
        f"retractions={[m['num_retractions'] for m in meta]} "
        f"wall={time.monotonic() - started:.1f}s"
    )


def assert_full(answers: Sequence[dict[str, Any]], tokens: int) -> None:
    for answer in answers:
        assert len(answer["output_ids"]) == tokens, answer["meta_info"]
        assert answer["meta_info"]["finish_reason"]["type"] == "length", answer["meta_info"]


# ------------------------------------------------------------------ 1. the acceptance scenario


async def test_default_offload_cycle_keeps_six_requests_in_flight_on_one_real_server(
    real_sglang: RealSGLang, real_servers: list[RealServer]
) -> None:
    """The default config (retract pause, client-retried flush) on one real server with six
    300-token requests in flight: the cycle completes, all six finish full length, those the
    pause found running after a retraction, the server reports the new version and keeps
    serving."""
    real = real_servers[0]
    started = time.monotonic()
    engine = SGLangHTTPEngine(real.url)
    server = RolloutServer([EngineGroup("actor", [engine])], config=LifecycleConfig())
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            async with slowed([real.url], SLOW_STEP_S):
                traffic = [
                    asyncio.ensure_future(post_generate(client, real.url, request(i)))
                    for i in range(6)
                ]
                await admitted([real.url], traffic)
                unanswered = await cycle(
                    server, real_sglang.model, "v1", PauseMode.RETRACT, traffic
                )
            answers = await asyncio.wait_for(asyncio.gather(*traffic), timeout=600)
        print(tally(answers, 6, started), server.metrics)
        assert_full(answers, TOKENS)
        assert_retracted(answers, unanswered)
        assert {a["meta_info"]["weight_version"] for a in answers} == {"v1"}
        assert await engine.weight_version() == "v1"
        await assert_serving(real, "v1")
        assert_invariants(server, cycles=1)
    finally:
        await engine.close()


# ------------------------------------------------------- 2. Ray engine actors over two servers


@pytest.fixture
async def actor_server(
    ray_cluster: None, real_servers: list[RealServer]
) -> AsyncIterator[tuple[list[Any], list[RealServer]]]:
    """A Ray engine actor over each of the two shared real servers; killed at the end."""
    actors = [start_engine_actor(sglang_http_factory(r.url)) for r in real_servers]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.ping.remote() for a in actors)), 60)
        yield actors, real_servers
    finally:
        for actor in actors:
            ray.kill(actor)


def versions_of(answer: dict[str, Any]) -> list[str]:
    return [span["version"] for span in answer["meta_info"]["weight_versions"]]


async def test_retract_cycle_over_two_real_actors_loses_nothing_and_retracts_what_was_running(
    real_sglang: RealSGLang, actor_server: tuple[list[Any], list[RealServer]]
) -> None:
    actors, reals = actor_server
    server = RolloutServer([EngineGroup("actor", actors)])
    started = time.monotonic()
    async with slowed([r.url for r in reals], SLOW_STEP_S):
        traffic = [asyncio.ensure_future(server.generate(request(i, LONG))) for i in range(8)]
        await admitted([r.url for r in reals], traffic)
        unanswered = await cycle(
            server, real_sglang.model, "v2-retract", PauseMode.RETRACT, traffic
        )
    answers = await asyncio.wait_for(asyncio.gather(*traffic), timeout=600)
    print(tally(answers, 8, started), server.generation.stats())

    assert_full(answers, LONG)
    assert_retracted(answers, unanswered)
    assert all(a["meta_info"]["num_resubmissions"] == 0 for a in answers)
    # Each engine ran some of them, one attempt each.
    assert {a["meta_info"]["engines"][0] for a in answers} == {"actor/0", "actor/1"}
    stats = server.generation.stats()
    assert (stats["submitted"], stats["completed"], stats["failed"]) == (8, 8, 0)
    assert stats["resubmissions"] == 0 and stats["retractions"] >= 8
    for real in reals:
        await assert_serving(real, "v2-retract")
    assert_invariants(server, cycles=1)


async def test_abort_cycle_over_two_real_actors_resubmits_every_aborted_request_to_full_length(
    real_sglang: RealSGLang, actor_server: tuple[list[Any], list[RealServer]]
) -> None:
    actors, reals = actor_server
    config = LifecycleConfig(pause_mode=PauseMode.ABORT)
    server = RolloutServer([EngineGroup("actor", actors)], config=config)
    started = time.monotonic()
    with capture_logs() as logs:
        async with slowed([r.url for r in reals], SLOW_STEP_S):
            sent = [dict(request(i, LONG), rid=f"abort-cycle-{i}") for i in range(8)]
            traffic = [asyncio.ensure_future(server.generate(r)) for r in sent]
            await admitted([r.url for r in reals], traffic)
            unanswered = await cycle(
                server, real_sglang.model, "v3-abort", PauseMode.ABORT, traffic
            )
        answers = await asyncio.wait_for(asyncio.gather(*traffic), timeout=600)
    print(tally(answers, 8, started), server.generation.stats())
    why = {}  # request id -> why each resubmission was made, in order
    for event in logs:
        if event["event"] == "generate.resubmit":
            why.setdefault(event["rid"], []).append(event["why"])

    assert_full(answers, LONG)
    # What the pause found running came back aborted with part of its output, was held while
    # offloaded and resubmitted once serving again; the resubmitted part ran on the new weights.
    # (A resubmission beyond that one is the client recovering from something else, such as a
    # connection lost under load: allowed, and shown here with its cause.)
    assert unanswered, "every request finished before the pause; none was aborted"
    for i in unanswered:
        meta, reasons = answers[i]["meta_info"], why.get(f"abort-cycle-{i}", [])
        assert meta["num_resubmissions"] == len(reasons) >= 1, (i, meta["engines"], reasons)
        assert len(meta["engines"]) == len(reasons) + 1, (i, meta["engines"], reasons)
        assert reasons[0].startswith("aborted on engine actor/"), (i, reasons)
        # never aborted again: nothing was sent to an engine the pause still held
        assert all(" was lost " in r for r in reasons[1:]), (i, reasons)
        assert versions_of(answers[i])[-1] == "v3-abort"
        if len(reasons) > 1:
            print(f"request {i} was resubmitted {len(reasons)} times: {reasons}")
    stats = server.generation.stats()
    assert (stats["submitted"], stats["completed"], stats["failed"]) == (8, 8, 0)
    assert stats["resubmissions"] == sum(len(r) for r in why.values())
    assert set(why) == {f"abort-cycle-{i}" for i in unanswered}
    for real in reals:
        await assert_serving(real, "v3-abort")
    assert_invariants(server, cycles=1)


async def test_in_place_pause_around_a_weight_update_keeps_requests_and_their_kv_cache(
    real_sglang: RealSGLang, actor_server: tuple[list[Any], list[RealServer]]
) -> None:
    """``paused()`` with ``pause_mode=in_place``: nothing is flushed (a real server refuses to
    flush while requests keep their KV cache) nor released; the update writes under the frozen
    requests, which then finish on the new weights without a retraction or a resubmission."""
    actors, reals = actor_server
    config = LifecycleConfig(pause_mode=PauseMode.IN_PLACE)
    server = RolloutServer([EngineGroup("actor", actors)], config=config)
    started = time.monotonic()
    async with slowed([r.url for r in reals], SLOW_STEP_S):
        batch = asyncio.ensure_future(server.generate_batch([request(i, LONG) for i in range(8)]))
        await admitted([r.url for r in reals], [batch], 8)
        async with server.paused():
            assert phase_names(server, "pause") == ["pause"]
            assert_engines(server, S.DRAINED, paused=True, pause_mode="in_place", released=())
            assert all(not e.flushed for e in server.snapshot().engines().values())
            # What the library does not send: a flush here is refused, the requests keep running.
            async with httpx.AsyncClient(timeout=60) as client:
                for real in reals:
                    refused = await client.post(f"{real.url}/flush_cache")
                    assert refused.status_code == 400, refused.text
            await server.update_weights(FromDisk(real_sglang.model), version="v4-in-place")
            # Drained, not released: the update runs without a flush after it.
            assert phase_names(server, "update_weights") == [
                "begin_weight_update",
                "push",
                "end_weight_update",
                "update_weight_version",
                "flush_after_update",
            ]
            assert not [
                s for s in engine_calls(server, "update_weights") if s.name == "flush_cache"
            ]
            assert_engines(server, S.DRAINED, paused=True, pause_mode="in_place", released=())
    assert phase_names(server, "resume") == ["check_versions", "continue"]
    assert_engines(server, S.SERVING, paused=False, pause_mode=None, released=())
    answers = await asyncio.wait_for(batch, timeout=600)
    print(tally(answers, 8, started), server.generation.stats())

    assert_full(answers, LONG)
    assert all(a["meta_info"]["num_retractions"] == 0 for a in answers)
    assert all(a["meta_info"]["num_resubmissions"] == 0 for a in answers)
    # One attempt each, finished on the new weights. (SGLang 0.5.23 attributes the whole
    # output of a request frozen in place to the new version: its spans do not split.)
    assert all(versions_of(a)[-1] == "v4-in-place" for a in answers)
    for real in reals:
        await assert_serving(real, "v4-in-place")
    spans = histories(server, ALL)
    assert cycle_order_violations(spans) == [] and ledger_violations(spans) == []
    for history in spans.values():
        ops = [e["op"] for e in history]
        assert "flush_cache" not in ops and "release_memory_occupation" not in ops
        assert ops.count("pause_generation") == ops.count("continue_generation") == 1
    assert phase_overlaps(server) == []


# ---------------------------------------------- 3. an engine the library launches in an actor


def process_group(leader: int) -> list[int]:
    """Live processes (not zombies) of the process group led by ``leader``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == leader and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def launched_server_pid(port: int) -> int:
    """The pid of the ``sglang.launch_server`` process serving ``port``."""
    wanted = ["sglang.launch_server", "--port", str(port)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if wanted[0] in argv and any(
                a == wanted[1] and b == wanted[2] for a, b in itertools.pairwise(argv)
            ):
                return int(entry.name)
    raise AssertionError(f"no sglang.launch_server process on port {port}")


async def test_launched_engine_in_an_actor_runs_the_cycle_with_a_shared_server_then_stops(
    real_sglang: RealSGLang, ray_cluster: None, real_servers: list[RealServer]
) -> None:
    """``launched_sglang_factory`` inside a Ray actor starts its own CPU server; with a shared
    server beside it in one ``RolloutServer`` the cycle keeps eight requests, and closing the
    engine stops its whole process group."""
    port = free_port()
    factory = launched_sglang_factory(
        real_sglang.model,
        port=port,
        python=real_sglang.python,
        memory_saver=False,
        env=real_sglang.child_env(),
        extra_args=list(CPU_FLAGS),
    )
    launched = start_engine_actor(factory)
    shared = start_engine_actor(sglang_http_factory(real_servers[0].url))
    url = f"http://127.0.0.1:{port}"
    leader: int | None = None
    try:
        # The first call starts the server and waits for /ready (a start-up of tens of seconds).
        info = await asyncio.wait_for(launched.server_info.remote(), 900)
        assert info["version"] == "0.5.23"
        # what the router binding registers it as: a regular server, not a prefill/decode half
        # (sglang: arg_groups/fields/disagg.py Disagg.disaggregation_mode, bootstrap port 8998)
        assert info["disaggregation_mode"] == "null"
        assert info["disaggregation_bootstrap_port"] == 8998
        # The shared server's actor is started too, or its half of the traffic arrives seconds
        # after the launched server's (a new Ray worker), which can finish its half meanwhile.
        assert await asyncio.wait_for(shared.ping.remote(), 120)
        leader = launched_server_pid(port)
        assert process_group(leader)
        server = RolloutServer(
            [EngineGroup("launched", [launched]), EngineGroup("shared", [shared])]
        )
        started = time.monotonic()
        async with slowed([url, real_servers[0].url], SLOW_STEP_S):
            traffic = [asyncio.ensure_future(server.generate(request(i, LONG))) for i in range(8)]
            await admitted([url, real_servers[0].url], traffic)
            unanswered = await cycle(
                server, real_sglang.model, "v5-launched", PauseMode.RETRACT, traffic
            )
        answers = await asyncio.wait_for(asyncio.gather(*traffic), timeout=600)
        print(tally(answers, 8, started), server.generation.stats())

        assert_full(answers, LONG)
        assert_retracted(answers, unanswered)
        assert {a["meta_info"]["engines"][0] for a in answers} == {"launched/0", "shared/0"}
        assert await launched.weight_version.remote() == "v5-launched"
        await assert_serving(real_servers[0], "v5-launched")
        assert_invariants(server, cycles=1)

        await asyncio.wait_for(launched.close.remote(), 120)
        assert process_group(leader) == []
        async with httpx.AsyncClient(timeout=5) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{url}/ready")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(launched.close.remote(), 120)
        ray.kill(launched)
        ray.kill(shared)
        if leader is not None and process_group(leader):
            os.killpg(leader, signal.SIGKILL)
