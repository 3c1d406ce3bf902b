"""``rollout-lifecycle demo``: runs the steps, handles injected faults, writes its files, and
exits non-zero when an invariant really breaks."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_lifecycle import mermaid
from rollout_lifecycle.cli import _parser, main
from rollout_lifecycle.cli.demo import _launcher, check_options, group_kinds

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SMALL = ["--steps", "2", "--groups", "1", "--engines", "2", "--requests", "6"]


def alive_actors() -> set[str]:
    from ray._private import state

    return {k for k, v in state.actors().items() if v["State"] != "DEAD"}


def demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["demo", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def checked_ops(out: str) -> int:
    found = re.search(r"checked (\d+) engine ops across (\d+) engines", out)
    assert found, out
    return int(found.group(1))


def assert_outputs(folder: Path) -> dict[str, object]:
    trace = json.loads((folder / "trace.json").read_text())
    assert any(e["ph"] == "X" and e["cat"] == "engine_call" for e in trace["traceEvents"])
    assert (folder / "timeline.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (folder / "lifecycle.mmd").read_text() == mermaid()
    metrics: dict[str, object] = json.loads((folder / "metrics.json").read_text())
    return {"trace": trace, "metrics": metrics}


def test_the_demo_runs_checks_and_writes_its_files(
    ray_cluster: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    actors = alive_actors()
    code, out, err = demo(capsys, *SMALL, "--out", str(tmp_path / "out"))
    assert code == 0, out + err
    assert "all invariants held; final state serving, weight version step-2" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+[12] ", line)]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(r[8] == "6" for r in rows)  # every request done
    assert all(r[11:13] == ["0/0/0", "32/80/4"] for r in rows)  # offloaded, then all back
    assert "step 1/2 offload" in err and "step 2/2 onload_kv" in err
    files = assert_outputs(tmp_path / "out")
    trace = files["trace"]
    assert isinstance(trace, dict)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "engine_call"]
    # Every op an engine recorded is one span, but the weight pushes (the push is the user's
    # code, not a phase): one update_weights_from_disk per engine and step.
    assert len(spans) == checked_ops(out) - 2 * 2
    metrics = files["metrics"]
    assert isinstance(metrics, dict)
    steps = metrics["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["metrics"]["lifecycle/offload/flush_retries"] == 0 for s in steps)
    deadline = time.monotonic() + 10
    while alive_actors() - actors and time.monotonic() < deadline:
        time.sleep(0.1)  # ray.kill is asynchronous
    assert not alive_actors() - actors


@pytest.mark.parametrize(
    ("fault", "needles"),
    [
        ("slow-flush", ["slow-flush armed on group0/0"]),
        ("flush-reject", ["offload failed in flush on group0/0", "reset() -> serving"]),
        ("engine-death", ["offload failed in release on group0/0", "recover() replaced group0/0"]),
    ],
)
def test_an_injected_fault_is_handled_and_the_invariants_still_hold(
    ray_cluster: None,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    fault: str,
    needles: list[str],
) -> None:
    code, out, err = demo(capsys, *SMALL, "--inject-fault", fault, "--out", str(tmp_path))
    assert code == 0, out + err
    assert "all invariants held; final state serving, weight version step-2" in out
    for needle in needles:
        assert needle in out
    metrics = assert_outputs(tmp_path)["metrics"]
    assert isinstance(metrics, dict)
    second = metrics["steps"][1]["metrics"]
    if fault == "slow-flush":
        assert second["lifecycle/offload/flush_slowest_s"] >= 0.4
        assert metrics["slowest_engines"]["lifecycle/offload/flush_slowest_s"] == "group0/0"
    if fault == "engine-death":
        assert "across 3 engines" in out  # the dead one and its replacement are both checked
        assert "lifecycle/recover/total_s" in second


def test_the_demo_exits_non_zero_when_an_invariant_breaks(
    ray_cluster: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The hidden --sabotage hook continues one engine directly, behind the server's back,
    # while its KV cache is released: the checks must find it in the engines' histories.
    code, out, err = demo(capsys, *SMALL, "--sabotage", "--out", str(tmp_path))
    assert code == 1, out + err
    assert "INVARIANTS BROKEN" in out
    assert re.search(r"invariant broken: step 2: .*continue started on g0-0", out), out
    assert "sabotage" in err
    assert_outputs(tmp_path)  # the files are written all the same


def test_bad_demo_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--steps must be between 1 and 1000, got 0"):
        main(["demo", "--steps", "0"])
    with pytest.raises(SystemExit):
        main(["demo", "--inject-fault", "meteor"])
    assert "invalid choice: 'meteor'" in capsys.readouterr().err


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "rollout_lifecycle.cli", "demo", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )


def test_the_demo_over_http_as_a_command(tmp_path: Path) -> None:
    done = run_script(
        "--http", "--steps", "1", "--groups", "1", "--engines", "2", "--requests", "4",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "behind stand-in SGLang servers (HTTP)" in done.stdout
    assert "all invariants held; final state serving, weight version step-1" in done.stdout
    assert_outputs(tmp_path)


def test_the_demo_with_a_fault_as_a_command(tmp_path: Path) -> None:
    done = run_script(
        *SMALL, "--inject-fault", "engine-death", "--pause-mode", "abort", "--out", str(tmp_path)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "recover() replaced group0/0" in done.stdout
    assert "all invariants held" in done.stdout
    assert re.search(r"demo finished in \d+\.\ds", done.stdout)
    assert_outputs(tmp_path)


def test_the_demo_through_a_router_survives_an_engine_death(
    ray_cluster: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = demo(
        capsys, *SMALL, "--http", "--router", "launch", "--inject-fault", "engine-death",
        "--pause-mode", "abort", "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0, out + err
    assert re.search(r"router http://127\.0\.0\.1:\d+: registered 2 worker\(s\)", out), out
    assert "recover() replaced group0/0" in out
    # The dead engine's worker is gone and its replacement serves in its place.
    assert "router: 2 worker(s) listed at the end, for 2 engine(s) serving" in out
    assert "all invariants held; final state serving, weight version step-2" in out


def test_the_demo_refuses_a_router_without_engine_urls() -> None:
    with pytest.raises(SystemExit, match="--router needs engines with URLs"):
        main(["demo", "--router", "launch"])


# ------------------------------------------------------------------ real servers: SGLang, vLLM


def checked(*argv: str) -> argparse.Namespace:
    """The demo's options for ``argv``, parsed and checked as ``run`` checks them."""
    args = _parser().parse_args(["demo", *argv])
    check_options(args)
    return args


PY = sys.executable


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vllm-python", PY], f"--vllm-python {PY}: needs --model"),
        (["--model", "/m"], "--model /m: needs --sglang-python and/or --vllm-python"),
        (["--vllm-args=--enforce-eager"], "--vllm-args need --vllm-python and --model"),
        (["--vllm-env", "A=1"], "--vllm-env need --vllm-python and --model"),
        (["--vllm-python", PY, "--model", "/m", "--vllm-env", "NOVALUE"], "got 'NOVALUE'"),
        (["--vllm-python", "/no/such/python", "--model", "/m"], "/no/such/python: no such"),
        (["--vllm-python", PY, "--model", "/m", "--vllm-args", "'open"], "'open\": No closing"),
        (["--vllm-python", PY, "--model", "/m", "--vllm-args=--api-key k"], "--api-key"),
        (
            ["--vllm-python", PY, "--model", "/m", "--inject-fault", "engine-death"],
            "not with real vLLM servers: --inject-fault engine-death",
        ),
        (["--vllm-python", PY, "--model", "/m", "--http"], "not with real vLLM servers: --http"),
        (
            ["--sglang-python", PY, "--vllm-python", PY, "--model", "/m", "--sabotage"],
            "not with real SGLang and vLLM servers: --sabotage",
        ),
        (["--vllm-python", PY, "--model", "/m", "--router", "launch"], "--router launch: not"),
        (
            ["--sglang-python", PY, "--vllm-python", PY, "--model", "/m", "--groups", "3"],
            "--groups 3: a mixed fleet has one SGLang group and one vLLM group",
        ),
    ],
)
def test_bad_real_server_options_are_refused_naming_the_value(
    argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        checked(*argv)


def test_each_group_of_real_servers_is_named_after_its_kind_and_launched_as_one() -> None:
    from rollout_lifecycle import LaunchedSGLangEngine, LaunchedVLLMEngine

    assert group_kinds(checked()) == [("group0", "simulated"), ("group1", "simulated")]
    assert group_kinds(checked("--http", "--groups", "1")) == [("group0", "standin")]
    mixed = checked(
        "--sglang-python", PY, "--vllm-python", PY, "--model", "/m",
        "--vllm-args", "--enforce-eager --dtype float32", "--vllm-env", "OMP_NUM_THREADS=1",
    )  # fmt: skip
    assert group_kinds(mixed) == [("sglang0", "sglang"), ("vllm0", "vllm")]
    assert (mixed.groups, mixed.engines, mixed.requests) == (2, 1, 6)
    vllm = _launcher(mixed, "vllm", 8000, "vllm0-0")()
    assert isinstance(vllm, LaunchedVLLMEngine)
    assert vllm.command == [
        PY, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
        "--host", "127.0.0.1", "--port", "8000", "--enforce-eager", "--dtype", "float32",
    ]  # fmt: skip
    assert mixed.server_env == {"sglang": {}, "vllm": {"OMP_NUM_THREADS": "1"}}
    assert isinstance(_launcher(mixed, "sglang", 8001, "sglang0-0")(), LaunchedSGLangEngine)
    two = checked("--vllm-python", PY, "--model", "/m", "--groups", "2")
    assert group_kinds(two) == [("vllm0", "vllm"), ("vllm1", "vllm")]
    assert (two.engines, two.requests) == (2, 6)


#: An interpreter for the demo to launch "servers" with: it runs the library's stand-ins of
#: vLLM and SGLang where the demo asks for ``vllm.entrypoints.openai.api_server`` or
#: ``sglang.launch_server``, after writing down how it was started.
FAKE_PYTHON = """\
#!{python}
import json, os, sys
argv = sys.argv[1:]
module, port = argv[1], argv[argv.index("--port") + 1]
with open(os.path.join({log!r}, port + ".json"), "w") as f:
    json.dump({{"argv": argv, "env": os.environ.get("DEMO_TEST_ENV"), "pid": os.getpid()}}, f)
if module == "vllm.entrypoints.openai.api_server":
    assert os.environ["VLLM_SERVER_DEV_MODE"] == "1"
    run = ["rollout_lifecycle.testing.standin.vllm_app", "--engine-options",
           json.dumps({{"token_latency": 0.004}})]
else:
    run = ["rollout_lifecycle.cli", "fake-sglang", "--token-latency", "0.004"]
os.execv({python!r}, [{python!r}, "-m", *run, "--port", port])
"""


def test_a_mixed_fleet_runs_an_sglang_group_and_a_vllm_group_and_stops_their_servers(
    ray_cluster: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    log = tmp_path / "launched"
    log.mkdir()
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    model = tmp_path / "model"  # (the vLLM stand-in reloads weights from a folder)
    model.mkdir()
    code, out, err = demo(
        capsys, "--sglang-python", str(fake), "--vllm-python", str(fake), "--model", str(model),
        "--vllm-env", "DEMO_TEST_ENV=vllm", "--sglang-env", "DEMO_TEST_ENV=sglang",
        "--vllm-args=--enforce-eager", "--steps", "2", "--requests", "4", "--out", str(tmp_path),
    )  # fmt: skip
    assert code == 0, out + err
    assert "demo: a mixed fleet: 1 real SGLang server(s) and 1 real vLLM server(s)" in out
    assert "groups: sglang0 = real SGLang servers, vllm0 = real vLLM servers" in out
    for group in ("sglang0 (real SGLang server x1)", "vllm0 (real vLLM server x1)"):
        assert f"group {group}: cycled in 2/2 step(s), 4/4 requests done, 0 lost" in out, out
    assert re.search(r"checked \d+ engine ops across 2 engines .*: all invariants held", out)
    launched = [json.loads(p.read_text()) for p in log.iterdir()]
    assert sorted((r["argv"][1], r["env"]) for r in launched) == [
        ("sglang.launch_server", "sglang"),
        ("vllm.entrypoints.openai.api_server", "vllm"),
    ]
    assert all(r["argv"][-1] == "--enforce-eager" for r in launched if r["env"] == "vllm")
    files = assert_outputs(tmp_path)
    trace, metrics = files["trace"], files["metrics"]
    assert isinstance(trace, dict) and isinstance(metrics, dict)
    kinds = {"sglang0": "real SGLang server", "vllm0": "real vLLM server"}
    assert trace["otherData"]["engine_kinds"] == kinds
    groups = {e["args"]["group"] for e in trace["traceEvents"] if e.get("cat") == "engine_call"}
    assert groups == {"sglang0", "vllm0"}
    assert metrics["groups"] == {"sglang0": "sglang", "vllm0": "vllm"}
    stopped = re.findall(r"stopped 1 (SGLang|vLLM) server\(s\): pid (\d+) exit", err)
    assert sorted(kind for kind, _ in stopped) == ["SGLang", "vLLM"], err
    assert {int(pid) for _, pid in stopped} == {r["pid"] for r in launched}
    for _, pid in stopped:  # the demo ended the processes it launched
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
