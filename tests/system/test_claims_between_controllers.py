"""One controller per engine: a call claims every engine it drives for its whole length, across
servers and processes on the host, and a second controller is refused at once, naming the first;
a claim dies with its process.

The claims' own rules in this process (the lock files, a refused claim keeping nothing, engines
without an address) are ``tests/core/test_claims.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import socket
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollout_lifecycle import (
    EngineClaimed,
    EngineGroup,
    LifecycleEvent,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
)
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.claims import LOCK_DIR_ENV, HostClaims
from rollout_lifecycle.testing import StandInServer

S = ServerState
BOUND = 30.0


@pytest.fixture(scope="module")
def servers() -> Iterator[list[StandInServer]]:
    with StandInServer.running(2, token_latency=0.001) as running:
        yield running


pytestmark = pytest.mark.usefixtures("own_lock_dir")


def history_ops(server: StandInServer) -> list[str]:
    return [e["op"] for e in server.history()]


@pytest.fixture
def engines(http_clients: list[SGLangHTTPEngine]) -> list[SGLangHTTPEngine]:
    return http_clients


def http_engines(
    servers: list[StandInServer], made: list[SGLangHTTPEngine], host: str = "127.0.0.1"
) -> list[SGLangHTTPEngine]:
    out = [SGLangHTTPEngine(s.url.replace("127.0.0.1", host), retries=0) for s in servers]
    made.extend(out)
    return out


async def test_a_second_server_is_refused_at_once_while_the_first_drives_the_engines(
    servers: list[StandInServer], engines: list[SGLangHTTPEngine]
) -> None:
    trainer = RolloutServer([EngineGroup("actor", http_engines(servers, engines))], name="trainer")
    # the same servers, spelled another way: one engine is one address
    operator = RolloutServer(
        [EngineGroup("actor", http_engines(servers, engines, "localhost"))], name="operator"
    )
    holding, go_on = asyncio.Event(), asyncio.Event()

    async def hold(event: LifecycleEvent) -> None:
        holding.set()
        await go_on.wait()

    trainer.on("before_release", hold)
    offload = asyncio.ensure_future(trainer.offload())
    await asyncio.wait_for(holding.wait(), BOUND)  # the trainer's call is under way
    sent = [len(history_ops(s)) for s in servers]
    with pytest.raises(EngineClaimed) as err:
        await asyncio.wait_for(operator.offload(), BOUND)
    assert "trainer" in str(err.value) and f"pid {os.getpid()}" in str(err.value)
    assert err.value.details["call"] == "offload" and err.value.details["server"] == "trainer"
    assert pickle.loads(pickle.dumps(err.value)).details == err.value.details
    assert [len(history_ops(s)) for s in servers] == sent  # the operator sent nothing
    assert operator.state is S.SERVING  # and its records are untouched
    go_on.set()
    await asyncio.wait_for(offload, BOUND)
    assert trainer.state is S.RELEASED
    await trainer.onload()
    # once the trainer's call is over, the operator's next call may claim the engines
    await operator.pause()
    await operator.resume()
    assert operator.state is S.SERVING


async def test_a_claim_taken_between_two_calls_refuses_the_next_which_can_be_tried_again(
    servers: list[StandInServer], engines: list[SGLangHTTPEngine]
) -> None:
    """A claim lasts one call: between the trainer's offload and its onload another controller
    may claim the engines (a racing controller whose pause then finds them paused). The
    trainer's onload meanwhile is refused before it sends anything, its server still
    released, and goes through once the other lets go."""
    trainer = RolloutServer([EngineGroup("actor", http_engines(servers, engines))], name="trainer")
    await trainer.offload()
    other = HostClaims().acquire(
        [f"address:{url_identity(s.url.replace('127.0.0.1', 'localhost'))}" for s in servers],
        {"pid": os.getpid(), "server": "operator", "call": "offload"},
    )
    try:
        sent = [len(history_ops(s)) for s in servers]
        with pytest.raises(EngineClaimed) as err:
            await asyncio.wait_for(trainer.onload(), BOUND)
        assert err.value.details["server"] == "operator"
        assert [len(history_ops(s)) for s in servers] == sent  # nothing sent
        assert trainer.state is S.RELEASED
    finally:
        other.release()
    await asyncio.wait_for(trainer.onload(), BOUND)
    assert trainer.state is S.SERVING
    assert not any(s.state()["paused"] or s.state()["released_tags"] for s in servers)


HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from rollout_lifecycle import EngineGroup, RolloutServer, SGLangHTTPEngine

    async def main() -> None:
        urls = sys.argv[1:]
        server = RolloutServer(
            [EngineGroup("actor", [SGLangHTTPEngine(u) for u in urls])], name="holder"
        )

        async def hold(event):
            print("holding", flush=True)
            await asyncio.sleep(3600)

        server.on("before_pause", hold)
        await server.pause()

    asyncio.run(main())
    """
)


async def test_a_claim_held_by_another_process_refuses_and_dies_with_it(
    servers: list[StandInServer], engines: list[SGLangHTTPEngine]
) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, *(s.url for s in servers), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        # a deadline on a fact: the child says it holds its claim
        line = await asyncio.wait_for(child.stdout.readline(), BOUND)
        assert line.strip() == b"holding", f"the holder did not start (exit {child.returncode})"
        server = RolloutServer(
            [EngineGroup("actor", http_engines(servers, engines))], name="second"
        )
        with pytest.raises(EngineClaimed) as err:
            await asyncio.wait_for(server.pause(), BOUND)
        assert err.value.details["pid"] == child.pid
        assert err.value.details["server"] == "holder" and err.value.details["call"] == "pause"
    finally:
        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(child.wait(), BOUND)
    # The holder died (SIGKILL: no clean-up ran); its claim went with it.
    await asyncio.wait_for(server.pause(), BOUND)
    await server.resume()
    assert server.state is S.SERVING


RACER = textwrap.dedent(
    """
    import asyncio, json, sys
    from rollout_lifecycle import EngineGroup, RolloutServer, SGLangHTTPEngine
    from rollout_lifecycle.testing.fleets import raced_cycle

    async def trial(urls):
        engines = [SGLangHTTPEngine(u, retries=0) for u in urls]
        server = RolloutServer([EngineGroup("actor", engines)], name=sys.argv[1])
        try:
            return await raced_cycle(server, retries=200)
        finally:
            await asyncio.gather(*(e.close() for e in engines))

    async def main():
        for line in sys.stdin:  # one trial per "go", all started at once by the test
            print(json.dumps(await trial(sys.argv[2:])), flush=True)

    asyncio.run(main())
    """
)

TRIALS = 20


async def race(
    spellings: dict[str, list[str]],
    lock_dir: Path | None,
    alive: Callable[[], bool],
    trials: int = TRIALS,
    bound: float = BOUND,
) -> list[tuple[str, str]]:
    """Start one ``RACER`` process per entry of ``spellings`` (name: the URLs it drives), each
    with a lock directory of its own under ``lock_dir`` (None: the default, shared), let them
    race ``trials`` full cycles, all started at once, and return each trial's pair of outcomes;
    ``alive()`` is asserted after every trial."""
    racers = {}
    for name, urls in spellings.items():
        env = dict(os.environ)
        if lock_dir is not None:
            env[LOCK_DIR_ENV] = str(lock_dir / f"locks-{name}")
        racers[name] = await asyncio.create_subprocess_exec(
            sys.executable, "-c", RACER, name, *urls,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
    outcomes: dict[str, list[str]] = {name: [] for name in racers}
    try:
        for _ in range(trials):
            for racer in racers.values():
                assert racer.stdin is not None
                racer.stdin.write(b"go\n")
            await asyncio.gather(*(r.stdin.drain() for r in racers.values() if r.stdin))
            for name, racer in racers.items():
                assert racer.stdout is not None
                line = await asyncio.wait_for(racer.stdout.readline(), bound)
                assert line, f"racer {name} exited ({await racer.wait()})"
                outcomes[name].append(json.loads(line))
            assert alive(), f"an engine died: {outcomes}"
    finally:
        for racer in racers.values():
            with contextlib.suppress(ProcessLookupError):
                racer.kill()
            await racer.wait()
    return list(zip(*outcomes.values(), strict=True))


@pytest.mark.parametrize("lock_dirs", ["one lock directory", "a lock directory each"])
async def test_two_controllers_spelling_one_engine_differently_kill_nothing(
    servers: list[StandInServer], tmp_path: Path, lock_dirs: str
) -> None:
    """Two controller processes race a full offload and onload over the same two engines, one
    spelling them 127.0.0.1 and the other by this host's name and 127.1, ``TRIALS`` times:
    each time one cycles and the other is refused before it sends a release (claimed, or its
    pause found the engines paused), whichever lock directory each has (two containers on one
    host network, each with its own /tmp). No engine dies."""
    spellings = {
        "a": [s.url for s in servers],
        "b": [
            servers[0].url.replace("127.0.0.1", socket.gethostname()),
            servers[1].url.replace("127.0.0.1", "127.1"),
        ],
    }
    lock_dir = None if lock_dirs == "one lock directory" else tmp_path
    both = await race(spellings, lock_dir, alive=lambda: all(s.alive() for s in servers))
    # one of the two went through
    assert all("cycled" in pair for pair in both), [p for p in both if "cycled" not in p]
    refused = [o for pair in both for o in pair if o != "cycled"]
    assert all(o == "claimed" or o.startswith("refused: conflict") for o in refused), both
    # left serving, every tag resident
    assert not any(s.state()["paused"] or s.state()["released_tags"] for s in servers)
