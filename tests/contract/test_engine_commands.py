"""The typed engine commands (``contract/commands``): each is checked once, where it is made, and
its ``args`` are what its ``EngineHost`` method takes."""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Any, ClassVar

import pytest

from rollout_lifecycle import (
    EngineGroup,
    EngineRejected,
    InvalidArgument,
    PauseMode,
    RolloutServer,
    Tag,
)
from rollout_lifecycle.backends.engine import EngineHost, LocalSeam
from rollout_lifecycle.contract import commands as c
from rollout_lifecycle.contract.ops import RUN, Op
from rollout_lifecycle.core.commands import COMMANDS
from rollout_lifecycle.core.runner import Plan, issue
from rollout_lifecycle.testing import SimulatedEngine

#: One command of every kind, with arguments where it takes some.
EVERY_KIND: list[c.EngineCommand] = [
    c.Pause(PauseMode.RETRACT),
    c.Continue(),
    c.Flush(2.0, 0.05),
    c.Release((Tag.WEIGHTS, Tag.KV_CACHE)),
    c.Resume((Tag.KV_CACHE,)),
    c.BeginUpdate(),
    c.EndUpdate(),
    c.SetVersion("v7"),
    c.UpdateFromDisk("/ckpt/step-7", "v7"),
    c.UpdateFromTensor(("AAAA",), None),
    c.UpdateFromDistributed(("w",), ("bfloat16",), ((2, 3),), "g", "v7", "direct"),
    c.JoinGroup("127.0.0.1", 29500, 1, 3, "g", "gloo"),
    c.LeaveGroup("g"),
    c.Observe(paused=False, purpose="identify", identify=True),
    c.ReadServerInfo(),
    c.ReadVersion(),
    c.ReadFingerprint(),
    c.ReadWorkerUrl(),
    c.ReadMemory(),
    c.ReadSleeping(),
    c.ReadLabel(),
    c.ReadHistory(),
    c.ReadState(),
    c.ReadStats(),
    c.Generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}),
    c.Abort("rid-1"),
    c.Close(),
]


def test_every_operation_has_one_command_kind_and_every_kind_is_listed_here() -> None:
    kinds = {type(cmd) for cmd in EVERY_KIND}
    public = {
        kind
        for name in c.__all__
        if isinstance(kind := getattr(c, name), type) and kind is not c.EngineCommand
    }
    assert kinds == public == set(c.KINDS.values())
    assert len({cmd.op for cmd in EVERY_KIND}) == len(EVERY_KIND)  # one kind per operation
    assert set(c.KINDS) == set(Op)


def test_the_lifecycle_reads_are_the_commands_that_say_they_read() -> None:
    assert {op for op, meaning in COMMANDS.items() if meaning.reads} == c.READ_OPS
    assert {cmd.op for cmd in EVERY_KIND if cmd.reads} == c.READ_OPS
    assert Op.PAUSE not in c.READ_OPS and Op.WEIGHT_VERSION in c.READ_OPS


#: Where a host method's parameter has another name than the command's field.
HOST_NAMES = {"weight_version": "version", "serialized_named_tensors": "payload"}
#: Host parameters no command field feeds: the engine's own flush, which the lifecycle never
#: asks of a write (it flushes every engine once all have the weights).
FIXED = {"flush_cache": False}


def plain(value: Any) -> Any:
    """``value`` as it crosses the seam: enums as their values, sequences as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value


@pytest.mark.parametrize("command", EVERY_KIND, ids=lambda cmd: type(cmd).__name__)
def test_the_args_of_a_command_are_what_its_host_method_takes(command: c.EngineCommand) -> None:
    """Each field of the command reaches the host parameter of its name, in plain values."""
    method = getattr(EngineHost, command.op.value, None)
    if method is None:  # the host does not adapt it: the backend's method takes the args
        assert command.args == () and dataclasses.fields(command) == ()
        return
    bound = inspect.signature(method).bind(None, *command.args)  # raises on a wrong arity
    fields = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
    fields.pop("_args", None)
    for name, value in list(bound.arguments.items())[1:]:
        # plain values only: they cross Ray and a process boundary as they are
        assert type(value) in (str, int, float, bool, list, dict, type(None)), (name, value)
        field = HOST_NAMES.get(name, name)
        if field in fields:
            assert value == plain(fields.pop(field)), name
        else:
            assert FIXED[name] == value, name
    assert fields == {}, "fields that reach no parameter"


async def test_a_release_command_moves_its_tags_on_the_engine_through_the_host() -> None:
    engine = SimulatedEngine("e", token_latency=0.001)
    server = RolloutServer([EngineGroup("g", [engine])])
    await server.pause()
    (record,) = server.groups[0].records
    command = c.Release((Tag.KV_CACHE, Tag.CUDA_GRAPH))
    calls = issue(Plan(command, (record,)))
    await calls.refs[0]
    assert sorted(engine.released_tags) == ["cuda_graph", "kv_cache"]
    await engine.close()


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: c.Pause("sideways"), "unknown pause mode 'sideways'"),
        (lambda: c.Release(()), "release_memory_occupation tags is empty"),
        (lambda: c.Resume(("weights", "weights")), "'weights' appears twice"),
        (lambda: c.Release(("kv",)), "unknown memory tag 'kv'"),
        (lambda: c.Release("weights"), "got the string 'weights'"),
        (lambda: c.SetVersion("v1\nforged"), "weight version must hold printable"),
        (lambda: c.SetVersion(""), "weight version must be a non-blank string"),
        (lambda: c.Flush(-1.0, 0.05), "flush deadline"),
        (lambda: c.UpdateFromDisk(""), "model_path must be a non-blank string"),
        (lambda: c.UpdateFromTensor("AAAA"), "payload must be a sequence of strings"),
        (lambda: c.UpdateFromTensor((b"AAAA",)), "payload must hold strings only"),
    ],
)
def test_a_command_refuses_a_bad_value_where_it_is_made_naming_it(make: Any, named: str) -> None:
    with pytest.raises(InvalidArgument, match=named.replace("(", r"\(")):
        make()


def test_a_command_normalises_what_it_was_given_and_tells_its_tags_and_mode() -> None:
    pause = c.Pause("abort")  # type: ignore[arg-type]
    assert pause.mode is PauseMode.ABORT and pause.args == ("abort",) and pause.tags == ()
    release = c.Release(("weights", "kv_cache"))  # type: ignore[arg-type]
    assert release.tags == (Tag.WEIGHTS, Tag.KV_CACHE) and release.mode is None
    assert release.args == (["weights", "kv_cache"],)
    assert release == c.Release((Tag.WEIGHTS, Tag.KV_CACHE))  # equal by value
    assert c.Continue().op is Op.CONTINUE and c.Continue().args == ()


class Sleepy(SimulatedEngine):
    """A simulated engine with one method of its own that the host does not adapt."""

    async def is_sleeping(self) -> bool:
        return bool(self.released_tags)


async def test_the_host_runs_a_command_it_does_not_adapt_on_the_backends_method() -> None:
    """``EngineHost.run``: the host's own method where it has one, else the backend's of the
    operation's name, else a 501 refusal naming it; anything but a command is refused."""
    host = EngineHost(Sleepy("e", token_latency=0.001))
    assert await host.run(*c.ReadLabel().wire) == "e"  # the host's own method

    class IsSleeping(c.EngineCommand):
        op: ClassVar[Any] = FakeOp("is_sleeping")
        reads = True

    assert await host.run(*IsSleeping().wire) is False  # the backend's
    plain = EngineHost(SimulatedEngine("p", token_latency=0.001))
    with pytest.raises(EngineRejected, match="does not support it") as refused:
        await plain.run(*IsSleeping().wire)
    assert refused.value.status == 501
    with pytest.raises(InvalidArgument, match="'pause' is not an engine operation"):
        await host.run("pause", "abort")
    with pytest.raises(InvalidArgument, match="'label' is not an operation checked"):
        await host.checked([None, None, False], *c.ReadLabel().wire)
    for engine in (host.backend, plain.backend):
        await engine.close()  # type: ignore[attr-defined]


async def test_the_in_process_seam_carries_a_command_as_run_does_and_refuses_the_same() -> None:
    """``LocalSeam.send`` calls the host's method of a command at once (no ``run`` coroutine
    between), with ``run``'s refusals: anything but a command fails the call, not the send."""
    host = EngineHost(SimulatedEngine("e", token_latency=0.001))
    local = LocalSeam()
    assert await local.send(host, RUN, c.ReadLabel().wire) == "e"
    await local.send(host, RUN, c.Pause(PauseMode.RETRACT).wire)
    assert host.backend.paused  # type: ignore[attr-defined]
    refused = local.send(host, RUN, ("pause", "abort"))  # (sent: the call is what fails)
    with pytest.raises(InvalidArgument, match="'pause' is not an engine operation"):
        await refused
    await host.backend.close()  # type: ignore[attr-defined]


class FakeOp(str):
    """An operation name the ``Op`` enum does not have (``run`` reads ``_value_``)."""

    @property
    def _value_(self) -> str:
        return str(self)
