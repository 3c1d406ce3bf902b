"""Keeps a router's worker set equal to the engines that may serve.

A ``RolloutServer`` given a router (``SGLangRouter``) binds this to its phase runner: before any
pause is sent, the engines about to pause are taken out of the router, and the pause is not sent
unless that worked (``RouterError``: nothing was sent, the state is unchanged); after every phase
that may have changed which engines serve (a continue, a pause, a probe, any engine call that
did not succeed), and after every state change that changes which groups the state lets serve,
the router is brought in step with the ledger: an engine is registered exactly when it serves
(``Fleet.serves``, the predicate the generation client routes by: alive, unpaused, all its
memory resident, the expected weights, a replacement only once a weight update reached it, and
a group the server's state lets serve), and the workers of engines that died, were retired or
stopped serving are taken out.

Each engine is registered as what its server says it serves as (``Capabilities.worker_type``,
read with its incarnation): a regular worker, or the prefill (with its bootstrap port) or decode
half of a prefill/decode pair, for a router in prefill/decode mode. The halves of a pair that
form one unit (``EngineGroup(unit=2)``) serve together or not at all (``Fleet.serves``), so one
sync registers both and one takes both out.

The binding takes out only workers it owns, since other clients may share the router: the
workers at the URLs of the engines in the fleet now, and a worker it registered itself for an
engine that has since been retired (one it could not take out when the engine died), until it
has taken that one out once. The URL of a retired engine is then free: a worker someone else
registers there (a server restarted at that address, another team's engine) is never touched.

Why take workers out rather than tune the router's health checks: the router probes ``/health``,
which on SGLang generates, so a paused engine never answers it; with health checks relaxed
enough to ride out an offload, the router would still send new requests to paused and released
workers, and would take long to notice a real death. Taken out, a worker gets no request while
it is paused, released or being written; the cost is that a request arriving while no worker is
registered gets the router's error at once, and the client retries it (as it retries an abort).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rollout_lifecycle.contract.capabilities import DEFAULT, Capabilities
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import InvalidArgument, RouterError
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.bus import StateEntered
from rollout_lifecycle.core.ledger import Fleet, may_serve
from rollout_lifecycle.core.runner import PhaseResult, Plan, WorkerUrls
from rollout_lifecycle.core.states import ServerState

_PAUSE, _CONTINUE = Op.PAUSE, Op.CONTINUE


class WorkerRouter(Protocol):
    """What the server needs of a router (``SGLangRouter`` is one)."""

    @property
    def url(self) -> str: ...

    async def workers(self) -> Sequence[Any]:
        """The listed workers (each with ``url``)."""
        ...

    async def add(
        self, url: str, *, worker_type: str = "regular", bootstrap_port: int | None = None
    ) -> None:
        """Register ``url`` as ``worker_type`` (``contract/capabilities.WORKER_TYPES``)."""
        ...

    async def remove(self, url: str) -> None: ...


class RouterSync:
    """The router binding of one server (see the module docstring)."""

    def __init__(
        self,
        router: WorkerRouter,
        fleet: Fleet,
        state: Callable[[], ServerState],
        urls: WorkerUrls,
        name: str,
    ) -> None:
        for attr in ("workers", "add", "remove"):
            if not callable(getattr(router, attr, None)):
                raise InvalidArgument(f"router must have async {attr}(), got {router!r}")
        self.router = router
        self._fleet = fleet
        self._state = state
        self._urls = urls
        #: How errors and events name the router.
        self._label = str(getattr(router, "url", router))
        self._log = logger().bind(server=name, router=self._label)
        #: The URLs (``url_identity``) at which this binding registered a worker that it has
        #: not taken out since: after its engine is retired, the one worker there it may remove.
        self._registered: set[str] = set()
        #: Why the router is not in step with the engines that serve, since the last sync
        #: after a phase failed (None once a sync succeeds): a call that leaves engines serving
        #: raises it (``RolloutServer``), rather than reporting success while the router
        #: sends them nothing.
        self.failure: RouterError | None = None
        #: One lock per event loop (a lock belongs to the loop it first waited on).
        self._lock: tuple[asyncio.Lock, asyncio.AbstractEventLoop] | None = None

    async def before(self, plan: Plan) -> None:
        """Take the engines ``plan`` is about to pause out of the router (``RouterError``)."""
        if plan.op is not _PAUSE:
            return
        urls = [u for u in (await self._urls.of(plan.targets)).values() if u is not None]
        try:
            async with self._locked():
                await asyncio.gather(*(self._remove(u) for u in urls))
        except RouterError:
            # Nothing is paused: put back what was taken out, if the router lets us.
            with contextlib.suppress(RouterError):
                await self.sync()
            raise

    async def after(self, plan: Plan, result: PhaseResult) -> None:
        """Bring the router in step after a phase that may have changed who serves."""
        if (
            plan.op is _CONTINUE
            or plan.op is _PAUSE
            or plan.op is Op.SERVER_INFO
            or plan.op is Op.OBSERVE
            or not all(o.ok for o in result.outcomes.values())
        ):
            await self._follow()

    async def entered(self, event: StateEntered) -> None:
        """Bring the router in step after a state change that changes which groups may serve
        (``may_serve``): a continue lets its engines serve once the server is ``serving``, a
        drain that failed once it is ``failed``."""
        if any(
            may_serve(event.state, g.needs_offload) != may_serve(event.previous, g.needs_offload)
            for g in self._fleet.groups
        ):
            await self._follow()

    async def _follow(self) -> None:
        """``sync``, keeping a refusal as ``failure`` (the engines are as the lifecycle left
        them; ``sync_router()`` puts the router right)."""
        try:
            await self.sync()
        except RouterError as exc:
            self.failure = exc
            self._log.warning("router.out_of_step", error=str(exc))

    def check(self) -> None:
        """Once a call has completed, raise ``RouterError`` if engines serve while the router
        could not be brought in step with them (it would send them nothing, or send requests to
        engines that stopped serving): the call did its work, ``sync_router()`` puts the router
        right."""
        failure = self.failure
        state = self._state()
        if failure is not None and any(self._fleet.serves(r, state) for r in self._fleet.live()):
            raise RouterError(
                failure.router,
                f"the call completed and its engines serve, but the router could not be "
                f"brought in step with them ({failure.message}); sync_router() puts it right",
                failure.status,
            )

    async def sync(self) -> dict[str, list[str]]:
        """Register every engine that serves and take out every other worker this binding owns
        (see the module docstring); the URLs added and removed. ``RouterError`` if the router
        refuses or is unreachable, or (once the rest is done) an engine that serves did not
        tell its worker URL."""
        records = self._fleet.records()
        urls = await self._urls.of(records)
        fleet = {url_identity(u) for u in urls.values() if u is not None}
        state = self._state()
        serving = [r for r in records if self._fleet.serves(r, state)]
        want = {
            url_identity(u): (u, r.capabilities or DEFAULT)
            for r in serving
            if (u := urls[r.id]) is not None
        }
        async with self._locked():
            listed: dict[str, tuple[str, str]] = {}
            for worker in await self.router.workers():
                with contextlib.suppress(InvalidArgument):
                    kind = str(getattr(worker, "worker_type", "regular"))
                    listed[url_identity(str(worker.url))] = (str(worker.url), kind)
            owned = fleet | self._registered
            # a worker listed as another type than its engine serves as (a server restarted
            # in another mode) is taken out and registered again
            wrong = {
                k
                for k, (_, caps) in want.items()
                if k in listed and listed[k][1] != caps.worker_type
            }
            extra = [listed[k][0] for k in listed.keys() & owned if k not in want or k in wrong]
            missing = [(u, caps) for k, (u, caps) in want.items() if k not in listed or k in wrong]
            # A unit's members are added in one gather and taken out in one: the router has no
            # call that changes several workers at once, so for the moment between its two
            # background jobs it may list one half of a prefill/decode pair.
            await asyncio.gather(*(self._remove(u) for u in extra))
            await asyncio.gather(*(self._add(u, caps) for u, caps in missing))
        added = [u for u, _ in missing]
        if extra or missing:
            self._log.info("router.synced", added=added, removed=extra)
        unread = self._urls.unread(serving)
        if unread:
            # Engines that serve but are not listed: the router is not in step, whatever it
            # took of the rest (an actor whose process has not started yet answers nothing).
            self.failure = RouterError(
                self._label,
                f"engines {unread} serve but did not answer the read of their worker URL "
                f"within {self._urls.deadline:g} s (deadlines.probe), so the router does not "
                f"list them; sync_router() registers them once they answer",
            )
            raise self.failure
        self.failure = None
        return {"added": added, "removed": extra}

    async def _add(self, url: str, caps: Capabilities) -> None:
        # Owned from the request on: a registration whose wait fails may still be done by the
        # router later, and only this binding would ever take it out.
        self._registered.add(url_identity(url))
        await self.router.add(url, worker_type=caps.worker_type, bootstrap_port=caps.bootstrap_port)

    async def _remove(self, url: str) -> None:
        await self.router.remove(url)
        # Taken out once: a worker at this URL from now on is not this binding's registration.
        self._registered.discard(url_identity(url))

    @contextlib.asynccontextmanager
    async def _locked(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[1] is not loop:
            self._lock = (asyncio.Lock(), loop)
        async with self._lock[0]:
            yield


__all__ = ["RouterSync", "WorkerRouter"]
