"""The engine interface: one protocol every backend implements, and the host that serves it.

A *backend* speaks to one SGLang engine (the simulated engine here; an HTTP client of a real
server). An ``EngineHost`` wraps one backend and exposes the lifecycle operations with the
library's own conventions (plain strings over the wire, flush retried until its deadline). The
host is what runs inside a Ray engine actor (``rollout_lifecycle.EngineActor``) and, for
in-process fleets, what an ``EngineGroup`` calls directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from types import CoroutineType
from typing import Any, Protocol, runtime_checkable

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.capabilities import capabilities_of
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineError,
    EngineFenced,
    EngineRejected,
    EngineRestarted,
    EngineStateConflict,
    EngineTimeout,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.identity import COARSE, Expectation, disagreement
from rollout_lifecycle.contract.ops import CHECKED, CHECKED_OPS, RUN, Op
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.contract.values import (
    DEFAULT_GROUP_NAME,
    PauseMode,
    Tag,
    check_seconds,
    member,
    parse_tags,
    short_repr,
)


@runtime_checkable
class EngineBackend(Protocol):
    """One SGLang engine, as the lifecycle needs it. Each method maps to one SGLang call."""

    @property
    def label(self) -> str:
        """A name for errors and logs (an address, never a credential)."""
        ...

    async def pause_generation(self, mode: PauseMode) -> None:
        """``POST /pause_generation``. ``PauseMode.WAIT`` is not SGLang's: a backend lets the
        requests in flight end before it pauses (``SGLangHTTPEngine``: a flush that waits,
        then a retract pause), or refuses it."""
        ...

    async def continue_generation(self) -> None:
        """``POST /continue_generation``."""
        ...

    async def flush_cache(self, timeout: float) -> None:
        """``POST /flush_cache``; raises ``EngineRejected`` (400) when not idle.

        ``timeout`` 0: no server-side wait (flush now if idle; while paused the waiting queue
        does not count). ``timeout`` T > 0: ``?timeout=T``, the server waits up to T for
        idleness counting the waiting queue (for an unpaused engine going idle).
        """
        ...

    async def release_memory_occupation(self, tags: Sequence[Tag]) -> bool | None:
        """``POST /release_memory_occupation`` with explicit tags. True when the release
        discarded the weights' values (a resume brings back their memory, not them: only a
        push makes them usable again); None or False otherwise."""
        ...

    async def resume_memory_occupation(self, tags: Sequence[Tag]) -> None:
        """``POST /resume_memory_occupation`` with explicit tags."""
        ...

    async def begin_weight_update(self) -> None:
        """``POST /begin_weight_update``; a session already open is refused with
        ``SESSION_OPEN`` (409), whatever the server's own answer for it."""
        ...

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update``."""
        ...

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
    ) -> None:
        """``POST /update_weights_from_disk``; every flag is sent explicitly."""
        ...

    async def update_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        """``POST /update_weight_version``; ``abort_all_requests`` is sent explicitly."""
        ...

    async def weight_version(self) -> str | None:
        """The loaded weight version (``GET /model_info``)."""
        ...

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info``: the liveness probe that is safe while paused."""
        ...

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``; returns ``{"text", "output_ids", "meta_info"}``."""
        ...

    async def close(self) -> None:
        """Release client resources."""
        ...


#: While an engine host reads an engine to check it, what the reads are for: the operation about
#: to be sent (``checked``), or ``"observe"``. A backend that keeps a history (the simulator)
#: marks those reads with it, so a test can tell them from calls of their own.
CHECKING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rollout_lifecycle_checking", default=None
)


def incarnation_of(info: Mapping[str, Any]) -> str | None:
    """The incarnation an SGLang ``/server_info`` names: a digest of its ``startup_time`` (the
    durations of this process's start-up phases, to the microsecond) and its ``random_seed``
    (drawn at start-up unless the server was given one). Both stay the same for the life of a
    process and differ between two starts, also at the same address. None when neither is
    there (the engine cannot be told apart from a restarted one)."""
    # sglang: http_server.py server_info ("startup_time": tokenizer_manager.startup_time, set
    # once from the scheduler's start-up: observability/startup_time.py);
    # arg_groups/serving_hook.py (random_seed=random.randint(0, 1 << 30) when not given)
    parts = {key: info.get(key) for key in ("startup_time", "random_seed")}
    if all(value is None for value in parts.values()):
        return None
    text = json.dumps(parts, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    # A start time alone (vLLM's, to the clock tick) may be two processes' (COARSE).
    return digest if parts["random_seed"] is not None else COARSE + digest


def observe(backend: object, *, paused: bool, identify: bool) -> Awaitable[dict[str, Any]]:
    """What ``backend``'s engine says of itself, to await: ``{"incarnation": str | None,
    "paused": bool | None}``, each read only when asked for (``identify``, ``paused``).

    A backend that offers ``observe()`` answers it itself (the HTTP client reads the routes
    below at once; the simulator its own state). Otherwise: the incarnation from
    ``server_info()`` (``incarnation_of``), which fails with ``EngineDead`` when nothing
    answers; and, for a backend that offers ``ping()`` (healthy, paused or not) and ``ready()``
    (healthy and not paused), whether it is paused: a healthy engine that is not ready is
    paused. SGLang answers ``/ping`` and ``/ready`` so; an engine that is unhealthy or
    starting, or a backend without them, cannot tell (None).
    """
    # (The backend's own coroutine is handed back, not awaited here: one coroutine less per
    # read, and a checked call reads once per engine per phase.)
    own = getattr(backend, "observe", None)
    if own is not None:
        found: Awaitable[dict[str, Any]] = own(paused=paused, identify=identify)
        return found
    return read_engine(backend, paused=paused, identify=identify)


async def read_engine(backend: object, *, paused: bool, identify: bool) -> dict[str, Any]:
    """``observe`` from the backend's reads (``server_info``, ``ping``, ``ready``)."""
    found: dict[str, Any] = {"incarnation": None, "paused": None}
    if identify:
        found["incarnation"] = incarnation_of(await backend.server_info())  # type: ignore[attr-defined]
    ping, ready = getattr(backend, "ping", None), getattr(backend, "ready", None)
    if paused and ping is not None and ready is not None:
        healthy, serving = await asyncio.gather(ping(), ready())
        found["paused"] = None if not healthy else not serving
    return found


def _takes(method: Callable[..., Any] | None, name: str) -> bool:
    """Whether ``method`` takes the keyword argument ``name``."""
    if method is None:
        return False
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):  # (a callable without a signature Python can read)
        return False


def introspect(backend: object, name: str, default: Any) -> Any:
    """``backend.name()`` where the backend offers it (a simulated engine's test hooks), else
    ``default``: a real server has no such method and answers nothing."""
    method = getattr(backend, name, None)
    return default if method is None else method()


#: What ``checked`` answers for a check that named nothing (no incarnation read, nothing
#: declared), by the command's result: None, or a flag (a release's "weights' values gone").
_UNNAMED: dict[bool | None, tuple[None, bool | None, None]] = {
    result: (None, result, None) for result in (None, True, False)
}

#: The operations ``run`` carries out, and those ``checked`` carries (their wire names).
_OPS = frozenset(op.value for op in Op)
_CHECKED = frozenset(op.value for op in CHECKED_OPS)


class EngineHost:
    """Serves one backend's lifecycle operations; the body of an engine actor.

    Arguments and results are plain Python values (strings, lists, dicts) so that the same
    methods work in process and across Ray.
    """

    def __init__(self, backend: EngineBackend) -> None:
        if not isinstance(backend, EngineBackend):
            raise InvalidArgument(f"backend must be an engine backend, got {backend!r}")
        self._backend = backend
        #: Whether the backend's ``observe`` marks its reads with their ``purpose`` itself (the
        #: simulator's does): then no ``CHECKING`` is set around them, which costs every
        #: checked call two new context mappings.
        self._marks_reads = _takes(getattr(backend, "observe", None), "purpose")
        #: The newest lease epoch each fencing scope has sent a command under (``fenced``).
        self._fences: dict[str, int] = {}
        #: ``checked``'s last answer that named the process, given again while it holds.
        self._answer: tuple[Any, Any, Any] | None = None

    @property
    def backend(self) -> EngineBackend:
        """The hosted backend."""
        return self._backend

    async def label(self) -> str:
        """The backend's label."""
        return self._backend.label

    async def worker_url(self) -> str | None:
        """The URL a router sends this engine's traffic to (an HTTP backend's base URL); None
        for an engine with none (a simulated one)."""
        url = getattr(self._backend, "url", None)
        return url if isinstance(url, str) else None

    async def observe(
        self, paused: bool = True, purpose: str = "observe", identify: bool = True
    ) -> dict[str, Any]:
        """Who the engine is and what it says of itself: ``{"incarnation": str | None,
        "paused": bool | None}`` (``observe``); ``purpose`` marks the reads: given to a
        backend whose ``observe`` takes it, else set in ``CHECKING`` while they run.
        With ``identify``, also what its driver declares it can do (``"capabilities"``,
        ``Capabilities.to_wire``): they are the process's, read with the incarnation."""
        return self._declared(await self._read(paused, purpose, identify), identify)

    def _declared(
        self, found: dict[str, Any], identify: bool, shared: bool = False
    ) -> dict[str, Any]:
        """A read ``found``, with what the driver declares when it names the process (with
        ``shared``, the declaration's one mapping: for an answer that only the runner reads)."""
        if identify:
            caps = capabilities_of(self._backend)
            found["capabilities"] = caps.wire if shared else caps.to_wire()
        return found

    def _read(self, paused: bool, purpose: str, identify: bool) -> Awaitable[dict[str, Any]]:
        """``observe``'s read of the backend, to await (no coroutine of its own where the
        backend marks its reads: a checked call makes one per engine per phase)."""
        if self._marks_reads:
            found: Awaitable[dict[str, Any]] = self._backend.observe(  # type: ignore[attr-defined]
                paused=paused, identify=identify, purpose=purpose
            )
            return found
        return self._marked_read(paused, purpose, identify)

    async def _marked_read(self, paused: bool, purpose: str, identify: bool) -> dict[str, Any]:
        """``observe(backend)`` with ``CHECKING`` set to ``purpose`` while it runs."""
        token = CHECKING.set(purpose)
        try:
            return await observe(self._backend, paused=paused, identify=identify)
        finally:
            CHECKING.reset(token)

    async def run(self, op: str, *args: Any) -> Any:
        """Carry out one command, as the seam delivers it (``contract/seam.command``): its
        operation's name and its ``args``, plain values, which cross Ray as cheaply as any call.
        The lifecycle's one way into an engine: the host's method of the operation where it has
        one (it adapts the call to the backend), else the backend's own method of that name; a
        backend without it refuses with a 501 ``EngineRejected``."""
        if op not in _OPS:
            raise InvalidArgument(f"{short_repr(op)} is not an engine operation")
        return await self._method(op)(*args)

    def _method(self, op: str) -> Callable[..., Awaitable[Any]]:
        """What carries out the operation ``op`` (``run``)."""
        method = getattr(self, op, None)
        return self._optional(op) if method is None else method  # type: ignore[no-any-return]

    async def checked(self, expect: Expectation, op: str, *args: Any) -> tuple[Any, Any, Any]:
        """The command ``op(*args)`` (``run``), carried out only once the engine has shown it
        is what its record expects (``expect``: ``(incarnation, paused, identify)``, see
        ``EngineRecord.expect``; the incarnation is read only with ``identify``); returns
        ``(incarnation, result, capabilities)`` (the capabilities only with ``identify``, else
        None).

        Another process at the address raises ``EngineRestarted``; a pause state other than
        the record's raises ``EngineStateConflict``; an engine that cannot be read raises
        ``IllegalEngineOp`` (or ``EngineDead`` when nothing answers). In each case ``op`` was
        not sent. The check and the call follow each other at once, so only a process that
        restarts in between (a start takes SGLang tens of seconds) could slip through.
        """
        if op not in _CHECKED:
            raise InvalidArgument(f"{short_repr(op)} is not an operation checked before it is sent")
        try:
            identify = expect[2] if len(expect) > 2 else True
            seen = self._declared(
                await self._read(expect[1] is not None, op, identify), identify, shared=True
            )
        except EngineDead:
            raise
        except EngineError as exc:
            raise IllegalEngineOp(
                self._backend.label,
                op,
                f"the engine could not be read before {op}, which was not sent: {exc}",
            ) from None
        found = disagreement(expect, seen)
        if found is not None and found[0] is Outcome.CONFLICT and not identify and expect[0]:
            # Not paused as recorded: a new process at the address looks so too. Which one it
            # is, its incarnation tells (read now, only on a disagreement).
            named = None
            with contextlib.suppress(EngineError):
                named = (await self.observe(False, op, True))["incarnation"]
            if named is not None and named != expect[0]:
                raise EngineRestarted(self._backend.label, op, expect[0], named)
        if found is not None:
            outcome, records, reported = found
            if outcome is Outcome.RESTARTED:
                raise EngineRestarted(self._backend.label, op, expect[0], seen["incarnation"])
            raise EngineStateConflict(self._backend.label, op, records, reported)
        result = await self._method(op)(*args)  # (``run``; ``op`` is checked above)
        incarnation, declared = seen["incarnation"], seen.get("capabilities")
        if result is None or type(result) is bool:
            # A command that answered nothing or a flag: one shared answer where the check
            # named nothing, else this engine's last one while it holds, not a tuple per engine
            # that its phase keeps until it settles.
            if incarnation is None and declared is None:
                return _UNNAMED[result]
            last = self._answer
            if (
                last is None
                or last[0] != incarnation
                or last[1] is not result
                or last[2] is not declared
            ):
                last = self._answer = (incarnation, result, declared)
            return last
        return (incarnation, result, declared)

    async def fenced(self, fence: Sequence[Any], via: str, *args: Any) -> Any:
        """Carry out a command sent under a cluster lease (``lease``): ``fence`` is
        ``[scope, epoch]``, ``via`` the method that carries it (``run`` or ``checked``) and
        ``args`` its arguments. A command whose epoch is older than the newest this engine has
        carried out for ``scope`` raises ``EngineFenced`` and does nothing: a controller whose
        lease another took over (it stalled past the lease's time to live) cannot act on the
        engine again, however late its commands arrive. The epoch is taken before the command
        runs, so that one arriving while an older one still runs is ordered after it."""
        scope, epoch = fence
        if not isinstance(scope, str) or type(epoch) is not int:
            raise InvalidArgument(f"a fence is [scope, epoch], got {short_repr(fence)}")
        current = self._fences.get(scope, -1)
        if epoch < current:
            op = args[1] if via == CHECKED and len(args) > 1 else (args[0] if args else via)
            raise EngineFenced(self._backend.label, str(op), epoch, current)
        self._fences[scope] = epoch
        if via == RUN:
            return await self.run(*args)
        if via == CHECKED:
            return await self.checked(*args)
        raise InvalidArgument(f"{short_repr(via)} is not a way to carry out a command")

    async def pause_generation(self, mode: str) -> None:
        """Pause generation in ``mode``."""
        await self._backend.pause_generation(member(PauseMode, mode, "pause mode"))

    async def continue_generation(self) -> None:
        """Continue generation."""
        await self._backend.continue_generation()

    async def flush_cache(self, deadline: float, retry_interval: float = 0.05) -> int:
        """The idle barrier: flush until the engine is idle, retrying 400s until ``deadline``
        seconds pass.

        Every attempt is a flush with no server-side timeout, and the client retries: a 400 is
        not fatal, it is the barrier saying "not yet". A server-side timeout would be wrong
        here: SGLang then re-checks idleness counting its waiting queue, where a retract pause
        keeps the retracted requests, and answers 400 after the timeout every time; without
        one it flushes as soon as nothing runs, the waiting queue ignored while paused. The
        same barrier serves the flush after a weight write. Returns the number of attempts the
        flush took (1 when the engine was idle at once), which the server reports as
        ``lifecycle/<call>/<phase>_retries``.
        """
        # sglang: flush_wrapper.py SchedulerFlushWrapper.handle (timeout_s <= 0 -> flush now;
        # > 0 -> deferred, check_pending uses is_fully_idle() with the waiting queue);
        # scheduler.py Scheduler.flush_cache (is_fully_idle(ignore_waiting=self._engine_paused))
        deadline = check_seconds("flush deadline", deadline, positive=False)  # 0: one attempt
        retry_interval = check_seconds("flush retry_interval", retry_interval, positive=False)
        clock = asyncio.get_running_loop().time  # the clock the retry sleeps run on
        start = clock()
        attempts = 0
        while True:
            attempts += 1
            try:
                await self._backend.flush_cache(0.0)
                return attempts
            except EngineRejected as exc:
                if exc.status != 400:
                    raise  # only 400 means "not idle yet"; a 401 or 503 will not pass by waiting
                remaining = deadline - (clock() - start)
                if remaining <= 0:
                    raise EngineTimeout(
                        self._backend.label,
                        "flush_cache",
                        f"engine not idle after {deadline:g}s and {attempts} attempt(s): "
                        f"{exc.message}",
                    ) from exc
                await asyncio.sleep(min(retry_interval, remaining))

    async def release_memory_occupation(self, tags: list[str]) -> bool:
        """Release the given tags; whether the release discarded the weights' values (the
        backend says so: ``EngineBackend.release_memory_occupation``), which the ledger records
        (``EngineRecord.lost_weights``)."""
        tags_ = _wire_tags(tags, "release tags")
        return await self._backend.release_memory_occupation(tags_) is True

    async def resume_memory_occupation(self, tags: list[str]) -> None:
        """Resume the given tags."""
        await self._backend.resume_memory_occupation(_wire_tags(tags, "resume tags"))

    async def begin_weight_update(self) -> None:
        """Open a weight-update session; one already open is refused with ``SESSION_OPEN``
        (409), as the backend says (``EngineBackend.begin_weight_update``)."""
        await self._backend.begin_weight_update()

    async def end_weight_update(self) -> None:
        """Close a weight-update session."""
        await self._backend.end_weight_update()

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = False
    ) -> None:
        """Load weights from disk."""
        # abort_all_requests is always false: aborting would drop the requests that a retract
        # pause preserved.
        await self._backend.update_weights_from_disk(
            model_path,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=False,
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Any,
        weight_version: str | None = None,
        flush_cache: bool = False,
    ) -> None:
        """Write weights from serialized tensors (inside a weight-update session)."""
        await self._optional("update_weights_from_tensor")(
            serialized_named_tensors,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=False,
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = False,
        load_format: str | None = None,
    ) -> None:
        """Receive weights over a collective group (inside a weight-update session).

        ``load_format`` is passed on only when given (backends without it keep working).
        """
        extra: dict[str, Any] = {} if load_format is None else {"load_format": load_format}
        await self._optional("update_weights_from_distributed")(
            names,
            dtypes,
            shapes,
            group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            abort_all_requests=False,
            **extra,
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """Join the collective group weights arrive over (``/init_weights_update_group``);
        returns once the trainer and every member joined."""
        await self._optional("init_weights_update_group")(
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name=group_name,
            backend=backend,
        )

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """Leave a collective group (``/destroy_weights_update_group``)."""
        await self._optional("destroy_weights_update_group")(group_name)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the request whose id is exactly ``rid`` (or all of them with ``abort_all``).

        SGLang (one tokenizer worker, its default) matches the rid exactly: a prefix aborts
        nothing, and ``rid=""`` without ``abort_all`` is ignored.
        """
        # sglang: tokenizer_manager.py TokenizerManager.abort_request
        await self._optional("abort_request")(rid, abort_all)

    def _optional(self, name: str) -> Any:
        method = getattr(self._backend, name, None)
        if method is None:
            raise EngineRejected(
                self._backend.label,
                name,
                f"{type(self._backend).__name__} does not support it",
                501,
            )
        return method

    async def update_weight_version(self, version: str) -> None:
        """Set the weight version without aborting any request."""
        # SGLang's own default is to abort every request, including retract-preserved ones.
        await self._backend.update_weight_version(version, abort_all_requests=False)

    async def weight_version(self) -> str | None:
        """The loaded weight version."""
        return await self._backend.weight_version()

    async def weight_fingerprint(self) -> dict[str, Any]:
        """The digest of every tensor the engine holds, as ``Fingerprint.to_wire`` gives it
        (``{"scheme", "tensors"}``); a 501 ``EngineRejected`` from a backend that cannot say."""
        result: dict[str, Any] = await self._optional("weight_fingerprint")()
        return result

    async def server_info(self) -> dict[str, Any]:
        """Liveness probe and server state."""
        return await self._backend.server_info()

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one generate request to completion (or abort)."""
        return await self._backend.generate(request)

    async def history(self) -> list[dict[str, Any]]:
        """Ops the backend received, if it records them (the simulated engine does)."""
        result: list[dict[str, Any]] = introspect(self._backend, "history", [])
        return result

    async def memory(self) -> dict[str, int]:
        """Resident bytes per tag, if the backend accounts memory (the simulated engine does)."""
        result: dict[str, int] = introspect(self._backend, "memory", {})
        return result

    async def state(self) -> dict[str, Any]:
        """What the engine keeps to itself (paused, released tags, ...), if the backend can
        say (the simulated engine can; a real server publishes none of it)."""
        result: dict[str, Any] = introspect(self._backend, "state", {})
        return result

    async def stats(self) -> dict[str, int]:
        """The backend's work counters and queue lengths (``running``, ``waiting``, ...), if it
        keeps them (the simulated engine does)."""
        result: dict[str, int] = introspect(self._backend, "stats", {})
        return result

    async def close(self) -> None:
        """Close the backend."""
        await self._backend.close()


def _wire_tags(tags: Any, what: str) -> list[Tag]:
    """``parse_tags`` of a command's tags as they come over the wire (every engine of a phase
    gets the same few names: parsed once per distinct list)."""
    if type(tags) is list and all(type(t) is str for t in tags):
        return list(_parsed_tags(tuple(tags), what))
    return list(parse_tags(tags, what=what))


@functools.lru_cache(maxsize=64)
def _parsed_tags(tags: tuple[str, ...], what: str) -> tuple[Tag, ...]:
    return parse_tags(tags, what=what)


class LocalSeam:
    """An ``EngineHost`` in this process: each call is an asyncio task on this loop."""

    def send(self, handle: EngineHost, op: str, args: tuple[Any, ...]) -> Awaitable[Any]:
        if op == RUN and args and args[0] in _OPS:
            # ``EngineHost.run``'s method called at once: one coroutine (and its arguments'
            # tuple) less per engine call, all of a phase's alive at once
            call = handle._method(args[0])(*args[1:])
        else:
            call = getattr(handle, op)(*args)
        if type(call) is CoroutineType:  # (a host method's: the loop's task, as ``ensure_future``
            # makes it, without its two calls and checks once per engine per phase)
            return asyncio.get_running_loop().create_task(call)
        task: Awaitable[Any] = asyncio.ensure_future(call)
        return task

    def identity(self, handle: EngineHost) -> Hashable:
        # The server URL of an HTTP backend (normalised: localhost and 127.0.0.1 are one).
        url = getattr(handle.backend, "url", None)
        if isinstance(url, str):
            try:
                return ("url", url_identity(url))
            except InvalidArgument:
                pass
        return ("object", id(handle.backend))

    async def retire(self, handle: EngineHost, deadline: float) -> None:
        await seam.abort_and_close(self, handle, deadline)


def _adopt(obj: object) -> EngineHost | None:
    """A bare engine backend is served by an ``EngineHost`` of its own."""
    return EngineHost(obj) if isinstance(obj, EngineBackend) else None


seam.register(EngineHost, LocalSeam())
seam.register_adopter(_adopt)
