"""Verified weight writes (``core/verify``): ``judge``'s verdicts on fingerprints, and
``update_weights(verify=True)`` on simulated fleets, where a push that misses an engine, writes
the wrong checkpoint or changes nothing is caught before any engine serves, the engines that
fail stay paused, stale and out of serving, and the rest follow ``unverified_engines``.

The simulated engine's fingerprint is a digest of what it records each write wrote (the path a
disk update named, the group a broadcast came over), so two engines agree exactly when the same
writes reached both.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from rollout_lifecycle import (
    DeadEnginePolicy,
    EngineGroup,
    Fingerprint,
    FromDisk,
    InvalidArgument,
    LifecycleConfig,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    StaleWeights,
    WeightsNotVerified,
)
from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine
from rollout_lifecycle.contract.fingerprint import EMPTY_DIGESTS, SIMULATED_SCHEME, VLLM_SCHEME
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.verify import BLIND, UNCHANGED, Verdict, Verification, judge
from rollout_lifecycle.testing.fleets import (
    faulty_engines,
    push_reaching,
    received_ops,
    simulated_engines,
)

S = ServerState


def fp(scheme: str = "s", **tensors: str) -> Fingerprint:
    return Fingerprint(scheme, tensors)


OLD, NEW, OTHER = fp(a="1", b="1"), fp(a="2", b="2"), fp(a="2", b="3")


# -- judge ------------------------------------------------------------------------------------


def test_engines_that_agree_and_changed_pass() -> None:
    groups = {"g/0": "g", "g/1": "g"}
    assert judge(groups, {"g/0": NEW, "g/1": NEW}, {"g/0": OLD, "g/1": OLD}, Verification()) == {}


def test_an_engine_the_push_did_not_change_fails_and_the_others_are_compared_without_it() -> None:
    groups = {"g/0": "g", "g/1": "g"}
    verdicts = judge(groups, {"g/0": NEW, "g/1": OLD}, {"g/0": OLD, "g/1": OLD}, Verification())
    assert set(verdicts) == {"g/1"}
    assert verdicts["g/1"].problem == "holds the weights it held before the push"
    # a push that may be a no-op: the two disagree and neither is the majority
    noop = judge(groups, {"g/0": NEW, "g/1": OLD}, {"g/0": OLD, "g/1": OLD}, Verification((), True))
    assert set(noop) == {"g/0", "g/1"}
    assert all("no majority" in v.problem for v in noop.values())


def test_the_minority_of_a_group_fails_naming_the_tensors_that_differ() -> None:
    groups = {f"g/{i}": "g" for i in range(3)}
    after = {"g/0": NEW, "g/1": NEW, "g/2": OTHER}
    verdicts = judge(groups, after, {}, Verification())
    assert set(verdicts) == {"g/2"}
    assert verdicts["g/2"].tensors == ("b",)
    assert "most engines of group 'g'" in verdicts["g/2"].problem


def test_groups_and_schemes_are_compared_apart() -> None:
    groups = {"a/0": "a", "b/0": "b", "a/1": "a"}
    after = {"a/0": NEW, "b/0": OTHER, "a/1": fp("other", a="9")}
    assert judge(groups, after, {}, Verification()) == {}


def test_an_expected_fingerprint_is_checked_per_scheme_and_unreadable_engines_fail() -> None:
    groups = {"g/0": "g", "g/1": "g", "g/2": "g"}
    after: dict[str, Fingerprint | str] = {"g/0": NEW, "g/1": OTHER, "g/2": "EngineRejected 501"}
    verdicts = judge(groups, after, {}, Verification((NEW,)))
    assert set(verdicts) == {"g/1", "g/2"}
    assert verdicts["g/1"].problem == "differs from the expected fingerprint"
    assert verdicts["g/1"].tensors == ("b",)
    assert verdicts["g/2"].problem == "could not be read: EngineRejected 501"
    # another scheme's expectation says nothing of these engines: they must agree
    agreeing = {**after, "g/1": NEW}
    assert set(judge(groups, agreeing, {}, Verification((fp("x", a="1"),)))) == {"g/2"}


def test_an_engine_that_holds_the_expected_fingerprint_passes_whatever_it_held_before() -> None:
    groups = {"g/0": "g", "g/1": "g"}
    # a re-push of the checkpoint both already hold: the expected fingerprint proves them right
    assert (
        judge(groups, {"g/0": NEW, "g/1": NEW}, {"g/0": NEW, "g/1": NEW}, Verification((NEW,)))
        == {}
    )
    # one that held other weights before and holds them still fails, naming the tensors
    verdicts = judge(
        groups, {"g/0": NEW, "g/1": OLD}, {"g/0": NEW, "g/1": OLD}, Verification((NEW,))
    )
    assert verdicts == {"g/1": Verdict(UNCHANGED, ("a", "b"))}
    # without expected nothing proves it: agreeing with an engine the push changed is not enough
    # (both may hold what the push missed), and another scheme's expectation says nothing
    after = {"g/0": NEW, "g/1": NEW}
    for spec in (Verification(), Verification((fp("x", a="2", b="2"),))):
        verdicts = judge(groups, after, {"g/0": NEW, "g/1": OLD}, spec)
        assert verdicts == {"g/0": Verdict(UNCHANGED)}


def test_an_engine_holding_the_expected_tensors_in_another_dtype_is_told_so() -> None:
    dtypes = {"a": "float32", "b": "float32", "c": "float32"}
    casts = {"bfloat16": {"a": "a16", "b": "b16", "c": "c16"}, "float16": {"a": "ah"}}
    want = Fingerprint("s", {"a": "a32", "b": "b32", "c": "c32"}, dtypes, casts)
    groups = {"g/0": "g", "g/1": "g", "g/2": "g"}
    after = {
        "g/0": fp(a="a16", b="b16", c="c16"),  # the same values, in bfloat16
        "g/1": fp(a="a16", b="b16", c="other"),  # in bfloat16, and one tensor is other weights
        "g/2": fp(a="a32", b="b32", c="c32"),
    }
    verdicts = judge(groups, after, {}, Verification((want,)))
    assert set(verdicts) == {"g/0", "g/1"} and verdicts["g/0"].tensors == ("a", "b", "c")
    assert verdicts["g/0"].problem.startswith(
        "holds bfloat16 where the trainer's fingerprint says float32 for 3 tensors (first: a): "
    )
    assert "dtype='bfloat16'" in verdicts["g/0"].problem
    assert verdicts["g/1"].problem == (
        "differs from the expected fingerprint (2 of the 3 tensors that differ: holds bfloat16 "
        "where the trainer's fingerprint says float32 for 2 tensors (first: a))"
    )
    error = WeightsNotVerified("v1", {k: v.problem for k, v in verdicts.items()}, {})
    assert "g/0 holds bfloat16 where the trainer's fingerprint says float32" in str(error)
    # the dtypes and casts explain; they take no part in comparisons, and cross the wire
    assert want == fp(a="a32", b="b32", c="c32") and Fingerprint.from_wire(want.to_wire()) == want
    assert Fingerprint.from_wire(want.to_wire()).recast(after["g/0"])["c"] == (
        "bfloat16",
        "float32",
    )
    with pytest.raises(InvalidArgument, match="tensors it does not hold"):
        Fingerprint("s", {"a": "1"}, {"z": "float32"})
    with pytest.raises(InvalidArgument, match="casts must map dtypes"):
        Fingerprint("s", {"a": "1"}, {}, {"": {"a": "2"}})


def test_fingerprints_compare_by_content_cross_the_wire_and_refuse_bad_values() -> None:
    assert Fingerprint.from_wire(NEW.to_wire()) == NEW and hash(NEW) == hash(fp(a="2", b="2"))
    assert NEW.digest == fp(b="2", a="2").digest != OTHER.digest
    assert NEW.differing(fp(a="2")) == ("b",)
    assert NEW.differing(fp("x", a="2", b="2")) == ("a", "b")
    with pytest.raises(InvalidArgument, match="'scheme', 'tensors'"):
        Fingerprint.from_wire({"tensors": {}})
    with pytest.raises(InvalidArgument, match="map names to digests"):
        Fingerprint("s", {"a": 1})  # type: ignore[dict-item]
    error = WeightsNotVerified("v1", {"g/1": "differs"}, {"g/1": ["a", "b"]})
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, StaleWeights) and again.tensors == {"g/1": ("a", "b")}
    assert str(again) == str(error) and "g/1 differs (tensors a, b)" in str(error)


# -- update_weights(verify=True) on simulated fleets -------------------------------------------


def server_of(*engines: Any, keepers: Any = (), **config: Any) -> RolloutServer:
    groups = [EngineGroup("actor", list(engines))]
    if keepers:
        groups.append(EngineGroup("reward", list(keepers), needs_offload=False))
    return RolloutServer(groups, config=LifecycleConfig(**config))


async def fingerprint_of(path: str) -> Fingerprint:
    """What an engine holds after loading ``path``: read from a spare simulated engine."""
    spare = SimulatedEngine("spare")
    await spare.update_weights_from_disk(
        path, weight_version=None, flush_cache=False, abort_all_requests=False
    )
    found = Fingerprint.from_wire(await spare.weight_fingerprint())
    await spare.close()
    return found


async def test_a_verified_write_reads_every_engine_before_and_after_the_push() -> None:
    engines = simulated_engines(2)
    server = server_of(*engines)
    await server.offload()
    await server.onload_weights()
    await server.update_weights(FromDisk("/ckpt/step1"), "v1", verify=True)
    for engine in engines:
        calls = received_ops(engine)
        assert calls.count("weight_fingerprint") == 2
        first, second = (i for i, op in enumerate(calls) if op == "weight_fingerprint")
        assert first < calls.index("update_weights_from_disk") < second
    phases = {s.name for s in server.timeline.spans("phase")}
    assert {"fingerprint_before", "verify_weights"} <= phases
    metrics = server.metrics
    assert metrics["lifecycle/update_weights/verify_weights_s"] >= 0
    await server.onload_kv()
    assert server.state is S.SERVING
    # off by default: no fingerprint is read
    await server.offload()
    await server.onload_weights()
    await server.update_weights(FromDisk("/ckpt/step2"), "v2")
    assert all(received_ops(e).count("weight_fingerprint") == 2 for e in engines)


async def test_a_push_that_misses_an_engine_is_caught_before_either_serves() -> None:
    engines = simulated_engines(2)
    server = server_of(*engines)
    await server.offload()
    await server.onload_weights()
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(push_reaching("/ckpt/step1", "actor/0"), "v1", verify=True)
    assert caught.value.problems == {"actor/1": "holds the weights it held before the push"}
    assert server.state is S.WEIGHTS_RESTORED
    record = server.snapshot().groups[0].engines[1]
    assert record.stale and record.unverified and record.paused
    # the version it reports (set on every engine) does not let it through
    assert await engines[1].weight_version() == "v1"
    with pytest.raises(StaleWeights, match="actor/1"):
        await server.onload_kv()
    assert all(e.state()["paused"] for e in engines)
    # a write that reaches it clears it
    await server.update_weights(FromDisk("/ckpt/step1b"), "v2", verify=True)
    await server.onload_kv()
    assert server.state is S.SERVING and not any(e.state()["paused"] for e in engines)
    assert not any(r.unverified for g in server.snapshot().groups for r in g.engines)


async def test_packed_weights_are_read_before_the_session_so_a_push_that_missed_all_fails() -> None:
    # A quantized model serves its weights packed; a session's begin unpacks them and its end
    # packs them again. Read inside the session, every engine would seem changed by a push
    # that reached none, and the engines, agreeing, would all pass.
    engines = simulated_engines(2, packed_weights=True)
    server = server_of(*engines)
    await server.offload()
    await server.onload_weights()
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(push_reaching("/ckpt/step1"), "v1", verify=True)
    assert set(caught.value.problems.values()) == {"holds the weights it held before the push"}
    assert set(caught.value.problems) == {"actor/0", "actor/1"}
    calls = received_ops(engines[0])
    assert calls.index("weight_fingerprint") < calls.index("begin_weight_update")
    # a push that reaches them passes
    await server.update_weights(FromDisk("/ckpt/step1"), "v2", verify=True)
    await server.onload_kv()
    assert server.state is S.SERVING


async def test_a_wrong_checkpoint_is_caught_against_the_expected_fingerprint() -> None:
    engines = simulated_engines(2)
    server = server_of(*engines)
    await server.offload()
    await server.onload_weights()
    want = await fingerprint_of("/ckpt/step1")
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(FromDisk("/ckpt/step0"), "v1", expected=want)
    assert set(caught.value.problems) == {"actor/0", "actor/1"}
    assert caught.value.tensors["actor/0"] == tuple(sorted(want.tensors))
    await server.update_weights(FromDisk("/ckpt/step1"), "v1", expected=want)
    await server.onload_kv()
    assert server.state is S.SERVING


async def test_a_push_of_the_same_weights_fails_unless_it_may_be_a_no_op() -> None:
    engines = simulated_engines(2)
    server = server_of(*engines, verify_weights=True)
    await server.pause()
    await server.update_weights(FromDisk("/ckpt/a"), "v1")
    with pytest.raises(WeightsNotVerified, match="held before the push"):
        await server.update_weights(FromDisk("/ckpt/a"), "v2")
    await server.update_weights(FromDisk("/ckpt/a"), "v3", may_be_noop=True)
    await server.resume()
    assert server.state is S.SERVING
    assert received_ops(engines[0]).count("weight_fingerprint") == 5  # no read before a no-op


async def test_re_pushing_the_checkpoint_an_engine_holds_passes_against_the_expected_one() -> None:
    engines = simulated_engines(2)
    server = server_of(*engines)
    await server.pause()
    want = await fingerprint_of("/ckpt/step1")
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(push_reaching("/ckpt/step1", "actor/0"), "v1", expected=want)
    assert set(caught.value.problems) == {"actor/1"}
    # without expected the engine that already held it cannot show the push reached it
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(FromDisk("/ckpt/step1"), "v1", verify=True)
    assert caught.value.problems == {"actor/0": UNCHANGED}
    # with it, both hold what they must: the way back is the same checkpoint
    await server.update_weights(FromDisk("/ckpt/step1"), "v1", expected=want)
    assert not any(r.unverified for r in server.snapshot().engines().values())
    await server.resume()
    assert server.state is S.SERVING and not any(e.state()["paused"] for e in engines)
    # an engine that holds other weights than expected, unchanged, still fails
    await server.pause()
    other = await fingerprint_of("/ckpt/step2")
    with pytest.raises(WeightsNotVerified, match="actor/0 holds the weights it held before"):
        await server.update_weights(push_reaching("/ckpt/step2", "actor/1"), "v2", expected=other)


async def test_under_skip_the_engines_that_pass_go_on_and_the_others_wait_paused() -> None:
    actor, reward = simulated_engines(3, "a"), simulated_engines(2, "r")
    config = {"unverified_engines": DeadEnginePolicy.SKIP}
    server = server_of(*actor, keepers=reward, **config)
    await server.offload()
    await server.onload_weights()
    reached = ("actor/0", "actor/1", "reward/0")
    await server.update_weights(push_reaching("/ckpt/step1", *reached), "v1", verify=True)
    # the reward engine that passed serves again; the one that did not waits paused
    assert not reward[0].state()["paused"] and reward[1].state()["paused"]
    await server.onload_kv()
    assert server.state is S.SERVING
    assert [e.state()["paused"] for e in actor] == [False, False, True]
    served = {r.id for g in server.snapshot().groups for r in g.engines if not r.paused}
    assert served == set(reached)
    for _ in range(6):
        out = await server.generate({"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["weight_version"] == "v1"
    assert actor[2].stats()["completed"] == 0 and reward[1].stats()["completed"] == 0


async def test_under_skip_a_write_that_no_engine_passes_still_raises() -> None:
    engines = simulated_engines(2)
    server = server_of(*engines, unverified_engines=DeadEnginePolicy.SKIP)
    await server.pause()
    with pytest.raises(WeightsNotVerified, match=r"actor/0.*actor/1"):
        await server.update_weights(push_reaching("/ckpt/step1"), "v1", verify=True)
    assert all(e.unverified for e in server.snapshot().engines().values())


def test_an_engine_whose_checksum_reads_tensors_as_empty_fails_even_as_expected() -> None:
    empty = EMPTY_DIGESTS[VLLM_SCHEME]
    blind = Fingerprint(VLLM_SCHEME, {"w": empty, "b": "1f", "a.weight": empty})
    seeing = Fingerprint(VLLM_SCHEME, {"w": "2e", "b": "1f", "a.weight": "3d"})
    assert blind.blind == ("a.weight", "w") and seeing.blind == ()
    before = {"g/0": Fingerprint(VLLM_SCHEME, {"b": "00"})}
    verdicts = judge({"g/0": "g"}, {"g/0": blind}, before, Verification.of(blind, False))
    assert verdicts == {"g/0": Verdict(BLIND, ("a.weight", "w"))}
    assert judge({"g/0": "g"}, {"g/0": seeing}, before, Verification.of(seeing, False)) == {}


async def test_an_engine_that_cannot_say_what_it_holds_fails_verification() -> None:
    engines = faulty_engines(2)
    engines[1].arm("weight_fingerprint", "reject", count=10)
    server = server_of(*engines)
    await server.pause()
    with pytest.raises(WeightsNotVerified, match="actor/1 could not be read"):
        await server.update_weights(FromDisk("/ckpt/step1"), "v1", verify=True)


async def test_a_replacement_that_the_push_missed_is_caught_before_it_joins() -> None:
    engines = simulated_engines(2)
    server = server_of(*engines)
    await server.pause()
    await engines[1].close()
    await server.probe()
    fresh = SimulatedEngine("fresh")
    await server.recover(lambda _: fresh)
    with pytest.raises(WeightsNotVerified) as caught:
        await server.update_weights(push_reaching("/ckpt/step1", "actor/0"), "v1", verify=True)
    assert set(caught.value.problems) == {"actor/1"}
    assert fresh.state()["paused"]
    await server.update_weights(FromDisk("/ckpt/step1"), "v1", verify=True, may_be_noop=True)
    await server.resume()
    assert not fresh.state()["paused"]


async def test_verification_arguments_are_checked_before_anything_is_sent() -> None:
    engines = simulated_engines(1)
    server = server_of(*engines)
    await server.pause()
    start = len(received_ops(engines[0]))
    with pytest.raises(InvalidArgument, match="verify=False"):
        await server.update_weights(FromDisk("/x"), "v1", verify=False, expected=fp(a="1"))
    with pytest.raises(InvalidArgument, match="expected must be"):
        await server.update_weights(FromDisk("/x"), "v1", expected=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="two fingerprints of one scheme"):
        await server.update_weights(FromDisk("/x"), "v1", expected=[fp(a="1"), fp(a="2")])
    with pytest.raises(InvalidArgument, match="may_be_noop"):
        await server.update_weights(FromDisk("/x"), "v1", may_be_noop=1)  # type: ignore[arg-type]
    assert len(received_ops(engines[0])) == start


async def test_an_expected_print_in_a_scheme_no_engine_hashes_in_is_refused_up_front() -> None:
    """The engines' drivers declare their fingerprint scheme; an expectation no engine can be
    compared with would check nothing, so the write is refused before anything is sent."""
    engines = simulated_engines(2)
    server = server_of(*engines)
    await server.pause()
    start = [len(received_ops(e)) for e in engines]
    vllm_print = Fingerprint(VLLM_SCHEME, {"a": "1"})
    want = await fingerprint_of("/ckpt/step1")
    for expected in (vllm_print, [want, vllm_print]):
        with pytest.raises(InvalidArgument) as refused:
            await server.update_weights(FromDisk("/ckpt/step1"), "v1", expected=expected)
        assert str(refused.value).startswith(
            "expected gives a fingerprint in scheme 'sha256', which no engine hashes in (the "
            "engines' schemes: 'simulated' (2 simulated))"
        )
    assert [len(received_ops(e)) for e in engines] == start
    assert server.state is S.DRAINED
    await server.update_weights(FromDisk("/ckpt/step1"), "v1", expected=want)
    assert not any(r.unverified for r in server.snapshot().engines().values())


def test_the_scheme_check_waits_for_every_engines_driver_to_be_known() -> None:
    sim, vllm = SimulatedEngine.capabilities.to_wire(), VLLMHTTPEngine.capabilities.to_wire()
    records = [EngineRecord(f"g/{i}", "g", None) for i in range(2)]
    spec = Verification((fp(SIMULATED_SCHEME, a="1"), fp(VLLM_SCHEME, a="1")))
    records[0].declares(sim)
    spec.check_schemes(records)  # the second engine's driver is unknown: nothing is refused
    records[1].declares(sim)
    with pytest.raises(InvalidArgument, match="'simulated' \\(2 simulated\\)"):
        spec.check_schemes(records)
    records[1].declares(vllm)  # a mixed fleet: each expectation has its engines
    spec.check_schemes(records)
    Verification().check_schemes(records)  # nothing expected: nothing to check
