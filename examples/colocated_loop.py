"""A slime-style colocated RL loop, written as plain synchronous Python.

The trainer and the rollout engines share the GPUs, so each step is: generate a batch ->
offload the engines -> train -> onload the weights -> push the new weights (versioned) ->
onload the KV cache. ``SyncRolloutServer`` runs the async lifecycle on a thread of its own, so
the loop has no ``async``/``await`` and the weight push is an ordinary blocking function.

Requests still decoding when the trainer takes the GPU (the long tail of a partial rollout,
submitted from a second thread) are retracted, not lost: they finish after the KV cache is back.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from rollout_lifecycle import EngineGroup, WeightUpdate
from rollout_lifecycle.sync import SyncRolloutServer
from rollout_lifecycle.testing import local_ray, simulated_engine_actors

STEPS = 3
ENGINES = 2
BATCH = 8


def prompts(step: int, count: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {"input_ids": [step, i], "sampling_params": {"max_new_tokens": tokens}}
        for i in range(count)
    ]


def push_weights(update: WeightUpdate) -> None:
    """The trainer's weight push: blocking, as a training loop writes it (runs in a worker)."""
    path = f"/checkpoints/{update.version}"
    ray.get(
        [e.update_weights_from_disk.remote(path, update.version) for e in update.engines.values()]
    )


def main() -> int:
    with local_ray():  # (a Ray cluster of its own, unless this process has one)
        return loop()


def loop() -> int:
    actors = simulated_engine_actors(ENGINES, label="actor", token_latency=0.002)
    try:
        ray.get([a.ping.remote() for a in actors])
        submitted = completed = retracted = 0
        with (
            SyncRolloutServer([EngineGroup("actor", actors)], name="colocated") as rollout,
            ThreadPoolExecutor(max_workers=1) as background,
        ):
            for step in range(1, STEPS + 1):
                batch = rollout.generate_batch(prompts(step, BATCH, 16), timeout=60)
                # The long tail keeps decoding while the trainer takes over.
                tail = background.submit(rollout.generate_batch, prompts(step, BATCH, 120))
                time.sleep(0.05)
                rollout.offload(timeout=60)
                time.sleep(0.05)  # train(batch): the GPU belongs to the trainer
                rollout.onload_weights(timeout=60)
                rollout.update_weights(push_weights, version=f"step-{step}", timeout=60)
                rollout.onload_kv(timeout=60)
                answers = batch + tail.result(timeout=60)
                submitted += 2 * BATCH
                completed += sum(
                    a["meta_info"]["finish_reason"]["type"] == "length" for a in answers
                )
                retracted += sum(a["meta_info"]["num_retractions"] > 0 for a in answers)
                print(f"step {step}: {len(answers)} answers, state {rollout.state.value}")
            final_state = rollout.state.value
        versions = ray.get([a.weight_version.remote() for a in actors])
        assert versions == [f"step-{STEPS}"] * ENGINES, versions
        assert completed == submitted, f"{submitted - completed} request(s) lost or aborted"
        assert retracted > 0, "no request was in flight across an offload"
        print(
            f"colocated_loop: {STEPS} steps on {ENGINES} engines, {completed}/{submitted} "
            f"requests completed ({retracted} retracted across an offload, none lost), every "
            f"engine on {versions[0]}, state {final_state}"
        )
        return 0
    finally:
        for actor in actors:
            ray.kill(actor)


if __name__ == "__main__":
    sys.exit(main())
