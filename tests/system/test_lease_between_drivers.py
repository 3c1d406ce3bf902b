"""One owner per fleet across the drivers of a Ray cluster (``lease``), on three real
raylets (``ray_nodes``): engine actors spread over the nodes, driver processes that connect to
the cluster as a training job's driver does, claims held in the cluster's lease registry and the
journal kept there.

- Two drivers race full cycles over the same fleet: each time one cycles and the other is
  refused before it sends anything an engine could die of; no engine dies.
- A driver killed (SIGKILL) at a phase boundary leaves its lease to end within its TTL and its
  journal in the cluster; a new driver adopts the fleet's true state from it and brings the
  fleet back to serving, under a newer epoch that fences anything the dead one left in flight.

The registry's rules on a virtual clock, the engine host's fence and a frozen server fenced are
``tests/system/test_lease.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout_lifecycle import (
    EngineClaimed,
    EngineGroup,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    start_engine_actor,
)
from rollout_lifecycle.lease import ClusterClaims, ClusterJournal, registry
from rollout_lifecycle.testing import LocalCluster, cycle_order_violations, until

S = ServerState
BOUND = 60.0
NAMESPACE = "lease-tests"
TRIALS = 20

DRIVER = textwrap.dedent(
    """
    import asyncio, json, sys
    import ray
    from rollout_lifecycle import EngineGroup, RolloutServer
    from rollout_lifecycle.lease import ClusterClaims, ClusterJournal
    from rollout_lifecycle.testing.fleets import raced_cycle

    address, leases, names, ttl, name, mode = sys.argv[1:7]
    ray.init(address=address, namespace="lease-tests", logging_level="ERROR", log_to_driver=False)
    engines = [ray.get_actor(n) for n in names.split(",")]

    def driver():
        claims = ClusterClaims(float(ttl), name=leases)
        server = RolloutServer(
            [EngineGroup("actor", engines)], name=name, claims=claims,
            journal=ClusterJournal("fleet", claims),
        )
        return claims, server

    def say(what):
        print(json.dumps(what), flush=True)

    async def trial():
        claims, server = driver()
        try:
            return await raced_cycle(server, retries=400)
        finally:
            claims.close()

    async def race():
        for line in sys.stdin:  # one trial per "go", both drivers started at once by the test
            say(await trial())

    async def die_at(event):
        claims, server = driver()

        async def stop(_):
            say({"at": event, "epoch": claims.epoch})
            await asyncio.sleep(3600)  # (killed here by the test)
        server.on(event, stop)
        await server.offload()
        await server.onload()

    asyncio.run(race() if mode == "race" else die_at(mode))
    """
)


@pytest.fixture(scope="module")
def fleet(ray_nodes: LocalCluster) -> Iterator[list[str]]:
    """Three named engine actors, one on each node, owned by this process (a driver killed
    does not take them with it)."""
    names, actors = [], []
    for i, node in enumerate(ray_nodes.node_ids()):
        name = f"engine-{i}"
        actors.append(
            start_engine_actor(
                functools.partial(SimulatedEngine, label=name, token_latency=0.002),
                name=name,
                namespace=NAMESPACE,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
        )
        names.append(name)
    ray.get([a.ping.remote() for a in actors], timeout=BOUND)
    yield names
    for actor in actors:
        ray.kill(actor, no_restart=True)


def engines_of(names: list[str]) -> list[Any]:
    return [ray.get_actor(n, namespace=NAMESPACE) for n in names]


@pytest.fixture
def leases(request: pytest.FixtureRequest, ray_nodes: LocalCluster) -> Iterator[str]:
    """A lease registry of this test's own."""
    name = f"leases-{request.node.name}"[:100]
    yield name
    ray.kill(registry(name), no_restart=True)


async def start_driver(
    cluster: LocalCluster, leases: str, names: list[str], ttl: float, name: str, mode: str
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", DRIVER, cluster.address, leases, ",".join(names), str(ttl), name,
        mode, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def read(driver: asyncio.subprocess.Process, who: str) -> Any:
    assert driver.stdout is not None
    line = await asyncio.wait_for(driver.stdout.readline(), BOUND)
    assert line, f"driver {who} exited ({await driver.wait()})"
    return json.loads(line)


async def histories(names: list[str]) -> dict[str, Any]:
    return {n: await e.history.remote() for n, e in zip(names, engines_of(names), strict=True)}


async def serving_whole(names: list[str]) -> None:
    """Every engine alive, not paused, every tag resident."""
    states = [await e.state.remote() for e in engines_of(names)]
    assert not any(s["dead"] or s["paused"] or s["released_tags"] for s in states), states


async def test_two_drivers_on_one_cluster_race_cycles_and_kill_nothing(
    ray_nodes: LocalCluster, fleet: list[str], leases: str
) -> None:
    """Two driver processes race a full offload and onload over the fleet ``TRIALS`` times,
    both started at once: each time one cycles and the other is refused (claimed by the
    other's lease, or its pause found the engines paused) before it sends a release. No
    engine dies; the fleet ends serving."""
    drivers = {who: await start_driver(ray_nodes, leases, fleet, 10.0, who, "race") for who in "ab"}
    outcomes: dict[str, list[str]] = {who: [] for who in drivers}
    try:
        for _ in range(TRIALS):
            for driver in drivers.values():
                assert driver.stdin is not None
                driver.stdin.write(b"go\n")
            await asyncio.gather(*(d.stdin.drain() for d in drivers.values() if d.stdin))
            for who, driver in drivers.items():
                outcomes[who].append(await read(driver, who))
    finally:
        for driver in drivers.values():
            with contextlib.suppress(ProcessLookupError):
                driver.kill()
            await driver.wait()
    both = list(zip(*outcomes.values(), strict=True))
    assert all("cycled" in pair for pair in both), both
    refused = [o for pair in both for o in pair if o != "cycled"]
    assert all(o == "claimed" or o.startswith("refused: conflict") for o in refused), both
    assert cycle_order_violations(await histories(fleet)) == []
    await serving_whole(fleet)


#: Where a driver is killed, and the call that brings the fleet back from the state its
#: journal then holds.
KILLED_AT = {
    "after_pause": (S.DRAINED, "resume"),
    "after_release": (S.RELEASED, "onload"),
    "after_resume_weights": (S.WEIGHTS_RESTORED, "onload_kv"),
}


@pytest.mark.parametrize("event", list(KILLED_AT))
async def test_a_driver_killed_mid_cycle_is_adopted_from_the_clusters_journal(
    ray_nodes: LocalCluster, fleet: list[str], leases: str, event: str
) -> None:
    """A driver is killed (SIGKILL) at ``event``, holding its lease. A new driver (this
    process) reads the cluster's journal, adopts the state it holds, is refused while the dead
    driver's lease lives, and once it has ended (``ttl``) brings the fleet back to serving
    under a newer epoch; then cycles. No engine dies or sees a call out of order."""
    ttl = 2.0
    driver = await start_driver(ray_nodes, leases, fleet, ttl, "doomed", event)
    try:
        stopped = await read(driver, "doomed")
        assert stopped["at"] == event
    finally:
        driver.kill()
        await driver.wait()
    claims = ClusterClaims(5.0, name=leases)
    journal = ClusterJournal("fleet", claims)
    server = RolloutServer(
        [EngineGroup("actor", engines_of(fleet))], name="adopter", claims=claims, journal=journal
    )
    last = journal.last()
    state, call = KILLED_AT[event]
    assert last is not None and last.state is state
    server.adopt(last)
    refusals = 0

    async def back() -> bool:
        nonlocal refusals
        try:
            await getattr(server, call)()
        except EngineClaimed as exc:
            assert "'doomed'" in str(exc)
            refusals += 1
            return False
        return True

    await until(back, what="the dead driver's lease ended", deadline=BOUND, every=0.2)
    assert refusals >= 1  # (the dead driver's lease outlived it, for its TTL)
    assert server.state is S.SERVING
    assert claims.epoch is None  # (each call lets its lease go)
    assert ray.get(claims.actor.leases.remote()) == {}
    await server.offload()
    await server.onload()
    answers = await server.generate_batch(
        [{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}} for _ in range(6)]
    )
    assert [len(a["output_ids"]) for a in answers] == [8] * 6
    assert cycle_order_violations(await histories(fleet)) == []
    await serving_whole(fleet)
    # a command under the dead driver's epoch is refused by every engine now
    for engine in engines_of(fleet):
        with pytest.raises(Exception, match="fenced"):
            stale = [claims.scope, stopped["epoch"]]
            await engine.fenced.remote(stale, "run", "pause_generation", "abort")
    claims.close()
