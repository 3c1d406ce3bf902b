"""Helpers of the router tests (stand-ins and real servers): what the router lists, and
traffic sent through it that must lose nothing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx

from rollout_lifecycle import SGLangRouter
from rollout_lifecycle.contract.urls import url_identity


async def listed(router: SGLangRouter) -> set[str]:
    return {url_identity(w.url) for w in await router.workers() if w.healthy}


async def every_listed(router: SGLangRouter) -> frozenset[str]:
    """The workers the router lists, healthy or not."""
    return frozenset(url_identity(str(w.url)) for w in await router.workers())


@contextlib.asynccontextmanager
async def watching(router: SGLangRouter, seen: list[frozenset[str]]) -> AsyncIterator[None]:
    """Read the router's workers (``every_listed``) every 50 ms for the block into ``seen``."""

    async def watch() -> None:
        while True:
            seen.append(await every_listed(router))
            await asyncio.sleep(0.05)

    task = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def ids(*urls: str) -> set[str]:
    return {url_identity(u) for u in urls}


async def stats(url: str) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        answer = await client.get(f"{url}/_standin/stats")
        answer.raise_for_status()
        result: dict[str, int] = answer.json()
        return result


class Traffic:
    """Requests sent through the router until stopped: a refused request (no worker listed, or
    a worker taken out under it) is retried, an aborted one resubmitted; none may be lost."""

    def __init__(self, url: str, senders: int, tokens: int = 12, **params: Any) -> None:
        self.url, self.senders, self.tokens, self.params = url, senders, tokens, params
        self.sent = self.completed = self.retried = self.resubmitted = 0
        self.stop = asyncio.Event()
        self.lost: list[str] = []
        self.in_flight = 0
        self._sending = asyncio.Event()  # set while a request is on its way
        #: When each refused attempt happened (the router had no worker to give it).
        self.refused_at: list[float] = []

    async def busy(self, deadline: float = 30.0) -> None:
        """Wait (up to ``deadline`` seconds) until a request is on its way through the router."""
        await asyncio.wait_for(self._sending.wait(), deadline)

    @contextlib.asynccontextmanager
    async def running(self, deadline: float) -> AsyncIterator[Traffic]:
        """Traffic sent for the block's length; at its end the senders finish what they have
        sent (within ``deadline`` seconds). A block that raises cancels them instead: its own
        error is the one to read, and the lifecycle it broke may never let them finish."""
        task = asyncio.ensure_future(self.run())
        try:
            yield self
        except BaseException:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise
        self.stop.set()
        await asyncio.wait_for(task, deadline)

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60, trust_env=False) as client:
            await asyncio.gather(*(self._sender(client, i) for i in range(self.senders)))

    async def _sender(self, client: httpx.AsyncClient, index: int) -> None:
        for n in itertools.count():
            if self.stop.is_set():
                return
            self.sent += 1
            params = {"max_new_tokens": self.tokens, **self.params}
            body = {"input_ids": [index + 3, n % 50 + 3, 7], "sampling_params": params}
            for _attempt in range(2000):  # bounded: ~40 s of retries at most
                self.in_flight += 1
                self._sending.set()
                try:
                    answer = await client.post("/generate", json=body)
                except httpx.HTTPError:
                    answer = None
                finally:
                    self.in_flight -= 1
                    if not self.in_flight:
                        self._sending.clear()
                if answer is None or answer.status_code != 200:
                    self.retried += 1
                    self.refused_at.append(asyncio.get_running_loop().time())
                    await asyncio.sleep(0.02)
                    continue
                finish = answer.json()["meta_info"]["finish_reason"]["type"]
                if finish == "abort":
                    self.resubmitted += 1
                    continue
                assert finish == "length", answer.text
                self.completed += 1
                break
            else:
                self.lost.append(f"sender {index} request {n}")
