"""The weight-update loop: phase hooks, versioned updates, stale engines, the slime-order defect."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    FromDistributed,
    HookFailed,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleConfig,
    LifecycleEvent,
    PauseMode,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    StaleWeights,
    WeightPushFailed,
    WeightUpdate,
)
from rollout_lifecycle.testing import until
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import received_ops as ops
from rollout_lifecycle.testing.fleets import simulated_engines as sims


def decoded(engines: list[SimulatedEngine]) -> int:
    """The tokens ``engines`` have decoded so far."""
    return sum(e.stats()["tokens"] for e in engines)


def decoding_since(
    tokens: int, engines: list[SimulatedEngine], batch: asyncio.Future[Any]
) -> Callable[[], bool]:
    """Whether ``engines`` have decoded more than ``tokens`` tokens, or ``batch`` is done."""
    return lambda: batch.done() or decoded(engines) > tokens


async def test_generation_cannot_continue_after_the_update_while_kv_is_released() -> None:
    """slime's order (update weights, then continue, with KV still released) is refused."""
    engines = sims(3)
    group = EngineGroup("actor", engines)
    server = RolloutServer([group])
    await server.offload()
    await server.onload_weights()
    await server.update_weights(FromDisk("/ckpt/1"), version="v1")
    assert server.state is ServerState.WEIGHTS_RESTORED
    with pytest.raises(IllegalTransition) as err:
        await server.resume()
    assert err.value.state == "weights_restored"
    with pytest.raises(IllegalEngineOp, match="kv_cache"):
        group.continue_generation()

    async def continue_too_early(event: LifecycleEvent) -> None:
        await event.server.resume()

    remove = server.on("after_update_weights", continue_too_early)
    with pytest.raises(HookFailed) as hook_err:
        await server.update_weights(FromDisk("/ckpt/1"), version="v1")
    assert isinstance(hook_err.value.__cause__, IllegalTransition)
    remove()
    assert all("continue_generation" not in ops(e) for e in engines)
    assert all(not e.dead for e in engines)
    await server.onload_kv()
    assert server.state is ServerState.SERVING


async def test_after_n_steps_every_engine_reports_version_n() -> None:
    actor, reward = sims(3, "a"), sims(2, "r")
    server = RolloutServer(
        [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    )
    for step in range(1, 6):
        await server.offload()
        await server.onload_weights()
        await server.update_weights(FromDisk(f"/ckpt/{step}"), version=f"step-{step}")
        await server.onload_kv()
    versions = await asyncio.gather(*(e.weight_version() for e in actor + reward))
    assert versions == ["step-5"] * 5
    assert server.expected_version == "step-5"
    for engine in reward:  # paused around each write, continued after it, never released
        history = ops(engine)
        assert "release_memory_occupation" not in history
        assert history.count("pause_generation") == history.count("continue_generation") == 5
        assert not engine.state()["paused"]


async def test_an_engine_that_missed_the_update_blocks_continue_with_stale_weights() -> None:
    inner = sims(3)
    engines = [FaultyEngine(e) for e in inner]
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.offload()
    await server.onload_weights()
    engines[1].arm("update_weights_from_disk", "reject")
    with pytest.raises(WeightPushFailed) as err:  # the built-in push's own error, as it is
        await server.update_weights(FromDisk("/ckpt/2"), version="v2")
    assert list(err.value.failures) == ["actor/1"]
    assert server.state is ServerState.WEIGHTS_RESTORED  # (where it was: the update may retry)
    with pytest.raises(StaleWeights) as stale:
        await server.onload_kv()
    assert stale.value.engines == {"actor/1": "default"} and stale.value.expected == "v2"
    assert server.state is ServerState.KV_RESTORED  # KV is back; generation stays paused
    infos = [e.state() for e in inner]
    assert all(i["paused"] for i in infos)
    await server.update_weights(FromDisk("/ckpt/2"), version="v2")  # the retry reaches it
    await server.onload_kv()
    assert server.state is ServerState.SERVING
    assert [await e.weight_version() for e in inner] == ["v2"] * 3


async def test_the_prefix_cache_is_flushed_after_each_update() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    for step in range(3):
        await asyncio.gather(
            *(e.generate({"input_ids": [1, 2, step], "sampling_params": {}}) for e in engines)
        )
        assert all(e.stats()["prefix_cache_size"] > 0 for e in engines)
        async with server.paused():  # a non-colocated sync keeps the KV cache resident
            await server.update_weights(FromDisk(f"/ckpt/{step}"), version=f"v{step}")
        assert all(e.stats()["prefix_cache_size"] == 0 for e in engines)
        for engine in engines:
            history = ops(engine)
            last_write = max(i for i, op in enumerate(history) if op == "update_weights_from_disk")
            assert "flush_cache" in history[last_write:]


async def test_phase_hooks_run_in_the_documented_order() -> None:
    server = RolloutServer([EngineGroup("actor", sims(2))])
    seen: list[str] = []

    def record(event: LifecycleEvent) -> None:
        seen.append(event.event)

    for event in (
        *(s.value for s in ServerState),
        *(
            f"{w}_{p}"
            for p in ("pause", "flush", "release", "resume_weights")
            for w in ("before", "after")
        ),
        *(
            f"{w}_{p}"
            for p in ("update_weights", "resume_kv", "continue")
            for w in ("before", "after")
        ),
    ):
        server.on(event, record)

    async def push(update: WeightUpdate) -> None:
        seen.append("push")

    await server.offload()
    await server.onload_weights()
    await server.update_weights(push, version="v1")
    await server.onload_kv()
    assert seen == [
        "pausing",
        "before_pause",
        "before_flush",
        "after_pause",
        "after_flush",
        "drained",
        "before_release",
        "after_release",
        "released",
        "before_resume_weights",
        "after_resume_weights",
        "weights_restored",
        "before_update_weights",
        "push",
        "after_update_weights",
        "before_resume_kv",
        "after_resume_kv",
        "kv_restored",
        "before_continue",
        "after_continue",
        "serving",
    ]


async def test_a_before_hook_that_raises_sends_nothing_and_a_retry_works() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    refusals = {"before_release": 1, "before_flush": 1}

    def refuse_once(event: LifecycleEvent) -> None:
        if refusals.get(event.event, 0) > 0:
            refusals[event.event] -= 1
            raise RuntimeError(f"not now ({event.event})")

    server.on("before_flush", refuse_once)
    server.on("before_release", refuse_once)
    with pytest.raises(HookFailed, match="before_flush"):
        await server.offload()
    # The drain was refused half-way: what it paused was continued, and it is serving again.
    assert server.state is ServerState.SERVING
    assert all(ops(e) == ["pause_generation", "continue_generation"] for e in engines)
    with pytest.raises(HookFailed, match="before_release"):
        await server.offload()
    assert server.state is ServerState.DRAINED  # the last completed state; nothing released
    assert all("release_memory_occupation" not in ops(e) for e in engines)
    await server.offload()
    assert server.state is ServerState.RELEASED
    await server.onload()
    assert all(not e.dead for e in engines)


@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.ABORT])
async def test_no_request_is_lost_across_ten_update_cycles(
    mode: PauseMode, capsys: pytest.CaptureFixture[str]
) -> None:
    engines = [SimulatedEngine(f"e{i}", token_latency=0.002) for i in range(4)]
    server = RolloutServer(
        [
            EngineGroup("actor", engines[:3]),
            EngineGroup("reward", engines[3:], needs_offload=False),
        ],
        LifecycleConfig(pause_mode=mode),
    )
    requests = [
        {"input_ids": [i, 5], "sampling_params": {"max_new_tokens": 40 + i % 30}} for i in range(48)
    ]
    batch = asyncio.ensure_future(server.generate_batch(requests))
    for cycle in range(10):
        # Decoding between steps: a token more than at the last onload (or every request done).
        await until(decoding_since(decoded(engines), engines, batch), what="decoding")
        await server.offload()
        await server.onload_weights()
        await server.update_weights(FromDisk(f"/ckpt/{cycle}"), version=f"v{cycle}")
        await server.onload_kv()
    results = await asyncio.wait_for(batch, timeout=60)
    completed = sum(
        r["meta_info"]["finish_reason"]["type"] == "length"
        and len(r["output_ids"]) == q["sampling_params"]["max_new_tokens"]
        for r, q in zip(results, requests, strict=True)
    )
    resubmitted = sum(r["meta_info"]["num_resubmissions"] for r in results)
    aborted_by_engines = sum(e.stats().get("aborted", 0) for e in engines)
    with capsys.disabled():
        print(
            f"\n[{mode.value}] 10 update cycles: submitted={len(requests)} completed={completed} "
            f"aborted={aborted_by_engines} resubmitted={resubmitted} "
            f"retractions={sum(r['meta_info']['num_retractions'] for r in results)}"
        )
    assert completed == len(requests)
    if mode is PauseMode.RETRACT:
        assert aborted_by_engines == resubmitted == 0
    else:
        assert resubmitted == aborted_by_engines > 0  # every abort was resubmitted


async def test_cancelling_a_call_made_from_a_hook_settles_its_phase_and_records_stay_true() -> None:
    inner = sims(2)
    engines = [FaultyEngine(e) for e in inner]
    server = RolloutServer([EngineGroup("actor", engines)])
    engines[0].arm("resume_memory_occupation", "slow", seconds=0.3)

    async def impatient(event: LifecycleEvent) -> None:
        await asyncio.wait_for(event.server.onload_weights(), 0.05)

    remove = server.on("released", impatient)
    with pytest.raises(HookFailed) as err:
        await server.offload()
    remove()
    assert isinstance(err.value.__cause__, TimeoutError)
    # The nested resume was settled, not abandoned: records and engines agree.
    assert server.state is ServerState.WEIGHTS_RESTORED
    for record, engine in zip(server.snapshot().engines().values(), inner, strict=True):
        released = tuple(t for t, b in engine.memory().items() if b == 0)
        assert set(record.released) == set(released) == {"kv_cache", "cuda_graph"}
    await server.onload()
    assert server.state is ServerState.SERVING and not any(e.dead for e in inner)


async def test_recover_heals_engines_that_a_part_way_failure_left_behind() -> None:
    inner = sims(3)
    engines = [FaultyEngine(e) for e in inner]
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.offload()
    engines[0].arm("resume_memory_occupation", "reject")
    with pytest.raises(PhaseFailed) as err:
        await server.onload_weights()
    assert err.value.failed_engines == ["actor/0"]
    assert server.state is ServerState.FAILED
    # Two engines have their weights back, one does not: recover() moves it to its peers.
    outcomes = await server.recover(lambda engine_id: pytest.fail("nothing to replace"))
    assert outcomes["actor/0"].ok
    assert server.state is ServerState.WEIGHTS_RESTORED
    assert {e.released for e in server.snapshot().engines().values()} == {
        ("kv_cache", "cuda_graph")
    }
    await server.onload()
    assert server.state is ServerState.SERVING
    assert all(all(b > 0 for b in e.memory().values()) for e in inner)


async def test_a_caller_cancelled_in_a_pausing_hook_cancels_it_and_never_leaves_pausing() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    entered = asyncio.Event()
    hook_cancelled: list[bool] = []

    async def linger(event: LifecycleEvent) -> None:
        entered.set()
        try:
            await asyncio.sleep(30)  # the caller is cancelled while the server is in pausing
        except asyncio.CancelledError:
            hook_cancelled.append(True)
            raise

    server.on("pausing", linger)
    task = asyncio.ensure_future(server.offload())
    await asyncio.wait_for(entered.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)  # not the hook's 30 s
    assert hook_cancelled == [True]
    # The hook ran before the drain sent anything: the call stops where it started.
    assert server.state is ServerState.SERVING
    assert all("release_memory_occupation" not in ops(e) for e in engines)


async def test_a_pausing_hook_that_raises_returns_the_server_to_serving() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    remove = server.on("pausing", lambda event: 1 / 0)
    with pytest.raises(HookFailed, match="pausing"):
        await server.offload()
    assert server.state is ServerState.SERVING
    assert all(ops(e) == [] for e in engines)  # nothing was sent
    remove()
    await server.offload()
    assert server.state is ServerState.RELEASED


async def test_the_generation_client_skips_a_replacement_until_it_has_the_version() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    async with server.paused():
        await server.update_weights(FromDisk("/ckpt/1"), version="v1")
    await engines[1].close()  # it dies; its replacement starts on the initial weights
    await server.probe()
    fresh = SimulatedEngine("fresh", token_latency=0.001)
    await server.recover(lambda engine_id: fresh)
    assert server.snapshot().engines()["actor/1"].stale
    answers = await server.generate_batch(
        [{"input_ids": [i], "sampling_params": {"max_new_tokens": 4}} for i in range(6)]
    )
    assert {a["meta_info"]["weight_version"] for a in answers} == {"v1"}
    assert fresh.stats()["completed"] == 0  # nothing was routed to the stale replacement
    async with server.paused():
        await server.update_weights(FromDisk("/ckpt/1"), version="v1")
    assert not server.snapshot().engines()["actor/1"].stale
    await server.generate_batch(
        [{"input_ids": [i], "sampling_params": {"max_new_tokens": 4}} for i in range(6)]
    )
    assert fresh.stats()["completed"] > 0


async def test_from_distributed_joins_the_group_writes_and_leaves_on_every_engine() -> None:
    # Each engine an SGLang HTTP client (httpx.MockTransport): what the strategy sends.
    import json

    import httpx

    from rollout_lifecycle import EngineHost, SGLangHTTPEngine

    seen: dict[str, list[tuple[str, dict[str, object]]]] = {"a": [], "b": []}

    def server(name: str) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            seen[name].append((request.url.path, json.loads(request.content)))
            return httpx.Response(200, json={"success": True, "message": "ok"})

        return httpx.MockTransport(handler)

    hosts = {
        n: EngineHost(
            SGLangHTTPEngine(f"http://{n}.test:30000", transport=server(n), check_version=False)
        )
        for n in seen
    }
    push = FromDistributed(
        names=["w"],
        dtypes=["bfloat16"],
        shapes=[[4, 4]],
        group_name="wg",
        load_format="direct",
        master_address="10.0.0.1",
        master_port=29500,
        world_size=3,
        rank_offsets={"a": 1, "b": 2},
    )
    await push(WeightUpdate(version="v5", engines=hosts))
    for name, offset in (("a", 1), ("b", 2)):
        paths = [p for p, _ in seen[name]]
        assert paths == [
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
        ]
        join, write, leave = (body for _, body in seen[name])
        assert join == {
            "master_address": "10.0.0.1",
            "master_port": 29500,
            "rank_offset": offset,
            "world_size": 3,
            "group_name": "wg",
            "backend": "nccl",
        }
        assert write["group_name"] == "wg" and write["load_format"] == "direct"
        assert write["weight_version"] == "v5" and write["abort_all_requests"] is False
        assert leave == {"group_name": "wg"}
    with pytest.raises(InvalidArgument, match="go together"):
        FromDistributed(["w"], ["f"], [[1]], "wg", master_address="10.0.0.1")
    with pytest.raises(InvalidArgument, match="no rank offset"):
        partial = FromDistributed(["w"], ["f"], [[1]], "wg", None, "10.0.0.1", 29500, 3, {"a": 1})
        await partial(WeightUpdate(version=None, engines=hosts))
