"""The admin key never shows: not in events, logs, output, reprs, errors or Ray's log files."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
from collections.abc import Iterator
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
from rollout_lifecycle.cli import main
from rollout_lifecycle.testing.standin import StandInServer

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


# A server that publishes its keys as SGLang 0.5.23's /server_info does (common.py
# build_server_info: resolved server arguments and the launch command, in clear).
PUBLISHED_ADMIN = "sk-admin-published-91c2e07d"
PUBLISHED_API = "sk-api-published-5be83f1a"
PUBLISHED_PASSWORD = "pw-ssl-published-77aa01"
PUBLISHED = (PUBLISHED_ADMIN, PUBLISHED_API, PUBLISHED_PASSWORD)


class _Publishing(http.server.BaseHTTPRequestHandler):
    def _answer(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/server_info":
            self._answer(
                200,
                {
                    "version": "0.5.23",
                    "api_key": PUBLISHED_API,
                    "admin_api_key": PUBLISHED_ADMIN,
                    "ssl_keyfile_password": PUBLISHED_PASSWORD,
                    "launch_command": (
                        "python -m sglang.launch_server --model-path m "
                        f"--api-key {PUBLISHED_API} --admin-api-key={PUBLISHED_ADMIN}"
                    ),
                    "internal_states": [{"memory_usage": {"weight": 1.5, "kvcache": 2.0}}],
                },
            )
        elif self.path == "/model_info":
            self._answer(200, {"weight_version": "v0"})
        elif self.path == "/ready":
            self._answer(200, {})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self._answer(200, {"message": "ok", "status": "ok"})

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def publishing_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Publishing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


async def test_keys_published_by_server_info_come_back_masked(publishing_url: str) -> None:
    # The client holds only the api key: the admin key in launch_command is not one it could
    # scrub by value.
    engine = SGLangHTTPEngine(publishing_url, api_key=PUBLISHED_API)
    try:
        with capture_logs() as events:
            info = await engine.server_info()
            assert await engine.check_version() == "0.5.23"
    finally:
        await engine.close()
    text = json.dumps(info)
    assert not [k for k in PUBLISHED if k in text]
    assert info["launch_command"].endswith("--api-key ******** --admin-api-key=********")
    assert info["internal_states"][0]["memory_usage"]["weight"] == 1.5
    assert not [k for k in PUBLISHED if k in repr(events)]


def test_ctl_never_shows_keys_published_by_server_info(
    publishing_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("PUBLISHED_API_KEY", PUBLISHED_API)
    caplog.set_level(logging.DEBUG)
    common = ["--engine", publishing_url, "--api-key-env", "PUBLISHED_API_KEY"]
    common += ["--state-file", str(tmp_path / "state.json"), "-vv"]
    seen = ""
    with capture_logs() as events:
        for argv in (["status", "--json"], ["status"], ["pause", "--json"], ["resume"]):
            code = main(["ctl", argv[0], *common, *argv[1:]])
            out, err = capsys.readouterr()
            assert code == 0, out + err
            seen += out + err
    status = json.loads(seen[: seen.index("\n}\n") + 2])
    assert status["engines"][0]["memory"] == {"weight": 1.5, "kvcache": 2.0}
    everything = seen + repr(events) + caplog.text + (tmp_path / "state.json").read_text()
    assert not [k for k in PUBLISHED if k in everything]


#: Keys no HTTP header can carry (httpx encodes header values as ASCII; h11 refuses control
#: characters and whitespace at either end): key -> what the refusal names.
UNSENDABLE = {
    "sk-clé-7f3e9b": "non-ASCII",
    "sk-k€y-7f3e9b": "non-ASCII",
    "sk-key-7f3e9b\n": "control character",
    "sk-key-7f3e9b\r\n": "control character",
    "sk-key\x00-7f3e9b": "control character",
    " sk-key-7f3e9b": "whitespace",
    "sk-key-7f3e9b\t": "whitespace",
}


@pytest.mark.parametrize("key", list(UNSENDABLE), ids=repr)
def test_a_key_no_http_header_can_carry_is_refused_naming_what_is_wrong_not_the_key(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_lifecycle import InvalidArgument, Secret
    from rollout_lifecycle.backends.secret import as_secret

    refusals = [
        lambda: Secret(key),
        lambda: as_secret(key, what="admin_key"),
        lambda: SGLangHTTPEngine("http://127.0.0.1:1", admin_key=key),
    ]
    if "\x00" not in key:  # (no environment variable holds a NUL)
        monkeypatch.setenv("UNSENDABLE_KEY", key)
        refusals.append(lambda: Secret.from_env("UNSENDABLE_KEY"))
        with pytest.raises(InvalidArgument) as from_env:
            Secret.from_env("UNSENDABLE_KEY")
        assert "'UNSENDABLE_KEY'" in str(from_env.value)
    for refuse in refusals:
        with pytest.raises(InvalidArgument) as err:
            refuse()
        message = str(err.value)
        assert UNSENDABLE[key] in message and "HTTP header" in message, message
        assert "sk-" not in message and key.strip() not in message, message
    # a key a header carries, spaces and tabs inside included, is taken
    for fine in ("sk-key-7f3e9b", "sk key\twith inner blanks", "~!#$%&'*+-.^_`|"):
        assert Secret(fine).reveal() == fine
