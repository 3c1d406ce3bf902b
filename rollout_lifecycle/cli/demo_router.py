"""The demo's sglang-router (``--router``): the router the server keeps in step, the traffic
sent through it as an RL client sends it, and the end-of-run check that it lists exactly the
engines that serve."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import httpx

from rollout_lifecycle.backends.router import LaunchedRouter, SGLangRouter
from rollout_lifecycle.cli.demo_report import StartedEngine
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.server import RolloutServer


class DemoRouting:
    """The router part of the demo; ``_Demo`` sets the attributes below."""

    args: argparse.Namespace
    live: dict[str, StartedEngine]
    problems: list[str]
    router: SGLangRouter | None
    router_url: str | None
    launched_router: LaunchedRouter | None
    router_refused: int

    def say(self, text: str) -> None:
        raise NotImplementedError

    def no_router_yet(self) -> None:
        self.router = self.router_url = self.launched_router = None
        self.router_refused = 0

    async def register_workers(self, server: RolloutServer) -> None:
        """Register the engines that serve at the start."""
        if self.router is not None:
            added = (await server.sync_router())["added"]
            self.say(f"demo: router {self.router.url}: registered {len(added)} worker(s)")

    def send(
        self,
        server: RolloutServer,
        requests: Sequence[dict[str, Any]],
        groups: Sequence[str | None],
    ) -> Awaitable[list[dict[str, Any]]]:
        """The step's traffic: through the router, else the server's own generation client
        (each request to its group in ``groups``, or to any engine where that is None)."""
        if self.router_url is not None:
            return self.via_router(requests)
        if not any(groups):
            return server.generate_batch(requests)
        return self.by_group(server, requests, groups)

    @staticmethod
    async def by_group(
        server: RolloutServer,
        requests: Sequence[dict[str, Any]],
        groups: Sequence[str | None],
    ) -> list[dict[str, Any]]:
        """One ``generate_batch`` per group, all at once; answers in request order."""
        order: dict[str | None, list[int]] = {}
        for index, group in enumerate(groups):
            order.setdefault(group, []).append(index)
        batches = await asyncio.gather(
            *(server.generate_batch([requests[i] for i in at], g) for g, at in order.items())
        )
        answers: dict[int, dict[str, Any]] = {}
        for at, batch in zip(order.values(), batches, strict=True):
            answers.update(zip(at, batch, strict=True))
        return [answers[i] for i in range(len(requests))]

    async def start_router(self) -> SGLangRouter | None:
        """The router the server keeps in step (``--router``; ``launch`` starts one)."""
        if self.args.router is None:
            return None
        url = self.args.router
        if url == "launch":
            self.launched_router = LaunchedRouter()
            url = (await self.launched_router.wait_ready()).url
        self.router_url = url
        self.router = SGLangRouter(url)
        return self.router

    async def via_router(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send ``requests`` through the router as an RL client does: a request the router
        refuses (no worker listed) is retried, an aborted one resubmitted in full."""
        limit = time.monotonic() + (600 if self.args.real else 60)
        assert self.router_url is not None

        async def one(client: httpx.AsyncClient, request: dict[str, Any]) -> dict[str, Any]:
            resubmitted = 0
            while time.monotonic() < limit:
                with contextlib.suppress(httpx.HTTPError):
                    answer = await client.post("/generate", json=request)
                    if answer.status_code == 200:
                        body: dict[str, Any] = answer.json()
                        if body["meta_info"]["finish_reason"]["type"] != "abort":
                            body["meta_info"]["num_resubmissions"] = resubmitted
                            return body
                        resubmitted += 1
                        continue
                self.router_refused += 1
                await asyncio.sleep(0.05)
            raise TimeoutError(f"request {request['input_ids']} not served through the router")

        timeout = httpx.Timeout(600.0, connect=5.0)
        async with httpx.AsyncClient(base_url=self.router_url, timeout=timeout) as client:
            return list(await asyncio.gather(*(one(client, r) for r in requests)))

    async def check_router(self) -> None:
        """The router lists exactly the engines that serve at the end."""
        if self.router is None:
            return
        serving = {url_identity(u) for u in self.serving_urls()}
        listed = {url_identity(w.url) for w in await self.router.workers() if w.healthy}
        self.say(
            f"router: {len(listed)} worker(s) listed at the end, for {len(serving)} engine(s) "
            f"serving; {self.router_refused} refused request(s) retried"
        )
        if listed != serving:
            self.problems.append(f"router lists {sorted(listed)}; serving: {sorted(serving)}")

    async def stop_router(self) -> None:
        if self.router is not None:
            await self.router.close()
        if self.launched_router is not None:
            await asyncio.to_thread(self.launched_router.stop)

    def serving_urls(self) -> list[str]:
        urls = []
        for engine in self.live.values():
            backend = engine.standin or engine.launched
            if backend is not None:
                urls.append(backend.url)
        return urls
