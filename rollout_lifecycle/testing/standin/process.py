"""Running a stand-in server: ``serve`` runs one in this process (the ``fake-sglang`` command;
``serving`` does the serving), and ``StandInServer`` starts one in a subprocess on loopback and
drives it from a test: start, stop, restart at the same port, fault rules, the engine's history
and state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.contract.exceptions import InvalidArgument, LifecycleError
from rollout_lifecycle.contract.identity import PROOF_WINDOW
from rollout_lifecycle.contract.values import check_flag, check_seconds
from rollout_lifecycle.testing.simulated import SimulatedEngine, check_engine_options
from rollout_lifecycle.testing.standin.app import DEFAULT_MODEL_PATH, create_app
from rollout_lifecycle.testing.standin.faults import FAULTS_PATH
from rollout_lifecycle.testing.standin.serving import (
    DEATH_EXIT_CODE,
    READY_PREFIX,
    check_serving,
    run_app,
)
from rollout_lifecycle.testing.standin.state import check_path

if TYPE_CHECKING:
    from fastapi import FastAPI

#: How long ``StandInServer.start`` waits for the child to accept connections by default: a
#: child imports FastAPI, uvicorn and this package, which on a loaded 2-core CI machine has
#: been seen to take more than 30 s.
DEFAULT_STARTUP_TIMEOUT = 120.0
#: How long a child that has exited is given for its last stdout line to be read.
_EXIT_READ_GRACE_S = 5.0
#: Environment variables through which ``StandInServer`` hands keys to its subprocess.
ADMIN_KEY_ENV = "ROLLOUT_LIFECYCLE_STANDIN_ADMIN_KEY"
API_KEY_ENV = "ROLLOUT_LIFECYCLE_STANDIN_API_KEY"


class StandInFailed(LifecycleError, RuntimeError):
    """A stand-in server process could not be started (or exited before it was ready)."""


def serve(
    *,
    host: str = "127.0.0.1",
    port: int,
    api_key: str | Secret | None = None,
    admin_key: str | Secret | None = None,
    engine_options: Mapping[str, Any] | None = None,
    history_file: str | None = None,
    model_path: str = DEFAULT_MODEL_PATH,
    print_ready: bool = True,
    allow_remote: bool = False,
    kind: str = "sglang",
    weight_transfer: bool = False,
) -> int:
    """Run a stand-in server in this process until it is stopped or its engine dies.

    ``port=0`` lets the OS pick one. Once connections are accepted it prints
    ``FAKE_SGLANG_READY port=<N>`` on stdout. When the engine dies the process exits at once
    with status ``DEATH_EXIT_CODE``: in-flight connections drop and the port closes, as with
    SGLang. Only loopback hosts are allowed unless ``allow_remote``. ``kind="vllm"`` serves
    vLLM's routes instead (``vllm_app``; ``weight_transfer`` for ``--weight-transfer-config``),
    with no admin key.
    """
    check_serving(
        host=host,
        port=port,
        engine_options=engine_options,
        print_ready=print_ready,
        allow_remote=allow_remote,
    )
    if kind not in ("sglang", "vllm"):
        raise InvalidArgument(f"kind must be 'sglang' or 'vllm', got {kind!r}")
    check_flag("weight_transfer", weight_transfer)

    def make_app(engine: SimulatedEngine, on_death: Callable[[], None]) -> FastAPI:
        if kind == "vllm":
            from rollout_lifecycle.testing.standin.vllm_app import create_vllm_app

            if admin_key is not None:
                raise InvalidArgument("vLLM has no admin key; pass api_key only")
            return create_vllm_app(
                engine,
                api_key=api_key,
                on_death=on_death,
                history_file=history_file,
                model_path=model_path,
                weight_transfer=weight_transfer,
            )
        return create_app(
            engine,
            api_key=api_key,
            admin_key=admin_key,
            on_death=on_death,
            history_file=history_file,
            model_path=model_path,
        )

    return run_app(
        make_app,
        name=f"fake-{kind}",
        host=host,
        port=port,
        engine_options=engine_options,
        model_path=model_path,
        print_ready=print_ready,
    )


def _latency_arg(op: str, value: object) -> str:
    if isinstance(value, tuple):
        return f"{op}={float(value[0])!r},{float(value[1])!r}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{op}={float(value)!r}"
    raise InvalidArgument(f"op_latency[{op!r}] must be seconds or a (low, high) pair")


def _engine_argv(options: Mapping[str, Any]) -> list[str]:
    """The ``fake-sglang`` flags that rebuild ``SimulatedEngine(**options)`` in the child."""
    argv: list[str] = []
    scalar_flags = {
        "label": "--label",
        "token_latency": "--token-latency",
        "seed": "--seed",
        "health_timeout": "--health-timeout",
        "weight_version": "--weight-version",
        "max_running": "--max-running",
        "dp_size": "--dp-size",
        "disaggregation_mode": "--disaggregation-mode",
        "disaggregation_bootstrap_port": "--disaggregation-bootstrap-port",
        "gpu_memory_bytes": "--gpu-memory-bytes",
    }
    for name, value in options.items():
        if value is None:
            continue
        if name in scalar_flags:
            text = repr(float(value)) if isinstance(value, float) else str(value)
            argv += [scalar_flags[name], text]
        elif name == "op_latency":
            pairs = [_latency_arg(op, v) for op, v in dict(value).items()]
            if pairs:
                argv += ["--op-latency", *pairs]
        elif name == "memory_bytes":
            pairs = [f"{getattr(t, 'value', t)}={int(n)}" for t, n in dict(value).items()]
            if pairs:
                argv += ["--memory-bytes", *pairs]
        elif name in ("weights_cpu_backup", "dp_dummy_batches", "check_model_paths"):
            if value:
                argv.append("--" + name.replace("_", "-"))
        else:
            raise InvalidArgument(f"unknown engine option {name!r} for a stand-in server")
    return argv


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


class StandInServer:
    """A stand-in SGLang server in a subprocess (``rollout-lifecycle fake-sglang``) on loopback.

    Keys reach the child through environment variables, never its command line. Start several
    at once with ``start_many`` / ``start_all`` (each child spends a second or two importing).
    """

    def __init__(
        self,
        *,
        admin_key: str | Secret | None = None,
        api_key: str | Secret | None = None,
        history_file: str | os.PathLike[str] | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        model_path: str | None = None,
        port: int = 0,
        **engine_options: Any,
    ) -> None:
        self._startup_timeout = check_seconds("startup_timeout", startup_timeout)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be an int in 0..65535 (0: any free), got {port!r}")
        #: The port asked for: 0 takes a free one; a port a stopped stand-in used restarts a
        #: server at the same URL.
        self._port_asked = port
        self._admin_key = as_secret(admin_key, what="admin_key")
        self._api_key = as_secret(api_key, what="api_key")
        self._history_file = check_path("history_file", history_file)
        if model_path is not None and (not isinstance(model_path, str) or not model_path):
            raise InvalidArgument(
                f"model_path must be a non-empty string or None, got {model_path!r}"
            )
        self._model_path = model_path
        engine_options.setdefault("label", "fake-sglang")
        # Invalid options fail here, not in the child.
        SimulatedEngine(**check_engine_options(engine_options))
        self._engine_argv = _engine_argv(engine_options)
        self.label: str = engine_options["label"]
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._ready = threading.Event()
        self._port: int | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def __repr__(self) -> str:
        where = self.url if self._port is not None else "not started"
        return f"StandInServer(label={self.label!r}, {where}, alive={self.alive()})"

    # ------------------------------------------------------------------ starting

    def _argv(self) -> list[str]:
        argv = [sys.executable, "-m", "rollout_lifecycle.cli", "fake-sglang"]
        argv += ["--port", str(self._port_asked)]
        argv += self._engine_argv
        if self._admin_key is not None:
            argv += ["--admin-key-env", ADMIN_KEY_ENV]
        return argv + self._shared_argv()

    def _shared_argv(self) -> list[str]:
        """The arguments every stand-in's command line takes: its key variable, history file
        and model path."""
        argv = []
        if self._api_key is not None:
            argv += ["--api-key-env", API_KEY_ENV]
        if self._history_file is not None:
            argv += ["--history-file", self._history_file]
        if self._model_path is not None:
            argv += ["--model-path", self._model_path]
        return argv

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (ADMIN_KEY_ENV, API_KEY_ENV)}
        if self._admin_key is not None:
            env[ADMIN_KEY_ENV] = self._admin_key.reveal()
        if self._api_key is not None:
            env[API_KEY_ENV] = self._api_key.reveal()
        # The child must import this very package, installed or not: the folder holding it
        # (this file is rollout_lifecycle/testing/standin/process.py).
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self) -> None:
        if self._proc is not None:
            raise StandInFailed(f"stand-in {self.label} was already started")
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(
            self._argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env(),
        )
        self._proc = proc
        self._finalizer = weakref.finalize(self, _kill, proc)
        threading.Thread(
            target=self._read_stdout, args=(proc,), name=f"standin-{self.label}", daemon=True
        ).start()

    def _read_stdout(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:  # drained to EOF so the child never blocks on a full pipe
            line = raw.decode("utf-8", "replace").strip()
            if not self._ready.is_set() and line.startswith(READY_PREFIX + " port="):
                with contextlib.suppress(ValueError):
                    self._port = int(line.rpartition("=")[2])
                    self._ready.set()
        proc.stdout.close()

    def _await_ready(self, deadline: float) -> None:
        proc = self._proc
        if proc is None:
            raise StandInFailed(f"stand-in {self.label} was never started")
        while not self._ready.wait(0.02):
            if proc.poll() is not None:
                # The reader may still be on the last line; give it a moment.
                if self._ready.wait(_EXIT_READ_GRACE_S):
                    break
                raise StandInFailed(
                    f"stand-in {self.label} exited with status {proc.returncode} before it was "
                    f"ready; stderr: {self.stderr_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                self.stop(2.0)
                raise StandInFailed(
                    f"stand-in {self.label} not ready within {self._startup_timeout:g}s; "
                    f"stderr: {self.stderr_text()[-2000:]}"
                )

    def start(self) -> StandInServer:
        """Spawn the server and wait (at most ``startup_timeout``) until it accepts requests."""
        self._spawn()
        self._await_ready(time.monotonic() + self._startup_timeout)
        return self

    @classmethod
    def start_all(cls, servers: Iterable[StandInServer]) -> list[StandInServer]:
        """Spawn every server first, then wait for all; on any failure stop them all."""
        started = list(servers)
        try:
            for server in started:
                server._spawn()
            now = time.monotonic()
            for server in started:
                server._await_ready(now + server._startup_timeout)
        except BaseException:
            for server in started:
                server.stop(2.0)
            raise
        return started

    @classmethod
    def start_many(cls, n: int, **options: Any) -> list[StandInServer]:
        """Start ``n`` alike servers at once; with a ``label``, server ``i`` is ``label-i``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be a positive int, got {n!r}")
        label = options.pop("label", "fake-sglang")
        return cls.start_all(cls(label=f"{label}-{i}", **options) for i in range(n))

    @classmethod
    @contextlib.contextmanager
    def running(cls, n: int, **options: Any) -> Iterator[list[StandInServer]]:
        """``start_many`` as a context manager: the servers are stopped when it exits (a
        module fixture is ``with StandInServer.running(3) as servers: yield servers``)."""
        servers = cls.start_many(n, **options)
        try:
            yield servers
        finally:
            for server in servers:
                server.stop()

    @classmethod
    async def start_many_async(cls, n: int, **options: Any) -> list[StandInServer]:
        """``start_many`` without blocking the event loop."""
        return await asyncio.to_thread(cls.start_many, n, **options)

    # ------------------------------------------------------------------ inspecting

    @property
    def port(self) -> int:
        """The port the server listens on (known once it is ready)."""
        if self._port is None:
            raise StandInFailed(f"stand-in {self.label} is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server process's id."""
        if self._proc is None:
            raise StandInFailed(f"stand-in {self.label} is not started")
        return self._proc.pid

    @property
    def history_file(self) -> str | None:
        """Where the server appends its ops as JSON lines, if anywhere."""
        return self._history_file

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended (``DEATH_EXIT_CODE`` after a death)."""
        return None if self._proc is None else self._proc.poll()

    def alive(self) -> bool:
        """True while the server process runs."""
        return self._proc is not None and self._proc.poll() is None

    def stderr_text(self) -> str:
        """What the server wrote on stderr so far (why it died, for instance)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    # ------------------------------------------------------------------ stand-in routes

    def _standin_call(self, method: str, path: str, body: object = None) -> Any:
        """One request to a ``/_standin/`` route, with the key its auth level wants."""
        import httpx

        # /_standin/* routes are at SGLang's normal level: the api key, when there is one.
        key = self._api_key
        headers = {"Authorization": f"Bearer {key.reveal()}"} if key is not None else {}
        try:
            with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as client:
                if body is None:
                    answer = client.request(method, path, headers=headers)
                else:
                    answer = client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise StandInFailed(
                f"stand-in {self.label}: {method} {path} failed ({type(exc).__name__}: {exc})"
            ) from None
        if answer.status_code == 400:
            try:
                message = answer.json()["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.text
            raise InvalidArgument(f"stand-in {self.label} refused {method} {path}: {message}")
        if not answer.is_success:
            raise StandInFailed(
                f"stand-in {self.label}: {method} {path} answered {answer.status_code}: "
                f"{answer.text[:500]}"
            )
        return answer.json()

    def inject(self, *rules: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Add fault rules (``POST /_standin/faults``); returns the rules now in force.

        A rule is ``{"path": "/pause_generation", "kind": K, "count": N, ...}``: ``kind`` one of
        ``FAULT_KINDS``, ``count`` the requests it hits (default 1, -1 forever), ``seconds`` for
        a delay, ``status`` (400..599, default 502) for a status. A bad rule raises
        ``InvalidArgument`` and none is added.
        """
        for rule in rules:
            if not isinstance(rule, Mapping):
                raise InvalidArgument(f"a fault rule must be a mapping, got {rule!r}")
        answer = self._standin_call("POST", FAULTS_PATH, [dict(rule) for rule in rules])
        result: list[dict[str, Any]] = answer["faults"]
        return result

    def clear_faults(self) -> None:
        """Remove every fault rule (``DELETE /_standin/faults``)."""
        self._standin_call("DELETE", FAULTS_PATH)

    def faults(self) -> list[dict[str, Any]]:
        """The fault rules in force, with the requests each will still hit and has hit."""
        result: list[dict[str, Any]] = self._standin_call("GET", FAULTS_PATH)["faults"]
        return result

    def lose_rank(self, rank: int) -> None:
        """The process of data-parallel rank ``rank`` dies, the rest of the server living on
        (``POST /_standin/lose_rank``; ``SimulatedEngine.lose_rank`` says what it answers then).
        Until a restart."""
        self._standin_call("POST", "/_standin/lose_rank", {"rank": rank})

    def slow_rank(self, rank: int, seconds: float) -> None:
        """Data-parallel rank ``rank`` answers every call that waits for every rank ``seconds``
        late (``POST /_standin/slow_rank``; ``SimulatedEngine.slow_rank``); 0 ends it."""
        self._standin_call("POST", "/_standin/slow_rank", {"rank": rank, "seconds": seconds})

    def state(self) -> dict[str, Any]:
        """What SGLang does not publish: paused, pause mode, released tags, weights valid,
        a deferred flush, an open weight-update session (``GET /_standin/state``)."""
        result: dict[str, Any] = self._standin_call("GET", "/_standin/state")
        return result

    def stats(self) -> dict[str, int]:
        """The engine's counters and queues: ``running``, ``waiting``, ``held``,
        ``retractions`` and the rest (``GET /_standin/stats``)."""
        result: dict[str, int] = self._standin_call("GET", "/_standin/stats")
        return result

    def history(self) -> list[dict[str, Any]]:
        """The engine's ops and the injected faults so far (``GET /_standin/history``)."""
        result: list[dict[str, Any]] = self._standin_call("GET", "/_standin/history")
        return result

    # ------------------------------------------------------------------ ending

    def wait_dead(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to end; True if it has."""
        timeout = check_seconds("timeout", timeout, positive=False)
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float = 5.0) -> int | None:
        """Terminate the server (kill it if it lingers past ``timeout``); its exit status."""
        timeout = check_seconds("timeout", timeout, positive=False)
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
        return proc.returncode

    def restart(self, timeout: float = 5.0) -> StandInServer:
        """Stop the server and start a new one at the same URL, as an orchestrator restarts a
        server in place: what answers there then is a fresh server with a new incarnation (every
        tag resident, not paused, the initial weights), and whatever was in flight is lost. The
        new one answers ``PROOF_WINDOW`` seconds after the old one stopped at the soonest."""
        port = self.port
        self.stop(timeout)
        # A real server takes seconds to start once the old one let its port go; a new
        # stand-in answers no sooner than PROOF_WINDOW after the old one's last answer, so that
        # a controller may take an answer as proof of the process for that long.
        time.sleep(PROOF_WINDOW)
        if self._stderr is not None:
            self._stderr.close()
        self._port_asked, self._port = port, None
        self._proc, self._ready = None, threading.Event()
        return self.start()

    def __enter__(self) -> StandInServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class VLLMStandInServer(StandInServer):
    """A stand-in vLLM 0.32.0 server in a subprocess (``vllm_app``) on loopback: vLLM's routes
    over the simulated engine. ``api_key`` guards the ``/v1`` routes only, as vLLM's does;
    ``weight_transfer`` stands for ``--weight-transfer-config``. Everything else is
    ``StandInServer``'s (start, stop, restart, faults, history, ``state()``)."""

    def __init__(
        self,
        *,
        api_key: str | Secret | None = None,
        weight_transfer: bool = False,
        history_file: str | os.PathLike[str] | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        model_path: str | None = None,
        port: int = 0,
        **engine_options: Any,
    ) -> None:
        engine_options.setdefault("label", "fake-vllm")
        super().__init__(
            api_key=api_key,
            history_file=history_file,
            startup_timeout=startup_timeout,
            model_path=model_path,
            port=port,
            **engine_options,
        )
        self._weight_transfer = check_flag("weight_transfer", weight_transfer)
        options = dict(engine_options)
        if "memory_bytes" in options:
            memory = dict(options["memory_bytes"])
            options["memory_bytes"] = {getattr(t, "value", t): n for t, n in memory.items()}
        self._engine_json = json.dumps(options)

    def _argv(self) -> list[str]:
        argv = [sys.executable, "-m", "rollout_lifecycle.testing.standin.vllm_app"]
        argv += ["--port", str(self._port_asked), "--engine-options", self._engine_json]
        argv += self._shared_argv()
        if self._weight_transfer:
            argv.append("--weight-transfer")
        return argv

    def __repr__(self) -> str:
        where = self.url if self._port is not None else "not started"
        return f"VLLMStandInServer(label={self.label!r}, {where}, alive={self.alive()})"

    def memory(self) -> dict[str, Any]:
        """Device bytes per tag and host bytes of offloaded weights (``/_standin/memory``)."""
        result: dict[str, Any] = self._standin_call("GET", "/_standin/memory")
        return result


__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "DEATH_EXIT_CODE",
    "DEFAULT_STARTUP_TIMEOUT",
    "READY_PREFIX",
    "StandInFailed",
    "StandInServer",
    "VLLMStandInServer",
    "serve",
]
