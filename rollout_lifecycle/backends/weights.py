"""Built-in weight-update strategies for ``RolloutServer.update_weights``.

Each is a callable taking the ``WeightUpdate`` the server passes to a push: it writes to every
engine in parallel, with ``flush_cache`` and ``abort_all_requests`` false (the server flushes
the prefix cache itself once every engine has the new weights), and names every engine that
failed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rollout_lifecycle.backends.tensor_payload import check_tensor_payloads
from rollout_lifecycle.contract.commands import (
    EngineCommand,
    JoinGroup,
    LeaveGroup,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensor,
)
from rollout_lifecycle.contract.exceptions import InvalidArgument, WeightPushFailed
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.push import WeightUpdate
from rollout_lifecycle.contract.seam import classify, command
from rollout_lifecycle.contract.values import check_int, check_strings


async def _write_all(
    strategy: str, update: WeightUpdate, commands: Mapping[str, EngineCommand]
) -> None:
    """Send each engine its command, all at once; ``WeightPushFailed`` naming every engine
    whose command failed, and how."""
    ids = list(commands)
    results = await asyncio.gather(
        *(command(update.engines[i], commands[i]) for i in ids),
        return_exceptions=True,
    )
    failures = {
        i: str(classify(r))
        for i, r in zip(ids, results, strict=True)
        if isinstance(r, BaseException)
    }
    if failures:
        raise WeightPushFailed(strategy, failures)


def _nonempty(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string, got {value!r}")
    return value


def _shape(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{name} must be a sequence of ints, got {value!r}")
    dims = tuple(value)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise InvalidArgument(f"{name} must hold ints >= 0, got {dim!r}")
    return dims


@dataclass(frozen=True)
class FromDisk:
    """Every engine loads ``model_path`` (``/update_weights_from_disk``)."""

    model_path: str
    #: What it sends each engine (``WeightPush``).
    sends: ClassVar[frozenset[Op]] = frozenset({Op.UPDATE_FROM_DISK})

    def __post_init__(self) -> None:
        _nonempty("model_path", self.model_path)

    async def __call__(self, update: WeightUpdate) -> None:
        load = UpdateFromDisk(self.model_path, update.version)
        await _write_all("FromDisk", update, dict.fromkeys(update.engines, load))


@dataclass(frozen=True)
class FromTensor:
    """Every engine receives serialized tensors (``/update_weights_from_tensor``).

    ``payload`` is one list of base64 strings (one per tensor-parallel rank) for every engine,
    or a mapping from engine id to its own list.
    """

    payload: Sequence[str] | Mapping[str, Sequence[str]]
    #: What it sends each engine (``WeightPush``).
    sends: ClassVar[frozenset[Op]] = frozenset({Op.UPDATE_FROM_TENSOR})

    def __post_init__(self) -> None:
        payload = self.payload
        if isinstance(payload, str | bytes) or not isinstance(payload, Sequence | Mapping):
            raise InvalidArgument(
                f"payload must be a list of serialized tensors or a mapping of them by engine id, "
                f"got {payload!r}"
            )
        if isinstance(payload, Mapping):
            for engine, tensors in payload.items():
                if not isinstance(engine, str):
                    raise InvalidArgument(f"payload keys must be engine ids, got {engine!r}")
                check_tensor_payloads(
                    f"payload[{engine!r}]", list(check_strings(f"payload[{engine!r}]", tensors))
                )
        else:
            check_tensor_payloads("payload", list(check_strings("payload", payload)))

    async def __call__(self, update: WeightUpdate) -> None:
        if isinstance(self.payload, Mapping):
            missing = sorted(set(update.engines) - set(self.payload))
            if missing:
                raise InvalidArgument(f"FromTensor has no payload for engines {missing}")
            writes = {
                i: UpdateFromTensor(tuple(self.payload[i]), update.version) for i in update.engines
            }
        else:
            write = UpdateFromTensor(tuple(self.payload), update.version)
            writes = dict.fromkeys(update.engines, write)
        await _write_all("FromTensor", update, writes)


@dataclass(frozen=True)
class FromDistributed:
    """Every engine receives tensors over collective group ``group_name``
    (``/update_weights_from_distributed``, with ``load_format``); the trainer broadcasts them
    meanwhile.

    The group must exist on every engine. Either it was made beforehand (``EngineHost.
    init_weights_update_group``), or give ``master_address``, ``master_port``, ``world_size``
    and ``rank_offsets`` (engine id -> the engine's first rank; the trainer is rank 0): then
    every engine joins the group (``/init_weights_update_group``, ``backend``) before the write
    and leaves it (``/destroy_weights_update_group``) after, and the trainer must join its own
    side (``torch.distributed`` with the same address, port, world size and group name) while
    the push runs.
    """

    names: Sequence[str]
    dtypes: Sequence[str]
    shapes: Sequence[Sequence[int]]
    group_name: str
    load_format: str | None = None
    master_address: str | None = None
    master_port: int | None = None
    world_size: int | None = None
    rank_offsets: Mapping[str, int] | None = None
    backend: str = "nccl"

    def __post_init__(self) -> None:
        _nonempty("group_name", self.group_name)
        check_strings("names", self.names)
        check_strings("dtypes", self.dtypes)
        if isinstance(self.shapes, str | bytes | Mapping) or not isinstance(self.shapes, Sequence):
            raise InvalidArgument(f"shapes must be a sequence of shapes, got {self.shapes!r}")
        for i, shape in enumerate(self.shapes):
            _shape(f"shapes[{i}]", shape)
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)) or not self.names:
            raise InvalidArgument(
                f"names, dtypes and shapes must be non-empty and of one length, got "
                f"{len(self.names)}, {len(self.dtypes)} and {len(self.shapes)}"
            )
        if self.load_format is not None:
            _nonempty("load_format", self.load_format)
        _nonempty("backend", self.backend)
        group = (self.master_address, self.master_port, self.world_size, self.rank_offsets)
        if any(v is not None for v in group) and any(v is None for v in group):
            raise InvalidArgument(
                "master_address, master_port, world_size and rank_offsets go together: give "
                "all four for the engines to join the group, or none if it exists already"
            )
        if self.master_address is not None:
            _nonempty("master_address", self.master_address)
        if self.master_port is not None:
            check_int("master_port", self.master_port, minimum=1, maximum=65535)
        if self.world_size is not None:
            check_int("world_size", self.world_size, minimum=2)
        if self.rank_offsets is not None:
            if not isinstance(self.rank_offsets, Mapping):
                raise InvalidArgument(
                    f"rank_offsets must map engine ids to ranks, got {self.rank_offsets!r}"
                )
            assert self.world_size is not None
            for engine, rank in self.rank_offsets.items():
                if not isinstance(engine, str):
                    raise InvalidArgument(f"rank_offsets keys must be engine ids, got {engine!r}")
                check_int(f"rank_offsets[{engine!r}]", rank, minimum=1, maximum=self.world_size - 1)

    @property
    def sends(self) -> frozenset[Op]:
        """What it sends each engine (``WeightPush``): the write, and the group's join and
        leave when it makes the group."""
        if self.rank_offsets is None:
            return frozenset({Op.UPDATE_FROM_DISTRIBUTED})
        return frozenset(
            {Op.INIT_UPDATE_GROUP, Op.UPDATE_FROM_DISTRIBUTED, Op.DESTROY_UPDATE_GROUP}
        )

    async def __call__(self, update: WeightUpdate) -> None:
        receive = UpdateFromDistributed(
            tuple(self.names),
            tuple(self.dtypes),
            tuple(tuple(s) for s in self.shapes),
            self.group_name,
            update.version,
            self.load_format,
        )
        writes = dict.fromkeys(update.engines, receive)
        if self.rank_offsets is None:
            await _write_all("FromDistributed", update, writes)
            return
        missing = sorted(set(update.engines) - set(self.rank_offsets))
        if missing:
            raise InvalidArgument(f"FromDistributed has no rank offset for engines {missing}")
        assert self.master_address is not None and self.master_port is not None
        assert self.world_size is not None
        join = {
            i: JoinGroup(
                self.master_address,
                self.master_port,
                self.rank_offsets[i],
                self.world_size,
                self.group_name,
                self.backend,
            )
            for i in update.engines
        }
        # sglang: io_struct.py InitWeightsUpdateGroupReqInput, DestroyWeightsUpdateGroupReqInput
        try:
            await _write_all("FromDistributed", update, join)
            await _write_all("FromDistributed", update, writes)
        except BaseException:
            # The first failure is the one to report; leaving is best effort then.
            with contextlib.suppress(WeightPushFailed):
                await _leave(update, self.group_name)
            raise
        await _leave(update, self.group_name)


async def _leave(update: WeightUpdate, group_name: str) -> None:
    await _write_all(
        "FromDistributed", update, dict.fromkeys(update.engines, LeaveGroup(group_name))
    )
