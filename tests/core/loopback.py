"""Loopback addresses of this test worker's own, for tests whose engines are claimed by address.

A claim holds its address for the whole host (an abstract socket per address:
``core/claims.py _bind_abstract``), so two pytest-xdist workers claiming one address at the same
time refuse each other (``EngineClaimed`` naming the other worker's pid). Each worker names its
own ports.
"""

from __future__ import annotations

import os

#: Ports per worker: room for the few addresses one test file names.
SPAN = 10
FIRST_PORT = 31000


def port(n: int) -> int:
    """This worker's ``n``-th port (``n`` from 1 to ``SPAN - 1``)."""
    assert 0 < n < SPAN, n
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return FIRST_PORT + SPAN * int(worker) + n


def loopback(n: int) -> str:
    """``http://127.0.0.1:`` and this worker's ``n``-th port."""
    return f"http://127.0.0.1:{port(n)}"
