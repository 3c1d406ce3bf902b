"""``/ready`` and ``/health`` while serving and while paused."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from wire.helpers import Target

from rollout_lifecycle.testing import until

#: How long the client waits for ``/health`` while paused: it must not have answered by then.
#: Well under SGLang's own 20 s health deadline, after which it would mark itself unhealthy.
HEALTH_PATIENCE = 3.0


async def test_ready_and_health_answer_200_while_serving(target: Target) -> None:
    async with target.client() as client:
        assert (await client.get("/ready")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/health_generate")).status_code == 200


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_ready_is_503_while_paused_and_200_after_continue(target: Target, mode: str) -> None:
    async with target.client() as client:
        assert (await client.post("/pause_generation", json={"mode": mode})).status_code == 200
        answer = await client.get("/ready")
        assert answer.status_code == 503
        assert (await client.post("/continue_generation", json={})).status_code == 200
        assert (await client.get("/ready")).status_code == 200


async def test_health_does_not_answer_while_paused_and_does_after_continue(
    target: Target,
) -> None:
    """``/health`` generates one token; while paused that request waits in the front end, so
    the probe hangs. Continue soon after (SGLang gives up after 20 s and marks itself
    unhealthy, and ``/ready`` then stays 503 until a later ``/health`` succeeds)."""
    async with target.client() as client:
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        with pytest.raises(httpx.TimeoutException):
            await client.get("/health", timeout=HEALTH_PATIENCE)
        assert (await client.post("/continue_generation", json={})).status_code == 200
        assert (await client.get("/health", timeout=60)).status_code == 200

        async def ready() -> bool:
            return (await client.get("/ready")).status_code == 200

        await until(ready, what="the server to answer /ready")


async def test_a_health_probe_sent_while_paused_answers_200_once_continued(
    target: Target,
) -> None:
    async with target.client() as client:
        assert (await client.post("/pause_generation", json={"mode": "abort"})).status_code == 200
        probe = asyncio.create_task(client.get("/health", timeout=60))
        done, _ = await asyncio.wait({probe}, timeout=HEALTH_PATIENCE)
        assert not done, "/health answered while paused"
        assert (await client.post("/continue_generation", json={})).status_code == 200
        assert (await asyncio.wait_for(probe, 60)).status_code == 200
