"""The lifecycle's metrics where a fleet's operator looks: an endpoint Prometheus scrapes beside
SGLang's, vLLM's and sglang-router's (``PrometheusMetrics``), and, on a Ray cluster, Ray's own
metrics pipeline (``RayMetrics``), which the cluster's Prometheus and dashboard read.

Both follow one or more ``RolloutServer`` objects (``watch``) through their event bus
(``core.bus``) and export the same metrics, one table (``FAMILIES``). Every metric has a
``server`` label (the server's name):

========================================================  =========  ============================
metric                                                    type       labels
========================================================  =========  ============================
``rollout_lifecycle_call_seconds``                        histogram  call, outcome (ok, error,
                                                                     cancelled)
``rollout_lifecycle_claim_conflicts_total``               counter    call (refused: another
                                                                     controller held an engine)
``rollout_lifecycle_phase_seconds``                       histogram  phase (the name in the
                                                                     ``metrics`` keys)
``rollout_lifecycle_engine_calls_total``                  counter    phase, outcome (``Outcome``)
``rollout_lifecycle_flush_retries_total``                 counter    phase
``rollout_lifecycle_weights_verified_total``              counter    (engines checked)
``rollout_lifecycle_verification_failures_total``         counter    (engines that failed)
``rollout_lifecycle_server_state``                        gauge      state (1 for the current)
``rollout_lifecycle_engines``                             gauge      state (``EngineState``)
``rollout_lifecycle_stale_engines``                       gauge      (weights not the expected
                                                                     version, whatever their
                                                                     memory state)
``rollout_lifecycle_requests_total``                      counter    outcome (submitted,
                                                                     completed, failed)
``rollout_lifecycle_request_resubmissions_total``         counter
``rollout_lifecycle_request_engine_deaths_total``         counter
``rollout_lifecycle_request_retractions_total``           counter
``rollout_lifecycle_requests_in_flight``                  gauge
``rollout_lifecycle_requests_holding``                    gauge
========================================================  =========  ============================

The phase and call metrics are the ones the server's ``metrics`` dict holds per call, summed
over every call, counted as the server's events come (on its loop). ``failed`` requests are
those the generation client gave up on (lost to the caller, who got an error),
``resubmissions`` those it sent again after an abort or a dead engine.

The gauges and the request counters are *readings*: taken from the server, whatever changed
them (a phase, a ``probe()``, an ``adopt()``, a straggler's late answer), and taken on the
server's own loop: a reader on another thread hands the read to the loop and waits for it up
to ``SCRAPE_WAIT`` seconds, so each server's readings are one consistent picture, never records
mid-change; a loop that does not answer in time is reported with its last reading. A server no
longer watched keeps its counters and histograms as they were. A subscriber that fails logs
``metrics.failed`` and never reaches the lifecycle call.

``PrometheusMetrics`` keeps its metrics in a ``prometheus_client`` registry of its own (or the
one given) and takes the readings at each scrape; ``serve()`` turns on the HTTP endpoint,
``text()`` renders what it would answer. A server no longer watched is no longer reported in
its gauges.

``RayMetrics`` records through ``ray.util.metrics`` in the process that drives the servers (a
Ray driver or actor). Ray's core worker hands the records to its node's metrics agent every
``metrics_report_interval_ms`` (10 s by default), and the agent answers Prometheus at the
node's ``metrics_export_port`` with Ray's prefix: ``ray_rollout_lifecycle_phase_seconds_bucket``
and so on, with Ray's own labels (``NodeAddress``, ``SessionName``, ``WorkerId``...) beside the
table's. The agent comes with ``ray[default]`` (the ``ray-metrics`` extra); a minimal Ray
records and exports nothing. Readings are taken every ``every`` seconds (a thread) and at the
end of each call; Ray keeps a series until the process ends, so a server no longer watched
keeps its last readings there. A counter that never moved is not exported by Ray (it cannot be
incremented by 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.contract.values import check_seconds
from rollout_lifecycle.core.bus import CallEnded, WeightsVerified
from rollout_lifecycle.core.ledger import EngineState
from rollout_lifecycle.core.runner import PhaseSettled
from rollout_lifecycle.core.states import Phase, ServerState

if TYPE_CHECKING:
    from rollout_lifecycle.core.server import RolloutServer

#: The prefix of every metric's name.
NAMESPACE = "rollout_lifecycle"
#: Histogram buckets, in seconds: a phase of an idle simulated engine (~1 ms) up to a weight
#: push or a slow reload of a large model (minutes).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
           60.0, 120.0, 300.0, float("inf"))  # fmt: skip
#: How long a reader on another thread waits for a server's loop to read it, in seconds.
SCRAPE_WAIT = 2.0


@dataclass(frozen=True)
class Family:
    """One metric: its name after the namespace (a counter's without ``_total``), its type, its
    help and its labels besides ``server``."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    text: str
    labels: tuple[str, ...] = ()


# -- counted from the servers' events -------------------------------------------------------------
CALLS = Family(
    "call_seconds", "histogram", "Public lifecycle calls, from taking the lock to their end",
    ("call", "outcome"),
)  # fmt: skip
CLAIM_CONFLICTS = Family(
    "claim_conflicts", "counter",
    "Calls refused because another controller held one of their engines", ("call",),
)  # fmt: skip
PHASES = Family(
    "phase_seconds", "histogram", "Phases, from the first engine call to the barrier", ("phase",)
)
ENGINE_CALLS = Family(
    "engine_calls", "counter", "Engine calls of the phases, by how each ended",
    ("phase", "outcome"),
)  # fmt: skip
FLUSH_RETRIES = Family(
    "flush_retries", "counter", "Flush attempts beyond the first (the engine was not idle yet)",
    ("phase",),
)  # fmt: skip
VERIFIED = Family("weights_verified", "counter", "Engines whose weights a verified write checked")
UNVERIFIED = Family(
    "verification_failures", "counter", "Engines that failed a verified write (left stale)"
)
# -- read from the servers ------------------------------------------------------------------------
SERVER_STATE = Family(
    "server_state", "gauge", "The server's state: 1 for the state it is in", ("state",)
)
ENGINES = Family("engines", "gauge", "Engines by the state their records imply", ("state",))
STALE = Family(
    "stale_engines", "gauge", "Engines whose weights are not the expected version (or unverified)"
)
REQUESTS = Family("requests", "counter", "Generate requests, by outcome", ("outcome",))
RESUBMISSIONS = Family(
    "request_resubmissions", "counter", "Requests sent again after an abort or lost engine"
)
ENGINE_DEATHS = Family("request_engine_deaths", "counter", "Request attempts lost to a dead engine")
RETRACTIONS = Family("request_retractions", "counter", "Retractions of requests by their engines")
IN_FLIGHT = Family("requests_in_flight", "gauge", "Generate requests accepted, not finished")
HOLDING = Family("requests_holding", "gauge", "Generate requests waiting for a serving engine")

#: Every metric, those counted from events first.
FAMILIES = (CALLS, CLAIM_CONFLICTS, PHASES, ENGINE_CALLS, FLUSH_RETRIES, VERIFIED, UNVERIFIED,
            SERVER_STATE, ENGINES, STALE, REQUESTS, RESUBMISSIONS, ENGINE_DEATHS, RETRACTIONS,
            IN_FLIGHT, HOLDING)  # fmt: skip
#: Those counted from the servers' events, and those read from the servers.
EVENTS, READ = FAMILIES[: FAMILIES.index(SERVER_STATE)], FAMILIES[FAMILIES.index(SERVER_STATE) :]
#: The generation client's ``stats()`` keys behind the read families.
_STATS = ((RESUBMISSIONS, "resubmissions"), (ENGINE_DEATHS, "engine_deaths"),
          (RETRACTIONS, "retractions"), (IN_FLIGHT, "in_flight"), (HOLDING, "holding"))  # fmt: skip
_REQUEST_OUTCOMES = ("submitted", "completed", "failed")

#: A value of one series: its family, its label values (the server's name first), the value.
Sample = tuple[Family, tuple[str, ...], float]


@dataclass(frozen=True)
class _Reading:
    """What a server says of itself now (read on its loop)."""

    state: ServerState
    engines: dict[str, int]
    stale: int
    requests: dict[str, int] | None

    def samples(self, server: str) -> Iterator[Sample]:
        """The read families' values: every state (0 for those not held), so a series that
        dropped to 0 says so."""
        for state in ServerState:
            yield SERVER_STATE, (server, state.value), 1.0 if state is self.state else 0.0
        for each in EngineState:
            yield ENGINES, (server, each.value), float(self.engines.get(each.value, 0))
        yield STALE, (server,), float(self.stale)
        if self.requests is None:
            return
        for outcome in _REQUEST_OUTCOMES:
            yield REQUESTS, (server, outcome), float(self.requests[outcome])
        for family, key in _STATS:
            yield family, (server,), float(self.requests[key])


def _read(server: RolloutServer) -> _Reading:
    return _Reading(
        server.state,
        {state.value: n for state, n in server.fleet.by_state().items()},
        sum(1 for r in server.fleet.records() if r.stale),
        server.generation.stats() if server.has_generation else None,
    )


async def _read_on_loop(server: RolloutServer) -> _Reading:
    return _read(server)


class _Readings:
    """The servers watched, each read on its own loop (the loop its events last came from),
    with its last reading for a loop that does not answer."""

    def __init__(self) -> None:
        self.servers: dict[str, RolloutServer] = {}
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._last: dict[str, _Reading] = {}

    def follows(self, name: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
        """Wrap a subscriber of server ``name``'s bus: note the loop it runs on, and keep what
        it raises from the lifecycle (logged)."""
        with_loop = self._loops

        def wrap(subscriber: Callable[[Any], None]) -> Callable[[Any], None]:
            def run(event: Any) -> None:
                try:
                    with_loop[name] = asyncio.get_running_loop()
                    subscriber(event)
                except Exception as exc:
                    logger().warning("metrics.failed", server=name, seen=repr(event), error=exc)

            return run

        with contextlib.suppress(RuntimeError):  # (watched from a coroutine: its loop)
            self._loops[name] = asyncio.get_running_loop()
        return wrap

    def forget(self, name: str) -> None:
        self.servers.pop(name, None)
        self._loops.pop(name, None)
        self._last.pop(name, None)

    def samples(self) -> Iterator[Sample]:
        """Every watched server's read families, now."""
        for name, server in list(self.servers.items()):
            seen = self.read(name, server)
            if seen is not None:
                yield from seen.samples(name)

    def read(self, name: str, server: RolloutServer) -> _Reading | None:
        """``server`` read on its loop (directly when that is this thread's, or no loop runs
        it); its last reading when its loop does not answer within ``SCRAPE_WAIT``."""
        loop = self._loops.get(name)
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or loop is here or loop.is_closed() or not loop.is_running():
            seen = _read(server)
        else:
            try:
                done = asyncio.run_coroutine_threadsafe(_read_on_loop(server), loop)
            except RuntimeError:  # (closed meanwhile)
                return self._last.get(name)
            try:
                seen = done.result(timeout=SCRAPE_WAIT)
            except TimeoutError:  # (busy: the read is not wanted any more)
                done.cancel()
                return self._last.get(name)
        self._last[name] = seen
        return seen


class _Exporter:
    """What both exporters share: following servers' events into the event families (by
    ``_add`` and ``_observe``, each exporter's own), and the readings."""

    def __init__(self) -> None:
        self._readings = _Readings()

    def watch(self, server: RolloutServer) -> Callable[[], None]:
        """Follow ``server`` from now on; returns what stops following it (its counters and
        histograms stay as they were). ``InvalidArgument`` for a second server of the same
        name."""
        name = server.name
        servers = self._readings.servers
        if name in servers:
            raise InvalidArgument(
                f"a server named {name!r} is watched already: give each server its own name"
            )
        servers[name] = server
        bus = server.bus
        with_loop = self._readings.follows(name)
        removers = [
            bus.subscribe(PhaseSettled, with_loop(lambda e: self._phase(name, e))),
            bus.subscribe(CallEnded, with_loop(lambda e: self._call(name, server, e))),
            bus.subscribe(WeightsVerified, with_loop(lambda e: self._verification(name, e))),
        ]

        def stop() -> None:
            for remove in removers:
                remove()
            if servers.get(name) is server:
                self._readings.forget(name)

        return stop

    def _add(self, family: Family, labels: tuple[str, ...], n: float) -> None:
        raise NotImplementedError

    def _observe(self, family: Family, labels: tuple[str, ...], seconds: float) -> None:
        raise NotImplementedError

    # -- the server's events (on its loop) -------------------------------------------------------

    def _phase(self, server: str, settled: PhaseSettled) -> None:
        result = settled.result
        phase = Phase(result.phase).metric
        self._observe(PHASES, (server, phase), result.seconds)
        counts: dict[Outcome, int] = {}
        for each in result.outcomes.values():
            counts[each.outcome] = counts.get(each.outcome, 0) + 1
        for outcome, n in counts.items():
            self._add(ENGINE_CALLS, (server, phase, outcome.value), n)
        if result.retries:
            self._add(FLUSH_RETRIES, (server, phase), result.retries)

    def _call(self, name: str, server: RolloutServer, ended: CallEnded) -> None:
        if ended.outcome == "claimed":
            self._add(CLAIM_CONFLICTS, (name, ended.call), 1)
        else:
            self._observe(CALLS, (name, ended.call, ended.outcome), ended.seconds)

    def _verification(self, server: str, verified: WeightsVerified) -> None:
        self._add(VERIFIED, (server,), verified.checked)
        self._add(UNVERIFIED, (server,), len(verified.failed))


class PrometheusMetrics(_Exporter):
    """The lifecycle metrics of the servers it watches on an endpoint Prometheus scrapes (see
    the module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__()
        self.registry = registry if registry is not None else CollectorRegistry()
        self._stop_serving: Callable[[], None] | None = None
        self._kept: dict[Family, Counter | Histogram] = {}
        for family in EVENTS:
            labels = ["server", *family.labels]
            if family.kind == "histogram":
                self._kept[family] = Histogram(
                    family.name, family.text, labels, namespace=NAMESPACE, registry=self.registry,
                    buckets=BUCKETS,
                )  # fmt: skip
            else:
                self._kept[family] = Counter(
                    family.name, family.text, labels, namespace=NAMESPACE, registry=self.registry
                )
        self.registry.register(_Scrape(self._readings))

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Answer Prometheus at ``http://addr:port/metrics`` (a daemon thread) until ``close``;
        the port (``port=0``: a free one). Loopback unless ``addr`` says otherwise."""
        if self._stop_serving is not None:
            raise InvalidArgument("the metrics endpoint is served already: close() it first")
        httpd, thread = start_http_server(port, addr=addr, registry=self.registry)

        def stop() -> None:
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=10)

        self._stop_serving = stop
        return int(httpd.server_port)

    def close(self) -> None:
        """Stop the endpoint, if served (idempotent)."""
        stop, self._stop_serving = self._stop_serving, None
        if stop is not None:
            stop()

    def text(self) -> str:
        """What the endpoint answers now (Prometheus's text format)."""
        return generate_latest(self.registry).decode()

    def _add(self, family: Family, labels: tuple[str, ...], n: float) -> None:
        counter = self._kept[family]
        assert isinstance(counter, Counter)
        counter.labels(*labels).inc(n)

    def _observe(self, family: Family, labels: tuple[str, ...], seconds: float) -> None:
        histogram = self._kept[family]
        assert isinstance(histogram, Histogram)
        histogram.labels(*labels).observe(seconds)


class _Scrape(Collector):
    """The read families, read at each scrape."""

    def __init__(self, readings: _Readings) -> None:
        self._readings = readings

    def collect(self) -> Iterable[Metric]:
        made: dict[Family, CounterMetricFamily | GaugeMetricFamily] = {}
        for family in READ:
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            made[family] = kind(
                f"{NAMESPACE}_{family.name}", family.text, labels=["server", *family.labels]
            )
        for family, labels, value in self._readings.samples():
            made[family].add_metric(list(labels), value)
        yield from made.values()


class RayMetrics(_Exporter):
    """The lifecycle metrics of the servers it watches, recorded through ``ray.util.metrics``
    for the cluster's Prometheus and dashboard (see the module docstring). Made in a process
    connected to Ray; readings every ``every`` seconds until ``close()``."""

    def __init__(self, every: float = 5.0) -> None:
        import ray
        from ray.util import metrics

        self.every = check_seconds("every", every)
        if not ray.is_initialized():
            raise InvalidArgument(
                "RayMetrics records through Ray: connect this process to Ray (ray.init) first"
            )
        super().__init__()
        self._kept: dict[Family, Any] = {}
        for family in FAMILIES:
            name, keys = f"{NAMESPACE}_{family.name}", ("server", *family.labels)
            if family.kind == "histogram":
                self._kept[family] = metrics.Histogram(
                    name, family.text, boundaries=list(BUCKETS[:-1]), tag_keys=keys
                )
            elif family.kind == "counter":
                self._kept[family] = metrics.Counter(name, family.text, tag_keys=keys)
            else:
                self._kept[family] = metrics.Gauge(name, family.text, tag_keys=keys)
        self._totals: dict[tuple[Family, tuple[str, ...]], float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._every, name="ray-metrics", daemon=True)
        self._thread.start()

    def report(self) -> None:
        """Take every server's readings now and record them (the thread does so every
        ``every`` seconds, each call's end for its server)."""
        self._record(self._readings.samples())

    def close(self) -> None:
        """Stop the readings' thread (idempotent); what is recorded stays recorded."""
        self._closed.set()
        self._thread.join(timeout=SCRAPE_WAIT + self.every)

    def _every(self) -> None:
        while not self._closed.wait(self.every):
            try:
                self.report()
            except Exception as exc:  # (the next one tries again)
                logger().warning("metrics.failed", seen="report", error=exc)

    def _record(self, samples: Iterable[Sample]) -> None:
        """Record readings: a gauge is set; a counter read as a running total moves by what it
        grew since its last reading (a total that fell, a new client under the name, is taken
        as the new start)."""
        with self._lock:
            for family, labels, value in samples:
                if family.kind == "gauge":
                    self._kept[family].set(value, tags=self._tags(family, labels))
                    continue
                last = self._totals.get((family, labels), 0.0)
                self._totals[family, labels] = value
                self._add(family, labels, value - last)

    def _call(self, name: str, server: RolloutServer, ended: CallEnded) -> None:
        super()._call(name, server, ended)
        self._record(_read(server).samples(name))

    def _add(self, family: Family, labels: tuple[str, ...], n: float) -> None:
        if n > 0:  # (Ray refuses to move a counter by 0)
            self._kept[family].inc(n, tags=self._tags(family, labels))

    def _observe(self, family: Family, labels: tuple[str, ...], seconds: float) -> None:
        self._kept[family].observe(seconds, tags=self._tags(family, labels))

    @staticmethod
    def _tags(family: Family, labels: tuple[str, ...]) -> dict[str, str]:
        return dict(zip(("server", *family.labels), labels, strict=True))


__all__ = [
    "BUCKETS", "FAMILIES", "NAMESPACE", "SCRAPE_WAIT", "Family", "PrometheusMetrics",
    "RayMetrics",
]  # fmt: skip
