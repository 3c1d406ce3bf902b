"""Waiting on facts instead of time: a test that needs a moment (a request decoding, a pause
landed, an actor gone) polls what the engine or the server reports until it holds, with a
generous deadline, so it passes the same on an idle machine and on a loaded one."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

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


__all__ = ["DEFAULT_DEADLINE_S", "until"]
