"""``SyncRolloutServer``: drive the lifecycle from a synchronous training loop, without asyncio.

It runs a ``RolloutServer`` on an event loop of its own thread, which every method hands its call
through anyio's blocking portal; every method blocks until done.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from anyio.from_thread import BlockingPortal

from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import InvalidArgument, LifecycleError
from rollout_lifecycle.contract.fingerprint import Fingerprint
from rollout_lifecycle.contract.outcome import EngineOutcome
from rollout_lifecycle.contract.values import MAX_SECONDS
from rollout_lifecycle.core import terminate
from rollout_lifecycle.core.calls import LIFECYCLE_CALLS
from rollout_lifecycle.core.config import LifecycleConfig
from rollout_lifecycle.core.group import EngineGroup
from rollout_lifecycle.core.server import (
    LifecycleEvent,
    RolloutServer,
    ServerSnapshot,
    WeightUpdate,
)
from rollout_lifecycle.core.states import ServerState

T = TypeVar("T")

#: How long ``close()`` waits, in all, for workers it abandoned (hooks still running) to end.
_ABANDONED_GRACE_S = 1.0

#: What the facade's hooks receive (``event.server`` is the async server; close over the facade
#: to call it).
SyncHook = Callable[[LifecycleEvent], Any]
SyncWeightPush = Callable[[WeightUpdate], Any]
SyncEngineFactory = Callable[[str], Any]

#: The facade's own members, beside the server's calls it offers (``PublicCall.sync``).
FACADE_MEMBERS = frozenset({"close", "closed", "server", "wrap"})

#: ``facade``: the SyncRolloutServer whose worker thread this is (hooks, pushes, factories).
_LOCAL = threading.local()


class SyncServerClosed(LifecycleError):
    """The ``SyncRolloutServer`` is closed (or was closed while this call ran)."""

    def __init__(self, name: str, call: str, during: bool = False) -> None:
        self._init = (name, call, during)
        self.call = call
        if during:
            message = (
                f"SyncRolloutServer {name!r} was closed while {call} was running; the call "
                f"was cancelled once the server had settled"
            )
        else:
            message = f"SyncRolloutServer {name!r} is closed; {call} is no longer available"
        super().__init__(message)


class CalledFromLoopThread(LifecycleError):
    """A facade method was called on the facade's own event-loop thread, which it would block."""

    def __init__(self, name: str, call: str) -> None:
        self._init = (name, call)
        self.call = call
        super().__init__(
            f"SyncRolloutServer {name!r}: {call} was called from the facade's own event-loop "
            f"thread (an async hook, or a coroutine on that loop), which it would block forever; "
            f"there, await the async server (event.server, or facade.server)"
        )


class SyncCallTimeout(LifecycleError, TimeoutError):
    """A call outlived its ``timeout``: it was cancelled, and returned once the server settled."""

    def __init__(self, call: str, timeout: float, state: str) -> None:
        self._init = (call, timeout, state)
        self.call = call
        self.timeout = timeout
        self.state = state
        super().__init__(
            f"{call} did not finish within {timeout:g}s; it was cancelled, and the server "
            f"settled in state {state!r}"
        )


class _Pending:
    """One call of a blocked caller, as the loop runs it."""

    def __init__(self, nested: bool) -> None:
        #: Made from inside an operation of the same server (a hook, push or factory) and part
        #: of it: cancelling it alone would interrupt a phase, so it is never cancelled alone.
        self.nested = nested
        #: The task running the call, once the loop started it (set and read on the loop).
        self.task: asyncio.Task[Any] | None = None
        #: Cancelled before the loop started it.
        self.cancel_first = False
        #: A cancel was carried out on the loop (a call is cancelled once: a second cancel
        #: would interrupt the phase the first lets settle).
        self.cancelled = False
        #: What the caller waits on: the call as it settled, ``(cancelled, value, error)``;
        #: cancelled itself if the loop ended under the call. It exists before the call is
        #: handed to the loop, so that a caller interrupted during the hand-over can wait on it.
        self.settled: Future[tuple[bool, Any, BaseException | None]] = Future()


class _Runtime:
    """What the loop thread shares with the facade (never the facade itself, so that a facade
    nobody closed can still be garbage-collected, and its finalizer stop the loop).

    Calls reach the loop through anyio's blocking portal, which other threads hand coroutines
    to and wait on through ``concurrent.futures.Future``; the loop runs on a thread of its
    own (``_run_loop``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.guard = threading.Lock()
        self.closed = False
        #: Calls handed to the loop and not yet settled (under ``guard``).
        self.pending: set[_Pending] = set()
        #: Worker threads running a sync callable; touched on the loop thread only.
        self.workers: set[threading.Thread] = set()
        #: Workers whose call was cancelled or outlived its deadline while the callable still
        #: ran: nobody waits for them any more, and ``close()`` does not join them.
        self.abandoned: set[threading.Thread] = set()
        self.thread_name = f"rollout-sync-{name}"
        started: Future[BlockingPortal] = Future()
        self.thread = threading.Thread(
            target=_run_loop, args=(self, started), name=self.thread_name, daemon=True
        )
        self.thread.start()
        self.portal = started.result()
        self.loop_thread = self.thread.ident

    def submit(
        self, pending: _Pending, make: Callable[[], Awaitable[Any]], context: contextvars.Context
    ) -> None:
        """Start ``make()`` on the loop in ``context``; ``pending.settled`` tells how it ended.

        The hand-over blocks until the loop has taken the call, and the loop may start it
        before the hand-over returns: a caller interrupted in it must settle the call as one
        interrupted while waiting (``_settle``)."""
        self.portal.start_task_soon(self._run, pending, make, context)

    @staticmethod
    async def _run(
        pending: _Pending, make: Callable[[], Awaitable[Any]], context: contextvars.Context
    ) -> None:
        # The call runs as a task of its own, in its caller's context (so that a call from a
        # hook's worker thread is seen as part of the operation that ran the hook); this task
        # only waits for it and reports how it ended, never raising (a BaseException escaping
        # a portal task would end the loop).
        if pending.cancel_first:
            return  # (settled by the cancel)
        task = context.run(asyncio.create_task, _awaited(make))
        pending.task = task
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:  # the portal is shutting down under the call
            task.cancel()
            pending.settled.cancel()
            raise
        if task.cancelled():
            pending.settled.set_result((True, None, None))
        elif (error := task.exception()) is not None:
            pending.settled.set_result((False, None, error))
        else:
            pending.settled.set_result((False, task.result(), None))

    def cancel(self, calls: Sequence[_Pending]) -> None:
        """Cancel ``calls`` on the loop, each once (a settled call has nothing to cancel; one
        the loop has not started settles as cancelled and never starts)."""

        def cancel() -> None:
            for pending in calls:
                if pending.cancelled:
                    continue
                pending.cancelled = True
                if pending.task is None:
                    pending.cancel_first = True
                    if not pending.settled.done():
                        pending.settled.set_result((True, None, None))
                else:
                    pending.task.cancel()

        try:
            self.portal.call(cancel)
        except RuntimeError:  # the loop has stopped: a call it did not settle never will
            for pending in calls:
                pending.settled.cancel()

    def stop(self) -> None:
        """Stop the loop without waiting (the finalizer of a facade nobody closed)."""
        with self.guard:
            self.closed = True
        with contextlib.suppress(RuntimeError):  # stopped already, or called on the loop
            self.portal.start_task_soon(self.portal.stop, True)

    def shutdown(self) -> None:
        """Cancel the calls in flight, let them settle, stop the loop and join the threads.

        Only the facade's top-level calls are cancelled: a server call settles its phase before
        it stops (its inner tasks must not be cancelled under it), and the calls nested in an
        operation stop with it. What is left on the loop then (engine-side work of in-process
        engines) is cancelled as the loop closes.
        """
        with self.guard:
            self.closed = True
            running = list(self.pending)
        self.cancel([pending for pending in running if not pending.nested])
        wait([p.settled for p in running])
        with contextlib.suppress(RuntimeError):  # the loop has ended already
            self.portal.call(self.portal.stop)
        self.thread.join()
        self.join_workers()

    def join_workers(self) -> None:
        """Join the worker threads; an abandoned one (a hook still running) gets a short grace,
        usually enough (its call to the facade fails now that the loop has stopped), and one
        that is hung is left behind with a warning."""
        for worker in list(self.workers - self.abandoned):
            worker.join()
        grace_ends = time.monotonic() + _ABANDONED_GRACE_S
        for worker in self.abandoned:
            worker.join(max(0.0, grace_ends - time.monotonic()))
            if worker.is_alive():
                logger().warning("sync.worker_abandoned", server=self.name, thread=worker.name)

    async def in_thread(
        self, facade: object, fn: Callable[..., Any], args: tuple[Any, ...], *, leave: bool
    ) -> Any:
        """Run ``fn(*args)`` in a new thread, in a copy of this task's context (so that a call
        back into the facade is seen as a re-entry of the operation in progress)."""
        runtime = self
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        context = contextvars.copy_context()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        def work() -> None:
            _LOCAL.facade = facade
            try:
                outcome: tuple[Any, BaseException | None] = (context.run(fn, *args), None)
            except BaseException as exc:
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(settle, *outcome)

        # Threads that have ended are forgotten here; close() joins the rest.
        ended = [t for t in runtime.workers if not t.is_alive()]
        runtime.workers.difference_update(ended)
        runtime.abandoned.difference_update(ended)
        thread = threading.Thread(target=work, name=f"{runtime.thread_name}-worker", daemon=True)
        runtime.workers.add(thread)
        thread.start()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # A thread cannot be interrupted. A hook's call stops waiting for it (the server
            # stops at its last boundary) and leaves it to return on its own: a call it makes
            # to the facade afterwards is a call of its own, serialized by the server. Others
            # are waited for.
            while not leave and not future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            if not future.done():
                runtime.abandoned.add(thread)
                logger().warning("sync.worker_left_running", server=runtime.name, fn=repr(fn))
            raise


def _run_loop(runtime: _Runtime, started: Future[BlockingPortal]) -> None:
    """The loop thread: an event loop running the portal until it is stopped.

    A ``KeyboardInterrupt`` raised in a task (a sync hook's, which the server lets propagate)
    leaves through the loop after the task handed it to its awaiter, and so to the blocked
    caller; the loop is not a casualty of it, and carries on.
    """

    async def serve() -> None:
        async with BlockingPortal() as portal:
            started.set_result(portal)
            await portal.sleep_until_stopped()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        main = loop.create_task(serve())
        while not main.done():
            try:
                loop.run_until_complete(main)
            except (KeyboardInterrupt, SystemExit) as exc:
                logger().warning("sync.loop_interrupted", server=runtime.name, error=repr(exc))
        if not started.done():
            started.set_exception(main.exception() or RuntimeError("the loop did not start"))
        # What is left (engine-side work of in-process engines) is cancelled.
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        with runtime.guard:
            runtime.closed = True
        asyncio.set_event_loop(None)
        loop.close()


async def _now(read: Callable[[], T]) -> T:
    return read()


def _settle(runtime: _Runtime, pending: _Pending, settled: Future[Any]) -> BaseException | None:
    """Cancel ``pending`` once and wait until it has settled, whatever interrupts the wait; the
    first interrupt, if any. A call never abandons a phase in flight, not at a second Ctrl-C
    either: every phase is bounded by its deadlines, and leaving early would hand the caller a
    server still moving (a release landing after the caller read ``drained``)."""
    interrupted: BaseException | None = None
    cancelled = False
    while True:
        try:
            if not cancelled:
                runtime.cancel([pending])  # (again after an interrupt in it: once on the loop)
                cancelled = True
            wait([settled])
            return interrupted
        except BaseException as exc:
            if interrupted is None:
                interrupted = exc


async def _awaited(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


def _is_async(fn: object) -> bool:
    # A callable object (a built-in strategy such as ``FromDisk``) is async by its ``__call__``.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 < timeout <= MAX_SECONDS
    ):
        raise InvalidArgument(
            f"timeout must be None or a number of seconds > 0 and <= {MAX_SECONDS:g}, "
            f"got {timeout!r}"
        )
    return float(timeout)


class SyncRolloutServer:
    """A ``RolloutServer`` for synchronous code: every lifecycle call blocks until it is done.

    ``SyncRolloutServer(groups, config, name=...)`` builds the server on the facade's own loop
    thread; ``SyncRolloutServer.wrap(factory)`` builds it by calling ``factory()`` (sync or
    async) there. Methods mirror the async API and raise what it raises (the same exception
    objects); each blocking call takes an optional ``timeout`` in seconds. Use the facade as a
    context manager, or call ``close()``.

    Threading design:

    * **One loop thread owns the server.** The ``RolloutServer`` (its lock, its state machine,
      its generation client) is built on that thread and only used there. A method hands the
      coroutine to the loop through anyio's blocking portal and blocks its caller on the
      ``concurrent.futures.Future`` the portal returns.
    * **Every sync callable handed over runs in a worker thread of its own**: hooks, weight
      pushes, ``recover`` factories. It may block (``ray.get``, a collective) without stalling
      the loop, and it may call the facade again; an awaitable it returns is awaited on the
      loop. Async callables (``async def``, a built-in strategy such as ``FromDisk``) run on the
      loop, as on the async server.
    * **Re-entry is routed by context, so it cannot deadlock.** A call runs in a copy of its
      caller's ``contextvars`` context, and a worker thread in a copy of the context of the
      operation that started it. A hook calling ``facade.update_weights(...)`` is thus seen by
      the server as a call from inside the operation that holds its lock, exactly like an async
      hook awaiting ``server.update_weights(...)``: it runs inline instead of waiting for the
      lock, while the hook runs. Such a nested call is part of that operation: it is never
      cancelled on its own (that would interrupt a phase), so its ``timeout`` does not apply;
      the operation's does. A thread the hook starts itself does not inherit the context:
      calling the facade from there while the hook waits for it would wait for the lock (until
      the hook deadline, ``Deadlines.hook``, stops the hook).
    * **Nothing is lost, nothing hangs.** A call that outlives its ``timeout``
      (``SyncCallTimeout``) or whose caller is interrupted (Ctrl-C) is cancelled as a cancelled
      async caller is: the server settles the phase in flight first, so the state is exact
      when the caller hears of it (a second Ctrl-C meanwhile does not cut the wait short; the
      caller gets the first once the call has settled). A hook's worker thread cannot be
      interrupted: a cancelled call (or a hook past ``Deadlines.hook``, which fails with
      ``HookFailed``) stops waiting for it and leaves it to return on its own; ``close()``
      does not join such a thread, and whatever it calls on the facade later is a call of its
      own, serialized behind any other.
    * Calling a blocking member from the loop thread itself (an async hook, a coroutine on that
      loop) raises ``CalledFromLoopThread`` instead of deadlocking; await ``facade.server``
      there. ``close()`` cancels the calls in flight (each settles; its caller gets
      ``SyncServerClosed``), stops the loop and joins every thread the facade started. The
      engines are the caller's: ``close()`` leaves them as they are.
    """

    def __init__(
        self,
        groups: Sequence[EngineGroup],
        config: LifecycleConfig | None = None,
        *,
        name: str = "rollout",
    ) -> None:
        self._start(name, lambda: RolloutServer(groups, config, name=name))

    @classmethod
    def wrap(cls, server_factory: Callable[[], Any]) -> SyncRolloutServer:
        """A facade over the ``RolloutServer`` that ``server_factory()`` returns (or, if async,
        resolves to); it is called on the facade's loop thread, where the server must live."""
        if isinstance(server_factory, RolloutServer) or not callable(server_factory):
            raise InvalidArgument(
                f"wrap() needs a callable returning a RolloutServer (the server must be built on "
                f"the facade's loop thread), got {server_factory!r}"
            )
        facade = cls.__new__(cls)
        facade._start(None, server_factory)
        return facade

    def _start(self, name: str | None, factory: Callable[[], Any]) -> None:
        terminate.install()  # (here: the server is built on the loop's thread, not the main one)
        self._runtime = _Runtime(name if isinstance(name, str) and name else "rollout")
        self._finalizer = weakref.finalize(self, _Runtime.stop, self._runtime)

        async def build() -> RolloutServer:
            server = factory()
            if inspect.isawaitable(server):
                server = await server
            if not isinstance(server, RolloutServer):
                raise InvalidArgument(
                    f"the server factory returned {server!r}, not a RolloutServer"
                )
            return server

        try:
            self._server = self._call("__init__", build)
        except BaseException:
            self._shutdown()
            raise
        self._runtime.name = self._server.name

    def __repr__(self) -> str:
        if self._runtime.closed:
            return f"SyncRolloutServer({self._runtime.name!r}, closed)"
        return f"SyncRolloutServer({self._runtime.name!r}, state={self._server.state.value!r})"

    def __enter__(self) -> SyncRolloutServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inspection ---------------------------------------------------------------------------

    @property
    def server(self) -> RolloutServer:
        """The async server. It lives on the facade's loop thread: await it there (from async
        hooks), never from another thread. Unlike the blocking members, readable anywhere."""
        if self._runtime.closed:
            raise SyncServerClosed(self._runtime.name, "server")
        return self._server

    @property
    def name(self) -> str:
        """The server's name."""
        return self._runtime.name

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._runtime.closed

    @property
    def state(self) -> ServerState:
        """The aggregate state."""
        return self._call("state", lambda: _now(lambda: self._server.state))

    @property
    def metrics(self) -> dict[str, float]:
        """Timings of the last completed call of each kind, as a flat dict."""
        return self._call("metrics", lambda: _now(lambda: self._server.metrics))

    @property
    def expected_version(self) -> str | None:
        """The version of the last versioned weight update."""
        return self._call("expected_version", lambda: _now(lambda: self._server.expected_version))

    def snapshot(self) -> ServerSnapshot:
        """The state and what the server knows of every engine."""
        return self._call("snapshot", lambda: _now(self._server.snapshot))

    def unhealthy_units(self) -> dict[str, str]:
        """The units of several servers that cannot serve whole, with why; see
        ``RolloutServer.unhealthy_units``."""
        return self._call("unhealthy_units", lambda: _now(self._server.unhealthy_units))

    def probe(self, *, timeout: float | None = None) -> dict[str, EngineOutcome]:
        """Probe every live engine's liveness without generating; dead ones are marked dead."""
        return self._call("probe", lambda: self._server.probe(), timeout)

    # -- hooks --------------------------------------------------------------------------------

    def on(self, event: str | ServerState, hook: SyncHook) -> Callable[[], None]:
        """Call ``hook(LifecycleEvent)`` on ``event`` (see ``RolloutServer.on``); returns its
        remover. A sync hook runs in a worker thread and may call this facade."""
        target = self._threaded(hook, leave=True) if callable(hook) else hook
        remove = self._call("on", lambda: _now(lambda: self._server.on(event, target)))

        def remover() -> None:
            if self._runtime.closed or self._on_loop_thread():
                remove()  # nothing runs hooks any more, or we are where they run
            else:
                self._call("remove_hook", lambda: _now(remove))

        return remover

    # -- lifecycle ----------------------------------------------------------------------------

    def offload(self, *, timeout: float | None = None) -> dict[str, float]:
        """Pause and drain the offloaded groups, then release their memory."""
        return self._call("offload", lambda: self._server.offload(), timeout)

    def onload_weights(self, *, timeout: float | None = None) -> dict[str, float]:
        """Resume the weights (``released -> weights_restored``); KV stays released."""
        return self._call("onload_weights", lambda: self._server.onload_weights(), timeout)

    def update_weights(
        self,
        push: SyncWeightPush,
        version: str | None = None,
        *,
        verify: bool | None = None,
        expected: Fingerprint | Sequence[Fingerprint] | None = None,
        may_be_noop: bool = False,
        timeout: float | None = None,
    ) -> dict[str, float]:
        """Write weights while they are resident and generation is paused, verified as
        ``RolloutServer.update_weights`` says.

        ``push(WeightUpdate)`` may be a plain function (run in a worker thread: it may block,
        e.g. on ``ray.get`` or a broadcast) or async / a built-in strategy (run on the loop). A
        sync push cannot be interrupted: past the server's weight-update deadline the call
        waits for it to return, then fails with ``HookFailed``.
        """
        target = self._threaded(push) if callable(push) else push
        return self._call(
            "update_weights",
            lambda: self._server.update_weights(
                target, version, verify=verify, expected=expected, may_be_noop=may_be_noop
            ),
            timeout,
        )

    def onload_kv(self, *, timeout: float | None = None) -> dict[str, float]:
        """Resume the KV cache, then continue generation."""
        return self._call("onload_kv", lambda: self._server.onload_kv(), timeout)

    def onload(self, *, timeout: float | None = None) -> dict[str, float]:
        """Everything ``offload`` undid: weights, then KV, then continue."""
        return self._call("onload", lambda: self._server.onload(), timeout)

    def pause(self, *, timeout: float | None = None) -> dict[str, float]:
        """Pause and drain every group; nothing is released."""
        return self._call("pause", lambda: self._server.pause(), timeout)

    def resume(self, *, timeout: float | None = None) -> dict[str, float]:
        """Continue generation from ``drained`` or ``kv_restored``."""
        return self._call("resume", lambda: self._server.resume(), timeout)

    def reset(self, *, timeout: float | None = None) -> ServerState:
        """Leave ``failed`` for the state the engines' records imply."""
        return self._call("reset", lambda: self._server.reset(), timeout)

    def recover(
        self,
        factory: SyncEngineFactory | None = None,
        *,
        unit_factory: Callable[[tuple[str, ...]], Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, EngineOutcome]:
        """Replace dead and uncertain engines through ``factory(engine_id)``, and unhealthy
        units whole through ``unit_factory(member_ids)`` (a sync factory runs in a worker
        thread); see ``RolloutServer.recover``."""
        one, unit = (self._threaded(f) if callable(f) else f for f in (factory, unit_factory))
        return self._call("recover", lambda: self._server.recover(one, unit_factory=unit), timeout)

    def add_engines(
        self, group: str, engines: Sequence[Any], *, timeout: float | None = None
    ) -> list[str]:
        """Engines join ``group``; their ids. See ``RolloutServer.add_engines``."""
        return self._call("add_engines", lambda: self._server.add_engines(group, engines), timeout)

    def remove_engines(
        self, ids: Sequence[str], *, stop: bool = True, timeout: float | None = None
    ) -> dict[str, EngineOutcome]:
        """The engines ``ids`` leave the fleet. See ``RolloutServer.remove_engines``."""
        return self._call(
            "remove_engines", lambda: self._server.remove_engines(ids, stop=stop), timeout
        )

    @contextmanager
    def paused(self, *, timeout: float | None = None) -> Iterator[SyncRolloutServer]:
        """Pause every group for the body (a non-colocated weight sync), then continue."""
        self.pause(timeout=timeout)
        try:
            yield self
        finally:
            if self.state is not ServerState.FAILED:
                self.resume(timeout=timeout)

    @contextmanager
    def offloaded(self, *, timeout: float | None = None) -> Iterator[SyncRolloutServer]:
        """Offload on enter; on exit, even when the body raises, restore weights, run the hooks
        (your weight push), restore KV and continue."""
        self.offload(timeout=timeout)
        try:
            yield self
        finally:
            if self.state is not ServerState.FAILED:
                self.onload(timeout=timeout)

    # -- generation ---------------------------------------------------------------------------

    def generate(
        self, request: dict[str, Any], group: str | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Run one generate request to its full answer, on serving engines only (held while
        they are paused; aborted work is resubmitted)."""
        return self._call("generate", lambda: self._server.generate(request, group=group), timeout)

    def generate_batch(
        self,
        requests: Sequence[dict[str, Any]],
        group: str | None = None,
        *,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        """Run every request concurrently; answers in request order."""
        return self._call(
            "generate_batch",
            lambda: self._server.generate_batch(requests, group=group),
            timeout,
        )

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel calls in flight (each settles first), stop the loop and join every thread.

        Idempotent. Afterwards every method raises ``SyncServerClosed``. Engines are left as
        they are.
        """
        runtime = self._runtime
        with runtime.guard:
            if runtime.closed:
                return
            if self._on_loop_thread():
                raise CalledFromLoopThread(runtime.name, "close")
            if getattr(_LOCAL, "facade", None) is self:
                raise LifecycleError(
                    f"SyncRolloutServer {runtime.name!r}: close() was called from one of its own "
                    f"hooks, pushes or factories, which the call in flight waits for"
                )
            runtime.closed = True
        self._shutdown()

    def _shutdown(self) -> None:
        self._runtime.shutdown()
        self._finalizer.detach()

    # -- machinery ----------------------------------------------------------------------------

    def _on_loop_thread(self) -> bool:
        return threading.get_ident() == self._runtime.loop_thread

    def _check_usable(self, call: str) -> None:
        if self._runtime.closed:
            raise SyncServerClosed(self._runtime.name, call)
        if self._on_loop_thread():
            raise CalledFromLoopThread(self._runtime.name, call)

    def _call(self, call: str, make: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``make()`` on the loop, in a copy of the caller's context; block until settled.

        A lifecycle call (``calls.LIFECYCLE_CALLS``) made from one of this facade's worker threads
        joins the operation in progress (it runs inline, under that operation's lock); it is
        bounded by that operation, never cancelled on its own: its ``timeout`` does not apply.
        """
        limit = _check_timeout(timeout)
        nested = call in LIFECYCLE_CALLS and getattr(_LOCAL, "facade", None) is self
        if nested:
            limit = None
        runtime = self._runtime
        pending = _Pending(nested)
        settled = pending.settled
        handed = False
        try:
            try:
                # The check and the hand-over are one step for close(): a call handed over
                # before it marked the facade closed runs (or is cancelled) before the loop
                # stops.
                with runtime.guard:
                    self._check_usable(call)
                    runtime.pending.add(pending)
                    handed = True
                    runtime.submit(pending, make, contextvars.copy_context())
                finished = bool(wait([settled], timeout=limit).done)
            except BaseException:
                # Interrupted (Ctrl-C) while waiting, or while handing the call over (which the
                # loop may have started already): like a cancelled async caller, settle first,
                # then raise.
                if handed:
                    _settle(runtime, pending, settled)
                raise
            if not finished and (interrupted := _settle(runtime, pending, settled)) is not None:
                raise interrupted
        finally:
            with runtime.guard:
                runtime.pending.discard(pending)
        if settled.cancelled():  # the loop ended under the call
            raise SyncServerClosed(runtime.name, call, during=True)
        cancelled, value, error = settled.result()
        if cancelled:
            if runtime.closed:
                raise SyncServerClosed(runtime.name, call, during=True)
            if not finished:
                raise SyncCallTimeout(call, limit or 0.0, self._server.state.value)
            raise asyncio.CancelledError(f"{call} was cancelled")
        if error is not None:
            raise error
        return cast(T, value)

    def _threaded(self, fn: Callable[..., Any], *, leave: bool = False) -> Callable[..., Any]:
        """``fn`` as the server should call it: async callables as they are, sync ones in a
        worker thread (whatever awaitable they return is awaited on the loop).

        A cancelled call ``leave``s a hook's thread running; it waits for a weight push (which
        must not write weights after its session closed) or a factory (whose engine would leak).
        """
        if _is_async(fn):
            return fn

        async def in_worker(*args: Any) -> Any:
            result = await self._runtime.in_thread(self, fn, args, leave=leave)
            if inspect.isawaitable(result):
                result = await result
            return result

        # HookFailed names the hook by its qualified name.
        in_worker.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        in_worker.__name__ = getattr(fn, "__name__", in_worker.__qualname__)
        return in_worker


__all__ = [
    "CalledFromLoopThread",
    "SyncCallTimeout",
    "SyncRolloutServer",
    "SyncServerClosed",
]
