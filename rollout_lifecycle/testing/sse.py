"""The JSON events of a streamed engine answer (server-sent events), split on newlines alone.

Both engines write each event as ``data: <json>`` and a blank line, with the JSON's strings left
raw: SGLang's ``/generate`` stream goes through ``orjson.dumps`` (``dumps_json`` in
``sglang/srt/utils/json_response.py``) and vLLM's ``/v1/completions`` stream through pydantic's
``model_dump_json`` (``vllm/entrypoints/openai/completion/serving.py``). Neither escapes U+2028,
U+2029 or U+0085, and a model's text can hold those characters. httpx's ``iter_lines`` splits on
every boundary ``str.splitlines`` knows, so it cuts such an event in two and its JSON does not
parse. These readers split on ``\\n`` only.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

DONE = "[DONE]"


class _Splitter:
    """Bytes in, whole ``data:`` payloads out; a payload may span any number of chunks."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        return [event for line in lines if (event := _event(line)) is not None]

    def close(self) -> list[dict[str, Any]]:
        rest, self._pending = self._pending, b""
        event = _event(rest)
        return [] if event is None else [event]


def _event(line: bytes) -> dict[str, Any] | None:
    text = line.decode("utf-8").rstrip("\r")
    if not text.startswith("data:"):
        return None
    payload = text[len("data:") :].strip()
    if payload == DONE:
        return None
    event = json.loads(payload)
    if not isinstance(event, dict):
        raise ValueError(f"a stream event is not a JSON object: {payload[:80]!r}")
    return event


def sse_events(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """Each ``data:`` event of ``chunks`` (``response.iter_bytes()``) as a dict, ``[DONE]``
    left out."""
    splitter = _Splitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.close()


async def asse_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """``sse_events`` for ``response.aiter_bytes()``."""
    splitter = _Splitter()
    async for chunk in chunks:
        for event in splitter.feed(chunk):
            yield event
    for event in splitter.close():
        yield event
