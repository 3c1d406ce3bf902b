"""The package modules one ``offload()`` passes through on its way to each engine's request.

Runs one offload of an HTTP engine (``SGLangHTTPEngine`` to a stand-in server on loopback) and
takes the call stack at the HTTP transport for every request it sends, joined
with the stack that created each task on the way (a phase sends its calls as tasks). With
``--ray`` it also runs one offload of engines behind Ray (``EngineActor``) and takes the
driver's stack where each actor call is sent; in the actor the call runs the same
``EngineHost`` and backend code as in process. Prints each request's chain of modules and how
many distinct package modules it crosses (docs/design.md, "One offload").

    python -m benchmarks.path          # ~5 s
    python -m benchmarks.path --ray    # ~15 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

import rollout_lifecycle

#: The package's source root; frames of the test kit (the stand-in, the simulator) are left
#: out: they are the engine's side of the wire.
ROOT = str(Path(rollout_lifecycle.__file__).parent) + "/"
KIT = ROOT + "testing/"


def _modules(stack: traceback.StackSummary) -> list[str]:
    return [
        f.filename[len(ROOT) : -len(".py")]
        for f in stack
        if f.filename.startswith(ROOT) and not f.filename.startswith(KIT)
    ]


class _Stacks:
    """Records, for every task created while installed, its creator's task and stack."""

    def __init__(self) -> None:
        self.parents: dict[asyncio.Task[Any], tuple[asyncio.Task[Any] | None, list[str]]] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        loop_type = asyncio.BaseEventLoop
        original = loop_type.create_task
        parents = self.parents

        def create_task(loop: Any, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            task = original(loop, coro, **kwargs)
            parents[task] = (asyncio.current_task(), _modules(traceback.extract_stack()[:-1]))
            return task

        loop_type.create_task = create_task  # type: ignore[method-assign]
        try:
            yield
        finally:
            loop_type.create_task = original  # type: ignore[method-assign]

    def here(self) -> list[str]:
        """The modules of the logical call chain that reached this point, outermost first
        (one entry per crossing: a module left and entered again appears twice)."""
        modules = _modules(traceback.extract_stack()[:-2])
        task: asyncio.Task[Any] | None = asyncio.current_task()
        while task in self.parents:
            task, created = self.parents[task]
            modules = created + modules
        chain: list[str] = []
        for module in modules:
            if not chain or chain[-1] != module:
                chain.append(module)
        return chain


async def http_chains() -> list[tuple[str, list[str]]]:
    """One offload of one HTTP engine (a stand-in server on loopback): (request path, chain)
    per request."""
    from rollout_lifecycle import EngineGroup, RolloutServer, SGLangHTTPEngine
    from rollout_lifecycle.testing import StandInServer

    stacks, chains = _Stacks(), []

    class Spy(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            chains.append((request.url.path, stacks.here()))
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    with StandInServer(token_latency=0.001) as standin:
        engine = SGLangHTTPEngine(standin.url, transport=Spy())
        server = RolloutServer([EngineGroup("actor", [engine])])
        with stacks.installed():
            await server.offload()
        await engine.close()
    return chains


async def ray_chains() -> list[tuple[str, list[str]]]:
    """One offload of two simulated engines behind Ray: (actor method, the driver's chain) per
    call sent."""
    import ray
    from ray.actor import ActorMethod

    from rollout_lifecycle import EngineGroup, RolloutServer
    from rollout_lifecycle.testing import local_ray, simulated_engine_actors

    stacks, chains = _Stacks(), []
    original = ActorMethod._remote

    def remote(method: Any, *args: Any, **kwargs: Any) -> Any:
        chains.append((method._method_name, stacks.here()))
        return original(method, *args, **kwargs)

    with local_ray():
        actors = simulated_engine_actors(2, token_latency=0.001)
        await asyncio.gather(*(a.ping.remote() for a in actors))
        server = RolloutServer([EngineGroup("actor", actors)])
        ActorMethod._remote = remote  # type: ignore[method-assign]
        try:
            with stacks.installed():
                await server.offload()
        finally:
            ActorMethod._remote = original  # type: ignore[method-assign]
        for actor in actors:
            ray.kill(actor)
    return chains


def show(title: str, chains: list[tuple[str, list[str]]]) -> None:
    print(title)
    for name, chain in chains:
        print(f"  {name:<28} {len(set(chain)):>2} modules: {' > '.join(chain)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray", action="store_true", help="also one offload on Ray")
    args = parser.parse_args(argv)
    show("in process, HTTP backend: the stack at each request", asyncio.run(http_chains()))
    if args.ray:
        show("Ray: the driver's stack at each actor call", asyncio.run(ray_chains()))


if __name__ == "__main__":
    main()
