"""An ``EngineBackend`` that starts its own vLLM server as a child process, then drives it
through ``VLLMHTTPEngine``.

The server runs ``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1``
(without it vLLM serves none of the lifecycle routes). It binds to loopback unless told
otherwise: vLLM's API key guards no lifecycle route. Start-up waits for ``GET /health`` to
answer 200, then runs the client's attach check (vLLM 0.32 or newer, with the RL routes).
"""

from __future__ import annotations

import functools
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
from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine
from rollout_lifecycle.contract.exceptions import InvalidArgument

__all__ = ["VLLM_API_KEY_ENV", "LaunchedVLLMEngine", "launched_vllm_factory"]

#: The variable vLLM reads its API key from when ``--api-key`` is not given.
# vllm: entrypoints/serve/middleware/register.py (args.api_key or [envs.VLLM_API_KEY])
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: What every launched vLLM server needs: the RL and developer routes.
# vllm: entrypoints/launchers/api_server/routers.py (register_rl_api_routers under the flag)
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


class LaunchedVLLMEngine(LaunchedServer[VLLMHTTPEngine]):
    """A vLLM server this object starts, owns and stops; implements ``EngineBackend``.

    The default command is ``PYTHON -m vllm.entrypoints.openai.api_server --model M --host H
    --port P *extra_args`` (``python``: the interpreter that has vLLM, often a virtual
    environment of its own); ``command`` replaces it. ``env`` adds variables for the child;
    ``VLLM_SERVER_DEV_MODE=1`` is always set. An ``api_key`` reaches vLLM through its
    environment (``VLLM_API_KEY``), never the command line; it guards the OpenAI routes only.

    ``sleep_level`` and ``weight_transfer`` are the client's (see ``VLLMHTTPEngine``).
    """

    EVENT = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        port: int,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        python: str | None = None,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        api_key: str | Secret | None = None,
        startup_timeout: float = 600.0,
        timeouts: HTTPTimeouts | None = None,
        label: str | None = None,
        stop_grace: float = 10.0,
        sleep_level: int = 1,
        weight_transfer: bool = False,
    ) -> None:
        extra, url = check_launch(model_path, port, host, extra_args, ("--api-key",))
        api = as_secret(api_key, what="api_key")
        http = VLLMHTTPEngine(
            url,
            api_key=api,
            timeouts=timeouts,
            label=label,
            sleep_level=sleep_level,
            weight_transfer=weight_transfer,
        )
        if command is None:
            module = "vllm.entrypoints.openai.api_server"
            cmd = [interpreter(python), "-m", module, "--model", model_path]
            cmd += ["--host", host, "--port", str(port), *extra]
        else:
            if python is not None:
                raise InvalidArgument("python does not apply to a custom command")
            cmd = check_str_list("command", command, allow_empty=False)
        super().__init__(
            model_path,
            http,
            cmd,
            env,
            keys={VLLM_API_KEY_ENV: api},
            startup_timeout=startup_timeout,
            stop_grace=stop_grace,
        )

    def _server_env(self) -> dict[str, str]:
        return dict(DEV_MODE)

    async def _port_taken(self) -> bool:
        return await self._http.health_status() is not None

    async def _probe(self, timeout: float) -> bool:
        # vllm: entrypoints/serve/instrumentator/health.py health: 200 once the engine core
        # answers (paused or not), 503 once it died
        return await self._http.ping()


delegate(LaunchedVLLMEngine, VLLMHTTPEngine)


def launched_vllm_factory(model_path: str, **kwargs: Any) -> Callable[[], LaunchedVLLMEngine]:
    """A picklable zero-argument factory of ``LaunchedVLLMEngine(model_path, **kwargs)``; the
    arguments are checked now (constructing an engine starts nothing), and the key is wrapped
    in ``Secret`` so that the factory's repr never shows it."""
    kwargs = secret_kwargs(kwargs, ("api_key",))
    LaunchedVLLMEngine(model_path, **kwargs)
    return functools.partial(LaunchedVLLMEngine, model_path, **kwargs)
