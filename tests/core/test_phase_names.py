"""Every phase is named once, by a ``Phase`` member: what the runner runs, what hooks, metrics and
``PhaseFailed`` name, and what the core writes (no phase named by a string literal)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from rollout_lifecycle import (
    HOOK_EVENTS,
    HOOK_PHASES,
    EngineGroup,
    FromDisk,
    LifecycleConfig,
    PhaseFailed,
    RolloutServer,
    SimulatedEngine,
)
from rollout_lifecycle.core.runner import PhaseRunner
from rollout_lifecycle.core.states import Phase
from rollout_lifecycle.testing.fleets import faulty_engines

CORE = Path(__file__).resolve().parents[2] / "rollout_lifecycle" / "core"
#: The calls whose first argument (or ``phase=``) names a phase.
PHASE_TAKERS = {
    "run",
    "require",
    "settle",
    "before",
    "survey",
    "close_sessions",
    "read",
    "advance",
    "PhaseFailed",
    "PhaseResult",
}


async def test_every_phase_a_cycle_a_failure_and_a_recovery_run_is_a_phase_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []
    settle = PhaseRunner.settle

    async def spy(self: PhaseRunner, phase: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(phase)
        return await settle(self, phase, *args, **kwargs)

    monkeypatch.setattr(PhaseRunner, "settle", spy)
    engines = faulty_engines(3, "a")
    server = RolloutServer([EngineGroup("actor", engines)], LifecycleConfig())
    await server.offload()
    await server.onload_weights()
    await server.update_weights(FromDisk("/ckpt/step1"), "v1", verify=True)
    await server.onload_kv()
    engines[1].arm("flush_cache", "reject")
    with pytest.raises(PhaseFailed) as failed:
        await server.offload()
    assert type(failed.value.phase) is Phase and failed.value.phase is Phase.FLUSH
    await server.reset()
    await engines[2].inner.close()
    await server.probe()
    await server.recover(lambda engine_id: SimulatedEngine(engine_id, token_latency=0.001))
    assert seen and all(type(p) is Phase for p in seen), [p for p in seen if type(p) is not Phase]
    ran = set(seen)
    assert {Phase.PAUSE, Phase.FLUSH, Phase.RELEASE, Phase.RESUME_WEIGHTS} <= ran
    assert {Phase.VERIFY_WEIGHTS, Phase.CHECK_VERSIONS, Phase.CONTINUE} <= ran
    assert {Phase.CONTINUE_AFTER_FAILURE, Phase.PROBE, Phase.RECOVER_SURVEY} <= ran
    assert set(server.metrics) >= {
        f"lifecycle/onload_weights/{Phase.RESUME_WEIGHTS.metric}_s",
        f"lifecycle/update_weights/{Phase.PUSH.metric}_s",
    }
    for engine in engines:
        await engine.close()


def test_hook_events_and_metric_names_come_from_the_phases() -> None:
    assert all(type(p) is Phase for p in HOOK_PHASES)
    assert [e for e in HOOK_EVENTS if e.startswith(("before_", "after_"))] == [
        f"{when}_{p.value}" for p in HOOK_PHASES for when in ("before", "after")
    ]
    assert (Phase.RESUME_WEIGHTS.metric, Phase.RESUME_KV.metric, Phase.PUSH.metric) == (
        "weights",
        "kv",
        "update",
    )
    assert Phase.FLUSH.metric == "flush" and f"{Phase.FLUSH}" == str(Phase.FLUSH) == "flush"


def test_no_phase_is_named_by_a_string_literal_in_the_core() -> None:
    names = {p.value for p in Phase}
    found = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called not in PHASE_TAKERS:
                continue
            args = [*node.args, *(k.value for k in node.keywords if k.arg in ("phase", "name"))]
            for arg in args:
                if isinstance(arg, ast.Constant) and arg.value in names:
                    found.append(f"{path.name}:{node.lineno}: {called}({arg.value!r})")
    assert not found, "phases named by a string: " + "; ".join(found)
