"""Serving a stand-in's app in this process: uvicorn on uvloop over a socket bound here, a ready
line on stdout once it accepts connections, and the process's end when its engine dies.

Both stand-ins run through it: ``process.serve`` (the ``fake-sglang`` command, either app) and
the vLLM stand-in's command line (``vllm_app.main``), each handing in how to build its app.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.values import check_flag
from rollout_lifecycle.testing.simulated import SimulatedEngine, check_engine_options
from rollout_lifecycle.testing.standin.faults import QuietDrops
from rollout_lifecycle.testing.standin.state import NEEDS

if TYPE_CHECKING:
    from fastapi import FastAPI

#: The one line ``run_app`` prints on stdout once the server accepts connections.
READY_PREFIX = "FAKE_SGLANG_READY"
#: Exit status of a stand-in whose engine died (SGLang's process dies with its scheduler).
DEATH_EXIT_CODE = 70

#: How a stand-in builds its app: from the engine and what to call when the engine dies.
AppFactory = Callable[[SimulatedEngine, Callable[[], None]], "FastAPI"]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_serving(
    *,
    host: str,
    port: int,
    engine_options: Mapping[str, Any] | None,
    print_ready: bool,
    allow_remote: bool,
) -> None:
    """Refuse what no stand-in can be served with: a missing web stack (``ImportError``), a
    bad host, port, flag or options (``InvalidArgument``), a host other than loopback unless
    ``allow_remote``."""
    try:
        import uvicorn  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(NEEDS) from exc
    if not isinstance(host, str) or not host:
        raise InvalidArgument(f"host must be a non-empty string, got {host!r}")
    check_flag("print_ready", print_ready)
    check_flag("allow_remote", allow_remote)
    if engine_options is not None and not isinstance(engine_options, Mapping):
        raise InvalidArgument(f"engine_options must be a mapping or None, got {engine_options!r}")
    if not allow_remote and not _is_loopback(host):
        raise InvalidArgument(
            f"host {host!r} is not a loopback address; the stand-in has no TLS and serves "
            "control endpoints, so pass allow_remote=True (--allow-remote) to expose it"
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be an int in 0..65535, got {port!r}")


def run_app(
    make_app: AppFactory,
    *,
    name: str,
    host: str,
    port: int,
    engine_options: Mapping[str, Any] | None,
    model_path: str,
    print_ready: bool,
) -> int:
    """Serve the app ``make_app`` builds over a new ``SimulatedEngine(**engine_options)`` until
    it is stopped or its engine dies; the arguments passed ``check_serving`` first.

    ``port=0`` lets the OS pick one. Once connections are accepted it prints
    ``FAKE_SGLANG_READY port=<N>`` on stdout (with ``print_ready``). When the engine dies the
    process exits at once with status ``DEATH_EXIT_CODE``, saying so on stderr as ``name``:
    in-flight connections drop and the port closes, as with SGLang. Returns 0 once stopped, 1
    if the server never started.
    """
    import uvicorn
    import uvloop

    # The engine's weights start as the checkpoint the server was started with.
    engine = SimulatedEngine(**check_engine_options(engine_options or {}), model_path=model_path)

    def on_death() -> None:
        sys.stderr.write(
            f"{name}: engine {engine.label} died: {engine.death_reason}; "
            f"exiting with status {DEATH_EXIT_CODE} like a crashed server\n"
        )
        sys.stderr.flush()
        os._exit(DEATH_EXIT_CODE)

    app = make_app(engine, on_death)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound_port: int = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
        # sglang: environ.py SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt(5), uvicorn's timeout_keep_alive
        timeout_keep_alive=5,
    )
    # An injected drop raises on purpose once its response has started; it is no app error.
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietDrops) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(QuietDrops())
    server = uvicorn.Server(config)

    async def main() -> bool:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn has no event
            await asyncio.sleep(0.01)
        if server.started and print_ready:
            sys.stdout.write(f"{READY_PREFIX} port={bound_port}\n")
            sys.stdout.flush()
        await task
        started = bool(server.started)
        await engine.close()
        return started

    try:
        # The real servers run uvicorn on uvloop, whose timers (the keep-alive's among them) run
        # before the sockets are read: a stall past the keep-alive drops a call written onto a
        # kept connection, here as there. sglang: entrypoints/http_server.py (loop="uvloop").
        started = uvloop.run(main())
    finally:
        sock.close()
    return 0 if started else 1


__all__ = [
    "DEATH_EXIT_CODE",
    "READY_PREFIX",
    "AppFactory",
    "check_serving",
    "run_app",
]
