"""What the cluster's lease costs per call: the same fleet of Ray engine actors driven through full
cycles by three servers in one run, rounds interleaved (rotating their order):

- ``host claims``: the default store (``HostClaims``); Ray actors have no address, so nothing is
  locked: the floor;
- ``cluster lease``: ``ClusterClaims`` (``lease``): one registry call to take the lease
  and one to let it go per public call, and every command carrying the lease's fence;
- ``lease + journal``: the same with ``ClusterJournal``: one more registry call, waited for,
  each time the records change (before each send, after each phase, on each state change).

Each server drives the fleet for a whole round (offload, onload weights, onload KV), one after
another; the per-call cost is the difference of the medians divided by the cycle's three calls.
Engines answer in ``--latency-ms`` (a uniform draw), so the cost is set against real phases.

    python -m benchmarks.lease
    python -m benchmarks.lease --engines 64 --rounds 15 --latency-ms 5 20
    python -m benchmarks.lease --nodes 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import ray

from benchmarks._common import (
    CYCLE_OPS,
    add_latency_argument,
    library_cycle,
    machine,
    median,
    table,
)
from rollout_lifecycle import ClusterClaims, ClusterJournal, EngineGroup, RolloutServer
from rollout_lifecycle.testing import LocalCluster, local_ray, simulated_engine_actors

#: The public calls in one cycle.
CALLS = 3
LEASES = "benchmark-leases"


@contextlib.contextmanager
def cluster(nodes: int) -> Iterator[None]:
    if nodes > 1:
        with LocalCluster(nodes):
            yield
    else:
        with local_ray():
            yield


def servers(engines: list[Any]) -> tuple[dict[str, RolloutServer], list[ClusterClaims]]:
    stores = [ClusterClaims(name=LEASES), ClusterClaims(name=LEASES)]
    made = {
        "host claims": RolloutServer([EngineGroup("actor", engines)], name="host"),
        "cluster lease": RolloutServer(
            [EngineGroup("actor", engines)], name="lease", claims=stores[0]
        ),
        "lease + journal": RolloutServer(
            [EngineGroup("actor", engines)],
            name="journal",
            claims=stores[1],
            journal=ClusterJournal("benchmark", stores[1]),
        ),
    }
    return made, stores


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    """Time the three servers' cycles (seconds, by server), print the table, and give back
    the engines and the registry."""
    low, high = args.latency_ms
    engines = simulated_engine_actors(
        args.engines, seed=7, op_latency=dict.fromkeys(CYCLE_OPS, (low / 1000, high / 1000))
    )
    ray.get([e.ping.remote() for e in engines], timeout=120)
    contenders, stores = servers(engines)
    names = list(contenders)
    for server in contenders.values():  # (a warm-up cycle each: first contact, the registry)
        await library_cycle(server)
    times: dict[str, list[float]] = {n: [] for n in names}
    for k in range(args.rounds):
        order = names[k % len(names) :] + names[: k % len(names)]
        for name in order:
            start = time.perf_counter()
            await library_cycle(contenders[name])
            times[name].append(time.perf_counter() - start)
    floor = median(times["host claims"])
    rows = []
    for name in names:
        cycle = median(times[name])
        per_call_ms = (cycle - floor) / CALLS * 1000
        rows.append([name, f"{cycle * 1000:.1f}", f"{cycle / floor:.3f}", f"{per_call_ms:+.2f}"])
    print(machine())
    print(
        f"{args.engines} engine actors on {args.nodes} node(s), op latency U({low}, {high}) ms, "
        f"{args.rounds} rounds per server, interleaved"
    )
    print(table(["server", "cycle ms (median)", "x host claims", "per call ms"], rows))
    for store in stores:
        store.close()
    for engine in engines:
        ray.kill(engine, no_restart=True)
    ray.kill(stores[0].actor, no_restart=True)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--nodes", type=int, default=1)
    add_latency_argument(parser, (5.0, 20.0))
    args = parser.parse_args(argv)
    with cluster(args.nodes):
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
