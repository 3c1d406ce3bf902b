"""ROLL-style training step: ``async with server.offloaded(): train()``.

Entering offloads the engines (pause, drain, release); leaving restores the weights, runs the
``weights_restored`` hooks - here the weight push - then restores the KV cache and continues
generation. The exit runs even when training raises (ROLL's own context manager has no
try/finally), so a failed step never leaves the engines released.
"""

from __future__ import annotations

import asyncio
import sys

import ray

from rollout_lifecycle import (
    EngineGroup,
    FromDisk,
    LifecycleEvent,
    RolloutServer,
    ServerState,
)
from rollout_lifecycle.testing import local_ray, simulated_engine_actors


class Trainer:
    def __init__(self) -> None:
        self.step = 0

    async def train(self, fail: bool = False) -> None:
        await asyncio.sleep(0.05)
        if fail:
            raise RuntimeError("CUDA out of memory in the backward pass")
        self.step += 1


async def run() -> int:
    engines = simulated_engine_actors(2, label="actor")
    try:
        await asyncio.gather(*(e.ping.remote() for e in engines))
        server = RolloutServer([EngineGroup("actor", engines)])
        trainer = Trainer()
        pushed: list[str] = []

        async def push_weights(event: LifecycleEvent) -> None:
            # Every exit pushes, even after a failed step: without --enable-weights-cpu-backup
            # the resumed weight pages hold garbage until weights are written again.
            version = f"step-{trainer.step}"
            await event.server.update_weights(FromDisk(f"/ckpt/{version}"), version=version)
            pushed.append(version)

        server.on("weights_restored", push_weights)

        async with server.offloaded():
            assert server.state is ServerState.RELEASED
            await trainer.train()
        assert server.state is ServerState.SERVING

        try:
            async with server.offloaded():
                await trainer.train(fail=True)
        except RuntimeError as exc:
            print(f"training raised: {exc}")
        assert server.state is ServerState.SERVING  # restored anyway
        snapshot = server.snapshot().engines().values()
        assert all(not e.released and not e.paused for e in snapshot)

        versions = await asyncio.gather(*(e.weight_version.remote() for e in engines))
        assert pushed == ["step-1", "step-1"] and versions == ["step-1", "step-1"]
        print(
            f"context_manager: 2 offloaded() steps (1 raised), {len(pushed)} weight pushes from "
            f"the weights_restored hook, engines on {versions[0]}, state {server.state.value}"
        )
        return 0
    finally:
        for engine in engines:
            ray.kill(engine)


def main() -> int:
    with local_ray():
        return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
