"""The ``rollout-lifecycle demo`` command line: its parser, its faults and the files it writes.

Kept apart from the demo itself (``demo.py``, which needs Ray) so that building the
``rollout-lifecycle`` parser, and so every ``ctl`` run, imports no Ray.
"""

from __future__ import annotations

import argparse

from rollout_lifecycle.contract.values import PauseMode

#: The command's description (``rollout-lifecycle demo --help``).
DESCRIPTION = """\
The ``rollout-lifecycle demo`` command: colocated RL steps on local Ray, checked and drawn.

It starts simulated SGLang engines as Ray actors (with ``--http`` each behind a stand-in SGLang
server on loopback), keeps generation traffic in flight through ``RolloutServer.generate_batch``
and runs offload -> onload weights -> versioned weight update -> onload KV every step, with a
fault the library has to handle if asked. It prints a line per call on stderr and a table of the
steps on stdout, writes the Chrome trace, the Gantt chart, the state diagram and the metrics to
``--out``, checks the invariants on the engines' own histories and exits 1 if one broke.

With ``--sglang-python PY --model PATH`` the engines are real SGLang servers instead, started
by the demo (``launched_sglang_factory``, one per engine, on free loopback ports) and stopped
when it ends; ``--sglang-args`` and ``--sglang-env`` add server flags and environment (a CPU
machine needs e.g. ``--sglang-args "--device cpu --disable-cuda-graph ..."``). A real server
keeps no history of the ops it received, so the barriers are checked on the calls the
library's timeline recorded; the fault injection needs the simulated engines and is left out.

With ``--vllm-python PY --model PATH`` the engines are real vLLM (0.32 or newer) servers
(``launched_vllm_factory``; ``VLLM_SERVER_DEV_MODE=1`` is always set), with ``--vllm-args`` and
``--vllm-env`` for their flags and environment. A CPU machine needs e.g. ``--vllm-args
"--enforce-eager --dtype float32 --distributed-executor-backend uni" --vllm-env
VLLM_CPU_KVCACHE_SPACE=1 --vllm-env VLLM_ENABLE_V1_MULTIPROCESSING=0 --vllm-env
OMP_NUM_THREADS=1``: the demo adds none of these itself. With both ``--sglang-python`` and
``--vllm-python`` the fleet is mixed: one SGLang group and one vLLM group (``--engines``
servers each) in the same ``RolloutServer``, every barrier across both. A real engine group is
named after its kind (``sglang0``, ``vllm0``): its engines are ``sglang0/0``, ``vllm0/0`` in
the trace, the chart and the table.
"""

#: The kinds of real servers the demo launches, in the order of their groups.
REAL_KINDS: tuple[str, ...] = ("sglang", "vllm")


#: What the output calls each kind of engine.
KIND_NAMES = {
    "simulated": "simulated engine",
    "standin": "stand-in SGLang server",
    "sglang": "real SGLang server",
    "vllm": "real vLLM server",
}

#: What ``--inject-fault`` can do to one engine (engine 0 of group 0, in step 2 or the last).
FAULTS: tuple[str, ...] = ("none", "slow-flush", "flush-reject", "engine-death")


FAULT_HELP = {
    "slow-flush": "its flush answers 0.4 s late: every engine waits at the idle barrier",
    "flush-reject": "its flush is refused (5xx): nothing is released anywhere, the server "
    "fails, reset() brings it back to serving and the offload is run again",
    "engine-death": "it dies in the release: the server fails with what was released recorded; "
    "recover() replaces it, brings the replacement to 'released' and the step goes on",
}


#: The files ``--out`` receives.
OUTPUTS = {
    "trace": "trace.json",
    "gantt": "timeline.png",
    "diagram": "lifecycle.mmd",
    "metrics": "metrics.json",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand to the ``rollout-lifecycle`` parser."""
    demo = sub.add_parser(
        "demo",
        help="run colocated RL steps on local Ray: simulated engines, or real SGLang/vLLM servers",
        description=DESCRIPTION.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="faults:\n"
        + "\n".join(f"  {name}: {text}" for name, text in FAULT_HELP.items())
        + f"\n\nfiles written to --out: {', '.join(OUTPUTS.values())}",
    )
    demo.add_argument("--steps", type=int, default=3, help="RL steps to run (default 3)")
    demo.add_argument(
        "--groups",
        type=int,
        default=None,
        help="engine groups (default 2; real servers 1; a mixed fleet has 2)",
    )
    demo.add_argument(
        "--engines", type=int, default=None, help="engines per group (default 2; a mixed fleet 1)"
    )
    demo.add_argument(
        "--requests",
        type=int,
        default=None,
        help="generate requests in flight per step (default 16; real servers 6)",
    )
    demo.add_argument(
        "--pause-mode",
        choices=[PauseMode.RETRACT.value, PauseMode.ABORT.value],
        default=PauseMode.RETRACT.value,
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--http",
        action="store_true",
        help="put each engine behind a stand-in SGLang server on loopback (needs the standin "
        "extra); the engine actors speak SGLang's HTTP API to them",
    )
    demo.add_argument(
        "--inject-fault", choices=FAULTS, default="none", help="a fault the library must handle"
    )
    demo.add_argument(
        "--router",
        metavar="URL",
        help="send the traffic through this sglang-router, whose workers the server keeps equal "
        "to the engines that serve ('launch': start one on loopback); needs --http or real "
        "servers, and the router extra",
    )
    real = demo.add_argument_group(
        "real servers",
        "run the steps on real SGLang and/or vLLM servers the demo launches and stops (no fault "
        "injection); with both interpreters, one SGLang group and one vLLM group",
    )
    real.add_argument(
        "--sglang-python",
        metavar="PY",
        help="the interpreter that has sglang installed; with --model, use real SGLang servers",
    )
    real.add_argument(
        "--vllm-python",
        metavar="PY",
        help="the interpreter that has vllm (0.32 or newer) installed; with --model, use real "
        "vLLM servers",
    )
    real.add_argument("--model", metavar="PATH", help="the model every server loads")
    for kind, module in (
        ("sglang", "sglang.launch_server"),
        ("vllm", "vllm.entrypoints.openai.api_server"),
    ):
        real.add_argument(
            f"--{kind}-args",
            action="append",
            default=[],
            metavar="ARGS",
            help=f"extra {module} arguments, split like a shell does; repeatable (use "
            f"--{kind}-args=--flag for a single flag)",
        )
        real.add_argument(
            f"--{kind}-env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"an environment variable for every {kind} server process; repeatable",
        )
    demo.add_argument(
        "--out",
        default="demo-output",
        metavar="DIR",
        help="where to write the trace, the Gantt chart, the diagram and the metrics "
        "(default ./demo-output)",
    )
    # Test hook: at the fault step, continue one engine directly (bypassing the server) while
    # its KV cache is released, so that a test sees the invariant checks catch a real breach.
    demo.add_argument("--sabotage", action="store_true", help=argparse.SUPPRESS)


__all__ = [
    "DESCRIPTION",
    "FAULTS",
    "FAULT_HELP",
    "KIND_NAMES",
    "OUTPUTS",
    "REAL_KINDS",
    "add_parser",
]
