"""Memory plan (a model, not a measurement): peak device memory per GPU of a weight update when
the engines wake in stages (weights, push, free the trainer's copy, then the KV cache) versus all
at once, for a 32B model on 8 x 80 GB GPUs at SGLang memory fraction 0.8.

The engines are simulated; each accounts its resident bytes per memory tag (``memory()``) and
the trainer's bytes are set by hand, so the peaks follow from the sizes assumed below, run
through the library's real call sequence. The accounting (``Gpu``: engine-resident + trainer-held
bytes, sampled after every step) and the weight push come from ``examples/multi_stage_wake.py``;
this script sizes them for the 32B setup.

Assumptions per GPU (all adjustable): one engine with tensor parallelism over the GPUs, so it
holds ``2 x params / tp`` bytes of bf16 weights; SGLang's static pool is ``fraction x GPU``, the
KV cache is the pool minus the weights; CUDA graphs ``--cuda-graph-gb``. The trainer shards over
the same GPUs: while training, bf16 parameters + fp32 gradients + Adam (fp32 master, m, v) =
18 bytes per parameter; at the weight push it still holds its bf16 parameters and fp32 gradient
buffer (6 bytes per parameter) until it frees them.

    python -m benchmarks.memory_plan
    python -m benchmarks.memory_plan --params 8e9 --gpus 8 --fraction 0.85
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import ray

from benchmarks._common import machine, table
from rollout_lifecycle import EngineGroup, LifecycleEvent, RolloutServer
from rollout_lifecycle.testing import local_ray, simulated_engine_actors

GB = 10**9
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multi_stage_wake.py"


def example() -> ModuleType:
    """``examples/multi_stage_wake.py``, loaded as a module (its ``Gpu`` and ``push``)."""
    name = "rollout_lifecycle_example_multi_stage_wake"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Setup:
    """The modelled hardware and model; sizes are per GPU."""

    params: float = 32e9
    gpus: int = 8
    gpu_gb: float = 80.0
    fraction: float = 0.8
    tp: int = 8
    cuda_graph_gb: float = 3.0
    train_bytes_per_param: float = 18.0
    push_bytes_per_param: float = 6.0

    @property
    def weights(self) -> int:
        """bf16 weights of the engine's shard."""
        return int(2 * self.params / self.tp)

    @property
    def kv_cache(self) -> int:
        """SGLang's static pool minus the weights."""
        kv = int(self.fraction * self.gpu_gb * GB) - self.weights
        if kv <= 0:
            raise ValueError("the weights do not fit in the static memory pool")
        return kv

    @property
    def cuda_graph(self) -> int:
        """CUDA graph memory."""
        return int(self.cuda_graph_gb * GB)

    @property
    def training(self) -> int:
        """What the trainer holds while training."""
        return int(self.train_bytes_per_param * self.params / self.gpus)

    @property
    def at_push(self) -> int:
        """What the trainer still holds when the weights are pushed."""
        return int(self.push_bytes_per_param * self.params / self.gpus)

    def engine_bytes(self) -> dict[str, int]:
        """The simulated engine's ``memory_bytes``."""
        return {"weights": self.weights, "kv_cache": self.kv_cache, "cuda_graph": self.cuda_graph}


@dataclass
class Plan:
    """One wake order's peaks, per GPU."""

    name: str
    training_peak: int
    update_peak: int
    #: Trainer bytes held when the KV cache was resumed.
    trainer_at_kv_wake: int


async def _train(server: RolloutServer, gpu: Any, setup: Setup) -> int:
    await server.offload()
    gpu.trainer = setup.training
    gpu.peak = 0
    await gpu.sample()
    training = int(gpu.peak)
    gpu.trainer = setup.at_push  # optimizer state offloaded; parameters and gradients remain
    gpu.peak = 0
    await gpu.sample()
    return training


async def wake_all_at_once(server: RolloutServer, gpu: Any, setup: Setup, version: str) -> Plan:
    """Resume every tag, push the weights (trainer copy still held), free it, continue."""
    push = example().push
    training = await _train(server, gpu, setup)
    seen: list[int] = []

    async def push_then_free(event: LifecycleEvent) -> None:  # everything is resident here
        await gpu.sample()
        await server.update_weights(push, version=version)
        gpu.trainer = 0

    remove_kv = server.on("before_resume_kv", lambda event: seen.append(gpu.trainer))
    remove = server.on("kv_restored", push_then_free)
    try:
        await server.onload()  # weights, KV cache, (hook: push, free), continue
    finally:
        remove()
        remove_kv()
    await gpu.sample()
    return Plan("all at once", training, int(gpu.peak), seen[0])


async def wake_in_stages(server: RolloutServer, gpu: Any, setup: Setup, version: str) -> Plan:
    """Resume the weights, push, free the trainer copy, then resume the KV cache."""
    push = example().push
    training = await _train(server, gpu, setup)
    seen: list[int] = []
    remove = server.on("before_resume_kv", lambda event: seen.append(gpu.trainer))
    try:
        await server.onload_weights()
        await gpu.sample()
        await server.update_weights(push, version=version)
        await gpu.sample()
        gpu.trainer = 0  # the trainer frees its copy
        await server.onload_kv()
    finally:
        remove()
    await gpu.sample()
    return Plan("multi-stage", training, int(gpu.peak), seen[0])


async def run_plan(setup: Setup) -> list[Plan]:
    """Both wake orders on the same simulated engines (one per GPU); needs a running Ray."""
    engines = simulated_engine_actors(setup.gpus, label="gpu", memory_bytes=setup.engine_bytes())
    try:
        await asyncio.gather(*(e.ping.remote() for e in engines))
        server = RolloutServer([EngineGroup("actor", engines)])
        gpu = example().Gpu(engines)
        plans = [
            await wake_all_at_once(server, gpu, setup, "v1"),
            await wake_in_stages(server, gpu, setup, "v2"),
        ]
        versions = await asyncio.gather(*(e.weight_version.remote() for e in engines))
        if set(versions) != {"v2"} or server.state.value != "serving":
            raise RuntimeError(f"weights {versions}, state {server.state.value}")
        return plans
    finally:
        for engine in engines:
            ray.kill(engine)


def report(setup: Setup, plans: Sequence[Plan]) -> str:
    """Peaks per GPU and whether each fits, with the sizes they follow from."""
    cap = setup.gpu_gb * GB
    rows = [
        [
            p.name,
            f"{p.update_peak / GB:.1f}",
            f"{p.update_peak / cap:.0%}",
            "yes" if p.update_peak <= cap else "NO (out of memory)",
            f"{p.trainer_at_kv_wake / GB:.0f}",
            f"{p.training_peak / GB:.1f}",
        ]
        for p in plans
    ]
    staged = next(p for p in plans if p.name == "multi-stage")
    at_once = next(p for p in plans if p.name == "all at once")
    cut = (at_once.update_peak - staged.update_peak) / at_once.update_peak
    head = (
        f"MODEL (not a measurement): {setup.params / 1e9:g}B parameters, {setup.gpus} x "
        f"{setup.gpu_gb:g} GB, memory fraction {setup.fraction:g}, TP {setup.tp}. Per GPU: "
        f"engine weights {setup.weights / GB:.1f} GB, KV cache {setup.kv_cache / GB:.1f} GB, "
        f"CUDA graphs {setup.cuda_graph / GB:.1f} GB; trainer {setup.training / GB:.1f} GB "
        f"training, {setup.at_push / GB:.1f} GB held at the weight push"
    )
    headers = [
        "wake order",
        "weight-update peak GB/GPU",
        f"of {setup.gpu_gb:g} GB",
        "fits",
        "trainer GB at KV wake",
        "training peak GB/GPU",
    ]
    return (
        f"{head}\n{table(headers, rows)}\n"
        f"multi-stage wake lowers the weight-update peak by {cut:.0%} "
        f"({at_once.update_peak / GB:.1f} -> {staged.update_peak / GB:.1f} GB per GPU)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the model from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    defaults = Setup()
    parser.add_argument("--params", type=float, default=defaults.params)
    parser.add_argument("--gpus", type=int, default=defaults.gpus)
    parser.add_argument("--gpu-gb", type=float, default=defaults.gpu_gb)
    parser.add_argument("--fraction", type=float, default=defaults.fraction)
    parser.add_argument("--tp", type=int, default=defaults.tp)
    parser.add_argument("--cuda-graph-gb", type=float, default=defaults.cuda_graph_gb)
    parser.add_argument(
        "--train-bytes-per-param", type=float, default=defaults.train_bytes_per_param
    )
    parser.add_argument("--push-bytes-per-param", type=float, default=defaults.push_bytes_per_param)
    args = parser.parse_args(argv)
    setup = Setup(
        args.params,
        args.gpus,
        args.gpu_gb,
        args.fraction,
        args.tp,
        args.cuda_graph_gb,
        args.train_bytes_per_param,
        args.push_bytes_per_param,
    )
    print(f"machine: {machine()}")
    with local_ray():
        plans = asyncio.run(run_plan(setup))
    print(report(setup, plans))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
