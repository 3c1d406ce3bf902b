"""The trainer-side fingerprint (``rollout_lifecycle.trainer``): each scheme's digest, the
engine's layout (names, shapes, dtype), the digests in other dtypes that let a verification
say an engine holds the trainer's tensors in another dtype, and the refusals.

The SGLang digests checked here were read from a real SGLang 0.5.23 server serving the tiny
GPT-2 in float16 (``/weights_checker``): every layer-norm weight there is 64 ones and every
bias 64 zeros. ``tests/real`` compares a whole checkpoint's fingerprint with the servers'.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy
import pytest

from rollout_lifecycle import (
    EngineGroup,
    Fingerprint,
    FromDisk,
    InvalidArgument,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    WeightsNotVerified,
)
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.fingerprint import SGLANG_SCHEME, VLLM_SCHEME
from rollout_lifecycle.trainer import SERVING_DTYPES, VLLM_PREFIX, fingerprint, tensor_digest

#: What the real server answered for ``transformer.h.0.ln_1.weight`` and ``...ln_1.bias``.
SGLANG_ONES_64_FP16 = "dba486f693668dde"
SGLANG_ZEROS_64_FP16 = "38723a2e5e8a17aa"


def test_the_sglang_digest_is_what_a_real_server_answers_for_the_same_bytes() -> None:
    assert tensor_digest(numpy.ones(64, numpy.float16), SGLANG_SCHEME) == SGLANG_ONES_64_FP16
    assert tensor_digest(numpy.zeros(64, numpy.float16), SGLANG_SCHEME) == SGLANG_ZEROS_64_FP16
    # the dtype is part of the bytes
    assert tensor_digest(numpy.ones(64, numpy.float32), SGLANG_SCHEME) != SGLANG_ONES_64_FP16


def test_the_vllm_digest_is_a_whole_sha256_of_the_bytes() -> None:
    data = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    assert tensor_digest(data, VLLM_SCHEME) == hashlib.sha256(data.tobytes()).hexdigest()
    # row-major bytes: a transposed view hashes as its own layout, not its parent's
    assert tensor_digest(data.T, VLLM_SCHEME) == hashlib.sha256(data.T.copy().tobytes()).hexdigest()
    assert tensor_digest(data.T, VLLM_SCHEME) != tensor_digest(data, VLLM_SCHEME)


def test_a_state_dict_is_put_in_the_engines_layout_before_it_is_digested() -> None:
    state = {
        "h.0.ln_1.weight": numpy.ones(64, numpy.float32),
        "h.0.attn.c_attn.weight": numpy.arange(12, dtype=numpy.float32).reshape(3, 4),
        "lm_head.weight": numpy.zeros(2, numpy.float32),
    }
    found = fingerprint(
        state,
        SGLANG_SCHEME,
        dtype=numpy.float16,
        rename=lambda n: None if n == "lm_head.weight" else f"transformer.{n}",
        transform=lambda n, t: t.T if n.endswith("c_attn.weight") else t,
    )
    assert set(found.tensors) == {
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.attn.c_attn.weight",
    }
    assert found.tensors["transformer.h.0.ln_1.weight"] == SGLANG_ONES_64_FP16
    attn = numpy.arange(12, dtype=numpy.float32).reshape(3, 4).T.astype(numpy.float16)
    assert found.tensors["transformer.h.0.attn.c_attn.weight"] == tensor_digest(attn, SGLANG_SCHEME)
    named = fingerprint([("w", numpy.ones(2))], VLLM_SCHEME, prefix=VLLM_PREFIX)
    assert list(named.tensors) == ["dp0:pp0:pcp0:tp0:w"] and isinstance(named, Fingerprint)


def test_bad_tensors_schemes_and_clashing_names_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="torch tensor or numpy array"):
        tensor_digest([1.0, 2.0], SGLANG_SCHEME)
    with pytest.raises(InvalidArgument, match="no trainer-side digest for scheme 'simulated'"):
        tensor_digest(numpy.ones(2), "simulated")
    with pytest.raises(InvalidArgument, match="two tensors are named 'w'"):
        fingerprint({"a": numpy.ones(2), "b": numpy.ones(2)}, VLLM_SCHEME, rename=lambda n: "w")


def test_a_digest_of_the_callers_replaces_the_schemes() -> None:
    found = fingerprint({"w": numpy.ones(2)}, "gpu", digest=lambda t: f"{int(t.sum()):016x}")
    assert found == Fingerprint("gpu", {"w": "0000000000000002"})
    with pytest.raises(InvalidArgument, match="pass digest="):
        fingerprint({"w": numpy.ones(2)}, "gpu")


def test_the_fingerprint_records_each_tensors_dtype_and_its_digests_in_the_others() -> None:
    state = {"w": numpy.arange(4, dtype=numpy.float32) / 3, "steps": numpy.arange(2)}
    assert not fingerprint(state, SGLANG_SCHEME).casts  # (one digest per tensor by default)
    found = fingerprint(state, SGLANG_SCHEME, casts=SERVING_DTYPES)
    assert dict(found.dtypes) == {"w": "float32", "steps": "int64"}
    # numpy has no bfloat16 (without ml_dtypes): float16 alone; integers are not cast
    assert {k: dict(v) for k, v in found.casts.items()} == {
        "float16": {"w": tensor_digest(state["w"].astype(numpy.float16), SGLANG_SCHEME)}
    }
    # cast from the trainer's values, not from the dtype the fingerprint is in (w / 3 is
    # not exact in float16)
    half = fingerprint(state, SGLANG_SCHEME, dtype=numpy.float16, casts=SERVING_DTYPES)
    assert half.dtypes["w"] == "float16" and half.casts["float32"]["w"] == found.tensors["w"]
    assert half == fingerprint(state, SGLANG_SCHEME, dtype=numpy.float16, casts=())
    assert not fingerprint(state, SGLANG_SCHEME, casts=()).casts
    with pytest.raises(InvalidArgument, match="casts must be a sequence"):
        fingerprint(state, SGLANG_SCHEME, casts="float16")


#: The checkpoints the float16 engines below load, as the trainer holds them (float32).
CHECKPOINTS = {
    "/ckpt/step1": {
        f"h.{i}.{part}": numpy.linspace(i, i + 1, 8, dtype=numpy.float32) / 3
        for i in range(5)
        for part in ("ln.weight", "ln.bias", "mlp.weight")
    }
}


class Float16Engine(SimulatedEngine):
    """A simulated engine whose checksum digests the bytes of the checkpoint it loaded, held
    in float16 (an SGLang server started with ``--dtype float16``)."""

    #: It reads SGLang's checksums, and says so (``Capabilities.fingerprint_scheme``).
    capabilities = Capabilities("sglang-float16", fingerprint_scheme=SGLANG_SCHEME)
    loaded: str | None = None

    async def update_weights_from_disk(self, model_path: str, **options: Any) -> None:
        await super().update_weights_from_disk(model_path, **options)
        self.loaded = model_path

    async def weight_fingerprint(self) -> dict[str, Any]:
        await super().weight_fingerprint()
        assert self.loaded is not None
        held = CHECKPOINTS[self.loaded].items()
        digests = {k: tensor_digest(v.astype(numpy.float16), SGLANG_SCHEME) for k, v in held}
        return {"scheme": self.capabilities.fingerprint_scheme, "tensors": digests}


async def test_a_verification_says_when_an_engine_holds_the_trainers_tensors_in_another_dtype() -> (
    None
):
    engines = [Float16Engine("e0"), Float16Engine("e1")]
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    tensors = CHECKPOINTS["/ckpt/step1"]
    with pytest.raises(WeightsNotVerified) as caught:
        # the trainer's fingerprint in its own dtype, float32, without the other dtypes' digests
        await server.update_weights(
            FromDisk("/ckpt/step1"), "v1", expected=fingerprint(tensors, SGLANG_SCHEME)
        )
    for engine in ("actor/0", "actor/1"):
        assert caught.value.problems[engine].startswith(
            "differs from the expected fingerprint in every tensor: if it serves another dtype "
            "than the fingerprint's (float32), fingerprint the trainer's tensors in that dtype"
        )
    with pytest.raises(WeightsNotVerified) as caught:
        # with them: the error names the dtype
        await server.update_weights(
            FromDisk("/ckpt/step1"),
            "v1",
            expected=fingerprint(tensors, SGLANG_SCHEME, casts=SERVING_DTYPES),
        )
    first = sorted(tensors)[0]
    for engine in ("actor/0", "actor/1"):
        assert caught.value.problems[engine].startswith(
            f"holds float16 where the trainer's fingerprint says float32 for 15 tensors "
            f"(first: {first}): it holds the trainer's tensors in another dtype; cast them to "
            f"the engine's dtype when you fingerprint them "
            f"(trainer.fingerprint(..., dtype='float16'))"
        )
        assert caught.value.tensors[engine] == tuple(sorted(tensors))
    assert "actor/0 holds float16 where the trainer's fingerprint says float32" in str(caught.value)
    # fingerprinted in the engine's dtype, the same checkpoint again passes
    want = fingerprint(tensors, SGLANG_SCHEME, dtype=numpy.float16)
    await server.update_weights(FromDisk("/ckpt/step1"), "v1", expected=want)
    await server.resume()
    assert server.state is ServerState.SERVING
