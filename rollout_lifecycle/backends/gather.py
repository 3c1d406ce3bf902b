"""The barrier's wait: every engine call of a phase, each one's end time, one deadline.

Cheap at thousands of calls. Ray object refs are not wrapped in an asyncio future each (every
such future costs a thread hop and an event-loop wake-up when its call lands); one helper thread
waits for all of a phase's refs with ``ray.wait`` in slices and fetches each slice's results
with one ``ray.get``, so a call's end time is known to within the slice (2 ms, or a tenth of
the time waited so far, at most 100 ms) while the barrier itself passes as the last call lands.
In-process calls (asyncio tasks) share one done-callback and wake the phase once, when the last
lands. A call still running at the deadline is returned as a future that lands when it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import ray

#: Slices of one ``ray.wait``: a ref's end time is known to within the slice, which grows with
#: the phase (a fraction of the time waited so far), so a long phase costs few wake-ups. The
#: last ref ends the wait at once (``ray.wait`` returns when every ref is ready).
_MIN_SLICE_S = 0.002
_MAX_SLICE_S = 0.1
_SLICE_FRACTION = 0.1


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


async def gather_calls(refs: Sequence[Awaitable[Any]], timeout: float) -> Landed:
    """Wait until every call in ``refs`` has landed or ``timeout`` seconds have passed."""
    landed = Landed(len(refs))
    if not refs:
        return landed
    loop = asyncio.get_running_loop()
    remote: list[int] = []
    local: dict[asyncio.Future[Any], int] = {}
    for i, ref in enumerate(refs):
        if isinstance(ref, ray.ObjectRef):
            remote.append(i)
        else:
            local[asyncio.ensure_future(ref)] = i
    waits: list[asyncio.Future[Any]] = []
    stop = threading.Event()
    began = time.monotonic()
    if remote:
        waits.append(_wait_remote(loop, [refs[i] for i in remote], remote, landed, timeout, stop))
    if local:
        waits.append(_wait_local(loop, local, landed))
    try:
        await asyncio.wait(waits, timeout=timeout)
    finally:
        stop.set()  # a cancelled wait must not leave the helper thread waiting
    if remote:
        # The helper thread has stopped (it gives up at the same deadline): the refs it did not
        # see land are the late ones.
        failure = await asyncio.shield(waits[0])
        unseen: dict[asyncio.Future[Any], int] = {
            asyncio.ensure_future(refs[i]): i for i in remote if landed.ends[i] is None
        }
        if unseen and failure is not None:
            # The helper could not wait (Ray refused the refs): wait for them one by one.
            left = max(0.0, timeout - (time.monotonic() - began))
            await asyncio.wait([_wait_local(loop, unseen, landed)], timeout=left)
        for future, i in unseen.items():
            if landed.ends[i] is None:
                landed.late[i] = future
    for future, i in local.items():
        if landed.ends[i] is None:
            landed.late[i] = future
    return landed


def _wait_local(
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


def _wait_remote(
    loop: asyncio.AbstractEventLoop,
    refs: list[Any],
    positions: list[int],
    landed: Landed,
    timeout: float,
    stop: threading.Event,
) -> asyncio.Future[BaseException | None]:
    """Wait in a helper thread; the future gives the error that stopped it early, if any."""
    done: asyncio.Future[BaseException | None] = loop.create_future()
    where = {ref: i for ref, i in zip(refs, positions, strict=True)}
    failure: list[BaseException] = []

    def finish() -> None:
        if not done.done():
            done.set_result(failure[0] if failure else None)

    def run() -> None:
        start = time.monotonic()
        pending = refs
        try:
            while pending and not stop.is_set():
                waited = time.monotonic() - start
                left = timeout - waited
                if left <= 0:
                    break
                piece = min(left, max(_MIN_SLICE_S, min(_MAX_SLICE_S, waited * _SLICE_FRACTION)))
                ready, pending = ray.wait(
                    pending, num_returns=len(pending), timeout=piece, fetch_local=False
                )
                if ready:
                    now = time.monotonic()
                    _fetch(ready, where, landed, now)
        except Exception as exc:  # e.g. refs Ray cannot wait for together
            failure.append(exc)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(finish)

    threading.Thread(target=run, name="rollout-lifecycle-wait", daemon=True).start()
    return done


def _fetch(ready: list[Any], where: dict[Any, int], landed: Landed, now: float) -> None:
    """Record the results of refs that landed (one ``ray.get``; one per ref only on errors)."""
    try:
        values = ray.get(ready)
    except Exception:
        for ref in ready:
            i = where[ref]
            try:
                landed.values[i] = ray.get(ref)
            except Exception as exc:
                landed.errors[i] = exc
            landed.ends[i] = now
        return
    for ref, value in zip(ready, values, strict=True):
        i = where[ref]
        landed.values[i] = value
        landed.ends[i] = now
