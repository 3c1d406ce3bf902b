"""SGLang's HTTP contract as one table: for every endpoint the library calls or the stand-in
serves, its route and older alias, the methods it accepts, the key it wants, the fields of its
body or query, the shape of its answer, which client timeout bounds it, and whether a call may be
sent again.

The HTTP client sends from this table (method, key, timeout, retries, how an answer is read),
the stand-in server serves from it (routes, auth, body validation, answer shapes), and the
contract tests check every row against a real server, so a row of SGLang's contract changes in
one place. Each row cites the SGLang function it was read from (``sglang/srt/entrypoints/
http_server.py`` unless said otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from rollout_lifecycle.backends.http.rows import (
    Answer,
    Auth,
    Endpoint,
    Field,
    TimeoutClass,
)
from rollout_lifecycle.contract.values import DEFAULT_GROUP_NAME

#: ``/pause_generation``'s modes, in the order of SGLang's ``Literal`` (its 400 names them so):
#: ``io_struct.py`` ``PauseGenerationReqInput.mode``.
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
#: Which model runners a weight call names (``io_struct.py`` ``WeightSelector``).
SELECTORS: tuple[str, ...] = ("target", "draft", "all")


def _flags() -> tuple[Field, ...]:
    """The fields every weight update shares (``io_struct.py`` ``UpdateWeights*ReqInput``)."""
    return (
        Field("load_format", "str", nullable=True),
        Field("weight_version", "str", nullable=True),
        Field("flush_cache", "bool", default=True),
        Field("abort_all_requests", "bool", default=False),
    )


_SELECTOR = Field("selector", "choice", default="all", choices=SELECTORS)
_GROUP = Field("group_name", "str", default=DEFAULT_GROUP_NAME)
_TAGS = Field("tags", "tags", nullable=True)


def _control(
    name: str,
    answer: Answer,
    timeout: TimeoutClass,
    *fields: Field,
    repeatable: bool = False,
    methods: tuple[str, ...] = ("POST",),
    reads_body: bool = True,
    body_optional: bool = False,
    source: str,
) -> Endpoint:
    return Endpoint(
        name,
        f"/{name}",
        methods,
        Auth.CONTROL,
        answer,
        timeout,
        repeatable,
        fields,
        reads_body=reads_body,
        body_optional=body_optional,
        source=source,
    )


def _read(
    name: str, auth: Auth, answer: Answer, repeatable: bool, *aliases: str, source: str
) -> Endpoint:
    """A ``GET`` with no body, bounded by the probe timeout."""
    return Endpoint(
        name,
        f"/{name}",
        ("GET",),
        auth,
        answer,
        "probe",
        repeatable,
        reads_body=False,
        aliases=aliases,
        source=source,
    )


_ROWS: tuple[Endpoint, ...] = (
    # ------------------------------------------------------------------ lifecycle
    _control(
        "pause_generation",
        Answer.STATUS_OK,
        "control",
        Field("mode", "choice", default="abort", choices=PAUSE_MODES),
        repeatable=True,
        source="pause_generation (io_struct.py PauseGenerationReqInput)",
    ),
    _control(
        "continue_generation",
        Answer.STATUS_OK,
        "control",
        Field("torch_empty_cache", "bool", default=True),
        repeatable=True,
        source="continue_generation (io_struct.py ContinueGenerationReqInput)",
    ),
    _control(
        "flush_cache",
        Answer.TEXT,
        "flush_margin",
        Field("timeout", "number", default=0.0, where="query"),
        repeatable=True,
        methods=("POST", "GET"),
        reads_body=False,
        source="flush_cache (timeout: Query(0.0, ge=0.0))",
    ),
    *(
        _control(
            name,
            Answer.NULL,
            "memory",
            _TAGS,
            methods=("POST", "GET"),
            source=f"{name} (io_struct.py {kind}MemoryOccupationReqInput)",
        )
        for name, kind in (
            ("release_memory_occupation", "Release"),
            ("resume_memory_occupation", "Resume"),
        )
    ),
    # ------------------------------------------------------------------ weights
    _control(
        "begin_weight_update",
        Answer.SUCCESS,
        "control",
        _SELECTOR,
        source="begin_weight_update (io_struct.py BeginWeightUpdateReqInput)",
    ),
    _control(
        "end_weight_update",
        Answer.SUCCESS,
        "control",
        source="end_weight_update (io_struct.py EndWeightUpdateReqInput)",
    ),
    _control(
        "update_weights_from_disk",
        Answer.SUCCESS,
        "weights",
        Field("model_path", "str", required=True),
        *_flags(),
        source="update_weights_from_disk (io_struct.py UpdateWeightFromDiskReqInput)",
    ),
    _control(
        "update_weights_from_tensor",
        Answer.SUCCESS,
        "weights",
        Field("serialized_named_tensors", "list", required=True),
        _SELECTOR,
        Field("torch_empty_cache", "bool", default=False),
        *_flags(),
        source="update_weights_from_tensor (io_struct.py UpdateWeightsFromTensorReqInput)",
    ),
    _control(
        "update_weights_from_distributed",
        Answer.SUCCESS,
        "weights",
        Field("names", "list", required=True),
        Field("dtypes", "list", required=True),
        Field("shapes", "list", required=True),
        _GROUP,
        _SELECTOR,
        Field("torch_empty_cache", "bool", default=False),
        *_flags(),
        source="update_weights_from_distributed "
        "(io_struct.py UpdateWeightsFromDistributedReqInput)",
    ),
    _control(
        "init_weights_update_group",
        Answer.SUCCESS,
        "weights",
        Field("master_address", "str", required=True),
        Field("master_port", "int", required=True),
        Field("rank_offset", "int", required=True),
        Field("world_size", "int", required=True),
        _GROUP,
        Field("backend", "str", default="nccl"),
        source="init_weights_update_group (io_struct.py InitWeightsUpdateGroupReqInput)",
    ),
    _control(
        "destroy_weights_update_group",
        Answer.SUCCESS,
        "control",
        _GROUP,
        source="destroy_weights_update_group (io_struct.py DestroyWeightsUpdateGroupReqInput)",
    ),
    _control(
        "update_weight_version",
        Answer.SUCCESS,
        "control",
        Field("new_version", "str", required=True),
        # SGLang's default aborts every request, those a retract pause kept included.
        Field("abort_all_requests", "bool", default=True),
        source="update_weight_version (io_struct.py UpdateWeightVersionReqInput)",
    ),
    _control(
        "abort_request",
        Answer.EMPTY,
        "control",
        Field("rid", "str", default="", nullable=True),
        Field("abort_all", "bool", default=False),
        source="abort_request (io_struct.py AbortReq)",
    ),
    _control(
        "weights_checker",
        Answer.OBJECT,
        "weights",
        # A plain string: the scheduler answers an action it does not know with 400 {"success":
        # false, "message": "Unsupported action='...'"}. It also takes "snapshot", "compare"
        # and "reset_tensors" (which overwrites every weight with noise); the library sends
        # only the read. With no body at all the route runs the default, a checksum.
        Field("action", "str", default="checksum"),
        _SELECTOR,
        repeatable=True,
        methods=("POST", "GET"),
        body_optional=True,
        source="check_weights (io_struct.py CheckWeightsReqInput; utils/weight_checker.py "
        "WeightChecker.handle, _compute_checksum): 200 {success, message, ranks, "
        "per_engine_checksum}",
    ),
    # ------------------------------------------------------------------ requests and reads
    Endpoint(
        "generate",
        "/generate",
        ("POST", "PUT"),
        Auth.NORMAL,
        Answer.OBJECT,
        "generate",
        False,
        source="generate_request",
    ),
    _read(
        "server_info",
        Auth.NORMAL,
        Answer.OBJECT,
        True,
        "/get_server_info",
        source="server_info, get_server_info (utils/common.py build_server_info)",
    ),
    _read(
        "model_info",
        Auth.NORMAL,
        Answer.OBJECT,
        True,
        "/get_model_info",
        source="model_info, get_model_info",
    ),
    _read(
        "ping",
        Auth.NORMAL,
        Answer.PROBE,
        False,
        source="sagemaker_health (200 when is_healthy(), paused or not)",
    ),
    _read(
        "ready",
        Auth.OPEN,
        Answer.PROBE,
        False,
        source="ready (tokenizer_manager.py is_ready: not paused and healthy)",
    ),
    _read(
        "health",
        Auth.OPEN,
        Answer.PROBE,
        False,
        "/health_generate",
        source="health_generate (a one-token generation: hangs while paused)",
    ),
)

#: Every row, by name.
ENDPOINTS: Mapping[str, Endpoint] = {row.name: row for row in _ROWS}
#: Every row, by each of its paths (aliases included).
BY_PATH: Mapping[str, Endpoint] = {path: row for row in _ROWS for path in row.paths}

#: SGLang never asks for a key on paths that start so (probes and Prometheus scraping).
# sglang: utils/auth.py decide_request_auth (/health*, /ready*, /metrics* are open)
OPEN_PREFIXES: tuple[str, ...] = ("/health", "/ready", "/metrics")

# Answers SGLang writes, which the simulator and stand-in give back word for word and the client
# may read.
#: ``/flush_cache``'s text on success.
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
#: ``/flush_cache``'s text when the scheduler refused and gave no message.
# sglang: http_server.py flush_cache (``ret.message or "Flush cache failed.\n"``)
FLUSH_FAILED = "Flush cache failed.\n"
#: A deferred flush (``?timeout=T``) that never saw the engine idle.
# sglang: flush_wrapper.py SchedulerFlushWrapper.check_pending / handle
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
#: A weight update that wrote the weights but could not flush a busy engine's cache.
# sglang: scheduler_components/weight_updater.py flush_cache_after_weight_update
WEIGHTS_WRITTEN_FLUSH_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)

#: A begin of a weight-update session while one is open (400).
# sglang: scheduler_components/weight_updater.py begin_weight_update
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"


def endpoint(name: str) -> Endpoint:
    """The row called ``name``."""
    try:
        return ENDPOINTS[name]
    except KeyError:
        raise KeyError(f"no SGLang endpoint {name!r}; known: {', '.join(ENDPOINTS)}") from None


def auth_level(path: str) -> Auth:
    """The key SGLang wants for ``path``; a route the table does not know is a normal one."""
    if path.startswith(OPEN_PREFIXES):
        return Auth.OPEN
    row = BY_PATH.get(path)
    return Auth.NORMAL if row is None else row.auth


def rows() -> Iterator[Endpoint]:
    """Every row, in the table's order."""
    return iter(_ROWS)


__all__ = [
    "BY_PATH",
    "ENDPOINTS",
    "FLUSH_FAILED",
    "FLUSH_TEXT",
    "FLUSH_TIMED_OUT",
    "OPEN_PREFIXES",
    "PAUSE_MODES",
    "SELECTORS",
    "SESSION_ALREADY_OPEN",
    "WEIGHTS_WRITTEN_FLUSH_FAILED",
    "auth_level",
    "endpoint",
    "rows",
]
