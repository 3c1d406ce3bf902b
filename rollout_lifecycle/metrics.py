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
over every call, counted as the server's events come (on its loop). ``failed`` requests are
those the generation client gave up on (lost to the caller, who got an error),
``resubmissions`` those it sent again after an abort or a dead engine.

The gauges and the request counters are read at each scrape, whatever changed them (a phase, a
``probe()``, an ``adopt()``, a straggler's late answer), and read on the server's own loop: the
scrape (the endpoint's thread) hands the read to the loop and waits for it up to
``SCRAPE_WAIT`` seconds, so each server's gauges are one consistent picture, never records
mid-change; a loop that does not answer in time is reported with its last reading. A server no
longer watched keeps its counters and histograms as they were; its gauges are no longer reported.
A subscriber that fails logs ``metrics.failed`` and never reaches the lifecycle call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.core.bus import CallEnded, WeightsVerified
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
#: How long a scrape waits for a server's loop to read its gauges, in seconds.
SCRAPE_WAIT = 2.0
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
        reg = self.registry

        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(name, text, ["server", *labels], namespace=NAMESPACE, registry=reg)

        def histogram(name: str, text: str, *labels: str) -> Histogram:
            return Histogram(
                name, text, ["server", *labels], namespace=NAMESPACE, registry=reg, buckets=BUCKETS
            )

        self._calls = histogram(
            "call_seconds", "Public lifecycle calls, from taking the lock to their end",
            "call", "outcome",
        )  # fmt: skip
        self._claimed = counter(
            "claim_conflicts", "Calls refused because another controller held one of their engines",
            "call",
        )  # fmt: skip
        self._phases = histogram(
            "phase_seconds", "Phases, from the first engine call to the barrier", "phase"
        )
        self._engine_calls = counter(
            "engine_calls", "Engine calls of the phases, by how each ended", "phase", "outcome"
        )
        self._retries = counter(
            "flush_retries", "Flush attempts beyond the first (the engine was not idle yet)",
            "phase",
        )  # fmt: skip
        self._verified = counter(
            "weights_verified", "Engines whose weights a verified write checked"
        )
        self._unverified = counter(
            "verification_failures", "Engines that failed a verified write (left stale)"
        )
        self._now = _Now(self._servers)
        self.registry.register(self._now)

    def watch(self, server: RolloutServer) -> Callable[[], None]:
        """Follow ``server`` from now on; returns what stops following it (its counters and
        histograms stay as they were). ``InvalidArgument`` for a second server of the same
        name."""
        name = server.name
        if name in self._servers:
            raise InvalidArgument(
                f"a server named {name!r} is watched already: give each server its own name"
            )
        self._servers[name] = server
        bus = server.bus
        with_loop = self._now.follows(name)
        removers = [
            bus.subscribe(PhaseSettled, with_loop(lambda e: self._phase(name, e))),
            bus.subscribe(CallEnded, with_loop(lambda e: self._call(name, e))),
            bus.subscribe(WeightsVerified, with_loop(lambda e: self._verification(name, e))),
        ]

        def stop() -> None:
            for remove in removers:
                remove()
            if self._servers.get(name) is server:
                del self._servers[name]
                self._now.forget(name)

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

    def _call(self, server: str, ended: CallEnded) -> None:
        if ended.outcome == "claimed":
            self._claimed.labels(server, ended.call).inc()
        else:
            self._calls.labels(server, ended.call, ended.outcome).observe(ended.seconds)

    def _verification(self, server: str, verified: WeightsVerified) -> None:
        self._verified.labels(server).inc(verified.checked)
        self._unverified.labels(server).inc(len(verified.failed))


@dataclass(frozen=True)
class _Reading:
    """What a scrape reports of one server now (read on its loop)."""

    state: ServerState
    engines: dict[str, int]
    stale: int
    requests: dict[str, int] | None


def _read(server: RolloutServer) -> _Reading:
    return _Reading(
        server.state,
        {state.value: n for state, n in server.fleet.by_state().items()},
        sum(1 for r in server.fleet.records() if r.stale),
        server.generation.stats() if server.has_generation else None,
    )


async def _read_on_loop(server: RolloutServer) -> _Reading:
    return _read(server)


class _Now(Collector):
    """The gauges and the request counters, read at each scrape on each server's own loop (the
    loop its events last came from)."""

    def __init__(self, servers: dict[str, RolloutServer]) -> None:
        self._servers = servers
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
        self._loops.pop(name, None)
        self._last.pop(name, None)

    def collect(self) -> Iterable[Metric]:
        state = GaugeMetricFamily(
            f"{NAMESPACE}_server_state", "The server's state: 1 for the state it is in",
            labels=["server", "state"],
        )  # fmt: skip
        engines = GaugeMetricFamily(
            f"{NAMESPACE}_engines", "Engines by the state their records imply",
            labels=["server", "state"],
        )  # fmt: skip
        stale = GaugeMetricFamily(
            f"{NAMESPACE}_stale_engines",
            "Engines whose weights are not the expected version (or unverified)",
            labels=["server"],
        )
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
        for name, server in list(self._servers.items()):
            seen = self._reading(name, server)
            if seen is None:
                continue
            for each in ServerState:
                state.add_metric([name, each.value], 1 if each is seen.state else 0)
            for value, n in seen.engines.items():
                engines.add_metric([name, value], n)
            stale.add_metric([name], seen.stale)
            if seen.requests is None:
                continue
            for outcome in ("submitted", "completed", "failed"):
                requests.add_metric([name, outcome], seen.requests[outcome])
            for key, counter in counters.items():
                counter.add_metric([name], seen.requests[key])
            in_flight.add_metric([name], seen.requests["in_flight"])
            holding.add_metric([name], seen.requests["holding"])
        yield from (state, engines, stale, requests, *counters.values(), in_flight, holding)

    def _reading(self, name: str, server: RolloutServer) -> _Reading | None:
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


__all__ = ["BUCKETS", "NAMESPACE", "SCRAPE_WAIT", "PrometheusMetrics"]
