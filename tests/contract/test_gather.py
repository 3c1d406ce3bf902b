"""The barrier's wait (``seam.wait``, over ``gather.gather_calls``): every call's end, value or
error, the deadline, and the late calls, for in-process tasks and Ray object refs alike."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray

from rollout_lifecycle.contract import seam
from rollout_lifecycle.testing import until


async def _after(seconds: float, value: Any = None, error: BaseException | None = None) -> Any:
    await asyncio.sleep(seconds)
    if error is not None:
        raise error
    return value


def _waiters() -> int:
    return sum(t.name == "rollout-lifecycle-wait" for t in threading.enumerate())


async def test_in_process_calls_land_with_their_values_errors_and_end_times() -> None:
    start = time.monotonic()
    refs = [
        asyncio.ensure_future(_after(0.05, "slow")),
        asyncio.ensure_future(_after(0.0, "fast")),
        asyncio.ensure_future(_after(0.01, error=ValueError("bad"))),
    ]
    landed = await seam.wait(refs, 5)
    assert landed.values[:2] == ["slow", "fast"]
    assert isinstance(landed.errors[2], ValueError) and landed.errors[:2] == [None, None]
    ends = [e for e in landed.ends if e is not None]
    assert len(ends) == 3 and all(start <= e <= time.monotonic() for e in ends)
    assert landed.ends[1] < landed.ends[0]  # type: ignore[operator]
    assert landed.late == {}


async def test_a_call_past_the_deadline_is_late_and_lands_later() -> None:
    answer = asyncio.Event()

    async def held() -> int:
        await answer.wait()  # lands only when the test lets it
        return 2

    refs = [asyncio.ensure_future(_after(0.0, 1)), asyncio.ensure_future(held())]
    landed = await asyncio.wait_for(seam.wait(refs, 0.05), 30)
    assert not refs[1].done()  # the wait returned at its deadline, without the call
    assert landed.ends[1] is None and set(landed.late) == {1}
    answer.set()
    assert await landed.late[1] == 2


async def test_no_calls_return_at_once() -> None:
    landed = await seam.wait([], 1)
    assert landed.ends == [] and landed.late == {}


async def test_ray_refs_land_with_values_errors_and_late_ones(
    engine_actors: Callable[..., list[Any]],
) -> None:
    fast, slow = engine_actors(2, op_latency={"pause_generation": 3.0})
    early = [
        fast.server_info.remote(),
        fast.release_memory_occupation.remote("kv_cache"),  # a string, not a list: raises
    ]
    # The two fast calls have landed (a fact, however loaded the machine) before the slow one
    # starts, so only the slow one can be past the short deadline below.
    await asyncio.to_thread(ray.wait, early, num_returns=2, timeout=120)
    refs = [
        *early,
        slow.pause_generation.remote("retract"),
        asyncio.ensure_future(_after(0.0, "local")),  # one phase may mix both kinds
    ]
    landed = await seam.wait(refs, 0.2)
    assert landed.values[0]["model_path"] == "simulated/sim-0" and landed.errors[0] is None
    assert isinstance(landed.errors[1], ray.exceptions.RayTaskError)
    assert landed.values[3] == "local"
    assert [i for i, e in enumerate(landed.ends) if e is None] == [2]
    assert await asyncio.wait_for(landed.late[2], 60) is None
    assert _waiters() == 0


async def test_a_cancelled_wait_stops_its_helper_thread(
    engine_actors: Callable[..., list[Any]],
) -> None:
    # The pause does not land, nor does the wait give up, before the helper must have stopped.
    (engine,) = engine_actors(1, op_latency={"pause_generation": 600.0})
    task = asyncio.ensure_future(seam.wait([engine.pause_generation.remote("retract")], 600))
    await until(lambda: _waiters() == 1, what="the helper thread to wait")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: _waiters() == 0, what="the helper thread to stop")


async def test_refs_ray_cannot_wait_for_together_are_still_waited_for(
    engine_actors: Callable[..., list[Any]],
) -> None:
    (engine,) = engine_actors(1)
    ref = engine.server_info.remote()
    landed = await seam.wait([ref, ref], 10)  # ray.wait refuses duplicates
    assert landed.late == {} and landed.errors == [None, None]
    assert [v["model_path"] for v in landed.values] == ["simulated/sim-0"] * 2


async def test_a_long_wait_for_ray_refs_wakes_a_few_times_not_every_few_milliseconds(
    engine_actors: Callable[..., list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each wake-up is a ray.wait over the refs still pending, on the driver's CPU, which the
    # engines' actors may share. A wake-up comes 10 ms apart at first, then a quarter of the
    # time waited so far, at most 100 ms apart: over a wait of T seconds at most 4 wake-ups
    # before 40 ms, one per quarter more until 400 ms, one per 100 ms after.
    (engine,) = engine_actors(1, op_latency={"pause_generation": 0.5})
    slices: list[float] = []
    real_wait = ray.wait

    def counted(*args: Any, **kwargs: Any) -> Any:
        slices.append(kwargs["timeout"])
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(ray, "wait", counted)
    began = time.monotonic()
    landed = await seam.wait([engine.pause_generation.remote("retract")], 60)
    took = time.monotonic() - began
    assert landed.errors == [None] and landed.late == {} and took >= 0.5
    growing = math.log(min(took, 0.4) / 0.04) / math.log(1.25)
    bound = 4 + math.ceil(growing) + math.ceil(max(0.0, took - 0.4) / 0.1) + 1
    assert len(slices) <= bound, (took, slices)
    assert min(slices) >= 0.01 and max(slices) <= 0.1
