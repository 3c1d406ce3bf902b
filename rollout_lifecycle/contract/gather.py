"""The barrier's wait: every engine call of a phase, each one's end time, one deadline.

Cheap at thousands of calls. In-process calls (asyncio tasks) share one done-callback and wake
the phase once, when the last lands. A transport whose calls are references of its own kind
(Ray's object refs) registers a batch wait for them (``seam.register_refs``), so they are not
wrapped in an asyncio future each: every such future costs a thread hop and an event-loop
wake-up when its call lands. A call still running at the deadline is returned as a future that
lands when it does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


class Landed:
    """What became of each call of a phase, by position.

    ``ends[i]`` is when call ``i`` landed (``time.monotonic()``) or None if it had not by the
    deadline; then ``late[i]`` is a future that completes when it does. Otherwise
    ``errors[i]`` is the exception it raised, or None and ``values[i]`` is its result.
    """

    __slots__ = ("ends", "errors", "late", "values")

    def __init__(self, count: int) -> None:
        self.ends: list[float | None] = [None] * count
        self.values: list[Any] = [None] * count
        self.errors: list[BaseException | None] = [None] * count
        self.late: dict[int, asyncio.Future[Any]] = {}


#: A wait for many calls of one kind at once: ``(loop, refs, their positions, landed, timeout,
#: stop)`` records each call's end, value or error in ``landed`` as it lands, gives up at the
#: deadline or when ``stop`` is set, and returns a future of the error that stopped it early
#: (None if none did).
BatchWait = Callable[
    [asyncio.AbstractEventLoop, list[Any], list[int], "Landed", float, threading.Event],
    "asyncio.Future[BaseException | None]",
]


def _no_batches(ref: object) -> BatchWait | None:
    return None


async def gather_calls(
    refs: Sequence[Awaitable[Any]],
    timeout: float,
    batch_of: Callable[[object], BatchWait | None] = _no_batches,
) -> Landed:
    """Wait until every call in ``refs`` has landed or ``timeout`` seconds have passed.

    ``batch_of(ref)`` names the batch wait of a call of a registered kind (None: an awaitable,
    waited for in this loop); it is asked once per type of call in the phase."""
    landed = Landed(len(refs))
    if not refs:
        return landed
    loop = asyncio.get_running_loop()
    batches: dict[BatchWait, list[int]] = {}
    local: dict[asyncio.Future[Any], int] = {}
    kind_of: dict[type, BatchWait | None] = {}
    #: Whether a kind of call is a future already (an in-process call's task): waited for as
    #: it is, not passed through ``ensure_future`` once per call.
    futures: dict[type, bool] = {}
    for i, ref in enumerate(refs):
        kind = type(ref)
        if kind not in kind_of:
            kind_of[kind] = batch_of(ref)
            futures[kind] = asyncio.isfuture(ref)
        batch = kind_of[kind]
        if batch is not None:
            batches.setdefault(batch, []).append(i)
        elif futures[kind]:
            local[ref] = i  # type: ignore[index]
        else:
            local[asyncio.ensure_future(ref)] = i
    waits: list[asyncio.Future[Any]] = []
    stop = threading.Event()
    began = time.monotonic()
    for batch, positions in batches.items():
        waits.append(batch(loop, [refs[i] for i in positions], positions, landed, timeout, stop))
    if local:
        waits.append(wait_local(loop, local, landed))
    try:
        await asyncio.wait(waits, timeout=timeout)
    finally:
        stop.set()  # a cancelled wait must not leave a batch's helper waiting
    for k, positions in enumerate(batches.values()):
        # Each batch wait has stopped (it gives up at the same deadline): the refs it did not
        # see land are the late ones.
        failure = await asyncio.shield(waits[k])
        unseen: dict[asyncio.Future[Any], int] = {
            asyncio.ensure_future(refs[i]): i for i in positions if landed.ends[i] is None
        }
        if unseen and failure is not None:
            # The batch wait could not wait (its transport refused the refs): one by one.
            left = max(0.0, timeout - (time.monotonic() - began))
            await asyncio.wait([wait_local(loop, unseen, landed)], timeout=left)
        for future, i in unseen.items():
            if landed.ends[i] is None:
                landed.late[i] = future
    for future, i in local.items():
        if landed.ends[i] is None:
            landed.late[i] = future
    return landed


def wait_local(
    loop: asyncio.AbstractEventLoop, futures: dict[asyncio.Future[Any], int], landed: Landed
) -> asyncio.Future[None]:
    done = loop.create_future()
    left = len(futures)
    ends, values, errors = landed.ends, landed.values, landed.errors

    def on_done(future: asyncio.Future[Any]) -> None:
        nonlocal left
        i = futures[future]
        ends[i] = time.monotonic()
        if future.cancelled():
            errors[i] = asyncio.CancelledError()
        elif future.exception() is not None:
            errors[i] = future.exception()
        else:
            values[i] = future.result()
        left -= 1
        if left == 0 and not done.done():
            done.set_result(None)

    for future in futures:
        future.add_done_callback(on_done)
    return done
