"""``rollout-lifecycle ctl`` drives real SGLang or vLLM servers from a shell; ``diagram`` draws
the machine.

Each ``ctl`` run is one lifecycle call of a ``RolloutServer`` whose engines are
``SGLangHTTPEngine`` backends, or ``VLLMHTTPEngine`` ones with ``--engine-kind vllm``, in this
process (no Ray), so every guard applies. SGLang cannot say which memory tags it holds
released, so the server's ledger lives in a state file between runs:
each run adopts it (``RolloutServer.adopt``), makes its call and writes it back atomically, and
during the call the server's journal rewrites it before every send that must not repeat and
after every outcome, so that a run killed at any instant (SIGKILL included) leaves a ledger that
refuses the call that could kill an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from rollout_lifecycle.backends.engine import incarnation_of
from rollout_lifecycle.cli.ctl_output import (
    emit,
    events_to_stderr,
    render_drive,
    render_status,
    report_error,
)
from rollout_lifecycle.cli.ctl_state import (
    ACTIONS,
    DEADLINES,
    ENGINE_KINDS,
    ENGINE_NAMES,
    PAUSING_ACTIONS,
    STATE_FORMAT,
    VLLM_KEY_WARNING,
    Backend,
    CtlError,
    ExitCode,
    Setup,
    T,
    check_lock_dir,
    close_backends,
    default_state_path,
    error_of,
    exit_code_of,
    journal_entry,
    locked,
    make_backends,
    make_setup,
    read_ledger,
    record_restarted,
    recorded_incarnation,
    unstale,
    url_of,
    utc_now,
    write_ledger,
)
from rollout_lifecycle.cli.ctl_status import SERVING_PROBE, recorded_row, run_status, serving
from rollout_lifecycle.contract.exceptions import (
    EngineClaimed,
    EngineError,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    PhaseFailed,
    RouterError,
)
from rollout_lifecycle.contract.values import PauseMode
from rollout_lifecycle.core.calls import PUBLIC_CALLS
from rollout_lifecycle.core.config import Deadlines
from rollout_lifecycle.core.group import EngineGroup
from rollout_lifecycle.core.server import RolloutServer, ServerSnapshot
from rollout_lifecycle.core.states import ServerState, mermaid

_CTL_DESCRIPTION = f"""\
Drive SGLang servers (started with --enable-memory-saver) or, with --engine-kind vllm, vLLM
servers (>= 0.32, started with VLLM_SERVER_DEV_MODE=1, and on a GPU with --enable-sleep-mode,
without which a release frees nothing) through the lifecycle, one call per run, through the
same RolloutServer and guards as the library (in this process, no Ray).

Engines: --engine URL (repeatable) and/or --engines-file PATH (one URL per line, '#' comments);
whitespace around a URL (a line end from a file, say) is dropped.
Keys: --admin-key-env VAR / --api-key-env VAR name environment variables; keys are never taken
from the command line and never printed.

vLLM (--engine-kind vllm): engine ids are vllm/<n>; a vLLM older than 0.32 or one without the
lifecycle routes (VLLM_SERVER_DEV_MODE=1) is refused before anything is sent; status reads
/health, /is_paused and the sleep state in /metrics. The state file records the engine kind,
and a run of another --engine-kind than the file's is refused (state). --admin-key-env,
--router and --router-key-env are SGLang's and refused with vllm.
{textwrap.fill(VLLM_KEY_WARNING + ".", width=95)}

The ledger (which engines are paused, flushed, which tags each holds released, the server
state) is kept in a JSON state file, rewritten atomically after every call: --state-file PATH,
or by default $XDG_STATE_HOME/rollout-lifecycle/ctl-<hash of the engine set>.json
(~/.local/state/... without XDG_STATE_HOME). The same engines in any order, and under any
spelling of their URLs (localhost, 127.0.0.1), share it. A state file recording other engines
is refused. With no state file the engines are taken to be serving, which a pausing action
first checks on /ready (vLLM: /health and /is_sleeping); delete a state file only when every
engine is serving again.

During a call the state file is rewritten before every call that must not repeat is sent
(a release or resume: its tags become uncertain) and after every outcome, with the state
'failed' while a call is in flight. A run stopped at any instant, even by SIGKILL, leaves it
exact or uncertain, never wrong: the next run refuses what could kill an engine. Then 'reset'
continues engines whose pause state is unknown; an engine with uncertain tags must be restarted
(SGLang cannot report its tags), and 'reset --restarted URL' records it as serving.

Router: --router URL keeps an sglang-router's workers equal to the engines that serve (taken
out before a pause, which is not sent unless the router confirmed it; put back once they serve
again; the whole set put right at the end of every run); --router-key-env VAR names its
control-plane key.

exit codes:
  0   ok
  2   usage: bad command line or input (option, URL, key variable or a key no HTTP header
      carries, engines file, a lock directory $ROLLOUT_LIFECYCLE_LOCK_DIR that cannot be made)
  3   refused: an illegal transition, a guard, stale weights or the router; no engine was
      changed
  4   failed: a phase failed on some engine; the state file records what happened
  5   unreachable: an engine could not be reached (or a phase failed only on that)
  6   state: the state file is for other engines (or another --engine-kind) or corrupt, or
      there is none and an engine is not serving
  7   busy: another ctl run holds the state file, or another controller drives an engine
  130 interrupted (Ctrl-C) once the phase in flight settled; the state file is written
  143 terminated (SIGTERM) once the phase in flight settled; the state file is written
"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``ctl`` and ``diagram`` commands on the ``rollout-lifecycle`` parser."""
    diagram = sub.add_parser(
        "diagram",
        help="print the lifecycle state diagram (Mermaid, drawn from the transition table)",
        description=(
            "Print the Mermaid state diagram of the lifecycle, drawn from the transition table "
            "the state machine runs on (rollout_lifecycle.mermaid())."
        ),
    )
    diagram.add_argument("--out", metavar="FILE", help="write the diagram to FILE instead")
    ctl = sub.add_parser(
        "ctl",
        help="drive real SGLang or vLLM servers through the lifecycle, one call per run",
        description=_CTL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--engine", action="append", default=[], metavar="URL", help="a server's URL"
    )
    common.add_argument(
        "--engine-kind",
        choices=ENGINE_KINDS,
        default=ENGINE_KINDS[0],
        help=(
            f"what the engines are (default {ENGINE_KINDS[0]}); every engine of a run is one "
            "kind, and the state file records it"
        ),
    )
    common.add_argument("--engines-file", metavar="PATH", help="a file of URLs, one per line")
    common.add_argument(
        "--state-file",
        metavar="PATH",
        help="the ledger (default: see rollout-lifecycle ctl --help)",
    )
    common.add_argument("--admin-key-env", metavar="VAR", help="env var holding the admin key")
    common.add_argument(
        "--api-key-env",
        metavar="VAR",
        help=(
            "env var holding the API key (vLLM's guards only its OpenAI routes, not the "
            "lifecycle routes: keep vLLM on loopback or a private network)"
        ),
    )
    common.add_argument(
        "--router",
        metavar="URL",
        help="an sglang-router in front of the engines: its workers follow the engines that serve",
    )
    common.add_argument(
        "--router-key-env", metavar="VAR", help="env var holding the router's control-plane key"
    )
    common.add_argument(
        "--pause-mode",
        choices=[m.value for m in PauseMode],
        default=PauseMode.RETRACT.value,
        help="how pausing treats requests in flight (default retract: none is lost; wait lets "
        "them finish first, within the pause deadline)",
    )
    defaults = Deadlines()
    shown = ", ".join(f"{name} {getattr(defaults, f):g}" for name, f in DEADLINES.items())
    common.add_argument(
        "--deadline",
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help=f"deadline of a phase on every engine; repeatable (defaults: {shown})",
    )
    common.add_argument(
        "--connect-timeout", type=float, default=5.0, metavar="S", help="seconds to connect (5)"
    )
    common.add_argument(
        "--lock-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for another ctl run on the same state file (30)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument(
        "-v", "--verbose", action="count", default=0, help="lifecycle events on stderr (-vv: all)"
    )
    actions = ctl.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in ACTIONS.items():
        action = actions.add_parser(name, parents=[common], help=text, description=text)
        if name == "reset":
            action.add_argument(
                "--restarted",
                action="append",
                default=[],
                metavar="URL",
                help=(
                    "an engine restarted since the ledger was written (its /ready must be 200; "
                    "vLLM's /health 200 and /is_sleeping false): "
                    "recorded as serving with all memory resident; repeatable"
                ),
            )


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``ctl`` or ``diagram`` command; the exit code."""
    if args.command == "diagram":
        return _diagram(args.out)
    try:
        setup = make_setup(args)
    except CtlError as exc:
        return report_error(args.action, bool(args.json), exc.code, exc.message, None)
    except LifecycleError as exc:  # (one the checks above missed: still one line)
        return report_error(args.action, bool(args.json), exit_code_of(exc), str(exc), None)
    if setup.engine_kind == "vllm" and setup.api_key is not None:
        print(f"rollout-lifecycle ctl {setup.action}: {VLLM_KEY_WARNING}", file=sys.stderr)
    with events_to_stderr(args.verbose):
        try:
            if setup.action == "status":
                code, report = _run_async(lambda: run_status(setup))
            else:
                check_lock_dir()  # the engines' claims need it: refused before anything is sent
                with locked(setup.state_path, setup.lock_timeout):
                    code, report = _run_async(lambda: _drive(setup))
        except CtlError as exc:
            return report_error(setup.action, setup.json, exc.code, exc.message, setup)
        except LifecycleError as exc:  # raised outside the call (its setup, its checks)
            return report_error(setup.action, setup.json, exit_code_of(exc), str(exc), setup)
        except (KeyboardInterrupt, _Terminated) as exc:
            terminated = isinstance(exc, _Terminated)
            message = "terminated (SIGTERM)" if terminated else "interrupted"
            if setup.action != "status":
                message += (
                    "; the phase in flight settled first, and the state file records where "
                    "the engines are"
                )
            stop = ExitCode.TERMINATED if terminated else ExitCode.INTERRUPTED
            return report_error(setup.action, setup.json, stop, message, setup)
    if setup.json:
        emit(json.dumps(report, indent=2))
    else:
        emit(render_status(report) if setup.action == "status" else render_drive(report))
    error = report.get("error")
    if error:
        print(f"rollout-lifecycle ctl {setup.action}: {error['message']}", file=sys.stderr)
    return int(code)


class _Terminated(Exception):
    """SIGTERM stopped the run once the call in flight had settled."""


#: The signal that stopped the run in progress, once one has (SIGTERM; SIGINT is asyncio's).
_STOPPED_BY: list[signal.Signals] = []


def _run_async(make: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(make())`` with SIGTERM handled as asyncio handles SIGINT: the main task is
    cancelled, so the call in flight settles (``RolloutServer`` stops at its next boundary)
    and the ledger is written; then ``_Terminated``. A second SIGTERM changes nothing."""

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def terminate() -> None:
            if not _STOPPED_BY:
                _STOPPED_BY.append(signal.SIGTERM)
                task.cancel()

        _STOPPED_BY.clear()
        loop.add_signal_handler(signal.SIGTERM, terminate)
        try:
            return await make()
        except asyncio.CancelledError:
            if _STOPPED_BY:
                raise _Terminated from None
            raise
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    return asyncio.run(main())


def _diagram(out: str | None) -> int:
    text = mermaid()
    if out is None:
        emit(text, end="")
        return 0
    try:
        Path(out).write_text(text)
    except OSError as exc:
        print(f"rollout-lifecycle diagram: cannot write {out}: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    return 0


async def _check_serving(setup: Setup, urls: Sequence[str]) -> None:
    """With no ledger, an engine counts as serving (all memory resident) only if its probe
    (SGLang's ``/ready``; vLLM's ``/health`` and ``/is_sleeping``) says so; a paused one may hold
    tags released, and releasing them again would kill it."""
    answers = await serving(setup, urls)
    down = [f"{u} ({why})" for u, (ok, why) in zip(urls, answers, strict=True) if ok is None]
    if down:
        raise CtlError(ExitCode.UNREACHABLE, f"engines not reachable: {', '.join(down)}")
    busy = [f"{u} ({why})" for u, (ok, why) in zip(urls, answers, strict=True) if ok is False]
    if busy:
        probe = SERVING_PROBE[setup.engine_kind]
        raise CtlError(
            ExitCode.STATE,
            f"no state file at {setup.state_path}, and by {probe} these engines do not serve "
            f"(paused or unhealthy): {', '.join(busy)}; what memory they hold released is "
            f"unknown. Give the state file that recorded it, or bring every engine back to "
            f"serving first",
        )


async def _restarted(
    setup: Setup, urls: Sequence[str], ledger: dict[str, Any]
) -> dict[str, str | None]:
    """The incarnation each ``--restarted`` engine shows now, once each shows it is a new
    process (not the one the state file records) that serves with all its memory resident."""
    answers = await serving(setup, setup.restarted)
    busy = [f"{u} ({why})" for u, (ok, why) in zip(setup.restarted, answers, strict=True) if not ok]
    if busy:
        raise CtlError(
            ExitCode.STATE,
            f"--restarted: by {SERVING_PROBE[setup.engine_kind]} these engines do not serve: "
            f"{', '.join(busy)}; a restarted server serves with all its memory resident",
        )
    backends = make_backends(setup, setup.restarted, retries=0)
    try:
        infos = await asyncio.gather(*(b.server_info() for b in backends), return_exceptions=True)
    finally:
        await close_backends(backends)
    seen: dict[str, str | None] = {}
    for url, info in zip(setup.restarted, infos, strict=True):
        if isinstance(info, BaseException):
            raise CtlError(ExitCode.UNREACHABLE, f"--restarted: {url}: {info}")
        found = incarnation_of(info)
        if found is not None and found == recorded_incarnation(ledger, urls, url, setup.group):
            raise CtlError(
                ExitCode.STATE,
                f"--restarted: {url} was not restarted: it is the process the state file "
                f"records (incarnation {found}); a call in flight to it may have landed, so "
                f"restart the server before recording it as new",
            )
        seen[url] = found
    return seen


async def _check_versions(kind: str, backends: Sequence[Backend]) -> None:
    """The attach check on every engine before the call, and nothing is sent when one is
    refused: an SGLang older than 0.5.22 (or one that reports no version); a vLLM older than
    0.32 or one without the lifecycle routes (no ``VLLM_SERVER_DEV_MODE=1``:
    ``VLLMHTTPEngine.check_version``). An engine that cannot be asked is left to the call,
    which reports it as unreachable or dead."""
    results = await asyncio.gather(*(b.check_version() for b in backends), return_exceptions=True)
    refused = [r.reason for r in results if isinstance(r, IllegalEngineOp)]
    if refused:
        names = [
            b.url for b, r in zip(backends, results, strict=True) if isinstance(r, IllegalEngineOp)
        ]
        detail = "; ".join(f"{u}: {why}" for u, why in zip(names, refused, strict=True))
        raise CtlError(ExitCode.REFUSED, f"unsupported {ENGINE_NAMES[kind]}: {detail}")
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, EngineError):
            raise result


async def _reset(server: RolloutServer) -> dict[str, float]:
    """``reset``, after what a stopped run left behind that can be settled without a restart.

    An engine with uncertain tags is refused (SGLang cannot say whether a release or resume it
    got landed; a second one kills it). Records that imply no single state because a stopped
    run left a pause or continue unanswered, or a drain unflushed, are healed first: engines
    whose pause state is unknown are continued (``RolloutServer.recover`` with nothing to
    replace), then the server settles in the state the records imply.
    """
    if server.state is not ServerState.FAILED:
        await server.reset()  # refused: reset leaves failed only
        return {}
    engines = server.snapshot().engines().values()
    unknown = {e.id: list(e.uncertain) for e in engines if e.alive and e.uncertain}
    if unknown:
        detail = "; ".join(f"{engine} {tags}" for engine, tags in sorted(unknown.items()))
        raise IllegalEngineOp(
            ", ".join(sorted(unknown)),
            "reset",
            f"tags may or may not be released ({detail}): a call to them was in flight when a "
            f"run stopped, and the engine cannot report them. Restart each such server, then run "
            f"'ctl reset --restarted URL' for it",
        )
    try:
        await server.reset()
    except IllegalTransition:

        def no_replacement(engine_id: str) -> Any:
            raise IllegalEngineOp(
                engine_id,
                "reset",
                "the engine is dead: restart it, then run 'ctl reset --restarted URL'",
            )

        return {
            f"lifecycle/reset/healed_{engine}": 1.0
            for engine, outcome in (await server.recover(no_replacement)).items()
            if outcome.ok
        }
    return {}


#: Each action's call (``PublicCall.ctl``); ``reset`` first resolves what a stopped run left.
_CALLS: dict[str, Callable[[RolloutServer], Awaitable[dict[str, float]]]] = {
    action: _reset if call.name == "reset" else getattr(RolloutServer, call.name)
    for call in PUBLIC_CALLS.values()
    for action in call.ctl
}


async def _drive(setup: Setup) -> tuple[ExitCode, dict[str, Any]]:
    """Adopt the ledger, make the action's call, write the ledger; the exit code and report."""
    urls, ledger = read_ledger(setup.state_path, setup.urls, setup.engine_kind)
    if setup.restarted:
        if ledger is None:
            raise CtlError(
                ExitCode.STATE, f"--restarted: there is no state file at {setup.state_path}"
            )
        record_restarted(ledger, urls, await _restarted(setup, urls, ledger), setup.group)
    if ledger is not None:
        unstale(ledger)
    backends = make_backends(setup, urls)
    recording: list[dict[str, Any]] = []

    def journal(snapshot: ServerSnapshot) -> None:
        # before every send that must not repeat, and after every outcome
        for last in recording:
            write_ledger(setup.state_path, urls, journal_entry(snapshot), last, setup.engine_kind)

    server = RolloutServer(
        [EngineGroup(setup.group, backends)],
        setup.config,
        name="ctl",
        journal=journal,
        router=setup.router,
    )
    try:
        if ledger is not None:
            try:
                server.adopt(ServerSnapshot.from_dict(ledger.get("server", {})))
            except InvalidArgument as exc:
                raise CtlError(
                    ExitCode.STATE, f"state file {setup.state_path} is unusable: {exc}"
                ) from None
        # The attach check first: a vLLM without the lifecycle routes is named as such, not
        # taken for an engine that does not serve.
        if setup.action != "reset":
            await _check_versions(setup.engine_kind, backends)
        if ledger is None and setup.action in PAUSING_ACTIONS:
            await _check_serving(setup, urls)
        # Without a ledger only a checked fleet is recorded: a refused or idle call proves
        # nothing about the engines.
        record = ledger is not None or setup.action in PAUSING_ACTIONS
        if record:
            recording.append(
                {"action": setup.action, "at": utc_now(), "exit_code": None, "in_flight": True}
            )
        before = server.state
        metrics: dict[str, float] = {}
        code, error, outcomes = ExitCode.OK, None, None
        routed: dict[str, list[str]] | None = None
        try:
            metrics = await _CALLS[setup.action](server)
            if setup.router is not None:  # (a router someone else changed is put right too)
                try:
                    routed = await server.sync_router()
                except RouterError as exc:  # the call was made: the engines changed
                    code, error = ExitCode.FAILED, error_of(exc)
        except LifecycleError as exc:
            code, error = exit_code_of(exc), error_of(exc)
            if isinstance(exc, EngineClaimed):  # another controller drives them: nothing sent
                # (a fleet another controller drives may be anywhere by now: a readiness check
                # proves nothing of it, and without a ledger none is started)
                record = ledger is not None
            if isinstance(exc, PhaseFailed):
                outcomes = {
                    engine: {
                        "url": url_of(engine, urls),
                        "outcome": o.outcome.value,
                        "detail": o.detail,
                        "duration_s": round(o.duration_s, 6),
                    }
                    for engine, o in sorted(exc.outcomes.items())
                }
        except asyncio.CancelledError:
            code = ExitCode.TERMINATED if _STOPPED_BY else ExitCode.INTERRUPTED
            stopped = "terminated" if _STOPPED_BY else "interrupted"
            error = {"kind": stopped, "message": f"{stopped} once the phase settled"}
            raise
        finally:
            # Also when cancelled (Ctrl-C, SIGTERM): the phase in flight has settled by now,
            # and the ledger must say what the engines hold.
            recording.clear()
            if record:
                last = {"action": setup.action, "at": utc_now(), "exit_code": int(code)}
                last["error"] = error["message"] if error else None
                try:
                    write_ledger(setup.state_path, urls, server.snapshot(), last, setup.engine_kind)
                except OSError as exc:
                    raise CtlError(
                        ExitCode.STATE, f"cannot write state file {setup.state_path}: {exc}"
                    ) from None
        report: dict[str, Any] = {
            "action": setup.action,
            "exit_code": int(code),
            "ok": code is ExitCode.OK,
            "engine_kind": setup.engine_kind,
            "previous_state": before.value,
            "state": server.state.value,
            "state_file": str(setup.state_path),
            "ledger_found": ledger is not None,
            "ledger_written": record,
            "metrics": metrics,
            "engines": [
                recorded_row(e, url_of(e.id, urls)) for e in server.snapshot().engines().values()
            ],
            "error": error,
        }
        if outcomes is not None:
            report["outcomes"] = outcomes
        if setup.router is not None:
            report["router"] = {"url": setup.router.url, "synced": routed}
        return code, report
    finally:
        await close_backends(backends)
        if setup.router is not None:
            await setup.router.close()


__all__ = ["ACTIONS", "STATE_FORMAT", "ExitCode", "add_parsers", "default_state_path", "run"]
