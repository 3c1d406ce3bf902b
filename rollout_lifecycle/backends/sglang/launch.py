"""SGLang servers this library starts, owns and stops (``LaunchedSGLangEngine``, a
``LaunchedServer``): the command line, the keys handed over through the environment, and the
readiness probe."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.backends.http.wire import HTTPTimeouts, check_str_list
from rollout_lifecycle.backends.launch import (
    LaunchedServer,
    check_launch,
    delegate,
    interpreter,
)
from rollout_lifecycle.backends.secret import Secret, as_secret, secret_kwargs
from rollout_lifecycle.backends.sglang.client import SGLangHTTPEngine
from rollout_lifecycle.contract.exceptions import InvalidArgument

__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "LaunchedSGLangEngine", "launched_sglang_factory"]

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


class LaunchedSGLangEngine(LaunchedServer[SGLangHTTPEngine]):
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

    Start-up waits for ``GET /ready`` to answer 200 (SGLang's readiness probe: 503 until the
    server is up, after warm-up; ``/model_info`` answers before warm-up), then refuses an SGLang
    older than 0.5.22.

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
        extra, url = check_launch(model_path, port, host, extra_args, _KEY_FLAGS)
        admin = as_secret(admin_key, what="admin_key")
        api = as_secret(api_key, what="api_key")
        http = SGLangHTTPEngine(
            url,
            admin_key=admin,
            api_key=api,
            timeouts=timeouts,
            label=label,
            weight_selector=weight_selector,
        )
        if not isinstance(memory_saver, bool):
            raise InvalidArgument(f"memory_saver must be True or False, got {memory_saver!r}")
        if command is None:
            python = interpreter(python)
            args = ["--model-path", model_path, "--host", host, "--port", str(port)]
            if memory_saver:
                args.append("--enable-memory-saver")
            args += extra
            if admin is None and api is None:
                cmd = [python, "-m", "sglang.launch_server", *args]
            else:
                cmd = [python, "-c", _KEYED_LAUNCH, *args]
        else:
            if python not in (None, sys.executable) or not memory_saver:
                raise InvalidArgument("python and memory_saver do not apply to a custom command")
            cmd = check_str_list("command", command, allow_empty=False)
        super().__init__(
            model_path,
            http,
            cmd,
            env,
            keys={ADMIN_KEY_ENV: admin, API_KEY_ENV: api},
            startup_timeout=startup_timeout,
            stop_grace=stop_grace,
        )

    # ----------------------------------------------------------------------------- the kind

    EVENT = "sglang"

    def _server_env(self) -> dict[str, str]:
        return {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}

    async def _port_taken(self) -> bool:
        # Any answer at all (a paused SGLang answers /ready with 503) means the port is taken.
        return await self._http.link.ready_status() is not None

    async def _probe(self, timeout: float) -> bool:
        # sglang: http_server.py ready() -> tokenizer_manager.py TokenizerManager.is_ready
        return await self._http.ready(timeout=timeout)

    def _shown_command(self) -> str:
        return " ".join("<keyed launch>" if a == _KEYED_LAUNCH else a for a in self._command)


delegate(LaunchedSGLangEngine, SGLangHTTPEngine)


def launched_sglang_factory(model_path: str, **kwargs: Any) -> Callable[[], LaunchedSGLangEngine]:
    """A picklable zero-argument factory of ``LaunchedSGLangEngine(model_path, **kwargs)``.

    The arguments are checked now (constructing an engine starts nothing); keys are wrapped in
    ``Secret`` so that the factory's repr never shows them.
    """
    kwargs = secret_kwargs(kwargs, ("admin_key", "api_key"))
    LaunchedSGLangEngine(model_path, **kwargs)
    return functools.partial(LaunchedSGLangEngine, model_path, **kwargs)
