"""The wire suite's servers: every scenario runs once on a stand-in SGLang server and once on
a real SGLang 0.5.23 server (CPU), through one small ``Target`` object, with the same assertions.
The vLLM scenarios (``vllm_target``) run on a stand-in vLLM server and on the keyless real vLLM
0.32.0 server of ``vllm_servers`` (marked ``real_vllm``), which they leave awake and resumed.

The real half is marked ``real_sglang`` (deselected by default; ``bash ci/real`` or
``-m real_sglang``). Shared servers are left serving, unpaused, with all memory resident; a test
that kills a server asks for a disposable one.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from real.servers import RealServer, RealServerPool
from wire.helpers import (
    STANDIN_TOKEN_LATENCY,
    VLLM_STANDIN_TOKEN_LATENCY,
    Kind,
    Target,
    VLLMTarget,
)

from rollout_lifecycle.testing.standin import StandInServer, VLLMStandInServer


def _standin(**keys: str) -> StandInServer:
    """A stand-in that, like SGLang, fails an update from a model path that does not exist; it
    serves a directory that does."""
    model = Path(tempfile.gettempdir()) / "rollout-lifecycle-contract-model"
    model.mkdir(exist_ok=True)
    return StandInServer(
        token_latency=STANDIN_TOKEN_LATENCY,
        model_path=str(model),
        check_model_paths=True,
        **keys,
    ).start()


def _restore(url: str, headers: dict[str, str]) -> None:
    """Leave a shared server unpaused (harmless on a serving one); a test that released memory
    resumes it itself."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/continue_generation", json={}, headers=headers, timeout=60.0)


class _StandIns:
    """The session's shared stand-in servers, replaced when a test left one dead."""

    def __init__(self) -> None:
        self._servers: dict[str, StandInServer] = {}

    def get(self, name: str, **keys: str) -> StandInServer:
        server = self._servers.get(name)
        if server is None or not server.alive():
            if server is not None:
                server.stop()
            server = _standin(**keys)
            self._servers[name] = server
        return server

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()


@pytest.fixture(scope="session")
def standins() -> Iterator[_StandIns]:
    holder = _StandIns()
    yield holder
    holder.stop()


def _standin_target(server: StandInServer, **keys: str | None) -> Target:
    return Target("standin", server.url, pid=server.pid, _exited=server.wait_dead, **keys)


def _real_target(server: RealServer, **keys: str | None) -> Target:
    assert server.proc is not None
    return Target("real", server.url, pid=server.proc.pid, _exited=server.exited, **keys)


def _disposable_target(target: Target, restart: Callable[[], object]) -> Target:
    target._restart = restart
    return target


@pytest.fixture(params=["standin", pytest.param("real", marks=pytest.mark.real_sglang)])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """A shared keyless server, serving and unpaused; ``target.disposable()`` gives one a test
    may kill."""
    yield from _shared_target(request, request.param)


@pytest.fixture(
    params=[
        "standin",
        pytest.param("real", marks=pytest.mark.real_sglang),
        pytest.param("real-dp", marks=pytest.mark.real_sglang),
    ]
)
def cycle_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """``target``, and for the lifecycle's scenarios (pause modes, the safe sequence) also the
    pool's real server with two data-parallel ranks (``RealServerPool.data_parallel``), left
    serving and unpaused: its front end must answer each call once every rank has done it."""
    if request.param != "real-dp":
        yield from _shared_target(request, request.param)
        return
    pool: RealServerPool = request.getfixturevalue("real_pool")
    target = _real_target(pool.data_parallel())
    yield target
    _restore(target.url, target.headers())
    pool.park_data_parallel()


def _shared_target(request: pytest.FixtureRequest, kind: Kind) -> Iterator[Target]:
    stops: list[Callable[[], Any]] = []
    if kind == "standin":
        shared = request.getfixturevalue("standins").get("shared")

        def standin_disposable() -> Target:
            server = _standin()
            stops.append(server.stop)
            return _disposable_target(_standin_target(server), server.restart)

        target = _standin_target(shared)
        target._disposable = standin_disposable
    else:
        pool: RealServerPool = request.getfixturevalue("real_pool")
        real = pool.shared(1)[0]

        def real_disposable() -> Target:
            server = pool.disposable()
            stops.append(server.stop)

            def give_back() -> None:
                stops.remove(server.stop)
                pool.give_back(server)

            disposable = _disposable_target(_real_target(server), server.restart)
            disposable._give_back = give_back
            return disposable

        target = _real_target(real)
        target._disposable = real_disposable
    yield target
    for stop in stops:
        stop()
    _restore(target.url, target.headers())


@pytest.fixture(params=["standin", pytest.param("real", marks=pytest.mark.real_sglang)])
def keyed(request: pytest.FixtureRequest) -> Iterator[Target]:
    """A server with both keys: ``RealServerPool.ADMIN_KEY`` and ``RealServerPool.API_KEY``."""
    keys = {"admin_key": RealServerPool.ADMIN_KEY, "api_key": RealServerPool.API_KEY}
    if request.param == "standin":
        server = request.getfixturevalue("standins").get("keyed", **keys)
        target = _standin_target(server, **keys)
    else:
        pool: RealServerPool = request.getfixturevalue("real_pool")
        target = _real_target(pool.keyed(), **keys)
    yield target
    _restore(target.url, target.headers())


# ------------------------------------------------------------------ vLLM


def contract_model_dir() -> str:
    """A directory the vLLM stand-in serves and reloads from (any directory is a checkpoint)."""
    model = Path(tempfile.gettempdir()) / "rollout-lifecycle-contract-vllm-model"
    model.mkdir(exist_ok=True)
    return str(model)


def vllm_standin(**options: Any) -> VLLMStandInServer:
    """A started vLLM stand-in serving ``contract_model_dir()``."""
    options.setdefault("token_latency", VLLM_STANDIN_TOKEN_LATENCY)
    return VLLMStandInServer(model_path=contract_model_dir(), **options).start()


def _restore_vllm(url: str) -> None:
    """Leave a shared vLLM server awake and resumed (harmless on a serving one)."""
    with contextlib.suppress(httpx.HTTPError):
        metrics = httpx.get(f"{url}/metrics", timeout=60.0).text
        if 'sleep_state="awake"} 0.0' in metrics:
            httpx.post(f"{url}/wake_up", timeout=60.0)
        httpx.post(f"{url}/resume", timeout=60.0)


@pytest.fixture(scope="session")
def shared_vllm_standin() -> Iterator[list[VLLMStandInServer]]:
    """The session's vLLM stand-in (replaced when a test left it dead)."""
    holder: list[VLLMStandInServer] = []
    yield holder
    for server in holder:
        server.stop()


@pytest.fixture(params=["standin", pytest.param("real", marks=pytest.mark.real_vllm)])
def vllm_target(request: pytest.FixtureRequest) -> Iterator[VLLMTarget]:
    """A shared keyless vLLM server, awake, resumed and serving; left so."""
    if request.param == "standin":
        holder: list[VLLMStandInServer] = request.getfixturevalue("shared_vllm_standin")
        if not holder or not holder[-1].alive():
            holder.append(vllm_standin())
        server = holder[-1]
        target = VLLMTarget(
            "standin",
            server.url,
            pid=server.pid,
            _exited=server.wait_dead,
            model_path=contract_model_dir(),
        )
    else:
        real = request.getfixturevalue("vllm_servers")[1]
        model = request.getfixturevalue("real_vllm").model
        assert real.proc is not None
        target = VLLMTarget(
            "real", real.url, pid=real.proc.pid, _exited=real.exited, model_path=str(model)
        )
    yield target
    _restore_vllm(target.url)
