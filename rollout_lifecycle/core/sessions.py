"""Weight writes: a weight-update session on every engine around the user's push.

``WeightWriter.write`` is the phase of ``update_weights()``: it pauses the engines still serving,
closes a session an earlier update left open, opens one everywhere, runs the user's push,
closes the sessions, sets the version (aborting nothing), flushes the prefix cache where the KV
cache is resident, verifies the weights when asked (``core/verify``), and continues what it
paused, on the expected weights only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.commands import (
    BeginUpdate,
    EndUpdate,
    Flush,
    SetVersion,
)
from rollout_lifecycle.contract.exceptions import (
    IllegalEngineOp,
    PhaseFailed,
    WeightPushFailed,
    shortlist,
)
from rollout_lifecycle.contract.fingerprint import Fingerprint
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import SESSION_OPEN, EngineOutcome
from rollout_lifecycle.contract.push import WeightPush, WeightUpdate, sends_of
from rollout_lifecycle.contract.values import PauseMode
from rollout_lifecycle.core.args import PhaseArgs
from rollout_lifecycle.core.parts import Client, Parts
from rollout_lifecycle.core.phases import Phases
from rollout_lifecycle.core.runner import PhaseResult, Plan, guard_groups
from rollout_lifecycle.core.states import Phase, ServerState
from rollout_lifecycle.core.verify import Verifier

FAILED = ServerState.FAILED.value
#: The write's reconciliations take one step each: the pause before it, the continue after it.
_HOLD: Mapping[Op, Phase] = {Op.PAUSE: Phase.PAUSE_FOR_UPDATE}
_SERVE: Mapping[Op, Phase] = {Op.CONTINUE: Phase.CONTINUE_AFTER_UPDATE}


class WeightWriter(Client):
    """The weight-write phase of one server."""

    def __init__(self, parts: Parts, phases: Phases) -> None:
        super().__init__(parts)
        self._phases = phases
        self._verifier = Verifier(parts)

    def preflight(self, args: PhaseArgs) -> None:
        """Before the write, what the engines' drivers declare must allow it: each operation the
        push says it sends (``sends_of``; ``Capabilities.weight_writes``) and each ``expected``
        fingerprint's scheme (``Verification.check_schemes``). An engine whose driver is not
        known yet leaves the question to the engine."""
        sends = sends_of(args.push)
        cannot: dict[Capabilities, list[str]] = {}
        for record in self._fleet.live() if sends else ():
            caps = record.capabilities
            if caps is not None and not sends <= caps.weight_writes:
                cannot.setdefault(caps, []).append(record.id)
        for caps, ids in cannot.items():
            missing = sorted(op.value for op in sends - caps.weight_writes)
            why = f"; {caps.writes_limited_by}" if caps.writes_limited_by else ""
            raise IllegalEngineOp(
                shortlist(ids, 3),
                "update_weights",
                f"{type(args.push).__name__} sends {missing}, which the {caps.family} driver "
                f"does not carry (it writes weights by "
                f"{sorted(op.value for op in caps.weight_writes)}{why}): push with a strategy "
                f"it carries, or write through the engine's own weight transfer in a push of "
                f"yours",
            )
        if args.verify is not None:
            args.verify.check_schemes(self._fleet.records())

    async def write(self, args: PhaseArgs) -> None:
        """The ``write_weights`` phase, with ``args.push`` and ``args.version``."""
        push, version, spec = args.push, args.version, args.verify
        assert push is not None
        deadlines = self._config.deadlines
        runner, fleet = self._runner, self._fleet
        guard_groups(fleet.groups, Op.SET_VERSION)
        await self._hooks.before(Phase.UPDATE_WEIGHTS)
        if version is not None:
            # From here on generation continues only on engines that report this version.
            self._versions.expected = version
        # Engines still serving (groups that keep their memory) are paused around the write:
        # the pause of a reconciliation to 'drained' that holds every engine.
        serving = [r for r in fleet.live() if not r.paused]
        reconciler = self._phases.reconciler
        await reconciler.require(ServerState.DRAINED, serving, _HOLD, hold=True)
        # A session that an earlier update left open (its begin or end did not complete, or a
        # process killed in its push) is closed first, or this begin would be refused with "a
        # weight update session is already open".
        await self._phases.close_open_sessions()
        # The fingerprints before the push are read before the sessions open: a begin restores
        # packed weights to the layout a load writes and the end packs them again (sglang:
        # model_runner_components/weight_updater.py begin_weight_update and
        # end_weight_update; model_loader/loader.py DefaultModelLoader
        # .restore_weights_before_loading, for quantized models), so only a read outside the
        # session sees the layout the read after the push sees.
        before: dict[str, Fingerprint | str] = {}
        if spec is not None and not spec.may_be_noop:
            before = await self._verifier.read(Phase.FINGERPRINT_BEFORE, fleet.live())
        outcomes = await self._begin()
        if not runner.succeeded(outcomes) and all(
            o.ok or o.status == SESSION_OPEN for o in outcomes.values()
        ):
            # Engines that answered "a session is already open" (one nothing recorded: a
            # controller that died without a journal) hold one: closed, the begin goes again.
            await self._phases.close_open_sessions()
            outcomes = await self._begin()
        if not runner.succeeded(outcomes):
            # Close the sessions that did (or may have) opened, or every later update would be
            # refused with "a weight update session is open".
            await self._phases.close_sessions(
                Phase.END_WEIGHT_UPDATE, [r for r in fleet.live() if r.session_unknown]
            )
            raise PhaseFailed(Phase.BEGIN_WEIGHT_UPDATE, outcomes, FAILED)
        engines = {r.id: r.handle for r in fleet.live()}
        try:
            await self._call_push(push, WeightUpdate(version, engines))
        except BaseException:
            # It may have stopped halfway; with a version, the version check refuses every
            # engine it did not finish, without one nothing would tell them apart.
            if version is None:
                self._versions.interrupted = True
            raise
        finally:
            end = Plan.over(fleet.groups, EndUpdate())
            await runner.require(Phase.END_WEIGHT_UPDATE, end, deadlines.weight_update)
        if version is not None:
            plan = Plan.over(fleet.groups, SetVersion(version))
            await runner.require(Phase.UPDATE_WEIGHT_VERSION, plan, deadlines.weight_update)
        self._versions.interrupted = False
        for record in fleet.live():
            record.written(versioned=version is not None)
        # The prefix cache holds KV computed with the old weights: drop it wherever the KV
        # cache is resident (a released KV cache comes back empty).
        resident = [
            r
            for r in fleet.live()
            if not (r.released | r.uncertain) and r.pause_mode is not PauseMode.IN_PLACE
        ]
        interval = self._config.flush_retry_interval
        plan = Plan(Flush(deadlines.flush, interval), tuple(resident))
        await runner.require(Phase.FLUSH_AFTER_UPDATE, plan, deadlines.flush + deadlines.probe)
        if spec is not None:
            await self._verifier.verify(fleet.live(), before, spec, version)
        # Only a complete write continues what it paused: the continue of a reconciliation to
        # the server's state. Outside 'drained' the groups that keep their memory serve (also
        # those an earlier write that failed left paused). In 'drained' they serve or not as
        # the server found them (not held there): those the write paused go back to serving.
        # An engine without the expected weights (it reports another version, or failed
        # verification) waits paused for an update while the others go on.
        state = self._state()
        if state is ServerState.DRAINED:
            paused_here = [r for r in serving if not fleet.offloads(r)]
            await reconciler.require(ServerState.SERVING, paused_here, _SERVE)
        else:
            await reconciler.require(state, fleet.records(), _SERVE)

    async def _begin(self) -> dict[str, EngineOutcome]:
        """Open a session on every live engine (``begin_weight_update``); the outcomes."""
        begin = Plan.over(self._fleet.groups, BeginUpdate())
        deadline = self._config.deadlines.weight_update
        return (await self._runner.run(Phase.BEGIN_WEIGHT_UPDATE, begin, deadline)).outcomes

    async def _call_push(self, push: WeightPush, update: WeightUpdate) -> None:
        start = time.monotonic()
        try:
            # A built-in push's own failure reaches the caller as it is (``WeightPushFailed``).
            await self._hooks.run_user(
                "update_weights",
                push,
                update,
                self._config.deadlines.weight_update,
                grace=None,
                own=(WeightPushFailed,),
            )
        finally:
            self._runner.observe(PhaseResult(Phase.PUSH, {}, start, time.monotonic() - start))


__all__ = ["WeightWriter"]
