"""Tensor payloads that would kill an SGLang server are refused before they are sent; the
stand-in dies of them as the real server does (``tests/real/test_real_verify.py`` shows it)."""

from __future__ import annotations

import asyncio
import base64
import multiprocessing.resource_sharer
import pickle

import httpx
import pytest
from backends.test_http_client import FakeServer, make_engine

from rollout_lifecycle import FromTensor, InvalidArgument
from rollout_lifecycle.backends.tensor_payload import deadly
from rollout_lifecycle.testing import until
from rollout_lifecycle.testing.fleets import pickled_tensors
from rollout_lifecycle.testing.standin import StandInServer


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


#: What a payload names when it lends a file descriptor (module and class, as pickled).
LENDING = {
    protocol: b64(pickle.dumps([("w", multiprocessing.resource_sharer.DupFd)], protocol))
    for protocol in (2, 4, 5)
}
NOT_A_PICKLE = b64(b"not a pickle")
CUT_SHORT = b64(base64.b64decode(pickled_tensors("w")[0])[:-6])


@pytest.mark.parametrize("protocol", sorted(LENDING))
def test_a_payload_that_lends_file_descriptors_is_deadly(protocol: int) -> None:
    assert "file descriptors" in (deadly(LENDING[protocol]) or "")


def test_bytes_that_are_no_whole_pickle_are_deadly_and_text_that_is_no_base64_is_not() -> None:
    assert "is not a pickle" in (deadly(NOT_A_PICKLE) or "")
    assert "is not a whole pickle" in (deadly(CUT_SHORT) or "")
    assert deadly("rank0-b64") is None  # the server answers 400 and lives
    assert deadly(pickled_tensors("w", "b")[0]) is None


@pytest.mark.parametrize("payload", [LENDING[4], NOT_A_PICKLE, CUT_SHORT])
async def test_the_client_refuses_a_deadly_payload_and_sends_nothing(payload: str) -> None:
    server = FakeServer()
    engine = make_engine(server)
    with pytest.raises(InvalidArgument, match=r"serialized_named_tensors\[1\] .*file_system"):
        await engine.update_weights_from_tensor(
            [pickled_tensors("w")[0], payload],
            weight_version="v1",
            flush_cache=False,
            abort_all_requests=False,
        )
    assert server.requests == []
    await engine.close()


def test_from_tensor_refuses_a_deadly_payload_when_made() -> None:
    with pytest.raises(InvalidArgument, match=r"payload\[0\] passes host tensors"):
        FromTensor([LENDING[5]])
    with pytest.raises(InvalidArgument, match=r"payload\['actor/1'\]\[0\] is not a pickle"):
        FromTensor({"actor/0": pickled_tensors("w"), "actor/1": [NOT_A_PICKLE]})
    FromTensor(pickled_tensors("w"))


async def test_the_standin_refuses_text_that_is_no_base64_and_dies_of_a_deadly_payload() -> None:
    server = await asyncio.to_thread(StandInServer().start)
    try:
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=30) as client:
            assert (await client.post("/begin_weight_update", json={})).status_code == 200
            refused = await client.post(
                "/update_weights_from_tensor", json={"serialized_named_tensors": ["rank0-b64"]}
            )
            assert refused.status_code == 400 and server.alive()
            with pytest.raises(httpx.HTTPError):
                await client.post(
                    "/update_weights_from_tensor",
                    json={"serialized_named_tensors": [NOT_A_PICKLE]},
                )
        await until(lambda: not server.alive(), what="the stand-in to die")
    finally:
        server.stop()
