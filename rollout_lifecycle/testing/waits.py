"""Waiting on facts instead of time: a test that needs a moment (a request decoding, a pause
landed, an actor gone) polls what the engine or the server reports until it holds, with a
generous deadline, so it passes the same on an idle machine and on a loaded one. For engines
behind Ray actors: until one is gone, until each has received a call (Ray loads only when a
wait on an actor needs it)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rollout_lifecycle.contract.values import check_seconds

#: How long a wait may take before the test fails: long, since a loaded machine is slow, and a
#: fact that never comes fails the test anyway.
DEFAULT_DEADLINE_S = 60.0


async def until(
    check: Callable[[], bool | Awaitable[bool]],
    *,
    what: str = "the condition",
    deadline: float = DEFAULT_DEADLINE_S,
    every: float = 0.005,
) -> None:
    """Return once ``check()`` (a function or a coroutine function) is true; ``AssertionError``
    naming ``what`` if it is not within ``deadline`` seconds. Polls every ``every`` seconds."""
    check_seconds("deadline", deadline)
    check_seconds("every", every)
    end = time.monotonic() + deadline
    while True:
        answer = check()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline:g} s waiting for {what}")
        await asyncio.sleep(every)


async def until_actor_gone(handle: Any, *, deadline: float = DEFAULT_DEADLINE_S) -> None:
    """Return once calls to the engine actor ``handle`` fail because it is gone (``ray.kill``
    returns before the actor is)."""
    import ray  # only the actor waits need Ray

    async def gone() -> bool:
        try:
            await handle.server_info.remote()
        except ray.exceptions.RayActorError:
            return True
        return False

    await until(gone, what=f"engine actor {handle!r} to be gone", deadline=deadline)


async def until_began(
    handles: Sequence[Any], op: str, *, times: int = 1, deadline: float = DEFAULT_DEADLINE_S
) -> None:
    """Return once every simulated engine actor of ``handles`` has received ``op`` ``times``
    times in all: the calls that returned (its history) and those still running (its state's
    ``in_flight``)."""

    async def received(handle: Any) -> int:
        history, state = await asyncio.gather(handle.history.remote(), handle.state.remote())
        running: list[str] = state["in_flight"]
        return sum(1 for e in history if e["op"] == op) + running.count(op)

    async def began() -> bool:
        counts = await asyncio.gather(*(received(h) for h in handles))
        return all(n >= times for n in counts)

    await until(began, what=f"{op} x{times} on every engine", deadline=deadline)


async def held_at(
    server: Any, event: str, call: Awaitable[Any], deadline: float = DEFAULT_DEADLINE_S
) -> tuple[asyncio.Future[Any], asyncio.Event]:
    """Start ``call`` and return once it has reached a hook on ``event`` of ``server`` (a
    ``RolloutServer``), where it waits, its claims held, until the returned event is set: the
    call's future and that event. A staged moment inside a call, with no sleep."""
    check_seconds("deadline", deadline)
    inside, go_on = asyncio.Event(), asyncio.Event()

    async def hold(_: object) -> None:
        inside.set()
        await go_on.wait()

    server.on(event, hold)
    task = asyncio.ensure_future(call)
    waiting = asyncio.ensure_future(inside.wait())
    await asyncio.wait({task, waiting}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
    if not inside.is_set():
        waiting.cancel()
        if task.done():
            task.result()  # (what the call raised before it got there)
        raise AssertionError(f"the call did not reach {event} within {deadline:g}s")
    return task, go_on


__all__ = ["DEFAULT_DEADLINE_S", "held_at", "until", "until_actor_gone", "until_began"]
