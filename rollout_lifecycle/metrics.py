"""The lifecycle's metrics for Prometheus: what a fleet's operator scrapes beside SGLang's,
vLLM's, sglang-router's and Ray's own.

``PrometheusMetrics`` watches one or more ``RolloutServer`` objects (``watch``) through their
event bus (``core.bus``) and keeps its metrics in a ``prometheus_client`` registry of its own
(or the one given); ``serve()`` turns on an HTTP endpoint for Prometheus to scrape, ``text()``
renders what it would answer. Every metric has a ``server`` label (the server's name):

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
over every call; ``failed`` requests are those the generation client gave up on (lost to the
caller, who got an error), ``resubmissions`` those it sent again after an abort or a dead engine.
The gauges of states are set on the server's loop at each phase, state change and call end, so a
scrape (from the endpoint's own thread) reads a consistent picture, never the records mid-change.
The request counters are the generation client's ``stats()`` at the scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.core.bus import CallEnded, StateEntered, WeightsVerified
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
#: The generation client's counters, as exported: its ``stats()`` key, the metric's name
#: (without the namespace and ``_total``) and its help.
_REQUEST_COUNTERS = (
    ("resubmissions", "request_resubmissions", "Requests sent again after an abort or lost engine"),
    ("engine_deaths", "request_engine_deaths", "Request attempts lost to a dead engine"),
    ("retractions", "request_retractions", "Retractions of requests by their engines"),
)  # fmt: skip


class PrometheusMetrics:
    """The lifecycle metrics of the servers it watches (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._servers: dict[str, RolloutServer] = {}
        self._stop_serving: Callable[[], None] | None = None
        ns, reg = NAMESPACE, self.registry
        self._calls = Histogram(
            "call_seconds", "Public lifecycle calls, from taking the lock to their end",
            ["server", "call", "outcome"], namespace=ns, registry=reg, buckets=BUCKETS,
        )  # fmt: skip
        self._claimed = Counter(
            "claim_conflicts", "Calls refused because another controller held one of their engines",
            ["server", "call"], namespace=ns, registry=reg,
        )  # fmt: skip
        self._phases = Histogram(
            "phase_seconds", "Phases, from the first engine call to the barrier",
            ["server", "phase"], namespace=ns, registry=reg, buckets=BUCKETS,
        )  # fmt: skip
        self._engine_calls = Counter(
            "engine_calls", "Engine calls of the phases, by how each ended",
            ["server", "phase", "outcome"], namespace=ns, registry=reg,
        )  # fmt: skip
        self._retries = Counter(
            "flush_retries", "Flush attempts beyond the first (the engine was not idle yet)",
            ["server", "phase"], namespace=ns, registry=reg,
        )  # fmt: skip
        self._verified = Counter(
            "weights_verified", "Engines whose weights a verified write checked",
            ["server"], namespace=ns, registry=reg,
        )  # fmt: skip
        self._unverified = Counter(
            "verification_failures", "Engines that failed a verified write (left stale)",
            ["server"], namespace=ns, registry=reg,
        )  # fmt: skip
        self._state = Gauge(
            "server_state", "The server's state: 1 for the state it is in, 0 for the others",
            ["server", "state"], namespace=ns, registry=reg,
        )  # fmt: skip
        self._engines = Gauge(
            "engines", "Engines by the state their records imply",
            ["server", "state"], namespace=ns, registry=reg,
        )  # fmt: skip
        self._stale = Gauge(
            "stale_engines", "Engines whose weights are not the expected version (or unverified)",
            ["server"], namespace=ns, registry=reg,
        )  # fmt: skip
        self.registry.register(_Requests(self._servers))

    def watch(self, server: RolloutServer) -> Callable[[], None]:
        """Follow ``server`` from now on; returns what stops following it (its series stay, as
        they were). ``InvalidArgument`` for a second server of the same name."""
        name = server.name
        if name in self._servers:
            raise InvalidArgument(
                f"a server named {name!r} is watched already: give each server its own name"
            )
        self._servers[name] = server
        bus = server.bus
        removers = [
            bus.subscribe(PhaseSettled, lambda e: self._phase(name, e)),
            bus.subscribe(StateEntered, lambda e: self._look(server)),
            bus.subscribe(CallEnded, lambda e: self._call(server, e)),
            bus.subscribe(WeightsVerified, lambda e: self._verification(name, e)),
        ]
        self._look(server)

        def stop() -> None:
            for remove in removers:
                remove()
            if self._servers.get(name) is server:
                del self._servers[name]

        return stop

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

    # -- the server's events (on its loop) -------------------------------------------------------

    def _phase(self, server: str, settled: PhaseSettled) -> None:
        result = settled.result
        phase = Phase(result.phase).metric
        self._phases.labels(server, phase).observe(result.seconds)
        counts: dict[Outcome, int] = {}
        for each in result.outcomes.values():
            counts[each.outcome] = counts.get(each.outcome, 0) + 1
        for outcome, n in counts.items():
            self._engine_calls.labels(server, phase, outcome.value).inc(n)
        if result.retries:
            self._retries.labels(server, phase).inc(result.retries)

    def _call(self, server: RolloutServer, ended: CallEnded) -> None:
        if ended.outcome == "claimed":
            self._claimed.labels(server.name, ended.call).inc()
        else:
            self._calls.labels(server.name, ended.call, ended.outcome).observe(ended.seconds)
        self._look(server)

    def _verification(self, server: str, verified: WeightsVerified) -> None:
        self._verified.labels(server).inc(verified.checked)
        self._unverified.labels(server).inc(len(verified.failed))

    def _look(self, server: RolloutServer) -> None:
        """Set the server's state gauges from what it is now."""
        name, now = server.name, server.state
        for state in ServerState:
            self._state.labels(name, state.value).set(1 if state is now else 0)
        for engines, n in server.fleet.by_state().items():
            self._engines.labels(name, engines.value).set(n)
        self._stale.labels(name).set(sum(1 for r in server.fleet.records() if r.stale))


class _Requests(Collector):
    """The generation clients' counters, read at each scrape (fixed keys of plain ints: a copy
    from the endpoint's thread is consistent enough)."""

    def __init__(self, servers: dict[str, RolloutServer]) -> None:
        self._servers = servers

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            f"{NAMESPACE}_requests", "Generate requests, by outcome", labels=["server", "outcome"]
        )
        counters = {
            key: CounterMetricFamily(f"{NAMESPACE}_{name}", text, labels=["server"])
            for key, name, text in _REQUEST_COUNTERS
        }
        in_flight = GaugeMetricFamily(
            f"{NAMESPACE}_requests_in_flight", "Generate requests accepted, not finished",
            labels=["server"],
        )  # fmt: skip
        holding = GaugeMetricFamily(
            f"{NAMESPACE}_requests_holding", "Generate requests waiting for a serving engine",
            labels=["server"],
        )  # fmt: skip
        for name, stats in self._stats():
            for outcome in ("submitted", "completed", "failed"):
                requests.add_metric([name, outcome], stats[outcome])
            for key, counter in counters.items():
                counter.add_metric([name], stats[key])
            in_flight.add_metric([name], stats["in_flight"])
            holding.add_metric([name], stats["holding"])
        yield requests
        yield from counters.values()
        yield in_flight
        yield holding

    def _stats(self) -> Iterator[tuple[str, dict[str, int]]]:
        for name, server in list(self._servers.items()):
            if server.has_generation:
                yield name, server.generation.stats()


__all__ = ["BUCKETS", "NAMESPACE", "PrometheusMetrics"]
