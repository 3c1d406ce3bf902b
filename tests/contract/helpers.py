"""What the contract scenarios share: requests of a known length, requests held in flight,
deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from rollout_lifecycle.testing.sse import asse_events
from rollout_lifecycle.testing.waits import until

Kind = Literal["standin", "real"]

#: The stand-in's seconds per generated token: close to the real CPU server's 50-100 tokens/s,
#: so that "requests in flight" means the same on both.
STANDIN_TOKEN_LATENCY = 0.015
#: Deadline for a request or a control call that should answer (a generous bound, not a sleep).
CALL_TIMEOUT = 120.0


@dataclass
class Target:
    """One server under test, whichever kind it is."""

    kind: Kind
    url: str
    admin_key: str | None = None
    api_key: str | None = None
    _exited: Callable[[float], bool] = field(repr=False, default=lambda _: False)
    _disposable: Callable[[], Target] | None = field(repr=False, default=None)
    _restart: Callable[[], object] | None = field(repr=False, default=None)

    def headers(self, key: str | None = None) -> dict[str, str]:
        """``Authorization: Bearer KEY`` for ``key`` (by default the control key: the admin
        key when the server has one, else the api key); no header for a keyless server."""
        key = key if key is not None else (self.admin_key or self.api_key)
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    def client(self, timeout: float = CALL_TIMEOUT) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers=self.headers(), timeout=timeout, trust_env=False
        )

    def exited(self, within: float) -> bool:
        """Whether the server process has exited, waiting up to ``within`` seconds."""
        return self._exited(within)

    def disposable(self) -> Target:
        """A fresh keyless server this test may kill (stopped when the test ends)."""
        assert self._disposable is not None, "only the shared keyless target hands these out"
        return self._disposable()

    def restart(self) -> None:
        """Stop a disposable server and start a new one at the same URL; returns once it is
        ready."""
        assert self._restart is not None, "only a disposable target restarts"
        self._restart()


def gen_request(tokens: int, i: int = 0, rid: str | None = None) -> dict[str, Any]:
    """A generate request of exactly ``tokens`` new tokens (random weights: no eos)."""
    body: dict[str, Any] = {
        "input_ids": [11 + i, 23, 5 + i, 42],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }
    if rid is not None:
        body["rid"] = rid
    return body


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    answer = await client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


async def held(client: httpx.AsyncClient, url: str = "") -> int:
    """The requests the scheduler of the server at ``url`` (by default the client's) holds,
    running or waiting, from ``/v1/loads`` (a request on its way, or held before the scheduler
    by a pause, is not counted)."""
    # sglang: entrypoints/v1_loads.py get_loads; the scheduler republishes its load after every
    # prefill (scheduler.py publish_load_snapshot(force=batch.forward_mode.is_extend())).
    answer = await client.get(f"{url}/v1/loads", params={"include": "core"})
    assert answer.status_code == 200, answer.text
    return sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in answer.json()["loads"])


async def in_flight(
    client: httpx.AsyncClient, n: int, tokens: int, *, rids: list[str] | None = None
) -> list[asyncio.Task[dict[str, Any]]]:
    """Start ``n`` generate requests and return once the scheduler holds all of them (``held``),
    none finished yet."""
    tasks = [
        asyncio.create_task(
            generate(client, gen_request(tokens, i, None if rids is None else rids[i]))
        )
        for i in range(n)
    ]

    async def all_held() -> bool:
        for task in tasks:
            assert not task.done(), "a request finished before the scenario began: make it longer"
        return await held(client) >= n

    await until(all_held, what=f"the scheduler to hold {n} requests", deadline=CALL_TIMEOUT)
    return tasks


def finish_type(answer: dict[str, Any]) -> str:
    kind: str = answer["meta_info"]["finish_reason"]["type"]
    return kind


# ------------------------------------------------------------------ vLLM

#: The vLLM stand-in's seconds per generated token, and the tokens of a request that must be
#: seen running: short on the stand-in; on the real CPU server (~450 tokens/s) 3,000 tokens are
#: needed for a request to be seen decoding before it ends.
VLLM_STANDIN_TOKEN_LATENCY = 0.005
VLLM_TOKENS: dict[Kind, int] = {"standin": 400, "real": 3000}


@dataclass
class VLLMTarget(Target):
    """One vLLM server under test: a ``Target`` that also names a checkpoint a reload from disk
    succeeds from, and the tokens of a request long enough to be seen running."""

    model_path: str = ""

    @property
    def tokens(self) -> int:
        return VLLM_TOKENS[self.kind]


class Streamed:
    """One streamed ``/v1/completions`` request: ``decoding`` is set once its first token came
    back (the request is running in the scheduler), ``done`` holds its finish reason and the
    number of tokens it streamed."""

    def __init__(self, url: str, tokens: int, request_id: str | None = None) -> None:
        self.tokens = tokens
        self.decoding = asyncio.Event()
        body: dict[str, Any] = {
            "prompt": [1, 2, 3, 4],
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        if request_id is not None:
            body["request_id"] = request_id
        self.done: asyncio.Future[tuple[str | None, int]] = asyncio.ensure_future(
            self._run(url, body)
        )

    async def _run(self, url: str, body: dict[str, Any]) -> tuple[str | None, int]:
        count, reason = 0, None
        async with (
            httpx.AsyncClient(timeout=CALL_TIMEOUT, trust_env=False) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as answer,
        ):
            assert answer.status_code == 200, await answer.aread()
            async for event in asse_events(answer.aiter_bytes()):
                choice = event["choices"][0]
                count += len(choice.get("token_ids") or [])
                reason = choice.get("finish_reason") or reason
                if count:
                    self.decoding.set()
        return reason, count

    async def started(self) -> Streamed:
        """Return once a token has come back; fail at once if the request ended first."""
        waiting = asyncio.ensure_future(self.decoding.wait())
        await asyncio.wait(
            [waiting, self.done], timeout=CALL_TIMEOUT, return_when="FIRST_COMPLETED"
        )
        waiting.cancel()
        assert self.decoding.is_set(), f"the stream never decoded: {self.done!r}"
        assert not self.done.done(), "the request ended before the scenario began: make it longer"
        return self

    async def result(self) -> tuple[str | None, int]:
        return await asyncio.wait_for(self.done, CALL_TIMEOUT)
