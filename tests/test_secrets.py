"""The admin key never shows: not in events, logs, output, reprs, errors or Ray's log files."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import ray
from structlog.testing import capture_logs

from rollout_lifecycle import (
    EngineGroup,
    LifecycleError,
    RolloutServer,
    SGLangHTTPEngine,
    Tag,
    sglang_http_factory,
    start_engine_actor,
)
from rollout_lifecycle._standin import StandInServer

KEY = "sk-admin-7f3e9b1c5d2a"


async def failing_run(engines: list[SGLangHTTPEngine], dying: StandInServer) -> list[str]:
    """Drive a cycle that fails in several ways; return the text of every error raised."""
    texts: list[str] = []
    server = RolloutServer([EngineGroup("actor", engines)])
    dying.inject({"path": "/pause_generation", "kind": "status", "status": 502, "count": 1})
    dying.inject({"path": "/release_memory_occupation", "kind": "die"})
    try:
        await server.offload()
    except LifecycleError as exc:
        texts += [str(exc), repr(exc), repr(getattr(exc, "outcomes", None))]
    texts += [repr(server), repr(server.snapshot()), repr(server.snapshot().to_dict())]
    await server.probe()
    for engine in engines:
        texts.append(repr(engine))
        for call in (
            engine.server_info(),
            engine.release_memory_occupation([Tag.KV_CACHE]),
            engine.pause_generation(server.config.pause_mode),
        ):
            try:
                await call
            except LifecycleError as exc:
                texts += [str(exc), repr(exc), repr(exc.args)]
    return texts


async def test_a_failing_run_never_shows_the_admin_key(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    servers = await StandInServer.start_many_async(4, admin_key=KEY)
    engines = [SGLangHTTPEngine(s.url, admin_key=KEY) for s in (servers[0], servers[1], servers[3])]
    wrong = SGLangHTTPEngine(servers[2].url, admin_key="not-" + KEY)
    caplog.set_level(logging.DEBUG)
    try:
        # A server dies under the release (through the stdlib fallback: structlog is not
        # configured), then a wrong key is refused (captured as structlog events).
        texts = await failing_run(engines[:2], servers[1])
        with capture_logs() as events:
            texts += await failing_run([engines[2], wrong], servers[3])
    finally:
        await asyncio.gather(*(e.close() for e in [*engines, wrong]))
        for s in servers:
            s.stop()
    out, err = capfd.readouterr()
    assert events and caplog.records, "the failing run emitted nothing to check"
    joined = "\n".join(texts)
    assert "connection refused" in joined and "401" in joined  # both failures really happened
    for s in servers:
        texts.append(s.stderr_text())
    everything = "\n".join([*texts, repr(events), caplog.text, out, err])
    assert KEY not in everything


async def test_engine_actors_never_write_the_admin_key_to_rays_logs(ray_cluster: None) -> None:
    (server,) = await StandInServer.start_many_async(1, admin_key=KEY)
    actors = [start_engine_actor(sglang_http_factory(server.url, admin_key=KEY))]
    wrong = start_engine_actor(sglang_http_factory(server.url, admin_key="x" + KEY))
    try:
        rollout = RolloutServer([EngineGroup("actor", [*actors, wrong])])
        with pytest.raises(LifecycleError) as err:
            await asyncio.wait_for(rollout.offload(), timeout=60)
        assert KEY not in str(err.value) and KEY not in repr(rollout.snapshot())
        assert KEY not in repr(sglang_http_factory(server.url, admin_key=KEY))
    finally:
        for actor in [*actors, wrong]:
            ray.kill(actor)
        server.stop()
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert files, "no Ray log files to check"
    leaks = [str(p) for p in files if KEY.encode() in p.read_bytes()]
    assert leaks == []
