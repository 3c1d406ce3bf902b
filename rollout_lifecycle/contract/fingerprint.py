"""Weight fingerprints: what an engine holds, tensor by tensor, and how two compare.

An engine's checksum route answers one digest per tensor of the bytes the engine holds: SGLang's
``/weights_checker {"action": "checksum"}`` the first 8 bytes of a sha256 (16 hex digits) over
each parameter and persistent buffer, vLLM's ``/weight_checker {"action": "checksum"}`` a whole
sha256 over each parameter. A ``Fingerprint`` is such an answer together with its ``scheme``
(the kind of digest), since two engines that hash differently can hold the same weights and
still disagree. ``update_weights(verify=True)`` compares them (``core/verify``), and
``rollout_lifecycle.trainer`` computes them from the trainer's side. A fingerprint computed there
also says the dtype it digested each tensor in (``dtypes``) and each tensor's digest in the other
dtypes an engine may serve (``casts``), so that an engine holding the trainer's tensors in another
dtype is told from one holding other weights (``recast``); an engine's checksum says neither.

Fingerprints cross process boundaries as plain values (``to_wire`` / ``from_wire``).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rollout_lifecycle.contract.exceptions import InvalidArgument

#: SGLang 0.5.23: ``f"{int.from_bytes(sha256(bytes).digest()[:8], 'big'):016x}"`` per tensor.
# sglang: utils/weight_checker.py _hash_tensor (managers/mm_utils.py tensor_hash, CPU path)
SGLANG_SCHEME = "sglang-sha256-64"
#: vLLM 0.32: ``sha256(bytes).hexdigest()`` per parameter.
# vllm: model_executor/model_loader/weight_checksum.py compute_tensor_digests
VLLM_SCHEME = "sha256"
#: The simulated engine's digests (of what it records it holds; no bytes).
SIMULATED_SCHEME = "simulated"

#: Each byte scheme's digest of zero bytes: what an engine reports for a tensor it holds
#: empty where its checksum reads. No weight is empty, so such a tensor is one the checksum
#: cannot see: vLLM on a CPU empties each linear layer's ``weight`` once it has packed it for
#: its kernels (vllm: model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``), and
#: computes with the packed copy.
EMPTY_DIGESTS: Mapping[str, str] = MappingProxyType(
    {
        SGLANG_SCHEME: hashlib.sha256(b"").digest()[:8].hex(),
        VLLM_SCHEME: hashlib.sha256(b"").hexdigest(),
    }
)


@dataclass(frozen=True)
class Fingerprint:
    """The digest of every tensor an engine holds, by tensor name, in one ``scheme``.

    Two fingerprints are equal when their schemes and tensors are: ``dtypes`` and ``casts``
    (known on the trainer's side only) explain a difference and take no part in comparisons.
    """

    scheme: str
    tensors: Mapping[str, str] = field(default_factory=dict)
    #: The dtype each tensor was digested in (e.g. ``"float32"``), by name, where known.
    dtypes: Mapping[str, str] = field(default_factory=dict)
    #: Each tensor's digest once cast to another dtype, by dtype and then name: what an engine
    #: holding the same values in that dtype reports.
    casts: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, str) or not self.scheme:
            raise InvalidArgument(f"a fingerprint's scheme must be a string, got {self.scheme!r}")
        object.__setattr__(self, "tensors", _names_to_strings("tensors", "digests", self.tensors))
        dtypes = _names_to_strings("dtypes", "dtypes", self.dtypes, self.tensors)
        object.__setattr__(self, "dtypes", dtypes)
        if not isinstance(self.casts, Mapping) or not all(
            isinstance(k, str) and k for k in self.casts
        ):
            raise InvalidArgument(
                "a fingerprint's casts must map dtypes to digests by name, "
                f"got {_short(self.casts)}"
            )
        casts = {
            k: _names_to_strings(f"casts[{k!r}]", "digests", v, self.tensors)
            for k, v in self.casts.items()
        }
        object.__setattr__(self, "casts", MappingProxyType(casts))

    def __hash__(self) -> int:
        return hash((self.scheme, self.digest))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        return self.scheme == other.scheme and dict(self.tensors) == dict(other.tensors)

    @functools.cached_property
    def digest(self) -> str:
        """One sha256 over every (name, digest) pair, in name order: equal digests, equal
        fingerprints."""
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            h.update(f"{name}\0{self.tensors[name]}\n".encode())
        return h.hexdigest()

    def differing(self, other: Fingerprint) -> tuple[str, ...]:
        """The tensors, in name order, whose digests differ from ``other``'s or that only one
        of the two holds; every tensor when the schemes differ."""
        if other.scheme != self.scheme:
            return tuple(sorted(set(self.tensors) | set(other.tensors)))
        names = set(self.tensors) | set(other.tensors)
        return tuple(sorted(n for n in names if self.tensors.get(n) != other.tensors.get(n)))

    @functools.cached_property
    def blind(self) -> tuple[str, ...]:
        """The tensors, in name order, whose digest is the digest of zero bytes: ones the
        engine's checksum reads as empty, so it cannot show what they hold (``EMPTY_DIGESTS``)."""
        empty = EMPTY_DIGESTS.get(self.scheme)
        return tuple(sorted(n for n, d in self.tensors.items() if d == empty))

    def recast(self, held: Fingerprint) -> dict[str, tuple[str, str]]:
        """The tensors that ``held`` holds as this fingerprint's values cast to another dtype,
        by name, in name order: for each, the dtype ``held`` holds it in and the dtype this
        fingerprint digested it in (``casts``, ``dtypes``); none when the schemes differ."""
        if held.scheme != self.scheme:
            return {}
        out: dict[str, tuple[str, str]] = {}
        for name in self.differing(held):
            found, said = held.tensors.get(name), self.dtypes.get(name)
            if found is None or said is None:
                continue
            for dtype, digests in self.casts.items():
                if dtype != said and digests.get(name) == found:
                    out[name] = (dtype, said)
                    break
        return out

    def to_wire(self) -> dict[str, Any]:
        """As plain JSON values: ``{"scheme", "tensors"}``, with ``"dtypes"`` and ``"casts"``
        when it has them."""
        wire: dict[str, Any] = {"scheme": self.scheme, "tensors": dict(self.tensors)}
        if self.dtypes:
            wire["dtypes"] = dict(self.dtypes)
        if self.casts:
            wire["casts"] = {k: dict(v) for k, v in self.casts.items()}
        return wire

    @classmethod
    def from_wire(cls, data: object) -> Fingerprint:
        """The fingerprint ``to_wire`` gave ``data`` (a ``Fingerprint`` passes as it is);
        ``InvalidArgument`` naming what is wrong otherwise."""
        if isinstance(data, Fingerprint):
            return data
        if not isinstance(data, Mapping) or not (
            {"scheme", "tensors"} <= set(data) <= {"scheme", "tensors", "dtypes", "casts"}
        ):
            raise InvalidArgument(
                f"a fingerprint must be {{'scheme', 'tensors'}} (and optionally 'dtypes', "
                f"'casts'), got {_short(data)}"
            )
        return cls(data["scheme"], data["tensors"], data.get("dtypes", {}), data.get("casts", {}))

    def __repr__(self) -> str:
        return f"Fingerprint({self.scheme!r}, {len(self.tensors)} tensors, {self.digest[:12]})"


def _names_to_strings(
    what: str, values: str, found: object, names: Mapping[str, str] | None = None
) -> Mapping[str, str]:
    """``found`` frozen, once checked to map names (of ``names``, when given) to strings."""
    if not isinstance(found, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in found.items()
    ):
        raise InvalidArgument(f"a fingerprint's {what} must map names to {values}, got {found!r}")
    unknown = sorted(set(found) - set(names)) if names is not None else []
    if unknown:
        raise InvalidArgument(f"a fingerprint's {what} name tensors it does not hold: {unknown}")
    return MappingProxyType(dict(found))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = ["EMPTY_DIGESTS", "SGLANG_SCHEME", "SIMULATED_SCHEME", "VLLM_SCHEME", "Fingerprint"]
