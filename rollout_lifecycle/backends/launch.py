"""An ``EngineBackend`` that starts its own SGLang server as a child process, then drives it.

Start-up waits for ``/ready`` (200 only once SGLang is up, after warm-up), then checks the SGLang
version; output becomes events, close stops the whole process group.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from rollout_lifecycle.backends.http import (
    HTTPTimeouts,
    SGLangHTTPEngine,
    _secret_kwargs,
    check_seconds,
    scrub,
    sglang_http_factory,
)
from rollout_lifecycle.backends.secret import Secret, as_secret
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

__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "LaunchedSGLangEngine",
    "launched_sglang_factory",
    "sglang_http_factory",
]

#: The environment variable that carries the admin key to the server process.
ADMIN_KEY_ENV = "ROLLOUT_LIFECYCLE_ADMIN_API_KEY"
#: The environment variable that carries the api key to the server process.
API_KEY_ENV = "ROLLOUT_LIFECYCLE_API_KEY"

# Runs sglang.launch_server as ``python -m`` would, after moving the keys from the environment
# into its argument list in-process: the kernel's copy of the command line (``ps``,
# /proc/PID/cmdline, readable by every user) never holds them, and SGLang's own worker
# processes do not inherit them.
_KEYED_LAUNCH = f"""\
import os, runpy, sys
for _env, _flag in (({ADMIN_KEY_ENV!r}, "--admin-api-key"), ({API_KEY_ENV!r}, "--api-key")):
    _key = os.environ.pop(_env, "")
    if _key:
        sys.argv += [_flag, _key]
del _env, _flag, _key
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""

#: Arguments that would put a key on the command line; keys go in admin_key / api_key.
_KEY_FLAGS = ("--api-key", "--admin-api-key")
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


def _str_list(name: str, value: object, *, allow_empty: bool) -> list[str]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{name} must be a sequence of strings, got {value!r}")
    items = list(value)
    if not all(isinstance(item, str) for item in items):
        raise InvalidArgument(f"{name} must hold strings only")
    if not items and not allow_empty:
        raise InvalidArgument(f"{name} must not be empty")
    return items


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


class LaunchedSGLangEngine:
    """An SGLang server this object starts, owns and stops; implements ``EngineBackend``.

    The default command is ``PYTHON -m sglang.launch_server --model-path M --host H --port P
    --enable-memory-saver *extra_args`` with ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` (without it
    releasing ``cuda_graph`` frees nothing). ``python`` is the interpreter that has sglang
    installed (this one by default; SGLang often lives in a virtual environment of its own).
    ``memory_saver=False`` leaves ``--enable-memory-saver`` out: the memory saver needs CUDA
    (its preloaded library loads libcuda, and the server exits without it), so a server on a
    machine without a GPU must run without it; release and resume then free nothing.
    ``command`` replaces the whole command line.

    Keys reach the server through its environment, never its command line, which every user of
    the machine can read (the environment only the same user and root): ``ADMIN_KEY_ENV`` and
    ``API_KEY_ENV`` are set for the child. With the default command a small bootstrap
    (``python -c``) hands them to SGLang's argument parser in-process and removes them from the
    environment before SGLang starts its workers. A custom ``command`` reads them itself (the
    stand-in server: ``--admin-key-env ROLLOUT_LIFECYCLE_ADMIN_API_KEY``). Output lines are
    scrubbed of the keys before they become events (SGLang prints its arguments at start-up).

    Every operation starts the server first if needed (``start()``). The child runs in its own
    process group so that ``close()`` stops SGLang's worker processes with it.

    ``weight_selector`` is the client's (see ``SGLangHTTPEngine``): the one selector of every
    weight-update session and its updates.
    """

    def __init__(
        self,
        model_path: str,
        *,
        port: int,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        python: str | None = None,
        memory_saver: bool = True,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        admin_key: str | Secret | None = None,
        api_key: str | Secret | None = None,
        startup_timeout: float = 600.0,
        timeouts: HTTPTimeouts | None = None,
        label: str | None = None,
        stop_grace: float = 10.0,
        weight_selector: str = "all",
    ) -> None:
        if not isinstance(model_path, str) or not model_path:
            raise InvalidArgument(f"model_path must be a non-empty string, got {model_path!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port must be an int between 1 and 65535, got {port!r}")
        if not isinstance(host, str) or not host:
            raise InvalidArgument(f"host must be a non-empty string, got {host!r}")
        extra = _str_list("extra_args", extra_args, allow_empty=True)
        for arg in extra:
            if arg.split("=", 1)[0] in _KEY_FLAGS:
                # Not echoed: the next argument is probably the key.
                raise InvalidArgument(
                    f"extra_args must not contain {arg.split('=', 1)[0]} (it would show the key "
                    "in the process list); pass admin_key= or api_key= instead"
                )
        if env is not None and (
            not isinstance(env, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise InvalidArgument(f"env must be a mapping of strings to strings, got {env!r}")
        self._admin_key = as_secret(admin_key, what="admin_key")
        self._api_key = as_secret(api_key, what="api_key")
        self._model_path = model_path
        self._startup_timeout = check_seconds("startup_timeout", startup_timeout, positive=True)
        self._stop_grace = check_seconds("stop_grace", stop_grace, positive=True)
        url_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self._http = SGLangHTTPEngine(
            f"http://{url_host}:{port}",
            admin_key=self._admin_key,
            api_key=self._api_key,
            timeouts=timeouts,
            label=label,
            weight_selector=weight_selector,
        )
        if python is None:
            python = sys.executable
        elif not isinstance(python, str) or not python:
            raise InvalidArgument(f"python must be a non-empty string, got {python!r}")
        if not isinstance(memory_saver, bool):
            raise InvalidArgument(f"memory_saver must be True or False, got {memory_saver!r}")
        if command is None:
            args = ["--model-path", model_path, "--host", host, "--port", str(port)]
            if memory_saver:
                args.append("--enable-memory-saver")
            args += extra
            if self._admin_key is None and self._api_key is None:
                self._command = [python, "-m", "sglang.launch_server", *args]
            else:
                self._command = [python, "-c", _KEYED_LAUNCH, *args]
        else:
            if python != sys.executable or not memory_saver:
                raise InvalidArgument("python and memory_saver do not apply to a custom command")
            self._command = _str_list("command", command, allow_empty=False)
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
    def http(self) -> SGLangHTTPEngine:
        """The HTTP client of the server."""
        return self._http

    def __repr__(self) -> str:
        return (
            f"LaunchedSGLangEngine({self._model_path!r}, url={self.url!r}, "
            f"label={self.label!r}, pid={self.pid!r})"
        )

    # ----------------------------------------------------------------------------- process

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, **self._env}
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
        env.setdefault("PYTHONUNBUFFERED", "1")
        for name, key in ((ADMIN_KEY_ENV, self._admin_key), (API_KEY_ENV, self._api_key)):
            # A variable inherited from this process must not configure a key nobody asked for.
            env.pop(name, None)
            if key is not None:
                env[name] = key.reveal()
        return env

    def _scrub(self, text: str) -> str:
        return scrub(text, (self._admin_key, self._api_key))

    def _last_output(self) -> str:
        if not self._tail:
            return "no output"
        return "last output:\n" + "\n".join(self._tail)

    async def start(self) -> None:
        """Start the server, wait until ``GET /ready`` answers 200, then check its version.

        ``/ready`` is SGLang's readiness probe: 503 until the server is up (after warm-up);
        ``/model_info`` answers before warm-up. Raises ``EngineDead`` if the process cannot
        start or exits first (with its exit code and last output), ``EngineTimeout`` if it is
        not ready within ``startup_timeout``, ``IllegalEngineOp`` naming the version if the
        server runs an SGLang older than 0.5.22 (or reports none); the process is then killed.
        A start that failed is not tried again.
        """
        # sglang: http_server.py ready() -> tokenizer_manager.py TokenizerManager.is_ready
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
        # Any answer at all (a paused SGLang answers /ready with 503) means the port is taken.
        if await self._http.link.ready_status() is not None:
            # Whatever answers there is not the server this engine is about to own.
            raise EngineDead(
                self.label, "start", f"something already answers at {self.url}; port is taken"
            )
        shown = ["<keyed launch>" if arg == _KEYED_LAUNCH else arg for arg in self._command]
        log.info(
            "sglang.start",
            engine=self.label,
            command=self._scrub(" ".join(shown)),
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
            # The attach check: refuse an SGLang older than 0.5.22 before anything is sent.
            await self._http.check_version("start")
        except BaseException:
            await self._stop()
            raise
        self._ready = True
        log.info(
            "sglang.ready",
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
                probe = asyncio.ensure_future(self._http.ready(timeout=remaining))
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
        """Turn each line the server prints into an ``sglang.log`` event, keys masked."""
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
            log.info("sglang.log", engine=self.label, stream=name, line=line)

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
                    logger().warning("sglang.unkillable", engine=self.label, pid=proc.pid)
        # Workers that outlived their parent still hold GPU memory: end the rest of the group.
        self._signal_group(proc, signal.SIGKILL)
        readers, self._readers = self._readers, []
        if readers:
            _, pending = await asyncio.wait(readers, timeout=_DRAIN_TIMEOUT)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        logger().info("sglang.exit", engine=self.label, pid=proc.pid, returncode=proc.returncode)

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

    async def _call(self, op: str, call: Callable[[SGLangHTTPEngine], Awaitable[_T]]) -> _T:
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


def _delegated(name: str) -> Callable[..., Awaitable[Any]]:
    """``LaunchedSGLangEngine``'s method for the call ``name``: started on first use, passed to
    the server's ``SGLangHTTPEngine`` with the same arguments; a connection lost because the
    process exited is ``EngineDead`` naming its exit code."""

    async def call(self: LaunchedSGLangEngine, *args: Any, **kwargs: Any) -> Any:
        return await self._call(name, lambda h: getattr(h, name)(*args, **kwargs))

    call.__name__ = name
    call.__qualname__ = f"LaunchedSGLangEngine.{name}"
    call.__doc__ = f"``SGLangHTTPEngine.{name}`` on the launched server."
    return call


# One method per call of the backend protocol, declared from DELEGATED rather than by hand.
for _name in sorted(DELEGATED):
    setattr(LaunchedSGLangEngine, _name, _delegated(_name))


def launched_sglang_factory(model_path: str, **kwargs: Any) -> Callable[[], LaunchedSGLangEngine]:
    """A picklable zero-argument factory of ``LaunchedSGLangEngine(model_path, **kwargs)``.

    The arguments are checked now (constructing an engine starts nothing); keys are wrapped in
    ``Secret`` so that the factory's repr never shows them.
    """
    kwargs = _secret_kwargs(kwargs, ("admin_key", "api_key"))
    LaunchedSGLangEngine(model_path, **kwargs)
    return functools.partial(LaunchedSGLangEngine, model_path, **kwargs)
