"""HTTP faults between the client and stand-in SGLang servers on loopback.

Faults are injected in the stand-in (``/_standin/faults``): a proxy's 502/503, a dropped
connection before the engine is touched (``drop``) or after the call ran (``drop_after``), a
delay, and a sudden death. Calls that are safe to repeat must ride them out; release and resume
must never be repeated, and the ledger must say what is known (and what is not) afterwards.

An answer later than a phase's deadline is staged by holding the call on its way to the server
(``_Held``) until the test lets it go, not by a fixed delay: it is late whatever the machine's
speed, so the engines that must answer in time can have deadlines a loaded machine meets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_lifecycle import (
    Deadlines,
    EngineDead,
    EngineGroup,
    EngineOutcome,
    EngineRejected,
    EngineUnreachable,
    HTTPTimeouts,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleConfig,
    Outcome,
    PauseMode,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    Tag,
    WeightUpdate,
)
from rollout_lifecycle.backends.http.transport import KEEPALIVE_EXPIRY_S
from rollout_lifecycle.core.runner import PhaseSettled
from rollout_lifecycle.testing import until
from rollout_lifecycle.testing.standin import DEATH_EXIT_CODE, FAULTS_PATH, StandInServer

ADMIN_KEY = "fault-admin-key-4d1e"
API_KEY = "fault-api-key-7a20"
ALL = ["weights", "kv_cache", "cuda_graph"]
TAGS = [Tag.WEIGHTS, Tag.KV_CACHE, Tag.CUDA_GRAPH]
#: Client timeouts short enough that a wrong wait fails the test quickly.
TIMEOUTS = HTTPTimeouts(
    connect=2.0, control=5.0, memory=5.0, weights=5.0, probe=3.0, generate=30.0, flush_margin=2.0
)
DEADLINES = Deadlines(
    pause=5.0, flush=5.0, release=5.0, resume=5.0, continue_=5.0, weight_update=10.0, probe=3.0
)
#: Bound of any one lifecycle call in these tests: nothing may hang.
BOUND = 15.0

Start = Callable[..., Awaitable[list[StandInServer]]]


def engine_for(
    server: StandInServer, retries: int = 3, transport: httpx.AsyncBaseTransport | None = None
) -> SGLangHTTPEngine:
    return SGLangHTTPEngine(
        server.url,
        admin_key=ADMIN_KEY,
        api_key=API_KEY,
        timeouts=TIMEOUTS,
        retries=retries,
        retry_backoff=0.01,
        label=server.label,
        # The attach check's GET /server_info would be one more entry in every history here.
        check_version=False,
        transport=transport,
    )


def ops(history: list[dict[str, Any]], op: str) -> list[dict[str, Any]]:
    return [e for e in history if e["op"] == op]


def injected(history: list[dict[str, Any]], path: str, kind: str | None = None) -> int:
    return sum(
        1
        for e in history
        if e["op"] == "fault"
        and e["path"] == path
        and (kind is None or e["kind"] == kind)
        and e["outcome"] == "injected"
    )


def history_file(server: StandInServer) -> list[dict[str, Any]]:
    assert server.history_file is not None
    text = Path(server.history_file).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


async def history(server: StandInServer) -> list[dict[str, Any]]:
    return await asyncio.to_thread(server.history)


async def info(server: StandInServer) -> dict[str, Any]:
    """What the stand-in's engine keeps to itself (paused, released tags): SGLang's own
    /server_info publishes none of it."""
    return await asyncio.to_thread(server.state)


async def drained(*servers: StandInServer) -> None:
    """Every lifecycle call that reached ``servers`` has returned, so their histories are
    complete: an absence read from them afterwards is one (not a call still being handled)."""
    for server in servers:
        await until(lambda s=server: not s.state()["in_flight"], what=f"{server.label} to drain")


async def submitted_at_least(servers: list[StandInServer], n: int) -> bool:
    """Whether every one of ``servers`` has received ``n`` generate requests so far."""
    counts = await asyncio.gather(*(asyncio.to_thread(s.stats) for s in servers))
    return all(c["submitted"] >= n for c in counts)


async def wait_for_op(server: StandInServer, op: str, count: int = 1, timeout: float = 5.0) -> None:
    """Wait (bounded) until ``count`` ``op`` entries are in the server's history."""
    deadline = time.monotonic() + timeout
    while len(ops(await history(server), op)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.label}: no {count} x {op} within {timeout}s")
        await asyncio.sleep(0.05)


#: Fresh servers are started this many at a time, when a test needs more (a stand-in spends
#: most of its start importing: on an idle machine a batch takes little longer than one). Not
#: the module's 24 at once: under six CPU hogs that took 110 s to over 120 s, the timeout of the
#: test that set the pool up; a batch of six takes about 20 s there.
BATCH = 6


class _Pool:
    """Fresh servers for the tests of this module, started a batch at a time."""

    def __init__(self, where: Path) -> None:
        self._where = where
        self._ready: list[StandInServer] = []
        #: Every server started (or being started): all are stopped when the module ends.
        self.started: list[StandInServer] = []

    def take(self, n: int) -> list[StandInServer]:
        """``n`` fresh servers (never used by another test), ready."""
        if len(self._ready) < n:
            batch = [self._new() for _ in range(max(BATCH, n - len(self._ready)))]
            StandInServer.start_all(batch)
            self._ready.extend(batch)
        taken, self._ready = self._ready[:n], self._ready[n:]
        return taken

    def _new(self) -> StandInServer:
        i = len(self.started)
        server = StandInServer(
            label=f"pool-{i}",
            admin_key=ADMIN_KEY,
            api_key=API_KEY,
            token_latency=0.002,
            history_file=self._where / f"pool-{i}.jsonl",
        )
        self.started.append(server)
        return server


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Pool]:
    """The servers this module uses; each test takes fresh ones."""
    servers = _Pool(tmp_path_factory.mktemp("fault-history"))
    yield servers
    for server in servers.started:
        server.stop()


@pytest.fixture(scope="module")
def shared(pool: _Pool) -> StandInServer:
    """One server for calls that leave it serving (retries, faults the engine never sees)."""
    return pool.take(1)[0]


@pytest.fixture
def plain(shared: StandInServer) -> Iterator[StandInServer]:
    shared.clear_faults()
    yield shared
    shared.clear_faults()


@pytest.fixture
async def standins(pool: _Pool) -> AsyncIterator[Start]:
    """Take ``n`` fresh servers (never used by another test); stopped when the test ends."""
    taken: list[StandInServer] = []

    async def take(n: int) -> list[StandInServer]:
        servers = await asyncio.to_thread(pool.take, n)
        taken.extend(servers)
        return servers

    yield take
    for server in taken:
        server.stop(2.0)


Make = Callable[..., list[SGLangHTTPEngine]]


@pytest.fixture
async def engines() -> AsyncIterator[Make]:
    """``make(servers)``: an engine per server, closed when the test ends; ``transports``
    (one per server, None for the default) gives the link to each."""
    made: list[SGLangHTTPEngine] = []

    def make(
        servers: list[StandInServer],
        transports: list[httpx.AsyncBaseTransport | None] | None = None,
    ) -> list[SGLangHTTPEngine]:
        links = transports if transports is not None else [None] * len(servers)
        out = [engine_for(s, transport=t) for s, t in zip(servers, links, strict=True)]
        made.extend(out)
        return out

    yield make
    await asyncio.gather(*(e.close() for e in made))


def rollout(engines: list[SGLangHTTPEngine], **deadlines: float) -> RolloutServer:
    config = LifecycleConfig(
        pause_mode=PauseMode.RETRACT, deadlines=dataclasses.replace(DEADLINES, **deadlines)
    )
    return RolloutServer([EngineGroup("actor", engines)], config)


# --------------------------------------------------------------------------------- the facility


@pytest.mark.parametrize(
    ("rule", "named"),
    [
        ({"path": "/pause", "kind": "drop"}, "'/pause'"),
        ({"path": "/_standin/faults", "kind": "drop"}, "'/_standin/faults'"),
        ({"path": "/flush_cache", "kind": "explode"}, "'explode'"),
        ({"path": "/flush_cache", "kind": "delay", "seconds": -1}, "-1"),
        ({"path": "/flush_cache", "kind": "delay"}, "None"),
        ({"path": "/flush_cache", "kind": "delay", "seconds": "1"}, "'1'"),
        ({"path": "/flush_cache", "kind": "status", "status": 200}, "200"),
        ({"path": "/flush_cache", "kind": "status", "status": "502"}, "'502'"),
        ({"path": "/flush_cache", "kind": "drop", "count": 0}, "0"),
        ({"path": "/flush_cache", "kind": "drop", "count": -2}, "-2"),
        ({"path": "/flush_cache", "kind": "drop", "secs": 1}, "'secs'"),
        ({"path": "/flush_cache", "kind": "drop", "status": 502}, "'drop'"),
        ({"path": "/flush_cache", "kind": "drop", "seconds": 1}, "'drop'"),
    ],
)
def test_a_bad_rule_is_a_400_naming_the_bad_value_and_adds_nothing(
    plain: StandInServer, rule: dict[str, Any], named: str
) -> None:
    good = {"path": "/pause_generation", "kind": "drop"}
    with httpx.Client(base_url=plain.url, timeout=5.0) as client:
        answer = client.post(
            FAULTS_PATH, json=[good, rule], headers={"Authorization": f"Bearer {API_KEY}"}
        )
    assert answer.status_code == 400
    body = answer.json()
    assert body["object"] == "error" and body["code"] == 400
    assert "rule #1" in body["message"] and named in body["message"]
    with pytest.raises(InvalidArgument, match="rule #0"):
        plain.inject(rule)
    assert plain.faults() == []  # all or nothing: the good rule was not added either


def test_rules_count_down_list_and_clear(plain: StandInServer) -> None:
    api = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=plain.url, timeout=5.0, headers=api) as client:
        wrapped = {"faults": [{"path": "/model_info", "kind": "status", "count": 2}]}
        assert client.post(FAULTS_PATH, json=wrapped).status_code == 200
        assert client.post(FAULTS_PATH, json={"faults": []}).status_code == 200
        for body in ({"faults": [], "extra": 1}, {"path": "/model_info", "kind": "drop"}, 7):
            assert client.post(FAULTS_PATH, json=body).status_code == 400, body
        assert client.post(FAULTS_PATH, content=b"{not json").status_code == 400
    rules = plain.inject({"path": "/model_info", "kind": "delay", "seconds": 0.05, "count": -1})
    assert rules == [
        {"path": "/model_info", "kind": "status", "count": 2, "status": 502, "applied": 0},
        {"path": "/model_info", "kind": "delay", "count": -1, "seconds": 0.05, "applied": 0},
    ]
    with httpx.Client(base_url=plain.url, timeout=5.0, headers=api) as client:
        statuses = [client.get("/model_info").status_code for _ in range(4)]
    assert statuses == [502, 502, 200, 200]  # first matching rule first; spent rules leave
    assert plain.faults() == [
        {"path": "/model_info", "kind": "delay", "count": -1, "seconds": 0.05, "applied": 2}
    ]
    plain.clear_faults()
    assert plain.faults() == []


def test_the_faults_route_is_at_the_level_of_the_other_standin_routes(
    plain: StandInServer,
) -> None:
    with httpx.Client(base_url=plain.url, timeout=5.0) as client:
        for headers in ({}, {"Authorization": f"Bearer {ADMIN_KEY}"}):
            # /_standin/* is at SGLang's normal level: the api key, not the admin key.
            assert client.get(FAULTS_PATH, headers=headers).status_code == 401
            assert client.get("/_standin/history", headers=headers).status_code == 401
        assert client.get(FAULTS_PATH, headers={"Authorization": f"Bearer {API_KEY}"}).is_success


def test_each_kind_as_a_raw_http_client_sees_it(plain: StandInServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    before = len(plain.history())
    with httpx.Client(base_url=plain.url, timeout=5.0, headers=admin) as client:
        plain.inject({"path": "/pause_generation", "kind": "status", "status": 503})
        answer = client.post("/pause_generation", json={"mode": "retract"})
        assert answer.status_code == 503 and "503 Service Unavailable" in answer.text
        assert answer.headers["content-type"].startswith("text/html")

        plain.inject({"path": "/pause_generation", "kind": "drop", "count": 5})
        for _ in range(5):  # the same transport error every time, never an answer
            with pytest.raises(httpx.RemoteProtocolError):
                client.post("/pause_generation", json={"mode": "retract"})
        assert plain.state()["paused"] is False  # untouched

        plain.inject({"path": "/pause_generation", "kind": "drop_after"})
        with pytest.raises(httpx.RemoteProtocolError):
            client.post("/pause_generation", json={"mode": "retract"})
        assert plain.state()["paused"] is True  # it ran

        plain.inject({"path": "/continue_generation", "kind": "delay", "seconds": 0.3})
        started = time.monotonic()
        assert client.post("/continue_generation", json={}).is_success
        assert time.monotonic() - started >= 0.3
    entries = plain.history()[before:]
    kinds = [(e["kind"], e["path"]) for e in entries if e["op"] == "fault"]
    assert kinds == [
        ("status", "/pause_generation"),
        *[("drop", "/pause_generation")] * 5,
        ("drop_after", "/pause_generation"),
        ("delay", "/continue_generation"),
    ]
    faults = [e for e in entries if e["op"] == "fault"]
    assert all(e["outcome"] == "injected" and e["end"] >= e["start"] for e in faults)
    assert [e["mode"] for e in ops(entries, "pause_generation")] == ["retract"]
    assert len(ops(entries, "continue_generation")) == 1
    assert plain.alive() and "Traceback" not in plain.stderr_text()


async def test_die_exits_70_like_a_fatal_misuse_and_logs_fault_then_death(
    standins: Start,
) -> None:
    (server,) = await standins(1)
    server.inject({"path": "/flush_cache", "kind": "die"})
    async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as client:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/flush_cache", headers=headers)
    assert await asyncio.to_thread(server.wait_dead, 5.0)
    assert server.returncode == DEATH_EXIT_CODE
    assert "injected fault 'die' on POST /flush_cache" in server.stderr_text()
    lines = history_file(server)
    assert [e["op"] for e in lines] == ["fault", "server_died"]
    assert lines[0]["kind"] == "die" and lines[0]["outcome"] == "injected"
    assert lines[1]["outcome"] == "fatal"


# --------------------------------------------------------------------------------- the client


SAFE_CALLS: dict[str, tuple[str, Callable[[SGLangHTTPEngine], Awaitable[Any]]]] = {
    "/pause_generation": ("pause_generation", lambda e: e.pause_generation(PauseMode.RETRACT)),
    "/flush_cache": ("flush_cache", lambda e: e.flush_cache(0.5)),
    "/continue_generation": ("continue_generation", lambda e: e.continue_generation()),
    "/server_info": ("server_info", lambda e: e.server_info()),
}
FAULTS: dict[str, dict[str, Any]] = {
    "502": {"kind": "status", "status": 502},
    "503": {"kind": "status", "status": 503},
    "drop": {"kind": "drop"},
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("path", list(SAFE_CALLS))
async def test_safe_calls_ride_out_proxy_errors_and_drops_and_run_once(
    plain: StandInServer, path: str, fault: str
) -> None:
    op, call = SAFE_CALLS[path]
    engine = engine_for(plain)
    try:
        before = len(await history(plain))
        await asyncio.to_thread(plain.inject, {"path": path, "count": 2, **FAULTS[fault]})
        await asyncio.wait_for(call(engine), BOUND)
        entries = (await history(plain))[before:]
    finally:
        await engine.continue_generation()
        await engine.close()
    assert injected(entries, path, FAULTS[fault]["kind"]) == 2  # the server saw the retries
    assert len(ops(entries, op)) == 1  # and the call ran on the engine exactly once
    assert plain.faults() == []


@pytest.mark.parametrize("path", ["/pause_generation", "/flush_cache", "/continue_generation"])
async def test_a_drop_after_the_call_ran_is_retried_because_repeating_it_is_harmless(
    plain: StandInServer, path: str
) -> None:
    op, call = SAFE_CALLS[path]
    engine = engine_for(plain)
    try:
        before = len(await history(plain))
        await asyncio.to_thread(plain.inject, {"path": path, "kind": "drop_after"})
        await asyncio.wait_for(call(engine), BOUND)
        entries = (await history(plain))[before:]
    finally:
        await engine.continue_generation()
        await engine.close()
    assert injected(entries, path, "drop_after") == 1
    assert [e["outcome"] for e in ops(entries, op)] == ["ok", "ok"]


async def test_retries_are_bounded_and_the_last_failure_is_raised(plain: StandInServer) -> None:
    engine = engine_for(plain, retries=2)
    try:
        before = len(await history(plain))
        plain.inject({"path": "/pause_generation", "kind": "status", "status": 503, "count": -1})
        with pytest.raises(EngineRejected) as rejected:
            await asyncio.wait_for(engine.pause_generation(PauseMode.RETRACT), BOUND)
        assert rejected.value.status == 503 and "503 Service Unavailable" in str(rejected.value)
        plain.clear_faults()
        plain.inject({"path": "/continue_generation", "kind": "drop", "count": -1})
        with pytest.raises(EngineUnreachable, match="RemoteProtocolError"):
            await asyncio.wait_for(engine.continue_generation(), BOUND)
        plain.clear_faults()
        entries = (await history(plain))[before:]
    finally:
        await engine.close()
    assert injected(entries, "/pause_generation") == 3  # 1 + 2 retries, then it gave up
    assert injected(entries, "/continue_generation") == 3
    assert not ops(entries, "pause_generation") and not ops(entries, "continue_generation")


UNSAFE_CALLS: dict[str, Callable[[SGLangHTTPEngine], Awaitable[Any]]] = {
    "/release_memory_occupation": lambda e: e.release_memory_occupation([Tag.KV_CACHE]),
    "/resume_memory_occupation": lambda e: e.resume_memory_occupation([Tag.KV_CACHE]),
    "/begin_weight_update": lambda e: e.begin_weight_update(),
    "/update_weights_from_disk": lambda e: e.update_weights_from_disk(
        "/ckpt/x", weight_version="x", flush_cache=False, abort_all_requests=False
    ),
    "/update_weight_version": lambda e: e.update_weight_version("x", abort_all_requests=False),
    "/generate": lambda e: e.generate({"input_ids": [1], "sampling_params": {}}),
}


@pytest.mark.parametrize("fault", ["502", "drop"])
@pytest.mark.parametrize("path", list(UNSAFE_CALLS))
async def test_calls_that_must_not_repeat_are_sent_once_whatever_the_fault(
    plain: StandInServer, path: str, fault: str
) -> None:
    engine = engine_for(plain)
    try:
        before = len(await history(plain))
        plain.inject({"path": path, "count": -1, **FAULTS[fault]})
        # A 502 on a call that must not repeat leaves its effect unknown, as a drop does.
        with pytest.raises(EngineUnreachable):
            await asyncio.wait_for(UNSAFE_CALLS[path](engine), BOUND)
        plain.clear_faults()
        entries = (await history(plain))[before:]
    finally:
        await engine.close()
    assert injected(entries, path) == 1  # one attempt, no retry
    assert [e for e in entries if e["op"] != "fault"] == []  # the engine never saw it
    assert plain.alive()


# --------------------------------------------------------------------------------- the server


async def test_offload_and_onload_ride_out_faults_on_every_safe_call(
    standins: Start, engines: Callable[[list[StandInServer]], list[SGLangHTTPEngine]]
) -> None:
    servers = await standins(2)
    a, b = servers
    a.inject(
        {"path": "/pause_generation", "kind": "status", "status": 502, "count": 2},
        {"path": "/flush_cache", "kind": "drop_after"},
        {"path": "/server_info", "kind": "drop"},
        {"path": "/continue_generation", "kind": "status", "status": 503},
    )
    b.inject(
        {"path": "/pause_generation", "kind": "drop"},
        {"path": "/flush_cache", "kind": "status", "status": 503, "count": 3},
        {"path": "/server_info", "kind": "status", "status": 502},
        {"path": "/continue_generation", "kind": "drop_after"},
    )
    server = rollout(engines(servers))
    await asyncio.wait_for(server.offload(), BOUND)
    assert server.state is ServerState.RELEASED
    probed = await asyncio.wait_for(server.probe(), BOUND)
    assert all(o.ok for o in probed.values())
    await asyncio.wait_for(server.onload(), BOUND)
    assert server.state is ServerState.SERVING
    histories = [await history(s) for s in servers]
    for s in servers:
        assert s.faults() == []  # every injected fault was met
        entries = histories[servers.index(s)]
        assert len(ops(entries, "release_memory_occupation")) == 1
        assert [e["tags"] for e in ops(entries, "resume_memory_occupation")] == [
            ["weights"],
            ["kv_cache", "cuda_graph"],
        ]
        assert all(e["outcome"] == "ok" for e in entries if e["op"] != "fault")
    assert injected(histories[0], "/pause_generation") == 2
    assert len(ops(histories[0], "pause_generation")) == 1
    assert len(ops(histories[0], "flush_cache")) == 2  # it ran, was dropped, ran again
    assert len(ops(histories[1], "flush_cache")) == 1
    assert len(ops(histories[1], "continue_generation")) == 2
    snap = server.snapshot().engines()
    assert all(
        e.alive and not e.paused and not e.released and not e.uncertain for e in snap.values()
    )


async def test_release_answered_502_fails_the_phase_is_not_repeated_and_is_uncertain(
    standins: Start, engines: Callable[[list[StandInServer]], list[SGLangHTTPEngine]]
) -> None:
    servers = await standins(2)
    servers[0].inject({"path": "/release_memory_occupation", "kind": "status", "status": 502})
    server = rollout(engines(servers))
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    assert err.value.phase == "release" and err.value.failed_engines == ["actor/0"]
    outcome = err.value.outcomes["actor/0"]
    # A gateway error does not say the release did not happen: the effect is unknown.
    assert outcome.outcome is Outcome.UNREACHABLE and "502" in outcome.detail
    assert err.value.outcomes["actor/1"].ok
    assert server.state is ServerState.FAILED
    first, second = [await history(s) for s in servers]
    assert ops(first, "release_memory_occupation") == []  # here the proxy kept it: nothing landed
    assert injected(first, "/release_memory_occupation", "status") == 1
    assert len(ops(second, "release_memory_occupation")) == 1
    assert all(s.alive() for s in servers)
    assert (await info(servers[0]))["released_tags"] == []
    snap = server.snapshot().engines()
    assert snap["actor/0"].released == () and snap["actor/0"].uncertain == tuple(ALL)
    assert snap["actor/1"].released == tuple(ALL)
    with pytest.raises(IllegalEngineOp, match="unknown state"):
        server.groups[0].release_memory(list(ALL))  # so no second release is ever sent


async def test_release_dropped_before_the_engine_fails_unreachable_and_is_uncertain(
    standins: Start, engines: Callable[[list[StandInServer]], list[SGLangHTTPEngine]]
) -> None:
    servers = await standins(2)
    servers[1].inject({"path": "/release_memory_occupation", "kind": "drop"})
    server = rollout(engines(servers))
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    assert err.value.phase == "release" and err.value.failed_engines == ["actor/1"]
    assert err.value.outcomes["actor/1"].outcome is Outcome.UNREACHABLE
    assert "RemoteProtocolError" in err.value.outcomes["actor/1"].detail
    entries = await history(servers[1])
    assert ops(entries, "release_memory_occupation") == []  # it never reached the engine
    assert injected(entries, "/release_memory_occupation", "drop") == 1
    assert servers[1].alive() and (await info(servers[1]))["released_tags"] == []
    # The client cannot tell a drop before the call from one after it: unknown, so guarded.
    snap = server.snapshot().engines()
    assert snap["actor/1"].released == () and snap["actor/1"].uncertain == tuple(ALL)
    assert snap["actor/0"].released == tuple(ALL)
    record = server.groups[0].records[1]
    with pytest.raises(IllegalEngineOp, match="unknown state"):
        record.check_release(TAGS)
    with pytest.raises(IllegalEngineOp, match="unknown state"):
        record.check_resume(TAGS)
    with pytest.raises(IllegalEngineOp):
        server.groups[0].release_memory(TAGS)  # nothing is sent to either engine
    await drained(*servers)
    assert ops(await history(servers[1]), "release_memory_occupation") == []
    assert len(ops(await history(servers[0]), "release_memory_occupation")) == 1


async def test_release_that_landed_before_the_drop_is_uncertain_and_never_sent_again(
    standins: Start, engines: Callable[[list[StandInServer]], list[SGLangHTTPEngine]]
) -> None:
    servers = await standins(2)
    target = servers[0]
    target.inject({"path": "/release_memory_occupation", "kind": "drop_after"})
    server = rollout(engines(servers))
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    assert err.value.phase == "release" and err.value.failed_engines == ["actor/0"]
    assert err.value.outcomes["actor/0"].outcome is Outcome.UNREACHABLE
    # The server did release: it is the client that cannot know.
    assert sorted((await info(target))["released_tags"]) == sorted(ALL)
    releases = ops(await history(target), "release_memory_occupation")
    assert [(e["tags"], e["outcome"]) for e in releases] == [(ALL, "ok")]
    snap = server.snapshot().engines()
    assert snap["actor/0"].released == () and snap["actor/0"].uncertain == tuple(ALL)
    assert snap["actor/1"].released == tuple(ALL) and snap["actor/1"].uncertain == ()
    group = server.groups[0]
    with pytest.raises(IllegalEngineOp, match="unknown state"):
        group.release_memory(TAGS)
    with pytest.raises(IllegalEngineOp, match="unknown state"):
        group.resume_memory(TAGS)
    with pytest.raises(IllegalTransition):
        await server.offload()  # from failed: refused before the guard is even asked
    with pytest.raises(IllegalTransition):
        await server.reset()  # records that hold an unknown tag imply no state
    await drained(*servers)
    assert len(ops(await history(target), "release_memory_occupation")) == 1
    assert target.alive() and servers[1].alive()


def passthrough() -> httpx.AsyncHTTPTransport:
    """The link a test's intercepting transport forwards to, pooled as the library's own link
    is: an idle connection is let go well before the server closes it (``KEEPALIVE_EXPIRY_S``
    against its 5 s keep-alive). With httpx's default (5 s, the server's own) a call held about
    5 s met a connection the server was closing, and went out again on a new one."""
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))


class _Held(httpx.AsyncBaseTransport):
    """The link to a server, holding the first call to ``path`` on its way until the test
    lets it go (``go``): the engine's answer to it comes as late as the test says, whatever the
    machine's speed. Every other call goes through at once."""

    def __init__(self, path: str) -> None:
        self._inner = passthrough()
        self._path = path
        #: Set once the held call was sent by the client (it waits here).
        self.sent = asyncio.Event()
        #: Set by the test: the held call goes on to the server.
        self.go = asyncio.Event()
        #: When a call to ``path`` was first answered (``time.monotonic()``): the held one's
        #: answer, or a repeat's if the held one failed on its way and was tried again.
        self.answered_at: float | None = None

    @property
    def holding(self) -> bool:
        """The call was sent and is held: the server has not seen it, so no answer can come."""
        return self.sent.is_set() and not self.go.is_set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != self._path:
            return await self._inner.handle_async_request(request)
        if not self.sent.is_set():
            self.sent.set()
            await self.go.wait()
        response = await self._inner.handle_async_request(request)
        if self.answered_at is None:
            self.answered_at = time.monotonic()
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def settled_while_held(server: RolloutServer, phase: str, held: _Held) -> list[bool]:
    """For each time ``phase`` settles: whether ``held`` was still holding its call then.
    Settled while held, the phase ended on its deadline: no answer could have come."""
    seen: list[bool] = []

    def settled(event: PhaseSettled) -> None:
        if event.result.phase == phase:
            seen.append(held.holding)

    server.bus.subscribe(PhaseSettled, settled)
    return seen


@pytest.mark.parametrize(
    ("path", "phase", "deadline"),
    [
        # Each phase waits 5 s (a flush's wait is its deadline plus the probe's): ample for the
        # engine that answers, a stand-in on loopback that answers in milliseconds, on a loaded
        # machine too (at 0.3 s it was named with the slow one under load).
        ("/pause_generation", "pause", {"pause": 5.0}),
        ("/flush_cache", "flush", {"flush": 2.5, "probe": 2.5}),
        ("/release_memory_occupation", "release", {"release": 5.0}),
    ],
)
async def test_a_delay_past_the_deadline_fails_the_phase_on_time_naming_the_engine(
    standins: Start,
    engines: Make,
    path: str,
    phase: str,
    deadline: dict[str, float],
) -> None:
    limit = sum(deadline.values())  # how long the phase waits for an answer
    servers = await standins(2)
    slow = servers[1]
    # The slow engine's call is held until the test lets it go: past the phase's deadline
    # however fast the machine. A late pause or flush is let go as soon as its phase settled
    # (the continue after a failed drain may wait for it); a late release only once the offload
    # failed (nothing waits for it: an offload that waited would never end).
    held = _Held(path)
    server = rollout(engines(servers, [None, held]), **deadline)
    settled = settled_while_held(server, phase, held)
    if phase != "release":  # (subscribed after the check: subscribers run in order)
        server.bus.subscribe(
            PhaseSettled, lambda e: held.go.set() if e.result.phase == phase else None
        )
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    held_after = held.holding  # still held once the offload had failed
    held.go.set()
    assert err.value.phase == phase and err.value.failed_engines == ["actor/1"]
    outcome = err.value.outcomes["actor/1"]
    assert outcome.outcome is Outcome.TIMED_OUT and "no answer within" in outcome.detail
    # Timed out by the phase's deadline, not by the answer: the call was still held when the
    # phase settled, so no answer could have come.
    assert limit <= outcome.duration_s
    assert settled == [True]
    assert err.value.outcomes["actor/0"].ok
    assert server.state is ServerState.FAILED
    snap = server.snapshot().engines()
    if phase == "release":
        # The offload failed with the release still held: it did not wait for the answer.
        assert held_after
        # The call may land (it will): neither a release nor a resume of it is safe now.
        assert snap["actor/1"].uncertain == tuple(ALL)
        await wait_for_op(slow, "release_memory_occupation", timeout=BOUND)
        assert sorted((await info(slow))["released_tags"]) == sorted(ALL)
    else:
        # After a failed drain the engines are continued. A late pause would overtake the
        # continue, so the continue waits for it to land (it was let go when its phase
        # settled); a late flush does not endanger a continue, so only a pause's order is fixed.
        # Both land in the end.
        await wait_for_op(slow, phase_op(phase), timeout=BOUND)
        await drained(*servers)
        entries = await history(slow)
        order = [e["op"] for e in entries if e["op"] in (phase_op(phase), "continue_generation")]
        if phase == "pause":
            # The continue was sent once the late pause had been answered, not just reached
            # the server first.
            continues = [
                s.start
                for s in server.timeline.spans("engine_call")
                if s.engine == "actor/1" and s.op == "continue_generation"
            ]
            assert held.answered_at is not None and len(continues) == 1
            assert continues[0] >= held.answered_at
            assert order == [phase_op(phase), "continue_generation"]
        else:
            assert sorted(order) == sorted([phase_op(phase), "continue_generation"])
        assert not (await info(slow))["paused"] and not snap["actor/1"].paused
        for s in servers:
            assert ops(await history(s), "release_memory_occupation") == []
    assert slow.alive() and servers[0].alive()


def phase_op(phase: str) -> str:
    return {"pause": "pause_generation", "flush": "flush_cache"}.get(
        phase, "release_memory_occupation"
    )


async def test_a_pause_later_than_the_continue_deadline_is_still_reflected_in_the_snapshot(
    standins: Start, engines: Make
) -> None:
    (slow,) = await standins(1)
    # The pause is held until the offload has failed: later than its own deadline and than
    # the continue's wait for it, however fast the machine. The continue's deadline is the
    # generous one of DEADLINES: recover() below must have its continue answered in time.
    held = _Held("/pause_generation")
    server = rollout(engines([slow], [held]), pause=0.3)
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    assert err.value.outcomes["actor/0"].outcome is Outcome.TIMED_OUT
    assert held.holding  # the offload gave up on the pause: it still has not reached the server
    held.go.set()
    await wait_for_op(slow, "pause_generation", timeout=BOUND)
    await drained(slow)
    entries = await history(slow)
    order = [e["op"] for e in entries if e["op"] in ("pause_generation", "continue_generation")]
    assert order == ["pause_generation"]  # no continue was sent to be overtaken
    really_paused = (await info(slow))["paused"]
    assert really_paused is True
    # Invariant 7: the snapshot says exactly which engine is paused.
    assert server.snapshot().engines()["actor/0"].paused is really_paused
    # recover() continues it once its pause has landed, and the server serves again.
    await asyncio.wait_for(server.recover(lambda engine_id: None), BOUND)
    assert server.state is ServerState.SERVING
    assert (await info(slow))["paused"] is False


class _GatewayTimeout(httpx.AsyncBaseTransport):
    """A reverse proxy that forwards every call, then answers 504 for the release (it gave up
    waiting for the upstream's answer, which came after all)."""

    def __init__(self) -> None:
        self._inner = passthrough()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.url.path != "/release_memory_occupation":
            return response
        await response.aread()
        await response.aclose()
        return httpx.Response(504, text="<html><title>504 Gateway Time-out</title></html>")

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_gateway_504_on_release_leaves_the_tags_uncertain(standins: Start) -> None:
    (target,) = await standins(1)
    engine = SGLangHTTPEngine(
        target.url,
        admin_key=ADMIN_KEY,
        api_key=API_KEY,
        timeouts=TIMEOUTS,
        retry_backoff=0.01,
        transport=_GatewayTimeout(),
    )
    try:
        server = rollout([engine])
        with pytest.raises(PhaseFailed) as err:
            await asyncio.wait_for(server.offload(), BOUND)
        assert err.value.outcomes["actor/0"].outcome is Outcome.UNREACHABLE  # effect unknown
        assert sorted((await info(target))["released_tags"]) == sorted(ALL)  # yet it released
        snap = server.snapshot().engines()["actor/0"]
        # The ledger must not claim the tags are resident: the next offload would release
        # them again, and a double release kills the server.
        assert snap.uncertain == tuple(ALL)
        with pytest.raises(IllegalEngineOp, match="unknown state"):
            server.groups[0].release_memory(list(ALL))  # never a second release
    finally:
        await engine.close()


async def test_a_server_that_dies_under_release_is_found_dead_and_no_one_is_released_twice(
    standins: Start, engines: Callable[[list[StandInServer]], list[SGLangHTTPEngine]]
) -> None:
    servers = await standins(3)
    victim = servers[1]
    victim.inject({"path": "/release_memory_occupation", "kind": "die"})
    # The release's deadline is far past the offload's bound: an offload that waited for the
    # dead engine's deadline, instead of failing on its dropped connection, would not end in it.
    server = rollout(engines(servers), release=4 * BOUND)
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    assert err.value.phase == "release" and err.value.failed_engines == ["actor/1"]
    assert err.value.outcomes["actor/1"].outcome in (Outcome.UNREACHABLE, Outcome.DEAD)
    assert await asyncio.to_thread(victim.wait_dead, 5.0)
    assert victim.returncode == DEATH_EXIT_CODE
    probed = await asyncio.wait_for(server.probe(), BOUND)
    # Found dead at once, by the look at the engine after its connection dropped (a probe
    # then leaves it out), or else by this probe.
    assert probed.get("actor/1", EngineOutcome(Outcome.DEAD)).outcome is Outcome.DEAD
    assert probed["actor/0"].ok and probed["actor/2"].ok
    snap = server.snapshot().engines()
    assert not snap["actor/1"].alive
    assert snap["actor/0"].released == snap["actor/2"].released == tuple(ALL)
    with pytest.raises(IllegalEngineOp, match="already released"):
        server.groups[0].release_memory(TAGS)
    lines = history_file(victim)
    assert [e["op"] for e in lines[-2:]] == ["fault", "server_died"]
    assert ops(lines, "release_memory_occupation") == []
    for survivor in (servers[0], servers[2]):
        assert survivor.alive()
        assert len(ops(await history(survivor), "release_memory_occupation")) == 1
    fresh = engine_for(victim, retries=0)
    with pytest.raises(EngineDead, match="connection refused"):
        await fresh.server_info()
    await fresh.close()


async def test_colocated_cycles_over_three_servers_with_random_faults_on_safe_calls(
    standins: Start, engines: Callable[[list[StandInServer]], list[SGLangHTTPEngine]]
) -> None:
    servers = await standins(3)
    rng = random.Random(20240611)
    kinds: list[dict[str, Any]] = [
        {"kind": "status", "status": 502},
        {"kind": "status", "status": 503},
        {"kind": "drop"},
        {"kind": "drop_after"},
    ]
    safe_paths = ["/pause_generation", "/flush_cache", "/continue_generation", "/server_info"]
    server = rollout(engines(servers))
    cycles = 3
    total_injected = 0
    async with httpx.AsyncClient(timeout=30.0) as client:
        for cycle in range(cycles):
            for s in servers:
                rules = [
                    {"path": path, **rng.choice(kinds)}
                    for path in safe_paths
                    for _ in range(rng.randint(0, 3))  # at most 3: retries=3 gets through
                ]
                rng.shuffle(rules)
                total_injected += len(rules)
                await asyncio.to_thread(s.inject, *rules)
            traffic = [
                asyncio.ensure_future(
                    client.post(
                        f"{s.url}/generate",
                        json={"input_ids": [cycle, i], "sampling_params": {"max_new_tokens": 40}},
                        headers={"Authorization": f"Bearer {API_KEY}"},
                    )
                )
                for s in servers
                for i in range(2)
            ]
            # The offload comes with this cycle's traffic on every server (a fact, not a sleep).
            await until(
                functools.partial(submitted_at_least, servers, 2 * (cycle + 1)),
                what="every server to receive its requests",
            )
            await asyncio.wait_for(server.offload(), BOUND)
            assert server.state is ServerState.RELEASED
            await asyncio.wait_for(server.probe(), BOUND)
            await asyncio.wait_for(server.onload_weights(), BOUND)

            def push(update: WeightUpdate) -> None:
                assert len(update.engines) == 3

            await asyncio.wait_for(server.update_weights(push, version=f"step-{cycle}"), BOUND)
            await asyncio.wait_for(server.onload_kv(), BOUND)
            assert server.state is ServerState.SERVING
            answers = await asyncio.wait_for(asyncio.gather(*traffic), BOUND)
            finishes = [a.json()["meta_info"]["finish_reason"]["type"] for a in answers]
            assert finishes == ["length"] * len(traffic)  # retract: nothing lost, nothing aborted
    seen = 0
    for s in servers:
        entries = await history(s)
        assert s.alive() and s.faults() == []
        seen += sum(1 for e in entries if e["op"] == "fault")
        releases = ops(entries, "release_memory_occupation")
        assert [e["tags"] for e in releases] == [ALL] * cycles
        resumed = [t for e in ops(entries, "resume_memory_occupation") for t in e["tags"]]
        assert sorted(resumed) == sorted(ALL * cycles)  # each tag once per cycle
        assert all(e["outcome"] == "ok" for e in entries if e["op"] != "fault")
        assert (await info(s))["released_tags"] == []
    assert seen == total_injected > 0
    snap = server.snapshot().engines()
    assert all(
        e.alive and not e.paused and not e.released and not e.uncertain for e in snap.values()
    )
