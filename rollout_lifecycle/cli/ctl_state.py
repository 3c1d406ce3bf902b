"""What a ``ctl`` run sets up and keeps between runs: the exit codes, the engines and keys it
was given, and the state file (the server's ledger) with its lock, read and written atomically.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import IntEnum
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rollout_lifecycle.backends.http.wire import HTTPTimeouts
from rollout_lifecycle.backends.router import SGLangRouter
from rollout_lifecycle.backends.secret import Secret
from rollout_lifecycle.backends.sglang.client import SGLangHTTPEngine
from rollout_lifecycle.backends.vllm.api import GUARDED_PREFIXES
from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine
from rollout_lifecycle.contract.exceptions import (
    EngineClaimed,
    EngineDead,
    EngineUnreachable,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleError,
    PhaseFailed,
    RouterError,
    StaleWeights,
)
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.contract.urls import mask_userinfo, url_identity
from rollout_lifecycle.contract.values import PauseMode, check_seconds, parse_tags, short_repr
from rollout_lifecycle.core.claims import lock_dir, make_lock_dir
from rollout_lifecycle.core.config import Deadlines, LifecycleConfig
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.server import ServerSnapshot
from rollout_lifecycle.core.states import ServerState

T = TypeVar("T")


#: The engine kinds ``ctl`` drives (``--engine-kind``); the first is the default, and the kind
#: of a state file that records none (one written before the field existed).
ENGINE_KINDS = ("sglang", "vllm")

#: The one group an SGLang fleet forms; engine ids are ``sglang/<index in the ledger>``. A
#: fleet's group is named after its engine kind (``Setup.group``): a vLLM fleet's is ``vllm``.
GROUP = "sglang"

#: Each engine kind as its users spell it, for messages (ctl's and the demo's).
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}

#: Options ``--engine-kind vllm`` refuses: what each is for on SGLang, and why vLLM has none.
SGLANG_ONLY = {
    "admin_key_env": (
        "--admin-key-env",
        "vLLM has no admin key: its lifecycle routes take no key at all",
    ),
    "router": ("--router", "it drives an sglang-router, which does not route to vLLM here"),
    "router_key_env": ("--router-key-env", "it is the key of an sglang-router (--router)"),
}

#: What ``--engine-kind vllm`` with a key says on stderr (and ``ctl --help`` says too).
VLLM_KEY_WARNING = (
    f"warning: vLLM's API key guards only the routes under {', '.join(GUARDED_PREFIXES)}; the "
    "lifecycle routes ctl calls (/pause, /sleep, /wake_up, ...) answer anyone who reaches the "
    "port without it. Keep vLLM on loopback or a private network"
)


#: The ``format`` field of a state file this version reads and writes.
STATE_FORMAT = "rollout-lifecycle-ctl/1"


class ExitCode(IntEnum):
    """What a ``ctl`` run exits with; scripts can rely on these."""

    OK = 0
    #: Bad command line or input: unknown option, bad URL, unset key variable or a key no HTTP
    #: header can carry, unreadable file, a lock directory (``ROLLOUT_LIFECYCLE_LOCK_DIR``) that
    #: cannot be made; any ``InvalidArgument`` the library raises.
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
    #: Another ``ctl`` run holds the state file's lock, or another controller (a ``ctl`` run
    #: with another state file, a training process) drives one of the engines: nothing sent.
    BUSY = 7
    #: Interrupted (Ctrl-C) after the phase in flight settled; the ledger was written.
    INTERRUPTED = 130
    #: Terminated (SIGTERM) after the phase in flight settled; the ledger was written.
    TERMINATED = 143


#: The ``ctl`` actions and what each does.
ACTIONS: dict[str, str] = {
    "status": (
        "show every engine as observed next to the recorded ledger, by safe reads only "
        "(SGLang: /server_info, /model_info and /ready, never /health; vLLM: /version, "
        "/metrics, /weight_info, /health and /is_paused)"
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


PAUSING_ACTIONS = ("pause", "drain", "offload")


#: ``--deadline`` phase names -> ``Deadlines`` fields.
DEADLINES = {
    "pause": "pause",
    "flush": "flush",
    "release": "release",
    "resume": "resume",
    "continue": "continue_",
    "probe": "probe",
}


class CtlError(Exception):
    """A ``ctl`` run stops with ``code`` and ``message`` (no key is ever in it)."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Setup:
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
    #: ``--router``: the sglang-router whose workers follow the engines that serve.
    router: SGLangRouter | None = None
    #: ``--engine-kind``: what the engines are (one of ``ENGINE_KINDS``).
    engine_kind: str = "sglang"

    @property
    def group(self) -> str:
        """The fleet's group name, its engine kind: engine ids are ``<group>/<index in the
        ledger>``."""
        return self.engine_kind


#: An engine client ``ctl`` drives.
Backend = SGLangHTTPEngine | VLLMHTTPEngine


def make_setup(args: argparse.Namespace) -> Setup:
    engine_kind = getattr(args, "engine_kind", ENGINE_KINDS[0])
    if engine_kind not in ENGINE_KINDS:
        raise CtlError(
            ExitCode.USAGE,
            f"--engine-kind {engine_kind!r} is not one of {', '.join(ENGINE_KINDS)}",
        )
    if engine_kind != "sglang":
        for dest, (option, why) in SGLANG_ONLY.items():
            if getattr(args, dest, None) is not None:
                raise CtlError(
                    ExitCode.USAGE,
                    f"{option} is for SGLang, not --engine-kind {engine_kind}: {why}",
                )
    urls = _engine_urls(args.engine, args.engines_file)
    keys: dict[str, Secret | None] = {}
    for kind, var in (
        ("admin", args.admin_key_env),
        ("api", args.api_key_env),
        ("router", args.router_key_env),
    ):
        keys[kind] = None
        if var is not None:
            try:
                keys[kind] = Secret.from_env(var)
            except InvalidArgument as exc:
                raise CtlError(ExitCode.USAGE, f"--{kind}-key-env: {exc}") from None
    values: dict[str, float] = {}
    for item in args.deadline:
        phase, sep, raw = item.partition("=")
        if not sep or phase not in DEADLINES:
            valid = ", ".join(DEADLINES)
            raise CtlError(
                ExitCode.USAGE, f"--deadline wants PHASE=SECONDS with PHASE one of {valid}"
            )
        try:
            values[DEADLINES[phase]] = float(raw)
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
            # SGLang's refusal of a drain that never goes idle must beat the pause deadline.
            drain=max(deadlines.pause - 2 * deadlines.probe, deadlines.pause / 2),
            memory=max(deadlines.release, deadlines.resume),
            probe=deadlines.probe,
            flush_margin=deadlines.probe,
        )
    except InvalidArgument as exc:
        raise CtlError(ExitCode.USAGE, str(exc)) from None
    router = None
    if args.router is not None:
        try:
            router = SGLangRouter(
                clean_url(args.router, "--router"),
                api_key=keys["router"],
                worker_api_key=keys["api"],
                timeout=max(connect, deadlines.probe),
            )
        except InvalidArgument as exc:
            raise CtlError(ExitCode.USAGE, f"--router: {exc}") from None
    elif args.router_key_env is not None:
        raise CtlError(ExitCode.USAGE, "--router-key-env needs --router URL")
    state = Path(args.state_file) if args.state_file else default_state_path(urls)
    restarted: list[str] = []
    given = {url_identity(u): u for u in urls}
    for raw in getattr(args, "restarted", []):
        try:
            key = url_identity(clean_url(raw, "--restarted"))
        except InvalidArgument as exc:
            raise CtlError(ExitCode.USAGE, f"--restarted: {exc}") from None
        if key not in given:
            raise CtlError(ExitCode.USAGE, f"--restarted {raw} is not one of the engines")
        restarted.append(given[key])
    return Setup(
        router=router,
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
        engine_kind=engine_kind,
    )


def _engine_urls(given: Sequence[str], engines_file: str | None) -> tuple[str, ...]:
    raw = [(u, "--engine") for u in given]
    if engines_file is not None:
        try:
            lines = Path(engines_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise CtlError(
                ExitCode.USAGE, f"cannot read --engines-file {engines_file}: {exc}"
            ) from None
        found = (line.partition("#")[0].strip() for line in lines)
        raw += [(u, f"--engines-file {engines_file}") for u in found if u]
    if not raw:
        raise CtlError(ExitCode.USAGE, "no engines: give --engine URL or --engines-file PATH")
    urls: list[str] = []
    seen: dict[str, str] = {}
    for url, where in raw:
        try:
            normal = clean_url(url, where)
        except InvalidArgument as exc:
            raise CtlError(ExitCode.USAGE, str(exc)) from None
        key = url_identity(normal)
        if key in seen:
            same = "is given twice" if seen[key] == normal else f"is {seen[key]} again"
            raise CtlError(ExitCode.USAGE, f"engine {normal} {same} (one server: {key})")
        seen[key] = normal
        urls.append(normal)
    return tuple(urls)


def clean_url(raw: str, where: str) -> str:
    """A server's URL as ``where`` (an option) gave it, normalized as ``SGLangHTTPEngine`` does;
    ``InvalidArgument`` naming the value and the fix for one no client can reach.

    Whitespace around it is dropped: no URL has any (RFC 3986, appendix C: whitespace around a
    URL in text is not part of it), and that is what a shell or a file adds, a line end from a
    file with CRLF line ends or a ``$(cat url.txt)`` in quotes; the engines file's lines are
    read the same way. Whitespace or a control character inside is refused (``validate_url``),
    as is anything the HTTP client could not send to (``httpx.URL``), so that no run ends in
    the client's error at its first call.
    """
    url = raw.strip()
    try:
        normal = SGLangHTTPEngine(url).url  # validates (whitespace inside too); opens nothing
        httpx.URL(normal)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    except httpx.InvalidURL as exc:
        shown = mask_userinfo(url)
        raise InvalidArgument(
            f"{where} {shown!r} is not a URL the HTTP client takes: {exc}"
        ) from None
    return normal


def check_lock_dir() -> None:
    """Refuse a claims lock directory (``core/claims``) that cannot be made, before anything is
    sent (made now if missing, as the first claim would)."""
    make_lock_dir(lock_dir())


def exit_code_of(exc: LifecycleError) -> ExitCode:
    """The exit code of a run the library's ``exc`` stopped."""
    if isinstance(exc, EngineClaimed):  # another controller drives the engines: nothing sent
        return ExitCode.BUSY
    if isinstance(exc, IllegalTransition | IllegalEngineOp | StaleWeights | RouterError):
        return ExitCode.REFUSED
    if isinstance(exc, InvalidArgument):
        return ExitCode.USAGE
    if isinstance(exc, EngineDead | EngineUnreachable):
        return ExitCode.UNREACHABLE
    if isinstance(exc, PhaseFailed):
        bad = [o for o in exc.outcomes.values() if not o.ok]
        lost = all(o.outcome in (Outcome.DEAD, Outcome.UNREACHABLE) for o in bad)
        return ExitCode.UNREACHABLE if bad and lost else ExitCode.FAILED
    return ExitCode.FAILED


def default_state_path(urls: Sequence[str]) -> Path:
    """The state file of an engine set: ``$XDG_STATE_HOME/rollout-lifecycle/ctl-<hash>.json``
    (``~/.local/state`` when XDG_STATE_HOME is unset or not absolute); any order and any
    spelling of the same servers (``url_identity``), one file."""
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    digest = hashlib.sha256("\n".join(sorted(map(url_identity, urls))).encode()).hexdigest()[:16]
    return root / "rollout-lifecycle" / f"ctl-{digest}.json"


def read_ledger(
    path: Path, urls: Sequence[str], kind: str = "sglang"
) -> tuple[list[str], dict[str, Any] | None]:
    """The engines in ledger order and the state file's content (None when there is none).

    Anything but a whole, well-typed state file of this version and of these engines is
    refused with ``CtlError(STATE)``, one line naming the file and what is wrong: bytes that
    are not UTF-8 or not JSON, JSON nested deeper than any ledger (``MAX_DEPTH``), a field
    missing or of another type (``_ledger_problem``), a ledger of other engines or of another
    engine kind than ``kind`` (a file without ``engine_kind`` is SGLang's). So every
    reader after this one (``adopt``, ``status``, ``--restarted``) gets a ledger of the shape
    ``write_ledger`` writes.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return list(urls), None
    except OSError as exc:
        raise CtlError(ExitCode.STATE, f"cannot read state file {path}: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CtlError(ExitCode.STATE, f"state file {path} is not UTF-8 text: {exc}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise CtlError(
            ExitCode.STATE, f"state file {path} is not a ledger: its JSON nests too deeply to read"
        ) from None
    except ValueError as exc:
        raise CtlError(ExitCode.STATE, f"state file {path} is not JSON: {exc}") from None
    problem = _ledger_problem(data)
    if problem is not None:
        raise CtlError(ExitCode.STATE, f"state file {path} {_cut(problem)}")
    recorded_kind = data.get("engine_kind", ENGINE_KINDS[0])
    if recorded_kind != kind:
        raise CtlError(
            ExitCode.STATE,
            f"state file {path} records {ENGINE_NAMES[recorded_kind]} engines (engine_kind "
            f"{recorded_kind}), but this run was given --engine-kind {kind}; nothing was sent. "
            f"Give --engine-kind {recorded_kind}, or another --state-file",
        )
    recorded: list[str] = data["engines"]
    try:
        keys = [url_identity(u) for u in recorded]
    except InvalidArgument as exc:
        raise CtlError(
            ExitCode.STATE, f"state file {path} records a bad URL: {_cut(str(exc))}"
        ) from None
    twice = sorted({u for u, k in zip(recorded, keys, strict=True) if keys.count(k) > 1})
    if twice:
        raise CtlError(ExitCode.STATE, f"state file {path} records one server twice: {twice}")
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


#: How deeply a state file may nest. ``write_ledger`` writes seven levels (the file, ``server``,
#: ``groups``, a group, its ``engines``, an engine, its tag lists); bounding them keeps every
#: later reading, printing and re-encoding of a state file from recursing without end.
MAX_DEPTH = 32

#: The fields of ``last_call`` ``write_ledger`` writes: what each must be, and its description.
_LAST_CALL: dict[str, tuple[Callable[[object], bool], str]] = {
    "action": (lambda v: isinstance(v, str), "a string"),
    "at": (lambda v: isinstance(v, str), "a string"),
    "exit_code": (
        lambda v: v is None or (type(v) is int and 0 <= v <= 255),
        "an exit code (an int in 0..255) or null",
    ),
    "error": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "in_flight": (lambda v: isinstance(v, bool), "true or false"),
}


def _ledger_problem(data: object) -> str | None:
    """What makes ``data`` (a state file's JSON) something other than a ledger of this version,
    as the end of a sentence about the file; None for a ledger.

    A ledger is an object of the current ``format`` with a non-empty list of URL strings as
    ``engines``; ``updated_at`` a string and ``last_call`` an object of typed fields when
    present; ``server`` a snapshot ``ServerSnapshot.from_dict`` reads whose groups and engines
    are lists, every engine's ``released`` and ``uncertain`` a list of distinct memory tags and
    its ``pause_mode`` a pause mode or null. No string may hold a lone surrogate (which no
    UTF-8 text holds) and nothing may nest deeper than ``MAX_DEPTH``. Unknown fields are
    ignored.
    """
    shape = _shape_problem(data)
    if shape is not None:
        return shape
    if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
        return f"is not a ledger of this version (format {STATE_FORMAT})"
    if "engine_kind" in data and data["engine_kind"] not in ENGINE_KINDS:
        return (
            f"has engine_kind {short_repr(data['engine_kind'])}, not one of "
            f"{', '.join(ENGINE_KINDS)}"
        )
    engines = data.get("engines")
    if not isinstance(engines, list) or not engines or not all(isinstance(u, str) for u in engines):
        return f"has no engine list (engines: {short_repr(engines)})"
    for key, kind, wanted in (("updated_at", str, "a string"), ("last_call", dict, "an object")):
        if key in data and not isinstance(data[key], kind):
            return f"has {key} {short_repr(data[key])}, not {wanted}"
    last = data.get("last_call", {})
    for key, (fits, wanted) in _LAST_CALL.items():
        if key in last and not fits(last[key]):
            return f"has last_call.{key} {short_repr(last[key])}, not {wanted}"
    server = data.get("server")
    if not isinstance(server, dict):
        return f"has server {short_repr(server)}, not an object"
    groups = server.get("groups")
    if not isinstance(groups, list):
        return f"has server.groups {short_repr(groups)}, not a list"
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            return f"has server.groups[{g}] {short_repr(group)}, not an object"
        engines = group.get("engines")
        if not isinstance(engines, list) or not all(isinstance(e, dict) for e in engines):
            return f"has server.groups[{g}].engines {short_repr(engines)}, not a list of objects"
    try:
        ServerSnapshot.from_dict(server)  # every field there, of its type
    except InvalidArgument as exc:
        return f"is unusable: {exc}"
    for g, group in enumerate(groups):
        for e, engine in enumerate(group["engines"]):
            where = f"server.groups[{g}].engines[{e}]"
            for key in ("released", "uncertain"):
                tags = engine.get(key, [])
                if not isinstance(tags, list):
                    return f"has {where}.{key} {short_repr(tags)}, not a list of tags"
                try:
                    if tags:
                        parse_tags(tags, what=f"{where}.{key}")
                except InvalidArgument as exc:
                    return f"is unusable: {exc}"
            mode = engine.get("pause_mode")
            if mode is not None and mode not in [m.value for m in PauseMode]:
                return f"has {where}.pause_mode {short_repr(mode)}, not a pause mode or null"
    return None


def _shape_problem(data: object) -> str | None:
    """A string that is not text (a lone surrogate), or nesting deeper than ``MAX_DEPTH``;
    walked without recursion."""
    pending: list[tuple[object, int]] = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return f"holds a string that is not text (a lone surrogate): {short_repr(value)}"
            continue
        if isinstance(value, dict):
            items: list[object] = [*value, *value.values()]
        elif isinstance(value, list):
            items = value
        else:
            continue
        if depth > MAX_DEPTH:
            return f"nests deeper than {MAX_DEPTH} levels, which no ledger does"
        pending.extend((item, depth + 1) for item in items)
    return None


def _cut(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut to ``limit`` characters (a state file's values can be long)."""
    line = " ".join(text.splitlines())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def write_ledger(
    path: Path,
    urls: Sequence[str],
    snapshot: ServerSnapshot,
    last_call: Mapping[str, Any],
    engine_kind: str = "sglang",
) -> None:
    """Write the state file atomically: a temporary file in its directory, then a rename.

    A state file that is a symbolic link stays one: the file written is the one it points to
    (``real_path``), so the rename replaces the target, not the link."""
    data = {
        "format": STATE_FORMAT,
        "engine_kind": engine_kind,
        "engines": list(urls),
        "updated_at": utc_now(),
        "last_call": dict(last_call),
        "server": snapshot.to_dict(),
    }
    path = real_path(path)
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


def real_path(path: Path) -> Path:
    """The file ``path`` names once every symbolic link is followed (a link to a file not yet
    there names where it will be); ``OSError`` for a loop of links."""
    try:
        return path.resolve()
    except RuntimeError as exc:  # a loop of links (an OSError from Python 3.13)
        raise OSError(f"{path}: {exc}") from None


@contextlib.contextmanager
def locked(path: Path, timeout: float) -> Iterator[None]:
    """Hold ``<state file>.lock`` for the run, so two runs never drive one fleet at once; a
    state file given through a symbolic link is locked beside its target, so that every link
    to one ledger takes the same lock."""
    try:
        path = real_path(path)
    except OSError as exc:
        raise CtlError(ExitCode.STATE, f"cannot resolve state file {path}: {exc}") from None
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


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def make_backends(setup: Setup, urls: Sequence[str], *, retries: int = 3) -> list[Backend]:
    """One client per engine, of the run's ``--engine-kind``."""
    if setup.engine_kind == "vllm":
        # vLLM's key guards only the OpenAI routes (vllm.api.GUARDED_PREFIXES); it is sent
        # there only, and ctl calls none of them.
        return [
            VLLMHTTPEngine(url, api_key=setup.api_key, timeouts=setup.timeouts, retries=retries)
            for url in urls
        ]
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


async def close_backends(backends: Sequence[Backend]) -> None:
    await asyncio.gather(*(b.close() for b in backends))


def _engine_records(ledger: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The engine records of a ledger (what is not one is passed over: the snapshot's own
    check refuses it later)."""
    server = ledger.get("server")
    groups = server.get("groups") if isinstance(server, dict) else None
    for group in groups if isinstance(groups, list) else []:
        engines = group.get("engines") if isinstance(group, dict) else None
        for engine in engines if isinstance(engines, list) else []:
            if isinstance(engine, dict) and isinstance(engine.get("id"), str):
                yield engine


def recorded_incarnation(
    ledger: Mapping[str, Any], urls: Sequence[str], url: str, group: str = GROUP
) -> Any:
    """The incarnation the ledger records for the engine at ``url`` (None if none)."""
    engine_id = f"{group}/{urls.index(url)}"
    for engine in _engine_records(ledger):
        if engine["id"] == engine_id:
            return engine.get("incarnation")
    return None


def unstale(ledger: Mapping[str, Any]) -> None:
    """Take no engine of ``ledger`` for one that lacks the fleet's weights: ``ctl`` pushes
    none, so an engine restarted in its place serves the model it was started with, as every
    engine of its fleet does (the library marks it stale until a push; here none comes)."""
    for engine in _engine_records(ledger):
        engine["stale"] = False


def record_restarted(
    ledger: dict[str, Any],
    urls: Sequence[str],
    restarted: Mapping[str, str | None],
    group: str = GROUP,
) -> None:
    """Record each ``restarted`` engine (URL -> the incarnation it shows now) in ``ledger`` as
    the library records a new process at an engine's address (``EngineRecord.restart``):
    alive, serving, every tag resident, stale until a push (``unstale`` says why ``ctl`` takes
    it as holding its fleet's weights); the server state becomes ``failed``, for ``reset`` to
    settle."""
    server = ledger.get("server")
    if not isinstance(server, dict) or not isinstance(server.get("groups"), list):
        return  # ServerSnapshot.from_dict refuses it
    ids = {f"{group}/{urls.index(u)}": seen for u, seen in restarted.items()}
    for engine in _engine_records(ledger):
        if engine["id"] in ids:
            record = EngineRecord(engine["id"], group, None)
            record.restart(ids[engine["id"]])
            fresh = dataclasses.asdict(record.snapshot())
            engine.update({k: v for k, v in fresh.items() if k not in ("id", "group")})
    server["state"] = ServerState.FAILED.value


def journal_entry(snapshot: ServerSnapshot) -> ServerSnapshot:
    """What the state file records while a call is in flight: ``failed`` (a run stopped now
    leaves engines mid-call) unless the records imply the server's state exactly."""
    if snapshot.in_flight() or snapshot.state is ServerState.PAUSING:
        return dataclasses.replace(snapshot, state=ServerState.FAILED)
    return snapshot


def error_of(exc: BaseException) -> dict[str, str]:
    return {"kind": type(exc).__name__, "message": str(exc)}


def url_of(engine_id: str, urls: Sequence[str]) -> str | None:
    index = engine_id.rpartition("/")[2]
    return urls[int(index)] if index.isdigit() and int(index) < len(urls) else None
