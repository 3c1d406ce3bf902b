"""``EngineGroup``: engines that share a role and an offload policy, and their ledger entries.

A group holds engine handles (Ray actor handles, ``HostedEngine``s or ``EngineHost``s; a bare
backend is wrapped in an ``EngineHost``) and one ``EngineRecord`` per engine. Its methods only
*issue* work, through the phase runner's ``issue``: each checks every targeted engine against
the SGLang contract first (raising ``IllegalEngineOp`` before anything is sent), then returns one
pending call per engine without waiting. A call of ``CHECKED_OPS`` (pause, continue, release,
resume, the begin of a weight-update session, the version) is sent as ``EngineHost.checked``:
its engine first shows who it is and whether it is paused, and the call answers
``[incarnation, result]``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.commands import (
    BeginUpdate,
    Continue,
    EndUpdate,
    EngineCommand,
    Flush,
    Pause,
    ReadServerInfo,
    Release,
    Resume,
    SetVersion,
)
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.ops import Op, as_op
from rollout_lifecycle.contract.values import PauseMode, Tag, check_int, check_name, parse_tags
from rollout_lifecycle.core.ledger import EngineRecord, EngineSnapshot
from rollout_lifecycle.core.runner import Calls, Plan, guard_groups, issue


def spellings(first: Any, second: Any, key: Hashable) -> str:
    """How a message names one engine given twice: both URLs where they differ, and the
    identity they share."""
    urls = [getattr(getattr(h, "backend", None), "url", None) for h in (first, second)]
    if all(isinstance(u, str) for u in urls) and urls[0] != urls[1]:
        return f"{urls[1]} and {urls[0]} reach one server, {shown(key)}"
    return shown(key)


class EngineGroup:
    """A set of engines that share a role and an offload policy.

    ``engines`` are Ray actor handles of ``EngineActor`` (production), ``EngineHost`` objects, or
    bare engine backends (in-process fleets; wrapped in an ``EngineHost``). Groups with
    ``needs_offload=False`` (GPUs not shared with the trainer) are never released.

    ``unit=N`` declares that the engines form units of ``N`` servers, each ``N`` in a row (a
    prefill/decode pair, a replica spread over the servers of several nodes): servers that live
    and die together. A unit serves (to the generation client and the router) only while every
    member serves; a member continues only once every member has its memory back; a member
    dead or with tags in an unknown state makes the whole unit unhealthy
    (``RolloutServer.unhealthy_units``) and ``recover(unit_factory=...)`` replaces the unit
    whole; a verified write fails every member of a unit where one fails. Each member keeps
    its own record, incarnation and claim.

    Engine ids are ``name/index``, the index the engine's place in ``engines`` unless
    ``indexes`` gives each one: a group rebuilt by a new driver after engines joined and left
    (``RolloutServer.add_engines``, ``remove_engines``) takes the ids its journal holds
    (``ServerSnapshot.indexes(group)``), so that it can ``adopt()`` it.
    """

    def __init__(
        self,
        name: str,
        engines: Sequence[Any],
        needs_offload: bool = True,
        unit: int = 1,
        *,
        indexes: Sequence[int] | None = None,
    ) -> None:
        check_name("group name", name, trimmed=True)
        if "/" in name:
            raise InvalidArgument(
                f"group name must not hold '/' (engine ids are name/index), got {name!r}"
            )
        if not isinstance(needs_offload, bool):
            raise InvalidArgument(f"needs_offload must be a bool, got {needs_offload!r}")
        if isinstance(engines, str | bytes) or not isinstance(engines, Sequence):
            raise InvalidArgument(f"engines of group {name!r} must be a sequence, got {engines!r}")
        if not engines:
            raise InvalidArgument(f"group {name!r} has no engines")
        if not isinstance(unit, int) or isinstance(unit, bool) or unit < 1:
            raise InvalidArgument(f"unit of group {name!r} must be an int >= 1, got {unit!r}")
        if len(engines) % unit:
            raise InvalidArgument(
                f"group {name!r} has {len(engines)} engines, not a whole number of units of "
                f"{unit}: give {unit} engines per unit"
            )
        handles: list[Any] = []
        seen: dict[Hashable, int] = {}
        for index, engine in enumerate(engines):
            handle = seam.as_handle(engine, name, index)
            key = seam.identity(handle)
            if key in seen:
                first = handles[seen[key]]
                raise InvalidArgument(
                    f"engine #{index} of group {name!r} is the same engine as engine "
                    f"#{seen[key]} ({spellings(first, handle, key)}); give each engine once"
                )
            seen[key] = index
            handles.append(handle)
        #: Called after the intent of calls that must not repeat is recorded, before they are
        #: sent (``RolloutServer``'s journal).
        self._before_send: Callable[[], None] | None = None
        self._name = name
        self._needs_offload = needs_offload
        self._unit = unit
        numbers = _indexes(name, indexes, len(handles), unit)
        self._records = tuple(
            EngineRecord(id=f"{name}/{i}", group=name, handle=h)
            for i, h in zip(numbers, handles, strict=True)
        )
        #: The index the next engine added takes (ids are never given twice).
        self._next = max(numbers) + 1
        for start in range(0, len(self._records), unit) if unit > 1 else ():
            members = self._records[start : start + unit]
            for record in members:
                record.joins(members)

    def __repr__(self) -> str:
        units = f", unit={self._unit}" if self._unit > 1 else ""
        return (
            f"EngineGroup({self._name!r}, engines={len(self._records)}, "
            f"needs_offload={self._needs_offload}{units})"
        )

    @property
    def name(self) -> str:
        """The group's name; engine ids are ``name/index``."""
        return self._name

    @property
    def needs_offload(self) -> bool:
        """True when the group's GPUs are shared with the trainer."""
        return self._needs_offload

    @property
    def unit(self) -> int:
        """How many servers make one unit of this group (1: each engine is a unit alone)."""
        return self._unit

    @property
    def engines(self) -> tuple[Any, ...]:
        """The engine handles, in order."""
        return tuple(r.handle for r in self._records)

    @property
    def records(self) -> tuple[EngineRecord, ...]:
        """The ledger entries of the group's engines."""
        return self._records

    def replace(self, record: EngineRecord, engine: Any) -> Any:
        """Put a new engine in ``record``'s slot, known to hold all its memory and to serve.

        Returns the old handle. The replacement counts as stale until it receives weights.
        """
        if record not in self._records:
            raise InvalidArgument(f"engine {record.id} is not in group {self._name!r}")
        index = self._records.index(record)
        handle = seam.as_handle(engine, self._name, index)
        key = seam.identity(handle)
        if any(r.key == key for r in self._records if r is not record):
            raise InvalidArgument(f"the replacement for {record.id} is already in the group")
        old = record.handle
        record.renew(handle)
        return old

    def add(self, engines: Sequence[Any], taken: Mapping[Hashable, str]) -> list[EngineRecord]:
        """Records for ``engines`` joining the group (``core/membership``), each a fresh server
        stale until it receives the fleet's weights (as a replacement is), with the next ids
        (``name/index``; an index is never given twice). ``taken``: the engines of the fleet
        by identity; ``InvalidArgument``, nothing added, for an engine given twice or there
        already."""
        if self._unit > 1:
            raise InvalidArgument(
                f"group {self._name!r} is made of units of {self._unit} servers: engines join "
                f"and leave it whole units at a time, which add_engines does not do yet"
            )
        if isinstance(engines, str | bytes) or not isinstance(engines, Sequence) or not engines:
            raise InvalidArgument(f"engines must be a non-empty sequence, got {engines!r}")
        seen = dict(taken)
        records = []
        for offset, engine in enumerate(engines):
            index = self._next + offset
            handle = seam.as_handle(engine, self._name, index)
            key = seam.identity(handle)
            if key in seen:
                raise InvalidArgument(
                    f"engine #{offset} given to join group {self._name!r} is {seen[key]} "
                    f"already ({shown(key)}); give each engine once"
                )
            seen[key] = f"engine #{offset} given to join"
            record = EngineRecord(id=f"{self._name}/{index}", group=self._name, handle=handle)
            record.renew(handle)
            records.append(record)
        self._next += len(records)
        self._records = (*self._records, *records)
        return records

    def drop(self, records: Collection[EngineRecord]) -> None:
        """Take ``records`` out of the group (engines leaving, or that did not join)."""
        self._records = tuple(r for r in self._records if r not in records)

    def live(self) -> list[EngineRecord]:
        """Records of the engines not known to be dead."""
        return [r for r in self._records if r.alive]

    # -- issuing ------------------------------------------------------------------------------

    def preflight(self, op: Op | str, tags: Sequence[Tag | str] = ()) -> None:
        """Run the guards of ``op`` on this group's targets without sending anything."""
        guard_groups([self], as_op(op), parse_tags(tags) if tags else ())

    def _run(self, command: EngineCommand) -> Calls:
        return issue(Plan.over([self], command), self._before_send)

    def pause_generation(self, mode: PauseMode) -> Calls:
        """Pause every live engine."""
        return self._run(Pause(mode))

    def flush_cache(self, deadline: float, retry_interval: float) -> Calls:
        """Flush every paused engine, each retrying until ``deadline`` seconds pass."""
        return self._run(Flush(deadline, retry_interval))

    def release_memory(self, tags: Sequence[Tag | str]) -> Calls:
        """Release ``tags`` on every engine (none when the group does not need offload)."""
        return self._run(Release(parse_tags(tags)))

    def resume_memory(self, tags: Sequence[Tag | str]) -> Calls:
        """Resume ``tags`` on every live engine of a group that offloads; refused (nothing
        sent) if one of them has not released them all."""
        return self._run(Resume(parse_tags(tags)))

    def continue_generation(self) -> Calls:
        """Continue generation on every paused engine."""
        return self._run(Continue())

    def begin_weight_update(self) -> Calls:
        """Open a weight-update session on every live engine."""
        return self._run(BeginUpdate())

    def end_weight_update(self) -> Calls:
        """Close the weight-update session on every live engine."""
        return self._run(EndUpdate())

    def probe(self) -> Calls:
        """Ask every live engine for its server info: the liveness probe that is safe while
        paused (a generating health check would hang on a paused engine)."""
        return self._run(ReadServerInfo())

    def update_weight_version(self, version: str) -> Calls:
        """Set the weight version on every live engine, aborting nothing."""
        return self._run(SetVersion(version))


def _indexes(name: str, given: Sequence[int] | None, count: int, unit: int) -> list[int]:
    """The index of each engine's id (``name/index``): ``given`` (a group rebuilt after
    engines joined and left: the ids its journal holds, ``ServerSnapshot.indexes``), else 0 to
    ``count - 1``; ``InvalidArgument`` for a list that does not fit."""
    if given is None:
        return list(range(count))
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise InvalidArgument(f"indexes of group {name!r} must be a sequence, got {given!r}")
    numbers = [check_int(f"index of group {name!r}", i, maximum=MAX_INDEX) for i in given]
    if len(numbers) != count:
        raise InvalidArgument(
            f"group {name!r} has {count} engines but {len(numbers)} indexes: give one each"
        )
    if len(set(numbers)) != count:
        raise InvalidArgument(f"indexes of group {name!r} repeat: {numbers}")
    if unit > 1 and numbers != list(range(count)):
        raise InvalidArgument(f"group {name!r} is made of units: its indexes are 0 to {count - 1}")
    return numbers


#: The largest index an engine id may carry.
MAX_INDEX = 10**9


def shown(identity: Hashable) -> str:
    """An engine identity as a message shows it."""
    if isinstance(identity, tuple) and identity and identity[0] in ("url", "actor"):
        return f"{identity[0]} {identity[1]}"
    return "the same object"


__all__ = ["EngineGroup", "EngineSnapshot", "spellings"]
