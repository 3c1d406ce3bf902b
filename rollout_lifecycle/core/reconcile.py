"""The reconciler: from a goal state and the engines' records to the phases that bring them there.

``Reconciler.reconcile(goal, records)`` compares what each record says with its engine's memory
target in ``goal`` (``Fleet.target``) and sends only the commands that close the gap, one
phase per command and each a barrier, in the lifecycle's order:

1. resume the tags released beyond the goal;
2. pause what the goal holds out of serving (``Target.held``), and a fresh server without the
   fleet's weights (stale) wherever it is; an engine whose last pause or continue did not
   answer is paused again;
3. flush what was paused here or is held by the goal and is not idle yet (not under the
   ``in_place`` pause mode, which keeps requests' memory);
4. release what the goal releases, only on engines paused and idle, never a tag held released;
5. continue what the goal lets generate (``Target.paused`` false) that is paused with all its
   memory resident and the fleet's weights (a versioned update's version is read first, also
   of an engine waiting for the weights: one that reports it holds them; one that reports
   another is marked stale and waits paused for an update, as a replacement does).

Pause, flush and release stop at the first phase that does not succeed everywhere (nothing is
released behind an engine that was not drained); the resume before them and the continue after
them are decided engine by engine, so they run whatever happened to the others. ``recover()``
reconciles its replacements and the healthy engines to the fleet's state; ``reset()`` and an
offload's release reconcile the paused engines of the groups that keep their memory (their
continue); a drain that failed is undone by reconciling the fleet back to ``serving``
(``Phases.undo_pause``). A later call finishes what a failed one left.

The lifecycle's forward transitions are the same steps, taken one at a time and strictly
(``Reconciler.advance``): each step's engines and tags come from the same comparison of goal
and records, but where recovery skips an engine that is out of place, a forward step refuses
it (the command's guard over every engine of the call's groups, ``IllegalEngineOp``, before
anything is sent); its ``before_`` hooks run first; an engine without the fleet's weights stops
the continue (``StaleWeights``) instead of waiting paused; and a step that does not succeed
everywhere raises ``PhaseFailed`` under its own name.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rollout_lifecycle.contract.commands import (
    Continue,
    Flush,
    Pause,
    ReadVersion,
    Release,
    Resume,
)
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import PhaseFailed, StaleWeights
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome
from rollout_lifecycle.contract.values import PauseMode, Tag, without_wait
from rollout_lifecycle.core.config import DeadEnginePolicy
from rollout_lifecycle.core.ledger import (
    CONTINUABLE_STATES,
    EngineRecord,
    EngineState,
    GroupRecords,
    Target,
    target,
)
from rollout_lifecycle.core.parts import Client
from rollout_lifecycle.core.runner import Plan, guard, guard_groups, targets_of
from rollout_lifecycle.core.states import Phase, ServerState

FAILED = ServerState.FAILED.value
_CONTINUE, _READ_VERSION = Continue(), ReadVersion()
#: The command of a memory step, by its operation.
_MEMORY_MOVES: dict[Op, type[Release | Resume]] = {Op.RELEASE: Release, Op.RESUME: Resume}

#: The phases of a reconciliation's steps, by operation: ``recover()``'s.
RECOVER_PHASES: Mapping[Op, Phase] = {
    Op.RESUME: Phase.RECOVER_RESUME,
    Op.PAUSE: Phase.RECOVER_PAUSE,
    Op.FLUSH: Phase.RECOVER_FLUSH,
    Op.RELEASE: Phase.RECOVER_RELEASE,
    Op.CONTINUE: Phase.RECOVER_CONTINUE,
}
#: The same for the reconciliation of the groups that keep their memory.
KEEPER_PHASES: Mapping[Op, Phase] = {
    Op.RESUME: Phase.RESUME_KEEPERS,
    Op.PAUSE: Phase.PAUSE_KEEPERS,
    Op.FLUSH: Phase.FLUSH_KEEPERS,
    Op.RELEASE: Phase.RELEASE_KEEPERS,
    Op.CONTINUE: Phase.CONTINUE_KEEPERS,
}


@dataclass
class _Pass:
    """One reconciliation in progress: the live engines, each one's target, the phase names,
    and the outcome of every call sent so far."""

    live: list[EngineRecord]
    #: Each group's target (one object a group: the target depends on the group alone).
    targets: dict[str, Target]
    phases: Mapping[Op, Phase]
    outcomes: dict[str, EngineOutcome] = field(default_factory=dict)
    #: The first step that did not succeed everywhere.
    failed: Phase | None = None

    def takes(self, op: Op) -> bool:
        """Whether this reconciliation takes the steps of ``op``: those its phases name."""
        return op in self.phases

    def target(self, record: EngineRecord) -> Target:
        return self.targets[record.group]

    def held(self, record: EngineRecord) -> bool:
        return self.target(record).held

    def resume_wanted(self) -> dict[str, set[Tag]]:
        """The tags each engine holds released beyond its target."""
        return {r.id: r.released.difference(self.target(r).released) for r in self.live}

    def to_pause(self) -> list[EngineRecord]:
        """Held out of serving (or stale) and not known to be paused."""
        return [
            r for r in self.live if (self.held(r) or r.stale) and (not r.paused or r.pause_unknown)
        ]

    def to_flush(self, asked: Collection[str]) -> tuple[EngineRecord, ...]:
        """Paused here (``asked``) or held, and not flushed since."""
        return tuple(
            r for r in self.live if r.paused and not r.flushed and (r.id in asked or self.held(r))
        )

    def release_wanted(self, in_place: bool) -> dict[str, set[Tag]]:
        """The tags each idle engine (paused and flushed) holds that its target releases."""
        idle = [r for r in self.live if r.paused and (r.flushed or in_place)]
        return {r.id: set(self.target(r).released) - r.released for r in idle}

    def to_continue(self) -> list[EngineRecord]:
        """Paused with all its memory resident where the target generates, with the fleet's
        weights as far as the record knows or waiting for them where a version may show them
        (not where only a write can: ``needs_write``); not a member of a unit that is not
        whole (``held_by_unit``: it stays paused until ``recover()`` replaces the unit)."""
        return [
            r
            for r in self.live
            if not self.target(r).paused
            and not r.held_by_unit
            and (
                r.state in CONTINUABLE_STATES
                or (r.state is EngineState.WAITING and not r.needs_write)
            )
        ]


class Reconciler(Client):
    """Brings engines to a state's memory targets (see the module docstring)."""

    async def reconcile(
        self,
        goal: ServerState,
        records: Sequence[EngineRecord],
        phases: Mapping[Op, Phase] = RECOVER_PHASES,
        *,
        hold: bool = False,
    ) -> dict[str, EngineOutcome]:
        """Bring the live engines of ``records`` to ``goal``'s memory targets, each step as the
        phase ``phases`` names; the outcome of every call sent (empty when nothing was out of
        place). A step whose operation ``phases`` does not name is not taken; ``hold`` holds
        every engine out of serving, whatever its group."""
        return (await self._reconcile(goal, records, phases, hold)).outcomes

    async def require(
        self,
        goal: ServerState,
        records: Sequence[EngineRecord],
        phases: Mapping[Op, Phase] = RECOVER_PHASES,
        *,
        hold: bool = False,
    ) -> None:
        """``reconcile``, raising ``PhaseFailed`` under the name of the first step that did not
        succeed everywhere."""
        run = await self._reconcile(goal, records, phases, hold)
        if run.failed is not None:
            raise PhaseFailed(run.failed, run.outcomes, FAILED)

    async def _reconcile(
        self,
        goal: ServerState,
        records: Sequence[EngineRecord],
        phases: Mapping[Op, Phase],
        hold: bool,
    ) -> _Pass:
        run = self._pass(goal, records, phases, hold=hold)
        await self._by_tags(run, Op.RESUME, run.resume_wanted(), self._deadline(Op.RESUME))
        await self._drain_and_release(run)
        await self._continue(run)
        return run

    async def advance(
        self,
        since: ServerState,
        goal: ServerState,
        groups: Sequence[GroupRecords],
        op: Op,
        name: Phase,
    ) -> None:
        """One step of a forward transition from ``since`` toward ``goal``, strictly (module
        docstring): ``op`` (pause, flush, release, resume or continue) to the engines of
        ``groups`` that the goal needs it on, as phase ``name``, after the ``before_{name}``
        hooks. A drain holds every engine of its groups (``pause()`` pauses the groups that
        keep their memory too)."""
        records = [r for g in groups for r in g.records]
        hold = goal is ServerState.DRAINED
        tags = self._moved(since, goal, op)
        if op in (Op.RELEASE, Op.RESUME):
            if tags:
                # every engine of the call's groups passes the guard, not only those planned
                guard_groups(groups, op, tags)
        else:
            everyone = targets_of(groups, op)
            guard(op, everyone)
            if op is Op.CONTINUE:
                stale = await self.lacking_weights(everyone)
                if stale:
                    raise StaleWeights(self._versions.wanted(), stale)
        await self._hooks.before(name)
        # (planned after the hooks, which may have changed the records)
        run = self._pass(goal, records, {op: name}, hold=hold)
        for plan in self._forward_plans(run, op, tags):
            await self._runner.require(name, plan, self._deadline(op))

    def _moved(self, since: ServerState, goal: ServerState, op: Op) -> tuple[Tag, ...]:
        """The tags a release or resume from ``since`` to ``goal`` moves on a group that
        offloads, in the configured release order."""
        if op not in (Op.RELEASE, Op.RESUME):
            return ()
        order = self._config.release_tags
        before, after = (target(state, True, order) for state in (since, goal))
        if before is None or after is None:
            raise ValueError(f"no memory step leads from {since.value!r} to {goal.value!r}")
        was, now = set(before.released), set(after.released)
        moved = now - was if op is Op.RELEASE else was - now
        return tuple(t for t in order if t in moved)

    def _forward_plans(self, run: _Pass, op: Op, tags: tuple[Tag, ...]) -> list[Plan]:
        """What a forward step of ``op`` sends (a release or resume moves the step's ``tags``):
        the engines whose records differ from the goal's targets in what the step changes."""
        mode = self._config.pause_mode
        if op is Op.PAUSE:
            targets = run.to_pause()
            if mode is not PauseMode.WAIT:
                return [Plan(Pause(mode), tuple(targets))]
            # An engine whose last pause is unknown may be paused already: no wait for it.
            held = without_wait(mode)
            unknown = tuple(r for r in targets if r.pause_unknown)
            known = tuple(r for r in targets if not r.pause_unknown)
            return [
                Plan(Pause(mode), known),
                Plan(Pause(held), unknown),
            ]
        if op is Op.FLUSH:
            return [Plan(self._flush(), run.to_flush(()))]
        if op is Op.CONTINUE:
            return [Plan(_CONTINUE, tuple(run.to_continue()))]
        if not tags:
            return []
        if op is Op.RESUME:  # still released, and the goal holds them
            chosen = tuple(r for r in run.live if not r.released.isdisjoint(tags))
        else:  # none released yet, the goal releases them, and idle (the guard saw to that)
            chosen = tuple(
                r
                for r in run.live
                if r.released.isdisjoint(tags) and run.target(r).released and r.paused
            )
        return [Plan(_MEMORY_MOVES[op](tags), chosen)]

    def _pass(
        self,
        goal: ServerState,
        records: Sequence[EngineRecord],
        phases: Mapping[Op, Phase],
        *,
        hold: bool = False,
    ) -> _Pass:
        """A reconciliation of the live engines of ``records`` to ``goal`` (``hold``: each is
        held out of serving, whatever its group)."""
        live = [r for r in records if r.alive]
        targets: dict[str, Target] = {}
        for record in live:
            if record.group not in targets:
                found = self._target(record, goal)
                targets[record.group] = (
                    Target(found.paused, found.released, True) if hold else found
                )
        return _Pass(live, targets, phases)

    def _target(self, record: EngineRecord, goal: ServerState) -> Target:
        found = self._fleet.target(record, goal)
        if found is None:
            raise ValueError(f"{goal.value!r} implies no memory state to reconcile to")
        return found

    def _deadline(self, op: Op) -> float:
        """The barrier's deadline for a phase of ``op`` (a flush's allows a margin for its last
        attempt's answer to arrive: the engine retries internally until the flush deadline)."""
        deadlines = self._config.deadlines
        return {
            Op.PAUSE: deadlines.pause,
            Op.FLUSH: deadlines.flush + deadlines.probe,
            Op.RELEASE: deadlines.release,
            Op.RESUME: deadlines.resume,
            Op.CONTINUE: deadlines.continue_,
        }[op]

    def _flush(self) -> Flush:
        return Flush(self._config.deadlines.flush, self._config.flush_retry_interval)

    async def _step(self, run: _Pass, plan: Plan, deadline: float) -> bool:
        """Run one step (the phase its pass names for its command) if it has targets and the
        pass takes it; whether every call of it succeeded."""
        if not plan.targets or not run.takes(plan.op):
            return True
        phase = run.phases[plan.op]
        got = (await self._runner.run(phase, plan, deadline)).outcomes
        run.outcomes.update(got)
        if self._runner.succeeded(got):
            return True
        run.failed = run.failed or phase
        return False

    async def _by_tags(
        self,
        run: _Pass,
        op: Op,
        wanted: dict[str, set[Tag]],
        deadline: float,
    ) -> bool:
        """Release or resume the tags ``wanted`` of each engine (by id), one phase per set of
        tags; stops at the first phase that fails (False)."""
        records = [r for r in run.live if r.id in wanted]
        for tags in _sets(self._config.release_tags, (wanted[r.id] for r in records)):
            chosen = tuple(r for r in records if wanted[r.id] == set(tags))
            plan = Plan(_MEMORY_MOVES[op](tags), chosen)
            if not await self._step(run, plan, deadline):
                return False
        return True

    async def _drain_and_release(self, run: _Pass) -> None:
        """Pause, flush and release what the targets need, stopping at the first phase that
        does not succeed. (Engines a reconcile pauses are replacements or of unknown pause: a
        wait mode pauses them in retract mode.)"""
        mode = without_wait(self._config.pause_mode)
        to_pause = run.to_pause() if run.takes(Op.PAUSE) else []
        # a continue still in flight lands first (it would undo the pause)
        await self._runner.landed(to_pause, self._deadline(Op.PAUSE), Op.PAUSE)
        plan = Plan(Pause(mode), tuple(to_pause))
        if not await self._step(run, plan, self._deadline(Op.PAUSE)):
            return
        in_place = mode is PauseMode.IN_PLACE
        if not in_place:
            plan = Plan(self._flush(), run.to_flush({r.id for r in to_pause}))
            if not await self._step(run, plan, self._deadline(Op.FLUSH)):
                return
        wanted = run.release_wanted(in_place)
        await self._by_tags(run, Op.RELEASE, wanted, self._deadline(Op.RELEASE))

    async def _continue(self, run: _Pass) -> None:
        """Continue the paused engines the targets let generate, once a pause still in flight
        has landed, except those without the fleet's weights (they wait for an update)."""
        paused = run.to_continue()
        if not paused or not run.takes(Op.CONTINUE):
            return
        # (a pause still in flight gets the continue's deadline to land: the continue waits)
        landed = await self._runner.landed(paused, self._deadline(Op.CONTINUE), Op.CONTINUE)
        lacking = await self.lacking_weights(landed)
        for record in landed:
            if record.id in lacking and not self._versions.interrupted:
                # it reports other weights than the fleet's (a push that failed under it): it
                # waits paused for an update, as a replacement does, and never serves them
                record.lacks_weights()
                logger().warning(
                    "engine.waits_for_weights",
                    server=self._name,
                    engine=record.id,
                    expected=self._versions.expected,
                    reports=lacking[record.id],
                )
        plan = Plan(_CONTINUE, tuple(r for r in landed if r.id not in lacking))
        await self._step(run, plan, self._deadline(Op.CONTINUE))

    async def lacking_weights(self, targets: Sequence[EngineRecord]) -> dict[str, str | None]:
        """The engines of ``targets`` without the expected weights, with the version each
        reports (None for a replacement that has received no update); an engine found to report
        the expected version is no longer stale. ``PhaseFailed`` if a version cannot be read.
        After an unversioned push that raised (``Versions.interrupted``), every target."""
        expected = self._versions.expected
        if self._versions.interrupted:
            return {r.id: None for r in targets}
        # Engines that failed verification under SKIP are left out: they wait, paused, while
        # the others go on (under FAIL they hold everything back).
        if self._config.unverified_engines is DeadEnginePolicy.SKIP:
            targets = [r for r in targets if not r.unverified]
        stale: dict[str, str | None] = {r.id: None for r in targets if r.stale}
        if expected is not None and targets:
            plan = Plan(_READ_VERSION, tuple(targets))
            phase = Phase.CHECK_VERSIONS
            result = await self._runner.run(phase, plan, self._config.deadlines.probe)
            for record in plan.targets:
                if not result.outcomes[record.id].ok:
                    raise PhaseFailed(phase, result.outcomes, FAILED)
                found = result.value(record.id)
                if found == expected and not record.needs_write:
                    stale.pop(record.id, None)
                    record.holds_weights()
                else:
                    stale[record.id] = found
        return stale


def _sets(order: Sequence[Tag], wanted: Iterable[Collection[Tag]]) -> list[tuple[Tag, ...]]:
    """The distinct non-empty tag sets of ``wanted``, each in ``order`` (the configured release
    order; others after it), in the order first met."""
    out: list[tuple[Tag, ...]] = []
    for tags in wanted:
        ordered = tuple(t for t in order if t in tags) + tuple(
            sorted((t for t in tags if t not in order), key=lambda t: t.value)
        )
        if ordered and ordered not in out:
            out.append(ordered)
    return out


__all__ = ["KEEPER_PHASES", "RECOVER_PHASES", "Reconciler"]
