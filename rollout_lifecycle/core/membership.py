"""Engines joining and leaving a running fleet: ``add_engines`` and ``remove_engines``.

Both are reconciliations made under the server's lock and its claims, in any settled state
(everything but ``failed``: ``recover()`` or ``reset()`` first), and leave the server in the
state it was in.

**Joining.** The engines get the group's next ids and records of fresh servers, stale until the
fleet's weights reach them (as replacements are). They are claimed with the rest of the call's
engines, then read (``join_probe``, within ``Deadlines.startup``): each must be a fresh server,
not paused, or none joins. Then they are reconciled to their group's memory targets in the
server's state (``join_*`` phases): in ``released`` they are paused, flushed and released like
the rest of the group, so that a trainer sharing their GPUs finds the memory free. A stale
engine never serves: it waits paused until a weight push reaches it (the fleet's next
``update_weights``, verified where the push is), and only then does a continue let it serve, the
generation client route to it and the router list it (``Fleet.serves``). In ``serving`` a
joining engine therefore waits paused for the next push. If one cannot be read as a fresh
server, none joins. If a step of the reconciliation fails, they are the fleet's but not where
their group's state holds them (a call of theirs may be in flight): the server fails, as after
a ``recover()`` whose replacement failed to come up, and ``recover()`` settles them.

**Leaving.** Each live engine is paused in abort mode (``leave_pause``; one paused already is not
paused again), the router binding taking its worker out before the pause is sent (from the pause's
intent on its record no longer serves: nothing routes a new request to it), and every request still
on it is aborted (``leave_abort``): a leaving engine is never continued, so whatever it holds comes
back to the generation client with its partial output and is resubmitted to the engines that stay (a
retract or in-place pause would keep those requests inside it). Then it is flushed, if it was not
since its pause, and every memory tag it still holds is released (``leave_flush``,
``leave_release``), so its GPU is free. (A flush is never sent to an engine with memory released: an
engine paused, flushed and released in the fleet's ``released`` state is flushed already.) Last,
unless the caller keeps them (``stop=False``), the engines are stopped as ``recover()`` retires a
replaced engine (an abort pause, then a close; a Ray engine actor is killed). Why stop by default: a
request sent straight to an engine while it was paused (not through the generation client or the
router, which never send to a paused engine) waits at its front end for the continue, where neither
a pause nor an abort reaches it (SGLang 0.5.23's ``TokenizerManager.generate_request`` waits on
``is_pause_cond`` before it sends anything to the scheduler, and ``abort_request`` reaches only the
scheduler); stopping the engine fails such a request, which a client can resubmit, where a continue
would run it on released memory. An engine kept (``stop=False``) is paused with every tag released:
resume its memory before anything continues it. The engines leave the records once every step has
succeeded. A step that fails keeps them in the fleet, where a call of theirs that did not answer is
still waited for by the fleet's next phases (a release in flight on one GPU before a resume on
another): the server fails, ``PhaseFailed`` names the step, and ``recover()`` settles them before a
``remove_engines`` again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.commands import Abort, Flush, Pause, Release
from rollout_lifecycle.contract.exceptions import (
    IllegalTransition,
    InvalidArgument,
    PhaseFailed,
)
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome
from rollout_lifecycle.contract.values import PauseMode, Tag, check_name
from rollout_lifecycle.core.claims import Claims
from rollout_lifecycle.core.group import EngineGroup
from rollout_lifecycle.core.ledger import SETTLED_STATES, EngineRecord
from rollout_lifecycle.core.machine import Machine
from rollout_lifecycle.core.parts import Client, Parts
from rollout_lifecycle.core.phases import Phases
from rollout_lifecycle.core.recovery import Recovery
from rollout_lifecycle.core.runner import Plan
from rollout_lifecycle.core.states import Phase, ServerState

S = ServerState

#: The phases of a joining engine's reconciliation.
JOIN_PHASES: Mapping[Op, Phase] = {
    Op.RESUME: Phase.JOIN_RESUME,
    Op.PAUSE: Phase.JOIN_PAUSE,
    Op.FLUSH: Phase.JOIN_FLUSH,
    Op.RELEASE: Phase.JOIN_RELEASE,
    Op.CONTINUE: Phase.JOIN_CONTINUE,
}
_PAUSE_ABORT, _ABORT_ALL = Pause(PauseMode.ABORT), Abort(abort_all=True)


class Membership(Client):
    """``add_engines`` and ``remove_engines`` of one server (see the module docstring)."""

    def __init__(
        self,
        parts: Parts,
        groups: Mapping[str, EngineGroup],
        phases: Phases,
        recovery: Recovery,
        claims: Claims,
        machine: Machine,
    ) -> None:
        super().__init__(parts)
        self._groups = groups
        self._phases = phases
        self._recovery = recovery
        self._claims = claims
        self._machine = machine

    def _settled(self, call: str) -> ServerState:
        state = self._state()
        if state not in SETTLED_STATES and state is not S.KV_RESTORED:
            raise IllegalTransition(
                call,
                state.value,
                [s.value for s in (*SETTLED_STATES, S.KV_RESTORED)],
                reason="engines join and leave a fleet in a settled state: recover() or "
                "reset() first",
            )
        return state

    async def add(self, group: str, engines: Sequence[Any]) -> list[str]:
        """Engines join ``group``; their ids."""
        state = self._settled("add_engines")
        found = self._groups.get(group)
        if found is None:
            raise InvalidArgument(
                f"no group {group!r} in this server; its groups are {sorted(self._groups)}"
            )
        taken = {r.key: f"engine {r.id}" for r in self._fleet.records()}
        records = found.add(engines, taken)
        try:
            self._journal()
            await self._claims.admit(records)
            outcomes, fresh = await self._recovery.probe(records, Phase.JOIN_PROBE)
            if not self._runner.succeeded(outcomes) or len(fresh) != len(records):
                raise PhaseFailed(Phase.JOIN_PROBE, outcomes, state.value)
        except BaseException:
            # None joins: nothing but reads was sent to them.
            found.drop(records)
            self._journal()
            raise
        try:
            await self._phases.reconciler.require(state, records, JOIN_PHASES)
        except BaseException:
            # They are the fleet's, not where their group's state holds them (a call of theirs
            # may still be in flight, which the fleet's next phases wait for): the server
            # fails, and recover() settles them as it settles replacements.
            await self._machine.fail()
            raise
        return [r.id for r in records]

    async def remove(self, ids: Sequence[str], stop: bool = True) -> dict[str, EngineOutcome]:
        """The engines ``ids`` leave the fleet (stopped, with ``stop``); the outcome of every
        call sent to them."""
        self._settled("remove_engines")
        records = self._chosen(ids)
        outcomes: dict[str, EngineOutcome] = {}
        live = tuple(r for r in records if r.alive)
        deadlines = self._config.deadlines
        flush = Flush(deadlines.flush, self._config.flush_retry_interval)
        steps: list[tuple[Phase, Callable[[], list[Plan]], float]] = [
            (Phase.LEAVE_PAUSE, lambda: [Plan(_PAUSE_ABORT, _unpaused(live))], deadlines.pause),
            (Phase.LEAVE_ABORT, lambda: [Plan(_ABORT_ALL, _alive(live))], deadlines.probe),
            (
                Phase.LEAVE_FLUSH,
                lambda: [Plan(flush, tuple(r for r in _alive(live) if not r.flushed))],
                deadlines.flush + deadlines.probe,
            ),
            (Phase.LEAVE_RELEASE, lambda: self._releases(live), deadlines.release),
        ]
        for phase, plans, deadline in steps:
            for plan in plans():
                if not plan.targets:
                    continue
                got = (await self._runner.run(phase, plan, deadline)).outcomes
                outcomes.update(got)
                if not self._runner.succeeded(got):
                    # Nothing is released behind an engine that was not drained. They stay the
                    # fleet's (a call of theirs may still be in flight, which the fleet's next
                    # phases wait for), out of place: the server fails; recover() settles them.
                    await self._machine.fail()
                    raise PhaseFailed(phase, outcomes, self._state().value)
        for name in {r.group for r in records}:
            self._groups[name].drop(records)
        self._journal()
        if stop:
            for record in records:  # (what its front end held fails there: a client resubmits)
                await seam.retire(record.handle, deadlines.probe)
        return outcomes

    def _chosen(self, ids: Sequence[str]) -> list[EngineRecord]:
        """The records of ``ids``; ``InvalidArgument`` for an id that is no engine of the fleet,
        one given twice, a member of a unit, or a group that would be left with none."""
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or not ids:
            raise InvalidArgument(f"ids must be a non-empty sequence of engine ids, got {ids!r}")
        by_id = {r.id: r for r in self._fleet.records()}
        chosen: list[EngineRecord] = []
        for engine in ids:
            check_name("engine id", engine)
            record = by_id.get(engine)
            if record is None:
                raise InvalidArgument(
                    f"no engine {engine!r} in this server; its engines are {sorted(by_id)}"
                )
            if record in chosen:
                raise InvalidArgument(f"engine {engine!r} given twice")
            if record.mates:
                raise InvalidArgument(
                    f"engine {engine!r} is a member of unit {record.unit_name}: engines leave "
                    f"a unit group whole units at a time, which remove_engines does not do yet"
                )
            chosen.append(record)
        for name, group in self._groups.items():
            if group.records and all(r in chosen for r in group.records):
                raise InvalidArgument(
                    f"removing {sorted(r.id for r in chosen)} would leave group {name!r} with "
                    f"no engine: a group keeps at least one"
                )
        return chosen

    def _releases(self, live: Sequence[EngineRecord]) -> list[Plan]:
        """Release every tag each idle leaving engine still holds: one plan per set of tags
        (the records say which are resident), in the order of ``release_tags``."""
        order = self._config.release_tags
        wanted: dict[tuple[Tag, ...], list[EngineRecord]] = {}
        for record in _alive(live):
            if record.paused and record.flushed:
                tags = tuple(t for t in order if t not in record.released)
                if tags:
                    wanted.setdefault(tags, []).append(record)
        return [Plan(Release(tags), tuple(chosen)) for tags, chosen in wanted.items()]


def _alive(records: Sequence[EngineRecord]) -> tuple[EngineRecord, ...]:
    return tuple(r for r in records if r.alive)


def _unpaused(records: Sequence[EngineRecord]) -> tuple[EngineRecord, ...]:
    """The live engines not known to be paused (an engine paused already is not paused
    again: its requests come back through the abort that follows)."""
    return tuple(r for r in records if r.alive and (not r.paused or r.pause_unknown))


__all__ = ["JOIN_PHASES", "Membership"]
