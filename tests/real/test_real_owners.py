"""One owner per real SGLang 0.5.23 server, whatever its name, and a journal that tells the truth
after a kill: the stand-in scenarios of ``tests/system/test_claims_between_controllers.py`` and
``tests/system/test_killed_controllers.py``, run against real servers.

Two controller processes race full cycles over the same two servers, one spelling them
127.0.0.1 and the other by this host's name and 127.1, each with a lock directory of its own:
one goes through, the other is refused, and no server dies. A trainer killed in its push
(SIGKILL) leaves both servers holding an open weight-update session, which a begin shows
("already open"); the next process adopts its journal as failed, and ``reset()`` closes the
sessions before the next update. (vLLM holds no session without a weight-transfer engine,
which a CPU cannot run: ``docs/vllm-contract.md``.)"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from real.servers import RealServer
from system.test_claims_between_controllers import race
from system.test_killed_controllers import killed_in_its_push, successor

from rollout_lifecycle import (
    FromDisk,
    ServerState,
    SGLangHTTPEngine,
)

pytestmark = pytest.mark.real_sglang

S = ServerState
#: Generous: a loaded machine runs two CPU servers and two controllers on 2 cores.
BOUND = 120.0


@pytest.fixture
async def clients() -> AsyncIterator[list[SGLangHTTPEngine]]:
    made: list[SGLangHTTPEngine] = []
    yield made
    await asyncio.gather(*(e.close() for e in made))


def serving(server: RealServer) -> dict[str, Any]:
    """Whether the real server is alive and serving (``/ready`` 200: not paused)."""
    answer = httpx.get(f"{server.url}/ready", timeout=30, trust_env=False)
    return {"alive": server.alive(), "ready": answer.status_code == 200}


async def test_two_controllers_spelling_real_servers_differently_kill_nothing(
    real_servers: list[RealServer], tmp_path: Path
) -> None:
    spellings = {
        "a": [s.url for s in real_servers],
        "b": [
            real_servers[0].url.replace("127.0.0.1", socket.gethostname()),
            real_servers[1].url.replace("127.0.0.1", "127.1"),
        ],
    }
    both = await race(
        spellings, tmp_path, alive=lambda: all(s.alive() for s in real_servers), bound=BOUND
    )
    assert all("cycled" in pair for pair in both), both  # one of the two went through
    refused = [o for pair in both for o in pair if o != "cycled"]
    assert all(o == "claimed" or o.startswith("refused: conflict") for o in refused), both
    assert [serving(s) for s in real_servers] == [{"alive": True, "ready": True}] * 2


async def test_a_trainer_sigkilled_in_its_push_leaves_real_sessions_that_reset_closes(
    real_servers: list[RealServer],
    real_sglang: Any,
    clients: list[SGLangHTTPEngine],
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.json"
    killed = await killed_in_its_push(
        [s.url for s in real_servers], journal, signal.SIGKILL, bound=BOUND
    )
    assert killed == -signal.SIGKILL
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        for real in real_servers:  # the kill left each server's session open
            begin = await http.post(f"{real.url}/begin_weight_update", json={"selector": "all"})
            assert begin.status_code == 400 and "already open" in begin.text, begin.text
    server = successor([s.url for s in real_servers], clients, journal)
    assert server.state is S.FAILED
    assert all(r.session_unknown and r.stale for r in server.snapshot().engines().values())
    assert await asyncio.wait_for(server.reset(), BOUND) is S.WEIGHTS_RESTORED  # sessions closed
    await asyncio.wait_for(server.update_weights(FromDisk(real_sglang.model), "v1"), BOUND)
    await asyncio.wait_for(server.onload_kv(), BOUND)
    assert server.state is S.SERVING
    assert [serving(s) for s in real_servers] == [{"alive": True, "ready": True}] * 2
