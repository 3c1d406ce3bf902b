"""One generate request across its attempts: the request sent each time, the answers joined.

A ``GenerationClient`` resubmits a request that was aborted or lost as the prompt plus
everything produced so far; ``Request`` keeps what each attempt produced and composes the one
answer the caller gets (output, counters, finish reason and weight-version spans over the whole
output, as SGLang 0.5.23 would have reported them for a request never interrupted).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from rollout_lifecycle.contract.exceptions import EngineError, InvalidArgument, LifecycleError
from rollout_lifecycle.contract.values import short_repr

#: The keys of a prompt: a request has exactly one.
PROMPT_KEYS = ("input_ids", "text")
#: The largest token id and ``max_new_tokens`` a request may give: the largest int32. No
#: vocabulary or context length comes near it (SGLang 0.5.23 itself takes ``1 << 30`` for "no
#: limit" in ``Scheduler.init_req_max_new_tokens`` and caps every request at the model's context
#: length), so a larger int is a mistake, refused before anything is sent rather than handed to
#: the engine's parsing and tensors.
MAX_REQUEST_INT = 2**31 - 1


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
class Request:
    """One caller's generate request across all its attempts: what was asked, what every
    attempt produced, and the answer they make together."""

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

    @classmethod
    def prepare(cls, request: object, group: str | None) -> Request:
        """Validate ``request`` and copy it (the caller may reuse its dict)."""
        if not isinstance(request, dict):
            raise InvalidArgument(f"a generate request must be a dict, got {short(request)}")
        given = [k for k in PROMPT_KEYS if request.get(k) is not None]
        if len(given) != 1:
            raise InvalidArgument(
                "a generate request needs exactly one of 'input_ids' (a list of token ids) or "
                f"'text' (a string), got {given or 'neither'}"
            )
        prompt_ids: list[int] | None = None
        prompt_text: str | None = None
        if given == ["input_ids"]:
            ids = request["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise InvalidArgument(
                    f"input_ids must be a non-empty list of token ids, got {short(ids)}"
                )
            bad = next(
                (
                    i
                    for i, t in enumerate(ids)
                    if isinstance(t, bool)
                    or not isinstance(t, int)
                    or not 0 <= t <= MAX_REQUEST_INT
                ),
                None,
            )
            if bad is not None:
                raise InvalidArgument(
                    f"input_ids must be token ids (ints in 0..{MAX_REQUEST_INT}): input_ids[{bad}] "
                    f"is {short(ids[bad])}"
                )
            prompt_ids = list(ids)
        else:
            text = request["text"]
            if not isinstance(text, str) or not text:
                raise InvalidArgument(f"text must be a non-empty string, got {short(text)}")
            prompt_text = text
        params = request.get("sampling_params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidArgument(f"sampling_params must be a dict, got {short(params)}")
        max_new = params.get("max_new_tokens")
        if max_new is not None and (
            isinstance(max_new, bool)
            or not isinstance(max_new, int)
            or not 1 <= max_new <= MAX_REQUEST_INT
        ):
            raise InvalidArgument(
                f"sampling_params.max_new_tokens must be a positive int of at most "
                f"{MAX_REQUEST_INT}, got {short(max_new)}"
            )
        if request.get("stream") not in (None, False):
            raise InvalidArgument(
                f"stream must be false: generate() returns one complete answer, got "
                f"{short(request.get('stream'))}"
            )
        rid = request.get("rid")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise InvalidArgument(f"rid must be a non-empty string, got {rid!r}")
        return cls(
            request=copy.deepcopy(request),
            group=group,
            prompt_ids=prompt_ids,
            prompt_text=prompt_text,
            params=copy.deepcopy(params),
            max_new=max_new,
            rid=rid,
        )

    def budget_used(self) -> bool:
        return self.max_new is not None and self.produced >= self.max_new

    def whole_finish(self, finish: dict[str, Any]) -> dict[str, Any]:
        """The finish_reason of the whole answer, from that of its last attempt.

        A length finish says how long the answer is: SGLang 0.5.23 ``Req.update_finish_state``
        reports ``FINISH_LENGTH(length=max_new_tokens)`` when the output reached its budget, so
        one request's ``length`` is its number of output tokens. After a resubmission the last
        attempt's ``length`` is only its reduced budget: the answer's is every token produced.
        A resumable abort that lands once the whole budget was produced is a length finish too.
        Any other finish (stop, a refusing abort) is the last attempt's, unchanged.
        """
        if resumable_abort(finish) or (finish.get("type") == "length" and self.resubmissions):
            return {"type": "length", "length": self.produced}
        return finish

    def body(self) -> dict[str, Any]:
        """The request to send now: the prompt plus everything produced so far."""
        body = {k: v for k, v in self.request.items() if k not in (*PROMPT_KEYS, "rid")}
        if self.prompt_ids is not None:
            body["input_ids"] = self.prompt_ids + self.output_ids
        else:
            body["text"] = (self.prompt_text or "") + self.text
        if self.produced:
            params = dict(self.params)
            if self.max_new is not None:
                params["max_new_tokens"] = self.max_new - self.produced
            low = params.get("min_new_tokens")
            if isinstance(low, int) and not isinstance(low, bool):
                params["min_new_tokens"] = max(0, low - self.produced)
            body["sampling_params"] = params
        body["rid"] = self.next_rid()
        return body

    def next_rid(self) -> str:
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
        attempt = len(self.engines)
        if self.rid is None:
            return uuid.uuid4().hex
        return self.rid if attempt == 0 else f"{self.rid}-resubmit-{attempt}"

    def absorb(self, engine: str, answer: object) -> dict[str, Any]:
        """Add one attempt's answer to the work; return its finish_reason."""

        def garbage(what: str) -> EngineError:
            return EngineError(engine, "generate", f"unusable answer: {what}")

        if not isinstance(answer, Mapping):
            raise garbage(f"expected a JSON object, got {type(answer).__name__}")
        meta = answer.get("meta_info")
        if not isinstance(meta, Mapping):
            raise garbage(f"meta_info is {short(meta)}")
        finish = meta.get("finish_reason")
        if not isinstance(finish, Mapping) or not isinstance(finish.get("type"), str):
            raise garbage(f"finish_reason is {short(finish)}")
        ids = answer.get("output_ids")
        text = answer.get("text", "")
        if self.prompt_ids is not None and not (
            isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        ):
            raise garbage(f"output_ids is {short(ids)}")
        if not isinstance(text, str) or (self.prompt_text is not None and "text" not in answer):
            raise garbage(f"text is {short(text)}")
        offset = self.produced
        if isinstance(ids, list):
            count = len(ids)
            self.output_ids.extend(ids)
        else:
            tokens = meta.get("completion_tokens")
            count = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0
        self.produced += count
        self.text += text
        for key in _SUMMED_COUNTERS:
            value = meta.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                self.counters[key] = self.counters.get(key, 0) + value
        if not self.last_meta:
            # The first answer's prompt is the caller's: attempts before it produced nothing.
            self.prompt_meta = {k: meta[k] for k in _PROMPT_FIELDS if k in meta}
        _join_spans(self, meta.get("weight_versions"), offset, count)
        self.last_meta = dict(meta)
        return dict(finish)

    def compose(self, finish: dict[str, Any] | None, why: str = "") -> dict[str, Any]:
        """The caller's answer, joined over the attempts (see the class docstring).

        ``finish`` None: the partial answer of a request given up for ``why``; its
        finish_reason is an abort with that message.
        """
        meta = dict(self.last_meta)
        meta["finish_reason"] = finish if finish is not None else {"type": "abort", "message": why}
        meta["num_resubmissions"] = self.resubmissions
        meta["engines"] = list(self.engines)
        meta.update(self.prompt_meta)
        meta.update(self.counters)
        meta["num_retractions"] = self.counters.get("num_retractions", 0)
        if "completion_tokens" in meta:
            meta["completion_tokens"] = self.produced
        meta.pop("weight_versions", None)
        spans = self.spans
        if spans:
            meta["weight_versions"] = [_copy_span(s) for s in spans]
            # As add_weight_versions_to_meta_info: weight_version names the last span's.
            meta["weight_version"] = spans[-1]["version"]
        elif spans is not None and self.produced == 0 and self.span_version is not None:
            # No output at all: SGLang's compute_weight_version_spans gives one empty span.
            meta["weight_versions"] = [WeightVersionSpan(version=self.span_version, start=0, end=0)]
            meta["weight_version"] = self.span_version
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def resumable_abort(finish: Mapping[str, Any]) -> bool:
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


def _join_spans(work: Request, raw: object, offset: int, count: int) -> None:
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


def short(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message."""
    return short_repr(value, limit)


__all__ = [
    "PROMPT_KEYS",
    "GenerationError",
    "GenerationTimeout",
    "NoLiveEngine",
    "Request",
    "TooManyResubmissions",
    "WeightVersionSpan",
    "resumable_abort",
    "short",
]
