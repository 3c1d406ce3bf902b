"""SIGTERM handled as Ctrl-C is: the lifecycle calls in progress settle before the process ends.

Ray and Kubernetes stop a process with SIGTERM, whose default action ends it at once, a call to
the engines half sent and its journal entry half true. While a lifecycle call is in progress in
a process that left SIGTERM to its default (its own handler, Ray's or ``ctl``'s, is never
replaced), a SIGTERM cancels that call as a cancelled caller does: the phase in flight settles,
the journal is written, and the server stops at the next boundary. Then the process ends as
SIGTERM ends it (the default action, sent again). With no call in progress it ends at once,
as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

#: The tasks running a lifecycle call, each with its loop (a sync facade's runs in a thread).
_CALLS: dict[asyncio.Task[object], asyncio.AbstractEventLoop] = {}
#: A SIGTERM came while calls were in progress: the last one to settle ends the process.
_terminating = False
#: This module's handler is the process's SIGTERM handler.
_installed = False


def _end() -> None:
    """End the process as SIGTERM's default action does. (Only the main thread may set a
    handler: from another, a sync facade's loop, SIGTERM is sent again for the main thread's
    handler to end it, which finds no call left.)"""
    global _installed
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed = False
    os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _terminating
    if not _CALLS:
        _end()
        return
    _terminating = True
    for task, loop in list(_CALLS.items()):
        with contextlib.suppress(RuntimeError):  # (a loop already closed)
            loop.call_soon_threadsafe(task.cancel)


def _install() -> None:
    """Take SIGTERM, where this is the main thread and nobody else has taken it."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):  # (not the main interpreter)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _installed = True


def install() -> None:
    """Take SIGTERM for the lifecycle calls of this process (from the main thread; a sync
    facade's server, whose calls run in a thread of their own, is built there)."""
    _install()


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """Run a lifecycle call in the current task so that a SIGTERM lets it settle first."""
    _install()
    task = asyncio.current_task()
    if task is None:
        yield
        return
    _CALLS[task] = asyncio.get_running_loop()
    try:
        yield
    finally:
        _CALLS.pop(task, None)
        if _terminating and not _CALLS and _installed:
            _end()


__all__ = ["install", "settling"]
