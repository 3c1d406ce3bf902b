"""The trainer-side fingerprint (``rollout_lifecycle.trainer``): each scheme's digest, the
engine's layout (names, shapes, dtype), and the refusals.

The SGLang digests checked here were read from a real SGLang 0.5.23 server serving the tiny
GPT-2 in float16 (``/weights_checker``): every layer-norm weight there is 64 ones and every
bias 64 zeros. ``tests/real`` compares a whole checkpoint's fingerprint with the servers'.
"""

from __future__ import annotations

import hashlib

import numpy
import pytest

from rollout_lifecycle import Fingerprint, InvalidArgument
from rollout_lifecycle.contract.fingerprint import SGLANG_SCHEME, VLLM_SCHEME
from rollout_lifecycle.trainer import VLLM_PREFIX, fingerprint, tensor_digest

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
