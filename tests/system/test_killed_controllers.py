"""A controller killed at any instant leaves a journal that tells the truth, and the next one
heals what it left.

A training process driving two stand-in servers is killed in the middle of its weight push,
with SIGKILL (nothing of it runs) or SIGTERM (how Ray and Kubernetes stop a process; the
library lets the call in progress settle, then the process ends as SIGTERM ends it). A second
process adopts its journal and must find the engines as they are: with SIGKILL a weight-update
session is open on both (the journal says it may be: adopted as failed, the engines stale until
a write completes, and ``reset()`` closes the sessions first); with SIGTERM it was closed before
the process ended.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
)
from rollout_lifecycle.core.snapshots import ServerSnapshot
from rollout_lifecycle.testing import StandInServer

S = ServerState
BOUND = 60.0

#: What both trainers share: imports, a journal kept in a file (written whole, then renamed),
#: the engines from the command line, and a push that says it runs, then runs for an hour.
COMMON = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from rollout_lifecycle import EngineGroup, RolloutServer, SGLangHTTPEngine
    from rollout_lifecycle.sync import SyncRolloutServer

    def journal(path):
        def write(snapshot):
            with open(path + ".tmp", "w") as f:
                json.dump(snapshot.to_dict(), f)
            os.replace(path + ".tmp", path)
        return write

    def server():
        engines = [SGLangHTTPEngine(u, retries=0) for u in sys.argv[2:]]
        group = EngineGroup("actor", engines)
        return RolloutServer([group], name="trainer", journal=journal(sys.argv[1]))

    async def push(update):
        print("pushing", flush=True)  # the sessions are open
        await asyncio.sleep(3600)
    """
)
TRAINER = COMMON + textwrap.dedent(
    """
    async def main():
        trainer = server()
        await trainer.offload()
        await trainer.onload_weights()
        await trainer.update_weights(push)

    asyncio.run(main())
    """
)
SYNC_TRAINER = COMMON + textwrap.dedent(
    """
    trainer = SyncRolloutServer.wrap(server)
    trainer.offload()
    trainer.onload_weights()
    trainer.update_weights(push)
    """
)


@pytest.fixture
def servers(two_standins: list[StandInServer]) -> list[StandInServer]:
    return two_standins


pytestmark = pytest.mark.usefixtures("own_lock_dir")


@pytest.fixture
def engines(http_clients: list[SGLangHTTPEngine]) -> list[SGLangHTTPEngine]:
    return http_clients


def urls(servers: list[StandInServer]) -> list[str]:
    return [s.url for s in servers]


def sessions(servers: list[StandInServer]) -> Callable[[], bool]:
    """Whether every stand-in holds an open weight-update session."""
    return lambda: all(s.state()["weight_update_session_open"] for s in servers)


async def killed_in_its_push(
    urls: list[str],
    journal: Path,
    how: signal.Signals,
    trainer: str = TRAINER,
    pushing: Callable[[], bool] = lambda: True,
    bound: float = BOUND,
) -> int:
    """Run the trainer over the engines at ``urls`` until its push has begun (and, asserted,
    ``pushing()``), send it ``how``; its exit status."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", trainer, str(journal), *urls, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), bound)
        assert line.strip() == b"pushing", f"the trainer did not push (exit {child.returncode})"
        assert pushing()
        child.send_signal(how)
        return await asyncio.wait_for(child.wait(), bound)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


def successor(urls: list[str], made: list[SGLangHTTPEngine], journal: Path) -> RolloutServer:
    """A new process's server over the engines at ``urls``, the journal adopted."""
    engines = [SGLangHTTPEngine(u, retries=0) for u in urls]
    made.extend(engines)
    server = RolloutServer([EngineGroup("actor", engines)], name="successor")
    server.adopt(ServerSnapshot.from_dict(json.loads(journal.read_text())))
    return server


async def test_a_trainer_sigkilled_in_its_push_leaves_a_journal_that_says_a_session_may_be_open(
    servers: list[StandInServer], engines: list[SGLangHTTPEngine], tmp_path: Path
) -> None:
    journal = tmp_path / "journal.json"
    killed = await killed_in_its_push(
        urls(servers), journal, signal.SIGKILL, pushing=sessions(servers)
    )
    assert killed == -signal.SIGKILL
    assert all(s.state()["weight_update_session_open"] for s in servers)  # left open
    server = successor(urls(servers), engines, journal)
    # a call was in progress and the push may have written half the weights
    assert server.state is S.FAILED
    records = server.snapshot().engines().values()
    assert all(r.session_unknown and r.stale for r in records)
    assert await server.reset() is S.WEIGHTS_RESTORED  # the sessions closed first
    assert not any(s.state()["weight_update_session_open"] for s in servers)
    await server.update_weights(FromDisk("/ckpt/after-the-kill"), version="v1")
    await server.onload_kv()
    assert server.state is S.SERVING
    assert not any(s.state()["paused"] or s.state()["released_tags"] for s in servers)
    assert all(s.alive() for s in servers)


@pytest.mark.parametrize("trainer", [TRAINER, SYNC_TRAINER], ids=["async", "sync facade"])
async def test_a_trainer_sigtermed_in_its_push_settles_then_ends_as_sigterm_ends_it(
    servers: list[StandInServer], engines: list[SGLangHTTPEngine], tmp_path: Path, trainer: str
) -> None:
    journal = tmp_path / "journal.json"
    assert (
        await killed_in_its_push(
            urls(servers), journal, signal.SIGTERM, trainer, pushing=sessions(servers)
        )
        == -signal.SIGTERM
    )
    # the push was cancelled, and the sessions closed, before the process ended
    assert not any(s.state()["weight_update_session_open"] for s in servers)
    server = successor(urls(servers), engines, journal)
    assert server.state is S.WEIGHTS_RESTORED  # (a cancelled call leaves the server in place)
    snapshot = server.snapshot()
    assert not any(r.session_unknown for r in snapshot.engines().values())
    # the push wrote who knows what, and no version tells: no engine continues until a write
    assert snapshot.interrupted
    await server.update_weights(FromDisk("/ckpt/after-the-stop"), version="v1")
    await server.onload_kv()
    assert server.state is S.SERVING and all(s.alive() for s in servers)
