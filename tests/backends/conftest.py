"""Fixtures of the backend tests."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from rollout_lifecycle.backends.launch import LaunchedServer


@pytest.fixture
def engines() -> Iterator[list[LaunchedServer[Any]]]:
    """Launched engines of a test; any process still running at the end is killed."""
    started: list[LaunchedServer[Any]] = []
    yield started
    for engine in started:
        pid = engine.pid
        if pid is not None and engine.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
