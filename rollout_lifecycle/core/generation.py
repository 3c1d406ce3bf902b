"""``GenerationClient``: generate through a ``RolloutServer``, routed to serving engines only.

Requests wait while their engines are paused; aborted or lost work is resubmitted as one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from rollout_lifecycle.core.config import check_int, check_seconds
from rollout_lifecycle.core.exceptions import (
    EngineError,
    InvalidArgument,
    LifecycleError,
)
from rollout_lifecycle.core.group import EngineGroup, EngineRecord, send_to_engine
from rollout_lifecycle.core.outcome import Outcome, classify, unwrap
from rollout_lifecycle.core.states import ServerState

if TYPE_CHECKING:
    from rollout_lifecycle.core.server import LifecycleEvent, RolloutServer

S = ServerState

#: Prompt keys of a request; everything else in it is passed through unchanged.
_PROMPT_KEYS = ("input_ids", "text")
#: The most resubmissions ``max_resubmissions`` may allow.
MAX_RESUBMISSIONS = 1_000_000
#: Outcomes after which an attempt's work is lost but the request can run elsewhere.
_LOST = frozenset({Outcome.DEAD, Outcome.UNREACHABLE})


class GenerationError(LifecycleError):
    """A generate request could not be completed.

    ``partial`` holds the answer so far (``text``, ``output_ids``, ``meta_info``) when some work
    was done, so that a caller can still keep it.
    """

    def __init__(self, message: str, partial: dict[str, Any] | None = None) -> None:
        self._init: tuple[Any, ...] = (message, partial)
        self.message = message
        self.partial = partial
        super().__init__(message)


class GenerationTimeout(GenerationError):
    """A request waited longer than ``hold_timeout`` for a serving engine, or ran longer than
    ``request_timeout`` in all; ``state`` is the server's state when it gave up."""

    def __init__(
        self,
        message: str,
        state: str,
        limit: str,
        waited: float,
        partial: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, partial)
        self._init = (message, state, limit, waited, partial)
        self.state = state
        #: ``"hold_timeout"`` or ``"request_timeout"``.
        self.limit = limit
        self.waited = waited


class NoLiveEngine(GenerationError):
    """Every engine that could serve a request (those of its ``group``, or of every group when
    none is named) is dead: nothing can answer it, so it fails at once instead of being held.

    Raised for a new request and for one held or resubmitted when its last engine dies; a
    ``recover()`` that replaces the dead engines lets later requests through. ``state`` is the
    server's state when the request gave up, ``group`` the group it named (or None).
    """

    def __init__(
        self,
        message: str,
        state: str,
        group: str | None,
        partial: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, partial)
        self._init = (message, state, group, partial)
        self.state = state
        self.group = group


class TooManyResubmissions(GenerationError):
    """A request was aborted or lost more than ``max_resubmissions`` times."""


class WeightVersionSpan(TypedDict):
    """One entry of ``meta_info["weight_versions"]``: output tokens ``[start, end)`` were
    generated with weights ``version`` (SGLang 0.5.23 ``srt/utils/weight_versions.py``:
    ``WeightVersionSpan``, put in the answer by ``add_weight_versions_to_meta_info``)."""

    version: str
    start: int
    end: int


#: Output-side counters of ``meta_info`` that each attempt counts for its own output only; the
#: answer reports their sum over attempts. (``completion_tokens`` is the tokens produced in all.)
_SUMMED_COUNTERS = ("num_retractions", "reasoning_tokens", "spec_verify_ct")
#: Prompt-side fields: they describe the caller's prompt, so the first attempt's are kept (a
#: resubmission's prompt is the caller's prompt plus the partial output, the client's doing).
_PROMPT_FIELDS = ("prompt_tokens", "cached_tokens", "cached_tokens_details")


@dataclass(eq=False)
class _Work:
    """One caller's request across all its attempts."""

    request: dict[str, Any]
    group: str | None
    prompt_ids: list[int] | None
    prompt_text: str | None
    params: dict[str, Any]
    max_new: int | None
    rid: str | None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    produced: int = 0
    resubmissions: int = 0
    engines: list[str] = field(default_factory=list)
    #: Engines where an attempt of this request was lost; others are preferred.
    avoid: set[str] = field(default_factory=set)
    #: Prompt-side fields of the first attempt that answered (see ``_PROMPT_FIELDS``).
    prompt_meta: dict[str, Any] = field(default_factory=dict)
    #: Sums of ``_SUMMED_COUNTERS`` over the attempts that reported them.
    counters: dict[str, int] = field(default_factory=dict)
    #: Weight-version spans over the joined output; None once an attempt that produced tokens
    #: carried none (or malformed ones): the answer then cannot say which weights made them.
    spans: list[WeightVersionSpan] | None = field(default_factory=list)
    #: The version of the last (possibly empty) span seen, for an answer with no tokens at all.
    span_version: str | None = None
    #: The ``meta_info`` of the last attempt that answered.
    last_meta: dict[str, Any] = field(default_factory=dict)


class GenerationClient:
    """Sends generate requests to a ``RolloutServer``'s engines, only while they serve.

    * **Routing**: to an engine that is alive, not paused, holds no released (or uncertain)
      memory and was not seen dying by this client, in ``group`` if one is named (else in any
      group); the one with the fewest requests outstanding from this client, ties by order.
    * **Holding**: while the server is not ``serving``, a request for a group that needs
      offload waits (groups with ``needs_offload=False`` keep serving during an offload, so
      their requests only wait while their own engines are paused, e.g. around a weight update);
      in ``failed`` every request waits. The wait is woken by hooks on every state and on the
      end of every phase (re-checked at each wake, and every ``recheck_interval`` seconds for
      changes no hook reports, such as a replaced engine) and bounded by ``hold_timeout``: then
      ``GenerationTimeout``. A request none of whose engines is alive (every engine of its
      group, or of every group, is recorded dead or was seen dying by this client) is not
      held: it fails at once with ``NoLiveEngine``, and so does a held request, or one whose
      attempt was lost, once its last engine dies.
    * **Resubmission**: an answer with finish_reason ``abort`` (a pause in ``abort`` mode, or any
      other abort that is not a 4xx refusal of the request itself) and an attempt lost to a dead
      or unreachable engine are resubmitted, once the group serves again, as prompt + partial
      output (``text`` + partial text for text prompts) with ``max_new_tokens`` (and
      ``min_new_tokens``) reduced by the tokens already produced, at most ``max_resubmissions``
      times, each attempt under its own request id (``rid``; see ``_attempt_rid``).
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
        server: RolloutServer,
        *,
        hold_timeout: float = 600.0,
        request_timeout: float = 3600.0,
        max_resubmissions: int = 100,
    ) -> None:
        # Imported here: _server may import this module.
        from rollout_lifecycle.core.server import HOOK_EVENTS, RolloutServer

        if not isinstance(server, RolloutServer):
            raise InvalidArgument(f"server must be a RolloutServer, got {server!r}")
        self._hold_timeout = check_seconds("hold_timeout", hold_timeout)
        self._request_timeout = check_seconds("request_timeout", request_timeout)
        self._max_resubmissions = check_int(
            "max_resubmissions", max_resubmissions, maximum=MAX_RESUBMISSIONS
        )
        self._server = server
        self._outstanding: dict[str, int] = {}
        #: Engine id -> the handle this client saw die in that slot (a replacement is not dead).
        self._dead: dict[str, Any] = {}
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
        self._holding = 0
        #: Aborts of abandoned attempts still being sent (kept referenced until they finish).
        self._aborts: set[asyncio.Future[Any]] = set()
        self._wake: asyncio.Event | None = None
        self._wake_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # Every state, and the end of every phase (a group paused around a weight update is
        # continued inside the phase, with no state change).
        states = {s.value for s in ServerState}
        self._removers: list[Callable[[], None]] = [
            server.on(event, self._on_state)
            for event in HOOK_EVENTS
            if event in states or event.startswith("after_")
        ]

    def __repr__(self) -> str:
        return f"GenerationClient({self._server.name!r}, stats={self.stats()})"

    # -- public -------------------------------------------------------------------------------

    @property
    def server(self) -> RolloutServer:
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
        work = self._prepare(request, self._check_group(group))
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
            raise InvalidArgument(f"requests must be a list of dicts, got {_short(requests)}")
        name = self._check_group(group)
        works = []
        for index, request in enumerate(requests):
            try:
                works.append(self._prepare(request, name))
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
            r.id: self._outstanding.get(r.id, 0) for g in self._server.groups for r in g.records
        }

    def stats(self) -> dict[str, int]:
        """Counters: requests ``submitted`` (accepted), ``completed``, ``failed`` (raised or
        cancelled), ``resubmissions`` (after an abort or a lost engine), ``engine_deaths``
        (attempts lost to a dead engine), ``retractions`` (summed over attempts), ``held``
        (times a request or resubmission waited for a serving engine), and now: ``holding``
        (waiting), ``in_flight`` (accepted, not finished)."""
        counts = dict(self._counts)
        counts["holding"] = self._holding
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
        self._notify()

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

    def _prepare(self, request: object, group: str | None) -> _Work:
        """Validate ``request`` and copy it (the caller may reuse its dict)."""
        if not isinstance(request, dict):
            raise InvalidArgument(f"a generate request must be a dict, got {_short(request)}")
        given = [k for k in _PROMPT_KEYS if request.get(k) is not None]
        if len(given) != 1:
            raise InvalidArgument(
                "a generate request needs exactly one of 'input_ids' (a list of token ids) or "
                f"'text' (a string), got {given or 'neither'}"
            )
        prompt_ids: list[int] | None = None
        prompt_text: str | None = None
        if given == ["input_ids"]:
            ids = request["input_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise InvalidArgument(
                    f"input_ids must be a non-empty list of token ids (ints >= 0), got "
                    f"{_short(ids)}"
                )
            prompt_ids = list(ids)
        else:
            text = request["text"]
            if not isinstance(text, str) or not text:
                raise InvalidArgument(f"text must be a non-empty string, got {_short(text)}")
            prompt_text = text
        params = request.get("sampling_params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidArgument(f"sampling_params must be a dict, got {_short(params)}")
        max_new = params.get("max_new_tokens")
        if max_new is not None and (
            isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1
        ):
            raise InvalidArgument(
                f"sampling_params.max_new_tokens must be a positive int, got {max_new!r}"
            )
        if request.get("stream") not in (None, False):
            raise InvalidArgument(
                f"stream must be false: generate() returns one complete answer, got "
                f"{_short(request.get('stream'))}"
            )
        rid = request.get("rid")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise InvalidArgument(f"rid must be a non-empty string, got {rid!r}")
        return _Work(
            request=copy.deepcopy(request),
            group=group,
            prompt_ids=prompt_ids,
            prompt_text=prompt_text,
            params=copy.deepcopy(params),
            max_new=max_new,
            rid=rid,
        )

    # -- one request --------------------------------------------------------------------------

    async def _generate(self, work: _Work) -> dict[str, Any]:
        self._counts["submitted"] += 1
        try:
            result = await self._run(work)
        except BaseException:
            self._counts["failed"] += 1
            raise
        self._counts["completed"] += 1
        return result

    async def _run(self, work: _Work) -> dict[str, Any]:
        deadline = time.monotonic() + self._request_timeout
        while True:
            record = await self._acquire(work, deadline)
            engine, handle = record.id, record.handle
            body = self._attempt_body(work)
            work.engines.append(engine)
            self._outstanding[engine] = self._outstanding.get(engine, 0) + 1
            try:
                answer = await self._call(work, handle, body, deadline)
            except GenerationError:
                raise
            except Exception as exc:
                outcome = classify(exc)
                if outcome.outcome not in _LOST:
                    inner = unwrap(exc)  # the engine's own error, not Ray's wrapping of it
                    if inner is exc:
                        raise
                    raise inner from exc
                if outcome.outcome is Outcome.DEAD:
                    self._dead[engine] = handle
                    self._counts["engine_deaths"] += 1
                work.avoid.add(engine)
                self._resubmit(work, f"engine {engine} was lost ({outcome})")
                continue
            finally:
                self._outstanding[engine] -= 1
            finish = self._absorb(work, engine, answer)
            if _resumable_abort(finish) and not self._budget_used(work):
                self._resubmit(work, f"aborted on engine {engine}: {finish.get('message')}")
                continue
            return self._compose(work, self._whole_finish(work, finish))

    def _budget_used(self, work: _Work) -> bool:
        return work.max_new is not None and work.produced >= work.max_new

    def _whole_finish(self, work: _Work, finish: dict[str, Any]) -> dict[str, Any]:
        """The finish_reason of the whole answer, from that of its last attempt.

        A length finish says how long the answer is: SGLang 0.5.23 ``Req.update_finish_state``
        reports ``FINISH_LENGTH(length=max_new_tokens)`` when the output reached its budget, so
        one request's ``length`` is its number of output tokens. After a resubmission the last
        attempt's ``length`` is only its reduced budget: the answer's is every token produced.
        A resumable abort that lands once the whole budget was produced is a length finish too.
        Any other finish (stop, a refusing abort) is the last attempt's, unchanged.
        """
        if _resumable_abort(finish) or (finish.get("type") == "length" and work.resubmissions):
            return {"type": "length", "length": work.produced}
        return finish

    def _resubmit(self, work: _Work, why: str) -> None:
        if work.resubmissions >= self._max_resubmissions:
            message = (
                f"generate request gave up after {work.resubmissions} resubmission(s) "
                f"(max_resubmissions={self._max_resubmissions}); last: {why}; "
                f"{work.produced} token(s) produced so far are in .partial"
            )
            raise TooManyResubmissions(message, self._compose(work, None, message))
        work.resubmissions += 1
        self._counts["resubmissions"] += 1

    def _attempt_body(self, work: _Work) -> dict[str, Any]:
        """The request to send now: the prompt plus everything produced so far."""
        body = {k: v for k, v in work.request.items() if k not in (*_PROMPT_KEYS, "rid")}
        if work.prompt_ids is not None:
            body["input_ids"] = work.prompt_ids + work.output_ids
        else:
            body["text"] = (work.prompt_text or "") + work.text
        if work.produced:
            params = dict(work.params)
            if work.max_new is not None:
                params["max_new_tokens"] = work.max_new - work.produced
            low = params.get("min_new_tokens")
            if isinstance(low, int) and not isinstance(low, bool):
                params["min_new_tokens"] = max(0, low - work.produced)
            body["sampling_params"] = params
        body["rid"] = self._attempt_rid(work)
        return body

    def _attempt_rid(self, work: _Work) -> str:
        """The request id of the attempt about to be sent; the client aborts it by exactly this.

        Every attempt carries an id the client knows, because SGLang 0.5.23
        ``TokenizerManager.abort_request`` (one tokenizer worker, the default) acts only on an
        rid equal to a live request's id: a prefix, or the id of an earlier attempt, aborts
        nothing. Each attempt's id is new, so that an abort meant for one attempt never reaches
        another (and ``TokenizerManager`` refuses an rid that is still live). The caller's
        ``rid`` goes to the first attempt unchanged and, suffixed ``-resubmit-N``, to attempt
        N. Without one, each attempt gets a fresh ``uuid4().hex`` (SGLang's own default id):
        equal lengths, so none is a prefix of another, which matters because once the tokenizer
        lets an abort through, ``Scheduler.abort_request`` aborts every rid that *starts* with it.
        """
        attempt = len(work.engines)
        if work.rid is None:
            return uuid.uuid4().hex
        return work.rid if attempt == 0 else f"{work.rid}-resubmit-{attempt}"

    async def _call(
        self, work: _Work, handle: Any, body: dict[str, Any], deadline: float
    ) -> dict[str, Any]:
        ref = send_to_engine(handle, "generate", (body,))
        future: asyncio.Future[Any] = asyncio.ensure_future(ref)
        try:
            done, _ = await asyncio.wait({future}, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:
            self._abort_attempt(handle, body["rid"])
            _cancel_call(ref, future)
            raise
        if not done:
            self._abort_attempt(handle, body["rid"])
            _cancel_call(ref, future)
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
                self._compose(work, None, message),
            )
        answer: dict[str, Any] = future.result()
        return answer

    def _abort_attempt(self, handle: Any, rid: str) -> None:
        """Ask the engine to abort the attempt ``rid`` that nobody waits for; do not wait.

        By the exact id the attempt was sent with (see ``_attempt_rid``): SGLang 0.5.23
        ``TokenizerManager.abort_request`` ignores an rid that is not a live request's id. The
        cancelled call alone may not stop the work: over HTTP SGLang notices a closed
        connection only at its next poll (``TokenizerManager._stream_one_response``), and a
        cancel may not reach an engine actor at all. Best effort: an engine that is gone, or
        has finished the attempt, has nothing to abort.
        """
        try:
            sent: asyncio.Future[Any] = asyncio.ensure_future(
                send_to_engine(handle, "abort_request", (rid,))
            )
        except Exception:  # a handle that cannot take the call: nothing more to do
            return
        self._aborts.add(sent)
        sent.add_done_callback(self._abort_sent)

    def _abort_sent(self, sent: asyncio.Future[Any]) -> None:
        self._aborts.discard(sent)
        if not sent.cancelled():
            sent.exception()  # retrieved: a failed best-effort abort is not an error

    def _absorb(self, work: _Work, engine: str, answer: object) -> dict[str, Any]:
        """Add one attempt's answer to the work; return its finish_reason."""

        def garbage(what: str) -> EngineError:
            return EngineError(engine, "generate", f"unusable answer: {what}")

        if not isinstance(answer, Mapping):
            raise garbage(f"expected a JSON object, got {type(answer).__name__}")
        meta = answer.get("meta_info")
        if not isinstance(meta, Mapping):
            raise garbage(f"meta_info is {_short(meta)}")
        finish = meta.get("finish_reason")
        if not isinstance(finish, Mapping) or not isinstance(finish.get("type"), str):
            raise garbage(f"finish_reason is {_short(finish)}")
        ids = answer.get("output_ids")
        text = answer.get("text", "")
        if work.prompt_ids is not None and not (
            isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        ):
            raise garbage(f"output_ids is {_short(ids)}")
        if not isinstance(text, str) or (work.prompt_text is not None and "text" not in answer):
            raise garbage(f"text is {_short(text)}")
        offset = work.produced
        if isinstance(ids, list):
            count = len(ids)
            work.output_ids.extend(ids)
        else:
            tokens = meta.get("completion_tokens")
            count = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0
        work.produced += count
        work.text += text
        for key in _SUMMED_COUNTERS:
            value = meta.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                work.counters[key] = work.counters.get(key, 0) + value
                if key == "num_retractions":
                    self._counts["retractions"] += value
        if not work.last_meta:
            # The first answer's prompt is the caller's: attempts before it produced nothing.
            work.prompt_meta = {k: meta[k] for k in _PROMPT_FIELDS if k in meta}
        _join_spans(work, meta.get("weight_versions"), offset, count)
        work.last_meta = dict(meta)
        return dict(finish)

    def _compose(self, work: _Work, finish: dict[str, Any] | None, why: str = "") -> dict[str, Any]:
        """The caller's answer, joined over the attempts (see the class docstring).

        ``finish`` None: the partial answer of a request given up for ``why``; its
        finish_reason is an abort with that message.
        """
        meta = dict(work.last_meta)
        meta["finish_reason"] = finish if finish is not None else {"type": "abort", "message": why}
        meta["num_resubmissions"] = work.resubmissions
        meta["engines"] = list(work.engines)
        meta.update(work.prompt_meta)
        meta.update(work.counters)
        meta["num_retractions"] = work.counters.get("num_retractions", 0)
        if "completion_tokens" in meta:
            meta["completion_tokens"] = work.produced
        meta.pop("weight_versions", None)
        spans = work.spans
        if spans:
            meta["weight_versions"] = [_copy_span(s) for s in spans]
            # As add_weight_versions_to_meta_info: weight_version names the last span's.
            meta["weight_version"] = spans[-1]["version"]
        elif spans is not None and work.produced == 0 and work.span_version is not None:
            # No output at all: SGLang's compute_weight_version_spans gives one empty span.
            meta["weight_versions"] = [WeightVersionSpan(version=work.span_version, start=0, end=0)]
            meta["weight_version"] = work.span_version
        return {"text": work.text, "output_ids": list(work.output_ids), "meta_info": meta}

    # -- routing and holding ------------------------------------------------------------------

    def _group_may_serve(self, group: EngineGroup, state: ServerState) -> bool:
        if state is S.SERVING:
            return True
        if state is S.FAILED:
            return False
        return not group.needs_offload  # an offload leaves such groups serving

    def _engine_serves(self, record: EngineRecord) -> bool:
        return (
            record.alive
            and not record.paused
            and not record.released
            and not record.uncertain
            # A replacement without the fleet's versioned weights generates nothing for us.
            and not (record.stale and self._server.expected_version is not None)
            and self._dead.get(record.id) is not record.handle
        )

    def _pick(self, work: _Work) -> EngineRecord | None:
        state = self._server.state
        candidates = [
            r
            for g in self._server.groups
            if work.group in (None, g.name) and self._group_may_serve(g, state)
            for r in g.records
            if self._engine_serves(r)
        ]
        if not candidates:
            return None
        preferred = [r for r in candidates if r.id not in work.avoid] or candidates
        return min(preferred, key=lambda r: self._outstanding.get(r.id, 0))

    async def _acquire(self, work: _Work, deadline: float) -> EngineRecord:
        """A serving engine for ``work``; waits (holds) while there is none."""
        start = time.monotonic()
        held = False
        try:
            while True:
                wake = self._event()
                record = self._pick(work)
                if record is not None:
                    return record
                self._check_alive(work)
                now = time.monotonic()
                waited = now - start
                if now >= deadline:
                    limit, bound = "request_timeout", self._request_timeout
                elif waited >= self._hold_timeout:
                    limit, bound = "hold_timeout", self._hold_timeout
                else:
                    if not held:
                        held = True
                        self._holding += 1
                        self._counts["held"] += 1
                    pause = min(self._hold_timeout - waited, deadline - now, self.recheck_interval)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), pause)
                    continue
                state = self._server.state.value
                message = (
                    f"generate request held {waited:.3g}s ({limit}={bound:g}s) with no engine "
                    f"to serve it: {self._why_held(work)}"
                )
                raise GenerationTimeout(
                    message,
                    state,
                    limit,
                    waited,
                    self._compose(work, None, message) if work.engines else None,
                )
        finally:
            if held:
                self._holding -= 1

    def _engine_dead(self, record: EngineRecord) -> bool:
        """Dead for good: recorded dead by the server, or seen dying by this client (the same
        handle; a replacement in its slot is another engine)."""
        return not record.alive or self._dead.get(record.id) is record.handle

    def _check_alive(self, work: _Work) -> None:
        """Fail ``work`` at once when every engine that could ever serve it is dead."""
        records = [
            r for g in self._server.groups if work.group in (None, g.name) for r in g.records
        ]
        if not all(self._engine_dead(r) for r in records):
            return
        where = f"group {work.group!r}" if work.group is not None else "any group"
        dead = ", ".join(r.id for r in records) or "none"
        message = (
            f"no engine of {where} is alive to serve the generate request (dead: {dead}; "
            f"server {self._server.state.value!r})"
        )
        if work.engines:
            message += f"; {work.produced} token(s) produced so far are in .partial"
        raise NoLiveEngine(
            message,
            self._server.state.value,
            work.group,
            self._compose(work, None, message) if work.engines else None,
        )

    def _why_held(self, work: _Work) -> str:
        state = self._server.state
        groups = [g for g in self._server.groups if work.group in (None, g.name)]
        where = f"group {work.group!r}" if work.group is not None else "any group"
        if not any(self._group_may_serve(g, state) for g in groups):
            return f"the server is {state.value!r} ({where} does not serve in that state)"
        notes = []
        for g in groups:
            for r in g.records:
                if not r.alive:
                    notes.append(f"{r.id} dead")
                elif self._dead.get(r.id) is r.handle:
                    notes.append(f"{r.id} died under a request")
                elif r.paused:
                    notes.append(f"{r.id} paused")
                elif r.released or r.uncertain:
                    notes.append(f"{r.id} holds released memory")
                elif r.stale and self._server.expected_version is not None:
                    notes.append(f"{r.id} lacks weight version {self._server.expected_version!r}")
        return f"the server is {state.value!r} and no engine of {where} serves ({', '.join(notes)})"

    # -- wake-ups -----------------------------------------------------------------------------

    def _event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._wake is None or self._wake_loop is not loop:
            self._wake, self._wake_loop = asyncio.Event(), loop
        return self._wake

    def _notify(self) -> None:
        wake, self._wake = self._wake, None
        if wake is None:
            return
        try:
            same_loop = asyncio.get_running_loop() is self._wake_loop
        except RuntimeError:
            same_loop = False
        if same_loop:
            wake.set()  # waiters of another (finished) loop are gone; theirs is just dropped

    def _on_state(self, event: LifecycleEvent) -> None:
        """The hook on every state (and phase end): wake held requests to re-check; never raises."""
        self._notify()


def _resumable_abort(finish: Mapping[str, Any]) -> bool:
    """An abort that says nothing against the request itself (a 4xx status refuses it)."""
    if finish.get("type") != "abort":
        return False
    status = finish.get("status_code")
    return not (isinstance(status, int) and 400 <= status < 500)


def _parse_spans(raw: object, count: int) -> list[WeightVersionSpan] | None:
    """One attempt's ``meta_info["weight_versions"]`` over its ``count`` output tokens; None
    when absent or not spans (a list of strings, say, as older servers and simulators sent).

    SGLang 0.5.23 builds them in ``compute_weight_version_spans`` (scheduler: ordered,
    contiguous from 0, adjacent equal versions joined) and ``add_weight_versions_to_meta_info``
    (tokenizer: ends clipped to the output length). Here: ordered, non-overlapping, each
    ``0 <= start <= end``, clipped to ``count`` likewise.
    """
    if not isinstance(raw, list) or not raw:
        return None
    spans: list[WeightVersionSpan] = []
    floor = 0
    for item in raw:
        if not isinstance(item, Mapping):
            return None
        version, start, end = item.get("version"), item.get("start"), item.get("end")
        if not (
            isinstance(version, str)
            and isinstance(start, int)
            and isinstance(end, int)
            and not isinstance(start, bool)
            and not isinstance(end, bool)
            and floor <= start <= end
        ):
            return None
        floor = end
        spans.append(
            WeightVersionSpan(version=version, start=min(start, count), end=min(end, count))
        )
    return spans


def _join_spans(work: _Work, raw: object, offset: int, count: int) -> None:
    """Add an attempt's spans to ``work.spans``, shifted by the ``offset`` tokens before it.

    Empty spans cover nothing and are dropped. A span that continues the previous one with the
    same version is joined to it, as SGLang 0.5.23 ``compute_weight_version_spans`` does within
    one request: an answer resubmitted under unchanged weights reads as one span, exactly as if
    it had never been aborted. An attempt that produced tokens without usable spans makes the
    answer's spans unknown (None) for good: they would misattribute its tokens otherwise.
    """
    if work.spans is None:
        return
    spans = _parse_spans(raw, count)
    if spans is None:
        if count:
            work.spans = None
        return
    for span in spans:
        work.span_version = span["version"]
        start, end = offset + span["start"], offset + span["end"]
        if end <= start:
            continue
        last = work.spans[-1] if work.spans else None
        if last is not None and last["version"] == span["version"] and last["end"] == start:
            last["end"] = end
        else:
            work.spans.append(WeightVersionSpan(version=span["version"], start=start, end=end))


def _copy_span(span: WeightVersionSpan) -> WeightVersionSpan:
    return WeightVersionSpan(version=span["version"], start=span["start"], end=span["end"])


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cancel_call(ref: object, future: asyncio.Future[Any]) -> None:
    """Stop an engine call nobody waits for (in process: cancel it; over Ray: ask Ray)."""
    future.cancel()
    if ref is future:
        return
    try:
        import ray

        ray.cancel(ref)
    except Exception:  # best effort: the ref may be finished, or not a Ray ref at all
        return


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
