"""Claims held in the cluster (``lease.py``): the registry's rules on a clock the test
moves (all or none, epochs in order, a lease ends ``ttl`` after its last renewal, continuity,
the journal written only under a live lease), the engine host's fence, and ``ClusterClaims``
driving a server on this process's Ray: every command of a call carries the call's epoch, a
second server is refused naming the first, and a server whose lease was taken over is fenced.

Two drivers on a three-node cluster, a driver frozen past its lease and a driver killed and
adopted from the cluster's journal are ``tests/system/test_lease_between_drivers.py``'s."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from rollout_lifecycle import (
    EngineClaimed,
    EngineGroup,
    InvalidArgument,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
)
from rollout_lifecycle.backends.engine import EngineHost
from rollout_lifecycle.contract.exceptions import EngineFenced, LeaseLost
from rollout_lifecycle.contract.seam import classify
from rollout_lifecycle.lease import (
    ClusterClaims,
    ClusterJournal,
    LeaseRegistry,
    registry,
)
from rollout_lifecycle.testing import cycle_order_violations, held_at, until

S = ServerState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_holds_all_its_keys_or_none_and_names_the_holder() -> None:
    reg = LeaseRegistry(Clock())
    first = reg.acquire(["a", "b"], {"pid": 1, "host": "n1"}, "s1", 15.0)
    assert first["epoch"] == 1 and first["same"] == {"a": False, "b": False}
    refused = reg.acquire(["c", "b"], {"pid": 2}, "s2", 15.0)
    assert refused == {"claimed": "b", "holder": {"pid": 1, "host": "n1", "epoch": 1}}
    # the refused lease kept nothing: "c" is free
    assert reg.acquire(["c"], {"pid": 2}, "s2", 15.0)["epoch"] == 2
    reg.release(1)
    assert reg.acquire(["a", "b"], {"pid": 2}, "s2", 15.0)["epoch"] == 3


def test_a_lease_ends_ttl_after_its_last_renewal() -> None:
    clock = Clock()
    reg = LeaseRegistry(clock)
    reg.acquire(["a"], {"pid": 1}, "s1", 15.0)
    clock.now += 10.0
    assert reg.renew([1]) == []  # renewed: 15 s from now
    clock.now += 14.9
    assert "claimed" in reg.acquire(["a"], {"pid": 2}, "s2", 15.0)
    clock.now += 0.2
    taken = reg.acquire(["a"], {"pid": 2}, "s2", 15.0)
    assert taken["epoch"] == 2 and taken["same"] == {"a": False}
    assert reg.renew([1, 2]) == [1]  # the first lease had ended
    assert list(reg.leases()) == [2]


def test_continuity_is_a_key_let_go_by_this_store_and_taken_by_no_other() -> None:
    clock = Clock()
    reg = LeaseRegistry(clock)
    reg.acquire(["a"], {}, "s1", 15.0)
    reg.release(1)
    assert reg.acquire(["a"], {}, "s1", 15.0)["same"] == {"a": True}
    reg.release(2)
    reg.acquire(["a"], {}, "s2", 15.0)
    reg.release(3)
    assert reg.acquire(["a"], {}, "s1", 15.0)["same"] == {"a": False}  # s2 held it between
    clock.now += 16.0  # lease 4 ends without being let go: its holder may have lost sight
    assert reg.acquire(["a"], {}, "s1", 15.0)["same"] == {"a": False}


def test_extending_a_lease_is_all_or_none_and_refused_once_it_ended() -> None:
    clock = Clock()
    reg = LeaseRegistry(clock)
    reg.acquire(["a"], {}, "s1", 15.0)
    reg.acquire(["b"], {"pid": 9}, "s2", 15.0)
    assert reg.extend(1, ["c", "b"])["claimed"] == "b"
    assert reg.extend(1, ["c"]) == {"epoch": 1, "same": {"c": False}}
    clock.now += 16.0
    assert reg.extend(1, ["d"]) == {"lost": 1}


def test_the_journal_is_written_only_under_a_live_lease_and_never_by_an_older_one() -> None:
    clock = Clock()
    reg = LeaseRegistry(clock)
    reg.acquire(["a"], {}, "s1", 15.0)
    assert reg.write("fleet", {"state": "released"}, 1) is None
    clock.now += 16.0  # lease 1 ends; lease 2 takes the fleet and writes
    reg.acquire(["a"], {}, "s2", 15.0)
    assert reg.write("fleet", {"state": "serving"}, 2) is None
    assert "ended" in (reg.write("fleet", {"state": "drained"}, 1) or "")
    reg.acquire(["y"], {}, "s3", 15.0)  # lease 3, then 4 writes, then 3 may not
    reg.acquire(["w"], {}, "s4", 15.0)
    assert reg.write("fleet", {"state": "paused"}, 4) is None
    assert reg.write("fleet", {}, 3) == "is older than the journal's last writer (epoch 4)"
    reg.acquire(["z"], {}, "s1", 15.0)  # a newer lease of the old store, on other keys
    reg.release(2)
    assert reg.write("fleet", {"state": "x"}, 5) is None  # (newer than the last writer's)
    assert reg.read("fleet") == {"state": "x"}
    assert reg.read("other") is None


async def test_an_engine_host_refuses_a_command_of_an_older_lease_and_does_nothing() -> None:
    engine = SimulatedEngine(label="e")
    host = EngineHost(engine)
    await host.fenced(["scope", 5], "run", "pause_generation", "retract")
    with pytest.raises(EngineFenced) as refused:
        await host.fenced(["scope", 4], "run", "continue_generation")
    assert refused.value.epoch == 4 and refused.value.current == 5
    assert "continue_generation" in str(refused.value) and "epoch 5" in str(refused.value)
    assert classify(refused.value).outcome is Outcome.REFUSED
    # another scope has its own epochs; a newer epoch passes and becomes the fence
    await host.fenced(["other", 1], "run", "continue_generation")
    await host.fenced(["scope", 6], "run", "pause_generation", "retract")
    ops = [e["op"] for e in await host.history()]
    assert ops == ["pause_generation", "continue_generation", "pause_generation"]
    with pytest.raises(InvalidArgument, match="a fence is"):
        await host.fenced(["scope", "6"], "run", "continue_generation")
    with pytest.raises(InvalidArgument, match="not a way"):
        await host.fenced(["scope", 7], "observe")


@pytest.fixture
def fresh_registry(ray_cluster: None, request: pytest.FixtureRequest) -> Any:
    """A registry of this test's own (its name is the test's)."""
    name = f"leases-{request.node.name}"[:100]
    yield name
    with_actor = registry(name)
    ray.kill(with_actor, no_restart=True)


def sims(count: int) -> list[SimulatedEngine]:
    return [SimulatedEngine(label=f"sim-{i}") for i in range(count)]


async def test_every_command_of_a_call_carries_the_calls_epoch(
    engine_actors: Any, fresh_registry: str
) -> None:
    engines = engine_actors(2)
    claims = ClusterClaims(5.0, name=fresh_registry)
    server = RolloutServer([EngineGroup("actor", engines)], name="a", claims=claims)
    await server.offload()
    await server.onload()
    histories = {f"e{i}": await e.history.remote() for i, e in enumerate(engines)}
    assert cycle_order_violations(histories) == []
    # the actors were claimed by their ids, and let go at the end of each call
    assert ray.get(claims.actor.leases.remote()) == {}
    # a command of the first call's lease is now refused by both engines: the fence moved on
    for engine in engines:
        with pytest.raises(EngineFenced):
            await engine.fenced.remote([claims.scope, 1], "run", "continue_generation")
    claims.close()


async def test_a_second_server_on_the_cluster_is_refused_naming_the_first(
    engine_actors: Any, fresh_registry: str
) -> None:
    engines = engine_actors(2)
    first = RolloutServer(
        [EngineGroup("actor", engines)], name="first", claims=ClusterClaims(name=fresh_registry)
    )
    second = RolloutServer(
        [EngineGroup("actor", engines)], name="second", claims=ClusterClaims(name=fresh_registry)
    )
    call, go_on = await held_at(first, "after_release", first.offload())
    with pytest.raises(EngineClaimed) as refused:
        await second.offload()
    assert "'first'" in str(refused.value) and "lease epoch" in str(refused.value)
    go_on.set()
    await call
    assert first.state is S.RELEASED and second.state is S.SERVING


async def until_no_lease(claims: ClusterClaims) -> None:
    """The registry holds no live lease (a lease not renewed ends ``ttl`` after its last
    renewal; the registry's own clock decides)."""

    async def ended() -> bool:
        return not await claims.actor.leases.remote()

    await until(ended, what="the frozen server's lease ended")


@pytest.mark.parametrize("journal", [False, True], ids=["no journal", "cluster journal"])
async def test_a_server_whose_lease_was_taken_over_is_fenced_and_acts_on_nothing(
    engine_actors: Any, fresh_registry: str, journal: bool
) -> None:
    """A server stops inside its offload, drained, holding its lease; it stops renewing (as a
    frozen process would) and the lease ends. A new server takes the fleet over as the journal
    says it is (drained) and resumes it, under a newer epoch. When the old server goes on, its
    release is refused: by every engine host (``EngineFenced``: without a journal, the commands
    are sent) or by the journal before anything is sent (``LeaseLost``). No engine releases
    anything; the fleet serves under its new owner."""
    engines = engine_actors(2)
    old_claims = ClusterClaims(1.0, name=fresh_registry)
    old_journal = ClusterJournal("fleet", old_claims) if journal else None
    old = RolloutServer(
        [EngineGroup("actor", engines)], name="old", claims=old_claims, journal=old_journal
    )
    call, go_on = await held_at(old, "after_flush", old.offload())
    old_claims.close()  # (its renewals stop, as a frozen process's would)
    await until_no_lease(old_claims)

    new_claims = ClusterClaims(5.0, name=fresh_registry)
    new_journal = ClusterJournal("fleet", new_claims) if journal else None
    new = RolloutServer(
        [EngineGroup("actor", engines)], name="new", claims=new_claims, journal=new_journal
    )
    last = new_journal.last() if new_journal is not None else old.snapshot()
    assert last is not None and last.state is S.DRAINED
    new.adopt(last)
    await new.resume()
    assert new.state is S.SERVING

    go_on.set()
    if journal:
        with pytest.raises(LeaseLost, match="writing journal 'fleet' refused"):
            await call
    else:
        with pytest.raises(PhaseFailed) as failed:
            await call
        outcomes = failed.value.outcomes.values()
        assert {o.outcome for o in outcomes} == {Outcome.REFUSED}
        assert all("fenced" in o.detail for o in outcomes)
    histories = {f"e{i}": await e.history.remote() for i, e in enumerate(engines)}
    ops = [[e["op"] for e in h] for h in histories.values()]
    assert all("release_memory_occupation" not in o for o in ops), ops
    assert cycle_order_violations(histories) == []
    states = [await e.state.remote() for e in engines]
    assert not any(s["paused"] or s["released_tags"] for s in states), states
    # the new owner cycles on
    await new.offload()
    await new.onload()
    assert new.state is S.SERVING
    new_claims.close()


async def test_an_engine_joining_is_claimed_in_the_cluster_and_one_held_elsewhere_joins_not(
    engine_actors: Any, fresh_registry: str
) -> None:
    """An engine actor joining under the cluster's claims is claimed by its actor id with the
    call's other engines: one another server drives now is refused (``EngineClaimed``), and
    nothing joins."""
    engines = engine_actors(3)
    server = RolloutServer(
        [EngineGroup("actor", engines[:2])], name="fleet", claims=ClusterClaims(name=fresh_registry)
    )
    other = RolloutServer(
        [EngineGroup("actor", engines[2:])], name="other", claims=ClusterClaims(name=fresh_registry)
    )
    call, go_on = await held_at(other, "after_pause", other.offload())
    with pytest.raises(EngineClaimed, match="'other'"):
        await server.add_engines("actor", [engines[2]])
    assert [r.id for r in server.fleet.records()] == ["actor/0", "actor/1"]
    go_on.set()
    await call
    await other.onload()
    # between the other server's calls its claim is let go: the engine joins (under the next
    # id: the refused join's was written to the journal, and an id is never given twice)
    assert await server.add_engines("actor", [engines[2]]) == ["actor/3"]
