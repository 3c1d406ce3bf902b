"""``ctl status``: what the state file records of every engine beside what each server says now
(``/ready``, ``/server_info``), without changing anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any

import httpx

from rollout_lifecycle.backends.http import (
    HTTPTimeouts,
    SGLangHTTPEngine,
)
from rollout_lifecycle.cli.ctl_state import (
    GROUP,
    CtlError,
    ExitCode,
    Setup,
    close_backends,
    make_backends,
    read_ledger,
)
from rollout_lifecycle.contract.exceptions import EngineError, InvalidArgument
from rollout_lifecycle.core.group import EngineSnapshot
from rollout_lifecycle.core.server import ServerSnapshot


async def ready_status(url: str, timeouts: HTTPTimeouts) -> tuple[int | None, str | None]:
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


def recorded_row(engine: EngineSnapshot, url: str | None) -> dict[str, Any]:
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


async def run_status(setup: Setup) -> tuple[ExitCode, dict[str, Any]]:
    """Probe every engine (safe probes only) and set it beside the ledger; changes nothing."""
    urls, ledger = read_ledger(setup.state_path, setup.urls)
    snapshot: ServerSnapshot | None = None
    if ledger is not None:
        try:
            snapshot = ServerSnapshot.from_dict(ledger.get("server", {}))
        except InvalidArgument as exc:
            raise CtlError(
                ExitCode.STATE, f"state file {setup.state_path} is unusable: {exc}"
            ) from None
    recorded = snapshot.engines() if snapshot is not None else {}
    backends = make_backends(setup, urls, retries=1)
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
        await close_backends(backends)
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
        ready_status(backend.url, timeouts),
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
        "recorded": None if recorded is None else recorded_row(recorded, backend.url),
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
