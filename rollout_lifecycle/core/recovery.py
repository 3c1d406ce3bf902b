"""Recovery: replace dead engines and engines in an unknown state, and heal the rest.

``Recovery.recover`` works out the state the fleet should be in (the server's, or after a
failure the state the healthy engines' records imply), makes every replacement through the
user's factory before anything is retired, reads each, then reconciles the replacements and
the healthy engines a part-way failure left behind or ahead to that state's memory targets
(``core/reconcile``: recovery is reconciling, not a lifecycle of its own), and leaves
``failed`` only when the records agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.commands import Observe
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import IllegalTransition, InvalidArgument, PhaseFailed
from rollout_lifecycle.contract.outcome import DISAGREEMENTS, EngineOutcome, Outcome
from rollout_lifecycle.core.group import EngineGroup
from rollout_lifecycle.core.ledger import (
    KEEPERS_SERVE,
    SETTLED_STATES,
    EngineRecord,
    EngineSnapshot,
)
from rollout_lifecycle.core.machine import Machine
from rollout_lifecycle.core.parts import Client, Parts
from rollout_lifecycle.core.phases import Phases
from rollout_lifecycle.core.runner import Plan
from rollout_lifecycle.core.states import Phase, ServerState

S = ServerState

#: Makes a replacement engine for an engine id (``"group/index"``); may be async.
EngineFactory = Callable[[str], Any]
#: Makes a replacement unit for the ids of a unit's members (``("pd/0", "pd/1")``, a group
#: declared with ``unit=2``): one new engine per member, in that order; may be async.
UnitFactory = Callable[[tuple[str, ...]], Any]


class Recovery(Client):
    """``recover()`` of one server."""

    def __init__(
        self, parts: Parts, groups: Mapping[str, EngineGroup], phases: Phases, machine: Machine
    ) -> None:
        super().__init__(parts)
        self._groups = groups
        self._phases = phases
        self._machine = machine

    async def reset(self) -> None:
        """Leave ``failed`` for the state the records imply once every engine has been read
        (``survey``); let the keepers serve there."""
        machine = self._machine
        machine.plan("reset")
        await self.survey(Phase.RESET_PROBE)
        unsettled = self._fleet.unsettled()
        if unsettled:
            raise IllegalTransition(
                "reset",
                machine.state.value,
                [S.FAILED.value],
                reason=f"the engines' records imply no single state to settle in: "
                f"{'; '.join(unsettled)}; recover() brings them to one",
            )
        await machine.perform("reset")
        if machine.state in KEEPERS_SERVE:
            # an offload that failed after its release may have left them paused
            try:
                await self._phases.serve_keepers(machine.state)
            except PhaseFailed:
                await machine.fail()
                raise

    async def survey(self, phase: Phase) -> list[EngineRecord]:
        """Before ``reset()`` or ``recover()`` settles anything on the records: read every live
        engine and let its record learn what it shows (a process restarted at its address is a
        fresh server; one paused or continued behind the records' back is in an unknown
        state), then close every weight-update session that may be open (a process killed in
        its push left one). The records found restarted (fresh servers now); ``PhaseFailed``
        if a session may still be open."""
        outcomes = await self.take_in(self._fleet.live(), phase)
        await self._phases.close_open_sessions()
        return [
            r
            for r in self._fleet.live()
            if r.id in outcomes and outcomes[r.id].outcome is Outcome.RESTARTED
        ]

    async def take_in(
        self, records: Sequence[EngineRecord], phase: Phase = Phase.PROBE_AGAIN
    ) -> dict[str, EngineOutcome]:
        """Look at ``records`` again (a probe found them restarted or not paused as recorded)
        and let each record learn what its engine shows now; fail the server if the records
        then imply another state. Under the server's lock."""
        plan = Plan(Observe(), tuple(r for r in records if r.alive))
        result = await self._runner.run(phase, plan, self._config.deadlines.probe)
        for record in plan.targets:
            out = result.outcomes[record.id]
            if out.outcome in DISAGREEMENTS:
                record.learn(out.outcome, result.restarted.get(record.id))
                logger().warning(
                    "engine.disagrees", server=self._name, engine=record.id, detail=out.detail
                )
        machine = self._machine
        if plan.targets and not self._fleet.implies(machine.state):
            await machine.fail()
        self._journal()
        gate = self._runner.gate
        if gate is not None and plan.targets:
            await gate.after(plan, result)  # the router follows the records learned
        return result.outcomes

    async def recover(
        self, factory: EngineFactory | None, unit_factory: UnitFactory | None = None
    ) -> dict[str, EngineOutcome]:
        """Replace the broken engines (every member of a unit one of them belongs to, through
        ``unit_factory``; the others through ``factory``), heal the rest; the outcome of every
        step."""
        fleet, machine = self._fleet, self._machine
        _check_factories(_units(fleet.broken()), factory, unit_factory)  # (before any read)
        renewed = await self.survey(Phase.RECOVER_SURVEY)  # fresh servers now, like replacements
        # a member restarted in place makes its unit unhealthy: the unit is replaced whole
        broken = fleet.broken(also=[r for r in renewed if r.mates])
        units = _units(broken)
        _check_factories(units, factory, unit_factory)
        state = machine.state
        skip = {r.id for r in broken} | {r.id for r in renewed}
        goal = fleet.settled_state(skip=skip) if state is S.FAILED else state
        if goal is None and state is S.FAILED:
            goal = fleet.majority_state(skip)
        if goal is S.SERVING and state is S.FAILED and self._versions.interrupted:
            # No engine may continue until a write completes (an unversioned push raised): the
            # fleet waits drained, where update_weights() is legal, and resume() serves after it.
            goal = S.DRAINED
        # (``kv_restored`` only as the current state: the records of a fleet in it settle as
        # ``drained``)
        if goal not in SETTLED_STATES:
            raise IllegalTransition("recover", state.value, [s.value for s in SETTLED_STATES])
        assert goal is not None
        replacements: list[tuple[EngineRecord, Any]] = []
        deadline = self._config.deadlines.startup
        for unit in units:  # every replacement exists before anything is retired
            if len(unit) == 1:
                (record,) = unit
                assert factory is not None  # (_check_factories)
                engine = await self._hooks.run_user(
                    "recover", factory, record.id, deadline, wrap=False
                )
                replacements.append((record, engine))
                continue
            ids = tuple(r.id for r in unit)
            assert unit_factory is not None  # (_check_factories)
            made = await self._hooks.run_user("recover", unit_factory, ids, deadline, wrap=False)
            if isinstance(made, str | bytes) or not isinstance(made, Sequence):
                raise InvalidArgument(
                    f"unit_factory({ids}) must return a sequence of {len(unit)} engines, one per "
                    f"member in that order; got {made!r}"
                )
            if len(made) != len(unit):
                raise InvalidArgument(
                    f"unit_factory({ids}) returned {len(made)} engines for a unit of "
                    f"{len(unit)}: give one new engine per member, in that order"
                )
            replacements.extend(zip(unit, made, strict=True))
        self._check_replacements(replacements)
        log = logger().bind(server=self._name, call="recover")
        retired = []
        #: What the records said of engines handed back at their own address (maybe the same
        #: process: a restart is only known once the engine has shown its incarnation).
        previous: dict[str, EngineSnapshot] = {}
        for record, engine in replacements:
            saved = record.snapshot()
            old = self._groups[record.group].replace(record, engine)
            log.info("engine.replaced", engine=record.id, target=goal.value)
            if seam.identity(old) != seam.identity(record.handle):
                retired.append(old)
            else:
                previous[record.id] = saved  # (not stopped: it may be a server restarted there)
        self._journal()
        for old in retired:
            await seam.retire(old, self._config.deadlines.probe)
        try:
            outcomes, fresh = await self.probe(
                [r for r, _ in replacements], Phase.RECOVER_PROBE, previous
            )
            fresh += [r for r in renewed if r.alive and r.id not in {b.id for b in broken}]
            if self._runner.succeeded(outcomes):
                # the fresh replacements and every healthy engine (one handed back as the same
                # process among them) reconciled to the goal together, phase by phase
                back = {r.id for r, _ in replacements if r not in fresh}
                records = fresh + self._fleet.live(skip - back)
                outcomes.update(await self._phases.reconciler.reconcile(goal, records))
        except Exception:
            # replacements in place but not brought up: the records imply no state
            if replacements and machine.state is not S.FAILED:
                await machine.fail()
            raise
        if not self._runner.succeeded(outcomes):
            if state is not S.FAILED:
                await machine.fail()
            raise PhaseFailed(Phase.RECOVER, outcomes, S.FAILED.value)
        if state is S.FAILED:
            await machine.advance("reset")
            if machine.state is S.FAILED:
                raise IllegalTransition(
                    "recover",
                    S.FAILED.value,
                    [],
                    reason=f"the engines' records still imply no single state after it: "
                    f"{'; '.join(fleet.unsettled())}",
                )
        return outcomes

    async def probe(
        self,
        records: Sequence[EngineRecord],
        phase: Phase = Phase.RECOVER_PROBE,
        previous: Mapping[str, EngineSnapshot] | None = None,
    ) -> tuple[dict[str, EngineOutcome], list[EngineRecord]]:
        """Read every replacement (or engine joining: ``core/membership``) before counting it
        (``phase``, within ``Deadlines.startup``): the outcomes, and those that are fresh
        servers.

        One handed back at its own address that shows the incarnation its record had is the
        same process, not a fresh engine: it keeps its record (alive again), and if that record
        holds tags in an unknown state nothing can settle them, so it is refused. One that
        reports itself paused is not the fresh server a replacement must be (its memory cannot
        be read): refused, its tags recorded as unknown, for the factory to replace again.
        """
        previous = previous or {}
        plan = Plan(Observe(), tuple(records))
        result = await self._runner.run(phase, plan, self._config.deadlines.startup)
        outcomes = dict(result.outcomes)
        fresh: list[EngineRecord] = []
        for record in records:
            out = outcomes[record.id]
            observed = result.answer(record.id)
            said = observed if isinstance(observed, Mapping) else {}
            seen = said.get("incarnation")
            saved = previous.get(record.id)
            same = saved is not None and saved.incarnation is not None and seen == saved.incarnation
            unused: tuple[Outcome, str] | None = None  # (not used: its tags become unknown)
            if same and record.mates and saved is not None and not saved.stale:
                # one member of a unit as it was, the rest new: not a unit that lives together
                # (one that was a fresh server, restarted in place, is handed back as such)
                unused = (
                    Outcome.REFUSED,
                    f"the unit factory handed back the process {record.id} was (incarnation "
                    f"{seen}, not restarted): a unit is replaced whole; restart every member",
                )
            elif same:
                assert saved is not None
                record.kept(saved)  # the process the record described: it keeps its record
                outcomes[record.id] = EngineOutcome(Outcome.OK, "", out.duration_s)
                if record.uncertain:
                    outcomes[record.id] = EngineOutcome(
                        Outcome.REFUSED,
                        f"the factory handed back the process it was to replace (incarnation "
                        f"{seen}, not restarted): its tags {list(saved.uncertain)} are still in "
                        f"an unknown state; restart that server, or hand back another engine",
                        out.duration_s,
                    )
            elif out.outcome is Outcome.CONFLICT:
                unused = (
                    Outcome.CONFLICT,
                    f"the replacement is not a fresh server ({out.detail}); what memory it "
                    f"holds cannot be read, so it is not used",
                )
            elif out.ok:
                # (a replacement's record is new: it names no process yet)
                record.met(seen, said.get("capabilities"))
                fresh.append(record)
            if unused is not None:
                record.learn(Outcome.CONFLICT, None)  # (replaced again by the next recover())
                outcomes[record.id] = EngineOutcome(*unused, out.duration_s)
        return outcomes, fresh

    def _check_replacements(self, replacements: Sequence[tuple[EngineRecord, Any]]) -> None:
        """Refuse, before anything is retired, replacements that are engines of this server
        already (other than the one each replaces) or that two factory calls returned."""
        replaced = {r.id for r, _ in replacements}
        taken = {r.key: f"engine {r.id}" for r in self._fleet.records() if r.id not in replaced}
        for record, engine in replacements:
            key = seam.identity(seam.as_handle(engine, record.group, 0))
            if key in taken:
                raise InvalidArgument(
                    f"the replacement for {record.id} is {taken[key]} already; "
                    f"the factory must return a new engine"
                )
            taken[key] = f"the replacement for {record.id}"


def _units(records: Sequence[EngineRecord]) -> list[tuple[EngineRecord, ...]]:
    """``records`` (each unit's members all in it, in group order) as their units."""
    out: list[tuple[EngineRecord, ...]] = []
    seen: set[str] = set()
    for record in records:
        if record.id not in seen:
            unit = record.unit
            seen.update(r.id for r in unit)
            out.append(unit)
    return out


def _check_factories(
    units: Sequence[tuple[EngineRecord, ...]],
    factory: EngineFactory | None,
    unit_factory: UnitFactory | None,
) -> None:
    """Refuse, before anything is made, a recover() that lacks the factory a broken engine or
    unit needs."""
    for unit in units:
        if len(unit) == 1 and factory is None:
            raise InvalidArgument(
                f"engine {unit[0].id} must be replaced ({unit[0].state.value}); recover(factory) "
                f"makes one engine, pass it"
            )
        if len(unit) > 1 and unit_factory is None:
            why = ", ".join(f"{r.id} {r.state.value}" for r in unit)
            raise InvalidArgument(
                f"unit {unit[0].unit_name} must be replaced whole ({why}); "
                f"recover(unit_factory=...) makes the {len(unit)} engines of a unit, pass it"
            )


__all__ = ["EngineFactory", "Recovery", "UnitFactory"]
