"""Engine backends that start their own server as a child process, then drive it.

``LaunchedServer`` owns the process: start-up waits for the server's readiness probe, then runs
its client's attach check; output becomes events; close stops the whole process group; a call
that meets a dead process names its exit code. Each family's launcher extends it:
``sglang.launch.LaunchedSGLangEngine`` (``/ready``: 200 only once it is up, after warm-up) and
``vllm.launch.LaunchedVLLMEngine``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from rollout_lifecycle.backends.http.transport import scrub
from rollout_lifecycle.backends.http.wire import check_str_list
from rollout_lifecycle.backends.secret import Secret
from rollout_lifecycle.contract.capabilities import Capabilities, capabilities_of
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineError,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.values import check_seconds

__all__ = ["DELEGATED", "LaunchedServer", "check_launch", "delegate", "interpreter"]

#: Seconds between two readiness probes during start-up.
_POLL_INTERVAL = 0.25
#: Lines of server output kept for the message of a failed start.
_TAIL_LINES = 20
#: Longest server output line kept in that message.
_TAIL_LINE_CHARS = 500
#: Longest line the output reader accepts (SGLang prints its whole configuration on one line).
_READ_LIMIT = 1 << 20
#: Seconds to wait for the last output after the process exited.
_DRAIN_TIMEOUT = 2.0
#: Seconds to wait for a process to go after SIGKILL.
_KILL_TIMEOUT = 5.0
#: Seconds a failed call waits for the process to exit, to report its exit code.
_EXIT_GRACE = 0.5

_T = TypeVar("_T")


def check_launch(
    model_path: object, port: object, host: object, extra_args: object, key_flags: Sequence[str]
) -> tuple[list[str], str]:
    """A launcher's checked arguments: ``extra_args`` as a list (never one of ``key_flags``:
    a key there would show in the process list) and the server's base URL."""
    if not isinstance(model_path, str) or not model_path:
        raise InvalidArgument(f"model_path must be a non-empty string, got {model_path!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port must be an int between 1 and 65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise InvalidArgument(f"host must be a non-empty string, got {host!r}")
    extra = check_str_list("extra_args", extra_args)
    for arg in extra:
        if arg.split("=", 1)[0] in key_flags:
            # Not echoed: the next argument is probably the key.
            raise InvalidArgument(
                f"extra_args must not contain {arg.split('=', 1)[0]} (it would show the key "
                "in the process list); pass the key as a keyword argument instead"
            )
    url_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return extra, f"http://{url_host}:{port}"


def interpreter(python: object) -> str:
    """The interpreter a server starts with: ``python``, or this one when None."""
    if python is None:
        return sys.executable
    if not isinstance(python, str) or not python:
        raise InvalidArgument(f"python must be a non-empty string, got {python!r}")
    return python


#: The calls a launched engine passes to its server's HTTP client: the backend protocol's
#: operations (``close`` and ``label`` are its own) and ``model_info``.
DELEGATED = frozenset(
    {
        *(
            op.value
            for op in Op
            if op not in (Op.CLOSE, Op.LABEL, Op.HISTORY, Op.MEMORY, Op.STATE, Op.STATS)
        ),
        "model_info",
    }
)


class ServerClient(Protocol):
    """What a launcher needs of its server's HTTP client (and passes every call to)."""

    @property
    def label(self) -> str: ...

    @property
    def url(self) -> str: ...

    async def check_version(self, op: str = "check_version") -> str: ...

    async def close(self) -> None: ...


_C = TypeVar("_C", bound=ServerClient)


class LaunchedServer(Generic[_C]):
    """A server process this object starts, owns and stops, and the HTTP client that drives it.

    Subclasses build the command line and the client, and say how to probe the server:
    ``_port_taken`` (anything answering at the address before the start), ``_probe`` (ready to
    serve) and ``_server_env`` (what the child needs beyond this process's environment).
    ``keys`` names the variable each key reaches the child in (a key of None: the variable is
    removed, so one inherited from this process configures nothing); output is scrubbed of them.
    ``EVENT`` prefixes the events (``<EVENT>.start``, ``.ready``, ``.log``, ``.exit``).
    Every operation starts the server first if needed (``start()``). The child runs in its own
    process group so that ``close()`` stops the server's worker processes with it.
    """

    EVENT: ClassVar[str]

    def __init__(
        self,
        model_path: str,
        http: _C,
        command: list[str],
        env: Mapping[str, str] | None,
        *,
        keys: Mapping[str, Secret | None],
        startup_timeout: float,
        stop_grace: float,
    ) -> None:
        if env is not None and (
            not isinstance(env, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise InvalidArgument(f"env must be a mapping of strings to strings, got {env!r}")
        self._model_path = model_path
        self._http = http
        self._command = command
        self._keys = dict(keys)
        self._startup_timeout = check_seconds("startup_timeout", startup_timeout, positive=True)
        self._stop_grace = check_seconds("stop_grace", stop_grace, positive=True)
        self._env = dict(env or {})
        self._proc: asyncio.subprocess.Process | None = None
        self._readers: list[asyncio.Task[None]] = []
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._start_lock = asyncio.Lock()
        self._ready = False
        self._start_error: str | None = None
        self._closed = False

    # ----------------------------------------------------------------------------- properties

    @property
    def label(self) -> str:
        """The engine's name in errors and events (the server URL unless given)."""
        return self._http.label

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._http.url

    @property
    def capabilities(self) -> Capabilities:
        """What the server's client declares its engine family can do (``contract/
        capabilities``): a launched vLLM server is planned with as vLLM, not as SGLang."""
        return capabilities_of(self._http)

    @property
    def command(self) -> list[str]:
        """The command line the server is started with (it never holds a key)."""
        return list(self._command)

    @property
    def pid(self) -> int | None:
        """The server process id, once started."""
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The server's exit code once it has exited, else None."""
        return None if self._proc is None else self._proc.returncode

    @property
    def http(self) -> _C:
        """The HTTP client of the server."""
        return self._http

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._model_path!r}, url={self.url!r}, "
            f"label={self.label!r}, pid={self.pid!r})"
        )

    # ----------------------------------------------------------------------------- the kind

    def _server_env(self) -> dict[str, str]:
        """Variables the child needs beyond this process's environment and ``env``."""
        return {}

    async def _port_taken(self) -> bool:
        """Whether anything answers at the server's address already."""
        raise NotImplementedError

    async def _probe(self, timeout: float) -> bool:
        """One readiness probe: True once the server serves."""
        raise NotImplementedError

    def _shown_command(self) -> str:
        """The command line as events show it."""
        return " ".join(self._command)

    # ----------------------------------------------------------------------------- process

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, **self._env, **self._server_env()}
        env.setdefault("PYTHONUNBUFFERED", "1")
        for name, key in self._keys.items():
            # A variable inherited from this process must not configure a key nobody asked for.
            env.pop(name, None)
            if key is not None:
                env[name] = key.reveal()
        return env

    def _scrub(self, text: str) -> str:
        return scrub(text, self._keys.values())

    def _last_output(self) -> str:
        if not self._tail:
            return "no output"
        return "last output:\n" + "\n".join(self._tail)

    async def start(self) -> None:
        """Start the server, wait until its readiness probe passes, then run the client's
        attach check (``check_version``).

        Raises ``EngineDead`` if the process cannot start or exits first (with its exit code
        and last output), or if something already answers at the address; ``EngineTimeout`` if
        it is not ready within ``startup_timeout``; ``IllegalEngineOp`` naming what was found if
        the attach check refuses the server. The process is then killed. A start that failed is
        not tried again.
        """
        if self._closed:
            raise EngineDead(self.label, "start", "the engine is closed")
        if self._ready:
            return
        async with self._start_lock:
            if self._ready:
                return
            if self._start_error is not None:
                raise EngineDead(self.label, "start", f"start failed earlier: {self._start_error}")
            try:
                await self._spawn_and_wait()
            except EngineError as exc:
                self._start_error = f"{type(exc).__name__}: {exc.message}"
                raise
            except IllegalEngineOp as exc:
                self._start_error = f"{type(exc).__name__}: {exc.reason}"
                raise

    async def _spawn_and_wait(self) -> None:
        log = logger()
        if await self._port_taken():
            # Whatever answers there is not the server this engine is about to own.
            raise EngineDead(
                self.label, "start", f"something already answers at {self.url}; port is taken"
            )
        log.info(
            f"{self.EVENT}.start",
            engine=self.label,
            command=self._scrub(self._shown_command()),
            startup_timeout=self._startup_timeout,
        )
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._child_env(),
                start_new_session=True,
                limit=_READ_LIMIT,
            )
        except OSError as exc:
            detail = self._scrub(f"{type(exc).__name__}: {exc}")
            raise EngineDead(self.label, "start", f"could not start the server: {detail}") from None
        self._proc = proc
        assert proc.stdout is not None and proc.stderr is not None
        self._readers = [
            asyncio.ensure_future(self._forward(proc.stdout, "stdout")),
            asyncio.ensure_future(self._forward(proc.stderr, "stderr")),
        ]
        try:
            if self._closed:
                # close() ran while the process was being created, before it could see it.
                raise EngineDead(self.label, "start", "the engine was closed during start-up")
            await self._wait_ready(proc)
            # The attach check: refuse a server the client cannot drive before anything is sent.
            await self._http.check_version("start")
        except BaseException:
            await self._stop()
            raise
        self._ready = True
        log.info(
            f"{self.EVENT}.ready",
            engine=self.label,
            pid=proc.pid,
            duration_s=round(time.monotonic() - started, 3),
        )

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._startup_timeout
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                if proc.returncode is not None:
                    await asyncio.wait(self._readers, timeout=_DRAIN_TIMEOUT)
                    raise EngineDead(
                        self.label,
                        "start",
                        f"server process exited with code {proc.returncode} before it was "
                        f"ready; {self._last_output()}",
                    )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise EngineTimeout(
                        self.label,
                        "start",
                        f"server not ready within {self._startup_timeout:g}s; "
                        f"{self._last_output()}",
                    )
                probe = asyncio.ensure_future(self._probe(remaining))
                await asyncio.wait({probe, exited}, return_when=asyncio.FIRST_COMPLETED)
                if not probe.done():
                    probe.cancel()
                    await asyncio.wait({probe})
                    continue
                if probe.result() and proc.returncode is None:
                    return
                pause = min(_POLL_INTERVAL, deadline - loop.time())
                if pause > 0:
                    await asyncio.wait({exited}, timeout=pause)
        finally:
            if not exited.done():
                exited.cancel()

    async def _forward(self, stream: asyncio.StreamReader, name: str) -> None:
        """Turn each line the server prints into an ``<EVENT>.log`` event, keys masked."""
        log = logger()
        while True:
            try:
                raw = await stream.readline()
            except ValueError:
                # Longer than the reader's limit: asyncio has dropped it; keep reading.
                raw = b"[a line longer than the output limit was dropped]\n"
            if not raw:
                return
            line = self._scrub(raw.decode("utf-8", errors="replace").rstrip())
            self._tail.append(
                line if len(line) <= _TAIL_LINE_CHARS else f"{line[:_TAIL_LINE_CHARS]}..."
            )
            log.info(f"{self.EVENT}.log", engine=self.label, stream=name, line=line)

    def _signal_group(self, proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
        try:
            if hasattr(os, "killpg"):
                # The child leads its own session, so its group id is its pid.
                os.killpg(proc.pid, sig)
            else:  # pragma: no cover - not POSIX
                proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def _stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after ``stop_grace``; reap; end the readers."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self._stop_grace)
            except asyncio.TimeoutError:
                self._signal_group(proc, signal.SIGKILL)
                try:
                    await asyncio.wait_for(proc.wait(), _KILL_TIMEOUT)
                except asyncio.TimeoutError:
                    logger().warning(f"{self.EVENT}.unkillable", engine=self.label, pid=proc.pid)
        # Workers that outlived their parent still hold GPU memory: end the rest of the group.
        self._signal_group(proc, signal.SIGKILL)
        readers, self._readers = self._readers, []
        if readers:
            _, pending = await asyncio.wait(readers, timeout=_DRAIN_TIMEOUT)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        logger().info(
            f"{self.EVENT}.exit", engine=self.label, pid=proc.pid, returncode=proc.returncode
        )

    async def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``stop_grace``) and close the client.

        Idempotent; later operations raise ``EngineDead``.
        """
        if self._closed:
            return
        # Not under the start lock: closing must not wait out a start-up, it ends it (the
        # start sees the process exit, or sees the flag if the process was not there yet).
        self._closed = True
        await self._stop()
        await self._http.close()

    # ----------------------------------------------------------------------------- delegation

    async def _call(self, op: str, call: Callable[[Any], Awaitable[_T]]) -> _T:
        await self.start()
        try:
            return await call(self._http)
        except (EngineDead, EngineUnreachable) as exc:
            proc = self._proc
            if proc is None:
                raise
            try:
                await asyncio.wait_for(proc.wait(), _EXIT_GRACE)
            except asyncio.TimeoutError:
                raise exc from None
            message = f"{exc.message}; the server process exited with code {proc.returncode}"
        raise EngineDead(self.label, op, message)


def _delegated(owner: str, client: str, name: str) -> Callable[..., Awaitable[Any]]:
    """A launcher's method for the call ``name``: started on first use, passed to the server's
    HTTP client with the same arguments; a connection lost because the process exited is
    ``EngineDead`` naming its exit code."""

    async def call(self: LaunchedServer[Any], *args: Any, **kwargs: Any) -> Any:
        return await self._call(name, lambda h: getattr(h, name)(*args, **kwargs))

    call.__name__ = name
    call.__qualname__ = f"{owner}.{name}"
    call.__doc__ = f"``{client}.{name}`` on the launched server."
    return call


def delegate(launcher: type[LaunchedServer[Any]], client: type[Any]) -> None:
    """Give ``launcher`` one method per call of the backend protocol that ``client`` has,
    declared from ``DELEGATED`` rather than by hand."""
    for name in sorted(DELEGATED):
        if hasattr(client, name):
            setattr(launcher, name, _delegated(launcher.__name__, client.__name__, name))
