"""Where engine actors run on a Ray cluster: one placement-group bundle per engine.

An ``EnginePlacement`` holds a placement group and what each engine actor asks of its bundle.
``reserve`` makes a group of its own (one bundle per engine, the user's bundle and strategy);
``colocated`` borrows the trainer's group, so that engine ``i`` runs in the trainer's bundle
``i``, on its node, sharing its GPUs (the colocated RL loop: each bundle hosts a trainer worker
and a rollout engine). ``start(i, factory)`` starts the engine actor of bundle ``i`` and checks
that it runs on the node Ray reserved that bundle on, refusing it (killed, ``PlacementFailed``)
elsewhere; ``check`` does the same for a handle made another way.

A node lost takes the bundles it held and the engine actors in them (Ray names them dead:
``ActorDiedError``, ``Outcome.DEAD``). Ray reschedules the lost bundles of a group, by the
group's own strategy, onto the nodes that have room: ``replacer`` is the ``recover()`` factory
that starts each replacement in the bundle of the engine it replaces once Ray has placed that
bundle again (within ``timeout``), so replacements follow the same rules as the engines they
replace.

Ray facts relied on (ray 2.60): ``ray.util.placement_group.placement_group_table(pg)`` gives
``bundles_to_node_id`` (bundle index to the node's hex id) and ``state`` (``CREATED``, or
``RESCHEDULING`` while a lost bundle waits for room); a bundle needs a resource it asks more than
zero of; an actor's ``ray.get_runtime_context().get_node_id()`` is the same hex id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.backends.engine import EngineBackend
from rollout_lifecycle.contract.exceptions import InvalidArgument, LifecycleError
from rollout_lifecycle.contract.values import check_int, check_seconds

#: Ray's placement strategies.
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: How often a wait for a rescheduled bundle looks again, in seconds.
_LOOK_EVERY = 0.1

EngineFactory = Callable[[], EngineBackend]


class PlacementFailed(LifecycleError):
    """Engines could not be placed as asked: a group Ray could not reserve in time, or an engine
    actor found on another node than its bundle's."""


def _resources(what: str, value: object) -> dict[str, float]:
    if not isinstance(value, Mapping) or not value:
        raise InvalidArgument(f"{what} must be a non-empty dict of resource amounts, got {value!r}")
    out: dict[str, float] = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"{what}: a resource name must be a non-empty string: {key!r}")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
            raise InvalidArgument(f"{what}[{key!r}] must be a number >= 0, got {amount!r}")
        out[key] = float(amount)
    if not any(out.values()):
        raise InvalidArgument(f"{what} asks nothing ({out}): Ray needs one resource above 0")
    return out


class EnginePlacement:
    """A placement group and what each engine actor asks of its bundle (module docstring).

    Make one with ``await EnginePlacement.reserve(...)`` or ``EnginePlacement.colocated(...)``.
    """

    def __init__(
        self,
        group: PlacementGroup,
        resources: Mapping[str, float],
        *,
        owned: bool,
        timeout: float = 60.0,
    ) -> None:
        self.group = group
        #: What each engine actor asks of its bundle (on top of ``num_cpus=0``).
        self.resources = dict(resources)
        #: Whether ``remove()`` gives the group back (it was reserved here).
        self._owned = owned
        self.timeout = check_seconds("timeout", timeout)

    def __repr__(self) -> str:
        return (
            f"EnginePlacement({self.group.bundle_count} bundles, resources={self.resources}, "
            f"{'reserved' if self._owned else 'borrowed'})"
        )

    @classmethod
    async def reserve(
        cls,
        count: int,
        bundle: Mapping[str, float],
        *,
        strategy: str = "PACK",
        resources: Mapping[str, float] | None = None,
        timeout: float = 60.0,
        name: str = "",
    ) -> EnginePlacement:
        """A placement group of ``count`` bundles of ``bundle``, placed by ``strategy`` (Ray's:
        ``PACK`` by default, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``); each engine actor
        asks ``resources`` of its bundle (the whole bundle by default). ``PlacementFailed``,
        the group given back, when Ray cannot place it within ``timeout`` seconds."""
        check_int("count", count, minimum=1)
        shape = _resources("bundle", bundle)
        if strategy not in STRATEGIES:
            raise InvalidArgument(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        asks = shape if resources is None else _resources("resources", resources)
        beyond = {k: v for k, v in asks.items() if v > shape.get(k, 0.0)}
        if beyond:
            raise InvalidArgument(
                f"each engine asks {beyond} of a bundle of {shape}: ask at most what a bundle holds"
            )
        seconds = check_seconds("timeout", timeout)
        group = placement_group([dict(shape) for _ in range(count)], strategy=strategy, name=name)
        try:
            await asyncio.wait_for(group.ready(), seconds)
        except BaseException as exc:
            remove_placement_group(group)  # (a group left pending would take room later)
            if not isinstance(exc, TimeoutError):
                raise
            raise PlacementFailed(
                f"Ray could not place {count} bundle(s) of {shape} ({strategy}) within "
                f"{seconds:g} s; the cluster has {_free()} free of {_total()}: add nodes, or "
                "ask for less"
            ) from None
        return cls(group, asks, owned=True, timeout=seconds)

    @classmethod
    def colocated(
        cls, trainer: PlacementGroup, resources: Mapping[str, float], *, timeout: float = 60.0
    ) -> EnginePlacement:
        """Engine ``i`` in the trainer's bundle ``i`` (its node, a share of its GPUs): each
        engine actor asks ``resources`` of that bundle. The group stays the trainer's."""
        if not isinstance(trainer, PlacementGroup):
            raise InvalidArgument(f"trainer must be a Ray PlacementGroup, got {trainer!r}")
        return cls(trainer, _resources("resources", resources), owned=False, timeout=timeout)

    # -- where bundles are ----------------------------------------------------------------------

    def nodes(self) -> dict[int, str | None]:
        """Each bundle's node (hex id), None for a bundle waiting for room (its node lost);
        ``PlacementFailed`` once the group is removed. (A read of the cluster's control store:
        blocking, so the coroutines below make it in a thread.)"""
        table = placement_group_table(self.group)
        if table.get("state") == "REMOVED":
            raise PlacementFailed(f"the placement group of {self!r} was removed")
        placed = table.get("bundles_to_node_id") or {}
        return {i: placed.get(i) or None for i in range(self.group.bundle_count)}

    async def node_of_bundle(self, index: int) -> str:
        """The live node bundle ``index`` is on, once Ray has placed it (``PlacementFailed``
        after ``timeout`` seconds without room for it)."""
        self._index(index)
        deadline = time.monotonic() + self.timeout
        while True:
            node = await asyncio.to_thread(self._live_node, index)
            if node is not None:
                return node
            if time.monotonic() >= deadline:
                raise PlacementFailed(
                    f"bundle {index} of {self!r} has no live node after {self.timeout:g} s (its "
                    f"node was lost and no node has room for it: {_free()} "
                    "free); add a node"
                )
            await asyncio.sleep(_LOOK_EVERY)

    # -- engine actors --------------------------------------------------------------------------

    async def start(self, index: int, factory: EngineFactory, **options: Any) -> Any:
        """Start the engine actor of bundle ``index`` from ``factory`` (``start_engine_actor``,
        ``options`` passed on) and check where it runs (``check``): each of the waits (the
        bundle placed, the actor's answer) within ``timeout``. (Ray holds an actor asked of a
        bundle not placed yet until it is: ``check`` waits for both.)"""
        self._index(index)
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        handle = start_engine_actor(
            factory, **actor_resources(self.resources), scheduling_strategy=strategy, **options
        )
        try:
            await self.check(index, handle)
        except BaseException:
            ray.kill(handle, no_restart=True)
            raise
        return handle

    async def start_all(self, factories: Sequence[EngineFactory]) -> list[Any]:
        """One engine actor per bundle, in bundle order (as many factories as bundles)."""
        if len(factories) != self.group.bundle_count:
            raise InvalidArgument(
                f"{len(factories)} factories for {self.group.bundle_count} bundles: "
                "give one factory per bundle"
            )
        started = await asyncio.gather(
            *(self.start(i, f) for i, f in enumerate(factories)), return_exceptions=True
        )
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for handle in started:  # all or none: the engines that did start are let go
                if not isinstance(handle, BaseException):
                    ray.kill(handle, no_restart=True)
            raise failed[0]
        return list(started)

    async def check(self, index: int, handle: Any) -> str:
        """The node ``handle``'s engine actor runs on, which must be bundle ``index``'s:
        ``PlacementFailed`` naming both nodes otherwise (a colocated engine off its trainer's
        node shares no GPU with it)."""
        bundle_node = await self.node_of_bundle(index)
        ref: Awaitable[str] = handle.node_id.remote()
        try:
            node = await asyncio.wait_for(ref, self.timeout)
        except TimeoutError:
            raise PlacementFailed(
                f"the engine actor for bundle {index} did not start within {self.timeout:g} s"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise PlacementFailed(
                f"the engine actor for bundle {index} died before it said where it runs: {exc}"
            ) from None
        if node != bundle_node:
            raise PlacementFailed(
                f"the engine actor for bundle {index} runs on node {node}, not on its bundle's "
                f"node {bundle_node}: start it in the bundle (EnginePlacement.start)"
            )
        return node

    def replacer(
        self, group: str, factory_for: Callable[[int], EngineFactory], **options: Any
    ) -> Callable[[str], Awaitable[Any]]:
        """A ``recover()`` factory for the engines of group ``group`` (engine ``group/i`` in
        bundle ``i``): the replacement of ``group/i`` is ``factory_for(i)``'s engine, started in
        bundle ``i`` once Ray has placed it (on a live node, by the group's strategy)."""

        async def replace(engine_id: str) -> Any:
            prefix, _, position = engine_id.rpartition("/")
            if prefix != group or not position.isdigit():
                raise InvalidArgument(
                    f"engine {engine_id!r} is not one of group {group!r}'s ({group}/<index>)"
                )
            index = int(position)
            return await self.start(index, factory_for(index), **options)

        return replace

    def remove(self) -> None:
        """Give the placement group back, if it was reserved here (a borrowed one stays)."""
        if self._owned:
            remove_placement_group(self.group)

    # -- helpers ------------------------------------------------------------------------------

    def _index(self, index: object) -> None:
        count = self.group.bundle_count
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise InvalidArgument(f"bundle index must be an int in [0, {count}), got {index!r}")

    def _live_node(self, index: int) -> str | None:
        """Bundle ``index``'s node if it is alive (blocking reads of the control store)."""
        node = self.nodes()[index]
        if node is None:
            return None
        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        return node if any(n["NodeID"] == node and n["Alive"] for n in nodes) else None


#: The resources Ray asks for by their own keywords (``ray_option_utils``: "CPU", "GPU" and
#: "memory" are refused in ``resources``).
_KEYWORDS = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


def actor_resources(resources: Mapping[str, float]) -> dict[str, Any]:
    """``resources`` as an actor's options: ``CPU``, ``GPU`` and ``memory`` by their keywords,
    the rest (custom resources) in ``resources``; ``num_cpus`` 0 unless ``CPU`` is asked."""
    options: dict[str, Any] = {"num_cpus": 0}
    custom = {}
    for key, amount in resources.items():
        if key in _KEYWORDS:
            options[_KEYWORDS[key]] = amount
        else:
            custom[key] = amount
    if custom:
        options["resources"] = custom
    return options


def _free() -> dict[str, float]:
    """The cluster's unreserved resources (for messages)."""
    return dict(ray.available_resources())  # type: ignore[no-untyped-call]


def _total() -> dict[str, float]:
    """The cluster's resources (for messages)."""
    return dict(ray.cluster_resources())  # type: ignore[no-untyped-call]


__all__ = ["STRATEGIES", "EnginePlacement", "PlacementFailed", "actor_resources"]
