"""One owner per fleet across the nodes of a Ray cluster: claims and a journal held in the cluster.

On one host a claim is the kernel's (``core/claims.HostClaims``: a lock that dies with its
holder). Controllers on two nodes see none of each other's locks, so on a cluster the claims
are kept by one detached named actor, the *lease registry* (``LeaseRegistry``), which any driver
of the namespace finds with ``ray.get_actor`` and which outlives the driver that started it. It
runs on the head node (where the cluster's own control store is: the registry is lost only with
the cluster).

- A **lease** holds the keys of a call's engines (what names each engine: ``core/claims``), all
  or none. A key another live lease holds is refused at once with ``EngineClaimed`` naming the
  holder, before anything is sent.
- Every lease takes the registry's next **epoch** (one counter, so epochs are totally
  ordered). Every command of the call carries it to the engine host (``EngineHost.fenced``),
  and an engine refuses a command whose epoch is older than one it has carried out
  (``EngineFenced``). So a controller that lost its lease cannot act on an engine again once
  the new holder has, however late its commands arrive.
- A lease lives ``ttl`` seconds past its last renewal. The store renews its leases from a
  thread every ``ttl / 3``, so a lease does not depend on the driver's event loop (a hook that
  blocks it keeps the lease), and it ends within ``ttl`` once the driver's process stops: the
  process killed, its node lost, or the process frozen (SIGSTOP, a paused VM). A frozen driver
  that wakes finds its lease gone, and its commands fenced.
- The **journal** (``ClusterJournal``) is kept by the registry too. Each entry is written under
  the writer's live lease; a write under a lease that has ended is refused (``LeaseLost``), and
  the journal's write comes before any command is sent. So a controller that lost the fleet
  cannot make the journal lie, and a driver started on any node adopts the fleet's true state
  from it (``RolloutServer.adopt(journal.last())``).

**The time to live** (``DEFAULT_TTL``, 15 s) is what a new driver waits to take over a fleet
whose driver died. It is set to Ray's own time to declare a node dead: the cluster's control
store checks each node every 3 s and names it dead after 5 failed checks
(``health_check_period_ms`` and ``health_check_failure_threshold`` in Ray's ``ray_config_def.h``).
So a driver lost with its node loses its lease about when Ray names the node dead, and a new
driver is held up no longer than the cluster itself holds replacements. Renewals every 5 s keep
a lease through two lost renewals (each is one actor call bounded by ``ttl / 3``). A shorter TTL
is safe (fencing holds whatever it is) but takes leases from drivers that are only slow.

Without Ray, the host's claims stay (``HostClaims``): both stores are the same small interface
(``core/claims.ClaimStore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from rollout_lifecycle.contract.exceptions import EngineClaimed, InvalidArgument, LeaseLost
from rollout_lifecycle.contract.values import check_seconds
from rollout_lifecycle.core.claims import describe
from rollout_lifecycle.core.snapshots import ServerSnapshot

#: The registry's actor name and namespace, unless a store names others.
REGISTRY_NAME = "rollout-lifecycle-leases"
NAMESPACE = "rollout_lifecycle"
#: How long a lease lives past its last renewal (see the module docstring).
DEFAULT_TTL = 15.0
#: The bound of each call to the registry.
DEFAULT_TIMEOUT = 10.0
#: The bound of a store's first call, which may start the registry's actor.
DEFAULT_STARTUP = 120.0

_log = logging.getLogger(__name__)


@dataclass
class _Key:
    """What the registry knows of one key."""

    #: The epoch of the live lease holding it (None: free).
    lease: int | None = None
    #: The store whose lease held it last, and whether that lease let it go itself (an expired
    #: or taken-over lease did not: its holder may have lost sight of the engine).
    store: str | None = None
    clean: bool = False


@dataclass
class _Row:
    """One live lease."""

    store: str
    holder: dict[str, Any]
    ttl: float
    expires: float
    keys: set[str] = field(default_factory=set)


class LeaseRegistry:
    """The lease registry's state and rules: the body of the detached actor (``registry``).
    Plain values in and out; ``clock`` is the registry's own (one process, one clock: expiry
    never compares two machines' clocks)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._epoch = 0
        self._keys: dict[str, _Key] = {}
        self._leases: dict[int, _Row] = {}
        #: Each journal's last entry and the epoch it was written under.
        self._journals: dict[str, tuple[int, dict[str, Any]]] = {}

    def _expire(self) -> None:
        now = self._clock()
        for epoch in [e for e, row in self._leases.items() if row.expires <= now]:
            self._drop(epoch, clean=False)

    def _drop(self, epoch: int, *, clean: bool) -> None:
        row = self._leases.pop(epoch, None)
        if row is None:
            return
        for key in row.keys:
            held = self._keys[key]
            if held.lease == epoch:
                held.lease, held.clean = None, clean

    def _conflict(self, keys: Sequence[str]) -> dict[str, Any] | None:
        for key in sorted(keys):
            held = self._keys.get(key)
            if held is not None and held.lease is not None:
                row = self._leases[held.lease]
                return {"claimed": key, "holder": dict(row.holder, epoch=held.lease)}
        return None

    def _hold(self, epoch: int, keys: Sequence[str]) -> dict[str, bool]:
        row, same = self._leases[epoch], {}
        for key in keys:
            held = self._keys.setdefault(key, _Key())
            same[key] = held.store == row.store and held.clean
            held.lease, held.store, held.clean = epoch, row.store, False
            row.keys.add(key)
        return same

    def acquire(
        self, keys: list[str], holder: dict[str, Any], store: str, ttl: float
    ) -> dict[str, Any]:
        """Hold every key of ``keys`` under a new lease of ``store``, or none: ``{"epoch": int,
        "same": {key: bool}}`` (``same``: no other store held the key since this store's last
        lease let it go), or ``{"claimed": key, "holder": {...}}``."""
        self._expire()
        found = self._conflict(keys)
        if found is not None:
            return found
        self._epoch += 1
        epoch = self._epoch
        self._leases[epoch] = _Row(store, dict(holder), ttl, self._clock() + ttl)
        return {"epoch": epoch, "same": self._hold(epoch, keys)}

    def extend(self, epoch: int, keys: list[str]) -> dict[str, Any]:
        """Hold ``keys`` under the live lease ``epoch`` too, or none (as ``acquire``);
        ``{"lost": epoch}`` when the lease has ended."""
        self._expire()
        if epoch not in self._leases:
            return {"lost": epoch}
        fresh = [k for k in keys if k not in self._leases[epoch].keys]
        found = self._conflict(fresh)
        if found is not None:
            return found
        return {"epoch": epoch, "same": self._hold(epoch, fresh)}

    def renew(self, epochs: list[int]) -> list[int]:
        """Give each live lease of ``epochs`` its time to live again; the ones that had ended."""
        self._expire()
        now, lost = self._clock(), []
        for epoch in epochs:
            row = self._leases.get(epoch)
            if row is None:
                lost.append(epoch)
            else:
                row.expires = now + row.ttl
        return lost

    def release(self, epoch: int) -> None:
        """Let lease ``epoch`` go (its keys are free; nothing if it had ended)."""
        self._drop(epoch, clean=True)

    def leases(self) -> dict[int, dict[str, Any]]:
        """The live leases: epoch, holder, keys and seconds left."""
        self._expire()
        now = self._clock()
        return {
            e: {"holder": r.holder, "keys": sorted(r.keys), "left_s": r.expires - now}
            for e, r in self._leases.items()
        }

    def write(self, journal: str, entry: dict[str, Any], epoch: int) -> str | None:
        """Keep ``entry`` as ``journal``'s last, written under lease ``epoch``; why not (the
        lease has ended, or a newer lease wrote the journal) or None."""
        self._expire()
        if epoch not in self._leases:
            return "has ended (it was not renewed within its time to live)"
        last = self._journals.get(journal)
        if last is not None and last[0] > epoch:
            return f"is older than the journal's last writer (epoch {last[0]})"
        self._journals[journal] = (epoch, entry)
        return None

    def read(self, journal: str) -> dict[str, Any] | None:
        """``journal``'s last entry (None: never written)."""
        last = self._journals.get(journal)
        return None if last is None else last[1]


#: The Ray actor class of the registry.
LeaseRegistryActor: Any = ray.remote(LeaseRegistry)


def registry(name: str = REGISTRY_NAME, namespace: str = NAMESPACE) -> Any:
    """The cluster's lease registry: found by name, or started (detached, on the head node,
    no CPU reserved) if no driver has started it yet."""
    return LeaseRegistryActor.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
    ).remote()


class ClusterClaims:
    """Claims held in the cluster's lease registry (see the module docstring); pass it to
    ``RolloutServer(claims=...)``, one store per server. ``ttl`` is a lease's time to live
    (``DEFAULT_TTL``), ``timeout`` the bound of each registry call."""

    cluster_wide = True

    def __init__(
        self,
        ttl: float = DEFAULT_TTL,
        *,
        name: str = REGISTRY_NAME,
        namespace: str = NAMESPACE,
        timeout: float = DEFAULT_TIMEOUT,
        startup: float = DEFAULT_STARTUP,
    ) -> None:
        self.ttl = check_seconds("ttl", ttl)
        self.timeout = check_seconds("timeout", timeout)
        #: The bound of the first call, which may start the registry's actor (a worker process
        #: to start: seconds on a loaded machine).
        self.startup = check_seconds("startup", startup)
        self._reached = False
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"name must be a non-empty string, got {name!r}")
        self.scope = f"{namespace}/{name}"
        self._name, self._namespace = name, namespace
        self._actor: Any = None
        self._token = f"{id(self):x}-{time.time_ns():x}"
        #: The live leases this store renews, by epoch.
        self._live: dict[int, ClusterLease] = {}
        self._lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def actor(self) -> Any:
        """The registry's actor handle."""
        if self._actor is None:
            self._actor = registry(self._name, self._namespace)
        return self._actor

    def _bound(self) -> float:
        return self.timeout if self._reached else max(self.timeout, self.startup)

    def _unanswered(self, method: str, bound: float) -> LeaseLost:
        return LeaseLost(
            f"{method} at the cluster's lease registry {self.scope}",
            None,
            f"could not be had: the registry did not answer within {bound:g} s",
        )

    def call(self, method: str, *args: Any) -> Any:
        """One registry call, waited for (``ray.get``, bounded: ``timeout``, or ``startup`` for
        the first); ``LeaseLost`` when it does not answer in time."""
        bound = self._bound()
        try:
            found = ray.get(getattr(self.actor, method).remote(*args), timeout=bound)
        except ray.exceptions.GetTimeoutError:  # (``ray.get``'s timeout: its docstring)
            raise self._unanswered(method, bound) from None
        self._reached = True
        return found

    async def reach(self, method: str, *args: Any) -> Any:
        """``call`` without blocking the event loop (an object ref is awaitable)."""
        bound = self._bound()
        try:
            found = await asyncio.wait_for(
                asyncio.wrap_future(getattr(self.actor, method).remote(*args).future()), bound
            )
        except asyncio.TimeoutError:
            raise self._unanswered(method, bound) from None
        self._reached = True
        return found

    async def acquire(self, keys: Sequence[str], holder: Mapping[str, Any]) -> ClusterLease:
        answer = await self.reach("acquire", list(keys), dict(holder), self._token, self.ttl)
        _refuse(answer)
        lease = ClusterLease(self, answer["epoch"], answer["same"])
        with self._lock:
            self._live[lease.epoch] = lease
        self._start_renewing()
        return lease

    @property
    def epoch(self) -> int | None:
        """The epoch of the newest live lease this store holds (None: none)."""
        with self._lock:
            return max(self._live, default=None)

    def forget(self, lease: ClusterLease) -> None:
        with self._lock:
            self._live.pop(lease.epoch, None)

    def _start_renewing(self) -> None:
        if self._renewer is None or not self._renewer.is_alive():
            self._renewer = threading.Thread(
                target=self._renew_loop, name="rollout-lifecycle-lease", daemon=True
            )
            self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                epochs = list(self._live)
            if not epochs:
                continue
            try:
                lost = ray.get(self.actor.renew.remote(epochs), timeout=self.ttl / 3)
            except Exception as exc:  # the next renewal tries again; the TTL decides
                _log.warning("lease renewal failed: %s", exc)
                continue
            for epoch in lost:
                with self._lock:
                    lease = self._live.pop(epoch, None)
                if lease is not None:
                    lease.lost = True
                    _log.warning("lease %s ended before it was let go", epoch)

    def close(self) -> None:
        """Stop renewing (the live leases end within ``ttl``)."""
        self._stop.set()


class ClusterLease:
    """The keys ``ClusterClaims`` holds for one call, under one epoch."""

    def __init__(self, store: ClusterClaims, epoch: int, same: Mapping[str, bool]) -> None:
        self._store, self.epoch = store, epoch
        self._same = dict(same)
        #: Whether the registry said the lease had ended before it was let go.
        self.lost = False
        self.fence: list[Any] | None = [store.scope, epoch]

    def continuous(self, key: str) -> bool:
        return self._same.get(key, False)

    async def extend(self, keys: Sequence[str]) -> None:
        fresh = [k for k in keys if k not in self._same]
        if not fresh:
            return
        answer = await self._store.reach("extend", self.epoch, fresh)
        if "lost" in answer:
            raise LeaseLost("claiming more engines", self.epoch, "has ended")
        _refuse(answer)
        self._same.update(answer["same"])

    def release(self) -> None:
        if self.fence is None:
            return
        self.fence = None
        self._store.forget(self)
        # Not waited for: a synchronous actor runs one submitter's calls in the order they were
        # submitted (Ray's "Actor Task Execution Order"; the registry has no task retries), so
        # this store's next acquire finds the keys free; a release that never lands (the
        # registry unreachable) ends with the lease's TTL.
        with contextlib.suppress(Exception):
            self._store.actor.release.remote(self.epoch)


def _refuse(answer: Mapping[str, Any]) -> None:
    """``EngineClaimed`` for a registry's answer that names a key another lease holds."""
    if "claimed" in answer:
        holder = answer["holder"]
        who = f"{describe(holder)}, lease epoch {holder.get('epoch')}"
        raise EngineClaimed(str(answer["claimed"]), who, holder)


class ClusterJournal:
    """A server's journal kept in the cluster's lease registry (``RolloutServer(journal=...)``),
    each entry written under the lease of ``claims``: a controller whose lease ended cannot
    write it (``LeaseLost``, before anything is sent). ``last()`` is what a new server adopts."""

    def __init__(self, name: str, claims: ClusterClaims) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"a journal's name must be a non-empty string, got {name!r}")
        if not isinstance(claims, ClusterClaims):
            raise InvalidArgument(f"claims must be a ClusterClaims, got {claims!r}")
        self.name, self._claims = name, claims

    def __call__(self, snapshot: ServerSnapshot) -> None:
        epoch = self._claims.epoch
        if epoch is None:
            raise LeaseLost(f"writing journal {self.name!r}", None, "is not held")
        why = self._claims.call("write", self.name, snapshot.to_dict(), epoch)
        if why is not None:
            raise LeaseLost(f"writing journal {self.name!r}", epoch, why)

    def last(self) -> ServerSnapshot | None:
        """The journal's last entry (None: never written)."""
        found = self._claims.call("read", self.name)
        return None if found is None else ServerSnapshot.from_dict(found)


__all__ = [
    "DEFAULT_TTL",
    "NAMESPACE",
    "REGISTRY_NAME",
    "ClusterClaims",
    "ClusterJournal",
    "ClusterLease",
    "LeaseRegistry",
    "registry",
]
