"""A unit of two real SGLang 0.5.23 servers (``EngineGroup(unit=2)``: servers that live and
restart together) beside a single server, behind a real sglang-router, with requests decoding
through the library's generation client: one member is killed between the release and the
resume; the resume fails naming it dead and its unit unhealthy, ``recover(unit_factory=...)``
restarts both members together (never one), the weights pushed are verified on all three, and
every request finishes full length. The router never lists half of the unit: read after every
call (the binding adds a unit's members in one sync and takes them out in one), and read every
50 ms from the death until the unit is back (the survivor is never listed alone)."""

from __future__ import annotations

import asyncio

import pytest
from real.checkpoints import trainer_fingerprint
from real.servers import RealServer, RealSGLang, restart_all, slowed
from real.test_real_lifecycle import (
    SLOW_STEP_S,
    TOKENS,
    admitted,
    assert_full,
    assert_serving,
    request,
)
from system.router_traffic import every_listed, watching

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    FromDisk,
    LaunchedRouter,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
)
from rollout_lifecycle.backends.sglang.client import SGLangHTTPEngine
from rollout_lifecycle.contract.urls import url_identity

pytestmark = pytest.mark.real_sglang


async def test_a_member_killed_between_release_and_resume_has_its_unit_replaced_whole(
    real_sglang: RealSGLang, real_servers: list[RealServer], disposable_real_server: RealServer
) -> None:
    # the unit: a shared server (restarted by the unit factory: it is left serving, as the
    # pool's shared servers must be) and one this test kills
    single, model = real_servers[0], real_sglang.model
    unit_servers = [real_servers[1], disposable_real_server]
    urls = [single.url, *(s.url for s in unit_servers)]
    unit_ids = {url_identity(s.url) for s in unit_servers}
    expected = await asyncio.to_thread(trainer_fingerprint, real_sglang, model, "sglang")
    engines = [SGLangHTTPEngine(url) for url in urls]
    made: list[SGLangHTTPEngine] = []
    asked: list[tuple[str, ...]] = []

    def restart_unit(ids: tuple[str, ...]) -> list[SGLangHTTPEngine]:
        asked.append(ids)
        restart_all(unit_servers, hold=[single])  # the survivor too: a unit restarts together
        made.extend(SGLangHTTPEngine(s.url) for s in unit_servers)
        return made[-2:]

    config = LifecycleConfig(deadlines=Deadlines(startup=900.0))
    seen: list[frozenset[str]] = []
    async with LaunchedRouter() as launched:
        router = launched.client()
        groups = [EngineGroup("single", engines[:1]), EngineGroup("pd", engines[1:], unit=2)]
        server = RolloutServer(groups, config, router=router)
        try:
            await server.sync_router()
            seen.append(await every_listed(router))
            # every real server says it is a regular one (no --disaggregation-mode)
            assert {w.worker_type for w in await router.workers()} == {"regular"}
            async with slowed(urls, SLOW_STEP_S):
                traffic = [
                    asyncio.ensure_future(server.generation.generate(request(60 + i)))
                    for i in range(6)
                ]
                await admitted(urls, traffic)
                await server.offload()
            seen.append(await every_listed(router))
            incarnations = {r.id: r.incarnation for r in server.fleet.records()}
            async with watching(router, seen):
                unit_servers[1].stop()  # a member's processes die between release and resume
                with pytest.raises(PhaseFailed) as failed:
                    await server.onload_weights()
                outcomes = failed.value.outcomes
                assert outcomes["pd/1"].outcome is Outcome.DEAD, outcomes
                assert outcomes["pd/0"].ok and outcomes["single/0"].ok, outcomes
                assert server.unhealthy_units() == {
                    "pd/0-1": "pd/1 dead; recover() replaces the unit whole"
                }
                assert not any(t.done() for t in traffic)
                await server.recover(unit_factory=lambda ids: asyncio.to_thread(restart_unit, ids))
            assert asked == [("pd/0", "pd/1")] and len(made) == 2
            assert server.unhealthy_units() == {}
            seen.append(await every_listed(router))
            if server.state.value != "weights_restored":
                await server.onload_weights()
            await server.update_weights(FromDisk(model), "unit-recovered", expected=expected)
            seen.append(await every_listed(router))
            await server.onload_kv()
            seen.append(await every_listed(router))
            answers = await asyncio.wait_for(asyncio.gather(*traffic), timeout=600)
            assert_full(answers, TOKENS)
            final = {url_identity(u) for u in urls}
            assert seen[0] == seen[-1] == final, (seen[0], seen[-1])
            halves = [s for s in seen if 0 < len(s & unit_ids) < len(unit_ids)]
            print(
                f"{len(answers)} of {len(traffic)} answered; router read {len(seen)} times, "
                f"{len(halves)} with half the unit; incarnations before {incarnations}"
            )
            assert halves == []
            records = server.snapshot().engines()
            assert all(r.alive and not r.stale and not r.unverified for r in records.values())
            # each member keeps its own record: a new process each, none the one before
            pd = [records["pd/0"].incarnation, records["pd/1"].incarnation]
            assert None not in pd and len(set(pd)) == 2
            assert not set(pd) & {incarnations["pd/0"], incarnations["pd/1"]}
            for real in [single, *unit_servers]:
                await assert_serving(real, "unit-recovered")
        finally:
            server.generation.close()
            await router.close()
            for engine in [*engines, *made]:
                await engine.close()
