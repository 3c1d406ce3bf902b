"""``/flush_cache`` idle, busy, after a retract pause and during an in_place pause, each with and
without ``?timeout``; and flushes sent together."""

from __future__ import annotations

import asyncio
import time

import httpx
from wire.helpers import Target, finish_type, in_flight

FLUSHED = "Cache flushed."
FAILED = "Flush cache failed."
TIMED_OUT = "Timed out waiting for idle state."
#: Long enough that a request is still decoding when the next call lands (a pause, a flush without
#: timeout) on any machine; short enough for a CPU server.
LONG = 200
SHORT_TIMEOUT = 0.5
#: Outlives SHORT_TIMEOUT by seconds even on an idle machine (a real CPU server decodes 200 tokens
#: of the tiny model in about half a second).
LONGER = 800


def assert_flushed(answer: httpx.Response) -> None:
    assert answer.status_code == 200 and answer.text.startswith(FLUSHED), answer.text


def assert_refused(answer: httpx.Response, message: str) -> None:
    assert answer.status_code == 400 and answer.text.strip() == message, answer.text


async def finish_all(tasks: list[asyncio.Task[dict[str, object]]], tokens: int) -> None:
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
        assert finish_type(result) == "length"
        assert len(result["output_ids"]) == tokens  # type: ignore[arg-type]


async def test_flush_on_an_idle_server_succeeds_with_and_without_timeout(target: Target) -> None:
    async with target.client() as client:
        assert_flushed(await client.post("/flush_cache"))
        assert_flushed(await client.post("/flush_cache", params={"timeout": 5}))


async def test_flush_without_timeout_while_serving_requests_is_refused(target: Target) -> None:
    async with target.client() as client:
        tasks = await in_flight(client, 2, LONG)
        assert_refused(await client.post("/flush_cache"), FAILED)
        await finish_all(tasks, LONG)


async def test_flush_with_timeout_while_serving_waits_for_idle_then_flushes(
    target: Target,
) -> None:
    async with target.client() as client:
        tasks = await in_flight(client, 2, 40)
        answer = await client.post("/flush_cache", params={"timeout": 100})
        assert_flushed(answer)
        # It answered once idle (what a wait pause on SGLang relies on): a flush with no wait,
        # which a running request would make a 400, passes now.
        assert_flushed(await client.post("/flush_cache"))
        await finish_all(tasks, 40)


async def test_flush_with_timeout_while_serving_longer_than_it_times_out(target: Target) -> None:
    async with target.client() as client:
        tasks = await in_flight(client, 2, LONGER)
        start = time.monotonic()
        answer = await client.post("/flush_cache", params={"timeout": SHORT_TIMEOUT})
        assert_refused(answer, TIMED_OUT)
        assert time.monotonic() - start >= SHORT_TIMEOUT
        await finish_all(tasks, LONGER)


async def test_flush_without_timeout_after_a_retract_pause_succeeds(target: Target) -> None:
    """While paused the scheduler's flush ignores its waiting queue, where retracted requests
    sit: the flush succeeds, and the requests finish after continue."""
    async with target.client() as client:
        tasks = await in_flight(client, 2, LONG)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        assert_flushed(await client.post("/flush_cache"))
        assert (await client.post("/continue_generation", json={})).status_code == 200
        await finish_all(tasks, LONG)


async def test_flush_with_timeout_after_a_retract_pause_times_out(target: Target) -> None:
    """A deferred flush re-checks idleness counting the waiting queue, which retracted
    requests never leave while paused: 400 after the timeout, every time."""
    async with target.client() as client:
        tasks = await in_flight(client, 2, LONG)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        start = time.monotonic()
        assert_refused(await client.post("/flush_cache", params={"timeout": 1}), TIMED_OUT)
        assert time.monotonic() - start >= 1.0
        assert (await client.post("/continue_generation", json={})).status_code == 200
        await finish_all(tasks, LONG)


async def test_flush_during_an_in_place_pause_with_requests_is_refused(target: Target) -> None:
    async with target.client() as client:
        tasks = await in_flight(client, 2, LONG)
        assert (
            await client.post("/pause_generation", json={"mode": "in_place"})
        ).status_code == 200
        assert_refused(await client.post("/flush_cache"), FAILED)
        assert_refused(await client.post("/flush_cache", params={"timeout": 1}), TIMED_OUT)
        assert (await client.post("/continue_generation", json={})).status_code == 200
        await finish_all(tasks, LONG)


async def test_flush_during_an_idle_pause_succeeds_with_and_without_timeout(
    target: Target,
) -> None:
    async with target.client() as client:
        for mode in ("abort", "retract", "in_place"):
            assert (await client.post("/pause_generation", json={"mode": mode})).status_code == 200
            assert_flushed(await client.post("/flush_cache"))
            assert_flushed(await client.post("/flush_cache", params={"timeout": 1}))
            assert (await client.post("/continue_generation", json={})).status_code == 200


async def test_flushes_sent_together_are_answered_one_after_the_other(target: Target) -> None:
    """The front end sends one flush at a time to the scheduler, so a second flush never meets
    a deferred one: both time out after a retract pause, the second a whole timeout later."""
    async with target.client() as client:
        tasks = await in_flight(client, 2, LONG)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        start = time.monotonic()
        answers = await asyncio.gather(
            *(client.post("/flush_cache", params={"timeout": 1}) for _ in range(2))
        )
        elapsed = time.monotonic() - start
        for answer in answers:
            assert_refused(answer, TIMED_OUT)
        assert elapsed >= 2.0
        assert (await client.post("/continue_generation", json={})).status_code == 200
        await finish_all(tasks, LONG)


async def test_flushes_sent_together_to_an_idle_server_all_succeed(target: Target) -> None:
    async with target.client() as client:
        answers = await asyncio.gather(
            client.post("/flush_cache"),
            client.post("/flush_cache", params={"timeout": 2}),
            client.get("/flush_cache"),
        )
        for answer in answers:
            assert_flushed(answer)
