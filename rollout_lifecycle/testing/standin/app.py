"""The stand-in's ASGI app: SGLang's routes, read from the endpoint table
(``backends.sglang.api``), in front of a ``SimulatedEngine``.

Each route is registered from its row (path, older alias, methods); its fields are read and
checked from the row; an engine refusal becomes the answer the row's shape gives (``success:
false``, a 400 text, a 503, or SGLang's JSON error). The handlers here say only what the
engine is asked and what the answer carries. Stand-in only, under ``/_standin/``: the engine's
history, memory and counters, and fault injection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar, cast

from rollout_lifecycle.backends.http.rows import Answer, Endpoint
from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.backends.sglang.api import (
    FLUSH_FAILED,
    FLUSH_TEXT,
    WEIGHTS_WRITTEN_FLUSH_FAILED,
    endpoint,
)
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineRejected,
    InvalidArgument,
)
from rollout_lifecycle.contract.outcome import SESSION_OPEN
from rollout_lifecycle.testing.sim_state import SIM_VERSION
from rollout_lifecycle.testing.simulated import SimulatedEngine
from rollout_lifecycle.testing.standin.auth import AuthMiddleware
from rollout_lifecycle.testing.standin.bodies import BadRequest, error, read
from rollout_lifecycle.testing.standin.faults import FAULTS_PATH
from rollout_lifecycle.testing.standin.state import (
    NEEDS,
    StandInState,
    check_path,
    fault_rules,
    standin_app,
    wait_disconnect,
)

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request
    from starlette.responses import Response

T = TypeVar("T")

DEFAULT_MODEL_PATH = "simulated/fake-sglang"
_Handler = Callable[["Request", dict[str, Any]], Awaitable[Any]]


def _answer(row: Endpoint, result: Any) -> Response:
    """``result`` in the shape ``row`` answers with."""
    from starlette.responses import JSONResponse, PlainTextResponse, Response

    if isinstance(result, Response):
        return result
    shape = row.answer
    if shape is Answer.STATUS_OK:
        return JSONResponse({"message": result, "status": "ok"})
    if shape is Answer.SUCCESS:
        extra = result if isinstance(result, dict) else {"message": result}
        return JSONResponse({"success": True, **extra})
    if shape is Answer.TEXT:
        return PlainTextResponse(result)
    if shape is Answer.PROBE:
        return Response(status_code=200 if result else 503)
    if shape is Answer.EMPTY:
        return Response(status_code=200)
    return JSONResponse(result)


def _refused(row: Endpoint, exc: EngineRejected) -> Response:
    """An engine's refusal in the shape ``row`` answers one with; a 500 is an exception the
    server's handler did not catch (an assert), which its framework answers without the text."""
    from starlette.responses import JSONResponse, PlainTextResponse, Response

    if exc.status == 500:
        # starlette: ServerErrorMiddleware answers an uncaught exception so
        return PlainTextResponse("Internal Server Error", status_code=500)
    if row.answer is Answer.SUCCESS:
        return JSONResponse({"success": False, "message": exc.message}, status_code=400)
    if row.answer is Answer.TEXT:
        # sglang: http_server.py flush_cache (the scheduler's message, or "Flush cache
        # failed.\n" when it gave none)
        text = FLUSH_FAILED if exc.message == FLUSH_FAILED.strip() else exc.message
        return PlainTextResponse(text, status_code=400)
    if row.answer is Answer.PROBE:
        return Response(status_code=503)
    return error(exc.message, exc.status)


def create_app(
    engine: SimulatedEngine,
    *,
    api_key: str | Secret | None = None,
    admin_key: str | Secret | None = None,
    on_death: Callable[[], None] | None = None,
    history_file: str | None = None,
    model_path: str = DEFAULT_MODEL_PATH,
) -> FastAPI:
    """The stand-in's ASGI app: SGLang 0.5.23's lifecycle routes in front of ``engine``.

    When the engine dies the app calls ``on_death`` before any response to the killing request
    is sent; ``serve`` passes one that exits the process, which drops every connection and
    closes the port as a crashed SGLang does. Without ``on_death`` (in-process use) requests
    raise ``StandInDied`` instead, which an ASGI server answers with a 500.

    Stand-in only: ``/_standin/faults`` injects HTTP faults into later requests (see
    ``FAULT_KINDS``); each applied fault is logged in the history as op ``"fault"``.
    """
    try:
        from starlette.responses import JSONResponse, Response
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(NEEDS) from exc

    api = as_secret(api_key, what="api_key")
    admin = as_secret(admin_key, what="admin_key")
    if not isinstance(engine, SimulatedEngine):
        raise InvalidArgument(f"engine must be a SimulatedEngine, got {engine!r}")
    history_file = check_path("history_file", history_file)
    if not isinstance(model_path, str) or not model_path:
        raise InvalidArgument(f"model_path must be a non-empty string, got {model_path!r}")
    if on_death is not None and not callable(on_death):
        raise InvalidArgument(f"on_death must be callable or None, got {on_death!r}")
    state = StandInState(
        engine, on_death=on_death, history_file=history_file, model_path=model_path
    )
    app = standin_app(state)
    # The last added runs first: a request passes auth before it can meet an injected fault.
    app.add_middleware(AuthMiddleware, api_key=api, admin_key=admin)

    def serves(name: str) -> Callable[[_Handler], _Handler]:
        """Serve the table's row ``name`` (every path and method it has) with ``handler``."""
        row = endpoint(name)

        def register(handler: _Handler) -> _Handler:
            async def route(request: Request) -> Response:
                if engine.dead:
                    state.die()
                try:
                    return _answer(row, await handler(request, await read(row, request)))
                except BadRequest as exc:
                    return error(exc.message)
                except EngineRejected as exc:
                    return _refused(row, exc)

            for path in row.paths:
                app.add_route(path, route, methods=list(row.methods))
                state.routes.add(path)
            return handler

        return register

    # ------------------------------------------------------------------ lifecycle

    @serves("pause_generation")
    async def pause_generation(_: Request, values: dict[str, Any]) -> str:
        await state.call(engine.pause_generation(values["mode"]))
        return "Generation paused successfully."

    @serves("continue_generation")
    async def continue_generation(_: Request, values: dict[str, Any]) -> str:
        await state.call(engine.continue_generation())
        return "Generation continued successfully."

    @serves("flush_cache")
    async def flush_cache(_: Request, values: dict[str, Any]) -> str:
        await state.call(engine.flush_cache(values["timeout"]))
        return FLUSH_TEXT

    @serves("release_memory_occupation")
    async def release_memory_occupation(_: Request, values: dict[str, Any]) -> None:
        await state.call(engine.release_memory_occupation(values["tags"]))

    @serves("resume_memory_occupation")
    async def resume_memory_occupation(_: Request, values: dict[str, Any]) -> None:
        await state.call(engine.resume_memory_occupation(values["tags"]))

    # ------------------------------------------------------------------ weights

    @serves("begin_weight_update")
    async def begin_weight_update(_: Request, values: dict[str, Any]) -> str:
        try:
            await state.call(engine.begin_weight_update(values["selector"]))
        except EngineRejected as exc:
            if exc.status == SESSION_OPEN:  # SGLang answers a session already open with 400
                raise EngineRejected(exc.engine, exc.op, exc.message, 400) from None
            raise
        return "Success"

    @serves("end_weight_update")
    async def end_weight_update(_: Request, values: dict[str, Any]) -> str:
        await state.call(engine.end_weight_update())
        return "Success"

    def update_flags(values: dict[str, Any]) -> dict[str, Any]:
        return {
            "weight_version": values["weight_version"],
            "flush_cache": values["flush_cache"],
            "abort_all_requests": values["abort_all_requests"],
        }

    def updated(message: str, version: str | None) -> str:
        return message if version is None else f"{message} Weight version updated to {version}."

    @serves("update_weights_from_disk")
    async def update_weights_from_disk(_: Request, values: dict[str, Any]) -> Any:
        path = values["model_path"]
        try:
            await state.call(engine.update_weights_from_disk(path, **update_flags(values)))
        except EngineRejected as exc:
            if exc.message == WEIGHTS_WRITTEN_FLUSH_FAILED:
                state.model_path = path
            return JSONResponse(
                {"success": False, "message": exc.message, "num_paused_requests": 0},
                status_code=400,
            )
        state.model_path = path
        message = updated("Succeeded to update model weights.", values["weight_version"])
        return {"message": message, "num_paused_requests": 0}

    # The update calls use their own selector, whatever the session's begin was given.

    @serves("update_weights_from_tensor")
    async def update_weights_from_tensor(_: Request, values: dict[str, Any]) -> str:
        await state.call(
            engine.update_weights_from_tensor(
                values["serialized_named_tensors"],
                selector=values["selector"],
                **update_flags(values),
            )
        )
        # sglang: weight_updater.py update_weights_from_tensor answers "Success"
        return updated("Success", values["weight_version"])

    @serves("update_weights_from_distributed")
    async def update_weights_from_distributed(_: Request, values: dict[str, Any]) -> str:
        await state.call(
            engine.update_weights_from_distributed(
                values["names"],
                values["dtypes"],
                values["shapes"],
                values["group_name"],
                load_format=values["load_format"],
                selector=values["selector"],
                **update_flags(values),
            )
        )
        return updated("Succeeded to update parameter online.", values["weight_version"])

    @serves("init_weights_update_group")
    async def init_weights_update_group(_: Request, values: dict[str, Any]) -> str:
        # The stand-in records the group and forms no collective.
        await state.call(
            engine.init_weights_update_group(
                values["master_address"],
                values["master_port"],
                values["rank_offset"],
                values["world_size"],
                group_name=values["group_name"],
                backend=values["backend"],
            )
        )
        return "Succeeded to initialize custom process group."

    @serves("destroy_weights_update_group")
    async def destroy_weights_update_group(_: Request, values: dict[str, Any]) -> str:
        await state.call(engine.destroy_weights_update_group(values["group_name"]))
        return "Succeeded to destroy custom process group."

    @serves("update_weight_version")
    async def update_weight_version(_: Request, values: dict[str, Any]) -> dict[str, Any]:
        version = values["new_version"]
        await state.call(
            engine.update_weight_version(version, abort_all_requests=values["abort_all_requests"])
        )
        return {"message": f"Weight version updated to {version}", "new_version": version}

    @serves("abort_request")
    async def abort_request(_: Request, values: dict[str, Any]) -> None:
        await state.call(engine.abort_request(values["rid"], abort_all=values["abort_all"]))

    # ------------------------------------------------------------------ probes and info

    @serves("weights_checker")
    async def weights_checker(_: Request, values: dict[str, Any]) -> Any:
        # sglang: http_server.py check_weights (one ChecksumInfo per rank; the engine's
        # checksum is a sha256 over the ranks' own); utils/weight_checker.py handle
        if values["action"] != "checksum":
            # (the stand-in serves only the read of the route's four actions)
            message = f"Unsupported action={values['action']!r}"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        sums = (await state.call(engine.weight_fingerprint()))["tensors"]
        rank = hashlib.sha256("".join(f"{k}{sums[k]}" for k in sorted(sums)).encode())
        placement = dict.fromkeys(("tp_rank", "pp_rank", "rank"), 0)
        # one entry per data-parallel rank, each saying dp_size 1 (as a real --dp-size 2
        # server answers: each scheduler reports its own rank's view)
        sizes = dict.fromkeys(("tp_size", "dp_size", "pp_size", "size"), 1)
        ranks = [
            {
                "checksums": sums,
                "per_gpu_checksum": rank.hexdigest(),
                "parallelism_info": [{"role": "target", **placement, "dp_rank": dp, **sizes}],
            }
            for dp in range(engine.dp_size)
        ]
        # sglang: tokenizer_control_mixin.py check_weights (sha256 over every rank's own)
        engine_sum = hashlib.sha256(rank.hexdigest().encode() * len(ranks)).hexdigest()
        return {"success": True, "message": "", "ranks": ranks, "per_engine_checksum": engine_sum}

    @serves("health")
    async def health(_: Request, values: dict[str, Any]) -> bool:
        # A real one-token generation: while paused it hangs, then answers 503.
        await state.call(engine.health())
        return True

    @serves("ready")
    async def ready(_: Request, values: dict[str, Any]) -> bool:
        # sglang: http_server.py ready (tokenizer_manager.is_ready: not paused and Up)
        return await state.call(engine.ready())

    @serves("ping")
    async def ping(_: Request, values: dict[str, Any]) -> bool:
        # sglang: http_server.py sagemaker_health (is_healthy(): Up, paused or not)
        return await state.call(engine.ping())

    @serves("server_info")
    async def server_info(_: Request, values: dict[str, Any]) -> dict[str, Any]:
        # sglang: http_server.py server_info, utils/common.py build_server_info: the resolved
        # server arguments, keys in clear (the client must mask them, not the server).
        info = await state.call(engine.server_info())
        keys = {
            "api_key": None if api is None else api.reveal(),
            "admin_api_key": None if admin is None else admin.reveal(),
        }
        info.update(model_path=state.initial_model_path, tokenizer_path=state.initial_model_path)
        info.update(keys)
        for rank in info["internal_states"]:
            rank.update(model_path=state.initial_model_path, **keys)
        return info

    @serves("model_info")
    async def model_info(_: Request, values: dict[str, Any]) -> dict[str, Any]:
        # sglang: http_server.py model_info (the model a weight update swapped in, the
        # tokenizer's weight version); it answers before warm-up.
        return {
            "model_path": state.model_path,
            "served_model_name": state.initial_model_path,
            "tokenizer_path": state.initial_model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": await state.call(engine.weight_version()),
        }

    @serves("generate")
    async def generate(request: Request, values: dict[str, Any]) -> Any:
        task = asyncio.ensure_future(engine.generate(await request.json()))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            gone.cancel()
        if not task.done():
            # SGLang aborts a request whose client went away; nobody reads this answer.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineDead):
                await task
            return Response(status_code=499)
        try:
            return await state.call(task)
        except EngineRejected as exc:
            return JSONResponse({"error": {"message": exc.message}}, status_code=exc.status)

    # ----------------------------------------------- a real route the library does not call

    async def loads(_: Request) -> Any:
        # sglang: entrypoints/v1_loads.py get_loads and managers/load_snapshot.py LoadSnapshot
        # (to_dict): one entry per data-parallel rank; the core keys tests wait on are the
        # scheduler's running and waiting requests (not those held before it while paused).
        counts = engine.stats()
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": SIM_VERSION,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": counts["running"],
                    "num_waiting_reqs": counts["waiting"],
                }
            ],
        }

    # ------------------------------------------------------------------ stand-in only

    def standin(path: str, methods: list[str], read: Callable[[Request], Awaitable[Any]]) -> None:
        async def route(request: Request) -> Response:
            if engine.dead:
                state.die()
            try:
                return JSONResponse(json.loads(json.dumps(await read(request), default=repr)))
            except BadRequest as exc:
                return error(exc.message)

        app.add_route(path, route, methods=methods)

    async def faults(request: Request) -> dict[str, Any]:
        return await fault_rules(state, request)

    async def history(_: Request) -> Any:
        return state.history()

    async def memory(_: Request) -> Any:
        return engine.memory()

    async def engine_state(_: Request) -> Any:
        return engine.state()

    async def stats(_: Request) -> Any:
        return engine.stats()

    async def lose_rank(request: Request) -> Any:
        body = await request.json()
        rank = body.get("rank") if isinstance(body, dict) else None
        try:
            engine.lose_rank(cast(int, rank))  # (checked there)
        except InvalidArgument as exc:
            raise BadRequest(str(exc)) from None
        return {"lost_ranks": [rank]}

    async def slow_rank(request: Request) -> Any:
        body = await request.json()
        found = body if isinstance(body, dict) else {}
        try:
            engine.slow_rank(cast(int, found.get("rank")), cast(float, found.get("seconds")))
        except InvalidArgument as exc:  # (checked there)
            raise BadRequest(str(exc)) from None
        return {"slow_rank": found.get("rank"), "seconds": found.get("seconds")}

    standin("/v1/loads", ["GET"], loads)
    standin("/_standin/history", ["GET"], history)
    standin("/_standin/memory", ["GET"], memory)
    standin("/_standin/state", ["GET"], engine_state)
    standin("/_standin/stats", ["GET"], stats)
    standin("/_standin/lose_rank", ["POST"], lose_rank)
    standin("/_standin/slow_rank", ["POST"], slow_rank)
    standin(FAULTS_PATH, ["GET", "POST", "DELETE"], faults)
    return app


__all__ = ["DEFAULT_MODEL_PATH", "create_app"]
