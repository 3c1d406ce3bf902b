"""The vLLM launcher: its command line and arguments, and the process it owns, against a small
server on loopback that answers vLLM's start-up and observe routes (``/health``, ``/version``,
``/is_paused``, ``/metrics``). ``tests/real/test_real_vllm.py`` starts a real vLLM server with
it."""

from __future__ import annotations

import pickle
import sys
import textwrap
from typing import Any

import pytest
import structlog
from backends.test_http_client import gone

from rollout_lifecycle import (
    HTTPTimeouts,
    LaunchedVLLMEngine,
    free_port,
    launched_vllm_factory,
)
from rollout_lifecycle.contract.exceptions import EngineDead, IllegalEngineOp, InvalidArgument

KEY = "vllm-launch-key-81b2"
#: Answers what the launcher reads at start-up; ``mode`` "exit" dies first, "old" is vLLM 0.31,
#: "no-dev" lacks the RL routes. Its first line says what its environment held.
SERVER_SCRIPT = textwrap.dedent(
    """
    import http.server, json, os, sys
    port, mode = int(sys.argv[1]), sys.argv[2]
    key = os.environ.get("VLLM_API_KEY")
    print(f"dev_mode={os.environ.get('VLLM_SERVER_DEV_MODE')} key={'set' if key else 'unset'}"
          f" key_is_ours={key == sys.argv[3]}", flush=True)
    if mode == "exit":
        print("fatal: no model here", file=sys.stderr, flush=True)
        sys.exit(4)

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, status, body):
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.answer(200, None)
            elif self.path == "/version":
                self.answer(200, {"version": "0.31.0" if mode == "old" else "0.32.0"})
            elif self.path == "/is_paused" and mode != "no-dev":
                self.answer(200, {"is_paused": False})
            elif self.path == "/metrics":
                data = b"process_start_time_seconds 1764230400.5\\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self.answer(404, {"detail": "Not Found"})

        def log_message(self, *args):
            print("served", self.path, flush=True)

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def launched(port: int, mode: str, **kwargs: Any) -> LaunchedVLLMEngine:
    kwargs.setdefault("startup_timeout", 60.0)
    return LaunchedVLLMEngine(
        "unused-model",
        port=port,
        command=[sys.executable, "-c", SERVER_SCRIPT, str(port), mode, KEY],
        timeouts=HTTPTimeouts(probe=2.0, connect=1.0),
        **kwargs,
    )


def test_the_default_command_runs_the_api_server_on_loopback_without_the_key() -> None:
    engine = LaunchedVLLMEngine(
        "/models/m", port=8123, python="/venv/bin/python", api_key=KEY, extra_args=["--x", "1"]
    )
    assert engine.command == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m",
        "--host", "127.0.0.1", "--port", "8123", "--x", "1",
    ]  # fmt: skip
    assert engine.url == "http://127.0.0.1:8123"
    assert KEY not in repr(engine)
    factory = launched_vllm_factory("/models/m", port=8123, api_key=KEY)
    assert KEY not in repr(factory) and KEY not in repr(pickle.loads(pickle.dumps(factory)))
    assert LaunchedVLLMEngine("/m", port=1, host="::1").url == "http://[::1]:1"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"extra_args": ["--api-key", KEY]}, "must not contain --api-key"),
        ({"extra_args": [f"--api-key={KEY}"]}, "must not contain --api-key"),
        ({"extra_args": "--dtype float32"}, "extra_args must be a sequence"),
        ({"port": 0}, "port must be an int"),
        ({"host": ""}, "host must be a non-empty string"),
        ({"python": "", "command": None}, "python must be a non-empty string"),
        ({"python": "/venv/bin/python", "command": ["serve"]}, "python does not apply"),
        ({"command": []}, "command must not be empty"),
        ({"env": {"A": 1}}, "env must be a mapping of strings"),
        ({"sleep_level": 3}, "sleep_level must be 1 or 2"),
    ],
)
def test_a_bad_argument_is_refused_by_name(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"port": 8123, **kwargs}
    with pytest.raises(InvalidArgument, match=match) as refused:
        LaunchedVLLMEngine("/models/m", **args)
    assert KEY not in str(refused.value)


async def test_a_launched_server_gets_dev_mode_and_its_key_in_its_environment_and_stops(
    engines: list[LaunchedVLLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    engine = launched(port, "ok", api_key=KEY)
    engines.append(engine)
    with structlog.testing.capture_logs() as events:
        found = await engine.observe()  # started lazily by the first call
        assert found["paused"] is False and isinstance(found["incarnation"], str)
        other = launched(port, "ok")  # a second engine must not adopt the first one's server
        engines.append(other)
        with pytest.raises(EngineDead, match="already answers"):
            await other.start()
        assert other.pid is None
        pid = engine.pid
        await engine.close()
    assert engine.returncode is not None and pid is not None and gone(pid)
    lines = [e["line"] for e in events if e["event"] == "vllm.log"]
    assert "dev_mode=1 key=set key_is_ours=True" in lines
    assert {e["event"] for e in events} >= {"vllm.start", "vllm.ready", "vllm.exit"}
    assert all(KEY not in repr(event) for event in events)
    # A key in this process's environment does not reach a server started without one.
    monkeypatch.setenv("VLLM_API_KEY", "inherited-key")
    keyless = launched(free_port(), "ok")
    engines.append(keyless)
    with structlog.testing.capture_logs() as events:
        await keyless.start()
        await keyless.close()
    assert "dev_mode=1 key=unset key_is_ours=False" in [
        e["line"] for e in events if e["event"] == "vllm.log"
    ]


@pytest.mark.parametrize(
    ("mode", "error", "match"),
    [
        ("exit", EngineDead, "exited with code 4.*fatal: no model here"),
        ("old", IllegalEngineOp, "reports vLLM '0.31.0'"),
        ("no-dev", IllegalEngineOp, "VLLM_SERVER_DEV_MODE=1"),
    ],
)
async def test_a_server_that_dies_or_cannot_be_driven_is_refused_and_stopped(
    engines: list[LaunchedVLLMEngine], mode: str, error: type[Exception], match: str
) -> None:
    engine = launched(free_port(), mode)
    engines.append(engine)
    with pytest.raises(error, match=f"(?s){match}"):
        await engine.start()
    assert engine.returncode is not None  # not left running
    with pytest.raises(EngineDead, match="start failed earlier"):
        await engine.observe()
    await engine.close()
