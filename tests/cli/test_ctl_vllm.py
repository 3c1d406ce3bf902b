"""``ctl --engine-kind vllm`` against stand-in vLLM servers: ``FakeVLLM`` (the transport that
answers as vLLM 0.32.0 does, from ``tests/backends/test_vllm_http.py``) kept paused or asleep as
its calls say, and served over loopback HTTP, so ``ctl`` runs unchanged."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from backends.test_vllm_http import FakeVLLM

from rollout_lifecycle import EngineGroup, RolloutServer, SGLangHTTPEngine
from rollout_lifecycle.backends.vllm.client import parse_sleep_state
from rollout_lifecycle.cli import main
from rollout_lifecycle.cli.ctl import ExitCode
from rollout_lifecycle.cli.ctl_state import GROUP, VLLM_KEY_WARNING, write_ledger

KEY = "sk-vllm-ctl-5e2b8c1d"
KEY_VAR = "CTL_TEST_VLLM_KEY"
ALL = ["weights", "kv_cache", "cuda_graph"]
#: What the stand-in's /metrics shows as the API server's start (its incarnation).
STARTED = "1764000000.25"
#: Reads that change nothing: the attach check, the identity check, the status probes.
READS = ("/version", "/is_paused", "/is_sleeping", "/metrics", "/health", "/weight_info")


class LiveVLLM(FakeVLLM):
    """``FakeVLLM`` that stays paused after ``/pause`` and asleep after ``/sleep`` until the
    wake that leaves it fully awake, which also resumes it, as vLLM does
    (vllm/v1/engine/core.py ``EngineCore.sleep`` pauses the scheduler; ``EngineCore.wake_up``
    resumes it once every allocation is resident), with the sleep gauge in ``/metrics``."""

    def __init__(self) -> None:
        super().__init__(
            pause=self._pause,
            resume=self._resume,
            sleep=self._sleep,
            wake_up=self._wake_up,
            is_paused=lambda r: httpx.Response(200, json={"is_paused": self.paused}),
            # vllm/v1/engine/core.py EngineCore.is_sleeping: paused, or the executor asleep
            is_sleeping=lambda r: httpx.Response(
                200, json={"is_sleeping": self.paused or bool(self.asleep)}
            ),
            metrics=lambda r: httpx.Response(200, text=self.metrics_text()),
            health=lambda r: httpx.Response(200),
        )
        self.paused = False
        self.level = 0
        self.asleep: set[str] = set()

    def _pause(self, request: httpx.Request) -> httpx.Response:
        self.paused = True
        return httpx.Response(200, json={"status": "paused"})

    def _resume(self, request: httpx.Request) -> httpx.Response:
        self.paused = False
        return httpx.Response(200, json={"status": "resumed"})

    def _sleep(self, request: httpx.Request) -> httpx.Response:
        self.paused, self.level = True, int(request.url.params["level"])
        self.asleep = {"weights", "kv_cache"}
        return httpx.Response(200, json={"status": "sleeping", "level": self.level})

    def _wake_up(self, request: httpx.Request) -> httpx.Response:
        tags = request.url.params.get_list("tags")
        self.asleep -= set(tags) if tags else set(self.asleep)
        if not self.asleep:
            self.level, self.paused = 0, False
        status = "sleeping" if self.asleep else "awake"
        return httpx.Response(200, json={"status": status, "tags": tags or None})

    def metrics_text(self) -> str:
        # vllm/v1/metrics/loggers.py record_sleep_state: set at a sleep and at a full wake
        gauge = {"awake": int(self.level == 0), "weights_offloaded": int(self.level == 1)}
        gauge["discard_all"] = int(self.level == 2)
        lines = [f"process_start_time_seconds {STARTED}"]
        lines += [
            f'vllm:engine_sleep_state{{engine="0",model_name="tiny",sleep_state="{s}"}} {v}.0'
            for s, v in gauge.items()
        ]
        return "\n".join(lines) + "\n"

    def lifecycle(self) -> list[str]:
        """The calls sent that change the engine, in order."""
        return [
            f"{method} {path}" + (f"?{query}" if query else "")
            for method, path, query in self.sent
            if path not in READS
        ]


class Served:
    """A ``FakeVLLM`` behind a loopback HTTP server."""

    def __init__(self, fake: FakeVLLM) -> None:
        self.fake = fake
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = httpx.Request(
                    self.command,
                    f"{served.url}{self.path}",
                    headers=dict(self.headers),
                    content=self.rfile.read(length) if length else b"",
                )
                answer = served.fake(request)
                body = answer.content
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "text/plain"))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes() -> Iterator[list[Served]]:
    served = [Served(LiveVLLM()), Served(LiveVLLM())]
    yield served
    for one in served:
        one.close()


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))


class Ctl:
    """``rollout-lifecycle ctl --engine-kind vllm`` in process, its output captured."""

    def __init__(self, capsys: pytest.CaptureFixture[str], common: list[str]) -> None:
        self.capsys = capsys
        self.common = common
        self.seen = ""

    def __call__(self, action: str, *extra: str, kind: str = "vllm") -> tuple[int, str, str]:
        code = main(["ctl", action, "--engine-kind", kind, *self.common, *extra])
        out, err = self.capsys.readouterr()
        self.seen += out + err
        return code, out, err

    def json(self, action: str, *extra: str, kind: str = "vllm") -> tuple[int, dict[str, Any]]:
        code, out, _ = self(action, "--json", *extra, kind=kind)
        report: dict[str, Any] = json.loads(out)
        assert report["exit_code"] == code
        return code, report


@pytest.fixture
def ctl(fakes: list[Served], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Iterator[Ctl]:
    engines = [a for f in fakes for a in ("--engine", f.url)]
    runner = Ctl(capsys, [*engines, "--state-file", str(tmp_path / "fleet.json")])
    yield runner
    assert KEY not in runner.seen


def live(served: Served) -> LiveVLLM:
    assert isinstance(served.fake, LiveVLLM)
    return served.fake


def sent_counts(fakes: list[Served]) -> list[int]:
    return [len(f.fake.sent) for f in fakes]


def test_a_cycle_on_vllm_sends_vllms_calls_and_records_a_vllm_ledger(
    ctl: Ctl, fakes: list[Served], tmp_path: Path
) -> None:
    code, report = ctl.json("offload")
    assert code == 0, report["error"]
    assert (report["previous_state"], report["state"]) == ("serving", "released")
    assert report["engine_kind"] == "vllm"
    assert [e["id"] for e in report["engines"]] == ["vllm/0", "vllm/1"]
    assert all(e["paused"] and e["released"] == ALL for e in report["engines"])
    # vllm: serve/dev/sleep/api_router.py sleep (mode keep: a release aborts nothing)
    offload = ["POST /pause?mode=keep", "POST /reset_prefix_cache", "POST /sleep?level=1&mode=keep"]
    for served in fakes:
        assert live(served).lifecycle() == offload
        assert live(served).paused and live(served).level == 1
    ledger = json.loads((tmp_path / "fleet.json").read_text())
    assert ledger["engine_kind"] == "vllm"
    assert [g["name"] for g in ledger["server"]["groups"]] == ["vllm"]
    assert ledger["server"]["state"] == "released"

    code, out, _ = ctl("onload-weights")
    assert code == 0 and out.splitlines()[0] == "onload-weights: released -> weights_restored (ok)"
    code, report = ctl.json("onload-kv")
    assert code == 0 and report["state"] == "serving"
    assert all(not e["paused"] and e["released"] == [] for e in report["engines"])
    for served in fakes:
        # The KV cache's wake is the continue (EngineCore.wake_up resumes once fully awake).
        assert live(served).lifecycle()[len(offload) :] == [
            "POST /wake_up?tags=weights",
            "POST /wake_up?tags=kv_cache",
        ]
        assert not live(served).paused and live(served).level == 0
    code, report = ctl.json("resume")  # already serving: nothing to send
    assert code == 0 and all(len(live(f).lifecycle()) == 5 for f in fakes)


def test_status_shows_what_vllm_answers_beside_the_ledger(ctl: Ctl, fakes: list[Served]) -> None:
    code, status = ctl.json("status")
    assert code == 0 and status["engine_kind"] == "vllm" and status["recorded_state"] is None
    for row in status["engines"]:
        assert row["reachable"] and row["ready"] is True and row["health_status"] == 200
        assert row["paused"] is False and row["sleep_state"] == "awake"
        assert row["recorded"] is None and row["agrees"] is True
    assert ctl.json("offload")[0] == 0
    before = [live(f).lifecycle() for f in fakes]
    code, status = ctl.json("status")
    assert code == 0 and status["recorded_state"] == "released"
    assert [r["id"] for r in status["engines"]] == ["vllm/0", "vllm/1"]
    for row in status["engines"]:
        # /health answers 200 paused or not; /is_paused says it is paused.
        assert row["health_status"] == 200 and row["ready"] is False and row["paused"] is True
        assert row["sleep_state"] == "weights_offloaded" and row["agrees"] is True
        assert row["recorded"]["released"] == ALL
        # what the driver declared at first contact, kept in the ledger across ctl runs
        assert row["recorded"]["family"] == "vllm" and row["recorded"]["kv_asleep"] is False
    code, out, _ = ctl("status")  # the table
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("ENGINE"))
    assert lines[0].startswith("recorded state: released")
    for served in fakes:
        row = next(line for line in lines if served.url in line)
        assert row[header.index("READY (HEALTH)") :].startswith("no (200)")
        assert row[header.index("PAUSED") :].startswith("yes")
        assert row[header.index("SLEEP") :].startswith("weights_offloaded")
        assert "weights,kv_cache,cuda_graph" in row
    assert [live(f).lifecycle() for f in fakes] == before  # status changed nothing
    live(fakes[0]).paused = False  # another controller continued it
    code, status = ctl.json("status")
    assert [r["agrees"] for r in status["engines"]] == [False, True]
    code, report = ctl.json("onload-weights")  # the guard names the engine that disagrees
    assert code == ExitCode.FAILED and "vllm/0: conflict" in report["error"]["message"]
    assert live(fakes[0]).lifecycle() == before[0]  # nothing sent to it


def test_a_run_of_another_engine_kind_than_the_state_files_is_refused_with_nothing_sent(
    ctl: Ctl, fakes: list[Served], tmp_path: Path
) -> None:
    assert ctl.json("pause")[0] == 0
    sent = sent_counts(fakes)
    for action in ("status", "resume"):
        code, _, err = ctl(action, kind="sglang")
        assert code == ExitCode.STATE
        assert "records vLLM engines (engine_kind vllm)" in err
        assert "given --engine-kind sglang" in err
    assert sent_counts(fakes) == sent
    # A state file written before the field existed is SGLang's.
    old = tmp_path / "old.json"
    urls = [f.url for f in fakes]
    engines = [SGLangHTTPEngine(u) for u in urls]
    snapshot = RolloutServer([EngineGroup(GROUP, engines)], name="ctl").snapshot()
    write_ledger(old, urls, snapshot, {"action": "pause", "at": "now", "exit_code": 0})
    data = json.loads(old.read_text())
    assert data.pop("engine_kind") == "sglang"
    old.write_text(json.dumps(data))
    code, _, err = ctl("resume", "--state-file", str(old))
    assert code == ExitCode.STATE
    assert "records SGLang engines (engine_kind sglang)" in err and "--engine-kind vllm" in err
    assert sent_counts(fakes) == sent
    assert ctl.json("resume")[0] == 0  # its own ledger still drives it


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--admin-key-env", KEY_VAR),
        ("--router", "http://127.0.0.1:9"),
        ("--router-key-env", KEY_VAR),
    ],
)
def test_sglang_only_options_are_refused_with_vllm(
    ctl: Ctl, fakes: list[Served], option: str, value: str
) -> None:
    code, _, err = ctl("offload", option, value)
    assert code == ExitCode.USAGE
    assert f"{option} is for SGLang, not --engine-kind vllm" in err
    assert sent_counts(fakes) == [0, 0]


def test_a_key_with_vllm_warns_that_it_leaves_the_lifecycle_routes_open(
    ctl: Ctl, fakes: list[Served]
) -> None:
    code, _, err = ctl("pause", "--api-key-env", KEY_VAR)
    assert code == 0
    assert VLLM_KEY_WARNING in err and "/v1" in err and "loopback or a private network" in err
    # vLLM's key guards only /v1 (vllm.api.GUARDED_PREFIXES): no route ctl calls is one.
    assert not any("authorization" in h for f in fakes for h in f.fake.headers)
    code, _, err = ctl("resume")  # no key: no warning
    assert code == 0 and "warning" not in err
    code, _, err = ctl("status", "--api-key-env", KEY_VAR, kind="sglang")
    assert "warning" not in err  # SGLang's key guards its routes


def test_the_help_says_vllms_key_does_not_guard_the_lifecycle_routes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["ctl", "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert " ".join(VLLM_KEY_WARNING.split()) in printed
    assert "--engine-kind vllm" in printed


def test_an_old_vllm_and_one_without_dev_mode_are_refused_naming_what_was_found(
    ctl: Ctl, fakes: list[Served]
) -> None:
    fakes[0].fake.version = "0.31.2"
    code, _, err = ctl("offload")
    assert code == ExitCode.REFUSED
    assert "unsupported vLLM" in err and "vLLM '0.31.2'; this client needs vLLM >= 0.32" in err
    fakes[0].fake.version = "0.32.0"
    fakes[1].fake.answers["is_paused"] = lambda r: httpx.Response(404, json={"detail": "x"})
    code, _, err = ctl("offload")
    assert code == ExitCode.REFUSED and "VLLM_SERVER_DEV_MODE=1" in err
    assert [live(f).lifecycle() for f in fakes] == [[], []]


def test_without_a_ledger_a_paused_vllm_is_not_taken_for_a_serving_one(
    ctl: Ctl, fakes: list[Served], tmp_path: Path
) -> None:
    live(fakes[1]).paused = True
    code, _, err = ctl("offload")
    assert code == ExitCode.STATE
    assert f"{fakes[1].url} (/is_sleeping true (paused, or memory asleep))" in err
    assert fakes[0].url not in err
    assert [live(f).lifecycle() for f in fakes] == [[], []]
    assert not (tmp_path / "fleet.json").exists()


def test_without_a_ledger_a_resumed_vllm_with_memory_asleep_is_not_taken_for_a_serving_one(
    ctl: Ctl, fakes: list[Served], tmp_path: Path
) -> None:
    # /resume runs the scheduler whatever is asleep (EngineCore.resume_scheduler).
    live(fakes[0]).asleep = {"kv_cache"}
    code, _, err = ctl("offload")
    assert code == ExitCode.STATE and f"{fakes[0].url} (/is_sleeping true" in err
    assert [live(f).lifecycle() for f in fakes] == [[], []]
    assert not (tmp_path / "fleet.json").exists()


def test_without_a_ledger_a_vllm_that_does_not_say_whether_it_sleeps_is_unreachable(
    ctl: Ctl, fakes: list[Served]
) -> None:
    def drop(request: httpx.Request) -> httpx.Response:
        raise ConnectionAbortedError("the connection drops without an answer")

    fakes[1].fake.answers["is_sleeping"] = drop
    code, _, err = ctl("offload")
    assert code == ExitCode.UNREACHABLE, err
    assert [live(f).lifecycle() for f in fakes] == [[], []]


def test_the_sleep_state_is_read_from_vllms_gauge() -> None:
    fake = LiveVLLM()
    assert parse_sleep_state(fake.metrics_text()) == "awake"
    fake.level = 2
    assert parse_sleep_state(fake.metrics_text()) == "discard_all"
    assert parse_sleep_state("process_start_time_seconds 1.0\n") is None
