"""Weight fingerprints from the trainer's side: what an engine's checksum route answers for the
weights a trainer pushes, computed from the trainer's own tensors.

A trainer that passes the result to ``update_weights(expected=...)`` checks "the engines hold
exactly what I pushed", not only "the engines agree". The digest is over the bytes the engine
holds, so the trainer's tensors must first be put in the engine's layout: its tensor names
(``rename``), its dtype (``dtype``: the engine's serving dtype, e.g. float16) and its shapes
(``transform``: a GPT-2 ``Conv1D`` weight is held transposed, as a ``Linear`` weight, by both
SGLang and vLLM). The fingerprint also records each tensor's dtype and, asked for (``casts``,
e.g. ``SERVING_DTYPES``), its digest cast to other dtypes, so that verification can tell an
engine that holds the trainer's tensors in another dtype (``Fingerprint.recast``). Each scheme's
algorithm is read from the engine's source:

- ``SGLANG_SCHEME``: the first 8 bytes of a sha256 of each tensor's bytes, as 16 hex digits,
  over parameters and persistent buffers (sglang: ``utils/weight_checker.py``
  ``_compute_checksum``, ``_hash_tensor``; ``managers/mm_utils.py`` ``tensor_hash``). That is
  SGLang's digest of a tensor in host memory; a tensor on a GPU it digests with a Triton kernel
  (``kernels/ops/memory/gpu_tensor_hash.py``), which a trainer passes as ``digest``, e.g.
  ``lambda t: f"{gpu_tensor_hash(t.cuda()):016x}"``.
- ``VLLM_SCHEME``: a sha256 hex digest of each parameter's bytes, named
  ``dp<r>:pp<r>:pcp<r>:tp<r>:<param>`` (``VLLM_PREFIX`` for a single worker; vllm:
  ``model_executor/model_loader/weight_checksum.py`` ``compute_tensor_digests``,
  ``v1/worker/gpu_worker.py`` ``compute_weight_checksums``).

Tensors are torch tensors or numpy arrays; each library is imported only for a tensor of its
own, so the module imports without either.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.fingerprint import SGLANG_SCHEME, VLLM_SCHEME, Fingerprint
from rollout_lifecycle.contract.values import check_int

#: The name prefix vLLM gives the tensors of a single worker (no parallelism).
VLLM_PREFIX = "dp0:pp0:pcp0:tp0:"

#: The dtypes an engine serves a model's floating-point tensors in: ``fingerprint`` digests each
#: such tensor in the others too (``casts``), so that a verification can name the dtype an
#: engine holds it in.
SERVING_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")

#: How each scheme digests one tensor's bytes.
_DIGESTS: dict[str, Callable[[memoryview], str]] = {
    SGLANG_SCHEME: lambda data: hashlib.sha256(data).digest()[:8].hex(),
    VLLM_SCHEME: lambda data: hashlib.sha256(data).hexdigest(),
}


def tensor_bytes(tensor: Any) -> memoryview:
    """The bytes ``tensor`` holds, in row-major order, as the engines hash them."""
    if hasattr(tensor, "detach"):  # a torch tensor: its bytes, whatever its dtype
        uint8 = importlib.import_module("torch").uint8
        flat: Any = tensor.detach().cpu().contiguous().reshape(-1).view(uint8).numpy()
        return memoryview(flat)
    if hasattr(tensor, "dtype") and hasattr(tensor, "tobytes"):  # a numpy array
        numpy = importlib.import_module("numpy")
        array: Any = numpy.ascontiguousarray(tensor).reshape(-1).view(numpy.uint8)
        return memoryview(array)
    raise InvalidArgument(f"a tensor must be a torch tensor or numpy array, got {type(tensor)}")


def scheme_digest(scheme: str) -> Callable[[Any], str]:
    """The digest of one tensor in ``scheme`` (``SGLANG_SCHEME`` or ``VLLM_SCHEME``)."""
    digest = _DIGESTS.get(scheme)
    if digest is None:
        raise InvalidArgument(
            f"no trainer-side digest for scheme {scheme!r}; known: {sorted(_DIGESTS)}; "
            f"pass digest= for another"
        )
    return lambda tensor: digest(tensor_bytes(tensor))


def tensor_digest(tensor: Any, scheme: str) -> str:
    """``tensor``'s digest in ``scheme`` (``SGLANG_SCHEME`` or ``VLLM_SCHEME``)."""
    return scheme_digest(scheme)(tensor)


def dtype_name(dtype: Any) -> str:
    """A dtype's name as the fingerprint records it, e.g. ``"bfloat16"``: a string as it is, a
    torch dtype without its ``torch.`` prefix, a numpy dtype (or scalar type) by its name."""
    if isinstance(dtype, str):
        return dtype
    if type(dtype).__module__ == "torch":  # torch.float16 -> "torch.float16"
        return str(dtype).removeprefix("torch.")
    return str(importlib.import_module("numpy").dtype(dtype).name)


def _is_float(tensor: Any) -> bool:
    if hasattr(tensor, "detach"):
        return bool(tensor.is_floating_point())
    numpy = importlib.import_module("numpy")
    return bool(numpy.issubdtype(tensor.dtype, numpy.floating))


def _cast(tensor: Any, dtype: str) -> Any:
    """``tensor`` cast to the dtype named ``dtype``, or None when its library has no such dtype
    (numpy has no bfloat16 without ``ml_dtypes``)."""
    if hasattr(tensor, "detach"):
        target = getattr(importlib.import_module("torch"), dtype, None)
        return tensor.to(target) if target is not None else None
    try:
        return tensor.astype(importlib.import_module("numpy").dtype(dtype))
    except TypeError:
        return None


#: The weights of a Hugging Face GPT-2 stored as ``Conv1D`` (``[in, out]``), which the engines
#: hold transposed, as ``Linear`` weights (``[out, in]``); checked against SGLang 0.5.23.
GPT2_CONV1D_WEIGHTS: tuple[str, ...] = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


def transposing(suffixes: Iterable[str]) -> Callable[[str, Any], Any]:
    """A ``transform`` for ``fingerprint`` that transposes the 2-D tensors whose names end with
    one of ``suffixes`` (e.g. ``GPT2_CONV1D_WEIGHTS``) and passes the others unchanged."""
    ends = tuple(suffixes)

    def transform(name: str, tensor: Any) -> Any:
        return tensor.T if name.endswith(ends) and len(tensor.shape) == 2 else tensor

    return transform


def emptying(suffixes: Iterable[str]) -> Callable[[str, Any], Any]:
    """A ``transform`` for ``fingerprint`` that empties the tensors whose names end with one of
    ``suffixes``: what vLLM on a CPU holds where its checksum reads a linear layer's weight,
    once the weight is packed for the CPU kernels (vllm: model_executor/layers/utils.py
    ``dispatch_cpu_unquantized_gemm`` replaces ``layer.weight`` with an empty tensor), so such a
    tensor digests as zero bytes and the checksum cannot see it change."""
    ends = tuple(suffixes)

    def transform(name: str, tensor: Any) -> Any:
        return tensor.reshape(-1)[:0] if name.endswith(ends) else tensor

    return transform


def fingerprint(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    scheme: str,
    *,
    dtype: Any = None,
    rename: Callable[[str], str | None] | None = None,
    transform: Callable[[str, Any], Any] | None = None,
    prefix: str = "",
    digest: Callable[[Any], str] | None = None,
    casts: Iterable[Any] = (),
) -> Fingerprint:
    """The fingerprint an engine of ``scheme`` reports once it holds ``tensors``.

    Each ``(name, tensor)`` is renamed (``rename``; None leaves the tensor out: one the engine
    does not hold, or ties to another), reshaped (``transform(name, tensor)``, given the
    engine's name), cast to ``dtype`` (``tensor.to(dtype)`` / ``astype``) and digested (by
    ``digest(tensor)`` when given, else by ``scheme``'s digest); the engine's name is
    ``prefix`` + the new name (``VLLM_PREFIX`` for a single vLLM worker).

    The fingerprint records the dtype each tensor was digested in, and each floating-point
    tensor's digest once cast from the trainer's values to each other dtype of ``casts`` that
    its library has: what an engine serving that dtype would report, so that a verification
    can say an engine holds the trainer's tensors in another dtype. That is one more digest per
    tensor and dtype (``casts=SERVING_DTYPES`` triples the hashing of a push's verification),
    so none by default: then an engine whose every tensor differs is told only that a dtype
    may be why.
    """
    if isinstance(casts, str):
        raise InvalidArgument(f"casts must be a sequence of dtypes, got the string {casts!r}")
    digest_of = digest if digest is not None else scheme_digest(scheme)
    others = tuple(dict.fromkeys(dtype_name(d) for d in casts))
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    cast_digests: dict[str, dict[str, str]] = {}
    for name, tensor in items:
        held = rename(name) if rename is not None else name
        if held is None:
            continue
        source = transform(held, tensor) if transform is not None else tensor
        value = source
        if dtype is not None:
            value = value.to(dtype) if hasattr(value, "detach") else value.astype(dtype)
        key = prefix + held
        if key in out:
            raise InvalidArgument(f"two tensors are named {key!r} in the engine's layout")
        out[key] = digest_of(value)
        dtypes[key] = dtype_name(value.dtype)
        if not _is_float(source):
            continue
        for other in others:
            cast = _cast(source, other) if other != dtypes[key] else None
            if cast is not None:
                cast_digests.setdefault(other, {})[key] = digest_of(cast)
    return Fingerprint(scheme, out, dtypes, cast_digests)


def sglang_tensor_payload(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *, ranks: int = 1
) -> list[str]:
    """``tensors`` (torch, on the host) as ``FromTensor`` sends them to an SGLang server in another
    process on this host: one base64 string per tensor-parallel rank (each rank loads its shard
    of the whole tensors), the tensors' storage moved to shared memory and passed by name.

    It pickles as SGLang's ``MultiprocessingSerializer.serialize`` does (``ForkingPickler``), with
    torch's ``file_system`` sharing strategy for the call: with the default, ``file_descriptor``,
    the server cannot fetch the tensors and dies (see ``backends/tensor_payload.py``). Keep the
    tensors alive until the push returns: their shared memory goes with them.
    """
    check_int("ranks", ranks, minimum=1)
    sharing = importlib.import_module("torch.multiprocessing")
    pickler = importlib.import_module("multiprocessing.reduction").ForkingPickler
    named = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    previous = sharing.get_sharing_strategy()
    sharing.set_sharing_strategy("file_system")
    try:
        data = io.BytesIO()
        pickler(data).dump(named)
    finally:
        sharing.set_sharing_strategy(previous)
    return [base64.b64encode(data.getvalue()).decode("ascii")] * ranks


__all__ = [
    "GPT2_CONV1D_WEIGHTS",
    "SERVING_DTYPES",
    "SGLANG_SCHEME",
    "VLLM_PREFIX",
    "VLLM_SCHEME",
    "dtype_name",
    "emptying",
    "fingerprint",
    "scheme_digest",
    "sglang_tensor_payload",
    "tensor_bytes",
    "tensor_digest",
    "transposing",
]
