"""What an engine family can do, as its driver declares it: the facts the lifecycle plans with
instead of finding them out by refusal.

A backend declares ``capabilities`` (a class attribute, or a property when they depend on how
the client was configured); the engine host sends them with every answer that names the
engine's incarnation (``EngineHost.observe`` with ``identify``), so the lifecycle reads them once
per process, at first contact, and keeps them on the engine's record (``EngineRecord``), in its
snapshot and in the journal. A backend that declares none is taken to do what SGLang does
(``DEFAULT``): the lifecycle's vocabulary is SGLang's.

Adding a capability is a field here, its value in the drivers that differ from the default,
and the one place that plans with it.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.fingerprint import SGLANG_SCHEME
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.values import Tag, check_int, parse_tags


@dataclass(frozen=True)
class Capabilities:
    """One engine family's declared abilities."""

    #: The engine family's name, for errors and ``ctl status`` (``sglang``, ``vllm``, ...).
    family: str = "sglang"
    #: Pairs ``(tag, needed)``: a release of ``tag`` must release ``needed`` with it (vLLM puts
    #: the weights to sleep only with the KV cache: ``/sleep``). Empty for SGLang, whose tags
    #: are released one by one.
    release_requires: tuple[tuple[Tag, Tag], ...] = ()
    #: The KV cache's resume is not sent at once: the continue wakes it (vLLM resumes generation
    #: as soon as every allocation is resident, so its last wake is the continue). Between its
    #: resume and the continue the engine's record says so (``EngineState.KV_ASLEEP``).
    kv_wakes_at_continue: bool = False
    #: How the engine digests the tensors it holds: the ``scheme`` of every fingerprint it
    #: reads (``contract/fingerprint``). A weight write verified against an ``expected``
    #: fingerprint is checked before it starts for one the engines can be compared with.
    fingerprint_scheme: str = SGLANG_SCHEME
    #: The weight-write operations the driver carries (SGLang's: from disk, from tensors, over a
    #: collective group, which it joins and leaves). A write whose push says it sends one the
    #: driver does not carry (``WeightPush.sends``) is refused before anything is sent.
    weight_writes: frozenset[Op] = frozenset(
        {
            Op.UPDATE_FROM_DISK,
            Op.UPDATE_FROM_TENSOR,
            Op.UPDATE_FROM_DISTRIBUTED,
            Op.INIT_UPDATE_GROUP,
            Op.DESTROY_UPDATE_GROUP,
        }
    )
    #: The data-parallel ranks behind the engine's one URL, each a scheduler process holding
    #: the whole model (SGLang's ``dp_size``), as the process reports it; 1 for one scheduler.
    ranks: int = 1
    #: Why ``weight_writes`` is narrower than the family's, when it is (a data-parallel SGLang
    #: server's refusals); the refusal of a write it does not carry says it.
    writes_limited_by: str = ""
    #: What a router registers the server as (``WORKER_TYPES``): ``regular``, or one half of a
    #: prefill/decode pair, as the process reports it (SGLang's ``--disaggregation-mode``).
    #: A half serves only through a router in prefill/decode mode, which sends each request
    #: to a prefill and a decode server together: the generation client never picks one.
    worker_type: str = "regular"
    #: A prefill server's bootstrap port (SGLang's ``--disaggregation-bootstrap-port``), which
    #: the router hands to the decode half of each request; None for the other types.
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        if self.worker_type not in WORKER_TYPES:
            raise InvalidArgument(
                f"capabilities: worker_type must be one of {', '.join(WORKER_TYPES)}, "
                f"got {self.worker_type!r}"
            )

    @property
    def half(self) -> bool:
        """Whether the server is one half of a prefill/decode pair (``worker_type``)."""
        return self.worker_type != "regular"

    def release_refusal(self, tags: Collection[Tag]) -> str | None:
        """Why a release of ``tags`` cannot be carried out by this family; None when it can."""
        if not self.release_requires:
            return None  # (each tag on its own: the guard of every release reads this)
        names = set(tags)
        needed = {need for tag, need in self.release_requires if tag in names}
        missing = sorted(t.value for t in needed - names)
        if not missing:
            return None
        asked = sorted(t.value for t in names)
        return (
            f"{self.family} cannot release tags {asked} without {missing} (it releases them "
            f"together); release {missing} with them, or none of them"
        )

    def to_wire(self) -> dict[str, Any]:
        """As plain values (a Ray call's answer, a snapshot, the journal): a new mapping of
        values built once per declaration (a snapshot holds one for each engine)."""
        return dict(self.wire)

    @functools.cached_property
    def wire(self) -> dict[str, Any]:
        """``to_wire``'s values in the declaration's one mapping, for a reader that keeps
        nothing of it and changes nothing (the checks' answers: one per engine per read
        otherwise)."""
        return {
            "family": self.family,
            "release_requires": [[tag.value, need.value] for tag, need in self.release_requires],
            "kv_wakes_at_continue": self.kv_wakes_at_continue,
            "fingerprint_scheme": self.fingerprint_scheme,
            "weight_writes": sorted(op.value for op in self.weight_writes),
            "ranks": self.ranks,
            "writes_limited_by": self.writes_limited_by,
            "worker_type": self.worker_type,
            "bootstrap_port": self.bootstrap_port,
        }

    @classmethod
    def from_wire(cls, data: object) -> Capabilities:
        """The capabilities ``to_wire`` gave as ``data``; keys it does not know are ignored (a
        newer driver's), a mistyped value raises ``InvalidArgument`` naming it."""
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"capabilities must be a mapping, got {data!r}")
        family = data.get("family", cls.family)
        if not isinstance(family, str) or not family:
            raise InvalidArgument(f"capabilities: family must be a name, got {family!r}")
        pairs = data.get("release_requires", [])
        if not isinstance(pairs, list | tuple) or not all(
            isinstance(p, list | tuple) and len(p) == 2 for p in pairs
        ):
            raise InvalidArgument(
                f"capabilities: release_requires must be [tag, needed] pairs, got {pairs!r}"
            )
        requires: list[tuple[Tag, Tag]] = []
        for pair in pairs:
            tag, need = parse_tags(pair, what="capabilities: release_requires")
            requires.append((tag, need))
        wakes = data.get("kv_wakes_at_continue", False)
        if not isinstance(wakes, bool):
            raise InvalidArgument(
                f"capabilities: kv_wakes_at_continue must be a bool, got {wakes!r}"
            )
        scheme = data.get("fingerprint_scheme", cls.fingerprint_scheme)
        if not isinstance(scheme, str) or not scheme:
            raise InvalidArgument(
                f"capabilities: fingerprint_scheme must be a name, got {scheme!r}"
            )
        writes = data.get("weight_writes")
        if writes is None:
            carried = cls.weight_writes
        elif isinstance(writes, list | tuple) and all(isinstance(w, str) for w in writes):
            # an operation this library does not know (a newer driver's) is left out
            carried = frozenset(Op(w) for w in writes if w in _OP_NAMES)
        else:
            raise InvalidArgument(
                f"capabilities: weight_writes must be operation names, got {writes!r}"
            )
        ranks = check_int("capabilities: ranks", data.get("ranks", cls.ranks), minimum=1)
        limited_by = data.get("writes_limited_by", cls.writes_limited_by)
        if not isinstance(limited_by, str):
            raise InvalidArgument(
                f"capabilities: writes_limited_by must be a string, got {limited_by!r}"
            )
        worker_type = data.get("worker_type", cls.worker_type)
        if not isinstance(worker_type, str):
            raise InvalidArgument(
                f"capabilities: worker_type must be a string, got {worker_type!r}"
            )
        port = data.get("bootstrap_port")
        if port is not None:
            port = check_int("capabilities: bootstrap_port", port, minimum=1, maximum=65535)
        found = cls(
            family, tuple(requires), wakes, scheme, carried, ranks, limited_by, worker_type, port
        )
        # One object per distinct declaration: a fleet's records share their family's.
        return _INTERNED.setdefault(found, found)


#: The ``worker_type`` values, in sglang-router 0.3.2's words (its worker API's
#: ``worker_type``; SGLang's ``--disaggregation-mode`` says ``null`` for ``regular``).
WORKER_TYPES = ("regular", "prefill", "decode")
#: Every operation's wire name.
_OP_NAMES = frozenset(op.value for op in Op)
#: What a backend that declares nothing can do: what SGLang does.
DEFAULT = Capabilities()
#: Every declaration read so far, by its value (a handful: one per engine family).
_INTERNED: dict[Capabilities, Capabilities] = {DEFAULT: DEFAULT}


def capabilities_of(backend: object) -> Capabilities:
    """What ``backend`` declares (its ``capabilities``), else ``DEFAULT``."""
    found = getattr(backend, "capabilities", None)
    return found if isinstance(found, Capabilities) else DEFAULT


__all__ = ["DEFAULT", "WORKER_TYPES", "Capabilities", "capabilities_of"]
