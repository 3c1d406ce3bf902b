"""Shared fixtures: one local Ray cluster per test session, fleets of simulated engines, and
structlog left as each test found it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import structlog

from rollout_lifecycle.testing import simulated_engine_actors


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
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def fleet(ray_cluster: None) -> Iterator[Callable[..., list[Any]]]:
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
