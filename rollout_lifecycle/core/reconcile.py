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
   memory resident and the fleet's weights (a versioned update's version is read first; one
   that reports another is marked stale and waits paused for an update, as a replacement does).

Pause, flush and release stop at the first phase that does not succeed everywhere (nothing is
released behind an engine that was not drained); the resume before them and the continue after
them are decided engine by engine, so they run whatever happened to the others. ``recover()``
reconciles its replacements and the healthy engines to the fleet's state; ``reset()`` and an
offload's release reconcile the paused engines of the groups that keep their memory (their
continue). A later call finishes what a failed one left.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from rollout_lifecycle.contract.exceptions import PhaseFailed
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome
from rollout_lifecycle.contract.values import PauseMode, Tag
from rollout_lifecycle.core.ledger import EngineRecord, Target
from rollout_lifecycle.core.parts import Client
from rollout_lifecycle.core.runner import Plan
from rollout_lifecycle.core.states import ServerState

FAILED = ServerState.FAILED.value

#: The phase names of one reconciliation, by step (``recover()``'s).
RECOVER_PHASES: Callable[[str], str] = "recover_{}".format
#: The phase names of the continue of the groups that keep their memory.
KEEPER_PHASES: Callable[[str], str] = "{}_keepers".format


@dataclass
class _Pass:
    """One reconciliation in progress: the live engines, each one's target, the phase names,
    and the outcome of every call sent so far."""

    live: list[EngineRecord]
    targets: dict[str, Target]
    phase: Callable[[str], str]
    outcomes: dict[str, EngineOutcome] = field(default_factory=dict)


class Reconciler(Client):
    """Brings engines to a state's memory targets (see the module docstring)."""

    async def reconcile(
        self,
        goal: ServerState,
        records: Sequence[EngineRecord],
        phase: Callable[[str], str] = RECOVER_PHASES,
    ) -> dict[str, EngineOutcome]:
        """Bring the live engines of ``records`` to ``goal``'s memory targets; the outcome of
        every call sent (empty when nothing was out of place)."""
        live = [r for r in records if r.alive]
        run = _Pass(live, {r.id: self._target(r, goal) for r in live}, phase)
        extra = {r.id: r.released - set(run.targets[r.id].released) for r in live}
        await self._by_tags(run, Op.RESUME, "resume", extra, self._config.deadlines.resume)
        await self._drain_and_release(run)
        await self._continue(run)
        return run.outcomes

    async def require(
        self,
        goal: ServerState,
        records: Sequence[EngineRecord],
        phase: Callable[[str], str] = RECOVER_PHASES,
    ) -> None:
        """``reconcile``, raising ``PhaseFailed`` if a call it sent did not succeed."""
        outcomes = await self.reconcile(goal, records, phase)
        if not self._runner.succeeded(outcomes):
            raise PhaseFailed(phase("continue"), outcomes, FAILED)

    def _target(self, record: EngineRecord, goal: ServerState) -> Target:
        found = self._fleet.target(record, goal)
        if found is None:
            raise ValueError(f"{goal.value!r} implies no memory state to reconcile to")
        return found

    async def _step(self, run: _Pass, step: str, plan: Plan, deadline: float) -> bool:
        """Run one phase if it has targets; whether every call of it succeeded."""
        if not plan.targets:
            return True
        got = (await self._runner.run(run.phase(step), plan, deadline)).outcomes
        run.outcomes.update(got)
        return self._runner.succeeded(got)

    async def _by_tags(
        self,
        run: _Pass,
        op: Op,
        step: str,
        wanted: dict[str, set[Tag]],
        deadline: float,
    ) -> bool:
        """Release or resume the tags ``wanted`` of each engine (by id), one phase per set of
        tags; stops at the first phase that fails (False)."""
        records = [r for r in run.live if r.id in wanted]
        for tags in _sets(self._config.release_tags, (wanted[r.id] for r in records)):
            chosen = tuple(r for r in records if wanted[r.id] == set(tags))
            plan = Plan(op, chosen, ([t.value for t in tags],), tags=tags)
            if not await self._step(run, step, plan, deadline):
                return False
        return True

    async def _drain_and_release(self, run: _Pass) -> None:
        """Pause, flush and release what the targets need, stopping at the first phase that
        does not succeed."""
        deadlines, mode, targets = self._config.deadlines, self._config.pause_mode, run.targets
        to_pause = [
            r
            for r in run.live
            if (targets[r.id].held or r.stale) and (not r.paused or r.pause_unknown)
        ]
        # a continue still in flight lands first (it would undo the pause)
        await self._runner.landed(to_pause, deadlines.pause, Op.PAUSE)
        plan = Plan(Op.PAUSE, tuple(to_pause), (mode.value,), mode=mode)
        if not await self._step(run, "pause", plan, deadlines.pause):
            return
        in_place = mode is PauseMode.IN_PLACE
        if not in_place:
            asked = {r.id for r in to_pause}
            to_flush = tuple(
                r
                for r in run.live
                if r.paused and not r.flushed and (r.id in asked or targets[r.id].held)
            )
            interval = self._config.flush_retry_interval
            plan = Plan(Op.FLUSH, to_flush, (deadlines.flush, interval))
            if not await self._step(run, "flush", plan, deadlines.flush + deadlines.probe):
                return
        idle = [r for r in run.live if r.paused and (r.flushed or in_place)]
        missing = {r.id: set(targets[r.id].released) - r.released for r in idle}
        await self._by_tags(run, Op.RELEASE, "release", missing, deadlines.release)

    async def _continue(self, run: _Pass) -> None:
        """Continue the paused engines the targets let generate, once a pause still in flight
        has landed, except those without the fleet's weights (they wait for an update)."""
        deadlines = self._config.deadlines
        paused = [
            r
            for r in run.live
            if not run.targets[r.id].paused
            and r.paused
            and not (r.released | r.uncertain or r.stale)
        ]
        if not paused:
            return
        landed = await self._runner.landed(paused, deadlines.pause, Op.CONTINUE)
        lacking = await self.lacking_weights(landed)
        for record in landed:
            if record.id in lacking:
                # it reports other weights than the fleet's (a push that failed under it): it
                # waits paused for an update, as a replacement does, and never serves them
                record.stale = True
        plan = Plan(Op.CONTINUE, tuple(r for r in landed if r.id not in lacking))
        await self._step(run, "continue", plan, deadlines.continue_)

    async def lacking_weights(self, targets: Sequence[EngineRecord]) -> dict[str, str | None]:
        """The engines of ``targets`` without the expected weights, with the version each
        reports (None for a replacement that has received no update); an engine found to report
        the expected version is no longer stale. ``PhaseFailed`` if a version cannot be read."""
        expected = self._versions.expected
        stale: dict[str, str | None] = {r.id: None for r in targets if r.stale}
        if expected is not None and targets:
            plan = Plan(Op.WEIGHT_VERSION, tuple(targets))
            result = await self._runner.run("check_versions", plan, self._config.deadlines.probe)
            for record in plan.targets:
                if not result.outcomes[record.id].ok:
                    raise PhaseFailed("check_versions", result.outcomes, FAILED)
                found = result.value(record.id)
                if found == expected:
                    stale.pop(record.id, None)
                    record.stale = False
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
