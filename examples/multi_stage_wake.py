"""verl-style multi-stage wake-up: weights first, push, free the trainer's copy, then the KV cache.

After training, the trainer still holds its copy of the weights until they are pushed. Waking
the engines' weights *and* KV cache at that moment stacks all three on one GPU. Waking in
stages (``onload_weights`` -> ``update_weights`` -> free the trainer copy -> ``onload_kv``)
never holds the KV cache and the trainer copy together, which is what lets a 32B model fit on
8 H100s. A ``before_resume_kv`` hook refuses to wake the KV cache while the trainer copy lives.

Peak memory per GPU = what the engine reports resident (the simulated engine's ``memory()``
accounting per tag) + what the simulated trainer holds; both orders run on the same engines.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import ray

from rollout_lifecycle import EngineGroup, LifecycleEvent, RolloutServer, WeightUpdate
from rollout_lifecycle.testing import local_ray, simulated_engine_actors

GIB = 1 << 30
#: Per GPU: the engine's tags, the trainer while training, and its weights copy kept for the push.
ENGINE_BYTES = {"weights": 16 * GIB, "kv_cache": 40 * GIB, "cuda_graph": 2 * GIB}
TRAINING_BYTES = 48 * GIB
WEIGHTS_COPY_BYTES = 16 * GIB


class Gpu:
    """Tracks the peak of engine-resident + trainer-held bytes on the engines' GPUs."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self.trainer = 0
        self.peak = 0

    async def sample(self) -> None:
        resident = await asyncio.gather(*(e.memory.remote() for e in self.engines))
        self.peak = max(self.peak, max(sum(m.values()) for m in resident) + self.trainer)


async def push(update: WeightUpdate) -> None:
    await asyncio.gather(
        *(
            e.update_weights_from_disk.remote("/ckpt", update.version)
            for e in update.engines.values()
        )
    )


async def train_step(server: RolloutServer, gpu: Gpu) -> None:
    await server.offload()
    gpu.trainer = TRAINING_BYTES  # parameters, gradients, optimizer state
    await gpu.sample()
    gpu.trainer = WEIGHTS_COPY_BYTES  # optimizer state offloaded; the weights wait to be pushed
    await gpu.sample()


async def wake_all_at_once(server: RolloutServer, gpu: Gpu, version: str) -> int:
    gpu.peak = 0
    await train_step(server, gpu)

    async def push_then_free(event: LifecycleEvent) -> None:  # everything is resident here
        await gpu.sample()
        await server.update_weights(push, version=version)
        gpu.trainer = 0

    remove = server.on("kv_restored", push_then_free)
    try:
        await server.onload()  # weights, KV cache, (hook: push, free), continue
    finally:
        remove()
    await gpu.sample()
    return gpu.peak


async def wake_in_stages(server: RolloutServer, gpu: Gpu, version: str) -> int:
    gpu.peak = 0
    await train_step(server, gpu)

    def trainer_freed_first(event: LifecycleEvent) -> None:
        if gpu.trainer:
            raise RuntimeError(f"KV cache would wake beside {gpu.trainer / GIB:.0f} GiB of trainer")

    remove = server.on("before_resume_kv", trainer_freed_first)
    try:
        await server.onload_weights()
        await gpu.sample()
        await server.update_weights(push, version=version)
        gpu.trainer = 0  # trainer freed
        await gpu.sample()
        await server.onload_kv()
    finally:
        remove()
    await gpu.sample()
    return gpu.peak


async def run() -> int:
    engines = simulated_engine_actors(2, label="actor", memory_bytes=ENGINE_BYTES)
    try:
        await asyncio.gather(*(e.ping.remote() for e in engines))
        server = RolloutServer([EngineGroup("actor", engines)])
        gpu = Gpu(engines)
        at_once = await wake_all_at_once(server, gpu, "v1")
        staged = await wake_in_stages(server, gpu, "v2")
        versions = await asyncio.gather(*(e.weight_version.remote() for e in engines))
        assert versions == ["v2", "v2"], versions
        assert staged < at_once, (staged, at_once)
        print(f"waking everything at once: peak {at_once / GIB:.1f} GiB per GPU")
        print(f"multi-stage wake:          peak {staged / GIB:.1f} GiB per GPU")
        print(
            f"multi_stage_wake: peak memory {at_once / GIB:.1f} -> {staged / GIB:.1f} GiB "
            f"({(staged - at_once) / at_once:+.1%}), state {server.state.value}, "
            f"weights {versions[0]}"
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
