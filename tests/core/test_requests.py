"""One generate request across its attempts (``core/requests.Request``), without engines: the
copy taken of the caller's request, the body each attempt sends (prompt plus output so far,
the budget left, an id of its own), what an attempt's answer adds (and an unusable answer
refused without adding anything), and the one answer composed over every attempt.

The attempts' answers are written here as SGLang 0.5.23 shapes them; the generation client's
use of ``Request`` against simulated engines is in ``test_generation.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_lifecycle.contract.exceptions import EngineError
from rollout_lifecycle.core.requests import Request, resumable_abort


def answer(
    ids: list[int] | None,
    finish: dict[str, Any],
    text: str | None = None,
    **meta: Any,
) -> dict[str, Any]:
    """An attempt's answer: output ids (None: a text answer without them), its finish."""
    out: dict[str, Any] = {"meta_info": {"finish_reason": finish, **meta}}
    if ids is not None:
        out["output_ids"] = ids
    if text is not None:
        out["text"] = text
    return out


ABORT = {"type": "abort", "message": "aborted by pause_generation(mode=abort)"}


def test_prepare_keeps_its_own_copy_of_the_callers_request() -> None:
    params = {"max_new_tokens": 8, "stop": ["x"]}
    caller = {"input_ids": [1, 2], "sampling_params": params, "return_logprob": True}
    request = Request.prepare(caller, "actor")
    caller["input_ids"].append(3)
    params["max_new_tokens"] = 1
    params["stop"].append("y")
    assert request.prompt_ids == [1, 2] and request.max_new == 8
    assert request.params == {"max_new_tokens": 8, "stop": ["x"]}
    assert request.request["sampling_params"] == {"max_new_tokens": 8, "stop": ["x"]}
    assert (request.group, request.rid, request.prompt_text) == ("actor", None, None)


def test_the_first_body_is_the_callers_request_with_its_rid() -> None:
    caller = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 2},
        "rid": "r1",
        "return_logprob": True,
    }
    request = Request.prepare(caller, None)
    assert request.body() == caller


def test_a_resubmission_sends_prompt_plus_output_with_the_budget_left() -> None:
    caller = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 10, "min_new_tokens": 5, "temperature": 0.0},
        "rid": "r1",
        "return_logprob": True,
    }
    request = Request.prepare(caller, None)
    request.engines.append("actor/0")  # the client adds each engine an attempt went to
    request.absorb("actor/0", answer([7, 8, 9], ABORT))
    request.resubmissions = 1
    body = request.body()
    assert body["input_ids"] == [1, 2, 7, 8, 9]
    assert body["sampling_params"] == {"max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.0}
    assert body["rid"] == "r1-resubmit-1" and body["return_logprob"] is True
    request.engines.append("actor/1")
    request.absorb("actor/1", answer([10, 11, 12], ABORT))
    body = request.body()
    assert body["sampling_params"]["min_new_tokens"] == 0  # never below zero
    assert body["sampling_params"]["max_new_tokens"] == 4
    assert body["rid"] == "r1-resubmit-2"
    assert caller["sampling_params"]["max_new_tokens"] == 10  # the caller's dict is untouched


def test_without_a_callers_rid_each_attempt_gets_a_fresh_id_none_a_prefix_of_another() -> None:
    request = Request.prepare({"input_ids": [1]}, None)
    rids = []
    for attempt in range(4):
        rids.append(request.body()["rid"])
        request.engines.append(f"actor/{attempt}")
    assert len(set(rids)) == 4
    assert len({len(r) for r in rids}) == 1
    assert not any(a != b and b.startswith(a) for a in rids for b in rids)


@pytest.mark.parametrize(
    ("prompt", "bad", "names"),
    [
        ({"input_ids": [1]}, ["not", "a", "dict"], "expected a JSON object, got list"),
        ({"input_ids": [1]}, {"output_ids": [1]}, "meta_info is None"),
        ({"input_ids": [1]}, answer([1], {"reason": "stop"}), "finish_reason is"),
        ({"input_ids": [1]}, answer(["a"], {"type": "stop"}), "output_ids is ['a']"),
        ({"input_ids": [1]}, answer(None, {"type": "stop"}, text="x"), "output_ids is None"),
        ({"text": "hi"}, answer([1], {"type": "stop"}), "text is ''"),
        (
            {"text": "hi"},
            {"meta_info": {"finish_reason": {"type": "stop"}}, "text": 5},
            "text is 5",
        ),
    ],
)
def test_an_unusable_answer_is_refused_naming_the_engine_and_adds_nothing(
    prompt: dict[str, Any], bad: object, names: str
) -> None:
    request = Request.prepare(prompt, None)
    request.absorb("actor/0", answer([4, 5], ABORT, text="ab", completion_tokens=2))
    before = (list(request.output_ids), request.text, request.produced, dict(request.last_meta))
    with pytest.raises(EngineError) as err:
        request.absorb("actor/1", bad)
    assert err.value.engine == "actor/1" and err.value.op == "generate"
    assert names in str(err.value)
    after = (list(request.output_ids), request.text, request.produced, dict(request.last_meta))
    assert after == before


def test_the_answer_joins_every_attempt_as_one_uninterrupted_request_would_read() -> None:
    request = Request.prepare({"text": "hi", "sampling_params": {"max_new_tokens": 5}}, None)
    first = {"prompt_tokens": 2, "cached_tokens": 0, "num_retractions": 1, "reasoning_tokens": 1}
    request.engines.append("actor/0")
    request.absorb("actor/0", answer(None, ABORT, text="ab", completion_tokens=2, **first))
    request.resubmissions = 1
    later = {"prompt_tokens": 4, "cached_tokens": 4, "num_retractions": 2, "reasoning_tokens": 0}
    request.engines.append("actor/1")
    finish = request.absorb(
        "actor/1",
        answer(None, {"type": "length", "length": 3}, text="cde", completion_tokens=3, **later),
    )
    whole = request.compose(request.whole_finish(finish))
    assert whole["text"] == "abcde" and whole["output_ids"] == []
    meta = whole["meta_info"]
    assert meta["completion_tokens"] == 5  # counted from each text answer's completion_tokens
    assert (meta["prompt_tokens"], meta["cached_tokens"]) == (2, 0)  # the caller's prompt
    assert (meta["num_retractions"], meta["reasoning_tokens"]) == (3, 1)  # summed
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["num_resubmissions"], meta["engines"]) == (1, ["actor/0", "actor/1"])


def test_a_request_given_up_keeps_its_partial_output_with_an_abort_naming_why() -> None:
    request = Request.prepare({"input_ids": [1]}, None)
    request.engines.append("actor/0")
    request.absorb("actor/0", answer([5, 6], ABORT, completion_tokens=2))
    partial = request.compose(None, "no live engine")
    assert partial["output_ids"] == [5, 6]
    assert partial["meta_info"]["finish_reason"] == {"type": "abort", "message": "no live engine"}
    assert partial["meta_info"]["num_retractions"] == 0 and partial["meta_info"]["engines"] == [
        "actor/0"
    ]


@pytest.mark.parametrize(
    ("resubmissions", "produced", "last", "whole"),
    [
        (0, 4, {"type": "length", "length": 4}, {"type": "length", "length": 4}),
        (2, 9, {"type": "length", "length": 3}, {"type": "length", "length": 9}),
        (1, 6, {"type": "stop", "matched": 2}, {"type": "stop", "matched": 2}),
        (1, 6, ABORT, {"type": "length", "length": 6}),  # aborted once the budget was produced
        (
            1,
            6,
            {"type": "abort", "message": "bad", "status_code": 400},
            {"type": "abort", "message": "bad", "status_code": 400},
        ),
    ],
)
def test_the_finish_of_the_whole_answer(
    resubmissions: int, produced: int, last: dict[str, Any], whole: dict[str, Any]
) -> None:
    request = Request.prepare({"input_ids": [1]}, None)
    request.resubmissions, request.produced = resubmissions, produced
    assert request.whole_finish(last) == whole


def test_an_abort_is_resumable_unless_it_refuses_the_request() -> None:
    assert resumable_abort({"type": "abort"})
    assert resumable_abort({"type": "abort", "status_code": 503})
    assert resumable_abort({"type": "abort", "status_code": "400"})  # not a status it can read
    assert not resumable_abort({"type": "abort", "status_code": 400})
    assert not resumable_abort({"type": "abort", "status_code": 499})
    assert not resumable_abort({"type": "stop"})
    assert not resumable_abort({"type": "length", "length": 3})


def test_weight_version_spans_are_clipped_to_the_output_and_dropped_when_out_of_order() -> None:
    clipped = Request.prepare({"input_ids": [1]}, None)
    spans = [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 50}]
    clipped.absorb("actor/0", answer([5, 6, 7], {"type": "stop"}, weight_versions=spans))
    meta = clipped.compose({"type": "stop"})["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 1},
        {"version": "v2", "start": 1, "end": 3},
    ]
    assert meta["weight_version"] == "v2"
    for bad in (
        [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 1, "end": 3}],
        [{"version": "v1", "start": True, "end": 3}],
        [{"version": 1, "start": 0, "end": 3}],
        [{"version": "v1", "start": 2, "end": 1}],
    ):
        request = Request.prepare({"input_ids": [1]}, None)
        request.absorb("actor/0", answer([5, 6, 7], {"type": "stop"}, weight_versions=bad))
        meta = request.compose({"type": "stop"})["meta_info"]
        assert "weight_versions" not in meta and "weight_version" not in meta, bad
