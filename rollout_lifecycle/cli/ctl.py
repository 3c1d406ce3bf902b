"""``rollout-lifecycle ctl`` drives real SGLang servers from a shell; ``diagram`` draws the machine.

Each ``ctl`` run is one lifecycle call of a ``RolloutServer`` whose engines are
``SGLangHTTPEngine`` backends in this process (no Ray), so every guard applies. SGLang cannot say
which memory tags it holds released, so the server's ledger lives in a state file between runs:
each run adopts it (``RolloutServer.adopt``), makes its call and writes it back atomically, and
during the call the server's journal rewrites it before every send that must not repeat and
after every outcome, so that a run killed at any instant (SIGKILL included) leaves a ledger that
refuses the call that could kill an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rollout_lifecycle.backends.http import (
    HTTPTimeouts,
    SGLangHTTPEngine,
    check_seconds,
    url_identity,
)
from rollout_lifecycle.backends.secret import Secret
from rollout_lifecycle.core.config import Deadlines, LifecycleConfig, PauseMode
from rollout_lifecycle.core.events import LOGGER_NAME
from rollout_lifecycle.core.exceptions import (
    EngineError,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    PhaseFailed,
    StaleWeights,
)
from rollout_lifecycle.core.group import EngineGroup, EngineSnapshot
from rollout_lifecycle.core.outcome import Outcome
from rollout_lifecycle.core.server import RolloutServer, ServerSnapshot
from rollout_lifecycle.core.states import ServerState, mermaid

T = TypeVar("T")

#: The one group every ``ctl`` fleet forms; engine ids are ``sglang/<index in the ledger>``.
GROUP = "sglang"
#: The ``format`` field of a state file this version reads and writes.
STATE_FORMAT = "rollout-lifecycle-ctl/1"


class ExitCode(IntEnum):
    """What a ``ctl`` run exits with; scripts can rely on these."""

    OK = 0
    #: Bad command line or input: unknown option, bad URL, unset key variable, unreadable file.
    USAGE = 2
    #: Refused by the lifecycle (illegal transition, a guard, stale weights): nothing was sent.
    REFUSED = 3
    #: A phase failed on some engine (rejected, timed out, ...); the ledger records what happened.
    FAILED = 4
    #: An engine could not be reached (``status``), or a phase failed only because engines were
    #: dead or unreachable.
    UNREACHABLE = 5
    #: The state file is unusable: another engine set, corrupt, or (with no state file) an engine
    #: that is not serving, so its memory state cannot be known.
    STATE = 6
    #: Another ``ctl`` run holds the state file's lock.
    BUSY = 7
    #: Interrupted (Ctrl-C) after the phase in flight settled; the ledger was written.
    INTERRUPTED = 130
    #: Terminated (SIGTERM) after the phase in flight settled; the ledger was written.
    TERMINATED = 143


#: The ``ctl`` actions and what each does.
ACTIONS: dict[str, str] = {
    "status": (
        "show every engine as observed (only /server_info, /model_info and /ready, never "
        "/health) next to the recorded ledger"
    ),
    "pause": (
        "pause generation on every engine, then pass the flush barrier unless --pause-mode is "
        "in_place (RolloutServer.pause: serving -> drained); nothing is released"
    ),
    "drain": (
        "pause every engine and pass the flush barrier, so every engine is idle (serving -> "
        "drained); nothing is released; refuses --pause-mode in_place"
    ),
    "offload": (
        "pause, flush, then release weights, KV cache and CUDA graphs on every engine "
        "(RolloutServer.offload: serving or drained -> released)"
    ),
    "onload-weights": (
        "resume the weights (released -> weights_restored); the KV cache stays released and "
        "generation paused"
    ),
    "onload-kv": (
        "resume the KV cache and CUDA graphs, then continue generation (weights_restored -> "
        "serving)"
    ),
    "resume": "continue generation (drained or kv_restored -> serving)",
    "reset": (
        "leave failed for the state the recorded engine records imply (RolloutServer.reset); "
        "engines a stopped run left with their pause state unknown are continued first. "
        "--restarted URL records an engine as restarted (serving, all memory resident)"
    ),
}

_PAUSING_ACTIONS = ("pause", "drain", "offload")
#: ``--deadline`` phase names -> ``Deadlines`` fields.
_DEADLINES = {
    "pause": "pause",
    "flush": "flush",
    "release": "release",
    "resume": "resume",
    "continue": "continue_",
    "probe": "probe",
}

_CTL_DESCRIPTION = """\
Drive SGLang servers (started with --enable-memory-saver) through the lifecycle, one call per
run, through the same RolloutServer and guards as the library (in this process, no Ray).

Engines: --engine URL (repeatable) and/or --engines-file PATH (one URL per line, '#' comments).
Keys: --admin-key-env VAR / --api-key-env VAR name environment variables; keys are never taken
from the command line and never printed.

The ledger (which engines are paused, flushed, which tags each holds released, the server
state) is kept in a JSON state file, rewritten atomically after every call: --state-file PATH,
or by default $XDG_STATE_HOME/rollout-lifecycle/ctl-<hash of the engine set>.json
(~/.local/state/... without XDG_STATE_HOME). The same engines in any order, and under any
spelling of their URLs (localhost, 127.0.0.1), share it. A state file recording other engines
is refused. With no state file the engines are taken to be serving, which a pausing action
first checks on /ready; delete a state file only when every engine is serving again.

During a call the state file is rewritten before every call that must not repeat is sent
(a release or resume: its tags become uncertain) and after every outcome, with the state
'failed' while a call is in flight. A run stopped at any instant, even by SIGKILL, leaves it
exact or uncertain, never wrong: the next run refuses what could kill an engine. Then 'reset'
continues engines whose pause state is unknown; an engine with uncertain tags must be restarted
(SGLang cannot report its tags), and 'reset --restarted URL' records it as serving.

exit codes:
  0   ok
  2   usage: bad command line or input (option, URL, key variable, engines file)
  3   refused: an illegal transition, a guard or stale weights; no engine was changed
  4   failed: a phase failed on some engine; the state file records what happened
  5   unreachable: an engine could not be reached (or a phase failed only on that)
  6   state: the state file is for other engines or corrupt, or there is none and an
      engine is not serving
  7   busy: another ctl run holds the state file
  130 interrupted (Ctrl-C) once the phase in flight settled; the state file is written
  143 terminated (SIGTERM) once the phase in flight settled; the state file is written
"""


class CtlError(Exception):
    """A ``ctl`` run stops with ``code`` and ``message`` (no key is ever in it)."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ------------------------------------------------------------------------------- parsers


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
        help="drive real SGLang servers through the lifecycle, one call per run",
        description=_CTL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--engine", action="append", default=[], metavar="URL", help="an SGLang server's URL"
    )
    common.add_argument("--engines-file", metavar="PATH", help="a file of URLs, one per line")
    common.add_argument(
        "--state-file",
        metavar="PATH",
        help="the ledger (default: see rollout-lifecycle ctl --help)",
    )
    common.add_argument("--admin-key-env", metavar="VAR", help="env var holding the admin key")
    common.add_argument("--api-key-env", metavar="VAR", help="env var holding the API key")
    common.add_argument(
        "--pause-mode",
        choices=[m.value for m in PauseMode],
        default=PauseMode.RETRACT.value,
        help="how pausing treats requests in flight (default retract: none is lost)",
    )
    defaults = Deadlines()
    shown = ", ".join(f"{name} {getattr(defaults, f):g}" for name, f in _DEADLINES.items())
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
                    "an engine restarted since the ledger was written (its /ready must be 200): "
                    "recorded as serving with all memory resident; repeatable"
                ),
            )


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``ctl`` or ``diagram`` command; the exit code."""
    if args.command == "diagram":
        return _diagram(args.out)
    try:
        setup = _setup(args)
    except CtlError as exc:
        return _report_error(args.action, bool(args.json), exc.code, exc.message, None)
    with _events_to_stderr(args.verbose):
        try:
            if setup.action == "status":
                code, report = _run_async(lambda: _status(setup))
            else:
                with _lock(setup.state_path, setup.lock_timeout):
                    code, report = _run_async(lambda: _drive(setup))
        except CtlError as exc:
            return _report_error(setup.action, setup.json, exc.code, exc.message, setup)
        except (KeyboardInterrupt, _Terminated) as exc:
            terminated = isinstance(exc, _Terminated)
            message = "terminated (SIGTERM)" if terminated else "interrupted"
            if setup.action != "status":
                message += (
                    "; the phase in flight settled first, and the state file records where "
                    "the engines are"
                )
            stop = ExitCode.TERMINATED if terminated else ExitCode.INTERRUPTED
            return _report_error(setup.action, setup.json, stop, message, setup)
    if setup.json:
        _out(json.dumps(report, indent=2))
    else:
        _out(_render_status(report) if setup.action == "status" else _render_drive(report))
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
        _out(text, end="")
        return 0
    try:
        Path(out).write_text(text)
    except OSError as exc:
        print(f"rollout-lifecycle diagram: cannot write {out}: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    return 0


# ------------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class _Setup:
    action: str
    urls: tuple[str, ...]
    admin_key: Secret | None
    api_key: Secret | None
    config: LifecycleConfig
    timeouts: HTTPTimeouts
    state_path: Path
    lock_timeout: float
    json: bool
    #: ``reset --restarted``: engines restarted since the ledger was written.
    restarted: tuple[str, ...] = ()


def _setup(args: argparse.Namespace) -> _Setup:
    urls = _engine_urls(args.engine, args.engines_file)
    keys: dict[str, Secret | None] = {}
    for kind, var in (("admin", args.admin_key_env), ("api", args.api_key_env)):
        keys[kind] = None
        if var is not None:
            try:
                keys[kind] = Secret.from_env(var)
            except InvalidArgument as exc:
                raise CtlError(ExitCode.USAGE, f"--{kind}-key-env: {exc}") from None
    values: dict[str, float] = {}
    for item in args.deadline:
        phase, sep, raw = item.partition("=")
        if not sep or phase not in _DEADLINES:
            valid = ", ".join(_DEADLINES)
            raise CtlError(
                ExitCode.USAGE, f"--deadline wants PHASE=SECONDS with PHASE one of {valid}"
            )
        try:
            values[_DEADLINES[phase]] = float(raw)
        except ValueError:
            raise CtlError(ExitCode.USAGE, f"--deadline {phase}: {raw!r} is not a number") from None
    mode = PauseMode(args.pause_mode)
    if args.action == "drain" and mode is PauseMode.IN_PLACE:
        raise CtlError(
            ExitCode.USAGE,
            "drain passes the flush barrier, which in_place (requests keep their KV cache) "
            "skips; use retract or abort, or 'pause' to pause in place",
        )
    try:
        deadlines = Deadlines(**values)
        config = LifecycleConfig(pause_mode=mode, deadlines=deadlines)
        connect = check_seconds("--connect-timeout", args.connect_timeout, positive=True)
        lock_timeout = check_seconds("--lock-timeout", args.lock_timeout, positive=False)
        # Each HTTP call gives up when its phase's deadline does, so an engine that does not
        # answer is named as timed out, not waited on beyond the deadline.
        timeouts = HTTPTimeouts(
            connect=connect,
            control=max(deadlines.pause, deadlines.continue_),
            memory=max(deadlines.release, deadlines.resume),
            probe=deadlines.probe,
            flush_margin=deadlines.probe,
        )
    except InvalidArgument as exc:
        raise CtlError(ExitCode.USAGE, str(exc)) from None
    state = Path(args.state_file) if args.state_file else default_state_path(urls)
    restarted: list[str] = []
    given = {url_identity(u): u for u in urls}
    for raw in getattr(args, "restarted", []):
        try:
            key = url_identity(raw)
        except InvalidArgument as exc:
            raise CtlError(ExitCode.USAGE, f"--restarted: {exc}") from None
        if key not in given:
            raise CtlError(ExitCode.USAGE, f"--restarted {raw} is not one of the engines")
        restarted.append(given[key])
    return _Setup(
        restarted=tuple(restarted),
        action=args.action,
        urls=urls,
        admin_key=keys["admin"],
        api_key=keys["api"],
        config=config,
        timeouts=timeouts,
        state_path=state,
        lock_timeout=lock_timeout,
        json=bool(args.json),
    )


def _engine_urls(given: Sequence[str], engines_file: str | None) -> tuple[str, ...]:
    raw = list(given)
    if engines_file is not None:
        try:
            lines = Path(engines_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise CtlError(
                ExitCode.USAGE, f"cannot read --engines-file {engines_file}: {exc}"
            ) from None
        raw += [u for u in (line.partition("#")[0].strip() for line in lines) if u]
    if not raw:
        raise CtlError(ExitCode.USAGE, "no engines: give --engine URL or --engines-file PATH")
    urls: list[str] = []
    seen: dict[str, str] = {}
    for url in raw:
        try:
            normal = SGLangHTTPEngine(url).url  # validates; opens nothing
        except InvalidArgument as exc:
            raise CtlError(ExitCode.USAGE, str(exc)) from None
        key = url_identity(normal)
        if key in seen:
            same = "is given twice" if seen[key] == normal else f"is {seen[key]} again"
            raise CtlError(ExitCode.USAGE, f"engine {normal} {same} (one server: {key})")
        seen[key] = normal
        urls.append(normal)
    return tuple(urls)


def default_state_path(urls: Sequence[str]) -> Path:
    """The state file of an engine set: ``$XDG_STATE_HOME/rollout-lifecycle/ctl-<hash>.json``
    (``~/.local/state`` when XDG_STATE_HOME is unset or not absolute); any order and any
    spelling of the same servers (``url_identity``), one file."""
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    digest = hashlib.sha256("\n".join(sorted(map(url_identity, urls))).encode()).hexdigest()[:16]
    return root / "rollout-lifecycle" / f"ctl-{digest}.json"


# ------------------------------------------------------------------------------- the ledger


def _read_ledger(path: Path, urls: Sequence[str]) -> tuple[list[str], dict[str, Any] | None]:
    """The engines in ledger order and the state file's content (None when there is none)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return list(urls), None
    except (OSError, UnicodeDecodeError) as exc:
        raise CtlError(ExitCode.STATE, f"cannot read state file {path}: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CtlError(ExitCode.STATE, f"state file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
        raise CtlError(
            ExitCode.STATE, f"{path} is not a state file of this version (format {STATE_FORMAT})"
        )
    recorded = data.get("engines")
    if not isinstance(recorded, list) or not all(isinstance(u, str) for u in recorded):
        raise CtlError(ExitCode.STATE, f"state file {path} has no engine list")
    try:
        keys = [url_identity(u) for u in recorded]
    except InvalidArgument as exc:
        raise CtlError(ExitCode.STATE, f"state file {path} records a bad URL: {exc}") from None
    given = {url_identity(u): u for u in urls}
    if sorted(keys) != sorted(given):
        missing = sorted(u for u, k in zip(recorded, keys, strict=True) if k not in given)
        extra = sorted(u for k, u in given.items() if k not in keys)
        raise CtlError(
            ExitCode.STATE,
            f"state file {path} records other engines (recorded but not given: "
            f"{missing or 'none'}; given but not recorded: {extra or 'none'}); give the engines "
            f"it records, or another "
            f"--state-file",
        )
    # the ledger's order, under the spelling given this run
    return [given[k] for k in keys], data


def _write_ledger(
    path: Path, urls: Sequence[str], snapshot: ServerSnapshot, last_call: Mapping[str, Any]
) -> None:
    """Write the state file atomically: a temporary file in its directory, then a rename."""
    data = {
        "format": STATE_FORMAT,
        "engines": list(urls),
        "updated_at": _now(),
        "last_call": dict(last_call),
        "server": snapshot.to_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(data, indent=2) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


@contextlib.contextmanager
def _lock(path: Path, timeout: float) -> Iterator[None]:
    """Hold ``<state file>.lock`` for the run, so two runs never drive one fleet at once."""
    lock = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise CtlError(ExitCode.STATE, f"cannot open lock file {lock}: {exc}") from None
    try:
        give_up = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    raise CtlError(
                        ExitCode.BUSY,
                        f"another rollout-lifecycle ctl run holds {lock} (waited {timeout:g}s)",
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


# ------------------------------------------------------------------------------- running


def _backends(setup: _Setup, urls: Sequence[str], *, retries: int = 3) -> list[SGLangHTTPEngine]:
    return [
        SGLangHTTPEngine(
            url,
            admin_key=setup.admin_key,
            api_key=setup.api_key,
            timeouts=setup.timeouts,
            retries=retries,
        )
        for url in urls
    ]


async def _close(backends: Sequence[SGLangHTTPEngine]) -> None:
    await asyncio.gather(*(b.close() for b in backends))


async def _ready_status(url: str, timeouts: HTTPTimeouts) -> tuple[int | None, str | None]:
    """``GET /ready`` once (open, no key): its status, or None and why there was no answer.

    Safe on a paused server, unlike ``/health``: it answers 503 while paused, without generating.
    """
    timeout = httpx.Timeout(timeouts.probe, connect=timeouts.connect)
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            answer = await client.get(f"{url}/ready")
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return answer.status_code, None


async def _check_serving(setup: _Setup, urls: Sequence[str]) -> None:
    """With no ledger, an engine counts as serving (all memory resident) only if ``/ready``
    says so; a paused one may hold tags released, and releasing them again would kill it."""
    answers = await asyncio.gather(*(_ready_status(u, setup.timeouts) for u in urls))
    down = [
        f"{u} ({why})" for u, (status, why) in zip(urls, answers, strict=True) if status is None
    ]
    if down:
        raise CtlError(ExitCode.UNREACHABLE, f"engines not reachable: {', '.join(down)}")
    busy = [f"{u} ({s})" for u, (s, _) in zip(urls, answers, strict=True) if s != 200]
    if busy:
        raise CtlError(
            ExitCode.STATE,
            f"no state file at {setup.state_path}, and /ready of {', '.join(busy)} is not 200 "
            f"(paused or unhealthy): what memory it holds released is unknown. Give the state "
            f"file that recorded it, or bring every engine back to serving first",
        )


async def _check_versions(backends: Sequence[SGLangHTTPEngine]) -> None:
    """The attach check on every engine before the call: an SGLang older than 0.5.22 (or one
    that reports no version) is refused and nothing is sent. An engine that cannot be asked is
    left to the call, which reports it as unreachable or dead."""
    results = await asyncio.gather(*(b.check_version() for b in backends), return_exceptions=True)
    refused = [r.reason for r in results if isinstance(r, IllegalEngineOp)]
    if refused:
        names = [
            b.url for b, r in zip(backends, results, strict=True) if isinstance(r, IllegalEngineOp)
        ]
        detail = "; ".join(f"{u}: {why}" for u, why in zip(names, refused, strict=True))
        raise CtlError(ExitCode.REFUSED, f"unsupported SGLang: {detail}")
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
            f"run stopped, and SGLang cannot report them. Restart each such server, then run "
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


def _restarted(ledger: dict[str, Any], urls: Sequence[str], restarted: Sequence[str]) -> None:
    """Record each ``restarted`` engine in ``ledger`` as a new server: alive, serving, every tag
    resident; the server state becomes ``failed``, for ``reset`` to settle."""
    server = ledger.get("server")
    if not isinstance(server, dict) or not isinstance(server.get("groups"), list):
        return  # ServerSnapshot.from_dict refuses it
    ids = {f"{GROUP}/{urls.index(u)}" for u in restarted}
    for group in server["groups"]:
        for engine in group.get("engines", []) if isinstance(group, dict) else []:
            if isinstance(engine, dict) and engine.get("id") in ids:
                engine.update(
                    alive=True,
                    paused=False,
                    pause_mode=None,
                    flushed=False,
                    released=[],
                    uncertain=[],
                    stale=False,
                    pause_unknown=False,
                    session_unknown=False,
                    last_op="restarted",
                    last_outcome=None,
                )
    server["state"] = ServerState.FAILED.value


def _journal_entry(snapshot: ServerSnapshot) -> ServerSnapshot:
    """What the state file records while a call is in flight: ``failed`` (a run stopped now
    leaves engines mid-call) unless the records imply the server's state exactly."""
    if snapshot.in_flight() or snapshot.state is ServerState.PAUSING:
        return dataclasses.replace(snapshot, state=ServerState.FAILED)
    return snapshot


_CALLS: dict[str, Callable[[RolloutServer], Awaitable[dict[str, float]]]] = {
    "pause": RolloutServer.pause,
    "drain": RolloutServer.pause,
    "offload": RolloutServer.offload,
    "onload-weights": RolloutServer.onload_weights,
    "onload-kv": RolloutServer.onload_kv,
    "resume": RolloutServer.resume,
    "reset": _reset,
}


async def _drive(setup: _Setup) -> tuple[ExitCode, dict[str, Any]]:
    """Adopt the ledger, make the action's call, write the ledger; the exit code and report."""
    urls, ledger = _read_ledger(setup.state_path, setup.urls)
    if setup.restarted:
        if ledger is None:
            raise CtlError(
                ExitCode.STATE, f"--restarted: there is no state file at {setup.state_path}"
            )
        answers = await asyncio.gather(*(_ready_status(u, setup.timeouts) for u in setup.restarted))
        busy = [
            f"{u} ({s or why})"
            for u, (s, why) in zip(setup.restarted, answers, strict=True)
            if s != 200
        ]
        if busy:
            raise CtlError(
                ExitCode.STATE,
                f"--restarted: /ready of {', '.join(busy)} is not 200; a restarted server "
                f"serves with all its memory resident",
            )
        _restarted(ledger, urls, setup.restarted)
    backends = _backends(setup, urls)
    recording: list[dict[str, Any]] = []

    def journal(snapshot: ServerSnapshot) -> None:
        # before every send that must not repeat, and after every outcome
        for last in recording:
            _write_ledger(setup.state_path, urls, _journal_entry(snapshot), last)

    server = RolloutServer(
        [EngineGroup(GROUP, backends)], setup.config, name="ctl", journal=journal
    )
    try:
        if ledger is not None:
            try:
                server.adopt(ServerSnapshot.from_dict(ledger.get("server", {})))
            except InvalidArgument as exc:
                raise CtlError(
                    ExitCode.STATE, f"state file {setup.state_path} is unusable: {exc}"
                ) from None
        elif setup.action in _PAUSING_ACTIONS:
            await _check_serving(setup, urls)
        if setup.action != "reset":
            await _check_versions(backends)
        # Without a ledger only a checked fleet is recorded: a refused or idle call proves
        # nothing about the engines.
        record = ledger is not None or setup.action in _PAUSING_ACTIONS
        if record:
            recording.append(
                {"action": setup.action, "at": _now(), "exit_code": None, "in_flight": True}
            )
        before = server.state
        metrics: dict[str, float] = {}
        code, error, outcomes = ExitCode.OK, None, None
        try:
            metrics = await _CALLS[setup.action](server)
        except (IllegalTransition, IllegalEngineOp, StaleWeights) as exc:
            code, error = ExitCode.REFUSED, _error(exc)
        except InvalidArgument as exc:
            code, error = ExitCode.USAGE, _error(exc)
        except PhaseFailed as exc:
            bad = [o for o in exc.outcomes.values() if not o.ok]
            lost = all(o.outcome in (Outcome.DEAD, Outcome.UNREACHABLE) for o in bad)
            code = ExitCode.UNREACHABLE if bad and lost else ExitCode.FAILED
            error = _error(exc)
            outcomes = {
                engine: {
                    "url": _url_of(engine, urls),
                    "outcome": o.outcome.value,
                    "detail": o.detail,
                    "duration_s": round(o.duration_s, 6),
                }
                for engine, o in sorted(exc.outcomes.items())
            }
        except LifecycleError as exc:
            code, error = ExitCode.FAILED, _error(exc)
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
                last = {"action": setup.action, "at": _now(), "exit_code": int(code)}
                last["error"] = error["message"] if error else None
                try:
                    _write_ledger(setup.state_path, urls, server.snapshot(), last)
                except OSError as exc:
                    raise CtlError(
                        ExitCode.STATE, f"cannot write state file {setup.state_path}: {exc}"
                    ) from None
        report: dict[str, Any] = {
            "action": setup.action,
            "exit_code": int(code),
            "ok": code is ExitCode.OK,
            "previous_state": before.value,
            "state": server.state.value,
            "state_file": str(setup.state_path),
            "ledger_found": ledger is not None,
            "ledger_written": record,
            "metrics": metrics,
            "engines": [
                _recorded_row(e, _url_of(e.id, urls)) for e in server.snapshot().engines().values()
            ],
            "error": error,
        }
        if outcomes is not None:
            report["outcomes"] = outcomes
        return code, report
    finally:
        await _close(backends)


def _error(exc: BaseException) -> dict[str, str]:
    return {"kind": type(exc).__name__, "message": str(exc)}


def _url_of(engine_id: str, urls: Sequence[str]) -> str | None:
    index = engine_id.rpartition("/")[2]
    return urls[int(index)] if index.isdigit() and int(index) < len(urls) else None


def _recorded_row(engine: EngineSnapshot, url: str | None) -> dict[str, Any]:
    return {
        "id": engine.id,
        "url": url,
        "alive": engine.alive,
        "paused": engine.paused,
        "pause_mode": engine.pause_mode,
        "flushed": engine.flushed,
        "released": list(engine.released),
        "uncertain": list(engine.uncertain),
        "stale": engine.stale,
        "last_op": engine.last_op,
        "last_outcome": engine.last_outcome,
    }


async def _status(setup: _Setup) -> tuple[ExitCode, dict[str, Any]]:
    """Probe every engine (safe probes only) and set it beside the ledger; changes nothing."""
    urls, ledger = _read_ledger(setup.state_path, setup.urls)
    snapshot: ServerSnapshot | None = None
    if ledger is not None:
        try:
            snapshot = ServerSnapshot.from_dict(ledger.get("server", {}))
        except InvalidArgument as exc:
            raise CtlError(
                ExitCode.STATE, f"state file {setup.state_path} is unusable: {exc}"
            ) from None
    recorded = snapshot.engines() if snapshot is not None else {}
    backends = _backends(setup, urls, retries=1)
    try:
        # Each probe is bounded by its HTTP timeouts; this bounds the lot.
        limit = 3 * (setup.timeouts.probe + setup.timeouts.connect) + 5
        probes = asyncio.wait_for(
            asyncio.gather(
                *(
                    _probe(f"{GROUP}/{i}", b, setup.timeouts, recorded.get(f"{GROUP}/{i}"))
                    for i, b in enumerate(backends)
                )
            ),
            limit,
        )
        try:
            rows = await probes
        except TimeoutError:
            raise CtlError(ExitCode.UNREACHABLE, f"the probes took over {limit:g}s") from None
    finally:
        await _close(backends)
    report: dict[str, Any] = {
        "action": "status",
        "exit_code": 0,
        "ok": True,
        "state_file": str(setup.state_path),
        "ledger": ledger is not None,
        "recorded_state": snapshot.state.value if snapshot else None,
        "last_call": ledger.get("last_call") if ledger else None,
        "updated_at": ledger.get("updated_at") if ledger else None,
        "engines": rows,
        "error": None,
    }
    code = ExitCode.OK
    unreachable = [r["url"] for r in rows if not r["reachable"]]
    if unreachable:
        code = ExitCode.UNREACHABLE
        report["error"] = {
            "kind": "unreachable",
            "message": f"engines not reachable: {', '.join(unreachable)}",
        }
    report["exit_code"], report["ok"] = int(code), code is ExitCode.OK
    return code, report


async def _probe(
    engine_id: str,
    backend: SGLangHTTPEngine,
    timeouts: HTTPTimeouts,
    recorded: EngineSnapshot | None,
) -> dict[str, Any]:
    """One engine as observed: ``/server_info`` (reachable, memory), ``/model_info`` (weight
    version) and ``/ready`` (200 serving; 503 paused or unhealthy)."""

    async def attempt(call: Awaitable[Any]) -> tuple[Any, str | None]:
        try:
            return await call, None
        except EngineError as exc:
            return None, exc.message

    (info, info_error), (version, _), (ready, ready_error) = await asyncio.gather(
        attempt(backend.server_info()),
        attempt(backend.weight_version()),
        _ready_status(backend.url, timeouts),
    )
    reachable = info is not None
    recorded_paused = recorded.paused if recorded is not None else False
    agrees = None if ready not in (200, 503) else (ready == 503) == recorded_paused
    return {
        "id": engine_id,
        "url": backend.url,
        "reachable": reachable,
        "ready": ready == 200 if ready is not None else None,
        "ready_status": ready,
        "weight_version": version,
        "memory": _memory(info) if isinstance(info, dict) else None,
        "recorded": None if recorded is None else _recorded_row(recorded, backend.url),
        "agrees": agrees,
        "error": info_error or ready_error,
    }


def _memory(info: Mapping[str, Any]) -> dict[str, float] | None:
    """Memory use per kind from ``/server_info``'s ``internal_states``, summed over ranks."""
    states = info.get("internal_states")
    if not isinstance(states, list):
        return None
    total: dict[str, float] = {}
    for state in states:
        usage = state.get("memory_usage") if isinstance(state, dict) else None
        if isinstance(usage, dict):
            for kind, value in usage.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[str(kind)] = total.get(str(kind), 0) + value
    return total or None


# ------------------------------------------------------------------------------- output


def _report_error(
    action: str, as_json: bool, code: ExitCode, message: str, setup: _Setup | None
) -> int:
    print(f"rollout-lifecycle ctl {action}: {message}", file=sys.stderr)
    if as_json:
        report = {
            "action": action,
            "exit_code": int(code),
            "ok": False,
            "state_file": None if setup is None else str(setup.state_path),
            "error": {"kind": code.name.lower(), "message": message},
        }
        _out(json.dumps(report, indent=2))
    return int(code)


def _out(text: str, end: str = "\n") -> None:
    """Write ``text`` to stdout; a reader that went away (``ctl ... | head``) is not an error.

    The run's exit code still says what the action did. stdout is pointed at /dev/null, so
    that nothing fails again when the interpreter flushes it at exit.
    """
    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _tags(tags: Sequence[str]) -> str:
    return ",".join(tags) if tags else "-"


def _yes(value: bool | None) -> str:
    return "?" if value is None else "yes" if value else "no"


def _paused(row: Mapping[str, Any]) -> str:
    return str(row["pause_mode"] or "yes") if row["paused"] else "no"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def _render_drive(report: Mapping[str, Any]) -> str:
    outcome = "ok" if report["ok"] else ExitCode(report["exit_code"]).name.lower()
    lines = [f"{report['action']}: {report['previous_state']} -> {report['state']} ({outcome})"]
    failed = report.get("outcomes") or {}
    rows = []
    for e in report["engines"]:
        last = e["last_outcome"] or "-"
        if e["id"] in failed:
            last = f"{failed[e['id']]['outcome']}: {failed[e['id']]['detail']}"
        rows.append(
            [
                e["id"],
                e["url"] or "?",
                _yes(e["alive"]),
                _paused(e),
                _tags(e["released"]),
                _tags(e["uncertain"]),
                e["last_op"] or "-",
                last,
            ]
        )
    headers = ["ENGINE", "URL", "ALIVE", "PAUSED", "RELEASED", "UNCERTAIN", "LAST OP", "OUTCOME"]
    lines.append(_table(headers, rows))
    if report["metrics"]:
        lines.append("metrics:")
        metrics = report["metrics"]
        values = [
            [f"  {k}", f"{v:.6f}" if k.endswith("_s") else _number(v)] for k, v in metrics.items()
        ]
        lines.append(_table(["  KEY", "VALUE"], values))
    if not report["ledger_found"]:
        lines.append("no state file before this run: the engines were taken to be serving")
    written = "written" if report["ledger_written"] else "not written: no engine was checked"
    lines.append(f"state file: {report['state_file']} ({written})")
    return "\n".join(lines)


def _render_status(report: Mapping[str, Any]) -> str:
    if report["ledger"]:
        last = report["last_call"] or {}
        head = (
            f"recorded state: {report['recorded_state']} (last call {last.get('action', '?')} "
            f"exit {last.get('exit_code', '?')} at {report['updated_at']})"
        )
    else:
        head = "recorded state: none (no state file: engines are taken to be serving)"
    rows = []
    for e in report["engines"]:
        rec = e["recorded"]
        memory = e["memory"]
        rows.append(
            [
                e["id"],
                e["url"],
                _yes(e["reachable"]),
                "-" if e["ready_status"] is None else f"{_yes(e['ready'])} ({e['ready_status']})",
                "-" if e["weight_version"] is None else str(e["weight_version"]),
                "-" if rec is None else _paused(rec),
                "-" if rec is None else _tags(rec["released"]),
                "-" if e["agrees"] is None else _yes(e["agrees"]),
                " ".join(f"{k}={_number(v)}" for k, v in memory.items()) if memory else "-",
            ]
        )
    headers = [
        "ENGINE",
        "URL",
        "REACHABLE",
        "READY",
        "WEIGHTS",
        "REC PAUSED",
        "REC RELEASED",
        "AGREES",
        "MEMORY",
    ]
    lines = [head, _table(headers, rows), f"state file: {report['state_file']}"]
    return "\n".join(lines)


@contextlib.contextmanager
def _events_to_stderr(verbosity: int) -> Iterator[None]:
    """The library's events on stderr: none by default (the report says what happened),
    phases and states with ``-v``, every engine call with ``-vv``."""
    level = (
        logging.CRITICAL + 1
        if verbosity <= 0
        else logging.INFO
        if verbosity == 1
        else logging.DEBUG
    )
    handler = logging.StreamHandler(sys.stderr)
    # ``transitions`` logs a refused transition as an error of its own; the report has it.
    loggers = [logging.getLogger(LOGGER_NAME), logging.getLogger("transitions")]
    saved = [(log.level, log.propagate) for log in loggers]
    for log in loggers:
        log.setLevel(level)
        log.propagate = False
        log.addHandler(handler)
    try:
        yield
    finally:
        for log, (old_level, old_propagate) in zip(loggers, saved, strict=True):
            log.removeHandler(handler)
            log.setLevel(old_level)
            log.propagate = old_propagate


__all__ = ["ACTIONS", "STATE_FORMAT", "ExitCode", "add_parsers", "default_state_path", "run"]
