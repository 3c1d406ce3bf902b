"""Load: thousands of generate requests in flight while the server cycles offload/onload.

Stand-in SGLang servers on loopback carry the traffic over HTTP; the server drives them
through ``SGLangHTTPEngine``. Every request must complete: under retract without a single
abort, under abort by resubmitting each aborted request as prompt + partial output. None may
be lost, none may hang.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
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
from rollout_lifecycle._standin import StandInServer
from rollout_lifecycle.testing import cycle_order_violations


async def run_load(
    pause_mode: PauseMode, engines: int, requests: int, cycles: int
) -> tuple[Counter[str], list[str], float]:
    servers = await StandInServer.start_many_async(engines, token_latency=0.02, seed=1)
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

            async def in_flight() -> int:
                stats = await asyncio.gather(
                    *(http.get(f"{s.url}/_standin/stats") for s in servers)
                )
                return sum(a.json()["in_flight"] for a in stats)

            traffic = [asyncio.ensure_future(one(i)) for i in range(requests)]
            deadline = time.monotonic() + 60
            while await in_flight() < requests and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # polling servers in other processes: no event to await
            for cycle in range(cycles):
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
                await asyncio.sleep(0.05)  # some decoding between steps
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
        tally["in_flight_at_first_offload"] = seen_in_flight[0]
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
            f"aborted={tally['aborted']} lost={tally['lost']}; in flight at the first offload: "
            f"{tally['in_flight_at_first_offload']}, cycles with requests in flight: "
            f"{tally['cycles_with_requests_in_flight']}"
        )
    assert tally["in_flight_at_first_offload"] == requests
    assert tally["cycles_with_requests_in_flight"] >= cycles // 2
    assert violations == []
    assert tally["lost"] == 0
    assert tally["completed"] == tally["submitted"]
    if mode is PauseMode.RETRACT:
        assert tally["aborted"] == 0
    else:  # every abort came back with its partial output and was resubmitted
        assert tally["aborted"] >= requests
