"""``ctl`` stopped by a signal at every phase, one server under two spellings, and state files
that are not ledgers.

Each signal case runs ``rollout-lifecycle ctl`` as a subprocess against stand-in servers whose
target operation takes a while inside the engine, signals it once every engine is running that
operation, and checks what the state file says, what the next run refuses, and that the
documented way out brings the fleet back to serving with every engine alive (the runs around
the signalled one go through ``main(argv)`` in this process: same code, no interpreter start).

A state file of any other content (bytes that are not UTF-8 or not JSON, JSON nested without
end, any JSON value in any field) ends every action in exit 6 with one line naming the file,
before any engine is touched: as a subprocess for the worst cases, in process for each field
and for arbitrary values (hypothesis).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from contract.test_urls import OTHER_SPELLINGS
from hypothesis import event, given, settings
from hypothesis import strategies as st

from rollout_lifecycle import EngineGroup, RolloutServer, SGLangHTTPEngine
from rollout_lifecycle.cli import main
from rollout_lifecycle.cli.ctl import ExitCode, default_state_path
from rollout_lifecycle.cli.ctl_state import GROUP, record_restarted, utc_now, write_ledger
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.contract.values import PauseMode, Tag
from rollout_lifecycle.core.ledger import EngineRecord, EngineSnapshot
from rollout_lifecycle.testing import StandInServer

ROOT = Path(__file__).resolve().parents[2]
#: An outer bound on every wait, far above what a loaded machine needs.
BOUND = 60.0
#: How long the targeted operation runs inside each engine.
SLOW = 2.5

#: phase -> (the ctl action whose call it is, the engine op, the actions run before it)
PHASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "pause": ("offload", "pause_generation", ()),
    "flush": ("offload", "flush_cache", ()),
    "release": ("offload", "release_memory_occupation", ()),
    "resume_weights": ("onload-weights", "resume_memory_occupation", ("offload",)),
    "resume_kv": ("onload-kv", "resume_memory_occupation", ("offload", "onload-weights")),
    "continue": ("onload-kv", "continue_generation", ("offload", "onload-weights")),
}
#: phase -> the state a handled SIGTERM leaves (the call stops at its next boundary).
AFTER_SIGTERM = {
    "pause": "drained",
    "flush": "drained",
    "release": "released",
    "resume_weights": "weights_restored",
    "resume_kv": "kv_restored",
    "continue": "serving",
}
#: The actions that bring each state back to serving.
TO_SERVING = {
    "serving": (),
    "drained": ("resume",),
    "released": ("onload-weights", "onload-kv"),
    "weights_restored": ("onload-kv",),
    "kv_restored": ("resume",),
}


def until_signal_handled(pid: int, signum: int) -> None:
    """Until process ``pid`` has taken ``signum`` (no longer pending) and its main thread then
    sleeps in its event loop's epoll wait: the loop has run the handler and everything it
    started, and waits again (Linux: read from /proc)."""
    proc = Path(f"/proc/{pid}")
    bit = 1 << (signum - 1)
    deadline = time.monotonic() + BOUND
    taken = False
    while True:
        if not taken:
            status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
            taken = not (int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & bit
        if taken and (proc / "wchan").read_text() == "do_epoll_wait":
            return
        assert time.monotonic() < deadline, f"process {pid} never handled signal {signum}"
        time.sleep(0.002)


class Fleet:
    """Two stand-ins whose ``op`` runs ``SLOW`` seconds, and ``ctl`` run against them."""

    def __init__(self, op: str, state_file: Path) -> None:
        self.op = op
        self.state_file = state_file
        self.servers = StandInServer.start_many(
            2, token_latency=0.002, op_latency={op: SLOW}, seed=1
        )

    def argv(self, action: str, *extra: str) -> list[str]:
        """The command line's arguments (``main(argv)``'s) for ``ctl action``."""
        engines = [a for s in self.servers for a in ("--engine", s.url)]
        return ["ctl", action, *engines, "--state-file", str(self.state_file), "--json", *extra]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(self, action: str, *extra: str) -> tuple[int, dict[str, Any]]:
        """Run ``ctl`` to its end in this process (only a call a test signals needs a process
        of its own, ``start``): its exit code and its JSON report."""
        code, out, _ = run_main(self.argv(action, *extra))
        report: dict[str, Any] = json.loads(out) if out.strip() else {}
        return code, report

    def start(self, action: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "rollout_lifecycle.cli", *self.argv(action)],
            env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def wait_in_flight(self) -> None:
        """Until every engine is running ``op`` (sent, not answered)."""
        deadline = time.monotonic() + BOUND
        while not all(self.running(s) for s in self.servers):
            assert time.monotonic() < deadline, f"{self.op} never started on every engine"
            time.sleep(0.02)

    def running(self, server: StandInServer) -> bool:
        return self.op in server.state()["in_flight"]

    def wait_settled(self) -> None:
        """Until no engine runs ``op`` any more (a call a killed run left lands or not)."""
        deadline = time.monotonic() + BOUND
        while any(self.running(s) for s in self.servers):
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def count(self, op: str) -> list[int]:
        return [sum(e["op"] == op for e in s.history()) for s in self.servers]

    def ledger(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.state_file.read_text())
        return data

    def recorded(self) -> list[dict[str, Any]]:
        engines: list[dict[str, Any]] = self.ledger()["server"]["groups"][0]["engines"]
        return engines

    def restart(self) -> None:
        """Stop every stand-in and start a fresh one at the same URL (all memory resident)."""
        ports = [s.port for s in self.servers]
        for server in self.servers:
            server.stop()
        self.servers = StandInServer.start_all(
            StandInServer(port=port, token_latency=0.002) for port in ports
        )

    def alive(self) -> list[bool]:
        return [s.alive() for s in self.servers]

    def ready(self) -> list[int]:
        return [httpx.get(f"{s.url}/ready", timeout=10).status_code for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def fleet_for(tmp_path: Path) -> Iterator[Any]:
    made: list[Fleet] = []

    def make(op: str) -> Fleet:
        made.append(Fleet(op, tmp_path / "fleet.json"))
        return made[-1]

    yield make
    for fleet in made:
        fleet.stop()


def cycle(fleet: Fleet) -> None:
    """A full offload / onload cycle passes and every engine serves."""
    for action in ("offload", "onload-weights", "onload-kv"):
        code, report = fleet.run(action)
        assert code == 0, report
    assert fleet.ready() == [200, 200]


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigterm_at_each_phase_settles_the_call_and_writes_an_exact_ledger(
    fleet_for: Any, phase: str
) -> None:
    action, op, before = PHASES[phase]
    fleet = fleet_for(op)
    for earlier in before:
        assert fleet.run(earlier)[0] == 0
    proc = fleet.start(action)
    fleet.wait_in_flight()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == ExitCode.TERMINATED == 143, err
    assert "terminated (SIGTERM)" in err
    state = fleet.ledger()["server"]["state"]
    assert state == AFTER_SIGTERM[phase]
    # the ledger is exact: what each engine holds released is what it records
    for server, engine in zip(fleet.servers, fleet.recorded(), strict=True):
        assert sorted(server.state()["released_tags"]) == sorted(engine["released"])
        assert not engine["uncertain"] and not engine["pause_unknown"]
    for step in TO_SERVING[state]:
        assert fleet.run(step)[0] == 0
    assert fleet.alive() == [True, True]
    cycle(fleet)


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigkill_at_each_phase_leaves_a_ledger_that_refuses_what_could_kill(
    fleet_for: Any, phase: str
) -> None:
    action, op, before = PHASES[phase]
    fleet = fleet_for(op)
    for earlier in before:
        assert fleet.run(earlier)[0] == 0
    memory_op = op in ("release_memory_occupation", "resume_memory_occupation")
    proc = fleet.start(action)
    fleet.wait_in_flight()
    proc.kill()
    proc.communicate(timeout=BOUND)
    fleet.wait_settled()  # the calls the killed run sent land on the engines
    ledger = fleet.ledger()
    assert ledger["server"]["state"] == "failed"
    assert ledger["last_call"]["in_flight"] is True
    engines = fleet.recorded()
    if memory_op:
        assert all(e["uncertain"] for e in engines)  # may or may not have landed
    if op in ("pause_generation", "continue_generation"):
        assert all(e["pause_unknown"] for e in engines)
    sent = fleet.count(op)
    # the same call again is refused: nothing is sent twice
    code, report = fleet.run(action)
    assert code == ExitCode.REFUSED, report
    assert fleet.count(op) == sent
    assert fleet.alive() == [True, True]
    code, report = fleet.run("reset")
    if memory_op:
        # tags in an unknown state: only a restart settles them
        assert code == ExitCode.REFUSED and "--restarted" in report["error"]["message"]
        assert fleet.alive() == [True, True]
        fleet.restart()
        urls = [a for s in fleet.servers for a in ("--restarted", s.url)]
        code, report = fleet.run("reset", *urls)
    assert code == 0, report
    assert report["state"] == "serving"
    assert fleet.alive() == [True, True] and fleet.ready() == [200, 200]
    cycle(fleet)


def test_a_second_sigterm_does_not_abandon_the_phase(fleet_for: Any) -> None:
    fleet = fleet_for("release_memory_occupation")
    proc = fleet.start("offload")
    fleet.wait_in_flight()
    proc.send_signal(signal.SIGTERM)
    until_signal_handled(proc.pid, signal.SIGTERM)  # the run is cancelled, the phase settling
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=BOUND)
    assert proc.returncode == ExitCode.TERMINATED
    assert fleet.ledger()["server"]["state"] == "released"
    assert fleet.run("onload-weights")[0] == 0 and fleet.run("onload-kv")[0] == 0


# -- two controllers ---------------------------------------------------------------------------


def test_two_ctl_runs_with_their_own_state_files_on_one_fleet_kill_nothing(
    fleet_for: Any, tmp_path: Path
) -> None:
    """Started together, both see the engines serving (their readiness checks pass); the one
    that claims the engines first runs, the other is refused at once, naming it."""
    fleet = fleet_for("pause_generation")
    first = fleet.start("offload")
    fleet.wait_in_flight()  # the first run's pause is on every engine: it holds the claims
    assert fleet.ready() == [200, 200]  # (the slow pause has not landed: both pass /ready)
    other = tmp_path / "other.json"
    code, report = fleet.run("offload", "--state-file", str(other))
    assert code == ExitCode.BUSY == 7, report
    message = report["error"]["message"]
    assert f"pid {first.pid}" in message and "call offload()" in message
    assert not other.exists() or json.loads(other.read_text())["server"]["state"] == "serving"
    first.communicate(timeout=BOUND)
    assert first.returncode == 0
    assert fleet.count("release_memory_occupation") == [1, 1]  # released once, by the first
    assert fleet.alive() == [True, True]
    cycle_back = [fleet.run(a)[0] for a in ("onload-weights", "onload-kv")]
    assert cycle_back == [0, 0] and fleet.ready() == [200, 200]


def test_ctl_beside_a_library_process_on_one_fleet_kills_nothing(fleet_for: Any) -> None:
    """A training process drives the engines (its call holds their claims); a ctl run is
    refused at once; once the process's call is over, ctl finds the engines as it left them."""
    fleet = fleet_for("pause_generation")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, *(s.url for s in fleet.servers)],
        env=fleet.env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        fleet.wait_in_flight()  # the trainer's pause is on every engine, not landed yet
        code, report = fleet.run("offload")
        assert code == ExitCode.BUSY, report
        message = report["error"]["message"]
        assert f"pid {trainer.pid}" in message and "server 'trainer'" in message
        out, _ = trainer.communicate(timeout=BOUND)
        assert trainer.returncode == 0 and out.strip() == "released"
    finally:
        trainer.kill()
    assert fleet.count("release_memory_occupation") == [1, 1]
    assert fleet.alive() == [True, True]
    # ctl, with no state file, finds the engines paused: not taken for serving, nothing sent
    code, report = fleet.run("offload")
    assert code == ExitCode.STATE, report
    assert fleet.count("release_memory_occupation") == [1, 1] and fleet.alive() == [True, True]


TRAINER = """
import asyncio, sys
from rollout_lifecycle import EngineGroup, RolloutServer, SGLangHTTPEngine

async def main() -> None:
    engines = [SGLangHTTPEngine(url) for url in sys.argv[1:]]
    server = RolloutServer([EngineGroup("actor", engines)], name="trainer")
    await server.offload()
    print(server.state.value, flush=True)

asyncio.run(main())
"""


def test_reset_restarted_refuses_a_server_that_was_not_restarted(fleet_for: Any) -> None:
    """A call in flight when a run was killed may still land on the same process: only a new
    one (another incarnation) is recorded as a fresh server."""
    fleet = fleet_for("release_memory_occupation")
    proc = fleet.start("offload")
    fleet.wait_in_flight()
    proc.kill()
    proc.communicate(timeout=BOUND)
    fleet.wait_settled()
    for server in fleet.servers:  # continued by hand: ready again, but the same process
        httpx.post(f"{server.url}/continue_generation", json={}, timeout=10)
    urls = [a for s in fleet.servers for a in ("--restarted", s.url)]
    code, report = fleet.run("reset", *urls)
    assert code == ExitCode.STATE, report
    assert "was not restarted" in report["error"]["message"]
    assert all(e["uncertain"] for e in fleet.recorded())  # unchanged
    fleet.restart()
    code, report = fleet.run("reset", *urls)
    assert code == 0 and report["state"] == "serving", report
    incarnations = [e["incarnation"] for e in fleet.recorded()]
    assert all(incarnations) and len(set(incarnations)) == 2
    cycle(fleet)


# -- one server, two spellings -----------------------------------------------------------------


def test_localhost_and_127_0_0_1_are_one_engine(tmp_path: Path) -> None:
    (server,) = StandInServer.start_many(1, token_latency=0.002)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "xdg")}
        numeric = f"http://127.0.0.1:{server.port}"
        named = f"http://localhost:{server.port}"

        def ctl(action: str, *urls: str) -> subprocess.CompletedProcess[str]:
            engines = [a for u in urls for a in ("--engine", u)]
            argv = [sys.executable, "-m", "rollout_lifecycle.cli", "ctl", action, *engines]
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

        both = ctl("offload", numeric, named)
        assert both.returncode == ExitCode.USAGE
        assert numeric in both.stderr and named in both.stderr
        assert [e["op"] for e in server.history() if e["op"] == "pause_generation"] == []
        # one state file for both spellings, accepted under either
        assert default_state_path([numeric]) == default_state_path([named + "/"])
        assert ctl("offload", numeric).returncode == 0
        again = ctl("offload", named)  # a no-op in released: nothing released twice
        assert again.returncode == 0, again.stderr
        assert ctl("onload-weights", named).returncode == 0
        assert ctl("onload-kv", numeric).returncode == 0
        ops = [e["op"] for e in server.history()]
        assert ops.count("release_memory_occupation") == 1
        assert server.alive()
    finally:
        server.stop()


# -- state files that are not ledgers ----------------------------------------------------------


@pytest.fixture(scope="module")
def standin() -> Iterator[StandInServer]:
    """One stand-in that every malformed-state-file case leaves untouched and serving."""
    with StandInServer.running(1, token_latency=0.002) as (server,):
        yield server
        assert server.alive() and httpx.get(f"{server.url}/ready", timeout=10).status_code == 200


def good_ledger(url: str) -> dict[str, Any]:
    """What ``ctl`` writes of one serving engine at ``url`` (``last_call`` as the journal writes
    it mid-call, so that every one of its fields is there)."""
    snapshot = RolloutServer([EngineGroup(GROUP, [SGLangHTTPEngine(url)])], name="ctl").snapshot()
    last = {"action": "offload", "at": utc_now(), "exit_code": None, "error": None}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.json"
        write_ledger(path, [url], snapshot, {**last, "in_flight": True})
        data: dict[str, Any] = json.loads(path.read_text())
    return data


#: Stands for "the field removed" in ``changed``.
DELETE = object()


def changed(ledger: Any, at: tuple[str | int, ...], value: Any) -> Any:
    """``ledger`` with the field at path ``at`` set to ``value`` (``DELETE``: removed)."""
    if not at:
        return value
    out = copy.deepcopy(ledger)
    parent = out
    for step in at[:-1]:
        parent = parent[step]
    if value is DELETE:
        del parent[at[-1]]
    else:
        parent[at[-1]] = value
    return out


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """Run the command line in this process (``main(argv)``); its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def ctl_in_process(action: str, url: str, state: Path, *extra: str) -> tuple[int, str]:
    """Run ``ctl`` in this process; its exit code and stderr."""
    code, _, err = run_main(["ctl", action, "--engine", url, "--state-file", str(state), *extra])
    return code, err


def assert_state_refusal(action: str, code: int, err: str, state: Path) -> None:
    """Exit 6 with one line on stderr that names the file (no traceback)."""
    assert code == ExitCode.STATE, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"rollout-lifecycle ctl {action}: ") and str(state) in err, err


#: State files that crash a reader that trusts their shape: name -> content.
WORST: dict[str, Any] = {
    "nested 100,000 deep": lambda url: b"[" * 100_000 + b"]" * 100_000,
    "last_call a string": lambda url: {**good_ledger(url), "last_call": "x"},
    "not UTF-8": lambda url: b"\xff\xfe" + json.dumps(good_ledger(url)).encode(),
    "a group's engines an int": lambda url: changed(
        good_ledger(url), ("server", "groups", 0, "engines"), 5
    ),
}


def _write(state: Path, content: Any) -> None:
    state.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())


@pytest.mark.parametrize("case", list(WORST))
def test_a_malformed_state_file_exits_6_in_one_line_and_never_a_traceback(
    standin: StandInServer, tmp_path: Path, case: str
) -> None:
    state = tmp_path / "fleet.json"
    _write(state, WORST[case](standin.url))
    before = len(standin.history())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for action in (["status"], ["offload"], ["reset", "--restarted", standin.url]):
        argv = [sys.executable, "-m", "rollout_lifecycle.cli", "ctl", *action]
        argv += ["--engine", standin.url, "--state-file", str(state)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stderr, done.stderr
        assert_state_refusal(action[0], done.returncode, done.stderr, state)
        assert done.stdout == ""
    # refused before anything was sent, even a probe
    assert len(standin.history()) == before


#: One bad value per field: (path, value, what the message names).
FIELDS: list[tuple[tuple[str | int, ...], Any, str]] = [
    (("format",), "rollout-lifecycle-ctl/0", "format"),
    (("engines",), "http://127.0.0.1:1", "engines"),
    (("engines",), [], "engines"),
    (("updated_at",), [1], "updated_at"),
    (("updated_at",), "\udc80", "surrogate"),
    (("last_call",), "x", "last_call"),
    (("last_call",), None, "last_call"),
    (("last_call", "action"), {"a": 1}, "last_call.action"),
    (("last_call", "exit_code"), "0", "last_call.exit_code"),
    (("last_call", "exit_code"), True, "last_call.exit_code"),
    (("last_call", "exit_code"), 10**6, "last_call.exit_code"),
    (("last_call", "error"), 1, "last_call.error"),
    (("last_call", "in_flight"), "yes", "last_call.in_flight"),
    (("server",), [], "server"),
    (("server", "state"), ["serving"], "snapshot"),
    (("server", "groups"), {"sglang": 1}, "server.groups"),
    (("server", "groups", 0), "sglang", "server.groups[0]"),
    (("server", "groups", 0, "engines"), 5, "server.groups[0].engines"),
    (("server", "groups", 0, "engines", 0), [], "server.groups[0].engines"),
    (("server", "groups", 0, "engines", 0, "alive"), 1, "'alive'"),
    (("server", "groups", 0, "engines", 0, "id"), ["sglang/0"], "'id'"),
    (("server", "groups", 0, "engines", 0, "released"), "weights", "released"),
    (("server", "groups", 0, "engines", 0, "released"), ["weights", "weights"], "twice"),
    (("server", "groups", 0, "engines", 0, "uncertain"), ["vram"], "'vram'"),
    (("server", "groups", 0, "engines", 0, "pause_mode"), "paused", "pause_mode"),
    (("server", "groups", 0, "engines", 0, "pause_mode"), ["retract"], "pause_mode"),
]


@pytest.mark.parametrize(
    ("at", "value", "needle"),
    [pytest.param(*f, id=f"{'.'.join(map(str, f[0]))}={f[1]!r}") for f in FIELDS],
)
def test_each_mistyped_field_exits_6_naming_it_for_every_action(
    standin: StandInServer, tmp_path: Path, at: tuple[str | int, ...], value: Any, needle: str
) -> None:
    state = tmp_path / "fleet.json"
    _write(state, changed(good_ledger(standin.url), at, value))
    before = len(standin.history())
    for action in ("status", "offload", "reset"):
        code, err = ctl_in_process(action, standin.url, state)
        assert_state_refusal(action, code, err, state)
        assert needle in err, err
    assert len(standin.history()) == before


def test_record_restarted_passes_over_what_is_not_an_engine_record() -> None:
    url = "http://127.0.0.1:1"
    shapes: list[Any] = [5, "sglang/0", [[]], [{"id": ["sglang/0"]}], [{"id": {}}]]
    for engines in shapes:
        ledger: dict[str, Any] = {"server": {"groups": [{"engines": engines}, 1, None]}}
        record_restarted(ledger, [url], {url: "a-new-incarnation"})
        assert ledger["server"]["state"] == "failed"


def test_record_restarted_records_a_new_process_as_the_library_does() -> None:
    """``ctl --restarted`` writes the record ``EngineRecord.restart`` leaves, field for field,
    whatever the old process's record held."""
    url = "http://127.0.0.1:1"
    old = EngineRecord(f"{GROUP}/0", GROUP, None)
    for op, tags in ((Op.PAUSE, ()), (Op.FLUSH, ()), (Op.RELEASE, (Tag.KV_CACHE,))):
        old.intend(op, tags, PauseMode.RETRACT)
        old.apply(op, tags, PauseMode.RETRACT, EngineOutcome(Outcome.OK), "the-old-process")
    old.intend(Op.RESUME, (Tag.WEIGHTS,), None)  # a resume in flight: its tag uncertain
    assert old.paused and old.released and old.uncertain
    engine = json.loads(json.dumps(dataclasses.asdict(old.snapshot())))
    ledger: dict[str, Any] = {"server": {"state": "released", "groups": [{"engines": [engine]}]}}
    record_restarted(ledger, [url], {url: "a-new-incarnation"})
    fresh = EngineRecord(old.id, GROUP, None)
    fresh.restart("a-new-incarnation")
    assert EngineSnapshot.from_dict(engine) == fresh.snapshot()
    assert ledger["server"]["state"] == "failed"


#: Any JSON value (bounded in size; ints short enough for ``json.dumps``).
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def _fields(value: Any, at: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    yield at
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _fields(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _fields(item, (*at, index))


def _types_kept(good: Any, value: Any, at: tuple[str | int, ...]) -> bool:
    """Whether ``value`` is of the JSON type the field holds in a ledger (null fields hold a
    string or null, ``exit_code`` an int or null, an engine's ``capabilities`` an object or
    null); a value of another type must be refused."""
    if not at:
        return False  # the whole file replaced by a small value: never a ledger
    if good is None:
        held = {"exit_code": int, "capabilities": dict}
        kinds: tuple[type, ...] = (held.get(str(at[-1]), str),)
        return value is None or isinstance(value, kinds)
    if isinstance(good, bool):
        return isinstance(value, bool)
    return isinstance(value, type(good))


@given(data=st.data(), action=st.sampled_from(["status", "reset"]))
@settings(max_examples=150, deadline=None)
def test_any_json_value_in_any_field_exits_6_in_one_line_or_is_read_as_a_ledger(
    standin: StandInServer, data: st.DataObject, action: str
) -> None:
    good = good_ledger(standin.url)
    at = data.draw(st.sampled_from(list(_fields(good))), label="field")
    value = data.draw(JSON | st.just(DELETE) if at else JSON, label="value")
    good_value: Any = good
    for step in at:
        good_value = good_value[step]
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "fleet.json"
        _write(state, changed(good, at, value))
        code, err = ctl_in_process(action, standin.url, state)  # raises nothing
    assert code in set(ExitCode), err
    event(f"exit {code}")
    if code == ExitCode.STATE:
        assert_state_refusal(action, code, err, state)
    if value is not DELETE and not _types_kept(good_value, value, at):
        assert code == ExitCode.STATE, (at, value, err)


# -- input a shell or a file mangles, and the environment ---------------------------------------


def assert_one_line(action: str, code: int, err: str, expected: ExitCode, *needles: str) -> None:
    """Exit ``expected`` with one line on stderr naming every needle (no traceback)."""
    assert code == expected, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"rollout-lifecycle ctl {action}: "), err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("around", ["\n", "\r\n", " ", "\t\r\n"], ids=repr)
def test_whitespace_around_a_url_is_not_part_of_it(
    standin: StandInServer, tmp_path: Path, around: str
) -> None:
    """What ``--engine "$(cat url.txt)"`` of a CRLF file, or a paste, gives: the URL without
    it (as the engines file reads each line), the same server and state file."""
    state = tmp_path / "fleet.json"
    argv = ["ctl", "status", "--engine", around + standin.url + around, "--json"]
    code, out, err = run_main([*argv, "--router", "http://127.0.0.1:1" + around])
    assert code == 0 and "Traceback" not in err, err
    (row,) = json.loads(out)["engines"]
    assert row["url"] == standin.url and row["reachable"] and row["ready"]
    assert json.loads(out)["state_file"] == str(default_state_path([standin.url]))
    code, err = ctl_in_process("reset", around + standin.url, state, "--restarted", standin.url)
    assert_one_line("reset", code, err, ExitCode.STATE, "no state file")  # (got that far)


#: URLs with whitespace or a control character inside: refused, naming the character.
MANGLED = {
    "http://127.0.0.1:3\n0000": "'\\n' at position 19",
    "http://127.0.0.1:30000/a b": "' ' at position 25",
    "http://127.0.0.1:30000/\x7f": "'\\x7f' at position 24",
    "http://127.0.0.1:\r30000": "'\\r' at position 18",
}


@pytest.mark.parametrize("url", list(MANGLED), ids=repr)
@pytest.mark.parametrize("option", ["--engine", "--router", "--restarted"])
def test_a_url_with_whitespace_or_a_control_character_inside_is_refused_in_one_line(
    standin: StandInServer, tmp_path: Path, url: str, option: str
) -> None:
    state = tmp_path / "fleet.json"
    engine = url if option == "--engine" else standin.url
    extra = [] if option == "--engine" else [option, url]
    before = len(standin.history())
    for action in ("status", "offload", "reset"):
        if option == "--restarted" and action != "reset":
            continue
        code, err = ctl_in_process(action, engine, state, *extra)
        assert_one_line(action, code, err, ExitCode.USAGE, option, repr(url), MANGLED[url])
        assert "URL alone" in err
    assert len(standin.history()) == before and not state.exists()


@pytest.mark.parametrize("key", ["sk-clé-4d1f9a", "sk-k€y-4d1f9a", "sk-4d1f9a\r\n", "sk-4d\n1f9a"])
def test_a_key_no_http_header_can_carry_is_refused_in_one_line_without_showing_it(
    standin: StandInServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    monkeypatch.setenv("CTL_ODD_KEY", key)
    state = tmp_path / "fleet.json"
    before = len(standin.history())
    for option in ("--admin-key-env", "--api-key-env"):
        for action in ("status", "offload"):
            code, out, err = run_main(
                ["ctl", action, "--engine", standin.url, "--state-file", str(state), "--json",
                 option, "CTL_ODD_KEY"]
            )  # fmt: skip
            assert_one_line(action, code, err, ExitCode.USAGE, option, "'CTL_ODD_KEY'")
            assert "HTTP header" in err and json.loads(out)["exit_code"] == ExitCode.USAGE
            assert "sk-" not in out + err and "4d1f9a" not in out + err
    assert len(standin.history()) == before and not state.exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_lock_dir_that_cannot_be_made_is_refused_in_one_line_before_anything_is_sent(
    standin: StandInServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The engines' claims (``core/claims``) need the lock directory: one that cannot exist is
    named with the fix, exit 2, before any engine is asked anything (status claims nothing)."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    locks = blocker if where == "a file" else blocker / "locks"
    monkeypatch.setenv("ROLLOUT_LIFECYCLE_LOCK_DIR", str(locks))
    state = tmp_path / "fleet.json"
    before = len(standin.history())
    for action in ("offload", "pause", "resume", "reset"):
        code, err = ctl_in_process(action, standin.url, state)
        assert_one_line(
            action, code, err, ExitCode.USAGE, f"ROLLOUT_LIFECYCLE_LOCK_DIR={locks}",
            "not a directory", "set ROLLOUT_LIFECYCLE_LOCK_DIR to a directory",
        )  # fmt: skip
    assert len(standin.history()) == before and not state.exists()
    assert ctl_in_process("status", standin.url, state)[0] == 0


def test_a_refused_claim_of_the_lock_dir_is_a_clean_usage_error(
    standin: StandInServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claims' own refusal of a lock it cannot open (``InvalidArgument``, raised once the
    call claims its engines) ends the run with exit 2 and its message on one stderr line."""
    from rollout_lifecycle.contract.exceptions import InvalidArgument
    from rollout_lifecycle.core import claims

    def refuse(directory: Path, key: str) -> int:
        raise InvalidArgument(
            f"cannot open the controller lock under {directory} of engine {key}; set "
            f"{claims.LOCK_DIR_ENV} to a directory every controller on this host can write"
        )

    monkeypatch.setattr(claims, "_open_lock", refuse)
    state = tmp_path / "fleet.json"
    code, out, err = run_main(
        ["ctl", "pause", "--engine", standin.url, "--state-file", str(state), "--json"]
    )
    assert_one_line("pause", code, err, ExitCode.USAGE, "set ROLLOUT_LIFECYCLE_LOCK_DIR")
    report = json.loads(out)
    assert report["error"]["kind"] == "InvalidArgument" and report["state"] == "serving"
    ops = [e["op"] for e in standin.history()]
    assert "pause_generation" not in ops  # nothing sent


def test_a_library_error_outside_the_call_is_one_line_with_its_exit_code(
    standin: StandInServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``LifecycleError`` raised while ctl sets up or checks, outside the lifecycle call,
    ends in one line and the exit code of its kind (``exit_code_of``), never a traceback."""
    from rollout_lifecycle.cli import ctl_state, ctl_status
    from rollout_lifecycle.contract.exceptions import EngineClaimed, InvalidArgument

    def raising(exc: Exception) -> Any:
        def raise_it(*args: Any, **kwargs: Any) -> Any:
            raise exc

        return raise_it

    state = tmp_path / "fleet.json"
    odd = InvalidArgument("an odd value; give another")
    with monkeypatch.context() as patch:  # in the attach check before the call
        patch.setattr(SGLangHTTPEngine, "check_version", raising(odd))
        code, err = ctl_in_process("offload", standin.url, state)
        assert_one_line("offload", code, err, ExitCode.USAGE, "an odd value; give another")
        claimed = EngineClaimed("http://loopback:1", "pid 1 on elsewhere", {})
        patch.setattr(SGLangHTTPEngine, "check_version", raising(claimed))
        code, err = ctl_in_process("drain", standin.url, state)
        assert_one_line("drain", code, err, ExitCode.BUSY, "pid 1 on elsewhere")
    with monkeypatch.context() as patch:  # in status's setup
        patch.setattr(ctl_status, "make_backends", raising(odd))
        code, err = ctl_in_process("status", standin.url, state)
        assert_one_line("status", code, err, ExitCode.USAGE, "an odd value")
    with monkeypatch.context() as patch:  # in the command line's (no --state-file)
        patch.setattr(ctl_state, "default_state_path", raising(odd))
        code, _, err = run_main(["ctl", "status", "--engine", standin.url, "--json"])
        assert_one_line("status", code, err, ExitCode.USAGE, "an odd value")
    assert not state.exists()


def test_a_symlinked_state_file_stays_a_link_and_its_target_holds_the_ledger(
    tmp_path: Path,
) -> None:
    """The atomic write renames beside the link's target, not over the link: a ledger kept
    elsewhere (a shared volume, a versioned directory) stays where the link points, and every
    link to it takes one lock."""
    (server,) = StandInServer.start_many(1, token_latency=0.002)
    try:
        (tmp_path / "kept").mkdir()
        target = tmp_path / "kept" / "fleet.json"
        link = tmp_path / "fleet.json"
        link.symlink_to(Path("kept") / "fleet.json")  # relative, and dangling until written
        for action, state in (
            ("offload", "released"),
            ("onload-weights", "weights_restored"),
            ("onload-kv", "serving"),
        ):
            code, err = ctl_in_process(action, server.url, link)
            assert code == 0, err
            assert link.is_symlink() and os.readlink(link) == str(Path("kept") / "fleet.json")
            assert json.loads(target.read_text())["server"]["state"] == state
        assert (tmp_path / "kept" / "fleet.json.lock").exists()
        assert not (tmp_path / "fleet.json.lock").exists()
        assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [
            "fleet.json",
            "fleet.json.lock",
        ]  # no temporary file left
        code, out, _ = run_main(
            ["ctl", "status", "--engine", server.url, "--state-file", str(link), "--json"]
        )
        assert code == 0 and json.loads(out)["recorded_state"] == "serving"
        # a loop of links is a state file problem, in one line
        loop = tmp_path / "loop.json"
        loop.symlink_to(loop)
        for action in ("status", "offload"):
            code, err = ctl_in_process(action, server.url, loop)
            assert_one_line(action, code, err, ExitCode.STATE, str(loop))
        assert server.alive()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("op", "rec_paused"),
    [("release_memory_occupation", "retract"), ("pause_generation", "unknown")],
)
def test_status_after_a_sigkill_mid_call_shows_what_the_state_file_does_not_know(
    fleet_for: Any, op: str, rec_paused: str
) -> None:
    """A run killed mid-release leaves tags uncertain, mid-pause a pause state unknown: status
    shows them (REC UNCERTAIN, REC PAUSED unknown), says AGREES unknown rather than yes, and
    how to settle them; its JSON carries them."""
    fleet = fleet_for(op)
    proc = fleet.start("offload")
    fleet.wait_in_flight()
    proc.kill()
    proc.communicate(timeout=BOUND)
    fleet.wait_settled()
    code, status = fleet.run("status")
    assert code == 0, status
    assert status["recorded_state"] == "failed" and status["last_call"]["in_flight"] is True
    tags = ["weights", "kv_cache", "cuda_graph"] if op == "release_memory_occupation" else []
    for row in status["engines"]:
        assert row["reachable"] and row["ready_status"] == 503  # paused, whatever landed
        assert sorted(row["recorded"]["uncertain"]) == sorted(tags)
        assert row["recorded"]["pause_unknown"] is (op == "pause_generation")
        assert row["recorded"]["session_unknown"] is False
        assert row["recorded"]["state"] == ("uncertain" if tags else "paused")
        assert row["record_certain"] is False and row["agrees"] is None
    code, out, err = run_main([a for a in fleet.argv("status") if a != "--json"])
    assert code == 0, err
    lines = out.splitlines()
    assert "in flight when its run stopped" in lines[0]
    header = next(line for line in lines if line.startswith("ENGINE"))
    for server in fleet.servers:
        row = next(line for line in lines if line.startswith("sglang/") and server.url in line)
        assert row[header.index("REC STATE") :].startswith("uncertain" if tags else "paused")
        assert row[header.index("REC PAUSED") :].startswith(rec_paused)
        assert row[header.index("REC RELEASED") :].startswith("- ")
        uncertain = row[header.index("REC UNCERTAIN") :]
        assert uncertain.startswith(",".join(tags) or "- "), row
        assert row[header.index("AGREES") :].startswith("unknown"), row
    if tags:
        for server in fleet.servers:
            assert f"'ctl reset --restarted {server.url}'" in out
    else:
        assert out.count("its pause state is unknown") == 2 and "'ctl reset'" in out
    # once settled, the record is certain again and agrees
    if tags:
        fleet.restart()
        restarted = [a for s in fleet.servers for a in ("--restarted", s.url)]
        assert fleet.run("reset", *restarted)[0] == 0
    else:
        assert fleet.run("reset")[0] == 0
    code, status = fleet.run("status")
    assert [(r["record_certain"], r["agrees"]) for r in status["engines"]] == [(True, True)] * 2


@pytest.mark.parametrize("spelling", OTHER_SPELLINGS)
def test_one_server_under_two_spellings_is_one_engine_given_twice(
    standin: StandInServer, tmp_path: Path, spelling: str
) -> None:
    """``ctl`` given one engine as 127.0.0.1 and under another spelling of this host refuses
    it, naming both, before anything is sent (released twice, it would die)."""
    state = tmp_path / "fleet.json"
    other = standin.url.replace("127.0.0.1", spelling)
    before = len(standin.history())
    for action in ("status", "offload"):
        code, _, err = run_main(
            ["ctl", action, "--engine", standin.url, "--engine", other, "--state-file", str(state)]
        )
        assert_one_line(action, code, err, ExitCode.USAGE, f"{other} is {standin.url} again")
    assert len(standin.history()) == before and not state.exists() and standin.alive()
