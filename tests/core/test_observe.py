"""The recorder (``core/observe.py``) on its own, fed calls and settled phases by hand: how a
call's phases add up in its metrics, what a call that did not succeed leaves, a phase outside
any call, the resident-memory reads and the call events.

The metrics a real lifecycle call returns, key by key, are ``test_metrics.py``'s; the timeline's
spans and traces are ``test_timeline.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from structlog.testing import capture_logs

from rollout_lifecycle import ALL_TAGS, LifecycleConfig, ServerState
from rollout_lifecycle.contract.commands import EngineCommand
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.core.bus import Bus
from rollout_lifecycle.core.ledger import EngineRecord, Fleet
from rollout_lifecycle.core.observe import Recorder
from rollout_lifecycle.core.runner import PhaseResult
from rollout_lifecycle.core.scope import CURRENT, Operation

S = ServerState


@dataclass
class Group:
    name: str
    needs_offload: bool
    records: tuple[EngineRecord, ...] = field(default=())


class Memory:
    """What each engine answers a memory read, and the reads asked."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.asked: list[tuple[Op, list[str], float]] = []

    async def __call__(
        self, command: EngineCommand, records: Sequence[EngineRecord], deadline: float
    ) -> dict[str, Any]:
        self.asked.append((command.op, [r.id for r in records], deadline))
        return {r.id: self.answers[r.id] for r in records if r.id in self.answers}


def recorder(
    owner: object, memory: Memory | None = None, **config: Any
) -> tuple[Recorder, list[EngineRecord]]:
    records = tuple(EngineRecord(f"actor/{i}", "actor", None) for i in range(3))
    fleet = Fleet([Group("actor", True, records)], ALL_TAGS)
    ask = memory if memory is not None else Memory({})
    made = Recorder(owner, "srv", LifecycleConfig(**config), fleet, lambda: S.SERVING, ask, Bus())
    return made, list(records)


@contextmanager
def inside(owner: object, op: Operation) -> Iterator[None]:
    """Run as part of ``op``, a public call of ``owner``."""
    token = CURRENT.set((owner, op, None))
    try:
        yield
    finally:
        CURRENT.reset(token)


def settled(
    phase: str,
    seconds: float,
    slowest: tuple[str, float] | None = None,
    retries: int | None = None,
) -> PhaseResult:
    return PhaseResult(phase, {}, 100.0, seconds, slowest=slowest, retries=retries)


async def test_a_call_adds_up_a_repeated_phase_and_keeps_its_slowest_engine() -> None:
    owner = object()
    rec, _ = recorder(owner)
    op = Operation("offload")
    await rec.begin(op)
    with inside(owner, op):
        rec.phase(settled("flush", 0.25, ("actor/0", 0.25), retries=1))
        rec.phase(settled("flush", 0.5, ("actor/1", 0.5), retries=2))
        rec.phase(settled("flush", 0.125, ("actor/2", 0.125)))
        rec.phase(settled("resume_weights", 0.75))  # named by its short name
    await rec.end(op, "ok")
    prefix = "lifecycle/offload/"
    assert op.metrics[prefix + "flush_s"] == 0.875
    assert op.metrics[prefix + "flush_retries"] == 3
    assert op.metrics[prefix + "flush_slowest_s"] == 0.5
    assert op.metrics[prefix + "weights_s"] == 0.75
    assert op.metrics[prefix + "total_s"] >= 0
    assert set(op.metrics) == {
        prefix + k for k in ("flush_s", "flush_retries", "flush_slowest_s", "weights_s", "total_s")
    }
    assert rec.metrics == op.metrics
    assert rec.slowest == {prefix + "flush_slowest_s": "actor/1"}
    (call,) = rec.timeline.spans("call")
    assert (call.name, call.outcome) == ("offload", "ok")
    assert [(s.name, s.state) for s in rec.timeline.spans("phase")] == [
        ("flush", "serving"),
        ("flush", "serving"),
        ("flush", "serving"),
        ("resume_weights", "serving"),
    ]


async def test_a_call_that_did_not_succeed_leaves_the_metrics_and_slowest_engines() -> None:
    owner = object()
    rec, _ = recorder(owner)

    async def pause(slowest: str, outcome: str) -> Operation:
        op = Operation("pause")
        await rec.begin(op)
        with inside(owner, op):
            rec.phase(settled("pause", 0.5, (slowest, 0.5)))
        await rec.end(op, outcome)
        return op

    done = await pause("actor/0", "ok")
    kept = (dict(rec.metrics), dict(rec.slowest))
    failed = await pause("actor/2", "error")
    assert (
        (rec.metrics, rec.slowest)
        == kept
        == (done.metrics, {"lifecycle/pause/pause_slowest_s": "actor/0"})
    )
    assert "lifecycle/pause/total_s" in failed.metrics  # the call itself still reports it
    assert [s.outcome for s in rec.timeline.spans("call")] == ["ok", "error"]


async def test_a_phase_outside_any_call_of_this_server_is_a_call_of_its_own() -> None:
    owner = object()
    rec, _ = recorder(owner)
    rec.phase(settled("observe", 0.5))  # (a probe)
    elsewhere = Operation("offload")
    with inside(object(), elsewhere):  # another server's call in progress
        rec.phase(settled("server_info", 0.25))
    assert elsewhere.metrics == {} and rec.metrics == {}
    calls = rec.timeline.spans("call")
    assert [(c.name, c.outcome, c.call_index) for c in calls] == [
        ("observe", "ok", 1),
        ("server_info", "ok", 2),
    ]
    assert [c.duration for c in calls] == [0.5, 0.25]
    assert [(p.name, p.call) for p in rec.timeline.spans("phase")] == [
        ("observe", "observe"),
        ("server_info", "server_info"),
    ]


async def test_memory_metrics_sum_the_byte_counts_of_the_live_engines() -> None:
    owner = object()
    memory = Memory(
        {
            "actor/0": {"weights": 100, "kv_cache": 40},
            # a flag, a key that is no tag name and a float are no byte counts
            "actor/1": {"weights": 50, "kv_cache": True, 7: 1, "cuda_graph": 2.5},
            "actor/2": {"weights": 1000},
        }
    )
    rec, records = recorder(owner, memory, memory_metrics=True)
    records[2].alive = False  # a dead engine is not asked
    op = Operation("offload")
    await rec.begin(op)
    memory.answers["actor/0"] = None  # answers nothing after the call
    memory.answers["actor/1"] = {"weights": 0, "kv_cache": 0}
    await rec.end(op, "ok")
    probe = LifecycleConfig().deadlines.probe
    assert memory.asked == [(Op.MEMORY, ["actor/0", "actor/1"], probe)] * 2
    bytes_metrics = {k: v for k, v in op.metrics.items() if "bytes" in k}
    assert bytes_metrics == {
        "lifecycle/offload/weights_bytes_before": 150,
        "lifecycle/offload/kv_cache_bytes_before": 40,
        "lifecycle/offload/weights_bytes_after": 0,
        "lifecycle/offload/kv_cache_bytes_after": 0,
    }
    assert all(type(v) is int for v in bytes_metrics.values())


async def test_memory_is_read_only_when_asked_for_and_not_after_a_failed_call() -> None:
    owner = object()
    memory = Memory({"actor/0": {"weights": 100}})
    rec, _ = recorder(owner, memory)
    op = Operation("offload")
    await rec.begin(op)
    await rec.end(op, "ok")
    assert memory.asked == []  # memory metrics are off by default
    rec, _ = recorder(owner, memory, memory_metrics=True)
    op = Operation("offload")
    await rec.begin(op)
    await rec.end(op, "cancelled")
    assert len(memory.asked) == 1  # before the call only
    assert not any("bytes" in k for k in op.metrics)


async def test_each_call_is_logged_at_its_start_and_end() -> None:
    owner = object()
    rec, _ = recorder(owner)
    op = Operation("onload_kv")
    with capture_logs() as logs:
        await rec.begin(op)
        await rec.end(op, "error")
    start, end = (e for e in logs if e["event"] in ("call.start", "call.end"))
    assert start == {
        "event": "call.start",
        "log_level": "info",
        "server": "srv",
        "call": "onload_kv",
        "state": "serving",
    }
    assert (end["event"], end["call"], end["outcome"]) == ("call.end", "onload_kv", "error")
    assert end["duration_s"] == round(op.metrics["lifecycle/onload_kv/total_s"], 6)
