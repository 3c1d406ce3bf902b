"""``GenerationClient``: generate through a ``RolloutServer``, routed to serving engines only.

Requests wait while their engines are paused; aborted or lost work is resubmitted as one answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout_lifecycle.contract import seam
from rollout_lifecycle.contract.commands import Abort, Generate
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.contract.values import check_int, check_seconds
from rollout_lifecycle.core.bus import StateEntered
from rollout_lifecycle.core.ledger import Fleet
from rollout_lifecycle.core.requests import (
    GenerationError,
    GenerationTimeout,
    NoLiveEngine,
    Request,
    TooManyResubmissions,
    resumable_abort,
    short,
)
from rollout_lifecycle.core.routing import Router, ServerView
from rollout_lifecycle.core.runner import PhaseSettled
from rollout_lifecycle.core.states import ServerState

S = ServerState

#: Prompt keys of a request; everything else in it is passed through unchanged.
#: The most resubmissions ``max_resubmissions`` may allow.
MAX_RESUBMISSIONS = 1_000_000
#: Outcomes after which an attempt's work is lost but the request can run elsewhere.
_LOST = frozenset({Outcome.DEAD, Outcome.UNREACHABLE})


class GenerationClient:
    """Sends generate requests to a ``RolloutServer``'s engines, only while they serve.

    * **Routing**: to an engine whose record serves (``EngineRecord.serves``: alive, known to
      be unpaused, no released or uncertain memory, not stale) and that this client did not see
      die, in ``group`` if one is named (else in any group); the one with the fewest requests
      outstanding from this client, ties by order.
    * **Holding**: while the server is not ``serving``, a request for a group that needs
      offload waits (groups with ``needs_offload=False`` keep serving during an offload, so
      their requests only wait while their own engines are paused, e.g. around a weight update);
      in ``failed`` every request waits. The wait is woken by the server's events on every
      state entered and every phase settled (``core/bus``; re-checked at each wake, and every
      ``recheck_interval`` seconds for changes no event reports) and bounded by
      ``hold_timeout``: then ``GenerationTimeout``. A request none of whose engines is alive
      (every engine of its group, or of every group, is recorded dead or was seen dying by
      this client) is not held: it fails at once with ``NoLiveEngine``, and so does a held
      request, or one whose attempt was lost, once its last engine dies.
    * **Resubmission**: an answer with finish_reason ``abort`` (a pause in ``abort`` mode, or any
      other abort that is not a 4xx refusal of the request itself) and an attempt lost to a dead
      or unreachable engine are resubmitted, once the group serves again, as prompt + partial
      output (``text`` + partial text for text prompts) with ``max_new_tokens`` (and
      ``min_new_tokens``) reduced by the tokens already produced, at most ``max_resubmissions``
      times, each attempt under its own request id (``rid``; see ``Request.next_rid``).
    * **One answer**: ``output_ids`` and ``text`` joined over the attempts, and a ``meta_info``
      that describes the whole answer:

      - ``finish_reason``: the last attempt's, except that a ``length`` finish after a
        resubmission (or an abort that landed once the whole budget was produced) reads
        ``{"type": "length", "length": <tokens produced in all>}``; never ``abort`` for an
        answer completed by a later attempt;
      - ``weight_versions``: SGLang's ``{"version", "start", "end"}`` spans over the output
        tokens, each attempt's shifted by the tokens before it; adjacent spans of the same
        version are joined (as SGLang does within one request), and ``weight_version`` is the
        last span's. Omitted when an attempt that produced tokens gave no usable spans;
      - summed over attempts: ``num_retractions``, ``reasoning_tokens``, ``spec_verify_ct``
        (each attempt counts its own output) and ``completion_tokens`` (tokens produced);
      - the first answer's ``prompt_tokens``, ``cached_tokens``, ``cached_tokens_details``
        (later attempts' prompts include the partial output);
      - added: ``num_resubmissions`` and ``engines`` (the engine of each attempt, in order; the
        last one finished it);
      - every other field (``id``, timings, logprobs, ...) is the last attempt's.
    * **Abandoned attempts**: an attempt the client stops waiting for (``request_timeout``, or
      the caller cancelled) is aborted at its engine by its exact request id.
      The ``partial`` answer of a request given up has finish_reason ``{"type": "abort",
      "message": <why>}``.

    Without ``max_new_tokens`` in the request, a resubmission asks for the engine's default
    budget again: give it to resume exactly. ``request_timeout`` bounds a whole ``generate``
    call, holds and attempts included.
    """

    #: Seconds between re-checks of a held request when no hook fires.
    recheck_interval: float = 0.05

    def __init__(
        self,
        server: ServerView,
        *,
        hold_timeout: float = 600.0,
        request_timeout: float = 3600.0,
        max_resubmissions: int = 100,
    ) -> None:
        if not isinstance(getattr(server, "fleet", None), Fleet):
            raise InvalidArgument(f"server must be a RolloutServer, got {server!r}")
        self._hold_timeout = check_seconds("hold_timeout", hold_timeout)
        self._request_timeout = check_seconds("request_timeout", request_timeout)
        self._max_resubmissions = check_int(
            "max_resubmissions", max_resubmissions, maximum=MAX_RESUBMISSIONS
        )
        self._server = server
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "submitted",
                "completed",
                "failed",
                "resubmissions",
                "engine_deaths",
                "retractions",
                "held",
            ),
            0,
        )
        self._router = Router(
            server,
            self._counts,
            self._hold_timeout,
            self._request_timeout,
            lambda: self.recheck_interval,
        )
        #: Aborts of abandoned attempts still being sent (kept referenced until they finish).
        self._aborts: set[asyncio.Future[Any]] = set()
        self._closed = False
        # Every state, and the end of every phase (a group paused around a weight update is
        # continued inside a phase, with no state change): held requests look again.
        self._removers: list[Callable[[], None]] = [
            server.bus.subscribe(StateEntered, self._wake),
            server.bus.subscribe(PhaseSettled, self._wake),
        ]

    def __repr__(self) -> str:
        return f"GenerationClient({self._server.name!r}, stats={self.stats()})"

    # -- public -------------------------------------------------------------------------------

    @property
    def server(self) -> ServerView:
        """The server whose engines this client uses."""
        return self._server

    async def generate(
        self, request: dict[str, Any], *, group: str | None = None
    ) -> dict[str, Any]:
        """Run one generate request to its full answer (see the class docstring).

        Raises ``InvalidArgument`` before anything is sent for a bad request or an unknown
        group; ``NoLiveEngine`` at once when every engine that could serve it is dead;
        ``GenerationTimeout``, ``TooManyResubmissions``, or the engine's own error (for
        example ``EngineRejected``) when the request cannot be completed.
        """
        self._check_open()
        work = Request.prepare(request, self._check_group(group))
        return await self._generate(work)

    async def generate_batch(
        self, requests: Sequence[dict[str, Any]], *, group: str | None = None
    ) -> list[dict[str, Any]]:
        """Run every request concurrently; answers in request order.

        Every request is validated before any is sent. If one fails, the others are cancelled
        and its error is raised.
        """
        self._check_open()
        if isinstance(requests, str | bytes | Mapping) or not isinstance(requests, Sequence):
            raise InvalidArgument(f"requests must be a list of dicts, got {short(requests)}")
        name = self._check_group(group)
        works = []
        for index, request in enumerate(requests):
            try:
                works.append(Request.prepare(request, name))
            except InvalidArgument as exc:
                raise InvalidArgument(f"request #{index}: {exc}") from None
        if not works:
            return []
        tasks = [asyncio.ensure_future(self._generate(w)) for w in works]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            await _cancel_all(tasks)
            raise
        if pending:
            await _cancel_all(tasks)
        for task in tasks:  # the first failure in request order
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise error
        return [t.result() for t in tasks]

    def outstanding(self) -> dict[str, int]:
        """Requests of this client at each engine now, for every engine of the server."""
        return {
            r.id: self._router.outstanding.get(r.id, 0)
            for g in self._server.groups
            for r in g.records
        }

    def stats(self) -> dict[str, int]:
        """Counters: requests ``submitted`` (accepted), ``completed``, ``failed`` (raised or
        cancelled), ``resubmissions`` (after an abort or a lost engine), ``engine_deaths``
        (attempts lost to a dead engine), ``retractions`` (summed over attempts), ``held``
        (times a request or resubmission waited for a serving engine), and now: ``holding``
        (waiting), ``in_flight`` (accepted, not finished)."""
        counts = dict(self._counts)
        counts["holding"] = self._router.holding
        counts["in_flight"] = counts["submitted"] - counts["completed"] - counts["failed"]
        return counts

    def close(self) -> None:
        """Remove this client's hooks and refuse new requests; idempotent.

        Requests already accepted run on: their waits re-check every ``recheck_interval``.
        """
        if self._closed:
            return
        self._closed = True
        for remove in self._removers:
            remove()
        self._removers.clear()
        self._router.notify()

    # -- validation ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationError("the GenerationClient is closed")

    def _check_group(self, group: str | None) -> str | None:
        if group is None:
            return None
        names = [g.name for g in self._server.groups]
        if not isinstance(group, str) or group not in names:
            raise InvalidArgument(
                f"unknown group {group!r}; groups of server {self._server.name!r}: "
                f"{', '.join(repr(n) for n in names)}"
            )
        return group

    # -- one request --------------------------------------------------------------------------

    async def _generate(self, work: Request) -> dict[str, Any]:
        self._counts["submitted"] += 1
        try:
            result = await self._run(work)
        except BaseException:
            self._counts["failed"] += 1
            raise
        self._counts["completed"] += 1
        return result

    async def _run(self, work: Request) -> dict[str, Any]:
        # Deadlines on the loop's clock, the one its waits time out on.
        deadline = asyncio.get_running_loop().time() + self._request_timeout
        while True:
            record = await self._router.acquire(work, deadline)
            engine, handle, incarnation = record.id, record.handle, record.incarnation
            body = work.body()
            work.engines.append(engine)
            self._router.outstanding[engine] = self._router.outstanding.get(engine, 0) + 1
            try:
                answer = await self._call(work, handle, body, deadline)
            except GenerationError:
                raise
            except Exception as exc:
                outcome = seam.classify(exc)
                if outcome.outcome not in _LOST:
                    inner = seam.unwrap(exc)  # the engine's own error, not Ray's wrapping of it
                    if inner is exc:
                        raise
                    raise inner from exc
                if outcome.outcome is Outcome.DEAD:
                    self._router.saw_die(engine, handle, incarnation)
                    self._counts["engine_deaths"] += 1
                work.avoid.add(engine)
                self._resubmit(work, body["rid"], f"engine {engine} was lost ({outcome})")
                continue
            finally:
                self._router.outstanding[engine] -= 1
            retractions = work.counters.get("num_retractions", 0)
            finish = work.absorb(engine, answer)
            self._counts["retractions"] += work.counters.get("num_retractions", 0) - retractions
            if resumable_abort(finish) and not work.budget_used():
                self._resubmit(
                    work, body["rid"], f"aborted on engine {engine}: {finish.get('message')}"
                )
                continue
            return work.compose(work.whole_finish(finish))

    def _resubmit(self, work: Request, attempt: str, why: str) -> None:
        """Count one more attempt of ``work`` (its last was the request id ``attempt``), or give
        up past ``max_resubmissions``."""
        if work.resubmissions >= self._max_resubmissions:
            message = (
                f"generate request gave up after {work.resubmissions} resubmission(s) "
                f"(max_resubmissions={self._max_resubmissions}); last: {why}; "
                f"{work.produced} token(s) produced so far are in .partial"
            )
            raise TooManyResubmissions(message, work.compose(None, message))
        work.resubmissions += 1
        self._counts["resubmissions"] += 1
        logger().info(
            "generate.resubmit",
            server=self._server.name,
            rid=work.rid,
            attempt=attempt,
            resubmission=work.resubmissions,
            engines=list(work.engines),
            why=why,
        )

    async def _call(
        self, work: Request, handle: Any, body: dict[str, Any], deadline: float
    ) -> dict[str, Any]:
        ref = seam.command(handle, Generate(body))
        future: asyncio.Future[Any] = asyncio.ensure_future(ref)
        try:
            done, _ = await asyncio.wait(
                {future}, timeout=max(0.0, deadline - asyncio.get_running_loop().time())
            )
        except asyncio.CancelledError:
            self._abort_attempt(handle, body["rid"])
            seam.cancel(ref, future)
            raise
        if not done:
            self._abort_attempt(handle, body["rid"])
            seam.cancel(ref, future)
            message = (
                f"generate request ran longer than request_timeout={self._request_timeout:g}s "
                f"(last attempt on {work.engines[-1]}, server {self._server.state.value!r}); "
                f"{work.produced} token(s) produced so far are in .partial"
            )
            raise GenerationTimeout(
                message,
                self._server.state.value,
                "request_timeout",
                self._request_timeout,
                work.compose(None, message),
            )
        answer: dict[str, Any] = future.result()
        return answer

    def _abort_attempt(self, handle: Any, rid: str) -> None:
        """Ask the engine to abort the attempt ``rid`` that nobody waits for; do not wait.

        By the exact id the attempt was sent with (see ``Request.next_rid``): SGLang 0.5.23
        ``TokenizerManager.abort_request`` ignores an rid that is not a live request's id. The
        cancelled call alone may not stop the work: over HTTP SGLang notices a closed
        connection only at its next poll (``TokenizerManager._stream_one_response``), and a
        cancel may not reach an engine actor at all. Best effort: an engine that is gone, or
        has finished the attempt, has nothing to abort.
        """
        try:
            sent: asyncio.Future[Any] = asyncio.ensure_future(seam.command(handle, Abort(rid)))
        except Exception:  # a handle that cannot take the call: nothing more to do
            return
        self._aborts.add(sent)
        sent.add_done_callback(self._abort_sent)

    def _abort_sent(self, sent: asyncio.Future[Any]) -> None:
        self._aborts.discard(sent)
        if not sent.cancelled():
            sent.exception()  # retrieved: a failed best-effort abort is not an error

    def _wake(self, event: object) -> None:
        """On every state entered and phase settled: wake held requests to look again."""
        self._router.notify()


async def _cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)


__all__ = [
    "GenerationClient",
    "GenerationError",
    "GenerationTimeout",
    "NoLiveEngine",
    "TooManyResubmissions",
]
