"""The lifecycle's phases: drain, release, restore and continue, each a barrier over the fleet.

Each phase plans its engine calls over the ledger (``Fleet``), runs them through the phase
runner, and raises ``PhaseFailed`` unless every engine it reached succeeded. The order in which
they run, and the states they connect, are the state machine's; what each guarantees is in
``docs/design.md`` (invariants 1-6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rollout_lifecycle.contract.commands import EndUpdate
from rollout_lifecycle.contract.exceptions import (
    HookFailed,
    IllegalEngineOp,
    PhaseFailed,
)
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.contract.values import PauseMode
from rollout_lifecycle.core.args import PhaseArgs
from rollout_lifecycle.core.config import DeadEnginePolicy
from rollout_lifecycle.core.ledger import EngineRecord, GroupRecords
from rollout_lifecycle.core.parts import Client, Parts
from rollout_lifecycle.core.reconcile import KEEPER_PHASES, RECOVER_PHASES, Reconciler
from rollout_lifecycle.core.runner import Plan
from rollout_lifecycle.core.states import Phase, ServerState

S = ServerState

FAILED = ServerState.FAILED.value
#: The phases of undoing a drain that failed: a reconciliation back to ``serving``, whose
#: continue is named for what it undoes.
UNDO_PHASES: Mapping[Op, Phase] = {**RECOVER_PHASES, Op.CONTINUE: Phase.CONTINUE_AFTER_FAILURE}


class Phases(Client):
    """The phases of one server's transitions."""

    def __init__(self, parts: Parts) -> None:
        super().__init__(parts)
        #: Brings engines to a state's memory targets (recovery, the groups that keep theirs).
        self.reconciler = Reconciler(parts)
        #: The outcomes of the last continue after a failed drain.
        self._last_outcomes: dict[str, EngineOutcome] = {}

    def offload_groups(self) -> tuple[GroupRecords, ...]:
        """The groups whose GPUs are shared with the trainer."""
        return tuple(g for g in self._fleet.groups if g.needs_offload)

    def preflight_offload(self) -> None:
        """Refuse an offload, before anything is paused, that a release would refuse: tags
        already released or unknown, or tags the engine's driver cannot release together."""
        tags = self._config.release_tags
        for record in self._fleet.offloaded():
            held = [t.value for t in tags if t in record.released | record.uncertain]
            if held:
                raise IllegalEngineOp(
                    record.id, Op.RELEASE.value, f"tags {held} are already released or unknown"
                )
            refusal = record.release_refusal(tags)
            if refusal is not None:
                raise IllegalEngineOp(
                    record.id,
                    Op.RELEASE.value,
                    f"{refusal}: set release_tags so (LifecycleConfig.release_tags)",
                )
        if self._config.dead_engines is DeadEnginePolicy.FAIL:
            groups = self.offload_groups()
            dead = [r.id for g in groups for r in g.records if not r.alive]
            if dead:
                raise IllegalEngineOp(
                    ", ".join(dead), "offload", "engines are dead; recover() them first"
                )

    # -- drain ----------------------------------------------------------------------------------

    async def drain(self, args: PhaseArgs) -> None:
        """Pause ``args.groups``, then flush them until idle (the idle barrier)."""
        groups = args.groups
        try:
            await self.reconciler.advance(S.SERVING, S.DRAINED, groups, Op.PAUSE, Phase.PAUSE)
        except PhaseFailed as failed:
            await self.undo_pause()
            raise PhaseFailed(
                Phase.PAUSE, self._with_unattempted(failed.outcomes), FAILED
            ) from None
        if self._config.pause_mode is PauseMode.IN_PLACE:
            return  # requests keep their KV cache: flush would be refused, and is not needed
        try:
            await self.reconciler.advance(S.SERVING, S.DRAINED, groups, Op.FLUSH, Phase.FLUSH)
        except HookFailed:
            if not await self.undo_pause(always=True):
                raise PhaseFailed(Phase.CONTINUE_AFTER_HOOK, self._last_outcomes, FAILED) from None
            raise
        except PhaseFailed:
            await self.undo_pause()
            raise

    async def undo_pause(self, *, always: bool = False) -> bool:
        """Continue the engines a drain paused (nothing is released); True if none stays paused.

        After a failed drain this follows ``continue_on_failure``; ``always`` is for a drain a
        hook refused, which must return to ``serving``. It is a reconciliation back to
        ``serving`` (``Reconciler.reconcile``): a pause that missed its deadline may still land
        and would overtake a continue sent before it, so such calls get until the deadline and
        an engine whose pause is still in flight is left paused (as recorded) for recover() to
        continue once it has landed; an engine that reports other weights than the fleet's
        waits paused for an update.
        """
        if not (always or self._config.continue_on_failure):
            return False
        records = self._fleet.records()
        outcomes = await self.reconciler.reconcile(S.SERVING, records, UNDO_PHASES)
        self._last_outcomes = outcomes
        return self._runner.succeeded(outcomes) and not any(
            r.paused and not r.stale for r in self._fleet.live()
        )

    def _with_unattempted(self, outcomes: dict[str, EngineOutcome]) -> dict[str, EngineOutcome]:
        out = dict(outcomes)
        for record in self._fleet.records():
            if record.id not in out and not record.alive:
                out[record.id] = EngineOutcome(Outcome.NOT_ATTEMPTED, "engine already dead")
        return out

    # -- release and restore --------------------------------------------------------------------

    async def release(self, args: PhaseArgs) -> None:
        """Release the release tags of the groups that offload; the others serve."""
        groups = self.offload_groups()
        await self.reconciler.advance(S.DRAINED, S.RELEASED, groups, Op.RELEASE, Phase.RELEASE)
        # Groups that keep their memory serve while the others are offloaded, also when
        # ``pause()`` paused them before this release.
        await self.serve_keepers(S.RELEASED)

    async def restore_weights(self, args: PhaseArgs) -> None:
        """Resume the released weight tags."""
        groups = self.offload_groups()
        await self.reconciler.advance(
            S.RELEASED, S.WEIGHTS_RESTORED, groups, Op.RESUME, Phase.RESUME_WEIGHTS
        )

    async def restore_kv(self, args: PhaseArgs) -> None:
        """Resume the released tags that are not weights (the KV cache, CUDA graphs)."""
        groups = self.offload_groups()
        await self.reconciler.advance(
            S.WEIGHTS_RESTORED, S.KV_RESTORED, groups, Op.RESUME, Phase.RESUME_KV
        )

    # -- continue -------------------------------------------------------------------------------

    async def continue_(self, args: PhaseArgs) -> None:
        """Continue every paused engine, once each has the expected weights."""
        # (a call still in flight on a target holds the continue back: PhaseRunner.run)
        groups = self._fleet.groups
        await self.reconciler.advance(S.KV_RESTORED, S.SERVING, groups, Op.CONTINUE, Phase.CONTINUE)

    async def serve_keepers(self, state: ServerState) -> None:
        """Let the groups that keep their memory serve in ``state``: reconcile their engines to
        it (a continue of those left paused, except those without the expected weights, which
        wait for an update), raising ``PhaseFailed`` if a call failed."""
        keepers = [r for g in self._fleet.groups if not g.needs_offload for r in g.records]
        await self.reconciler.require(state, keepers, KEEPER_PHASES)

    # -- weight-update sessions -----------------------------------------------------------------

    async def close_sessions(
        self, phase: Phase, records: Sequence[EngineRecord]
    ) -> dict[str, EngineOutcome]:
        """End the weight-update sessions that may be open on ``records``.

        A begin still in flight would open its session after the end: it gets until the
        deadline to land, and an engine whose begin still has not answered keeps its session
        marked unknown for the next update to close. Ending a session that is not open is a
        harmless 400, which the ledger reads as closed.
        """
        deadline = self._config.deadlines.weight_update
        for record in records:
            record.may_hold_session()
        ready = await self._runner.landed(records, deadline, Op.END_UPDATE)
        return (await self._runner.run(phase, Plan(EndUpdate(), tuple(ready)), deadline)).outcomes

    async def close_open_sessions(self) -> None:
        """Close every weight-update session the records say may be open (``session_unknown``:
        an update that did not complete, a process killed in its push); ``PhaseFailed`` if one
        may still be open."""
        left_open = [r for r in self._fleet.live() if r.session_unknown]
        if left_open:
            outcomes = await self.close_sessions(Phase.CLOSE_WEIGHT_UPDATE, left_open)
            if any(r.session_unknown for r in left_open if r.alive):
                raise PhaseFailed(Phase.CLOSE_WEIGHT_UPDATE, outcomes, FAILED)


__all__ = ["Phases"]
