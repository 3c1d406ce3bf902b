"""Fleets across the nodes of a Ray cluster: three real raylets on this machine
(``LocalCluster``, the ``ray_nodes`` fixture), engine actors placed through placement groups
(``EnginePlacement``), colocation with the trainer's bundles checked, and a node lost at each
phase boundary: its engines named dead, the rest of the fleet safe, replacements placed by the
same rules on the nodes that survive, no request lost."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from benchmarks import overhead
from rollout_lifecycle import (
    HOOK_PHASES,
    DeadEnginePolicy,
    EngineGroup,
    EnginePlacement,
    EngineState,
    FromDisk,
    InvalidArgument,
    LifecycleConfig,
    LifecycleEvent,
    Outcome,
    PlacementFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    start_engine_actor,
)
from rollout_lifecycle.backends.actor import EngineActor
from rollout_lifecycle.backends.placement import actor_resources
from rollout_lifecycle.metrics import BUCKETS, PrometheusMetrics, RayMetrics
from rollout_lifecycle.testing import (
    LocalCluster,
    cycle_order_violations,
    until,
    until_actor_gone,
)

BOUND = 60.0
TOKENS = 64


def factory(i: int) -> Callable[[], SimulatedEngine]:
    return functools.partial(SimulatedEngine, label=f"sim-{i}", token_latency=0.004)


def requests(n: int) -> list[dict[str, Any]]:
    return [
        {"input_ids": [1, 2, 3 + i], "sampling_params": {"max_new_tokens": TOKENS}}
        for i in range(n)
    ]


async def until_taken(engines: list[Any], count: int) -> None:
    """The engines have taken at least ``count`` generate requests in all (a counter: a wait
    on it cannot miss its moment; each request decodes for ~0.25 s, so they are in flight)."""

    async def taken() -> bool:
        found = await asyncio.gather(*(e.stats.remote() for e in engines))
        return sum(s["submitted"] for s in found) >= count

    await until(taken, what=f"{count} request(s) taken")


async def cycle(server: RolloutServer, version: str) -> None:
    """A colocated step: offload, weights back, a verified push from disk, KV back, serve."""
    await server.offload()
    await server.onload_weights()
    await server.update_weights(FromDisk(f"/ckpt/{version}"), version, verify=True)
    await server.onload_kv()


def whole(answers: list[dict[str, Any]]) -> None:
    """Every request finished, full length (nothing lost to a dead node)."""
    assert [len(a["output_ids"]) for a in answers] == [TOKENS] * len(answers)
    assert {a["meta_info"]["finish_reason"]["type"] for a in answers} == {"length"}


@pytest.fixture
def kill_after() -> Any:
    """Actors and placement groups to give back when the test ends."""
    actors: list[Any] = []
    placements: list[EnginePlacement] = []
    yield actors, placements
    for actor in actors:
        ray.kill(actor, no_restart=True)
    for placement in placements:
        placement.remove()


async def spread(kill_after: Any, n: int) -> tuple[EnginePlacement, list[Any]]:
    """``n`` engines, each in its bundle of a SPREAD placement group, given back at the end."""
    actors, placements = kill_after
    placement = await EnginePlacement.reserve(n, {"gpu": 1}, strategy="SPREAD", timeout=BOUND)
    placements.append(placement)
    engines = await placement.start_all([factory(i) for i in range(n)])
    actors.extend(engines)
    return placement, engines


async def test_a_fleet_spread_over_three_nodes_cycles_with_traffic_and_loses_nothing(
    ray_nodes: LocalCluster, kill_after: Any
) -> None:
    placement, engines = await spread(kill_after, 4)
    nodes = [await e.node_id.remote() for e in engines]
    assert set(nodes) == set(ray_nodes.node_ids())  # every node holds an engine
    assert nodes == [placement.nodes()[i] for i in range(4)]  # each in its bundle
    server = RolloutServer([EngineGroup("actor", engines)], name="spread")
    batch = asyncio.ensure_future(server.generate_batch(requests(12)))
    await until_taken(engines, 12)
    await cycle(server, "v1")
    more = asyncio.ensure_future(server.generate_batch(requests(12)))
    await until_taken(engines, 24)
    await cycle(server, "v2")
    whole(await asyncio.wait_for(batch, BOUND))
    whole(await asyncio.wait_for(more, BOUND))
    assert server.state is ServerState.SERVING
    assert server.fleet.count(states=[EngineState.SERVING]) == 4
    versions = await asyncio.gather(*(e.weight_version.remote() for e in engines))
    assert versions == ["v2"] * 4


@ray.remote(num_cpus=0)
class TrainerWorker:
    """A trainer's worker: holds half of its bundle's GPU."""

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())


async def test_colocated_engines_share_their_trainers_nodes_and_one_elsewhere_is_refused(
    ray_nodes: LocalCluster, kill_after: Any
) -> None:
    actors, _ = kill_after
    trainer = placement_group([{"gpu": 1}] * 3, strategy="STRICT_SPREAD")
    await asyncio.wait_for(trainer.ready(), BOUND)
    try:
        workers = [
            TrainerWorker.options(
                resources={"gpu": 0.5},
                scheduling_strategy=PlacementGroupSchedulingStrategy(trainer, i),
            ).remote()
            for i in range(3)
        ]
        actors.extend(workers)
        trainer_nodes = [await w.node.remote() for w in workers]
        assert len(set(trainer_nodes)) == 3
        placement = EnginePlacement.colocated(trainer, {"gpu": 0.5}, timeout=BOUND)
        engines = await placement.start_all([factory(i) for i in range(3)])
        actors.extend(engines)
        assert [await e.node_id.remote() for e in engines] == trainer_nodes
        server = RolloutServer([EngineGroup("actor", engines)], name="colocated")
        await cycle(server, "v1")
        assert server.state is ServerState.SERVING

        # An engine actor started off its trainer's node shares no GPU with it: refused.
        elsewhere = next(n for n in ray_nodes.node_ids() if n != trainer_nodes[0])
        stray = start_engine_actor(
            factory(9), scheduling_strategy=NodeAffinitySchedulingStrategy(elsewhere, soft=False)
        )
        actors.append(stray)
        with pytest.raises(PlacementFailed) as refused:
            await placement.check(0, stray)
        assert f"runs on node {elsewhere}, not on its bundle's node {trainer_nodes[0]}" in str(
            refused.value
        )
        # The trainer's bundles are full (half its worker's, half its engine's): one more
        # colocated engine cannot start (and is killed).
        with pytest.raises(PlacementFailed, match="did not start"):
            await EnginePlacement.colocated(trainer, {"gpu": 0.5}, timeout=2).start(0, factory(8))
    finally:
        remove_placement_group(trainer)


async def test_a_group_the_cluster_cannot_hold_is_refused_with_what_it_has(
    ray_nodes: LocalCluster,
) -> None:
    with pytest.raises(PlacementFailed) as refused:
        await EnginePlacement.reserve(1, {"gpu": 3}, timeout=2, name="too-big")  # no node has 3
    assert "could not place 1 bundle(s) of {'gpu': 3.0} (PACK)" in str(refused.value)
    assert "add nodes, or ask for less" in str(refused.value)
    # given back, not left pending to take room once a node could hold it
    groups = placement_group_table().values()
    assert [g["state"] for g in groups if g["name"] == "too-big"] == ["REMOVED"]


@pytest.mark.parametrize(
    ("count", "bundle", "options", "message"),
    [
        (0, {"gpu": 1}, {}, "count must be an int >= 1"),
        (1, {}, {}, "bundle must be a non-empty dict"),
        (1, {"gpu": 0}, {}, "asks nothing"),
        (1, {"gpu": -1}, {}, "must be a number >= 0"),
        (1, {"gpu": 1}, {"strategy": "SOMEWHERE"}, "strategy must be one of"),
        (1, {"gpu": 1}, {"resources": {"gpu": 2}}, "ask at most what a bundle holds"),
        (1, {"gpu": 1}, {"timeout": 0}, "timeout must be a finite number of seconds > 0"),
    ],
)
async def test_bad_placements_are_refused_before_ray_is_asked(
    count: int, bundle: dict[str, float], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        await EnginePlacement.reserve(count, bundle, **options)


@pytest.mark.parametrize("phase", [p.value for p in HOOK_PHASES])
async def test_a_node_lost_at_a_phase_boundary_is_named_and_replaced_on_the_survivors(
    ray_nodes: LocalCluster, kill_after: Any, phase: str
) -> None:
    actors, _ = kill_after
    victim = ray_nodes.add_node(resources={"gpu": 1})
    placement, engines = await spread(kill_after, 4)
    lost = [i for i, node in placement.nodes().items() if node == victim]
    assert lost, f"SPREAD left the new node empty: {placement.nodes()}"
    server = RolloutServer(
        [EngineGroup("actor", engines)],
        LifecycleConfig(dead_engines=DeadEnginePolicy.SKIP),
        name=f"lose-{phase}",
    )

    async def lose_the_node(event: LifecycleEvent) -> None:
        remove()
        ray_nodes.remove_node(victim)  # (blocks the loop a moment: Ray's utility uses signals)
        for i in lost:  # a fact, waited for: the cluster has found the node lost
            await until_actor_gone(engines[i], deadline=BOUND)

    remove = server.on(f"before_{phase}", lose_the_node)
    batch = asyncio.ensure_future(server.generate_batch(requests(12)))
    await until_taken(engines, 12)
    await cycle(server, "v1")  # goes on without the lost node's engines
    records = server.fleet.records()
    assert [r.id for r in records if r.state is EngineState.DEAD] == [f"actor/{i}" for i in lost]
    assert server.state is ServerState.SERVING

    replaced = await server.recover(placement.replacer("actor", factory))
    assert {k: v.outcome for k, v in replaced.items()} == {f"actor/{i}": Outcome.OK for i in lost}
    survivors = set(ray_nodes.node_ids())
    assert victim not in survivors
    new = [server.engines()[f"actor/{i}"] for i in lost]
    actors.extend(new)
    for i, handle in zip(lost, new, strict=True):
        node = await handle.node_id.remote()
        assert node in survivors and node == placement.nodes()[i]  # in its bundle, moved
    await cycle(server, "v2")  # the replacements get the weights, verified, and serve
    whole(await asyncio.wait_for(batch, BOUND))
    assert server.fleet.count(states=[EngineState.SERVING]) == 4
    handles = server.engines()
    assert (
        await asyncio.gather(*(h.weight_version.remote() for h in handles.values())) == ["v2"] * 4
    )
    # the rest of the fleet was safe: every barrier kept, no call an engine could not survive
    kept = {k: h for k, h in handles.items() if int(k.rpartition("/")[2]) not in lost}
    histories = await asyncio.gather(*(h.history.remote() for h in kept.values()))
    assert cycle_order_violations(dict(zip(kept, histories, strict=True))) == []


@pytest.mark.parametrize(
    ("asked", "options"),
    [
        ({"GPU": 1}, {"num_cpus": 0, "num_gpus": 1}),
        ({"CPU": 2, "GPU": 0.5}, {"num_cpus": 2, "num_gpus": 0.5}),
        ({"gpu": 1, "memory": 2**30}, {"num_cpus": 0, "resources": {"gpu": 1}, "memory": 2**30}),
    ],
)
def test_cpus_gpus_and_memory_are_asked_by_rays_own_keywords(
    asked: dict[str, float], options: dict[str, Any]
) -> None:
    assert actor_resources(asked) == options
    EngineActor.options(**options)  # Ray takes them ("GPU" in resources= it refuses)
    with pytest.raises(ValueError, match="num_gpus"):
        EngineActor.options(num_cpus=0, resources={"GPU": 1})


async def test_the_overhead_benchmark_runs_its_contenders_across_the_nodes(
    ray_nodes: LocalCluster,
) -> None:
    result = await overhead.run_fleet(
        actors=3, servers=3, rounds=1, seq_budget_s=0, latency_ms=(0.0, 1.0), nodes=3
    )
    assert set(result.times) == {overhead.RAW, overhead.RAY_GET, overhead.LIBRARY, overhead.SLIME}
    assert not any(result.violations.values()) and not any(result.incomplete.values())
    assert "3 engines (3 actors x 1) on 3 nodes" in overhead.report(result)
    # its placement group (three bundles, placed) is given back
    await until(lambda: ray.available_resources().get("gpu") == 6.0, what="the gpus given back")


#: The labels Ray's metrics agent adds to every series (its node, session, process...).
RAYS_OWN = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "JobId"}


def lifecycle_series(text: str, prefix: str) -> dict[tuple[str, frozenset[Any]], float]:
    """The lifecycle's series in a Prometheus answer, by name (``prefix`` dropped) and the
    lifecycle's own labels (a bucket's bound as a number: the two exporters write it apart)."""
    found: dict[tuple[str, frozenset[Any]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(prefix + "rollout_lifecycle_"):
                continue
            labels = {
                k: float(v) if k == "le" else v
                for k, v in s.labels.items()
                if k not in RAYS_OWN and not k.startswith("otel_")
            }
            found[s.name.removeprefix(prefix), frozenset(labels.items())] = s.value
    return found


def bounded_sum(
    series: dict[tuple[str, frozenset[Any]], float], histogram: str, labels: frozenset[Any]
) -> tuple[float, float]:
    """The least and the most a histogram's observations can sum to, given its buckets."""
    bounds = sorted(
        (dict(k[1])["le"], v)
        for k, v in series.items()
        if k[0] == histogram + "_bucket" and k[1] - {("le", dict(k[1])["le"])} == labels
    )
    low = high = below = 0.0
    lower_bound = 0.0
    for bound, cumulative in bounds:
        count, below = cumulative - below, cumulative
        if count:
            low, high = low + count * lower_bound, high + count * bound
        lower_bound = bound
    return low, high


@pytest.mark.ray_metrics
async def test_the_lifecycles_metrics_reach_the_clusters_prometheus_as_the_server_counts_them(
    ray_nodes: LocalCluster, kill_after: Any
) -> None:
    # (its own tier, `bash ci/ray-metrics`: the agent is in ray[default], not in a minimal Ray)
    assert importlib.util.find_spec("opencensus.stats") is not None, (
        "Ray's metrics agent needs ray[default]: pip install '.[test,ray-metrics]'"
    )
    _, engines = await spread(kill_after, 3)
    server = RolloutServer([EngineGroup("actor", engines)], name="ray-metrics")
    on_ray, on_endpoint = RayMetrics(every=0.2), PrometheusMetrics()
    on_ray.watch(server)
    on_endpoint.watch(server)
    try:
        batch = asyncio.ensure_future(server.generate_batch(requests(6)))
        await until_taken(engines, 6)
        await cycle(server, "v1")
        got = dict(server.metrics)  # the last call's: onload_kv
        whole(await asyncio.wait_for(batch, BOUND))
        on_ray.report()  # the requests' counts, now that all came back
        url = ray_nodes.metrics_url()  # the driver's node: where its records go
        want = {
            key: v
            for key, v in lifecycle_series(on_endpoint.text(), "").items()
            if not key[0].endswith("_created")  # (the client's own timestamps)
            and (v or not key[0].endswith("_total"))  # (Ray moves no counter by 0)
        }
        # Ray keeps a histogram as its bucket counts and answers each sum rebuilt from them
        exact = {k: v for k, v in want.items() if not k[0].endswith("_seconds_sum")}
        seen: dict[tuple[str, frozenset[Any]], float] = {}

        async def agreed() -> bool:
            nonlocal seen
            async with httpx.AsyncClient() as client:
                answer = await client.get(url, timeout=BOUND)
            seen = lifecycle_series(answer.text, "ray_")
            return seen.keys() >= want.keys() and all(seen[k] == v for k, v in exact.items())

        try:
            await until(agreed, what="Ray's agent answering as the endpoint", every=0.25)
        except AssertionError as exc:
            differ = {k: (v, seen.get(k)) for k, v in exact.items() if seen.get(k) != v}
            raise AssertionError(f"{exc}: (endpoint, Ray) differ in {differ}") from None
    finally:
        on_ray.close()
    sums = [k for k in want if k not in exact]
    counts = [k for k in want if k[0].endswith("_seconds_count")]
    assert len(sums) == len(counts) > 4  # each call's and each phase's, all checked below
    for name, labels in sums:
        low, high = bounded_sum(want, name.removesuffix("_sum"), labels)
        assert low <= seen[name, labels] <= high, (name, labels)
    assert seen.keys() == want.keys()  # no series of its own either
    ours = {"server": "ray-metrics"}

    def at(name: str, **labels: Any) -> float:
        return seen[name, frozenset({**ours, **labels}.items())]

    # against the server's own account of the call, and the fleet's
    call = {"call": "onload_kv", "outcome": "ok"}
    took = got["lifecycle/onload_kv/total_s"]
    bucket = BUCKETS.index(min(b for b in BUCKETS if b >= took))
    assert at("rollout_lifecycle_call_seconds_bucket", **call, le=BUCKETS[bucket]) == 1
    if bucket:
        assert at("rollout_lifecycle_call_seconds_bucket", **call, le=BUCKETS[bucket - 1]) == 0
    assert at("rollout_lifecycle_phase_seconds_count", phase="pause") == 1
    assert at("rollout_lifecycle_engine_calls_total", phase="pause", outcome="ok") == 3
    assert at("rollout_lifecycle_weights_verified_total") == 3
    assert at("rollout_lifecycle_server_state", state="serving") == 1
    assert at("rollout_lifecycle_server_state", state="released") == 0
    assert at("rollout_lifecycle_engines", state="serving") == 3
    assert at("rollout_lifecycle_requests_total", outcome="completed") == 6
    assert at("rollout_lifecycle_requests_in_flight") == 0
