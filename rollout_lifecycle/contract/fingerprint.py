"""Weight fingerprints: what an engine holds, tensor by tensor, and how two compare.

An engine's checksum route answers one digest per tensor of the bytes the engine holds: SGLang's
``/weights_checker {"action": "checksum"}`` the first 8 bytes of a sha256 (16 hex digits) over
each parameter and persistent buffer, vLLM's ``/weight_checker {"action": "checksum"}`` a whole
sha256 over each parameter. A ``Fingerprint`` is such an answer together with its ``scheme``
(the kind of digest), since two engines that hash differently can hold the same weights and
still disagree. ``update_weights(verify=True)`` compares them (``core/verify``), and
``rollout_lifecycle.trainer`` computes them from the trainer's side.

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
    """The digest of every tensor an engine holds, by tensor name, in one ``scheme``."""

    scheme: str
    tensors: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, str) or not self.scheme:
            raise InvalidArgument(f"a fingerprint's scheme must be a string, got {self.scheme!r}")
        if not isinstance(self.tensors, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.tensors.items()
        ):
            raise InvalidArgument(
                f"a fingerprint's tensors must map names to digests, got {self.tensors!r}"
            )
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))

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

    def to_wire(self) -> dict[str, Any]:
        """As plain JSON values: ``{"scheme", "tensors"}``."""
        return {"scheme": self.scheme, "tensors": dict(self.tensors)}

    @classmethod
    def from_wire(cls, data: object) -> Fingerprint:
        """The fingerprint ``to_wire`` gave ``data`` (a ``Fingerprint`` passes as it is);
        ``InvalidArgument`` naming what is wrong otherwise."""
        if isinstance(data, Fingerprint):
            return data
        if not isinstance(data, Mapping) or set(data) != {"scheme", "tensors"}:
            raise InvalidArgument(
                f"a fingerprint must be {{'scheme', 'tensors'}}, got {_short(data)}"
            )
        return cls(data["scheme"], data["tensors"])

    def __repr__(self) -> str:
        return f"Fingerprint({self.scheme!r}, {len(self.tensors)} tensors, {self.digest[:12]})"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = ["EMPTY_DIGESTS", "SGLANG_SCHEME", "SIMULATED_SCHEME", "VLLM_SCHEME", "Fingerprint"]
