"""Load: thousands of generate requests in flight while the server cycles offload/onload.

Stand-in SGLang servers on loopback carry the traffic over HTTP; the server drives them
through ``SGLangHTTPEngine``. Every request must complete: under retract without a single
abort, under abort by resubmitting each aborted request as prompt + partial output. None may
be lost, none may hang.

The stand-ins decode in their own processes, so how many requests a given pause catches is
the machine's speed: the test asserts only what the library guarantees (nothing lost, every
answer complete, the call order of every cycle). That requests are in flight during a cycle
is made certain, not hoped for: the traffic is sent while the first offload has the engines
paused, where every request waits until the cycle ends; after each onload the engines decode
(a token more is seen, or all are done), each later cycle waits until requests are seen in
flight (or all are done), and how many it caught is printed, not asserted.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from rollout_lifecycle import (
    EngineGroup,
    LifecycleConfig,
    PauseMode,
    RolloutServer,
    SGLangHTTPEngine,
    WeightUpdate,
)
from rollout_lifecycle.testing import cycle_order_violations, until
from rollout_lifecycle.testing.standin import StandInServer


async def run_load(
    pause_mode: PauseMode, engines: int, requests: int, cycles: int
) -> tuple[Counter[str], list[str], float]:
    # Eight Python processes importing at once on a loaded 2-core machine: a generous bound.
    servers = await StandInServer.start_many_async(
        engines, token_latency=0.02, seed=1, startup_timeout=120
    )
    clients = [SGLangHTTPEngine(s.url) for s in servers]
    server = RolloutServer(
        [
            EngineGroup("actor", clients[: engines // 2]),
            EngineGroup("critic", clients[engines // 2 :]),
        ],
        LifecycleConfig(pause_mode=pause_mode),
    )
    rng = random.Random(7)
    seen_in_flight: list[int] = []
    tally: Counter[str] = Counter()
    # No keep-alive: a request sent on a connection the server is just closing for idleness
    # fails in transport, which is a client race, not something the lifecycle lost.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:

            async def one(i: int) -> str:
                """One request; an aborted one is resubmitted as prompt + partial output."""
                url = servers[i % engines].url
                tokens = rng.randint(150, 300)
                prompt: list[int] = [i, 1]
                output: list[int] = []
                while len(output) < tokens:
                    try:
                        answer = await http.post(
                            f"{url}/generate",
                            json={
                                "input_ids": prompt + output,
                                "sampling_params": {"max_new_tokens": tokens - len(output)},
                            },
                        )
                        body: dict[str, Any] = answer.json()
                    except httpx.HTTPError:
                        return "lost"
                    output += body["output_ids"]
                    kind = body["meta_info"]["finish_reason"]["type"]
                    if kind == "abort":
                        tally["aborted"] += 1
                    elif kind != "length":
                        return "lost"
                return "completed" if len(output) == tokens else "lost"

            async def total(key: str) -> int:
                """The sum of one counter of every stand-in's stats."""
                stats = await asyncio.gather(
                    *(http.get(f"{s.url}/_standin/stats") for s in servers)
                )
                return sum(a.json()[key] for a in stats)

            async def in_flight() -> int:
                return await total("in_flight")

            async def poll_until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
                # Polling servers in other processes: no event to await. The conditions below
                # hold in the end whatever the speed: the deadline only names what never came.
                await until(condition, what=what, deadline=300, every=0.05)

            traffic: list[asyncio.Future[str]] = []

            async def all_sent_are_waiting() -> bool:
                # A request that ended while the engines are paused was lost: count it too.
                return await in_flight() + sum(t.done() for t in traffic) >= requests

            async def some_in_flight_or_all_done() -> bool:
                return all(t.done() for t in traffic) or await in_flight() > 0

            for cycle in range(cycles):
                if cycle == 0:
                    await server.offload()
                    # Sent while paused: every request waits at its engine through this cycle.
                    traffic.extend(asyncio.ensure_future(one(i)) for i in range(requests))
                    await poll_until(all_sent_are_waiting, "every request to wait at its engine")
                    seen_in_flight.append(await in_flight())
                else:
                    await poll_until(some_in_flight_or_all_done, "requests in flight")
                    seen_in_flight.append(await in_flight())
                    await server.offload()
                await asyncio.sleep(0.01)  # the trainer's step

                async def push(update: WeightUpdate) -> None:
                    await asyncio.gather(
                        *(
                            h.update_weights_from_disk("/ckpt", update.version)
                            for h in update.engines.values()
                        )
                    )

                await server.onload_weights()
                await server.update_weights(push, version=f"v{cycle}")
                await server.onload_kv()
                # Some decoding between steps: a token more than at the onload (or all done).
                decoded = await total("tokens")

                async def decoding_or_all_done(since: int = decoded) -> bool:
                    return all(t.done() for t in traffic) or await total("tokens") > since

                await poll_until(decoding_or_all_done, "decoding after the onload")
            done, pending = await asyncio.wait(traffic, timeout=120)
            tally.update(t.result() for t in done)
            tally["lost"] += len(pending)
            for task in pending:
                task.cancel()
        async with httpx.AsyncClient(timeout=30) as http:
            histories = {
                s.url: (await http.get(f"{s.url}/_standin/history")).json() for s in servers
            }
        tally["submitted"] = requests
        tally["in_flight_through_the_first_cycle"] = seen_in_flight[0]
        tally["cycles_with_requests_in_flight"] = sum(n > 0 for n in seen_in_flight)
        return tally, cycle_order_violations(histories), time.monotonic() - started
    finally:
        await asyncio.gather(*(c.close() for c in clients))
        for s in servers:
            s.stop()


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("mode", "engines", "requests", "cycles"),
    # Under abort every cycle aborts every request and each is resubmitted: fewer requests keep
    # that churn within the suite's time budget.
    [(PauseMode.RETRACT, 8, 2000, 20), (PauseMode.ABORT, 8, 400, 20)],
)
async def test_no_request_is_lost_while_the_server_cycles(
    mode: PauseMode, engines: int, requests: int, cycles: int, capsys: pytest.CaptureFixture[str]
) -> None:
    tally, violations, took = await run_load(mode, engines, requests, cycles)
    with capsys.disabled():
        print(
            f"\nload [{mode.value}] {engines} engines, {cycles} offload/onload cycles in "
            f"{took:.1f}s: submitted={tally['submitted']} completed={tally['completed']} "
            f"aborted={tally['aborted']} lost={tally['lost']}; in flight through the first "
            f"cycle: {tally['in_flight_through_the_first_cycle']}, cycles with requests in "
            f"flight: {tally['cycles_with_requests_in_flight']}"
        )
    # Paused engines keep every request sent to them: all are in flight through cycle 0.
    assert tally["in_flight_through_the_first_cycle"] == requests
    assert violations == []
    assert tally["lost"] == 0
    assert tally["completed"] == tally["submitted"]  # each with exactly its tokens
    if mode is PauseMode.RETRACT:
        assert tally["aborted"] == 0  # retract keeps requests; it never aborts one
