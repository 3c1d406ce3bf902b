"""Bad input gets a clear error naming the value, before any engine is touched."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    HTTPTimeouts,
    InvalidArgument,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    SimulatedEngine,
)
from rollout_lifecycle.testing import calls_received


def simulated_fleet(n: int = 2) -> list[SimulatedEngine]:
    return [SimulatedEngine(f"e{i}") for i in range(n)]


def untouched(engines: list[SimulatedEngine]) -> bool:
    return all(e.history() == [] for e in engines)


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda e: RolloutServer(EngineGroup("a", e)), "sequence of EngineGroup"),
        (lambda e: RolloutServer([EngineGroup("a", e[:1]), EngineGroup("a", e[1:])]), "'a'"),
        (lambda e: RolloutServer([EngineGroup("a", e)], name=""), "''"),
        (lambda e: RolloutServer(["a"]), "'a'"),
        (lambda e: EngineGroup("a", e, needs_offload="yes"), "'yes'"),
        (lambda e: EngineGroup("a", "engine"), "'engine'"),
        (lambda e: EngineGroup(" a", e), "' a'"),
        (lambda e: EngineGroup("a", [e[0], 3]), "int"),
        (lambda e: LifecycleConfig(release_tags=("kv_cache", "kvcache")), "'kvcache'"),
        (lambda e: LifecycleConfig(deadlines=Deadlines(release=-1)), "-1"),
        (lambda e: LifecycleConfig(deadlines=Deadlines(pause=0)), "'pause'"),
        (lambda e: LifecycleConfig(pause_mode="paused"), "'paused'"),
        (lambda e: HTTPTimeouts(control=0), "control"),
        (lambda e: SGLangHTTPEngine("localhost:30000"), "localhost:30000"),
        (lambda e: SGLangHTTPEngine("ftp://127.0.0.1:30000"), "ftp"),
        (lambda e: SimulatedEngine("x", token_latency=-0.1), "-0.1"),
    ],
)
def test_bad_construction_names_the_value(
    build: Callable[[list[SimulatedEngine]], Any], needle: str
) -> None:
    engines = simulated_fleet()
    with pytest.raises(InvalidArgument) as err:
        build(engines)  # type: ignore[no-untyped-call]
    assert needle in str(err.value)
    assert untouched(engines)


async def test_bad_call_arguments_are_refused_before_any_engine_is_touched() -> None:
    engines = simulated_fleet()
    group = EngineGroup("actor", engines)
    server = RolloutServer([group])
    with pytest.raises(InvalidArgument, match="'weights_restored!'"):
        server.on("weights_restored!", lambda event: None)
    with pytest.raises(InvalidArgument, match="callable"):
        server.on("released", "not a hook")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="callable"):
        await server.update_weights("not callable")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="''"):
        await server.update_weights(lambda update: None, version="")
    with pytest.raises(InvalidArgument, match="callable"):
        await server.recover("not callable")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="needs a factory"):
        await server.recover(None)
    with pytest.raises(InvalidArgument, match="'kv'"):
        group.release_memory(["kv"])
    with pytest.raises(InvalidArgument, match="empty"):
        group.resume_memory([])
    assert server.state is ServerState.SERVING
    assert untouched(engines)


def garbage_server(request: httpx.Request) -> httpx.Response:
    """An SGLang lookalike that answers pause with something that is not JSON at all."""
    if request.url.path == "/pause_generation":
        return httpx.Response(200, content=b"\x00\xff<html>oops", headers={"content-type": "x"})
    if request.url.path == "/server_info":
        return httpx.Response(200, json=["not", "a", "dict"])
    return httpx.Response(200, text=json.dumps({"status": "ok"}))


async def test_an_engine_that_answers_garbage_fails_the_phase_and_is_named() -> None:
    good = SimulatedEngine("good")
    bad = SGLangHTTPEngine(
        "http://127.0.0.1:9", transport=httpx.MockTransport(garbage_server), retries=0
    )
    server = RolloutServer([EngineGroup("actor", [good, bad])])
    with pytest.raises(PhaseFailed) as err:
        await server.offload()
    assert err.value.phase == "pause"
    assert err.value.failed_engines == ["actor/1"]
    outcome = err.value.outcomes["actor/1"]
    # its first call reads who it is (/server_info): the garbage refuses the pause there
    assert outcome.outcome is Outcome.REFUSED and "garbage" in outcome.detail
    # Nothing was released anywhere, and the healthy engine serves again.
    ops = [e["op"] for e in calls_received(good.history())]
    assert ops == ["pause_generation", "continue_generation"]
    probe = await server.probe()
    assert probe["actor/1"].outcome is Outcome.ERROR
    await bad.close()
    await good.close()


#: Names and versions that would forge or garble a log line, a metrics key or a state file:
#: control characters (C0, DEL, C1), a format character (a bidirectional override), a line
#: separator, a lone surrogate.
UNPRINTABLE = [
    "a\nb",
    "a\r\nX-Injected: 1",
    "a\tb",
    "a\x00b",
    "\x1b[31mred",
    "a\x7f",
    "a\x85b",
    "a\u2028b",
    "a\u202eb",
    "a\ud800",
    "a\n",
]


async def _push(update: object) -> None:
    return None


@pytest.mark.parametrize("bad", UNPRINTABLE, ids=ascii)
async def test_names_and_versions_with_control_characters_are_refused_naming_them(
    bad: str,
) -> None:
    engines = simulated_fleet()
    with pytest.raises(InvalidArgument) as err:
        EngineGroup(bad, engines)
    assert repr(bad) in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        RolloutServer([EngineGroup("actor", engines)], name=bad)
    assert repr(bad) in str(err.value)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    before = [len(e.history()) for e in engines]
    with pytest.raises(InvalidArgument) as err:
        await server.update_weights(_push, version=bad)
    assert repr(bad) in str(err.value)
    assert [len(e.history()) for e in engines] == before  # nothing was sent
    assert server.state is ServerState.DRAINED


async def test_printable_names_and_versions_still_pass() -> None:
    engines = simulated_fleet()
    server = RolloutServer([EngineGroup("actor critic", engines)], name="rollout (run 7)")
    await server.pause()
    await server.update_weights(_push, version="步骤-3 v1.2+local")
    await server.update_weights(_push, version=" v2 ")  # (surrounding spaces: as before)
    with pytest.raises(InvalidArgument, match="' a'"):
        EngineGroup(" a", engines)  # a group name still has none
    for blank in ("", "   "):
        with pytest.raises(InvalidArgument, match=repr(blank)):
            await server.update_weights(_push, version=blank)
