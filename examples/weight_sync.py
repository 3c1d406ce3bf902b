"""Non-colocated weight sync: the engines keep their GPUs, so nothing is ever released.

With ``needs_offload=False`` the engines only pause around the weight write:
``async with server.paused(): await server.update_weights(...)`` pauses and drains them (in
``retract`` mode the requests in flight keep their progress), writes the weights, flushes the
prefix cache computed with the old weights, and continues. Requests sent during the sync finish
once it is over; none is aborted.
"""

from __future__ import annotations

import asyncio
import sys

import ray

from rollout_lifecycle import EngineGroup, FromDisk, RolloutServer, ServerState
from rollout_lifecycle.testing import local_ray, simulated_engine_actors

SYNCS = 3


async def run() -> int:
    engines = simulated_engine_actors(2, label="rollout", token_latency=0.002)
    try:
        await asyncio.gather(*(e.ping.remote() for e in engines))
        server = RolloutServer([EngineGroup("rollout", engines, needs_offload=False)])
        requests = []
        for sync in range(1, SYNCS + 1):
            requests += [
                engines[i % 2].generate.remote(
                    {"input_ids": [sync, i], "sampling_params": {"max_new_tokens": 50}}
                )
                for i in range(6)
            ]
            await asyncio.sleep(0.03)  # decoding is under way
            async with server.paused():
                assert server.state is ServerState.DRAINED
                await server.update_weights(FromDisk(f"/ckpt/{sync}"), version=f"v{sync}")
            assert server.state is ServerState.SERVING

        answers = await asyncio.gather(*requests)
        finished = [a["meta_info"]["finish_reason"]["type"] for a in answers]
        retracted = sum(a["meta_info"]["num_retractions"] > 0 for a in answers)
        histories = await asyncio.gather(*(e.history.remote() for e in engines))
        ops = [entry["op"] for history in histories for entry in history]
        versions = await asyncio.gather(*(e.weight_version.remote() for e in engines))
        assert finished == ["length"] * len(answers), finished
        assert "release_memory_occupation" not in ops and "resume_memory_occupation" not in ops
        assert ops.count("pause_generation") == ops.count("continue_generation") == 2 * SYNCS
        assert versions == [f"v{SYNCS}"] * 2, versions
        print(
            f"weight_sync: {SYNCS} syncs under paused(), {len(answers)} requests completed "
            f"({retracted} retracted across a sync, none aborted), 0 releases, engines on "
            f"{versions[0]}, state {server.state.value}"
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
