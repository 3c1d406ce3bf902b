"""``/abort_request``: an exact rid aborts that request only; a prefix of a rid and an empty
rid abort nothing; ``abort_all`` aborts every request."""

from __future__ import annotations

import asyncio
import uuid

from wire.helpers import Target, finish_type, in_flight

TOKENS = 150


def rids(n: int) -> list[str]:
    stem = f"contract-{uuid.uuid4().hex[:8]}"
    return [f"{stem}-{i}" for i in range(n)]


async def test_abort_by_exact_rid_aborts_only_that_request(target: Target) -> None:
    names = rids(2)
    async with target.client() as client:
        tasks = await in_flight(client, 2, TOKENS, rids=names)
        answer = await client.post("/abort_request", json={"rid": names[0]})
        assert answer.status_code == 200 and answer.content == b""
        aborted, kept = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert finish_type(aborted) == "abort" and len(aborted["output_ids"]) < TOKENS
        assert finish_type(kept) == "length" and len(kept["output_ids"]) == TOKENS


async def test_a_prefix_of_a_rid_or_an_empty_rid_aborts_nothing(target: Target) -> None:
    names = rids(2)
    async with target.client() as client:
        tasks = await in_flight(client, 2, TOKENS, rids=names)
        prefix = names[0][: len(names[0]) - 2]
        for rid in (prefix, ""):
            answer = await client.post("/abort_request", json={"rid": rid})
            assert answer.status_code == 200 and answer.content == b""
        for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
            assert finish_type(result) == "length" and len(result["output_ids"]) == TOKENS


async def test_abort_all_aborts_every_request(target: Target) -> None:
    async with target.client() as client:
        tasks = await in_flight(client, 3, TOKENS)
        answer = await client.post("/abort_request", json={"abort_all": True})
        assert answer.status_code == 200 and answer.content == b""
        for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
            assert finish_type(result) == "abort" and len(result["output_ids"]) < TOKENS
