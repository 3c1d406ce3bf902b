"""Fixtures the system tests of controllers share: two stand-in servers, a lock directory of the
test's own (the host-wide one by default), and HTTP clients closed after the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollout_lifecycle import SGLangHTTPEngine
from rollout_lifecycle.core.claims import LOCK_DIR_ENV
from rollout_lifecycle.testing import StandInServer


@pytest.fixture
def two_standins() -> Iterator[list[StandInServer]]:
    """Two stand-in SGLang servers for one test."""
    with StandInServer.running(2, token_latency=0.001) as running:
        yield running


@pytest.fixture
def own_lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own claims lock directory (``ROLLOUT_LIFECYCLE_LOCK_DIR``)."""
    directory = tmp_path / "locks"
    monkeypatch.setenv(LOCK_DIR_ENV, str(directory))
    return directory


@pytest.fixture
async def http_clients() -> AsyncIterator[list[SGLangHTTPEngine]]:
    """A list to put the test's HTTP clients in: each is closed when the test ends."""
    made: list[SGLangHTTPEngine] = []
    yield made
    await asyncio.gather(*(e.close() for e in made))
