"""The vLLM stand-in's ASGI app: the routes of vLLM 0.32.0's table (``backends.vllm.api``),
started with ``VLLM_SERVER_DEV_MODE=1``, in front of a simulated engine (``vllm_engine``).

Each route of the table is registered from its row (path, method); the handlers say what the
engine is asked and answer as vLLM does (its JSON error body, ``{"error": "Unauthorized"}``
from the key check of the ``/v1`` routes only). The stand-in's faults, history and death
handling are the SGLang stand-in's (``app.StandInState``, ``faults.FaultMiddleware``). Beyond
the table: the weight-transfer routes (``/init_weight_transfer_engine``, ``/update_weights``),
``/load`` (``--enable-server-load-tracking``), and, stand-in only, ``/_standin/*``.

Run one as a process with ``python -m rollout_lifecycle.testing.standin.vllm_app --port N``
(``process.VLLMStandInServer`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.backends.vllm.api import (
    ENDPOINTS,
    GUARDED_PREFIXES,
    PAUSE_MODES,
    SLEEP_STATES,
)
from rollout_lifecycle.contract.exceptions import EngineRejected, InvalidArgument
from rollout_lifecycle.testing.sim_state import detokenize
from rollout_lifecycle.testing.simulated import SimulatedEngine
from rollout_lifecycle.testing.standin.auth import token_matches
from rollout_lifecycle.testing.standin.bodies import BadRequest, json_body
from rollout_lifecycle.testing.standin.faults import FAULTS_PATH
from rollout_lifecycle.testing.standin.serving import check_serving, run_app
from rollout_lifecycle.testing.standin.state import (
    NEEDS,
    StandInState,
    check_path,
    fault_rules,
    standin_app,
    wait_disconnect,
)
from rollout_lifecycle.testing.standin.vllm_engine import (
    VLLM_VERSION,
    VLLMEngineModel,
    VLLMError,
)

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import ASGIApp, Receive, Scope, Send

DEFAULT_VLLM_MODEL_PATH = "simulated/fake-vllm"
#: How often a streamed completion looks for new tokens.
_STREAM_POLL_S = 0.005

_Handler = Callable[["Request"], Awaitable[Any]]


def vllm_error(message: str, status: int = 400, kind: str | None = None) -> Response:
    """vLLM's error body (``serve/exception_handling/error_response.py``): ``kind`` names the
    error, by default as vLLM names an exception's (``create_error_response``)."""
    from starlette.responses import JSONResponse

    kind = VLLMError(message, status).kind if kind is None else kind
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class VLLMAuthMiddleware:
    """vLLM's key check: only paths under ``GUARDED_PREFIXES`` want ``Bearer <key>``."""

    # vllm: entrypoints/serve/middleware/authenticate.py AuthenticationMiddleware

    def __init__(self, app: ASGIApp, *, api_key: Secret | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.api_key
        if (
            key is None
            or scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or not scope["path"].startswith(GUARDED_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        if not token_matches(Headers(scope=scope).get("authorization"), key.reveal()):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _query_int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {raw!r}") from None


def _mode(request: Request) -> str:
    # vllm: the routes' ``mode: Annotated[PauseMode, Query()] = "abort"`` (a Literal)
    mode = request.query_params.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode


def _completion_request(body: dict[str, Any], rid: str) -> dict[str, Any]:
    """A ``/v1/completions`` body as the simulated engine's request."""
    prompt = body.get("prompt")
    request: dict[str, Any] = {"rid": rid}
    if isinstance(prompt, str):
        request["text"] = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        request["input_ids"] = prompt
    else:
        raise BadRequest(f"prompt must be a string or a list of token ids, got {prompt!r}")
    tokens = body.get("max_tokens", 16)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise BadRequest(f"max_tokens must be an int >= 0, got {tokens!r}")
    request["sampling_params"] = {"max_new_tokens": tokens}
    logprobs = body.get("logprobs")
    if logprobs is not None and (logprobs != 0 or isinstance(logprobs, bool)):
        raise VLLMError(
            f"the stand-in serves logprobs 0 (the sampled token's) only, got {logprobs!r}", 400
        )
    return request


def _token_logprob(position: int, token: int) -> float:
    """The stand-in's logprob of ``token`` at output ``position``: deterministic, in [-5, -0.05]
    (the real tiny model's were near -5 to -6, close to uniform over its vocabulary)."""
    return -0.05 - ((token * 7919 + position * 104729) % 1000) / 202.0


def _completion_logprobs(body: dict[str, Any], ids: list[int], done: list[int]) -> Any:
    """A choice's ``logprobs`` for ``ids``, after ``done`` (a stream's tokens already sent), as
    vLLM answers ``logprobs: 0``: None when not asked."""
    # vllm: entrypoints/openai/completion/serving.py
    # OpenAIServingCompletion._create_completion_logprobs (protocol.py CompletionLogProbs): per
    # output token its text, its logprob, the top logprobs (with 0: the sampled token's alone),
    # and where its text starts in the completion (a stream's chunks go on counting).
    if body.get("logprobs") is None:
        return None
    tokens = [detokenize([t]) for t in ids]
    logprobs = [_token_logprob(len(done) + i, t) for i, t in enumerate(ids)]
    start = len(detokenize(done))
    return {
        "text_offset": [start + sum(len(t) for t in tokens[:i]) for i in range(len(ids))],
        "token_logprobs": logprobs,
        "tokens": tokens,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
    }


def create_vllm_app(
    engine: SimulatedEngine,
    *,
    api_key: str | Secret | None = None,
    on_death: Callable[[], None] | None = None,
    history_file: str | None = None,
    model_path: str = DEFAULT_VLLM_MODEL_PATH,
    weight_transfer: bool = False,
) -> FastAPI:
    """The vLLM stand-in's ASGI app in front of ``engine``; ``weight_transfer`` stands for a
    server started with ``--weight-transfer-config``. A death ends the process through
    ``on_death`` as in the SGLang stand-in (``app.create_app``)."""
    try:
        from starlette.responses import (
            JSONResponse,
            PlainTextResponse,
            Response,
            StreamingResponse,
        )
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(NEEDS) from exc

    key = as_secret(api_key, what="api_key")
    history_file = check_path("history_file", history_file)
    if not isinstance(model_path, str) or not model_path:
        raise InvalidArgument(f"model_path must be a non-empty string, got {model_path!r}")
    model = VLLMEngineModel(engine, weights_path=model_path, weight_transfer=weight_transfer)
    state = StandInState(
        engine, on_death=on_death, history_file=history_file, model_path=model_path
    )
    #: Completions from arrival to answer (``/load``).
    load = {"requests": 0}

    app = standin_app(state)
    app.state.vllm = model
    app.add_middleware(VLLMAuthMiddleware, api_key=key)

    def route(path: str, methods: list[str], handler: _Handler) -> None:
        async def serve(request: Request) -> Response:
            if engine.dead:
                state.die()
            try:
                result = await state.call(handler(request))
            except BadRequest as exc:
                # vllm: serve/exception_handling/handlers/validation.py and http.py: a refused
                # query or body is named by its status phrase
                return vllm_error(exc.message, 400, "Bad Request")
            except VLLMError as exc:
                return vllm_error(exc.message, exc.status)
            except EngineRejected as exc:
                return vllm_error(exc.message, exc.status if exc.status >= 400 else 500)
            if isinstance(result, Response):
                return result
            return JSONResponse(result)

        app.add_route(path, serve, methods=methods)
        state.routes.add(path)

    def serves(name: str) -> Callable[[_Handler], _Handler]:
        row = ENDPOINTS[name]

        def register(handler: _Handler) -> _Handler:
            for path in row.paths:
                route(path, list(row.methods), handler)
            return handler

        return register

    # ------------------------------------------------------------------ lifecycle

    @serves("pause")
    async def pause(request: Request) -> Any:
        # vllm: entrypoints/rl/online/api_router.py pause_generation
        await model.pause(_mode(request))
        return {"status": "paused"}

    @serves("resume")
    async def resume(_: Request) -> Any:
        await model.resume()  # vllm: rl/online/api_router.py resume_generation
        return {"status": "resumed"}

    @serves("is_paused")
    async def is_paused(_: Request) -> Any:
        return {"is_paused": model.paused}  # vllm: rl/online/api_router.py is_paused

    @serves("reset_prefix_cache")
    async def reset_prefix_cache(_: Request) -> Any:
        # vllm: entrypoints/serve/dev/cache/api_router.py reset_prefix_cache (200 either way)
        return {"success": await model.reset_prefix_cache()}

    @serves("sleep")
    async def sleep(request: Request) -> Any:
        # vllm: entrypoints/serve/dev/sleep/api_router.py sleep
        level = _query_int(request, "level", 1)
        if not 0 <= level <= 2:  # vllm: Query(ge=0, le=2)
            raise BadRequest(f"level must be 0, 1 or 2, got {level}")
        await model.sleep(level, _mode(request))
        return {"status": "sleeping", "level": level}

    @serves("wake_up")
    async def wake_up(request: Request) -> Any:
        # vllm: entrypoints/serve/dev/sleep/api_router.py wake_up (no tags: every tag)
        tags = request.query_params.getlist("tags") or None
        awake = await model.wake_up(tags)
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @serves("is_sleeping")
    async def is_sleeping(_: Request) -> Any:
        return {"is_sleeping": model.is_sleeping()}

    @serves("abort_requests")
    async def abort_requests(request: Request) -> Any:
        body = await json_body(request)
        ids = body.get("request_ids")
        if ids is not None and not isinstance(ids, list):
            raise BadRequest(f"request_ids must be a list, got {ids!r}")
        return {"status": "aborted", "aborted": await model.abort(ids)}

    # ------------------------------------------------------------------ weights

    @serves("collective_rpc")
    async def collective_rpc(request: Request) -> Any:
        # vllm: entrypoints/serve/dev/rpc/api_router.py collective_rpc
        body = await json_body(request)
        method = body.get("method")
        if method is None:
            raise BadRequest("Missing 'method' in request body")
        kwargs = body.get("kwargs") or {}
        if method != "reload_weights" or not isinstance(kwargs, dict):
            raise VLLMError(
                f"the stand-in serves collective_rpc reload_weights only, got {method!r}"
            )
        await model.reload_weights(kwargs.get("weights_path"))
        return {"results": [None]}

    @serves("weight_checker")
    async def weight_checker(request: Request) -> Any:
        # vllm: entrypoints/rl/online/api_router.py weight_checker
        body = await json_body(request)
        action = body.get("action")
        checksums = await model.checksums()
        if action == "checksum":
            return {"checksums": checksums}
        if action == "compare" and isinstance(body.get("baseline"), dict):
            baseline = body["baseline"]
            names = checksums.keys() | baseline.keys()
            mismatches = sorted(n for n in names if checksums.get(n) != baseline.get(n))
            return {"match": not mismatches, "mismatches": mismatches}
        raise BadRequest(f"the stand-in serves action checksum and compare, got {action!r}")

    @serves("update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        version = (await json_body(request)).get("new_version")
        if not isinstance(version, str):
            raise BadRequest(f"new_version must be a string, got {version!r}")
        await model.update_weight_version(version)
        return {"success": True, "new_version": version}

    @serves("weight_info")
    async def weight_info(_: Request) -> Any:
        return {"weight_version": await engine.weight_version()}

    async def init_weight_transfer_engine(request: Request) -> Any:
        info = (await json_body(request)).get("init_info")
        if not isinstance(info, dict):
            raise BadRequest(f"init_info must be an object, got {info!r}")
        await model.init_weight_transfer(info)
        return {"message": "Weight transfer initialized"}

    @serves("start_weight_update")
    async def start_weight_update(_: Request) -> Any:
        await model.start_weight_update()
        return {"message": "Weight update started"}

    async def update_weights(request: Request) -> Any:
        info = (await json_body(request)).get("update_info")
        if not isinstance(info, dict | list):
            raise BadRequest(f"update_info must be an object or a list, got {info!r}")
        await model.update_weights(info)
        return {"message": "Weights updated"}

    @serves("finish_weight_update")
    async def finish_weight_update(request: Request) -> Any:
        # An empty body is allowed (no version); anything else must be a JSON object.
        body = await json_body(request) if (await request.body()).strip() else {}
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest(f"weight_version must be a string, got {version!r}")
        await model.finish_weight_update(version)
        return {"message": "Weight update finished"}

    route("/init_weight_transfer_engine", ["POST"], init_weight_transfer_engine)
    route("/update_weights", ["POST"], update_weights)

    # ------------------------------------------------------------------ probes

    @serves("version")
    async def version(_: Request) -> Any:
        return {"version": VLLM_VERSION}

    @serves("health")
    async def health(_: Request) -> Any:
        # vllm: entrypoints/serve/instrumentator/health.py health (200, paused or not)
        return Response(status_code=200)

    @serves("metrics")
    async def metrics(_: Request) -> Any:
        gauges = model.sleep_gauges()
        lines = [
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {model.started!r}",
            "# TYPE vllm:engine_sleep_state gauge",
        ]
        labels = f'engine="0",model_name="{model_path}"'
        for name in SLEEP_STATES:
            lines.append(
                f'vllm:engine_sleep_state{{{labels},sleep_state="{name}"}} {float(gauges[name])}'
            )
        return PlainTextResponse("\n".join(lines) + "\n")

    async def server_load(_: Request) -> Any:
        # vllm: entrypoints/serve/instrumentator/basic.py get_server_load_metrics
        return {"server_load": load["requests"]}

    route("/load", ["GET"], server_load)

    # ------------------------------------------------------------------ completions

    def choice(
        result: dict[str, Any], body: dict[str, Any], ids: list[int], done: list[int]
    ) -> dict[str, Any]:
        reason = result["meta_info"]["finish_reason"]["type"] if result else None
        out: dict[str, Any] = {
            "index": 0,
            "text": detokenize(ids),
            "logprobs": _completion_logprobs(body, ids, done),
            "finish_reason": reason,
            "stop_reason": None,
        }
        if body.get("return_token_ids"):
            out["token_ids"] = ids
        return out

    @serves("completions")
    async def completions(request: Request) -> Any:
        # vllm: entrypoints/openai/completion/serving.py create_completion: the request runs
        # as "cmpl-<request_id>-0" (a random request_id when none is given).
        body = await json_body(request)
        if body.get("model") not in (None, model_path):
            raise VLLMError(f"The model `{body['model']}` does not exist.", 404)
        base = body.get("request_id") or uuid.uuid4().hex
        rid = f"cmpl-{base}-0"
        sim = _completion_request(body, rid)
        head = {"id": f"cmpl-{base}", "object": "text_completion", "model": model_path}
        load["requests"] += 1
        task = asyncio.ensure_future(engine.generate(sim))
        if body.get("stream"):
            return StreamingResponse(stream(task, rid, body, head), media_type="text/event-stream")
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            load["requests"] -= 1
        if not task.done():
            task.cancel()  # vLLM aborts a request whose client went away; nobody reads this
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
        result = await task
        ids = list(result["output_ids"])
        prompt = len(sim.get("input_ids") or sim.get("text") or [])
        return {
            **head,
            "created": int(time.time()),
            "choices": [choice(result, body, ids, [])],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": len(ids),
                "total_tokens": prompt + len(ids),
            },
        }

    async def stream(
        task: asyncio.Future[dict[str, Any]], rid: str, body: dict[str, Any], head: dict[str, Any]
    ) -> AsyncIterator[str]:
        sent = 0

        def chunk(ids: list[int], result: dict[str, Any], done: list[int]) -> str:
            choices = [choice(result, body, ids[len(done) :], done)]
            data = {**head, "created": int(time.time()), "choices": choices}
            return f"data: {json.dumps(data)}\n\n"

        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_STREAM_POLL_S)
                so_far = list(engine.output_so_far(rid) or [])
                if len(so_far) > sent and not task.done():
                    yield chunk(so_far, {}, so_far[:sent])
                    sent = len(so_far)
            result = await state.call(task)
            ids = list(result["output_ids"])
            yield chunk(ids, result, ids[:sent])
            yield "data: [DONE]\n\n"
        finally:
            if not task.done():
                task.cancel()
            load["requests"] -= 1

    # ------------------------------------------------------------------ stand-in only

    async def faults(request: Request) -> Any:
        return await fault_rules(state, request)

    async def as_json(value: Any) -> Any:
        return json.loads(json.dumps(value, default=repr))

    route(FAULTS_PATH, ["GET", "POST", "DELETE"], faults)
    route("/_standin/history", ["GET"], lambda _: as_json(state.history()))
    route("/_standin/memory", ["GET"], lambda _: as_json(model.memory()))
    route("/_standin/state", ["GET"], lambda _: as_json(model.state()))
    route("/_standin/stats", ["GET"], lambda _: as_json(engine.stats()))
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one vLLM stand-in on loopback until stopped (or its engine dies)."""
    parser = argparse.ArgumentParser(prog="fake-vllm", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--engine-options", default="{}", help="SimulatedEngine options, JSON")
    parser.add_argument("--model-path", default=DEFAULT_VLLM_MODEL_PATH)
    parser.add_argument("--history-file", default=None)
    parser.add_argument("--api-key-env", default=None, help="variable holding the API key")
    parser.add_argument("--weight-transfer", action="store_true")
    args = parser.parse_args(argv)
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            print(f"fake-vllm: {args.api_key_env} is not set", file=sys.stderr)
            return 2
    engine_options = json.loads(args.engine_options)
    check_serving(
        host=args.host,
        port=args.port,
        engine_options=engine_options,
        print_ready=True,
        allow_remote=False,
    )

    def make_app(engine: SimulatedEngine, on_death: Callable[[], None]) -> FastAPI:
        return create_vllm_app(
            engine,
            api_key=api_key,
            on_death=on_death,
            history_file=args.history_file,
            model_path=args.model_path,
            weight_transfer=args.weight_transfer,
        )

    return run_app(
        make_app,
        name="fake-vllm",
        host=args.host,
        port=args.port,
        engine_options=engine_options,
        model_path=args.model_path,
        print_ready=True,
    )


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["DEFAULT_VLLM_MODEL_PATH", "VLLMAuthMiddleware", "create_vllm_app", "main", "vllm_error"]
