"""What tells one server process from another, and what a server says of its own pause:
``/server_info``'s ``startup_time`` and ``random_seed``, ``/ping`` beside ``/ready``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from wire.helpers import Target, in_flight

from rollout_lifecycle import incarnation_of


async def server_info(client: httpx.AsyncClient) -> dict[str, Any]:
    answer = await client.get("/server_info")
    assert answer.status_code == 200
    info: dict[str, Any] = answer.json()
    return info


async def test_server_info_names_its_process_the_same_on_every_read(target: Target) -> None:
    async with target.client() as client:
        first = await server_info(client)
        startup = first["startup_time"]
        assert isinstance(startup, dict) and startup  # durations of this process's start-up
        assert {"load_weight", "kv_cache_allocation", "scheduler_e2e"} <= set(startup)
        assert isinstance(first["random_seed"], int)  # drawn at start-up (none was given)
        assert incarnation_of(first) is not None
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        assert (await client.post("/flush_cache")).status_code == 200
        paused = await server_info(client)
        assert (await client.post("/continue_generation", json={})).status_code == 200
        again = await server_info(client)
    assert incarnation_of(paused) == incarnation_of(again) == incarnation_of(first)
    assert again["startup_time"] == startup and again["random_seed"] == first["random_seed"]


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_ping_answers_200_paused_or_not_while_ready_answers_503_paused(
    target: Target, mode: str
) -> None:
    """A healthy server that is not ready is paused: what a client reads before a call that
    would kill a server it wrongly believes paused."""
    async with target.client() as client:
        assert (await client.get("/ping")).status_code == 200
        assert (await client.get("/ready")).status_code == 200
        tasks = await in_flight(client, 2, 200)
        assert (await client.post("/pause_generation", json={"mode": mode})).status_code == 200
        assert (await client.get("/ping")).status_code == 200
        assert (await client.get("/ready")).status_code == 503
        assert (await client.post("/continue_generation", json={})).status_code == 200
        assert (await client.get("/ready")).status_code == 200
        await asyncio.gather(*tasks)


async def test_ping_is_a_normal_endpoint_for_keys(keyed: Target) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60) as client:
        assert (await client.get("/ping")).status_code == 401
        admin = await client.get("/ping", headers=keyed.headers(keyed.admin_key))
        assert admin.status_code == 401
        api = await client.get("/ping", headers=keyed.headers(keyed.api_key))
        assert api.status_code == 200


async def test_a_server_restarted_at_its_address_is_a_new_incarnation_and_a_fresh_server(
    target: Target,
) -> None:
    """What an orchestrator does every day: the new process answers at the same URL, with a new
    incarnation, serving (not paused) whatever the old one was doing."""
    server = target.disposable()
    async with server.client() as client:
        before = await server_info(client)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
    await asyncio.to_thread(server.restart)
    async with server.client() as client:
        after = await server_info(client)
        assert (await client.get("/ready")).status_code == 200  # not paused: a fresh server
        assert (await client.get("/ping")).status_code == 200
    assert incarnation_of(after) != incarnation_of(before)
    assert after["startup_time"] != before["startup_time"]
    server.give_back()  # a fresh server, asked nothing since its start: the next test's
