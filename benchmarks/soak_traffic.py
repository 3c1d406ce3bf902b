"""The request half of the soak benchmark: generate traffic through the library's own client
while a colocated trainer cycles the fleet, engines die and are replaced, leg after leg.

Each leg builds a fresh fleet and a fresh ``RolloutServer`` (groups ``actor`` and ``critic``,
both offloaded) with one pause mode; legs alternate ``retract`` (leg 0) and ``abort``. Traffic
goes through ``server.generate`` (the ``GenerationClient``: it holds requests while the engines
are paused and resubmits aborted or lost ones as prompt + partial output): a fixed number of
workers keep that many requests in flight all the time, so every offload meets requests in
flight. A cycle is what a colocated RL trainer does: ``offload()``, a trainer step,
``onload_weights()``, ``update_weights(push)`` through every engine, ``onload_kv()``, then
decoding until the cycle's share of the traffic has been sent. Every ``death_every``-th cycle
one engine with requests on it is killed; the server finds it (``probe()``) and replaces it
(``recover(factory)``); the requests it held must still complete elsewhere. Every
``Knobs.churn_every``-th cycle one actor engine with requests on it leaves the fleet
(``remove_engines``: what it held comes back and runs elsewhere) and a fresh one joins
(``add_engines``) before the cycle's offload, serving once the cycle's push reaches it.

Three fleets: in-process simulated engines on a virtual-time loop (``looptime``: decoding and
deadlines cost no real time; ``run_soak_in_process``), simulated engine actors on Ray
(``soak_on_ray``), and real SGLang servers (``soak_real``). Each returns a ``TrafficReport``:
every request accepted is either completed with every token it asked for or counted lost;
nothing here waits without a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from benchmarks._common import cpu_sglang_setup
from rollout_lifecycle import (
    EngineGroup,
    EngineHost,
    FromDisk,
    LaunchedSGLangEngine,
    LifecycleConfig,
    PauseMode,
    RolloutServer,
    SGLangHTTPEngine,
    SimulatedEngine,
    WeightUpdate,
    free_port,
    launched_sglang_factory,
)
from rollout_lifecycle.testing import (
    History,
    barrier_violations,
    fatal_calls,
    local_ray,
    send_to_engine,
    simulated_engine_actors,
)

T = TypeVar("T")

#: The pause mode of leg k is ``LEG_MODES[k % 2]``.
LEG_MODES: tuple[PauseMode, PauseMode] = (PauseMode.RETRACT, PauseMode.ABORT)
#: The two groups of every server, both offloaded with the trainer.
GROUPS: tuple[str, str] = ("actor", "critic")
#: The critic's servers form units of two (``EngineGroup(unit=2)``) where it has two units or
#: more: a member killed makes its unit unhealthy, and ``recover()`` replaces the unit whole
#: while the other units serve its requests (a group of one unit serves nothing until the new
#: unit's weights are pushed, and a leg's last recovery has no push after it).
UNIT_GROUPS: dict[str, int] = {"critic": 2}
#: Lifecycle op latencies of the simulated engines, seconds (uniform, seeded per engine).
SIM_OP_LATENCY: tuple[float, float] = (0.001, 0.005)
_SIM_OPS = (
    "pause_generation",
    "continue_generation",
    "flush_cache",
    "release_memory_occupation",
    "resume_memory_occupation",
    "update_weights_from_disk",
    "update_weight_version",
    "server_info",
)
#: Where ``ci/sglang-env`` puts SGLang 0.5.23 and the tiny model.
SGLANG_CACHE = Path(
    os.environ.get("ROLLOUT_LIFECYCLE_CACHE", str(Path.home() / ".cache" / "rollout-lifecycle"))
)
ROOT = Path(__file__).resolve().parent.parent


class SoakStalled(Exception):
    """One of the soak's own awaits passed its bound."""


@dataclass
class TrafficReport:
    """What one soak did to its requests, summed over its legs."""

    fleet: str  # "in-process", "ray" or "real"
    legs: int  # fleets built one after another, pause modes alternating
    cycles: int  # offload/onload cycles in all legs
    submitted: int  # generate requests the GenerationClient accepted
    completed: int  # answered with every token asked for
    aborted: int  # attempts answered finish_reason abort (retract: 0 but on engines that died)
    resubmitted: int  # client resubmissions (GenerationClient.stats()["resubmissions"])
    lost: int  # submitted - completed: failed, raised, hung past the bound, or short of tokens
    deaths: int  # engines killed on purpose
    recoveries: int  # successful server.recover(factory) calls
    violations: int  # call-order / barrier violations in the engines' histories
    wall_s: float
    rss_mb: list[tuple[int, float]]  # (cycle index, driver RSS in MiB) after every cycle
    #: Units of several servers replaced whole (a member killed: ``UNIT_GROUPS``).
    units_replaced: int = 0
    #: Aborted attempts in ``retract`` legs (must be 0: retract keeps every request).
    aborted_under_retract: int = 0
    #: Requests planned but never sent (a leg stopped early): not in ``submitted``.
    unsent: int = 0
    #: Engines that left the fleet and joined it (``Knobs.churn_every``), and the attempts the
    #: leaving engines handed back aborted (in every mode: a leaving engine is never continued;
    #: counted in ``aborted``, not in ``aborted_under_retract``).
    leaves: int = 0
    joins: int = 0
    aborted_on_leaving: int = 0
    #: Why a leg stopped early, a request failed, or what could not be checked.
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: One row per leg: mode, cycles, submitted, completed, lost, aborted, resubmitted, deaths,
    #: the fewest requests in flight at any offload of the leg, wall seconds.
    per_leg: list[dict[str, object]] = field(default_factory=list)
    #: The violations themselves (at most 20 kept).
    violation_samples: list[str] = field(default_factory=list)

    def row(self) -> dict[str, object]:
        """Columns for a table: counts, rates, and RSS first (after cycle 1), last and peak."""
        values = [mb for _, mb in self.rss_mb]
        wall = self.wall_s if self.wall_s > 0 else float("nan")
        return {
            "fleet": self.fleet,
            "legs": self.legs,
            "cycles": self.cycles,
            "submitted": self.submitted,
            "completed": self.completed,
            "lost": self.lost,
            "aborted": self.aborted,
            "aborted (retract)": self.aborted_under_retract,
            "resubmitted": self.resubmitted,
            "deaths": self.deaths,
            "recoveries": self.recoveries,
            "units replaced": self.units_replaced,
            "left / joined": f"{self.leaves} / {self.joins}",
            "violations": self.violations,
            "wall s": round(self.wall_s, 1),
            "req/s": round(self.submitted / wall, 1),
            "cycles/s": round(self.cycles / wall, 2),
            "rss first MiB": round(values[0], 1) if values else float("nan"),
            "rss last MiB": round(values[-1], 1) if values else float("nan"),
            "rss peak MiB": round(max(values), 1) if values else float("nan"),
        }


def rss_mb() -> float:
    """The driver's resident memory now, MiB (``/proc/self/statm``; else the peak so far)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def bounded(what: str, awaitable: Awaitable[T], seconds: float) -> T:
    """``awaitable`` within ``seconds`` (on the loop's clock), else ``SoakStalled``."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise SoakStalled(f"{what} did not finish within {seconds:g}s") from None


#: The memory tags of the resume phases, which a server's timeline does not record.
_PHASE_TAGS: dict[str, tuple[str, ...]] = {
    "resume_weights": ("weights",),
    "resume_kv": ("kv_cache", "cuda_graph"),
}


def timeline_histories(server: RolloutServer) -> dict[str, History]:
    """The engine calls in ``server.timeline`` as call histories by engine id (for the barrier
    check of engines that record none, e.g. real servers); the timeline is cleared."""
    histories: dict[str, list[dict[str, Any]]] = {}
    for span in server.timeline.spans("engine_call"):
        histories.setdefault(str(span.engine), []).append(
            {
                "op": span.op,
                "tags": _PHASE_TAGS.get(span.phase or ""),
                "start": span.start,
                "end": span.end,
                "outcome": span.outcome,
            }
        )
    server.timeline.clear()
    return dict(histories)


def _unit(group: str, engines: int) -> int:
    """The unit size of ``group`` with ``engines`` engines (``UNIT_GROUPS``; 1 where they are
    not two units or more)."""
    unit = UNIT_GROUPS.get(group, 1)
    return unit if engines % unit == 0 and engines >= 2 * unit else 1


def _split(total: int, parts: int) -> list[int]:
    """``total`` over ``parts`` as evenly as integers allow."""
    return [total // parts + (k < total % parts) for k in range(parts)]


@dataclass(frozen=True)
class Sizes:
    """How big one soak is: requests and cycles over its legs, engines per fleet, a death every
    ``death_every``-th cycle (0: none), and the seed of its random choices."""

    requests: int
    cycles: int
    legs: int
    engines: int
    death_every: int
    seed: int = 0

    def __post_init__(self) -> None:
        legs, cycles, requests, engines = self.legs, self.cycles, self.requests, self.engines
        if legs < 1 or cycles < legs or requests < 1 or engines < 2 or self.death_every < 0:
            raise ValueError(
                f"need legs >= 1, cycles >= legs, requests >= 1, engines >= 2 and death_every "
                f">= 0; got legs={legs}, cycles={cycles}, requests={requests}, "
                f"engines={engines}, death_every={self.death_every}"
            )


# ------------------------------------------------------------------------------------ fleets


class Fleet:
    """Where one soak's engines come from, how one is killed, and what they recorded.

    A fleet lives for one soak: each leg asks it for fresh groups (``build``). Engines are named
    by unique labels (a replacement gets a new one); histories and abort counts are kept for
    every engine ever built, the killed ones included.
    """

    name = "fleet"
    #: Whether engines can be made mid-leg cheaply enough to join the fleet
    #: (``Knobs.churn_every``).
    can_replace = True
    #: Whether the engines record their own call histories (else the soak checks the
    #: server's record of the calls it made, ``server.timeline``).
    keeps_history = True

    def __init__(self) -> None:
        #: Label -> when it was killed (``time.monotonic()``, the histories' clock).
        self.gone: dict[str, float] = {}
        self._serial = 0
        self._leg = 0

    def next_label(self, engine_id: str) -> str:
        """A new label for a replacement of ``engine_id`` (``group/index``) in this leg."""
        self._serial += 1
        return f"l{self._leg}-{engine_id.replace('/', '-')}-r{self._serial}"

    async def build(self, leg: int, sizes: Sequence[int]) -> list[list[Any]]:
        """The engines of each group for leg ``leg``, started and answering."""
        raise NotImplementedError

    def replacement(self, engine_id: str) -> Any:
        """A fresh engine for ``engine_id`` (the ``recover()`` factory)."""
        raise NotImplementedError

    async def kill(self, handle: Any) -> None:
        raise NotImplementedError

    async def push(self, update: WeightUpdate) -> None:
        """The trainer's weight push: one write through every engine handle of the update."""
        await asyncio.gather(
            *(
                send_to_engine(
                    h, "update_weights_from_disk", (f"/ckpt/{update.version}", update.version)
                )
                for h in update.engines.values()
            )
        )

    async def take_histories(self, final: bool) -> dict[str, History] | None:
        """The lifecycle calls the engines recorded since the last take (every engine ever
        built, the killed ones included), or None when there is nothing to check now: the
        engines keep no history, or (``final`` False) this fleet hands them over only at the
        end."""
        return None

    async def aborted(self) -> int | None:
        """Attempts the engines answered with finish_reason abort (None: they do not say); not
        those of engines the server retires (``retiring``)."""
        return None

    def retiring(self, handle: Any) -> None:
        """The server is about to retire ``handle``'s engine (a member of a unit replaced
        whole): the abort of its retirement is not the lifecycle's abort of a request."""

    async def end_leg(self) -> None:
        """Stop this leg's engines (the next leg builds its own)."""


class SimFleet(Fleet):
    """In-process ``SimulatedEngine``s in ``EngineHost``s; a death is ``close()`` (what an
    injected death does to the simulator: every in-flight generate raises ``EngineDead``, every
    later call too)."""

    name = "in-process"

    def __init__(self, *, token_latency: float, seed: int) -> None:
        super().__init__()
        self._token_latency = token_latency
        self._seed = seed
        self._engines: dict[str, SimulatedEngine] = {}
        self._hosts: dict[int, str] = {}
        self._live: list[SimulatedEngine] = []
        self._aborted = 0
        #: Labels of the engines the server retires (``retiring``).
        self._retired: set[str] = set()

    def _make(self, label: str) -> EngineHost:
        engine = SimulatedEngine(
            label,
            token_latency=self._token_latency,
            op_latency=dict.fromkeys(_SIM_OPS, SIM_OP_LATENCY),
            seed=self._seed + len(self._engines),
        )
        host = EngineHost(engine)
        self._engines[label] = engine
        self._hosts[id(host)] = label
        self._live.append(engine)
        return host

    async def build(self, leg: int, sizes: Sequence[int]) -> list[list[Any]]:
        self._leg = leg
        return [
            [self._make(f"l{leg}-{group}-{i}") for i in range(size)]
            for group, size in zip(GROUPS, sizes, strict=True)
        ]

    def replacement(self, engine_id: str) -> Any:
        return self._make(self.next_label(engine_id))

    async def kill(self, handle: Any) -> None:
        label = self._hosts[id(handle)]
        self.gone[label] = time.monotonic()
        await self._engines[label].close()

    async def take_histories(self, final: bool) -> dict[str, History]:
        # Taken as the soak goes (each cycle checked on its own): the engines live in this
        # process, and their histories must not make the driver's memory grow with the run.
        return {e.label: e.take_history() for e in self._live}

    async def aborted(self) -> int:
        counted = (e for e in self._live if e.label not in self._retired)
        return self._aborted + sum(e.stats()["aborted"] for e in counted)

    def retiring(self, handle: Any) -> None:
        self._retired.add(self._hosts[id(handle)])

    async def end_leg(self) -> None:
        # The soak took the histories; keep the counts and drop the engines.
        for engine in self._live:
            if engine.label not in self._retired:
                self._aborted += engine.stats()["aborted"]
            await engine.close()
        self._live.clear()
        self._retired.clear()
        self._engines.clear()
        self._hosts.clear()


class RayFleet(Fleet):
    """``simulated_engine_actors`` on Ray; a death is ``ray.kill`` (history and counters are
    read just before)."""

    name = "ray"

    def __init__(self, *, token_latency: float, seed: int, startup_s: float = 120.0) -> None:
        super().__init__()
        self._options: dict[str, Any] = {
            "token_latency": token_latency,
            "op_latency": dict.fromkeys(_SIM_OPS, SIM_OP_LATENCY),
        }
        self._seed = seed
        self._startup_s = startup_s
        self._live: list[tuple[str, Any]] = []
        self._histories: dict[str, History] = {}
        self._aborted = 0
        self._started = 0

    def _start(self, label: str) -> Any:
        (actor,) = simulated_engine_actors(
            1, label=label, seed=self._seed + self._started, **self._options
        )
        self._started += 1
        # simulated_engine_actors labels engine i of the call f"{label}-{i}"
        self._live.append((f"{label}-0", actor))
        return actor

    async def build(self, leg: int, sizes: Sequence[int]) -> list[list[Any]]:
        self._leg = leg
        groups = [
            [self._start(f"l{leg}-{group}-{i}") for i in range(size)]
            for group, size in zip(GROUPS, sizes, strict=True)
        ]
        await bounded(
            "engine actors starting",
            asyncio.gather(*(a.ping.remote() for g in groups for a in g)),
            self._startup_s,
        )
        return groups

    def replacement(self, engine_id: str) -> Any:
        return self._start(self.next_label(engine_id))

    def label_of(self, handle: Any) -> str | None:
        return next((label for label, h in self._live if h is handle), None)

    async def _keep(self, label: str, actor: Any) -> None:
        history, stats = await bounded(
            f"history of {label}",
            asyncio.gather(send_to_engine(actor, "history"), send_to_engine(actor, "stats")),
            60.0,
        )
        self._histories[label] = history
        self._aborted += int(stats.get("aborted", 0))

    async def kill(self, handle: Any) -> None:
        import ray

        label = self.label_of(handle)
        assert label is not None
        await self._keep(label, handle)
        self.gone[label] = time.monotonic()
        ray.kill(handle, no_restart=True)
        self._live = [(lb, h) for lb, h in self._live if h is not handle]

    async def take_histories(self, final: bool) -> dict[str, History] | None:
        # The histories grow in the actors, not here: all are read once, at the end.
        if not final:
            return None
        for label, actor in self._live:
            with contextlib.suppress(Exception):
                await self._keep(label, actor)
        taken, self._histories = self._histories, {}
        return taken

    async def aborted(self) -> int:
        live = await bounded(
            "engine stats",
            asyncio.gather(
                *(send_to_engine(a, "stats") for _, a in self._live), return_exceptions=True
            ),
            60.0,
        )
        return self._aborted + sum(int(s.get("aborted", 0)) for s in live if isinstance(s, dict))

    async def end_leg(self) -> None:
        import ray

        for label, actor in self._live:
            if label not in self._histories:
                with contextlib.suppress(Exception):
                    await self._keep(label, actor)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._live.clear()


class RealFleet(Fleet):
    """Real SGLang servers: attached by URL (a fresh HTTP client per leg), or launched by this
    fleet (kept across legs; a death stops the server's process group, and the replacement is a
    new server that starts inside ``recover()``). Real servers keep no history for the barrier
    check; aborted attempts are counted from the client (resubmissions not due to a death)."""

    name = "real"
    #: (a real server takes tens of seconds to start: the real soak does not churn)
    can_replace = False
    keeps_history = False

    def __init__(
        self,
        *,
        urls: Sequence[str] = (),
        launch: Callable[[], LaunchedSGLangEngine] | None = None,
        count: int = 0,
        model: str,
    ) -> None:
        super().__init__()
        if bool(urls) == (launch is not None):
            raise ValueError("give urls (attach) or launch (start servers), not both or neither")
        self._urls = list(urls)
        self._launch = launch
        self._launched: list[LaunchedSGLangEngine] = (
            [launch() for _ in range(count)] if launch is not None else []
        )
        self._model = model
        self._clients: list[SGLangHTTPEngine] = []

    @property
    def launched(self) -> list[LaunchedSGLangEngine]:
        return list(self._launched)

    async def start(self, timeout: float) -> None:
        """Start the launched servers together (they import for a minute on a CPU)."""
        await bounded(
            "SGLang servers starting",
            asyncio.gather(*(e.start() for e in self._launched)),
            timeout,
        )

    async def build(self, leg: int, sizes: Sequence[int]) -> list[list[Any]]:
        self._leg = leg
        # (a launched engine's calls are made at import time: not an EngineBackend to mypy)
        backends: list[Any]
        if self._urls:
            self._clients = [SGLangHTTPEngine(url) for url in self._urls]
            backends = list(self._clients)
        else:
            backends = list(self._launched)
        if sum(sizes) != len(backends):
            raise ValueError(f"{len(backends)} real servers for groups of sizes {list(sizes)}")
        hosts = [EngineHost(b) for b in backends]
        return [hosts[: sizes[0]], hosts[sizes[0] :]]

    def replacement(self, engine_id: str) -> Any:
        if self._launch is None:
            raise RuntimeError("attached servers cannot be replaced")
        engine = self._launch()
        self._launched.append(engine)
        backend: Any = engine
        return EngineHost(backend)

    async def kill(self, handle: Any) -> None:
        backend = handle.backend
        if not isinstance(backend, LaunchedSGLangEngine):
            raise RuntimeError("only servers this fleet launched can be killed")
        self.gone[backend.label] = time.monotonic()
        self._launched = [e for e in self._launched if e is not backend]
        await backend.close()

    async def push(self, update: WeightUpdate) -> None:
        await FromDisk(self._model)(update)

    async def end_leg(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients), return_exceptions=True)
        self._clients = []

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self._launched), return_exceptions=True)


# ------------------------------------------------------------------------------------ traffic


class Traffic:
    """``workers`` coroutines that keep that many generate requests in flight through
    ``server.generate`` until ``total`` have been sent; each answer is checked."""

    def __init__(
        self,
        server: RolloutServer,
        *,
        total: int,
        workers: int,
        tokens: tuple[int, int],
        rng: random.Random,
        by_group: bool,
    ) -> None:
        self._server = server
        self.total = total
        self.sent = 0
        self.completed = 0
        self.short = 0
        self.failures: Counter[str] = Counter()
        self.samples: list[str] = []
        self.stopping = False
        self._tokens = tokens
        self._rng = rng
        self._groups: tuple[str | None, ...] = GROUPS if by_group else (None,)
        self._target = 0
        self._reached = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._worker()) for _ in range(max(1, workers))]

    @property
    def tasks(self) -> list[asyncio.Future[None]]:
        return list(self._tasks)

    def done(self) -> bool:
        return all(t.done() for t in self._tasks)

    async def _worker(self) -> None:
        lo, hi = self._tokens
        while self.sent < self.total and not self.stopping:
            i = self.sent
            self.sent += 1
            if self.sent >= self._target:
                self._reached.set()
            want = self._rng.randint(lo, hi)
            request = {
                "input_ids": [1 + i % 997, 1 + i % 13, 7],
                "sampling_params": {"max_new_tokens": want, "ignore_eos": True},
            }
            try:
                answer = await self._server.generate(
                    request, group=self._groups[i % len(self._groups)]
                )
            except Exception as exc:  # every failure is counted; the soak goes on
                self.failures[type(exc).__name__] += 1
                if len(self.samples) < 5:
                    self.samples.append(f"{type(exc).__name__}: {exc}"[:400])
                continue
            finish = answer["meta_info"].get("finish_reason") or {}
            if len(answer["output_ids"]) == want and finish.get("type") == "length":
                self.completed += 1
            else:
                self.short += 1
                if len(self.samples) < 5:
                    self.samples.append(
                        f"short answer: {len(answer['output_ids'])} of {want} tokens, "
                        f"finish {finish}"
                    )
        self._reached.set()

    async def until_sent(self, count: int, seconds: float) -> None:
        """Wait until ``count`` requests have been sent (or all, or the workers stopped)."""
        deadline = asyncio.get_running_loop().time() + seconds
        while self.sent < min(count, self.total) and not self.done():
            self._reached.clear()  # (cleared before the target moves: no wake is missed)
            self._target = count
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise SoakStalled(f"traffic: {self.sent} of {count} sent within {seconds:g}s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._reached.wait(), min(remaining, 1.0))

    async def wait(self, seconds: float) -> None:
        """Wait for the workers (every request sent and answered) for ``seconds``."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=seconds)

    async def cancel_rest(self) -> int:
        """Cancel the requests still unanswered; returns how many."""
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=60.0)
        return len(pending)


# ------------------------------------------------------------------------------------ one leg


@dataclass
class Knobs:
    """How a soak runs, beyond its sizes (seconds are the loop's: virtual in process)."""

    concurrency: int = 256
    tokens: tuple[int, int] = (4, 32)
    trainer_step_s: float = 0.05
    min_decode_s: float = 0.02
    call_timeout_s: float = 600.0
    traffic_timeout_s: float = 600.0
    drain_timeout_s: float = 600.0
    #: Real seconds the whole soak may take before it stops its legs and counts what is left.
    wall_limit_s: float = 3600.0
    #: Every ``churn_every``-th cycle (0: never) one actor engine with requests on it leaves the
    #: fleet (``remove_engines``) and a fresh one joins (``add_engines``) before the cycle's
    #: offload, waiting paused for the cycle's push.
    churn_every: int = 3


class _Stop:
    """A real-time limit: the loop may run on virtual time (whose bounds never pass while
    something keeps it busy), so a ``threading.Timer`` cancels the leg's body and its traffic
    through ``call_soon_threadsafe``."""

    def __init__(self, wall_limit_s: float) -> None:
        self.expired = False
        self.body: asyncio.Future[Any] | None = None
        self.traffic: Traffic | None = None
        self._loop = asyncio.get_running_loop()
        self._timer = threading.Timer(wall_limit_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to stop
            self._loop.call_soon_threadsafe(self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self.body is not None and not self.body.done():
            self.body.cancel()
        if self.traffic is not None:
            self.traffic.stopping = True
            for task in self.traffic.tasks:
                task.cancel()

    def cancel(self) -> None:
        self._timer.cancel()


class Soak:
    """One soak: its legs one after another on one fleet, and the report they add up to."""

    def __init__(self, fleet: Fleet, sizes: Sizes, knobs: Knobs) -> None:
        self.fleet = fleet
        self.sizes = sizes
        self.knobs = knobs
        self.report = TrafficReport(
            fleet=fleet.name,
            legs=sizes.legs,
            cycles=0,
            submitted=0,
            completed=0,
            aborted=0,
            resubmitted=0,
            lost=0,
            deaths=0,
            recoveries=0,
            violations=0,
            wall_s=0.0,
            rss_mb=[],
        )
        #: Window starts for the barrier check (``time.monotonic()``, the histories' clock)
        #: since the histories were last checked: one per cycle and one per recovery, so a
        #: replacement's bring-up is checked on its own.
        self.windows: list[float] = []
        self._checked = False
        self._server: RolloutServer | None = None
        self._cycle_index = 0

    async def run(self) -> TrafficReport:
        began = time.perf_counter()
        stop = _Stop(self.knobs.wall_limit_s)
        try:
            sizes = self.sizes
            requests = _split(sizes.requests, sizes.legs)
            cycles = _split(sizes.cycles, sizes.legs)
            for leg in range(sizes.legs):
                if stop.expired:
                    self.report.unsent += sum(requests[leg:])
                    continue
                await self._leg(leg, LEG_MODES[leg % 2], requests[leg], cycles[leg], stop)
        finally:
            stop.cancel()
        await self._check_histories(final=True)
        if not self._checked:
            self.report.notes.append("violations: not checked (the engines keep no history)")
        elif not self.fleet.keeps_history:
            self.report.notes.append(
                "violations: checked on the server's record of its engine calls "
                "(server.timeline, times as the driver saw them): the engines keep no history"
            )
        if await self.fleet.aborted() is None:
            self.report.notes.append(
                "aborted: counted from the client (resubmissions minus attempts lost to deaths)"
            )
        self.report.lost = self.report.submitted - self.report.completed
        self.report.wall_s = time.perf_counter() - began
        return self.report

    async def _check_histories(self, *, final: bool = False) -> None:
        """Check the calls recorded since the last check, in the windows opened since then.

        Checked at the start of every cycle (before its pause) and at the end of every leg:
        no barrier pair spans a check (the last phase of a cycle is ``continue``, the first of
        the next is ``pause``), and calls still in flight stay for the next take.
        """
        histories = await self.fleet.take_histories(final)
        if histories is None and not self.fleet.keeps_history and self._server is not None:
            histories = timeline_histories(self._server)
        if histories is None:
            return
        self._checked = True
        found = fatal_calls(histories) + barrier_violations(
            histories, scopes=sorted(self.windows), gone=self.fleet.gone
        )
        self.windows.clear()
        self.report.violations += len(found)
        room = 20 - len(self.report.violation_samples)
        self.report.violation_samples.extend(found[: max(0, room)])

    async def _unit_replacement(self, ids: tuple[str, ...]) -> list[Any]:
        """A fresh unit for a unit found unhealthy: a replacement per member."""
        self.report.units_replaced += 1
        assert self._server is not None
        engines = self._server.engines()
        for engine_id in ids:
            self.fleet.retiring(engines[engine_id])
        made = [self.fleet.replacement(engine_id) for engine_id in ids]
        return [await m if inspect.isawaitable(m) else m for m in made]

    def _new_server(self, groups: list[list[Any]], mode: PauseMode, leg: int) -> RolloutServer:
        return RolloutServer(
            [
                EngineGroup(name, engines, needs_offload=True, unit=_unit(name, len(engines)))
                for name, engines in zip(GROUPS, groups, strict=True)
            ],
            LifecycleConfig(pause_mode=mode),
            name=f"soak-leg-{leg}",
        )

    async def _leg(
        self, leg: int, mode: PauseMode, requests: int, cycles: int, stop: _Stop
    ) -> None:
        began = time.perf_counter()
        per_group = _split(self.sizes.engines, len(GROUPS))
        aborted_before = await self.fleet.aborted()
        try:
            groups = await self.fleet.build(leg, per_group)
        except Exception as exc:
            self.report.errors.append(f"leg {leg}: no fleet: {type(exc).__name__}: {exc}"[:1000])
            self.report.unsent += requests
            await self.fleet.end_leg()
            return
        server = self._server = self._new_server(groups, mode, leg)
        traffic = Traffic(
            server,
            total=requests,
            workers=self.knobs.concurrency,
            tokens=self.knobs.tokens,
            rng=random.Random(self.sizes.seed * 1000 + leg),
            by_group=min(per_group) >= 2,
        )
        state = {
            "deaths": 0,
            "recoveries": 0,
            "min_in_flight": -1,
            "cycles": 0,
            "leaves": 0,
            "joins": 0,
            "left_aborted": 0,
        }
        body = asyncio.ensure_future(self._cycles(server, traffic, requests, cycles, state))
        stop.body, stop.traffic = body, traffic
        error: str | None = None
        try:
            await body
        except asyncio.CancelledError:
            if not stop.expired:
                raise
            error = (
                f"leg {leg}: stopped at the wall limit ({self.knobs.wall_limit_s:g}s); its "
                f"requests were cancelled (their attempts aborted: counted in aborted)"
            )
        except Exception as exc:
            error = f"leg {leg} ({mode.value}): {type(exc).__name__}: {exc}"[:1000]
        finally:
            stop.body = None
        drain = self.knobs.drain_timeout_s
        if error is not None:
            self.report.errors.append(error)
            traffic.stopping = True
            drain = min(drain, 30.0)  # the server may never serve again: do not wait long
        if stop.expired:
            drain = 0.0
        await traffic.wait(drain)
        # Counted before the rest is cancelled: the client aborts what it gives up on.
        aborted_after = await self.fleet.aborted()
        cancelled = await traffic.cancel_rest()
        stop.traffic = None
        if cancelled:
            self.report.errors.append(
                f"leg {leg}: {cancelled} request(s) still unanswered after {drain:g}s: cancelled"
            )
        stats = server.generation.stats()
        server.generation.close()
        with contextlib.suppress(SoakStalled):
            await bounded("history check", self._check_histories(), self.knobs.call_timeout_s)
        self._server = None
        await self.fleet.end_leg()
        if aborted_after is not None and aborted_before is not None:
            aborted = aborted_after - aborted_before
        else:
            aborted = stats["resubmissions"] - stats["engine_deaths"]
        self.report.aborted += aborted
        if mode is PauseMode.RETRACT:
            self.report.aborted_under_retract += aborted - state["left_aborted"]
        self.report.leaves += state["leaves"]
        self.report.joins += state["joins"]
        self.report.aborted_on_leaving += state["left_aborted"]
        report = self.report
        report.cycles += state["cycles"]
        report.submitted += stats["submitted"]
        report.completed += traffic.completed
        report.resubmitted += stats["resubmissions"]
        report.deaths += state["deaths"]
        report.recoveries += state["recoveries"]
        report.unsent += requests - traffic.sent
        failures = dict(traffic.failures)
        if traffic.short:
            failures["short"] = traffic.short
        report.errors.extend(f"leg {leg}: {s}" for s in traffic.samples)
        report.per_leg.append(
            {
                "leg": leg,
                "mode": mode.value,
                "cycles": state["cycles"],
                "submitted": stats["submitted"],
                "completed": traffic.completed,
                "lost": stats["submitted"] - traffic.completed,
                "aborted": aborted,
                "resubmitted": stats["resubmissions"],
                "engine_deaths_seen": stats["engine_deaths"],
                "deaths": state["deaths"],
                "min_in_flight_at_offload": state["min_in_flight"],
                "failures": failures,
                "wall_s": round(time.perf_counter() - began, 2),
            }
        )

    async def _cycles(
        self,
        server: RolloutServer,
        traffic: Traffic,
        requests: int,
        cycles: int,
        state: dict[str, int],
    ) -> None:
        knobs = self.knobs
        call = knobs.call_timeout_s
        for k in range(cycles):
            # Decode until this cycle's share of the traffic has gone out (half a share before
            # the first cycle): the offload then meets the workers' requests in flight.
            await asyncio.sleep(knobs.min_decode_s)
            await traffic.until_sent(int((k + 0.5) * requests / cycles), knobs.traffic_timeout_s)
            await self._check_histories()
            self._cycle_index += 1
            n = self._cycle_index
            in_flight = server.generation.stats()["in_flight"]
            if state["min_in_flight"] < 0 or in_flight < state["min_in_flight"]:
                state["min_in_flight"] = in_flight
            churn = knobs.churn_every
            if churn and n % churn == 0 and self.fleet.can_replace:
                # (with requests in flight; the newcomer gets this cycle's push)
                await self._churn(server, state, n)
            self.windows.append(time.monotonic())
            await bounded(f"cycle {n}: offload", server.offload(), call)
            await asyncio.sleep(knobs.trainer_step_s)  # the trainer's step on the GPUs
            await bounded(f"cycle {n}: onload_weights", server.onload_weights(), call)
            await bounded(
                f"cycle {n}: update_weights",
                server.update_weights(self.fleet.push, version=f"v{n}"),
                call,
            )
            await bounded(f"cycle {n}: onload_kv", server.onload_kv(), call)
            state["cycles"] += 1
            self.report.rss_mb.append((n, round(rss_mb(), 1)))
            every = self.sizes.death_every
            if every and n % every == 0:
                await self._death(server, state, n)

    async def _churn(self, server: RolloutServer, state: dict[str, int], n: int) -> None:
        """A fresh engine joins the actor group, then one with requests on it leaves (in that
        order, so that the group keeps its engines while the newcomer starts)."""
        call = self.knobs.call_timeout_s
        actors = [e for e in server.engines() if e.startswith("actor/")]
        busy = [e for e, c in server.generation.outstanding().items() if c and e in actors]
        leaving = random.Random(self.sizes.seed * 104729 + n).choice(sorted(busy or actors))
        self.windows.append(time.monotonic())
        fresh = self.fleet.replacement(f"actor/joining-{n}")
        if inspect.isawaitable(fresh):
            fresh = await fresh
        await bounded(f"cycle {n}: add", server.add_engines("actor", [fresh]), call)
        state["joins"] += 1
        before = await self.fleet.aborted()
        self.windows.append(time.monotonic())
        await bounded(
            f"cycle {n}: remove {leaving}", server.remove_engines([leaving], stop=False), call
        )
        after = await self.fleet.aborted()
        if before is not None and after is not None:
            state["left_aborted"] += after - before
        state["leaves"] += 1

    async def _death(self, server: RolloutServer, state: dict[str, int], n: int) -> None:
        """Kill one engine that has requests on it, let the server find it, replace it."""
        call = self.knobs.call_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        engines = server.engines()
        busy: list[str] = []
        while loop.time() < deadline:
            busy = [e for e, count in server.generation.outstanding().items() if count > 0]
            if busy or not server.generation.stats()["in_flight"]:
                break  # (nothing in flight: the leg's traffic is done, no engine will be busy)
            await asyncio.sleep(0.005)
        if not busy:
            self.report.notes.append(f"cycle {n}: no engine had requests when one was killed")
            busy = sorted(engines)
        victim = random.Random(self.sizes.seed * 7919 + n).choice(sorted(busy))
        await bounded(f"cycle {n}: kill {victim}", self.fleet.kill(engines[victim]), call)
        state["deaths"] += 1
        # Decoding goes on: the client sees the attempts on the dead engine fail and resubmits
        # them on the others before the server itself knows.
        await asyncio.sleep(self.knobs.min_decode_s)
        outcomes = await bounded(f"cycle {n}: probe", server.probe(), call)
        found = outcomes.get(victim)
        if found is None or found.ok:
            self.report.errors.append(f"cycle {n}: probe did not find {victim} dead: {found}")
        self.windows.append(time.monotonic())
        recovery = server.recover(self.fleet.replacement, unit_factory=self._unit_replacement)
        await bounded(f"cycle {n}: recover", recovery, call)
        state["recoveries"] += 1


# ------------------------------------------------------------------------------------ entries


async def soak_in_process(
    *,
    requests: int,
    cycles: int,
    legs: int,
    engines: int,
    death_every: int,
    seed: int,
    token_latency: float = 0.01,
    knobs: Knobs | None = None,
) -> TrafficReport:
    """The soak over in-process simulated engines, on the running loop.

    Meant for a virtual-time loop (``run_soak_in_process``): decoding (``token_latency`` per
    token) and every bound then cost no real time.
    """
    sizes = Sizes(requests, cycles, legs, engines, death_every, seed)
    fleet = SimFleet(token_latency=token_latency, seed=seed)
    return await Soak(fleet, sizes, knobs or Knobs()).run()


def run_soak_in_process(
    *,
    requests: int,
    cycles: int,
    legs: int,
    engines: int,
    death_every: int,
    seed: int,
    token_latency: float = 0.01,
    knobs: Knobs | None = None,
    virtual: bool = True,
) -> TrafficReport:
    """``soak_in_process`` on a loop of its own: a ``looptime`` virtual-time loop (the clock
    jumps ahead whenever every task waits), or a plain asyncio loop with ``virtual=False``."""
    if virtual:
        import looptime

        loop: asyncio.AbstractEventLoop = looptime.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(
            soak_in_process(
                requests=requests,
                cycles=cycles,
                legs=legs,
                engines=engines,
                death_every=death_every,
                seed=seed,
                token_latency=token_latency,
                knobs=knobs,
            )
        )
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def soak_on_ray(
    *,
    requests: int,
    cycles: int,
    legs: int,
    engines: int,
    death_every: int,
    seed: int,
    token_latency: float = 0.01,
    knobs: Knobs | None = None,
) -> TrafficReport:
    """The soak over simulated engine actors on Ray (real time; a local 2-CPU Ray is started
    unless one runs). At most 8 engines: each is an actor process."""
    if engines > 8:
        raise ValueError(f"at most 8 engine actors on this machine, got {engines}")
    sizes = Sizes(requests, cycles, legs, engines, death_every, seed)

    async def main() -> TrafficReport:
        fleet = RayFleet(token_latency=token_latency, seed=seed)
        soak = Soak(fleet, sizes, knobs or Knobs(concurrency=512))
        try:
            return await soak.run()
        finally:
            await fleet.end_leg()

    with local_ray():
        return asyncio.run(main())


def cpu_sglang_launch(
    *, python: str | None = None, model: str | None = None
) -> tuple[Callable[[], LaunchedSGLangEngine], str]:
    """A factory of CPU SGLang 0.5.23 servers as the real-server test tier runs them (its
    flags and device shim, ``tests/real/servers.py``; a free port per server), and the model
    path. Defaults: the interpreter and tiny model ``ci/sglang-env`` made."""
    venv, tiny = SGLANG_CACHE / "sglang-0.5.23", SGLANG_CACHE / "tiny-gpt2"
    missing = not (venv / ".complete").exists() or not (tiny / ".complete").exists()
    if (python is None or model is None) and missing:
        raise RuntimeError(f"no SGLang environment under {SGLANG_CACHE}: run bash ci/sglang-env")
    python = python or str(venv / "bin" / "python")
    model = model or str(tiny)
    flags, env = cpu_sglang_setup()
    chosen_python, chosen_model = python, model

    def launch() -> LaunchedSGLangEngine:
        factory = launched_sglang_factory(
            chosen_model,
            port=free_port(),
            python=chosen_python,
            memory_saver=False,
            env=env,
            extra_args=flags,
        )
        return factory()

    return launch, model


async def soak_real(
    *,
    urls: Sequence[str] = (),
    launch: Callable[[], LaunchedSGLangEngine] | None = None,
    servers: int = 2,
    model: str,
    requests: int,
    cycles: int,
    legs: int = 2,
    death_every: int = 0,
    seed: int = 0,
    knobs: Knobs | None = None,
    startup_timeout_s: float = 900.0,
) -> TrafficReport:
    """The soak over real SGLang servers: attached (``urls``; every leg gets fresh clients) or
    launched here (``launch``, e.g. from ``cpu_sglang_launch()``: ``servers`` of them, started
    once and used by every leg; deaths need these). ``model`` is the path each weight update
    reloads (``FromDisk``). Sized for a CPU by default: 2 servers, requests of 4-16 tokens, 16
    in flight."""
    if death_every and launch is None:
        raise ValueError("deaths need servers this soak launches (launch=...)")
    fleet = RealFleet(urls=urls, launch=launch, count=servers if launch else 0, model=model)
    knobs = knobs or Knobs(
        concurrency=16,
        tokens=(4, 16),
        trainer_step_s=0.2,
        min_decode_s=0.2,
        call_timeout_s=900.0,
    )
    soak = Soak(
        fleet, Sizes(requests, cycles, legs, len(urls) or servers, death_every, seed), knobs
    )
    try:
        began = time.perf_counter()
        try:
            await fleet.start(startup_timeout_s)
        except Exception as exc:
            soak.report.errors.append(f"servers did not start: {type(exc).__name__}: {exc}")
            soak.report.unsent = requests
            return soak.report
        started = time.perf_counter() - began
        report = await soak.run()
        if launch is not None:
            report.notes.append(f"servers started in {started:.1f}s (not in wall_s)")
        return report
    finally:
        await fleet.close()


__all__ = [
    "LEG_MODES",
    "Fleet",
    "Knobs",
    "RayFleet",
    "RealFleet",
    "SimFleet",
    "Sizes",
    "Soak",
    "SoakStalled",
    "Traffic",
    "TrafficReport",
    "bounded",
    "cpu_sglang_launch",
    "rss_mb",
    "run_soak_in_process",
    "soak_in_process",
    "soak_on_ray",
    "soak_real",
    "timeline_histories",
]
