"""Shared fixtures: one local Ray cluster per test session, fleets of simulated engines, the
session's real SGLang servers (started once, for tests marked ``real_sglang``), and structlog
left as each test found it; under pytest-xdist each worker launches its servers on ports of its
own."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import structlog
from real.servers import (
    RealServer,
    RealServerPool,
    RealSGLang,
    RealVLLM,
    RealVLLMServer,
    require_real_sglang,
    require_real_vllm,
    start_all,
)
from real.vllm_models import API_KEY, long_model

from rollout_lifecycle.backends.ports import PORT_RANGE, PORTS_ENV
from rollout_lifecycle.testing import LocalCluster, simulated_engine_actors
from rollout_lifecycle.testing.actor_fleets import init_local_ray


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, give each worker its own part of the library's port range
    (``ROLLOUT_LIFECYCLE_PORTS``): a port one worker chose for a server could otherwise be
    drawn by the other before that server binds it."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if not worker or not worker.startswith("gw") or not count or PORTS_ENV in os.environ:
        return
    index, workers = int(worker[2:]), int(count)
    low, high = PORT_RANGE
    size = (high - low + 1) // workers
    os.environ[PORTS_ENV] = f"{low + index * size}-{low + (index + 1) * size - 1}"


@pytest.fixture(autouse=True)
def unconfigured_structlog() -> Iterator[None]:
    """``structlog.testing.capture_logs()`` leaves structlog configured (with its default
    printer to stdout) after it exits, and the library follows a configured structlog: events
    of later tests would then land on stdout, in the JSON that ``ctl --json`` prints."""
    configured = structlog.is_configured()
    yield
    if not configured and structlog.is_configured():
        structlog.reset_defaults()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    init_local_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[LocalCluster]:
    """A Ray cluster of three nodes on this machine (``LocalCluster``: each its own raylet, two
    of the custom resource ``gpu`` each) for one module; this process's one-node cluster, if
    it had one, is shut down for the module and started again after it."""
    had = ray.is_initialized()
    if had:
        ray.shutdown()
    try:
        with LocalCluster(3) as cluster:
            yield cluster
    finally:
        if had:
            init_local_ray()


@pytest.fixture
def engine_actors(ray_cluster: None) -> Iterator[Callable[..., list[Any]]]:
    """Start simulated engine actors; every actor started is killed when the test ends."""
    started: list[Any] = []

    def start(count: int, *, wait: bool = True, **options: Any) -> list[Any]:
        actors = simulated_engine_actors(count, **options)
        started.extend(actors)
        if wait:
            ray.get([a.ping.remote() for a in actors], timeout=60)
        return actors

    yield start
    for actor in started:
        ray.kill(actor)


@pytest.fixture(scope="session")
def real_sglang() -> RealSGLang:
    """SGLang 0.5.23's interpreter and the tiny model; skips (fails under CI) without them."""
    return require_real_sglang()


@pytest.fixture(scope="session")
def real_pool(real_sglang: RealSGLang) -> Iterator[RealServerPool]:
    """Every real server the session needs, started together once."""
    pool = RealServerPool(real_sglang)
    yield pool
    pool.stop()


@pytest.fixture
def real_servers(real_pool: RealServerPool) -> list[RealServer]:
    """Two shared keyless real servers, serving with all memory resident; leave them so."""
    return real_pool.shared(2)


@pytest.fixture
def disposable_real_server(real_pool: RealServerPool) -> Iterator[RealServer]:
    """A real server this test may kill; stopped when the test ends."""
    server = real_pool.disposable()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> RealVLLM:
    """The vLLM environment, serving the tiny model with 8,192 positions (``long_model``);
    skips (fails under CI) without it."""
    env = require_real_vllm()
    return dataclasses.replace(env, model=long_model(env, tmp_path_factory.mktemp("long")))


@pytest.fixture(scope="session")
def vllm_servers(real_vllm: RealVLLM) -> Iterator[list[RealVLLMServer]]:
    """Two real vLLM servers, started together once: the first with an API key (``API_KEY``).
    Leave them awake, unpaused and generating."""
    servers = start_all([RealVLLMServer(real_vllm, api_key=API_KEY), RealVLLMServer(real_vllm)])
    yield servers  # type: ignore[misc]
    for server in servers:
        server.stop()


#: Seconds a real-server test may take, its share of the pool's start-up included.
REAL_SGLANG_TIMEOUT_S = 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        real = item.get_closest_marker("real_sglang") or item.get_closest_marker("real_vllm")
        if real and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(REAL_SGLANG_TIMEOUT_S))
