"""The ``rollout-lifecycle`` command: ``demo`` runs colocated RL steps on local Ray.

The demo starts a local Ray cluster and simulated SGLang engines, keeps generation traffic in
flight, and runs offload / onload-weights / weight update / onload-KV cycles through a
``RolloutServer``. It prints what happened and exits non-zero if any invariant broke.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence

from rollout_lifecycle._config import LifecycleConfig, PauseMode
from rollout_lifecycle._group import EngineGroup
from rollout_lifecycle._server import RolloutServer, WeightUpdate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run colocated RL steps on local Ray with simulated engines")
    demo.add_argument("--steps", type=int, default=3, help="RL steps to run (default 3)")
    demo.add_argument("--groups", type=int, default=2, help="engine groups (default 2)")
    demo.add_argument("--engines", type=int, default=2, help="engines per group (default 2)")
    demo.add_argument(
        "--requests", type=int, default=16, help="generate requests in flight per step"
    )
    demo.add_argument(
        "--pause-mode",
        choices=[PauseMode.RETRACT.value, PauseMode.ABORT.value],
        default=PauseMode.RETRACT.value,
    )
    demo.add_argument("--seed", type=int, default=0)
    return parser


def _positive(name: str, value: int, limit: int) -> None:
    if not 1 <= value <= limit:
        raise SystemExit(f"rollout-lifecycle: --{name} must be between 1 and {limit}, got {value}")


async def _demo(args: argparse.Namespace) -> int:
    import ray

    from rollout_lifecycle.testing import cycle_order_violations, simulated_engine_actors

    latency = {
        "pause_generation": (0.001, 0.01),
        "flush_cache": (0.001, 0.01),
        "release_memory_occupation": (0.01, 0.05),
        "resume_memory_occupation": (0.01, 0.05),
        "continue_generation": (0.001, 0.005),
    }
    groups: list[EngineGroup] = []
    for g in range(args.groups):
        actors = simulated_engine_actors(
            args.engines,
            label=f"g{g}",
            seed=args.seed + 100 * g,
            token_latency=0.004,
            op_latency=latency,
        )
        groups.append(EngineGroup(f"group{g}", actors, needs_offload=True))
    server = RolloutServer(groups, LifecycleConfig(pause_mode=PauseMode(args.pause_mode)))
    handles = [h for g in groups for h in g.engines]
    await asyncio.gather(*(h.ping.remote() for h in handles))
    print(
        f"demo: {args.groups} group(s) x {args.engines} simulated engine(s) on local Ray, "
        f"pause mode {args.pause_mode}, {args.steps} step(s), {args.requests} requests per step"
    )
    header = (
        f"{'step':>4} {'offload_s':>9} {'weights_s':>9} {'update_s':>9} {'kv_s':>8} "
        f"{'done':>5} {'aborted':>7} {'retracted':>9} {'state':>8}"
    )
    print(header)
    failures = 0
    for step in range(1, args.steps + 1):
        requests = [
            handles[i % len(handles)].generate.remote(
                {"input_ids": [step, i], "sampling_params": {"max_new_tokens": 40 + i % 24}}
            )
            for i in range(args.requests)
        ]
        await asyncio.sleep(0.05)  # let decoding start, so the offload meets requests in flight
        offload = await server.offload()
        await asyncio.sleep(0.05)  # the trainer's turn on the GPU
        weights = await server.onload_weights()

        async def push(update: WeightUpdate) -> None:
            await asyncio.gather(
                *(
                    h.update_weights_from_disk.remote(f"/ckpt/{update.version}", update.version)
                    for h in update.engines.values()
                )
            )

        update = await server.update_weights(push, version=f"step-{step}")
        kv = await server.onload_kv()
        results = await asyncio.wait_for(asyncio.gather(*requests), timeout=60)
        aborted = sum(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
        retracted = sum(r["meta_info"]["num_retractions"] > 0 for r in results)
        print(
            f"{step:>4} {offload['lifecycle/offload/total_s']:>9.3f} "
            f"{weights['lifecycle/onload_weights/total_s']:>9.3f} "
            f"{update['lifecycle/update_weights/total_s']:>9.3f} "
            f"{kv['lifecycle/onload_kv/total_s']:>8.3f} {len(results) - aborted:>5} "
            f"{aborted:>7} {retracted:>9} {server.state.value:>8}"
        )
        if args.pause_mode == PauseMode.RETRACT.value and aborted:
            print(f"  ! step {step}: {aborted} request(s) aborted under retract")
            failures += 1
    histories = {rec.id: await rec.handle.history.remote() for g in groups for rec in g.records}
    versions = await asyncio.gather(*(h.weight_version.remote() for h in handles))
    problems = cycle_order_violations(histories)
    expected = f"step-{args.steps}"
    if any(v != expected for v in versions):
        problems.append(f"weight versions {versions}, expected all {expected!r}")
    for problem in problems:
        print(f"  ! invariant broken: {problem}")
    ops = sum(len(h) for h in histories.values())
    print(
        f"checked {ops} engine ops across {len(histories)} engines: "
        f"{'all invariants held' if not problems and not failures else 'INVARIANTS BROKEN'}; "
        f"final state {server.state.value}, weight version {versions[0]}"
    )
    for handle in handles:
        ray.kill(handle)
    return 1 if problems or failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-lifecycle`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        _positive("steps", args.steps, 1000)
        _positive("groups", args.groups, 8)
        _positive("engines", args.engines, 16)
        _positive("requests", args.requests, 10_000)
        import ray

        started = time.monotonic()
        ray.init(
            num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False
        )
        try:
            code = asyncio.run(_demo(args))
        finally:
            ray.shutdown()
        print(f"demo finished in {time.monotonic() - started:.1f}s")
        return code
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
