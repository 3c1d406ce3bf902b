"""The ctl command against stand-in SGLang servers, the diagram command, RolloutServer.adopt."""

from __future__ import annotations

import asyncio
import fcntl
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from rollout_lifecycle import (
    EngineGroup,
    IllegalTransition,
    InvalidArgument,
    LaunchedRouter,
    RolloutServer,
    ServerSnapshot,
    ServerState,
    SimulatedEngine,
    mermaid,
)
from rollout_lifecycle.cli import main
from rollout_lifecycle.cli.ctl import STATE_FORMAT, ExitCode, default_state_path
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.testing import StandInServer, cycle_order_violations, until

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "adm-ctl-4d1f9a7c03"
KEY_VAR = "CTL_TEST_ADMIN_KEY"
ALL = ["weights", "kv_cache", "cuda_graph"]


@pytest.fixture(scope="module")
def servers() -> Iterator[list[StandInServer]]:
    with StandInServer.running(3, admin_key=ADMIN_KEY, token_latency=0.002, seed=3) as servers:
        yield servers


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(KEY_VAR, ADMIN_KEY)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))


def engine_args(servers: list[StandInServer]) -> list[str]:
    return [a for s in servers for a in ("--engine", s.url)] + ["--admin-key-env", KEY_VAR]


class Ctl:
    """Runs ``rollout-lifecycle ctl`` in process (``main(argv)``) and captures its output."""

    def __init__(self, capsys: pytest.CaptureFixture[str], common: list[str]) -> None:
        self.capsys = capsys
        self.common = common
        self.seen = ""  # everything printed so far, to check that no key ever is

    def __call__(self, action: str, *extra: str) -> tuple[int, str, str]:
        code = main(["ctl", action, *self.common, *extra])
        out, err = self.capsys.readouterr()
        self.seen += out + err
        return code, out, err

    def json(self, action: str, *extra: str) -> tuple[int, dict[str, Any]]:
        code, out, _ = self(action, "--json", *extra)
        report: dict[str, Any] = json.loads(out)
        assert report["exit_code"] == code
        return code, report


@pytest.fixture
def ctl(
    servers: list[StandInServer], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Iterator[Ctl]:
    runner = Ctl(capsys, [*engine_args(servers), "--state-file", str(tmp_path / "fleet.json")])
    yield runner
    assert ADMIN_KEY not in runner.seen
    # Every test leaves the shared fleet alive and serving.
    assert all(s.alive() for s in servers)
    assert [ready(s) for s in servers] == [200] * len(servers)


def ready(server: StandInServer) -> int:
    return httpx.get(f"{server.url}/ready", timeout=10).status_code


def memory(server: StandInServer) -> dict[str, int]:
    answer = httpx.get(f"{server.url}/_standin/memory", timeout=10)
    answer.raise_for_status()
    result: dict[str, int] = answer.json()
    return result


def touched(server: StandInServer) -> list[dict[str, Any]]:
    # GET /server_info (ctl's version check before a call, and the read of the engine before
    # each checked call), /ping and /ready read and change nothing.
    return [e for e in server.history() if e["op"] not in ("server_info", "ping", "ready")]


def history_lengths(servers: list[StandInServer]) -> list[int]:
    return [len(touched(s)) for s in servers]


# ------------------------------------------------------------------------------- diagram


def test_diagram_prints_the_machine_diagram_which_is_the_readme_copy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["diagram"]) == 0
    printed = capsys.readouterr().out
    assert printed == mermaid()
    (readme_copy,) = re.findall(
        r"^```mermaid\n(.*?)^```$", (ROOT / "README.md").read_text(), flags=re.S | re.M
    )
    assert printed == readme_copy
    out = tmp_path / "lifecycle.mmd"
    assert main(["diagram", "--out", str(out)]) == 0
    assert out.read_text() == mermaid()
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------- the cycle


def test_offload_status_onload_cycle_drives_every_standin_and_records_the_ledger(
    ctl: Ctl, servers: list[StandInServer], tmp_path: Path
) -> None:
    before = history_lengths(servers)
    code, report = ctl.json("offload")
    assert code == 0 and report["ok"]
    assert (report["previous_state"], report["state"]) == ("serving", "released")
    assert {e["url"] for e in report["engines"]} == {s.url for s in servers}
    assert all(e["released"] == ALL and e["paused"] for e in report["engines"])
    assert report["metrics"]["lifecycle/offload/total_s"] > 0
    assert "lifecycle/offload/release_s" in report["metrics"]
    for server in servers:
        assert memory(server) == {"weights": 0, "kv_cache": 0, "cuda_graph": 0}
    ledger = json.loads((tmp_path / "fleet.json").read_text())
    assert ledger["format"] == STATE_FORMAT
    assert ledger["engines"] == [s.url for s in servers]
    assert ledger["server"]["state"] == "released"

    code, status = ctl.json("status")
    assert code == 0 and status["recorded_state"] == "released"
    for row in status["engines"]:
        assert row["reachable"] and row["ready"] is False and row["ready_status"] == 503
        assert row["recorded"]["released"] == ALL and row["recorded"]["paused"]
        assert row["recorded"]["state"] == "released"
        assert row["agrees"] is True
        # SGLang's memory_usage (weight, kvcache in GB, fixed at load): it cannot show a release.
        assert {"weight", "kvcache"} <= set(row["memory"])
        assert row["weight_version"] == "default"  # SGLang's initial version
    code, out, _ = ctl("status")  # the table
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("ENGINE"))
    assert lines[0].startswith("recorded state: released")
    for server in servers:
        row = next(line for line in lines if server.url in line)
        # Aligned: every column starts where its header does.
        assert row.index(server.url) == header.index("URL")
        assert row[header.index("READY") :].startswith("no (503)")
        assert "weights,kv_cache,cuda_graph" in row

    code, out, _ = ctl("onload-weights")
    assert code == 0
    assert out.splitlines()[0] == "onload-weights: released -> weights_restored (ok)"
    assert "lifecycle/onload_weights/weights_s" in out
    for server in servers:
        held = memory(server)
        assert held["weights"] > 0 and held["kv_cache"] == 0 and held["cuda_graph"] == 0

    code, report = ctl.json("onload-kv")
    assert code == 0 and report["state"] == "serving"
    assert all(not e["paused"] and e["released"] == [] for e in report["engines"])
    for server in servers:
        assert all(v > 0 for v in memory(server).values())

    code, report = ctl.json("resume")  # onload-kv already continued: nothing to do
    assert code == 0 and report["state"] == "serving" and report["previous_state"] == "serving"
    assert set(report["metrics"]) == {"lifecycle/resume/total_s"}

    histories = {s.url: touched(s)[n:] for s, n in zip(servers, before, strict=True)}
    assert cycle_order_violations(histories) == []
    for history in histories.values():
        ops = [e["op"] for e in history]
        assert ops.count("release_memory_occupation") == 1
        assert ops.count("continue_generation") == 1
        assert "health" not in ops and "health_generate" not in ops


# ------------------------------------------------------------------------------- refusals


def test_a_wait_offload_lets_the_request_in_flight_end_within_the_pause_deadline(
    ctl: Ctl, servers: list[StandInServer]
) -> None:
    body = {"input_ids": [4, 4], "sampling_params": {"max_new_tokens": 400}}
    answers: list[dict[str, Any]] = []
    sender = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{servers[0].url}/generate", json=body, timeout=120).json()
        )
    )
    sender.start()

    running = until(
        lambda: servers[0].stats()["running"] > 0, what="the request to run", deadline=120
    )
    asyncio.run(running)
    before = len(servers[0].history())
    code, _, err = ctl("offload", "--pause-mode", "wait", "--deadline", "pause=90")
    assert code == 0, err
    sender.join(120)
    (answer,) = answers
    assert len(answer["output_ids"]) == 400 and answer["meta_info"]["num_retractions"] == 0
    # SGLang's client drains with a flush that waits, then pauses; the flush gives up in time
    # for its refusal to beat the pause deadline (90 s less twice the probe's 10 s).
    calls = [(e["op"], e.get("timeout") or e.get("mode")) for e in servers[0].history()[before:]]
    drained = calls.index(("flush_cache", 70.0))
    assert ("pause_generation", "retract") in calls[drained + 1 :]
    assert ctl("onload-weights")[0] == 0 and ctl("onload-kv")[0] == 0


def test_misuse_is_refused_before_any_engine_is_touched_and_the_standins_live(
    ctl: Ctl, servers: list[StandInServer], tmp_path: Path
) -> None:
    ledger = tmp_path / "fleet.json"
    before = history_lengths(servers)
    code, out, err = ctl("onload-kv")  # no ledger: the fleet counts as serving
    assert code == ExitCode.REFUSED == 3
    assert "onload_kv() is not allowed in state 'serving'" in err
    assert "not written" in out and not ledger.exists()
    code, report = ctl.json("resume", "--pause-mode", "abort")
    assert code == 0 and report["ledger_written"] is False  # a no-op in serving proves nothing
    assert history_lengths(servers) == before

    assert ctl("drain")[0] == 0
    drained = history_lengths(servers)
    for action in ("onload-kv", "onload-weights", "reset"):
        code, report = ctl.json(action)
        assert code == ExitCode.REFUSED
        assert report["error"]["kind"] == "IllegalTransition"
        assert report["state"] == "drained"
    assert history_lengths(servers) == drained
    assert ctl("resume")[0] == 0

    # A guard: engines paused in place hold KV for their requests; releasing would kill them.
    assert ctl("pause", "--pause-mode", "in_place")[0] == 0
    paused = history_lengths(servers)
    code, out, err = ctl("offload")
    assert code == ExitCode.REFUSED
    assert "refused release_memory_occupation" in err and "in_place" in err
    assert history_lengths(servers) == paused
    assert json.loads(ledger.read_text())["server"]["state"] == "drained"
    assert ctl("resume")[0] == 0
    ops = [e["op"] for s, n in zip(servers, before, strict=True) for e in touched(s)[n:]]
    assert "release_memory_occupation" not in ops and "resume_memory_occupation" not in ops


def test_a_state_file_of_other_engines_or_a_corrupt_one_is_refused(
    ctl: Ctl, servers: list[StandInServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "fleet.json"
    assert ctl("drain")[0] == 0
    before = history_lengths(servers)
    two = Ctl(capsys, [*engine_args(servers[:2]), "--state-file", str(ledger)])
    for action in ("resume", "status"):
        code, _, err = two(action)
        assert code == ExitCode.STATE == 6
        assert "records other engines" in err and servers[2].url in err
    assert history_lengths(servers) == before
    assert json.loads(ledger.read_text())["server"]["state"] == "drained"

    # The same engines in another order share the ledger (engine ids follow the ledger).
    reordered = Ctl(capsys, [*engine_args(servers[::-1]), "--state-file", str(ledger)])
    code, report = reordered.json("resume")
    assert code == 0 and (report["previous_state"], report["state"]) == ("drained", "serving")
    assert [e["url"] for e in report["engines"]] == [s.url for s in servers]

    good = ledger.read_text()
    ledger.write_text(good.replace('"state": "serving"', '"state": "released"'))
    code, _, err = ctl("offload")  # the records (nothing released) contradict the state
    assert code == ExitCode.STATE and "imply 'serving'" in err
    ledger.write_text("{not json")
    code, _, err = ctl("status")
    assert code == ExitCode.STATE and "not JSON" in err
    # Only the reordered resume reached the engines: one continue each.
    assert history_lengths(servers) == [n + 1 for n in before]
    assert ADMIN_KEY not in two.seen + reordered.seen


def test_without_a_state_file_a_paused_engine_is_not_taken_for_serving(
    ctl: Ctl, servers: list[StandInServer], tmp_path: Path
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    url = servers[1].url
    httpx.post(f"{url}/pause_generation", json={"mode": "retract"}, headers=admin, timeout=10)
    try:
        before = history_lengths(servers)
        code, _, err = ctl("offload")
        assert code == ExitCode.STATE
        assert url in err and "/ready" in err
        ops = [e["op"] for s, n in zip(servers, before, strict=True) for e in touched(s)[n:]]
        assert set(ops) <= {"server_info"}  # only the /ready probes
        assert not (tmp_path / "fleet.json").exists()
    finally:
        httpx.post(f"{url}/continue_generation", json={}, headers=admin, timeout=10)


def test_a_failed_flush_exits_4_continues_the_fleet_and_reset_leaves_failed(
    ctl: Ctl, servers: list[StandInServer]
) -> None:
    servers[0].inject({"path": "/flush_cache", "kind": "status", "status": 500, "count": -1})
    try:
        code, report = ctl.json("offload")
    finally:
        servers[0].clear_faults()
    assert code == ExitCode.FAILED == 4
    assert report["state"] == "failed" and report["error"]["kind"] == "PhaseFailed"
    failed = [e for e, o in report["outcomes"].items() if o["outcome"] != "ok"]
    assert failed == ["sglang/0"] and report["outcomes"]["sglang/0"]["outcome"] == "rejected"
    assert all(not e["paused"] for e in report["engines"])  # continued, nothing released
    assert ctl("offload")[0] == ExitCode.REFUSED  # failed: only reset leaves it
    code, report = ctl.json("reset")
    assert code == 0 and (report["previous_state"], report["state"]) == ("failed", "serving")


def test_another_run_holding_the_state_file_makes_ctl_exit_busy(
    ctl: Ctl, tmp_path: Path, servers: list[StandInServer]
) -> None:
    lock = tmp_path / "fleet.json.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        before = history_lengths(servers)
        code, _, err = ctl("drain", "--lock-timeout", "0.2")
        assert code == ExitCode.BUSY == 7 and "holds" in err
        assert history_lengths(servers) == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no engines"),
        (["--engine", "ftp://x"], "http"),
        (["--engine", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:9/"], "twice"),
        (["--engine", "http://127.0.0.1:9", "--admin-key-env", "CTL_UNSET_VAR"], "CTL_UNSET_VAR"),
        (["--engine", "http://127.0.0.1:9", "--deadline", "nap=3"], "PHASE"),
        (["--engine", "http://127.0.0.1:9", "--deadline", "pause=-1"], "pause"),
        (["--engine", "http://127.0.0.1:9", "--pause-mode", "in_place"], "in_place"),
        (["--engines-file", "/nonexistent/engines.txt"], "cannot read"),
    ],
)
def test_bad_input_exits_2_with_a_message_and_touches_nothing(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CTL_UNSET_VAR", raising=False)
    state = tmp_path / "s.json"
    assert main(["ctl", "drain", *argv, "--state-file", str(state)]) == ExitCode.USAGE == 2
    assert message in capsys.readouterr().err
    assert not state.exists()


def test_an_unreachable_engine_without_a_state_file_exits_5(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    state = tmp_path / "s.json"
    # Nothing listens on port 9 (discard): the /ready check finds the engine unreachable.
    code = main(["ctl", "offload", "--engine", "http://127.0.0.1:9", "--state-file", str(state)])
    assert code == ExitCode.UNREACHABLE
    assert "not reachable" in capsys.readouterr().err
    assert not state.exists()


def test_engines_file_comments_and_default_state_path_follow_the_engine_set(
    servers: list[StandInServer], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    listing = tmp_path / "engines.txt"
    listing.write_text(
        "# rollout fleet\n" + "".join(f"{s.url}   # engine {i}\n\n" for i, s in enumerate(servers))
    )
    runner = Ctl(capsys, ["--engines-file", str(listing), "--admin-key-env", KEY_VAR])
    assert runner("drain")[0] == 0
    path = default_state_path([s.url for s in servers[::-1]])
    assert path.is_relative_to(tmp_path / "xdg" / "rollout-lifecycle")
    assert json.loads(path.read_text())["server"]["state"] == "drained"
    code, report = Ctl(capsys, engine_args(servers[::-1])).json("resume")
    assert code == 0 and report["state"] == "serving" and report["state_file"] == str(path)
    assert [ready(s) for s in servers] == [200] * 3


# ------------------------------------------------------------------------------- subprocess


def test_ctl_as_a_subprocess_prints_json_and_never_the_key(
    ctl: Ctl, servers: list[StandInServer], tmp_path: Path
) -> None:
    env = {**os.environ, KEY_VAR: ADMIN_KEY, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "rollout_lifecycle.cli", "ctl"]
    common = [*engine_args(servers), "--state-file", str(tmp_path / "fleet.json")]

    def run(action: str) -> tuple[int, dict[str, Any]]:
        done = subprocess.run(
            [*argv, action, *common, "--json"], env=env, capture_output=True, text=True, timeout=60
        )
        assert ADMIN_KEY not in done.stdout + done.stderr
        report: dict[str, Any] = json.loads(done.stdout)
        return done.returncode, report

    code, report = run("offload")
    assert code == 0 and report["state"] == "released"
    code, report = run("onload-kv")
    assert code == ExitCode.REFUSED and "weights_restored" in report["error"]["message"]
    assert ctl("onload-weights")[0] == 0  # in process, on the ledger the subprocess wrote
    code, report = run("onload-kv")
    assert code == 0 and report["state"] == "serving"


# ------------------------------------------------------------------------------- a dead engine


def test_a_dead_engine_fails_the_pause_with_exit_5_and_stays_recorded_dead(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    fleet = StandInServer.start_many(3, admin_key=ADMIN_KEY)
    try:
        ctl = Ctl(capsys, [*engine_args(fleet), "--state-file", str(tmp_path / "f.json")])
        assert ctl("drain")[0] == 0 and ctl("resume")[0] == 0
        fleet[2].stop()
        code, report = ctl.json("offload")
        assert code == ExitCode.UNREACHABLE == 5
        assert report["state"] == "failed"
        assert report["outcomes"]["sglang/2"]["outcome"] == "dead"
        assert [ready(s) for s in fleet[:2]] == [200, 200]  # the others were continued
        code, status = ctl.json("status")
        assert code == ExitCode.UNREACHABLE
        assert [r["reachable"] for r in status["engines"]] == [True, True, False]
        assert status["engines"][2]["recorded"]["alive"] is False
        assert [r["recorded"]["state"] for r in status["engines"]] == ["serving"] * 2 + ["dead"]
        assert ctl("reset")[0] == 0  # the live engines agree: serving
        before = history_lengths(fleet[:2])
        code, _, err = ctl("offload")
        assert code == ExitCode.REFUSED and "dead" in err
        assert history_lengths(fleet[:2]) == before
        assert ADMIN_KEY not in ctl.seen
    finally:
        for server in fleet:
            server.stop()


# ------------------------------------------------------------------------------- adopt


async def test_adopt_takes_over_a_recorded_state_and_every_guard_applies() -> None:
    engines = [SimulatedEngine(f"e{i}", token_latency=0.001) for i in range(3)]
    first = RolloutServer([EngineGroup("g", engines)])
    await first.offload()
    saved = json.loads(json.dumps(first.snapshot().to_dict()))

    second = RolloutServer([EngineGroup("g", engines)])
    second.adopt(ServerSnapshot.from_dict(saved))
    assert second.state is ServerState.RELEASED
    assert second.snapshot().engines()["g/1"].released == tuple(ALL)
    with pytest.raises(IllegalTransition):
        await second.onload_kv()
    await second.offload()  # a no-op in released: nothing is released twice
    await second.onload_weights()
    await second.onload_kv()
    assert second.state is ServerState.SERVING
    assert all(e.memory()["kv_cache"] > 0 for e in engines)
    assert [e["op"] for e in engines[0].history()].count("release_memory_occupation") == 1


async def test_adopt_refuses_a_snapshot_that_does_not_fit_and_changes_nothing() -> None:
    engines = [SimulatedEngine(f"e{i}") for i in range(2)]
    server = RolloutServer([EngineGroup("g", engines)])
    await server.offload()
    data = server.snapshot().to_dict()
    fresh = RolloutServer([EngineGroup("g", engines)])
    wrong_state = {**data, "state": "serving"}
    with pytest.raises(InvalidArgument, match="imply 'released'"):
        fresh.adopt(ServerSnapshot.from_dict(wrong_state))
    assert fresh.state is ServerState.SERVING
    assert all(e.released == () for e in fresh.snapshot().engines().values())
    with pytest.raises(InvalidArgument, match="pausing"):
        fresh.adopt(ServerSnapshot.from_dict({**data, "state": "pausing"}))
    other = RolloutServer([EngineGroup("h", engines)])
    with pytest.raises(InvalidArgument, match="groups"):
        other.adopt(ServerSnapshot.from_dict(data))
    engine = data["groups"][0]["engines"][0]
    for broken in ({**engine, "paused": "yes"}, {**engine, "released": ["weight"]}):
        bad = {**data, "groups": [{**data["groups"][0], "engines": [broken, engine]}]}
        with pytest.raises(InvalidArgument):
            fresh.adopt(ServerSnapshot.from_dict(bad))
    with pytest.raises(InvalidArgument, match="not a server snapshot"):
        ServerSnapshot.from_dict({"name": "x"})
    failed = {**data, "state": "failed"}  # failed takes any records
    fresh.adopt(ServerSnapshot.from_dict(failed))
    assert fresh.state is ServerState.FAILED
    assert await fresh.reset() is ServerState.RELEASED


# ------------------------------------------------------------------------------- output pipe


def test_ctl_exits_quietly_when_its_output_pipe_is_closed(tmp_path: Path) -> None:
    # `rollout-lifecycle ctl ... | head -0`: the reader is gone before ctl writes anything (its
    # end of the pipe is closed before ctl starts), so every write fails with EPIPE.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket closes
    argv = [sys.executable, "-m", "rollout_lifecycle.cli", "ctl", "status", "--json"]
    engine = ["--engine", f"http://127.0.0.1:{port}", "--state-file", str(tmp_path / "s.json")]
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run(
            [*argv, *engine],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(writer)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == ExitCode.UNREACHABLE  # what the action found, not the pipe


# ------------------------------------------------------------------------------- old SGLang


class _OldSGLang(http.server.BaseHTTPRequestHandler):
    posts: ClassVar[list[str]] = []

    def _answer(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/server_info":
            self._answer(200, {"version": "0.5.21", "internal_states": [{}]})
        elif self.path in ("/ready", "/model_info"):
            self._answer(200, {"weight_version": "v0"})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).posts.append(self.path)
        self._answer(200, {"message": "ok", "status": "ok"})

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_ctl_refuses_an_sglang_older_than_0_5_22_and_sends_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OldSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        state = tmp_path / "old.json"
        code = main(["ctl", "offload", "--engine", url, "--state-file", str(state)])
        _, err = capsys.readouterr()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert code == ExitCode.REFUSED
    assert "0.5.21" in err and "older than 0.5.22" in err
    assert _OldSGLang.posts == []
    assert not state.exists()


def test_ctl_keeps_a_router_in_step_and_refuses_when_the_router_does(
    servers: list[StandInServer], ctl: Ctl, monkeypatch: pytest.MonkeyPatch
) -> None:
    router_key = "ctl-router-key-91b7"
    launched = LaunchedRouter(api_key=router_key)
    asyncio.run(launched.wait_ready())
    client = launched.client()

    def listed() -> set[str]:
        async def ask() -> set[str]:
            try:
                return {url_identity(w.url) for w in await client.workers() if w.healthy}
            finally:
                await client.close()

        return asyncio.run(ask())

    everyone = {url_identity(s.url) for s in servers}
    via = ["--router", launched.url, "--router-key-env", "CTL_ROUTER_KEY"]
    try:
        monkeypatch.setenv("CTL_ROUTER_KEY", router_key)
        code, report = ctl.json("resume", *via)  # already serving: registers the fleet
        assert code == 0 and {url_identity(u) for u in report["router"]["synced"]["added"]} == (
            everyone
        )
        assert listed() == everyone
        code, report = ctl.json("offload", *via)
        assert code == 0 and report["state"] == "released" and listed() == set()
        code, report = ctl.json("onload-weights", *via)
        assert code == 0 and report["state"] == "weights_restored" and listed() == set()
        code, report = ctl.json("onload-kv", *via)
        assert code == 0 and report["state"] == "serving" and listed() == everyone
        monkeypatch.setenv("CTL_ROUTER_KEY", "not-the-router-key")
        code, report = ctl.json("offload", *via)
        assert code == 3 and report["state"] == "serving", report
        assert "401, the router refused the control-plane key" in report["error"]["message"]
        assert listed() == everyone
        assert [ready(s) for s in servers] == [200] * len(servers)  # nothing was paused
        assert router_key not in ctl.seen
    finally:
        launched.stop()
