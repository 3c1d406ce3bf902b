"""The stream readers keep an event whole when its text holds a line boundary other than
``\\n``, however the answer's bytes are chunked."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_lifecycle.testing.sse import asse_events, sse_events

#: Characters str.splitlines (and so httpx's iter_lines) takes for line ends.
BOUNDARIES = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"

texts = st.text(alphabet=st.sampled_from(BOUNDARIES + "ab\u00e9\u4e2d "), max_size=12)


def stream(events: list[dict[str, str]]) -> bytes:
    """An answer body as the engines write it: raw strings (``ensure_ascii=False``), a blank
    line after each event, ``[DONE]`` last."""
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)
    return (body + "data: [DONE]\n\n").encode()


def chunked(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    return [body[a:b] for a, b in itertools.pairwise(points)]


@given(st.lists(texts.map(lambda t: {"text": t}), max_size=4), st.lists(st.integers(0, 10**6)))
def test_every_event_comes_back_whole_however_the_bytes_are_cut(
    events: list[dict[str, str]], cuts: list[int]
) -> None:
    assert list(sse_events(chunked(stream(events), cuts))) == events


@given(st.lists(texts.map(lambda t: {"text": t}), max_size=4), st.lists(st.integers(0, 10**6)))
def test_the_async_reader_agrees(events: list[dict[str, str]], cuts: list[int]) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for chunk in chunked(stream(events), cuts):
            yield chunk

    async def read() -> list[dict[str, object]]:
        return [event async for event in asse_events(chunks())]

    assert asyncio.run(read()) == events


def test_an_event_with_a_unicode_line_separator_reads_whole_where_iter_lines_cuts_it() -> None:
    body = stream([{"text": "one\u2028two"}, {"text": "three\x85"}])
    answer = httpx.Response(200, content=body)
    with pytest.raises(json.JSONDecodeError):
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[len("data:") :])
    assert list(sse_events(httpx.Response(200, content=body).iter_bytes())) == [
        {"text": "one\u2028two"},
        {"text": "three\x85"},
    ]


def test_a_last_event_without_its_newline_is_read_and_a_non_object_is_refused() -> None:
    assert list(sse_events([b'data: {"a": 1}\r\n\r\ndata: {"b"', b": 2}"])) == [{"a": 1}, {"b": 2}]
    with pytest.raises(ValueError, match=r"not a JSON object: '\[1\]'"):
        list(sse_events([b"data: [1]\n\n"]))
