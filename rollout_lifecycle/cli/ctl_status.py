"""``ctl status``: what the state file records of every engine beside what each server says now
(SGLang: ``/ready``, ``/server_info``; vLLM: ``/health``, ``/is_paused``, ``/metrics``), without
changing anything; and the check that an engine serves with all its memory resident.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import httpx

from rollout_lifecycle.backends.http.wire import HTTPTimeouts
from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine
from rollout_lifecycle.cli.ctl_state import (
    Backend,
    CtlError,
    ExitCode,
    Setup,
    close_backends,
    make_backends,
    read_ledger,
)
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineError,
    EngineTimeout,
    EngineUnreachable,
    InvalidArgument,
)
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


#: The probe that says an engine serves, per engine kind, for messages.
SERVING_PROBE = {"sglang": "/ready", "vllm": "/health and /is_sleeping"}


async def serving(setup: Setup, urls: Sequence[str]) -> list[tuple[bool | None, str]]:
    """Whether each engine serves with all its memory resident, as safe probes say: True,
    False and what it answered, or None and why nothing answered.

    SGLang: ``/ready`` 200 (503 while paused). vLLM: ``/health`` 200 and ``/is_sleeping``
    false (``_vllm_serving``).
    """
    if setup.engine_kind != "vllm":
        answers = await asyncio.gather(*(ready_status(u, setup.timeouts) for u in urls))
        return [
            (None, why or "") if status is None else (status == 200, f"/ready {status}")
            for status, why in answers
        ]
    backends = make_backends(setup, urls, retries=0)
    try:
        return list(await asyncio.gather(*(_vllm_serving(b) for b in backends)))
    finally:
        await close_backends(backends)


async def _vllm_serving(backend: Backend) -> tuple[bool | None, str]:
    """Whether a vLLM engine serves with all its memory resident (None: it did not say).
    ``/is_paused`` is not enough: ``/resume`` runs the scheduler whatever is asleep."""
    assert isinstance(backend, VLLMHTTPEngine)
    health = await backend.health_status()
    if health is None:
        return None, "/health: no answer"
    if health != 200:
        return False, f"/health {health}"
    try:
        # vllm: v1/engine/core.py EngineCore.is_sleeping (paused, or the executor asleep)
        sleeping = await backend.is_sleeping()
    except (EngineUnreachable, EngineTimeout, EngineDead) as exc:
        return None, f"/is_sleeping: {exc.message}"
    except EngineError as exc:
        return False, f"/is_sleeping: {exc.message}"
    if sleeping:
        return False, "/is_sleeping true (paused, or memory asleep)"
    return True, "/health 200, /is_sleeping false"


def recorded_row(engine: EngineSnapshot, url: str | None) -> dict[str, Any]:
    return {
        "id": engine.id,
        "url": url,
        "state": engine.state.value,
        "alive": engine.alive,
        "paused": engine.paused,
        "pause_mode": engine.pause_mode,
        "flushed": engine.flushed,
        "released": list(engine.released),
        "uncertain": list(engine.uncertain),
        "pause_unknown": engine.pause_unknown,
        "session_unknown": engine.session_unknown,
        "stale": engine.stale,
        "weights_lost": engine.weights_lost,
        "kv_asleep": engine.kv_asleep,
        "family": None if engine.capabilities is None else engine.capabilities.get("family"),
        "last_op": engine.last_op,
        "last_outcome": engine.last_outcome,
    }


def record_certain(recorded: EngineSnapshot | None) -> bool:
    """Whether the ledger knows the engine's state: no tag it may or may not hold released
    (a release or resume was in flight when a run stopped), no pause or continue unanswered,
    no weight-update session that may be open. What an engine shows can agree with an
    uncertain record only by chance: SGLang reports no released tags, and ``/ready`` answers
    503 whether a release landed or not."""
    return recorded is None or not (
        recorded.uncertain or recorded.pause_unknown or recorded.session_unknown
    )


def agreement(observed_paused: bool | None, recorded: EngineSnapshot | None) -> bool | None:
    """Whether what an engine shows (paused or not; None: it did not say) agrees with its
    record (none: serving): False on a pause state the record knows and the engine
    contradicts; None (unknown) when the engine did not say, or the record is not certain
    (``record_certain``), since what the engine shows then cannot confirm it."""
    if observed_paused is None or (recorded is not None and recorded.pause_unknown):
        return None
    if observed_paused != (recorded.paused if recorded is not None else False):
        return False
    return True if record_certain(recorded) else None


async def run_status(setup: Setup) -> tuple[ExitCode, dict[str, Any]]:
    """Probe every engine (safe probes only) and set it beside the ledger; changes nothing."""
    urls, ledger = read_ledger(setup.state_path, setup.urls, setup.engine_kind)
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
        probe = _vllm_probe if setup.engine_kind == "vllm" else _probe
        ids = [f"{setup.group}/{i}" for i in range(len(backends))]
        probes = asyncio.wait_for(
            asyncio.gather(
                *(
                    probe(engine_id, b, setup.timeouts, recorded.get(engine_id))
                    for engine_id, b in zip(ids, backends, strict=True)
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
        "engine_kind": setup.engine_kind,
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


async def _attempt(call: Awaitable[Any]) -> tuple[Any, str | None]:
    try:
        return await call, None
    except EngineError as exc:
        return None, exc.message


async def _probe(
    engine_id: str,
    backend: Backend,
    timeouts: HTTPTimeouts,
    recorded: EngineSnapshot | None,
) -> dict[str, Any]:
    """One engine as observed: ``/server_info`` (reachable, memory), ``/model_info`` (weight
    version) and ``/ready`` (200 serving; 503 paused or unhealthy)."""
    (info, info_error), (version, _), (ready, ready_error) = await asyncio.gather(
        _attempt(backend.server_info()),
        _attempt(backend.weight_version()),
        ready_status(backend.url, timeouts),
    )
    reachable = info is not None
    agrees = agreement(None if ready not in (200, 503) else ready == 503, recorded)
    return {
        "id": engine_id,
        "url": backend.url,
        "reachable": reachable,
        "ready": ready == 200 if ready is not None else None,
        "ready_status": ready,
        "weight_version": version,
        "memory": _memory(info) if isinstance(info, dict) else None,
        "recorded": None if recorded is None else recorded_row(recorded, backend.url),
        "record_certain": record_certain(recorded),
        "agrees": agrees,
        "error": info_error or ready_error,
    }


async def _vllm_probe(
    engine_id: str,
    backend: Backend,
    timeouts: HTTPTimeouts,
    recorded: EngineSnapshot | None,
) -> dict[str, Any]:
    """One vLLM engine as observed: ``/version`` and ``/metrics`` (reachable; the sleep state
    gauge), ``/weight_info`` (weight version), ``/health`` (200 paused or not, 503 once the
    engine core died) and ``/is_paused``. ``ready``: healthy and not paused."""
    assert isinstance(backend, VLLMHTTPEngine)
    (info, info_error), (version, _), health, (seen, paused_error) = await asyncio.gather(
        _attempt(backend.server_info()),
        _attempt(backend.weight_version()),
        backend.health_status(),
        _attempt(backend.observe(identify=False)),
    )
    paused = seen.get("paused") if isinstance(seen, dict) else None
    return {
        "id": engine_id,
        "url": backend.url,
        "reachable": info is not None,
        "ready": None if health is None else health == 200 and paused is False,
        "health_status": health,
        "paused": paused,
        "sleep_state": None if info is None else info["sleep_state"],
        "weight_version": version,
        "memory": None,
        "recorded": None if recorded is None else recorded_row(recorded, backend.url),
        "record_certain": record_certain(recorded),
        "agrees": agreement(paused if isinstance(paused, bool) else None, recorded),
        "error": info_error or paused_error,
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
