"""``rollout-lifecycle demo`` on a mixed fleet it launches itself: one real SGLang 0.5.23 server
and one real vLLM 0.32.0 server, a group each in the same ``RolloutServer``. The steps run with
requests decoding on both, the checks hold across both groups, the files are written (as
``ci/demo`` checks them) and every server process is gone afterwards.

One run proves the SGLang demo and the vLLM demo together (a vLLM server takes 60-90 s to
start): it runs in the tier that has both engines (``real_vllm``, ``ci/real-vllm``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from real.servers import CPU_FLAGS, VLLM_CPU_FLAGS, RealSGLang, require_real_vllm, running_in_group

from rollout_lifecycle import mermaid

pytestmark = pytest.mark.real_vllm

CLI = str(Path(sys.executable).with_name("rollout-lifecycle"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Per step, sent to the two groups in turn.
REQUESTS = 4
#: What every engine receives in the two steps: each op of the cycle once a step (the resume
#: twice: the weights, then the KV cache).
CYCLE = {
    "pause_generation": 2,
    "flush_cache": 2,
    "release_memory_occupation": 2,
    "resume_memory_occupation": 4,
    "continue_generation": 2,
}


def test_the_demo_runs_a_mixed_sglang_and_vllm_fleet_it_launches_and_stops(
    real_sglang: RealSGLang, tmp_path: Path
) -> None:
    real_vllm = require_real_vllm()
    assert real_vllm.model == real_sglang.model  # the tiny model, for both kinds
    out = tmp_path / "demo-output"
    # The CPU shim and flags are this test tier's, not the package's: they reach the servers
    # as environment and extra server arguments, for each kind its own.
    env = [a for k, v in real_sglang.child_env().items() for a in ("--sglang-env", f"{k}={v}")]
    env += [a for k, v in real_vllm.child_env().items() for a in ("--vllm-env", f"{k}={v}")]
    command = [
        CLI, "demo", "--model", real_sglang.model,
        "--sglang-python", real_sglang.python, f"--sglang-args={shlex.join(CPU_FLAGS)}",
        "--vllm-python", real_vllm.python, f"--vllm-args={shlex.join(VLLM_CPU_FLAGS)}",
        *env, "--steps", "2", "--requests", str(REQUESTS), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    assert "a mixed fleet: 1 real SGLang server(s) and 1 real vLLM server(s)" in done.stdout
    assert "groups: sglang0 = real SGLang servers, vllm0 = real vLLM servers" in done.stdout
    assert "fault scenarios (slow-flush, flush-reject, engine-death) are left out" in done.stdout
    assert re.search(
        r"checked \d+ engine ops across 2 engines \(as the library's timeline recorded them\): "
        r"all invariants held; final state serving, weight version step-2",
        done.stdout,
    ), printed
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"^\s+[12] ", line)]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(r[8] == str(REQUESTS) for r in rows), printed  # every request done
    # Both groups ran every step's whole cycle and lost no request.
    for group in ("sglang0 (real SGLang server x1)", "vllm0 (real vLLM server x1)"):
        line = f"group {group}: cycled in 2/2 step(s), {REQUESTS}/{REQUESTS} requests done, 0 lost"
        assert line in done.stdout, printed
    assert "step 1/2 offload" in done.stderr and "step 2/2 onload_kv" in done.stderr

    trace = json.loads((out / "trace.json").read_text())
    assert trace["otherData"]["engine_kinds"] == {
        "sglang0": "real SGLang server",
        "vllm0": "real vLLM server",
    }
    calls = [e for e in trace["traceEvents"] if e.get("cat") == "engine_call"]
    assert calls and all(e["ph"] == "X" and e["dur"] >= 0 for e in calls)
    for group in ("sglang0", "vllm0"):
        ops = [e["name"] for e in calls if e["args"]["group"] == group]
        ok = [
            e["name"] for e in calls if e["args"]["group"] == group and e["args"]["outcome"] == "ok"
        ]
        assert all(ok.count(op) >= n for op, n in CYCLE.items()), (group, ops)
    png = (out / "timeline.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000
    assert (out / "lifecycle.mmd").read_text() == mermaid()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["groups"] == {"sglang0": "sglang", "vllm0": "vllm"}
    assert [s["step"] for s in metrics["steps"]] == [1, 2]
    assert all("lifecycle/offload/release_s" in s["metrics"] for s in metrics["steps"])

    for kind in ("SGLang", "vLLM"):  # the demo stopped the servers it launched
        ready = re.search(
            rf"1 {kind} server\(s\) ready in [\d.]+s: (\S+) \(pid (\d+)\)$", done.stderr, re.M
        )
        assert ready, done.stderr
        url, pid = ready.group(1), int(ready.group(2))
        assert re.search(rf"stopped 1 {kind} server\(s\): pid {pid} exit -?\d+", done.stderr)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
        # The whole process group ended (vLLM's engine core, SGLang's scheduler: children).
        assert running_in_group(pid) == [], (kind, pid)
