"""Weight verification: after a write, each engine's fingerprint is checked before it serves.

``update_weights(verify=True)`` (or ``LifecycleConfig.verify_weights``) reads every live
engine's fingerprint (``Op.FINGERPRINT``) before the push and again after it, and ``judge``
decides, group by group and scheme by scheme (engines that hash differently cannot be
compared), which engines fail:

- every engine whose fingerprint could not be read, or reads some tensors as empty (no weight
  is: its checksum cannot see them; ``Fingerprint.blind``);
- with an ``expected`` fingerprint of their scheme: every engine that differs from it. One that
  holds it passes whatever it held before the push (re-pushing the checkpoint an engine holds
  is the way back from a failed verification); where the difference is the dtype alone (the
  engine holds the trainer's tensors cast to another dtype: ``Fingerprint.recast``), the verdict
  says so and how to fix it;
- without one: unless the push may be a no-op, every engine that holds what it held before the
  push (a push that never reached it: agreeing with the others proves nothing, they may have
  missed it too); of the others, every engine that differs from what most of them hold (with no
  majority, every one of them).

``Verifier.verify`` marks each engine that fails stale and unverified: it stays paused and out
of the router until a later write reaches it (the version it reports does not clear it), and
under ``DeadEnginePolicy.FAIL`` the call raises ``WeightsNotVerified``; under ``SKIP`` it does
when every engine failed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rollout_lifecycle.contract.commands import ReadFingerprint
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import (
    InvalidArgument,
    LifecycleError,
    WeightsNotVerified,
)
from rollout_lifecycle.contract.fingerprint import Fingerprint
from rollout_lifecycle.contract.values import check_flag
from rollout_lifecycle.core.bus import WeightsVerified
from rollout_lifecycle.core.config import DeadEnginePolicy
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.parts import Client
from rollout_lifecycle.core.runner import Plan
from rollout_lifecycle.core.states import Phase


@dataclass(frozen=True)
class Verification:
    """What a verified write checks beyond agreement within each group."""

    #: The fingerprints the engines must hold, at most one per scheme.
    expected: tuple[Fingerprint, ...] = ()
    #: Whether an engine may hold what it held before the push (a push of the same weights);
    #: one that holds the ``expected`` fingerprint of its scheme may in any case.
    may_be_noop: bool = False

    @classmethod
    def wanted(
        cls, verify: object, expected: object, may_be_noop: object, default: bool
    ) -> Verification | None:
        """What ``update_weights(verify, expected, may_be_noop)`` asks to check, or None for
        no verification (``verify`` None follows ``default``; ``expected`` implies it)."""
        if verify is not None:
            check_flag("verify", verify)
        spec = cls.of(expected, may_be_noop)
        if verify is False and spec.expected:
            raise InvalidArgument("expected was given with verify=False: nothing would check it")
        checked = verify if verify is not None else bool(spec.expected) or default
        return spec if checked else None

    @classmethod
    def of(cls, expected: object, may_be_noop: object) -> Verification:
        """From ``update_weights``' arguments: ``expected`` is None, a ``Fingerprint`` (or its
        wire form) or a sequence of them, one per scheme; ``InvalidArgument`` otherwise."""
        check_flag("may_be_noop", may_be_noop)
        if expected is None:
            found: tuple[Fingerprint, ...] = ()
        elif isinstance(expected, Fingerprint | Mapping):
            found = (Fingerprint.from_wire(expected),)
        elif isinstance(expected, list | tuple):
            found = tuple(Fingerprint.from_wire(e) for e in expected)
        else:
            raise InvalidArgument(
                f"expected must be a Fingerprint or a sequence of them, got {expected!r}"
            )
        schemes = [f.scheme for f in found]
        if len(set(schemes)) != len(schemes):
            raise InvalidArgument(f"expected gives two fingerprints of one scheme: {schemes}")
        return cls(found, bool(may_be_noop))

    def check_schemes(self, records: Iterable[EngineRecord]) -> None:
        """Before the write: refuse an ``expected`` fingerprint in a scheme none of ``records``
        hashes in, by what their drivers declare (``Capabilities.fingerprint_scheme``). It
        would check nothing, and the engines would be judged by agreement alone. While an
        engine's driver is unknown (no call has identified it yet) the question stays open."""
        if not self.expected:
            return
        held: dict[str, Counter[str]] = defaultdict(Counter)
        for record in records:
            caps = record.capabilities
            if caps is None:
                return
            held[caps.fingerprint_scheme][caps.family] += 1
        for want in self.expected:
            if want.scheme in held:
                continue
            theirs = "; ".join(
                f"{scheme!r} ({', '.join(f'{n} {family}' for family, n in sorted(c.items()))})"
                for scheme, c in sorted(held.items())
            )
            raise InvalidArgument(
                f"expected gives a fingerprint in scheme {want.scheme!r}, which no engine hashes "
                f"in (the engines' schemes: {theirs}): compute it in theirs "
                f"(rollout_lifecycle.trainer.fingerprint(tensors, scheme)), or leave it out"
            )


#: Why an engine whose checksum reads some tensors as empty fails (``Fingerprint.blind``).
BLIND = (
    "its checksum reads some tensors as empty (no weight is), so it cannot show what they hold "
    "(vLLM on a CPU: linear weights packed away)"
)


@dataclass(frozen=True)
class Verdict:
    """Why one engine failed verification, and the tensors that differ (if any can be named)."""

    problem: str
    tensors: tuple[str, ...] = ()


def judge(
    groups: Mapping[str, str],
    after: Mapping[str, Fingerprint | str],
    before: Mapping[str, Fingerprint],
    spec: Verification,
    units: Mapping[str, str] | None = None,
) -> dict[str, Verdict]:
    """The engines of ``after`` that fail verification, by id (module docstring).

    ``groups`` maps each engine to its group; ``after`` holds each engine's fingerprint after
    the push, or why it could not be read; ``before`` the fingerprints read before it (an
    engine missing there is not checked for a change); ``units`` the engines that are members
    of a unit of several servers to its name (``_unit_verdicts``).
    """
    failed = _engine_verdicts(groups, after, before, spec)
    if units:
        failed.update(_unit_verdicts(units, after, failed))
    return failed


def _unit_verdicts(
    units: Mapping[str, str],
    after: Mapping[str, Fingerprint | str],
    failed: Mapping[str, Verdict],
) -> dict[str, Verdict]:
    """A unit serves only when every member holds the same weights, checked: its members that
    passed fail when another member failed, or when the members' fingerprints (of one scheme)
    differ among themselves."""
    members: dict[str, list[str]] = defaultdict(list)
    for engine, unit in units.items():
        if engine in after:
            members[unit].append(engine)
    out: dict[str, Verdict] = {}
    for unit, engines in members.items():
        bad = [e for e in engines if e in failed]
        prints = [after[e] for e in engines if e not in failed]
        digests = {(p.scheme, p.digest) for p in prints if isinstance(p, Fingerprint)}
        if bad:
            why = (
                f"member {bad[0]} of its unit {unit} failed verification ({failed[bad[0]].problem})"
            )
        elif len({scheme for scheme, _ in digests}) < len(digests):
            why = f"the members of its unit {unit} hold different weights"
        else:
            continue
        for engine in engines:
            if engine not in failed:
                out[engine] = Verdict(f"{why}: a unit serves only with every member verified")
    return out


def _engine_verdicts(
    groups: Mapping[str, str],
    after: Mapping[str, Fingerprint | str],
    before: Mapping[str, Fingerprint],
    spec: Verification,
) -> dict[str, Verdict]:
    """``judge`` of each engine by itself and against its group."""
    failed: dict[str, Verdict] = {}
    expected = {f.scheme: f for f in spec.expected}
    peers: dict[tuple[str, str], dict[str, Fingerprint]] = defaultdict(dict)
    for engine, found in after.items():
        if isinstance(found, str):
            failed[engine] = Verdict(f"could not be read: {found}")
        elif found.blind:
            failed[engine] = Verdict(BLIND, found.blind)
        else:
            peers[(groups[engine], found.scheme)][engine] = found
    for (group, scheme), prints in peers.items():
        want = expected.get(scheme)
        if want is not None:
            # The expected fingerprint proves an engine right whatever it held before.
            for engine, held in prints.items():
                if held != want:
                    unchanged = not spec.may_be_noop and before.get(engine) == held
                    failed[engine] = _against(held, want, unchanged)
            continue
        if not spec.may_be_noop:
            # Nothing proves an engine the push did not change right (the others may have
            # missed the push as well): it fails whatever they hold, and the rest are compared
            # among themselves.
            for engine, held in list(prints.items()):
                if before.get(engine) == held:
                    failed[engine] = Verdict(UNCHANGED)
                    del prints[engine]
        failed.update(_disagreeing(group, prints))
    return failed


#: Why an engine that holds what it held before the push fails.
UNCHANGED = "holds the weights it held before the push"


def _against(held: Fingerprint, want: Fingerprint, unchanged: bool) -> Verdict:
    """The verdict on an engine that holds ``held`` where ``want`` was expected: the dtype it
    holds the expected tensors in when that is the whole difference (``Fingerprint.recast``)."""
    differing = held.differing(want)
    recast = want.recast(held)
    if recast and len(recast) == len(differing):
        return Verdict(_dtype_problem(recast), differing)
    problem = UNCHANGED if unchanged else "differs from the expected fingerprint"
    said = sorted(set(want.dtypes.values()))
    if not recast and said and set(differing) >= set(want.tensors):
        problem += (
            f" in every tensor: if it serves another dtype than the fingerprint's "
            f"({', '.join(said)}), fingerprint the trainer's tensors in that dtype "
            f"(trainer.fingerprint(..., dtype=...)), or give casts=SERVING_DTYPES to have this "
            f"error name it"
        )
    if recast:
        share = f"{len(recast)} of the {len(differing)} tensors that differ"
        problem += f" ({share}: {_dtype_problem(recast, fix=False)})"
    return Verdict(problem, differing)


def _dtype_problem(recast: Mapping[str, tuple[str, str]], fix: bool = True) -> str:
    """What ``Fingerprint.recast`` found, e.g. "holds bfloat16 where the trainer's fingerprint
    says float32 for 15 tensors (first: a.weight)", and with ``fix`` how to put it right."""
    by_pair: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, pair in recast.items():
        by_pair[pair].append(name)
    held_dtypes = sorted({h for h, _ in by_pair})
    said_dtypes = sorted({s for _, s in by_pair})
    parts = []
    for held in held_dtypes:
        says = [
            f"{said} for {_count(names)} (first: {names[0]})"
            for (h, said), names in sorted(by_pair.items())
            if h == held
        ]
        parts.append(f"holds {held} where the trainer's fingerprint says {' and '.join(says)}")
    text = ", and ".join(parts)
    if not fix:
        return text
    if len(held_dtypes) == 1:
        cast = f"trainer.fingerprint(..., dtype={held_dtypes[0]!r})"
    else:
        cast = "a transform= that casts each tensor to the dtype the engine holds it in"
    serve = " or ".join(said_dtypes)
    return (
        f"{text}: it holds the trainer's tensors in another dtype; cast them to the engine's "
        f"dtype when you fingerprint them ({cast}), or serve the engine in {serve} if that is "
        f"the dtype meant"
    )


def _count(names: Sequence[str]) -> str:
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''}"


def _disagreeing(group: str, prints: Mapping[str, Fingerprint]) -> dict[str, Verdict]:
    """The engines of one group (and scheme) that differ from what most of them hold."""
    by_digest: dict[str, list[str]] = defaultdict(list)
    for engine, held in prints.items():
        by_digest[held.digest].append(engine)
    if len(by_digest) < 2:
        return {}
    counts = Counter({d: len(e) for d, e in by_digest.items()}).most_common(2)
    (top, n), (_, runner_up) = counts
    out: dict[str, Verdict] = {}
    if n == runner_up:
        for engine, held in prints.items():
            other = next(p for p in prints.values() if p != held)
            out[engine] = Verdict(
                f"disagrees with the other engines of group {group!r} (no majority)",
                held.differing(other),
            )
        return out
    majority = prints[by_digest[top][0]]
    for engine, held in prints.items():
        if held.digest != top:
            out[engine] = Verdict(
                f"differs from what most engines of group {group!r} hold",
                held.differing(majority),
            )
    return out


class Verifier(Client):
    """Reads fingerprints around a weight write and acts on ``judge``'s verdicts."""

    async def read(
        self, phase: Phase, records: Sequence[EngineRecord]
    ) -> dict[str, Fingerprint | str]:
        """Each engine's fingerprint, or why it could not be read, in one timed phase."""
        plan = Plan(ReadFingerprint(), tuple(records))
        result = await self._runner.run(phase, plan, self._config.deadlines.weight_update)
        out: dict[str, Fingerprint | str] = {}
        for record in plan.targets:
            outcome = result.outcomes[record.id]
            if not outcome.ok:
                out[record.id] = str(outcome)
                continue
            try:
                out[record.id] = Fingerprint.from_wire(result.value(record.id))
            except LifecycleError as exc:
                out[record.id] = f"its answer is no fingerprint: {exc}"
        return out

    async def verify(
        self,
        records: Sequence[EngineRecord],
        before: Mapping[str, Fingerprint | str],
        spec: Verification,
        version: str | None,
    ) -> None:
        """Check ``records`` after a write (``before``: what ``read`` gave before the push).

        Each engine that fails is marked stale and unverified; under ``DeadEnginePolicy.FAIL``
        ``WeightsNotVerified`` is raised, otherwise the write goes on without them.
        """
        after = await self.read(Phase.VERIFY_WEIGHTS, [r for r in records if r.alive])
        earlier = {k: v for k, v in before.items() if isinstance(v, Fingerprint)}
        groups = {r.id: r.group for r in records}
        units = {r.id: r.unit_name for r in records if r.mates}
        verdicts = judge(groups, after, earlier, spec, units)
        for record in records:
            if record.id in verdicts:
                record.failed_verification()
        self._runner.bus.publish(WeightsVerified(len(after), tuple(sorted(verdicts))))
        if not verdicts:
            return
        problems = {k: v.problem for k, v in verdicts.items()}
        tensors = {k: v.tensors for k, v in verdicts.items()}
        error = WeightsNotVerified(version, problems, tensors)
        logger().warning("weights.unverified", engines=sorted(verdicts), error=str(error))
        # SKIP goes on without the engines that failed, as long as one passed.
        if self._config.unverified_engines is DeadEnginePolicy.FAIL or len(verdicts) == len(after):
            raise error


__all__ = ["BLIND", "UNCHANGED", "Verdict", "Verification", "Verifier", "judge"]
