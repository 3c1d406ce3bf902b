"""The ``rollout-lifecycle`` command: ``demo`` runs colocated RL steps on local Ray.

``fake-sglang`` serves a stand-in SGLang 0.5.23 server (simulated engine, no GPU) on loopback.

The demo starts a local Ray cluster and simulated SGLang engines, keeps generation traffic in
flight, and runs offload / onload-weights / weight update / onload-KV cycles through a
``RolloutServer``. It prints what happened and exits non-zero if any invariant broke.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
    _add_fake_sglang(sub)
    return parser


def _add_fake_sglang(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fake = sub.add_parser(
        "fake-sglang",
        help="serve a stand-in SGLang 0.5.23 server (simulated engine, no GPU) on loopback",
        description=(
            "Serve SGLang 0.5.23's lifecycle routes in front of a simulated engine. Misuse kills "
            "it as it kills SGLang: the process exits with status 70. With --port 0 it prints "
            "'FAKE_SGLANG_READY port=N' once it accepts connections. Keys are read from the "
            "environment variables named by --admin-key-env / --api-key-env, never from the "
            "command line. Needs the 'standin' extra (fastapi, uvicorn)."
        ),
    )
    fake.add_argument("--port", type=int, required=True, help="port to listen on; 0: any free")
    fake.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    fake.add_argument(
        "--allow-remote", action="store_true", help="allow a host that is not a loopback address"
    )
    fake.add_argument("--admin-key-env", metavar="VAR", help="env var holding the admin API key")
    fake.add_argument("--api-key-env", metavar="VAR", help="env var holding the API key")
    fake.add_argument("--label", default="fake-sglang", help="engine name in history and errors")
    fake.add_argument("--token-latency", type=float, metavar="S", help="seconds per decode step")
    fake.add_argument(
        "--op-latency",
        nargs="+",
        action="extend",
        default=[],
        metavar="OP=SECONDS",
        help="latency of a lifecycle op: OP=S or OP=LOW,HIGH (uniform); repeatable",
    )
    fake.add_argument("--seed", type=int, help="seed of the latency draws")
    fake.add_argument(
        "--health-timeout", type=float, metavar="S", help="seconds before /health answers 503"
    )
    fake.add_argument("--history-file", metavar="PATH", help="append every op here as JSON lines")
    fake.add_argument("--weight-version", help="initial weight version (default '0')")
    fake.add_argument("--model-path", help="model_path reported by /model_info")
    fake.add_argument(
        "--weights-cpu-backup",
        action="store_true",
        help="keep weights valid across release/resume (--enable-weights-cpu-backup)",
    )
    fake.add_argument(
        "--dp-dummy-batches",
        action="store_true",
        help="run data-parallel dummy batches when idle (they die on released memory)",
    )
    fake.add_argument("--max-running", type=int, help="most requests decoding at once")
    fake.add_argument("--gpu-memory-bytes", type=int, help="GPU size; resume beyond it dies (OOM)")
    fake.add_argument(
        "--memory-bytes",
        nargs="+",
        action="extend",
        default=[],
        metavar="TAG=BYTES",
        help="resident bytes of a memory tag; repeatable",
    )


def _fail(message: str) -> int:
    print(f"rollout-lifecycle fake-sglang: {message}", file=sys.stderr)
    return 2


def _pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{flag} wants NAME=VALUE, got {item!r}")
        pairs.append((name, value))
    return pairs


def _fake_sglang(args: argparse.Namespace) -> int:
    from rollout_lifecycle._exceptions import InvalidArgument

    keys: dict[str, str | None] = {"admin": None, "api": None}
    for kind, var in (("admin", args.admin_key_env), ("api", args.api_key_env)):
        if var is None:
            continue
        value = os.environ.get(var)
        if not value:
            flag = f"--{kind}-key-env"
            return _fail(f"environment variable {var} (named by {flag}) is not set or is empty")
        keys[kind] = value
    options: dict[str, object] = {"label": args.label}
    try:
        latency: dict[str, float | tuple[float, float]] = {}
        for op, value in _pairs(args.op_latency, "--op-latency"):
            low, comma, high = value.partition(",")
            latency[op] = (float(low), float(high)) if comma else float(value)
        memory = {tag: int(n) for tag, n in _pairs(args.memory_bytes, "--memory-bytes")}
    except ValueError as exc:
        return _fail(str(exc))
    if latency:
        options["op_latency"] = latency
    if memory:
        options["memory_bytes"] = memory
    for name in ("token_latency", "seed", "health_timeout", "weight_version", "max_running"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.gpu_memory_bytes is not None:
        options["gpu_memory_bytes"] = args.gpu_memory_bytes
    options["weights_cpu_backup"] = args.weights_cpu_backup
    options["dp_dummy_batches"] = args.dp_dummy_batches
    from rollout_lifecycle._standin import DEFAULT_MODEL_PATH, serve

    try:
        return serve(
            host=args.host,
            port=args.port,
            api_key=keys["api"],
            admin_key=keys["admin"],
            engine_options=options,
            history_file=args.history_file,
            model_path=args.model_path or DEFAULT_MODEL_PATH,
            allow_remote=args.allow_remote,
        )
    except (InvalidArgument, ImportError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc}")


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
    if args.command == "fake-sglang":
        return _fake_sglang(args)
    if args.command == "demo":
        _positive("steps", args.steps, 1000)
        _positive("groups", args.groups, 8)
        _positive("engines", args.engines, 16)
        _positive("requests", args.requests, 10_000)
        from rollout_lifecycle.testing import local_ray

        started = time.monotonic()
        with local_ray():
            code = asyncio.run(_demo(args))
        print(f"demo finished in {time.monotonic() - started:.1f}s")
        return code
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
