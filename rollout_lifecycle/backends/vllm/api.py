"""vLLM's HTTP contract as one table, of the rows SGLang's is made of (``http.rows``): for every
route the vLLM client calls, its method, the key it wants, its fields (query or body), the shape
of its answer, which client timeout bounds it, and whether a call may be sent again.

The routes below exist only when the server runs with ``VLLM_SERVER_DEV_MODE=1`` (the RL and
developer routers are mounted then), except the OpenAI API and the probes. vLLM's ``--api-key``
guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``; every lifecycle route
answers whoever reaches the port. Each row cites the vLLM function it was read from (under
``vllm/entrypoints/``), and ``tests/wire/test_wire_vllm.py`` checks the rows against a
real vLLM 0.32.0 server and the vLLM stand-in (``testing/standin/vllm_app.py``, which serves
this table) side by side.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollout_lifecycle.backends.http.rows import (
    Answer,
    Auth,
    Endpoint,
    Field,
    FieldKind,
    TimeoutClass,
)

#: ``/pause``'s modes (``vllm/v1/engine/__init__.py`` ``PauseMode``): abort answers every
#: running request at once with ``finish_reason: "abort"``; wait blocks until they finish; keep
#: freezes them, and they go on after ``/resume``.
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")
#: The labels of the ``vllm:engine_sleep_state`` gauge in ``/metrics``
#: (``v1/metrics/loggers.py record_sleep_state``): ``awake`` is 1 once fully awake; else
#: ``weights_offloaded`` is 1 after a level-1 sleep, ``discard_all`` after a level-2 one. vLLM
#: sets the gauge at a sleep and at the wake that leaves it fully awake (``AsyncLLM.wake_up``),
#: so it reads asleep until then.
SLEEP_STATES: tuple[str, ...] = ("awake", "weights_offloaded", "discard_all")
#: vLLM's key guards only these prefixes: ``serve/middleware/authenticate.py GUARDED_PREFIX``.
GUARDED_PREFIXES: tuple[str, ...] = ("/v1", "/v2", "/inference", "/cohere")


def _route(
    name: str,
    answer: Answer,
    timeout: TimeoutClass,
    *fields: Field,
    method: str = "POST",
    repeatable: bool = False,
    path: str | None = None,
    reads_body: bool = True,
    source: str,
) -> Endpoint:
    path = f"/{name}" if path is None else path
    auth = Auth.NORMAL if path.startswith(GUARDED_PREFIXES) else Auth.OPEN
    return Endpoint(
        name,
        path,
        (method,),
        auth,
        answer,
        timeout,
        repeatable,
        fields,
        reads_body=reads_body,
        source=source,
    )


def _query(name: str, kind: FieldKind, default: object, choices: tuple[str, ...] = ()) -> Field:
    return Field(name, kind, default=default, choices=choices, where="query")


_ROWS: tuple[Endpoint, ...] = (
    # ------------------------------------------------------------------ lifecycle
    _route(
        "pause",
        Answer.STATUS_OK,
        "control",
        _query("mode", "choice", "abort", PAUSE_MODES),
        repeatable=True,
        reads_body=False,
        source="rl/online/api_router.py pause_generation (200 {'status': 'paused'}, twice too)",
    ),
    _route(
        "resume",
        Answer.STATUS_OK,
        "control",
        repeatable=True,
        reads_body=False,
        source="rl/online/api_router.py resume_generation",
    ),
    _route(
        "is_paused",
        Answer.OBJECT,
        "probe",
        method="GET",
        repeatable=True,
        reads_body=False,
        source="rl/online/api_router.py is_paused ({'is_paused': bool}; true at once)",
    ),
    _route(
        "reset_prefix_cache",
        Answer.SUCCESS,
        "control",
        repeatable=True,
        reads_body=False,
        source="serve/dev/cache/api_router.py reset_prefix_cache ({'success': false} while "
        "requests hold blocks)",
    ),
    _route(
        "sleep",
        Answer.STATUS_OK,
        "memory",
        _query("level", "int", 1),
        _query("mode", "choice", "abort", PAUSE_MODES),
        reads_body=False,
        # Levels: 0 pauses only; 1 moves the weights to host memory and drops the KV cache; 2
        # drops both (the weights must be pushed again before serving).
        source="serve/dev/sleep/api_router.py sleep -> v1/engine/core.py EngineCore.sleep",
    ),
    _route(
        "wake_up",
        Answer.OBJECT,
        "memory",
        _query("tags", "tags", None),
        reads_body=False,
        source="serve/dev/sleep/api_router.py wake_up -> EngineCore.wake_up ({'status': "
        "'awake'|'sleeping'}; once fully awake it resumes the scheduler)",
    ),
    _route(
        "is_sleeping",
        Answer.OBJECT,
        "probe",
        method="GET",
        repeatable=True,
        reads_body=False,
        source="serve/dev/sleep/api_router.py is_sleeping (paused or asleep)",
    ),
    _route(
        "abort_requests",
        Answer.OBJECT,
        "control",
        Field("request_ids", "list", nullable=True),
        source="rl/online/api_router.py abort_requests ({} aborts every request)",
    ),
    # ------------------------------------------------------------------ weights
    _route(
        "collective_rpc",
        Answer.OBJECT,
        "weights",
        Field("method", "str", required=True),
        Field("args", "list", nullable=True),
        Field("kwargs", "object", nullable=True),
        Field("timeout", "number", nullable=True),
        source="serve/dev/rpc/api_router.py collective_rpc ({'results': [...]})",
    ),
    _route(
        "weight_checker",
        Answer.OBJECT,
        "weights",
        Field("action", "choice", required=True, choices=("checksum", "compare", "reset")),
        Field("baseline", "object", nullable=True),
        source="rl/online/api_router.py weight_checker (reset zeroes every weight)",
    ),
    _route(
        "update_weight_version",
        Answer.SUCCESS,
        "control",
        Field("new_version", "str", required=True),
        source="rl/online/api_router.py update_weight_version (a label; aborts nothing)",
    ),
    _route(
        "weight_info",
        Answer.OBJECT,
        "probe",
        method="GET",
        repeatable=True,
        reads_body=False,
        source="rl/online/api_router.py weight_info ({'weight_version'}; 'default' at start)",
    ),
    _route(
        "start_weight_update",
        Answer.OBJECT,
        "control",
        reads_body=False,
        source="rl/online/api_router.py start_weight_update",
    ),
    _route(
        "finish_weight_update",
        Answer.OBJECT,
        "control",
        Field("weight_version", "str", nullable=True),
        source="rl/online/api_router.py finish_weight_update (sets the version)",
    ),
    # ------------------------------------------------------------------ requests and reads
    _route(
        "completions",
        Answer.OBJECT,
        "generate",
        path="/v1/completions",
        source="openai/completion/api_router.py create_completion",
    ),
    _route(
        "version",
        Answer.OBJECT,
        "probe",
        method="GET",
        repeatable=True,
        reads_body=False,
        source="serve/__init__.py show_version ({'version': '0.32.0'})",
    ),
    _route(
        "health",
        Answer.PROBE,
        "probe",
        method="GET",
        repeatable=True,
        reads_body=False,
        source="serve/instrumentator/health.py health (200 paused or not; 503 once the engine "
        "core is dead)",
    ),
    _route(
        "metrics",
        Answer.TEXT,
        "probe",
        method="GET",
        repeatable=True,
        reads_body=False,
        source="Prometheus exposition (process_start_time_seconds, vllm:engine_sleep_state)",
    ),
)

#: Every row, by name.
ENDPOINTS: Mapping[str, Endpoint] = {row.name: row for row in _ROWS}


__all__ = ["ENDPOINTS", "GUARDED_PREFIXES", "PAUSE_MODES"]
