"""Pause in each mode with requests in flight, and what becomes of those requests; on the real
server also with two data-parallel ranks (``cycle_target``), the requests spread over both."""

from __future__ import annotations

import asyncio

from wire.helpers import Target, finish_type, gen_request, in_flight

#: The length of the requests a pause must find in flight: 6 s on the stand-in (15 ms a token),
#: 4-8 s on the real CPU server. Under twelve CPU hogs a pause lands within 0.1 s of the
#: requests being seen running, but the test process itself may stall there (a garbage
#: collection, time slices lost in a full suite on a loaded machine): at 60 tokens (0.9 s) the
#: requests then finished before their pause came ("an in_place pause keeps requests open"
#: failed in CI, and fails on any machine when the test stalls 1.2 s before its pause).
TOKENS = 400


async def test_abort_pause_returns_every_request_with_partial_output_and_finish_abort(
    cycle_target: Target,
) -> None:
    async with cycle_target.client() as client:
        tasks = await in_flight(client, 3, TOKENS)
        answer = await client.post("/pause_generation", json={"mode": "abort"})
        assert answer.status_code == 200, answer.text
        # The pause answers only once nothing is in flight: every request has its answer.
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for result in results:
            assert finish_type(result) == "abort", result["meta_info"]
            assert len(result["output_ids"]) < TOKENS
        assert (await client.post("/continue_generation", json={})).status_code == 200


async def test_retracted_requests_finish_after_continue_and_count_the_retraction(
    cycle_target: Target,
) -> None:
    async with cycle_target.client() as client:
        tasks = await in_flight(client, 3, TOKENS)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        assert not any(task.done() for task in tasks), "a retract pause keeps requests open"
        assert (await client.post("/continue_generation", json={})).status_code == 200
        for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
            assert finish_type(result) == "length"
            assert len(result["output_ids"]) == TOKENS
            assert result["meta_info"]["num_retractions"] >= 1


async def test_in_place_paused_requests_finish_after_continue(cycle_target: Target) -> None:
    async with cycle_target.client() as client:
        tasks = await in_flight(client, 3, TOKENS)
        answer = await client.post("/pause_generation", json={"mode": "in_place"})
        assert answer.status_code == 200
        assert not any(task.done() for task in tasks), "an in_place pause keeps requests open"
        assert (await client.post("/continue_generation", json={})).status_code == 200
        for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
            assert finish_type(result) == "length"
            assert len(result["output_ids"]) == TOKENS


async def test_a_wait_mode_is_refused_with_400_and_the_requests_run_on_unpaused(
    cycle_target: Target,
) -> None:
    # The library's wait mode is not SGLang's: its client drains with a flush instead.
    async with cycle_target.client() as client:
        tasks = await in_flight(client, 2, TOKENS)
        answer = await client.post("/pause_generation", json={"mode": "wait"})
        assert answer.status_code == 400 and "wait" in answer.text, answer.text
        assert (await client.get("/ready")).status_code == 200, "nothing was paused"
        for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
            assert finish_type(result) == "length" and len(result["output_ids"]) == TOKENS
            assert result["meta_info"]["num_retractions"] == 0


async def test_requests_sent_while_paused_wait_and_run_after_continue(cycle_target: Target) -> None:
    async with cycle_target.client() as client:
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        late = asyncio.create_task(client.post("/generate", json=gen_request(5)))
        done, _ = await asyncio.wait({late}, timeout=2.0)
        assert not done, "a request sent while paused must wait"
        assert (await client.post("/continue_generation", json={})).status_code == 200
        answer = await asyncio.wait_for(late, 60)
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 5
