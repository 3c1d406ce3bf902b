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
"""

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
        help="run colocated RL steps on local Ray with simulated engines",
        description=DESCRIPTION.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="faults:\n"
        + "\n".join(f"  {name}: {text}" for name, text in FAULT_HELP.items())
        + f"\n\nfiles written to --out: {', '.join(OUTPUTS.values())}",
    )
    demo.add_argument("--steps", type=int, default=3, help="RL steps to run (default 3)")
    demo.add_argument(
        "--groups", type=int, default=None, help="engine groups (default 2; real servers 1)"
    )
    demo.add_argument("--engines", type=int, default=None, help="engines per group (default 2)")
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
        "real SGLang servers",
        "run the steps on real SGLang servers the demo launches and stops (no fault injection)",
    )
    real.add_argument(
        "--sglang-python",
        metavar="PY",
        help="the interpreter that has sglang installed; with --model, use real servers",
    )
    real.add_argument("--model", metavar="PATH", help="the model every server loads")
    real.add_argument(
        "--sglang-args",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra sglang.launch_server arguments, split like a shell does; repeatable (use "
        "--sglang-args=--flag for a single flag)",
    )
    real.add_argument(
        "--sglang-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for every server process; repeatable",
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


__all__ = ["DESCRIPTION", "FAULTS", "FAULT_HELP", "OUTPUTS", "add_parser"]
