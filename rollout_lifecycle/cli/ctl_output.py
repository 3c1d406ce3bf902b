"""What ``ctl`` prints: tables for people, JSON with ``--json``, errors on stderr, and the
library's events on stderr at ``-v`` / ``-vv``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rollout_lifecycle.cli.ctl_state import ExitCode, Setup
from rollout_lifecycle.contract.events import LOGGER_NAME


def report_error(
    action: str, as_json: bool, code: ExitCode, message: str, setup: Setup | None
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
        emit(json.dumps(report, indent=2))
    return int(code)


def emit(text: str, end: str = "\n") -> None:
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
    if row.get("pause_unknown"):
        return "unknown"
    return str(row["pause_mode"] or "yes") if row["paused"] else "no"


def _uncertain(rec: Mapping[str, Any] | None) -> str:
    """What a record does not know, for the REC UNCERTAIN column: the tags that may or may not
    be released, and ``session`` for a weight-update session that may be open."""
    if rec is None:
        return "-"
    return _tags([*rec["uncertain"], *(["session"] if rec.get("session_unknown") else [])])


def _agrees(row: Mapping[str, Any]) -> str:
    if row["agrees"] is None:
        return "-" if row.get("record_certain", True) else "unknown"
    return _yes(row["agrees"])


def _uncertain_notes(engines: Sequence[Mapping[str, Any]]) -> list[str]:
    """A line per engine whose record is not certain: what is unknown, and the way out."""
    notes = []
    for e in engines:
        rec = e["recorded"]
        if rec is None or e.get("record_certain", True):
            continue
        if rec["uncertain"]:
            notes.append(
                f"{e['id']}: the state file cannot say whether {_tags(rec['uncertain'])} "
                f"{'is' if len(rec['uncertain']) == 1 else 'are'} released (a release or "
                f"resume was in flight when a run stopped, and the engine cannot report it): "
                f"restart the server, then run 'ctl reset --restarted {e['url']}'"
            )
        if rec.get("pause_unknown"):
            notes.append(
                f"{e['id']}: its pause state is unknown (a pause or continue was in flight when "
                f"a run stopped): 'ctl reset' continues it"
            )
        if rec.get("session_unknown"):
            notes.append(f"{e['id']}: a weight-update session may be open")
    return notes


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def render_drive(report: Mapping[str, Any]) -> str:
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


def render_status(report: Mapping[str, Any]) -> str:
    if report["ledger"]:
        last = report["last_call"] or {}
        ended = (
            "in flight when its run stopped"
            if last.get("in_flight")
            else f"exit {last.get('exit_code', '?')}"
        )
        head = (
            f"recorded state: {report['recorded_state']} (last call {last.get('action', '?')} "
            f"{ended} at {report['updated_at']})"
        )
    else:
        head = "recorded state: none (no state file: engines are taken to be serving)"
    notes = _uncertain_notes(report["engines"])
    if report.get("engine_kind") == "vllm":
        table = _vllm_status_table(report["engines"])
        return "\n".join([head, table, *notes, f"state file: {report['state_file']}"])
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
                "-" if rec is None else rec["state"],
                "-" if rec is None else _paused(rec),
                "-" if rec is None else _tags(rec["released"]),
                _uncertain(rec),
                _agrees(e),
                " ".join(f"{k}={_number(v)}" for k, v in memory.items()) if memory else "-",
            ]
        )
    headers = [
        "ENGINE",
        "URL",
        "REACHABLE",
        "READY",
        "WEIGHTS",
        "REC STATE",
        "REC PAUSED",
        "REC RELEASED",
        "REC UNCERTAIN",
        "AGREES",
        "MEMORY",
    ]
    lines = [head, _table(headers, rows), *notes, f"state file: {report['state_file']}"]
    return "\n".join(lines)


def _vllm_status_table(engines: Sequence[Mapping[str, Any]]) -> str:
    """vLLM's status rows: ``/health``, ``/is_paused`` and the sleep state of ``/metrics``."""
    rows = []
    for e in engines:
        rec = e["recorded"]
        health = e["health_status"]
        rows.append(
            [
                e["id"],
                e["url"],
                _yes(e["reachable"]),
                "-" if health is None else f"{_yes(e['ready'])} ({health})",
                _yes(e["paused"]),
                e["sleep_state"] or "-",
                "-" if e["weight_version"] is None else str(e["weight_version"]),
                "-" if rec is None else rec["state"],
                "-" if rec is None else _paused(rec),
                "-" if rec is None else _tags(rec["released"]),
                _uncertain(rec),
                _agrees(e),
            ]
        )
    headers = [
        "ENGINE",
        "URL",
        "REACHABLE",
        "READY (HEALTH)",
        "PAUSED",
        "SLEEP",
        "WEIGHTS",
        "REC STATE",
        "REC PAUSED",
        "REC RELEASED",
        "REC UNCERTAIN",
        "AGREES",
    ]
    return _table(headers, rows)


@contextlib.contextmanager
def events_to_stderr(verbosity: int) -> Iterator[None]:
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
