"""``rollout-lifecycle demo`` on real SGLang 0.5.23 servers it launches itself: the steps run
with requests decoding, the checks hold, the files are written (as ``ci/demo`` checks them) and
the servers are gone afterwards."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from real.servers import CPU_FLAGS, RealSGLang

from rollout_lifecycle import mermaid

pytestmark = pytest.mark.real_sglang

CLI = str(Path(sys.executable).with_name("rollout-lifecycle"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REQUESTS = 4


def test_the_demo_runs_its_steps_on_real_servers_it_launches_and_stops(
    real_sglang: RealSGLang, tmp_path: Path
) -> None:
    out = tmp_path / "demo-output"
    # The CPU shim is this test tier's, not the package's: it reaches the servers as
    # environment, the CPU flags as extra server arguments.
    env = [a for k, v in real_sglang.child_env().items() for a in ("--sglang-env", f"{k}={v}")]
    command = [
        CLI,
        "demo",
        "--sglang-python",
        real_sglang.python,
        "--model",
        real_sglang.model,
        f"--sglang-args={shlex.join(CPU_FLAGS)}",
        *env,
        "--steps",
        "2",
        "--requests",
        str(REQUESTS),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    assert "1 group(s) x 2 real SGLang server(s)" in done.stdout
    assert "fault scenarios (slow-flush, flush-reject, engine-death) are left out" in done.stdout
    assert re.search(
        r"checked \d+ engine ops across 2 engines \(as the library's timeline recorded them\): "
        r"all invariants held; final state serving, weight version step-2",
        done.stdout,
    ), printed
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"^\s+[12] ", line)]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(r[8] == str(REQUESTS) for r in rows), printed  # every request done
    assert "step 1/2 offload" in done.stderr and "step 2/2 onload_kv" in done.stderr

    trace = json.loads((out / "trace.json").read_text())
    calls = [e for e in trace["traceEvents"] if e.get("cat") == "engine_call"]
    assert calls and all(e["ph"] == "X" and e["dur"] >= 0 for e in calls)
    assert {e["name"] for e in calls} >= {
        "pause_generation",
        "flush_cache",
        "release_memory_occupation",
        "resume_memory_occupation",
        "continue_generation",
    }
    png = (out / "timeline.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000
    assert (out / "lifecycle.mmd").read_text() == mermaid()
    metrics = json.loads((out / "metrics.json").read_text())
    assert [s["step"] for s in metrics["steps"]] == [1, 2]
    assert all("lifecycle/offload/release_s" in s["metrics"] for s in metrics["steps"])

    ready = re.search(r"SGLang server\(s\) ready in [\d.]+s: (.*)$", done.stderr, flags=re.M)
    assert ready, done.stderr
    urls = ready.group(1).split(", ")
    assert len(urls) == 2
    for url in urls:  # the demo stopped the servers it launched
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/ready", timeout=5)
