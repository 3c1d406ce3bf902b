"""A stand-in SGLang 0.5.23 HTTP server: the simulated engine behind SGLang's routes, no GPU needed.

It answers like SGLang and dies like SGLang (the fatal call's connection drops, the port closes).
Its routes, keys, body checks and answer shapes come from the same endpoint table the HTTP
client sends from (``backends.sglang.api``). Stand-in only, under ``/_standin/``: the engine's
history, memory and counters, and HTTP fault injection (``/_standin/faults``: delays, proxy
errors, dropped connections, sudden death) for tests of what a client does when the network or
the server misbehaves.

- ``app``: the ASGI app (``create_app``), its routes and the state they share;
- ``auth``: which key a request carries, and the 401 before a route;
- ``bodies``: request fields checked against the table, and SGLang's error answer;
- ``faults``: the injected faults;
- ``serving``: uvicorn serving a stand-in's app in this process, and its end when the engine
  dies;
- ``process``: ``serve`` (in this process), ``StandInServer`` and ``VLLMStandInServer``
  (subprocesses);
- ``vllm_app``, ``vllm_engine``: the vLLM 0.32.0 stand-in's routes and engine.
"""

from __future__ import annotations

from rollout_lifecycle.backends.sglang.api import OPEN_PREFIXES, auth_level
from rollout_lifecycle.testing.standin.app import DEFAULT_MODEL_PATH, create_app
from rollout_lifecycle.testing.standin.auth import request_allowed
from rollout_lifecycle.testing.standin.faults import FAULT_KINDS, FAULTS_PATH
from rollout_lifecycle.testing.standin.process import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    DEATH_EXIT_CODE,
    DEFAULT_STARTUP_TIMEOUT,
    READY_PREFIX,
    StandInFailed,
    StandInServer,
    VLLMStandInServer,
    serve,
)
from rollout_lifecycle.testing.standin.state import StandInDied

__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "DEATH_EXIT_CODE",
    "DEFAULT_MODEL_PATH",
    "DEFAULT_STARTUP_TIMEOUT",
    "FAULTS_PATH",
    "FAULT_KINDS",
    "OPEN_PREFIXES",
    "READY_PREFIX",
    "StandInDied",
    "StandInFailed",
    "StandInServer",
    "VLLMStandInServer",
    "auth_level",
    "create_app",
    "request_allowed",
    "serve",
]
