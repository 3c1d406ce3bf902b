"""``Capabilities``: what each engine family's driver declares, the rule a release is checked
against, their plain form (a Ray answer, a snapshot, the journal), and what an engine host sends
with an engine's incarnation."""

from __future__ import annotations

import json

import pytest

from rollout_lifecycle import FromDisk, FromDistributed, FromTensor, SGLangHTTPEngine
from rollout_lifecycle.backends.engine import EngineHost
from rollout_lifecycle.backends.sglang.client import SGLANG_CAPABILITIES, data_parallel
from rollout_lifecycle.backends.sglang.launch import LaunchedSGLangEngine
from rollout_lifecycle.backends.vllm.client import VLLM_CAPABILITIES, VLLMHTTPEngine
from rollout_lifecycle.backends.vllm.launch import LaunchedVLLMEngine
from rollout_lifecycle.contract.capabilities import DEFAULT, Capabilities, capabilities_of
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.fingerprint import (
    SGLANG_SCHEME,
    SIMULATED_SCHEME,
    VLLM_SCHEME,
    Fingerprint,
)
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.push import sends_of
from rollout_lifecycle.contract.values import Tag
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.simulated import SimulatedEngine

W, KV, CG = Tag.WEIGHTS, Tag.KV_CACHE, Tag.CUDA_GRAPH


def test_each_driver_declares_its_family() -> None:
    assert SGLANG_CAPABILITIES.family == "sglang"
    assert VLLMHTTPEngine.capabilities is VLLM_CAPABILITIES
    assert VLLM_CAPABILITIES.family == "vllm" and VLLM_CAPABILITIES.kv_wakes_at_continue
    assert not SGLANG_CAPABILITIES.kv_wakes_at_continue
    assert capabilities_of(SimulatedEngine("sim")).family == "simulated"
    # a wrapper declares what it wraps; an object that declares nothing does what SGLang does
    assert capabilities_of(FaultyEngine(SimulatedEngine("sim"))).family == "simulated"
    assert capabilities_of(object()) is DEFAULT and DEFAULT.family == "sglang"
    # a launcher declares what its server's client does
    launched = LaunchedVLLMEngine("/models/m", port=8123, python="/venv/bin/python")
    assert capabilities_of(launched) is VLLM_CAPABILITIES
    sglang = LaunchedSGLangEngine("/models/m", port=30001)
    assert capabilities_of(sglang) is SGLANG_CAPABILITIES
    # how each family digests its tensors (``weight_fingerprint`` answers in this scheme)
    assert SGLANG_CAPABILITIES.fingerprint_scheme == SGLANG_SCHEME
    assert VLLM_CAPABILITIES.fingerprint_scheme == VLLM_SCHEME
    assert SimulatedEngine.capabilities.fingerprint_scheme == SIMULATED_SCHEME


#: The operations that write weights.
WRITES = frozenset(
    {
        Op.UPDATE_FROM_DISK,
        Op.UPDATE_FROM_TENSOR,
        Op.UPDATE_FROM_DISTRIBUTED,
        Op.INIT_UPDATE_GROUP,
        Op.DESTROY_UPDATE_GROUP,
    }
)


@pytest.mark.parametrize(
    ("driver", "declared"),
    [
        (SGLangHTTPEngine, SGLANG_CAPABILITIES),
        (VLLMHTTPEngine, VLLM_CAPABILITIES),
        (SimulatedEngine, SimulatedEngine.capabilities),
    ],
)
def test_each_driver_declares_the_weight_writes_it_has_a_method_for(
    driver: type, declared: Capabilities
) -> None:
    carried = frozenset(op for op in WRITES if callable(getattr(driver, op.value, None)))
    assert declared.weight_writes == carried
    assert Op.UPDATE_FROM_DISK in carried
    assert declared.ranks == 1 and not declared.writes_limited_by


def test_each_built_in_strategy_says_what_it_sends() -> None:
    assert FromDisk("/x").sends == {Op.UPDATE_FROM_DISK}
    assert FromTensor(["a"]).sends == {Op.UPDATE_FROM_TENSOR}
    spec = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
    assert FromDistributed(**spec).sends == {Op.UPDATE_FROM_DISTRIBUTED}  # type: ignore[arg-type]
    joins = FromDistributed(  # type: ignore[arg-type]
        **spec, master_address="127.0.0.1", master_port=1, world_size=2, rank_offsets={"e": 1}
    )
    assert joins.sends == WRITES - {Op.UPDATE_FROM_DISK, Op.UPDATE_FROM_TENSOR}
    assert sends_of(lambda update: None) == frozenset() and sends_of(FromDisk("/x")) == {
        Op.UPDATE_FROM_DISK
    }


async def test_the_simulator_reads_fingerprints_in_its_declared_scheme() -> None:
    sim = SimulatedEngine("sim")
    found = Fingerprint.from_wire(await sim.weight_fingerprint())
    assert found.scheme == sim.capabilities.fingerprint_scheme


@pytest.mark.parametrize(
    ("tags", "refused"),
    [
        ((W,), True),
        ((W, CG), True),
        ((W, KV), False),
        ((KV,), False),
        ((KV, CG), False),
        ((W, KV, CG), False),
    ],
)
def test_vllm_releases_its_weights_only_with_the_kv_cache(
    tags: tuple[Tag, ...], refused: bool
) -> None:
    why = VLLM_CAPABILITIES.release_refusal(tags)
    assert (why is not None) == refused
    if why is not None:
        assert "vllm" in why and "['kv_cache']" in why
    assert SGLANG_CAPABILITIES.release_refusal(tags) is None  # one by one


def test_the_plain_form_comes_back_as_the_same_capabilities_through_json() -> None:
    odd = Capabilities("x", ((CG, W),), True, "x-md5", frozenset(), 3, "why")
    for caps in (DEFAULT, VLLM_CAPABILITIES, odd, data_parallel(4)):
        assert Capabilities.from_wire(json.loads(json.dumps(caps.to_wire()))) == caps
    # a newer driver's keys are ignored, and so are the writes this library has no name for
    assert Capabilities.from_wire({"family": "vllm", "later": 1}) == Capabilities("vllm")
    read = Capabilities.from_wire({"weight_writes": ["update_weights_from_disk", "teleport"]})
    assert read.weight_writes == {Op.UPDATE_FROM_DISK}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ("vllm", "'vllm'"),
        ({"family": ""}, "family"),
        ({"release_requires": [["weights"]]}, "release_requires"),
        ({"release_requires": [["weights", "kv"]]}, "'kv'"),
        ({"kv_wakes_at_continue": "yes"}, "'yes'"),
        ({"fingerprint_scheme": ""}, "fingerprint_scheme must be a name"),
        ({"weight_writes": "update_weights_from_disk"}, "weight_writes must be operation"),
        ({"weight_writes": [1]}, "weight_writes must be operation"),
        ({"ranks": 0}, "ranks must be an int >= 1, got 0"),
        ({"ranks": True}, "ranks must be an int >= 1, got True"),
        ({"writes_limited_by": None}, "writes_limited_by must be a string, got None"),
    ],
)
def test_a_mistyped_plain_form_is_refused_by_name(data: object, named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        Capabilities.from_wire(data)


async def test_the_host_sends_them_with_the_incarnation_and_only_then() -> None:
    host = EngineHost(SimulatedEngine("sim"))
    seen = await host.observe(paused=False, identify=True)
    assert seen["capabilities"] == SimulatedEngine.capabilities.to_wire()
    assert "capabilities" not in await host.observe(paused=True, identify=False)
