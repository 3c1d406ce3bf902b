"""The ``rollout-lifecycle`` command: ``demo`` runs colocated RL steps on local Ray.

``fake-sglang`` serves a stand-in SGLang 0.5.23 server (simulated engine, no GPU) on loopback.
``ctl`` drives real SGLang servers through the lifecycle; ``diagram`` prints the state diagram.

The demo starts a local Ray cluster and simulated SGLang engines, keeps generation traffic in
flight, and runs offload / onload-weights / weight update / onload-KV cycles through a
``RolloutServer``. It prints what happened and exits non-zero if any invariant broke.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rollout_lifecycle.cli import ctl as _ctl
from rollout_lifecycle.cli import demo_args as _demo_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_args.add_parser(sub)
    _add_fake_sglang(sub)
    _ctl.add_parsers(sub)
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
            "command line. Needs the 'standin' extra (fastapi, uvicorn, uvloop)."
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
    fake.add_argument("--weight-version", help="initial weight version (default 'default')")
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
    fake.add_argument(
        "--check-model-paths",
        action="store_true",
        help="fail an update from disk whose model path is not a directory, as SGLang does",
    )
    fake.add_argument("--max-running", type=int, help="most requests decoding at once")
    fake.add_argument(
        "--dp-size",
        type=int,
        help="data-parallel ranks it reports (/server_info dp_size); with more than one it "
        "refuses tensor and collective weight writes, as SGLang does",
    )
    fake.add_argument(
        "--disaggregation-mode",
        choices=("null", "prefill", "decode"),
        help="what /server_info says it serves as (a prefill or decode half, or null)",
    )
    fake.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        help="the prefill server's bootstrap port /server_info names (default 8998)",
    )
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
    from rollout_lifecycle.contract.exceptions import InvalidArgument

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
    for name in (
        "token_latency",
        "seed",
        "health_timeout",
        "weight_version",
        "max_running",
        "dp_size",
        "disaggregation_mode",
        "disaggregation_bootstrap_port",
    ):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.gpu_memory_bytes is not None:
        options["gpu_memory_bytes"] = args.gpu_memory_bytes
    options["weights_cpu_backup"] = args.weights_cpu_backup
    options["dp_dummy_batches"] = args.dp_dummy_batches
    options["check_model_paths"] = args.check_model_paths
    from rollout_lifecycle.testing.standin import DEFAULT_MODEL_PATH, serve

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rollout-lifecycle`` console script."""
    args = _parser().parse_args(argv)
    if args.command in ("ctl", "diagram"):
        return _ctl.run(args)
    if args.command == "fake-sglang":
        return _fake_sglang(args)
    if args.command == "demo":
        from rollout_lifecycle.cli import demo  # (needs Ray: imported only to run it)

        return demo.run(args)
    return 2  # pragma: no cover - argparse rejects unknown commands
