"""Snapshots of a server's knowledge, and adopting one in another process.

``ServerSnapshot`` is the state and every engine's record, as plain frozen data that round-trips
through JSON (``to_dict`` / ``from_dict``). ``adopt`` loads one into a fleet's records after
checking that the records imply the snapshot's state, so a process can take over engines an
earlier one left in any state, with every guard applying as if it had made those calls.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.core.ledger import EngineSnapshot, Fleet
from rollout_lifecycle.core.parts import Versions
from rollout_lifecycle.core.states import ServerState

S = ServerState


@dataclass(frozen=True)
class GroupSnapshot:
    """One group's engines at one moment."""

    name: str
    needs_offload: bool
    engines: tuple[EngineSnapshot, ...]


@dataclass(frozen=True)
class ServerSnapshot:
    """The server's aggregate state and what it knows of every engine."""

    name: str
    state: ServerState
    groups: tuple[GroupSnapshot, ...]
    #: The weight version every engine must report to continue (the last versioned update's).
    expected_version: str | None = None
    #: An unversioned push raised and no write completed since: no engine continues on what
    #: it holds until one does (``core/parts.Versions``).
    interrupted: bool = False

    @classmethod
    def of(
        cls, name: str, state: ServerState, fleet: Fleet, versions: Versions | None = None
    ) -> ServerSnapshot:
        """The snapshot of ``fleet``'s records now (and of ``versions``)."""
        groups = tuple(
            GroupSnapshot(g.name, g.needs_offload, tuple(r.snapshot() for r in g.records))
            for g in fleet.groups
        )
        if versions is None:
            return cls(name, state, groups)
        return cls(name, state, groups, versions.expected, versions.interrupted)

    def ids(self, group: str) -> list[str]:
        """The ids of ``group``'s engines, in order (``[]`` for a group it does not hold)."""
        return [e.id for g in self.groups if g.name == group for e in g.engines]

    def indexes(self, group: str) -> list[int]:
        """The index of each of ``group``'s engines (its id ``group/index``): what
        ``EngineGroup(..., indexes=...)`` takes to rebuild the group as the snapshot holds it."""
        return [int(i.rsplit("/", 1)[1]) for i in self.ids(group)]

    def versions(self) -> tuple[str | None, bool]:
        """What the server knew of the weights: ``(expected_version, interrupted)``."""
        return self.expected_version, self.interrupted

    def engines(self) -> dict[str, EngineSnapshot]:
        """Every engine's snapshot by id."""
        return {e.id: e for g in self.groups for e in g.engines}

    def in_flight(self) -> bool:
        """Whether a live engine's record shows a call without an answer (uncertain tags, a
        pause or a weight-update session unknown): taken mid-call, or left by a failed one."""
        return any(
            e.alive and (e.uncertain or e.pause_unknown or e.session_unknown)
            for g in self.groups
            for e in g.engines
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for logging or JSON."""
        out = asdict(self)
        out["state"] = self.state.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerSnapshot:
        """The snapshot ``to_dict()`` gave (read back from JSON, say); ``InvalidArgument`` if
        ``data`` is not one."""
        engine = EngineSnapshot.from_dict
        try:
            groups = tuple(
                GroupSnapshot(g["name"], g["needs_offload"], tuple(map(engine, g["engines"])))
                for g in data["groups"]
            )
            snapshot = cls(
                data["name"],
                ServerState(data["state"]),
                groups,
                data.get("expected_version"),
                data.get("interrupted", False),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"not a server snapshot: {type(exc).__name__}: {exc}") from None
        if not isinstance(snapshot.name, str) or not all(
            isinstance(g.name, str) and isinstance(g.needs_offload, bool) for g in groups
        ):
            raise InvalidArgument("not a server snapshot: a name or needs_offload is mistyped")
        version = snapshot.expected_version
        if not (version is None or isinstance(version, str)) or not isinstance(
            snapshot.interrupted, bool
        ):
            raise InvalidArgument("not a server snapshot: expected_version or interrupted")
        return snapshot


def adopt(fleet: Fleet, snapshot: ServerSnapshot) -> ServerState:
    """Load ``snapshot``'s records into ``fleet``; the state the server enters.

    The groups must be the snapshot's (names, order, ``needs_offload``, engine ids), and the
    records must imply the snapshot's state (``failed`` takes any). A snapshot taken mid-call
    (records with a call in flight) whose records no longer imply its state is adopted as
    ``failed``, the records keeping what is unknown for the guards. So is one with a
    weight-update session that may be open (a process killed in its push, or before the end
    of one answered): its engines may hold half the new weights, so they are stale (held
    paused until a write completes), and ``reset()``, ``recover()`` and the next update close
    the session before anything else. Raises ``InvalidArgument``, changing nothing, otherwise.
    """
    if not isinstance(snapshot, ServerSnapshot):
        raise InvalidArgument(f"expected a ServerSnapshot, got {snapshot!r}")
    ours = [(g.name, g.needs_offload, [r.id for r in g.records]) for g in fleet.groups]
    theirs = [(g.name, g.needs_offload, [e.id for e in g.engines]) for g in snapshot.groups]
    if ours != theirs:
        raise InvalidArgument(f"the snapshot's groups {theirs} are not this server's {ours}")
    state = snapshot.state
    in_flight = snapshot.in_flight()
    if state is S.PAUSING and not in_flight:
        raise InvalidArgument("a snapshot taken in 'pausing' (mid-call) cannot be adopted")
    records = fleet.records()
    saved = [{k: copy.copy(v) for k, v in vars(r).items()} for r in records]
    engines = [e for g in snapshot.groups for e in g.engines]
    try:
        for record, engine in zip(records, engines, strict=True):
            record.load(engine)
        implied = fleet.settled_state()
        if state not in (S.FAILED, implied) and in_flight:
            state = S.FAILED
        interrupted = [r for r in records if r.alive and r.session_unknown]
        for record in interrupted:
            record.lacks_weights()  # (what the push wrote is not known)
        if interrupted:
            state = S.FAILED
        if not fleet.implies(state):
            shown = "no single state" if implied is None else repr(implied.value)
            raise InvalidArgument(
                f"the snapshot's engine records imply {shown}, not its state {state.value!r}"
            )
    except BaseException:
        for record, values in zip(records, saved, strict=True):
            vars(record).update(values)
        raise
    return state


__all__ = ["GroupSnapshot", "ServerSnapshot", "adopt"]
