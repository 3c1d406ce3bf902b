"""An ``EngineBackend`` for vLLM: an async HTTP client of one vLLM 0.32 server started with
``VLLM_SERVER_DEV_MODE=1``, mapping the library's lifecycle onto vLLM's routes (``vllm.api``).

How each operation lands on vLLM (see ``docs/vllm-contract.md``):

* pause: ``/pause?mode=`` with ``retract`` and ``in_place`` as vLLM's ``keep`` (running requests
  freeze and go on after the continue; nothing is lost) and ``abort`` as ``abort``.
* flush, the idle barrier: ``/reset_prefix_cache``, which answers ``success: false`` while
  requests hold KV blocks; that is reported as the refusal (400) of a busy engine.
* release: ``/sleep?level=1`` (weights to host memory, KV cache dropped) or ``level=2`` (both
  dropped; the weights must be pushed again), always with ``mode=keep`` so a release never
  aborts. vLLM puts the weights to sleep only with the KV cache, so a release of the weights
  must name the KV cache too (``VLLM_CAPABILITIES``); one of the KV cache alone sleeps both and
  wakes the weights back.
* resume: ``/wake_up?tags=weights`` at once. The KV cache's wake is held back until the
  continue: vLLM resumes generation as soon as every allocation is resident again
  (``EngineCore.wake_up``), so the wake that completes it *is* the continue, and it is sent only
  when the lifecycle continues, after every barrier before it (at every continue: vLLM ignores
  the wake of a tag that is not asleep).
* weights from disk: ``/collective_rpc`` ``reload_weights`` (in place), then
  ``/update_weight_version``. A reload that fails leaves the model half-loaded, and vLLM dies on
  its next forward pass (``model_loader/reload/inplace.py reload_weights``): the client then
  refuses the continue, the KV wake and generation, naming the path and vLLM's error, until a
  reload succeeds.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar

import httpx

from rollout_lifecycle.backends.engine import incarnation_of
from rollout_lifecycle.backends.http.transport import HTTPTransport, open_wire
from rollout_lifecycle.backends.http.wire import (
    HTTPTimeouts,
    check_name,
    check_str,
    parse_version,
    shown,
)
from rollout_lifecycle.backends.secret import Secret, as_secret, secret_kwargs
from rollout_lifecycle.backends.vllm.api import ENDPOINTS, SLEEP_STATES
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.fingerprint import VLLM_SCHEME, Fingerprint
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.values import (
    PauseMode,
    Tag,
    check_flag,
    check_seconds,
    member,
    parse_tags,
    short_repr,
)

#: The oldest vLLM this client drives: 0.32 has the RL routes (``/pause`` modes, ``/resume``,
#: ``/weight_info``, ``/weight_checker``) it relies on.
MIN_VLLM_VERSION: tuple[int, int, int] = (0, 32, 0)
#: The library's pause modes as vLLM's: both memory-keeping modes freeze running requests.
_PAUSE_MODES: Mapping[PauseMode, str] = {
    PauseMode.RETRACT: "keep",
    PauseMode.IN_PLACE: "keep",
    PauseMode.ABORT: "abort",
    PauseMode.WAIT: "wait",
}
#: What vLLM calls a weight version nobody has set.
# vllm: v1/engine/async_llm.py (weight version "default" until update_weight_version)
_UNSET_VERSION = "default"
#: What vLLM can do (``contract/capabilities``): ``/sleep`` puts the weights to sleep only with
#: the KV cache (``serve/dev/sleep/api_router.py sleep``; a sleep of the KV cache alone is
#: followed by a wake of the weights), and the KV cache's wake is the continue (module
#: docstring).
VLLM_CAPABILITIES = Capabilities(
    "vllm",
    release_requires=((Tag.WEIGHTS, Tag.KV_CACHE),),
    kv_wakes_at_continue=True,
    # vllm: model_executor/model_loader/weight_checksum.py compute_tensor_digests
    fingerprint_scheme=VLLM_SCHEME,
    # A reload in place (``update_weights_from_disk``); tensors reach vLLM only through its
    # weight-transfer engine, which a push of the caller's own drives.
    weight_writes=frozenset({Op.UPDATE_FROM_DISK}),
)
#: A reload's answer when the prefix cache could not be reset after it.
_NOT_RESET_AFTER_RELOAD = (
    "the weights were reloaded, but the prefix cache was not reset because requests still hold "
    "KV blocks; pause and flush, then reset it"
)
#: How often a flush with a wait asks again whether the engine went idle.
_FLUSH_POLL_S = 0.05


class VLLMHTTPEngine:
    """One vLLM server over HTTP; implements ``EngineBackend`` (module docstring: the mapping).

    ``api_key`` is sent (``Authorization: Bearer``) to the routes vLLM guards with it, the
    OpenAI API; vLLM asks no key of its lifecycle routes, so keep the server on loopback or a
    private network. ``sleep_level`` 1 (default) keeps released weights in host memory; 2 drops
    them, and then every release must be followed by a weight push. ``weight_transfer`` says
    the server runs vLLM's weight-transfer engine (``--weight-transfer-config``): only then do
    the session calls reach ``/start_weight_update`` and ``/finish_weight_update``; a reload
    from disk needs no session. ``model`` is the served model name sent with generations (the
    server's only model when None).

    Attach check: before the first lifecycle call the client reads ``/version`` and
    ``/is_paused`` once, and refuses a vLLM older than 0.32 or one without the RL routes
    (started without ``VLLM_SERVER_DEV_MODE=1``), with ``IllegalEngineOp`` naming what it found.
    """

    #: What vLLM can do: ``VLLM_CAPABILITIES``.
    capabilities: ClassVar[Capabilities] = VLLM_CAPABILITIES

    def __init__(
        self,
        url: str,
        *,
        api_key: str | Secret | None = None,
        timeouts: HTTPTimeouts | None = None,
        retries: int = 3,
        retry_backoff: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
        label: str | None = None,
        sleep_level: int = 1,
        weight_transfer: bool = False,
        model: str | None = None,
        check_version: bool = True,
    ) -> None:
        self._api_key = as_secret(api_key, what="api_key")
        self._wire, self._timeouts = open_wire(
            url,
            label,
            admin_key=None,
            api_key=self._api_key,
            timeouts=timeouts,
            retries=retries,
            retry_backoff=retry_backoff,
            transport=transport,
        )
        self._url, self._label = self._wire.url, self._wire.label
        if sleep_level not in (1, 2) or isinstance(sleep_level, bool):
            raise InvalidArgument(f"sleep_level must be 1 or 2, got {shown(sleep_level)}")
        self._sleep_level = sleep_level
        self._weight_transfer = check_flag("weight_transfer", weight_transfer)
        self._model = check_str("model", model, optional=True)
        self._check_version = check_flag("check_version", check_version)
        #: The vLLM version the attach check accepted.
        self._version: str | None = None
        #: Why the weights are unusable (a reload failed, or a level-2 sleep discarded them),
        #: until weights are pushed: a reload that succeeds, or a weight-transfer session
        #: followed by the version the update sets.
        self._broken: str | None = None
        #: A weight-transfer session ended since the weights were marked unusable.
        self._session_ended = False

    # ----------------------------------------------------------------------------- properties

    @property
    def label(self) -> str:
        """The engine's name in errors and events (the URL unless given)."""
        return self._label

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._url

    @property
    def vllm_version(self) -> str | None:
        """The vLLM version the attach check accepted (None before it ran, or when skipped)."""
        return self._version

    @property
    def broken(self) -> str | None:
        """Why this engine must not run a forward pass (a failed reload, or weights a level-2
        sleep discarded and no push has replaced), else None."""
        return self._broken

    def __repr__(self) -> str:
        return f"VLLMHTTPEngine({self._url!r}, label={self._label!r}, api_key={self._api_key!r})"

    # ----------------------------------------------------------------------------- calls

    async def _call(
        self,
        name: str,
        body: dict[str, Any] | None = None,
        *,
        query: Mapping[str, str | list[str]] | None = None,
        op: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One call of the row ``name``: its method, key, timeout (unless ``timeout`` is given)
        and retries from the table, its answer read as the row's shape says (a JSON object,
        else None)."""
        row = ENDPOINTS[name]
        op = name if op is None else op
        wait = getattr(self._timeouts, row.timeout) if timeout is None else timeout
        try:
            response = await self._wire.request(row, body, wait, op=op, query=query)
        except EngineRejected as exc:
            if exc.status == 500 and ENGINE_CORE_DEAD in exc.message:
                # gone, not refusing: a request it held is sent elsewhere, as after a death
                raise EngineDead(
                    self._label,
                    op,
                    f"its engine core died (vLLM's EngineDeadError); the server shuts itself "
                    f"down: {exc.message}",
                ) from exc
            raise
        return self._wire.read_answer(op, row, response)

    async def _send(
        self, op: str, name: str, body: dict[str, Any] | None = None, **how: Any
    ) -> Any:
        """The attach check (once), then one call."""
        await self.attach(op)
        return await self._call(name, body, op=op, **how)

    def _refuse_forward(self, op: str) -> None:
        if self._broken is not None:
            raise IllegalEngineOp(
                self._label,
                op,
                f"its weights are unusable: {self._broken}; nothing that runs a forward pass is "
                "sent until weights are pushed (a reload that succeeds, or a weight-transfer "
                "session and the version the update sets after it)",
            )

    # ----------------------------------------------------------------------------- attach

    async def check_version(self, op: str = "check_version") -> str:
        """Read ``/version`` and ``/is_paused``; refuse a vLLM older than 0.32 or without the
        RL routes (``IllegalEngineOp`` naming what was found). Returns the version found."""
        self._version = await _vllm_version(self._call, self._label, op)
        return self._version

    async def attach(self, op: str) -> None:
        """The attach check, once per client, before its first lifecycle call."""
        if self._check_version and self._version is None:
            await self.check_version(op)

    # ----------------------------------------------------------------------------- lifecycle

    async def pause_generation(self, mode: PauseMode) -> None:
        """``POST /pause?mode=keep|abort|wait``; retried (pausing twice does no harm). A wait
        pause answers once the requests in flight have ended: it gets the ``drain`` timeout."""
        mode = member(PauseMode, mode, "pause mode")
        # vllm: rl/online/api_router.py pause_generation -> EngineCoreProc.pause_scheduler
        # (wait: PAUSED_NEW, new requests queued while the running ones step to their end;
        # it answers once they have drained)
        wait = self._timeouts.drain if mode is PauseMode.WAIT else None
        query = {"mode": _PAUSE_MODES[mode]}
        await self._send("pause_generation", "pause", query=query, timeout=wait)

    async def continue_generation(self) -> None:
        """``POST /wake_up?tags=kv_cache``, which resumes the scheduler once nothing is asleep
        and says so (``{"status": "awake"}``): the continue is that one call.

        The wake is sent at every continue, not only after this client resumed the KV cache: the
        resume may have been recorded by another process (a ``ctl onload-kv`` run before this
        ``ctl resume``), and vLLM ignores a wake of a tag that is not asleep
        (``v1/executor/abstract.py Executor.wake_up`` returns at once, with a warning), then
        resumes all the same. No ``/resume`` follows: it would only set the state the wake set,
        and the engine core takes it between steps, so with requests decoding it waits for the
        first step the wake started (26 against 5 ms idle, ``benchmarks.real_routes``).

        A wake that leaves something asleep (``"sleeping"``: the weights, slept by another
        process) did not resume the scheduler, and nothing here does: ``/resume`` would run it
        on memory that is not there. That raises ``IllegalEngineOp``."""
        op = "continue_generation"
        self._refuse_forward(op)
        # vllm: serve/dev/sleep/api_router.py wake_up -> v1/engine/core.py EngineCore.wake_up
        # (fully awake -> resume_scheduler; the answer's status says which)
        woken = await self._send(op, "wake_up", query={"tags": ["kv_cache"]})
        status = woken.get("status") if isinstance(woken, dict) else None
        if status != "awake":
            raise IllegalEngineOp(
                self._label,
                op,
                f"the KV cache's wake answered {short_repr(woken)}, not fully awake: its "
                "weights are still asleep (slept by another process?), so the scheduler was not "
                "resumed, and no /resume is sent to run it on memory that is not there; onload "
                "the weights first",
            )

    async def flush_cache(self, timeout: float) -> None:
        """``POST /reset_prefix_cache``; ``success: false`` (requests hold KV blocks) raises
        ``EngineRejected`` with status 400, as a busy SGLang's flush does. With ``timeout`` T >
        0 the client asks again until the engine is idle or T has passed."""
        op = "flush_cache"
        wait = check_seconds("flush timeout", timeout, positive=False)
        deadline = time.monotonic() + wait
        while not await self._reset_prefix_cache(op):
            if time.monotonic() >= deadline:
                raise EngineRejected(
                    self._label,
                    op,
                    "/reset_prefix_cache answered success=false: requests still hold KV "
                    "blocks (the engine is not idle)",
                    400,
                )
            await asyncio.sleep(_FLUSH_POLL_S)

    async def _reset_prefix_cache(self, op: str) -> bool:
        """One ``/reset_prefix_cache``: whether it succeeded (false: requests hold blocks)."""
        # vllm: serve/dev/cache/api_router.py reset_prefix_cache ({"success": false} while
        # blocks are held, e.g. by running requests)
        try:
            await self._send(op, "reset_prefix_cache")
        except EngineRejected as exc:
            if exc.status != 200:
                raise
            return False
        return True

    async def release_memory_occupation(self, tags: Sequence[Tag]) -> bool:
        """``POST /sleep?level=L&mode=keep``, sent once: vLLM puts the weights and the KV cache
        to sleep together. A release of the KV cache alone (a replacement joining a fleet whose
        weights are back) sleeps both, then wakes the weights (``/wake_up?tags=weights``; at
        level 2 they are unusable until a push). A release of the weights alone is refused.
        Returns whether the weights' values are gone (level 2): the lifecycle's record of the
        engine keeps that (``EngineRecord.weights_lost``), so that a process that adopts its
        journal does not continue the engine before a push either."""
        op = "release_memory_occupation"
        asked = parse_tags(tags, what=f"{op} tags")
        refusal = self.capabilities.release_refusal(asked)
        if refusal is not None:
            raise IllegalEngineOp(self._label, op, refusal)
        # vllm: serve/dev/sleep/api_router.py sleep -> EngineCore.sleep (pause, then
        # executor.sleep(level)); mode keep: a release never aborts what a pause kept.
        level = str(self._sleep_level)
        if self._sleep_level == 2:
            # vllm: v1/worker/gpu_worker.py Worker.sleep keeps no copy of the weights at level
            # 2, and Worker.wake_up brings back their memory, not their values: a forward pass
            # before a push would run on whatever that memory holds. Marked before the send: a
            # sleep whose answer is lost may have discarded them.
            self._broken = "a level-2 sleep discarded them and no push has replaced them"
            self._session_ended = False
        await self._send(op, "sleep", query={"level": level, "mode": "keep"})
        if Tag.WEIGHTS not in asked:
            try:
                await self._send(op, "wake_up", query={"tags": ["weights"]})
            except (EngineRejected, EngineUnreachable) as exc:  # the sleep landed: no refusal
                # (or unknown effect) may hide it
                raise EngineError(
                    self._label, op, f"slept, then the weights' wake failed: {exc}"
                ) from None
        return self._sleep_level == 2

    async def resume_memory_occupation(self, tags: Sequence[Tag]) -> None:
        """``POST /wake_up?tags=weights`` for the weights; the KV cache's wake waits for the
        continue (see the module docstring); sent once."""
        op = "resume_memory_occupation"
        names = {t.value for t in parse_tags(tags, what=f"{op} tags")}
        if Tag.WEIGHTS.value in names:
            await self._send(op, "wake_up", query={"tags": ["weights"]})
        if Tag.KV_CACHE.value in names:
            # Nothing is sent: the continue wakes the KV cache. Checked now, so that a resume
            # vLLM could not honour fails in its own phase, before any engine continues.
            self._refuse_forward(op)
            await self.attach(op)

    # ----------------------------------------------------------------------------- weights

    async def begin_weight_update(self) -> None:
        """``POST /start_weight_update`` with a weight-transfer engine; else no session."""
        if self._weight_transfer:
            await self._send("begin_weight_update", "start_weight_update")

    async def end_weight_update(self) -> None:
        """``POST /finish_weight_update {}`` with a weight-transfer engine; else no session."""
        if self._weight_transfer:
            await self._send("end_weight_update", "finish_weight_update", {})
            # Whether the trainer's writes all landed is known only to the caller: the session
            # ends also after a push that raised. The version set after it vouches for them.
            self._session_ended = True

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        load_format: str | None = None,
    ) -> None:
        """``/collective_rpc reload_weights {"weights_path"}`` (in place), then the version and
        the flush asked for. A failed reload marks the weights unusable (see ``broken``)."""
        op = "update_weights_from_disk"
        model_path = check_name("model_path", model_path)
        if load_format is not None:
            raise InvalidArgument(f"vLLM's reload takes no load_format, got {load_format!r}")
        version = check_str("weight_version", weight_version, optional=True)
        if check_flag("abort_all_requests", abort_all_requests):
            await self._send(op, "abort_requests", {})
        body = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        try:
            # vllm: serve/dev/rpc/api_router.py collective_rpc -> Worker.reload_weights ->
            # model_executor/model_loader/reload/inplace.py reload_weights
            await self._send(op, "collective_rpc", body)
        except (EngineRejected, EngineUnreachable) as exc:
            # vLLM drops the connection behind a failed collective_rpc's 500 without a
            # "Connection: close"; a call that reused it would fail with its effect unknown.
            await self._wire.drop_connections()
            self._broken = f"a reload failed (from {model_path!r}: {exc})"
            self._session_ended = False
            said = (
                f"the reload from {model_path!r} failed and left the weights unusable until a "
                f"reload succeeds: {exc}"
            )
            if isinstance(exc, EngineRejected):
                raise EngineRejected(self._label, op, said, exc.status) from None
            raise EngineUnreachable(self._label, op, said) from None  # (its effect unknown)
        self._broken = None
        if version is not None:
            await self._send(op, "update_weight_version", {"new_version": version})
        if check_flag("flush_cache", flush_cache) and not await self._reset_prefix_cache(op):
            raise EngineRejected(self._label, op, _NOT_RESET_AFTER_RELOAD, 400)

    async def update_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        """``POST /update_weight_version {"new_version"}`` (a label; vLLM aborts nothing), after
        ``/abort_requests {}`` when ``abort_all_requests``."""
        op = "update_weight_version"
        new = check_str("version", version, optional=False)
        if check_flag("abort_all_requests", abort_all_requests):
            await self._send(op, "abort_requests", {})
        await self._send(op, "update_weight_version", {"new_version": new})
        if self._session_ended:  # the update that ended the session completed: it wrote them
            self._broken, self._session_ended = None, False

    async def weight_version(self) -> str | None:
        """The loaded weight version (``GET /weight_info``); None while vLLM says ``default``."""
        info = await self._call("weight_info")
        version = info.get("weight_version")
        if version is not None and not isinstance(version, str):
            self._wire.garbage("weight_version", "/weight_info", "weight_version is no string")
        return None if version == _UNSET_VERSION else version

    async def weight_fingerprint(self) -> dict[str, Any]:
        """``POST /weight_checker {"action": "checksum"}``: a ``Fingerprint``'s wire form."""
        # A sha256 per tensor, named with its worker (vllm: compute_weight_checksums)
        sums = (await self._call("weight_checker", {"action": "checksum"})).get("checksums")
        if not isinstance(sums, dict):
            self._wire.garbage("weight_fingerprint", "/weight_checker", "no checksums object")
        tensors = {str(k): str(v) for k, v in sums.items()}
        return Fingerprint(self.capabilities.fingerprint_scheme, tensors).to_wire()

    # ----------------------------------------------------------------------------- requests

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """One SGLang-shaped request (``input_ids`` or ``text``, ``sampling_params``, ``rid``,
        ``return_logprob``) as ``POST /v1/completions``; the answer in SGLang's shape (``text``,
        ``output_ids``, ``meta_info`` with ``finish_reason``, and ``output_token_logprobs`` when
        asked: see ``_output_logprobs``). Sent once."""
        op = "generate"
        self._refuse_forward(op)
        body = _completion(request, self._model)
        answer = await self._call("completions", body, op=op)
        return _as_sglang(self._wire, answer, logprobs="logprobs" in body)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_requests``: the request this client's ``generate`` sent as ``rid``, or
        every request with ``abort_all``."""
        if not isinstance(rid, str):
            raise InvalidArgument(f"rid must be a string, got {shown(rid)}")
        if check_flag("abort_all", abort_all):
            await self._call("abort_requests", {})
        elif rid:
            await self._call("abort_requests", {"request_ids": [completion_id(rid)]})

    # ----------------------------------------------------------------------------- probes

    async def server_info(self) -> dict[str, Any]:
        """The liveness probe, safe while paused: ``/version`` and, from ``/metrics``, the API
        server's start time (``process_start_time_seconds``) as ``startup_time``, which names
        this process's incarnation, and its ``sleep_state`` (``parse_sleep_state``)."""
        version = await self._call("version", op="server_info")
        row = ENDPOINTS["metrics"]
        response = await self._wire.request(row, None, self._timeouts.probe, op="server_info")
        return {
            "engine_kind": "vllm",
            "version": version.get("version"),
            "startup_time": parse_start_time(response.text),
            "sleep_state": parse_sleep_state(response.text),
        }

    async def observe(self, *, paused: bool = True, identify: bool = True) -> dict[str, Any]:
        """What the server says of itself: its incarnation and whether it is paused."""
        found: dict[str, Any] = {"incarnation": None, "paused": None}
        if identify:
            found["incarnation"] = incarnation_of(await self.server_info())
        if paused:
            try:
                answer = await self._call("is_paused", op="observe")
            except (EngineDead, EngineUnreachable, EngineTimeout):
                return found
            if isinstance(answer.get("is_paused"), bool):
                found["paused"] = answer["is_paused"]
        return found

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: True while the engine is paused or any of its memory is asleep
        (``v1/engine/core.py EngineCore.is_sleeping``), False when it serves fully resident."""
        answer = await self._call("is_sleeping")
        found = answer.get("is_sleeping")
        if not isinstance(found, bool):
            self._wire.garbage("is_sleeping", "/is_sleeping", "is_sleeping is no boolean")
        return bool(found)

    async def ping(self, timeout: float | None = None) -> bool:
        """One ``GET /health``: True on a 2xx answer (paused or not)."""
        status = await self.health_status()
        return status is not None and 200 <= status < 300

    async def health_status(self) -> int | None:
        """One ``GET /health``: the status of whatever answers at the URL, or None when nothing
        does."""
        return await self._wire.status(ENDPOINTS["health"], self._timeouts.probe)

    async def ready(self, timeout: float | None = None) -> bool:
        """Healthy and not paused."""
        if not await self.ping(timeout):
            return False
        found = await self.observe(identify=False)
        return found["paused"] is False

    async def close(self) -> None:
        """Close the HTTP client; later calls raise ``EngineDead``. Idempotent, never raises."""
        await self._wire.close()


async def _vllm_version(call: Callable[..., Awaitable[Any]], label: str, op: str) -> str:
    """The attach check's reads: the version, and that the RL routes are there."""
    info = await call("version", op=op)
    found = info.get("version")
    wanted = ".".join(str(n) for n in MIN_VLLM_VERSION)
    parsed = parse_version(found) if isinstance(found, str) else None
    if parsed is None or parsed < MIN_VLLM_VERSION:
        raise IllegalEngineOp(
            label, op, f"/version reports vLLM {shown(found)}; this client needs vLLM >= {wanted}"
        )
    try:
        await call("is_paused", op=op)
    except EngineRejected as exc:
        if exc.status != 404:
            raise
        raise IllegalEngineOp(
            label,
            op,
            "the server has no /is_paused route: start vLLM with VLLM_SERVER_DEV_MODE=1, "
            "without which it serves none of the lifecycle routes",
        ) from None
    assert isinstance(found, str)
    return found


def parse_start_time(text: str) -> str | None:
    """The API server's ``process_start_time_seconds`` in a ``/metrics`` text, None if absent."""
    for line in text.splitlines():
        if line.startswith("process_start_time_seconds "):
            return line.split()[1]
    return None


def parse_sleep_state(text: str) -> str | None:
    """The label of ``vllm:engine_sleep_state`` whose value is 1 in a ``/metrics`` text (one of
    ``SLEEP_STATES``), None when the gauge is not shown."""
    for line in text.splitlines():
        if not line.startswith("vllm:engine_sleep_state{"):
            continue
        labels, _, value = line.rpartition(" ")
        for state in SLEEP_STATES:
            if f'sleep_state="{state}"' in labels and value.strip() in ("1", "1.0"):
                return state
    return None


#: What vLLM answers every call with once an engine core died (one rank's, on a data-parallel
#: server): a 500 whose message is EngineDeadError's, and then it shuts itself down
#: (vllm: v1/engine/exceptions.py EngineDeadError; entrypoints/serve/exception_handling/handlers/
#: vllm_error.py engine_error_handler -> terminate_if_errored).
ENGINE_CORE_DEAD = "EngineCore encountered an issue"


def completion_id(rid: str) -> str:
    """The id vLLM knows a ``/v1/completions`` request by, when it was sent with ``request_id``
    ``rid`` and one prompt; ``/abort_requests`` matches this id, not ``rid``."""
    # vllm: entrypoints/openai/completion/serving.py create_completion: the request's id is
    # "cmpl-" + its request_id, and prompt i runs as f"{request_id}-{i}";
    # entrypoints/rl/online/api_router.py abort_requests -> AsyncLLM.abort(external ids)
    return f"cmpl-{rid}-0"


def _completion(request: dict[str, Any], model: str | None) -> dict[str, Any]:
    """An SGLang ``/generate`` body as a vLLM ``/v1/completions`` body."""
    if not isinstance(request, dict):
        raise InvalidArgument(f"request must be a dict, got {shown(request)}")
    if request.get("stream"):
        raise InvalidArgument("generate() does not stream; send the request with stream false")
    if "input_ids" in request:
        prompt: Any = request["input_ids"]
    elif "text" in request:
        prompt = request["text"]
    else:
        raise InvalidArgument("request needs input_ids or text")
    params = dict(request.get("sampling_params") or {})
    body: dict[str, Any] = {"prompt": prompt, "return_token_ids": True}
    if model is not None:
        body["model"] = model
    if "max_new_tokens" in params:
        body["max_tokens"] = params.pop("max_new_tokens")
    for name in ("temperature", "top_p", "top_k", "stop", "ignore_eos", "seed", "min_tokens"):
        if name in params:
            body[name] = params.pop(name)
    if params:
        raise InvalidArgument(f"sampling_params vLLM is not sent: {sorted(params)}")
    if _wants_logprobs(request):
        # vllm: entrypoints/openai/completion/protocol.py CompletionRequest.logprobs: the number
        # of top logprobs besides the sampled token's; 0 asks for the sampled token's alone.
        body["logprobs"] = 0
    rid = request.get("rid")
    if isinstance(rid, str) and rid:
        body["request_id"] = rid
    return body


#: SGLang's logprob keys besides ``return_logprob`` (sglang 0.5.23:
#: srt/managers/io_struct.py GenerateReqInput), each with the values that ask for nothing.
_UNSERVED_LOGPROB_KEYS: Mapping[str, tuple[Any, ...]] = {
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None, []),
    "return_text_in_logprobs": (None, False),
    "return_sampling_mask": (None, False),
    "sampling_logprobs_mode": (None,),
    "return_flat_raw_top_logprobs": (None, False),
}


def _wants_logprobs(request: Mapping[str, Any]) -> bool:
    """Whether ``request`` asks for its output tokens' logprobs (SGLang's ``return_logprob``,
    a bool). SGLang's other logprob keys (prompt logprobs, top logprobs, texts, ...) are not
    served: any of them that asks for something is refused rather than left unanswered."""
    for key, nothing in _UNSERVED_LOGPROB_KEYS.items():
        value = request.get(key)
        if not any(value is v or (type(value) is type(v) and value == v) for v in nothing):
            raise InvalidArgument(
                f"vLLM's client returns output_token_logprobs only (return_logprob); "
                f"{key}={shown(value)} is not served, leave it out"
            )
    wanted = request.get("return_logprob", False)
    if not isinstance(wanted, bool):
        raise InvalidArgument(f"return_logprob must be a bool, got {shown(wanted)}")
    return wanted


def _output_logprobs(wire: HTTPTransport, choice: dict[str, Any], ids: list[Any]) -> list[Any]:
    """SGLang's ``meta_info.output_token_logprobs`` from a choice answered to ``logprobs: 0``:
    ``[logprob, token_id, None]`` per output token (the text is None, as SGLang's without
    ``return_text_in_logprobs``).

    What they are: with vLLM's default ``--logprobs-mode raw_logprobs``, the log-softmax of the
    model's raw logits, taken before logits processors, penalties, temperature, top-k and top-p
    (vllm: v1/sample/sampler.py ``Sampler.forward``, ``Sampler.compute_logprobs``; config/model.py
    ``ModelConfig.logprobs_mode``). SGLang's are the same when greedy, but when sampling are taken
    after the temperature unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set (sglang:
    srt/layers/sampler.py ``Sampler.forward``): at a temperature other than 1 the engines' numbers
    differ for the same token."""
    # vllm: entrypoints/openai/completion/serving.py
    # OpenAIServingCompletion._create_completion_logprobs: token_logprobs[i] is the logprob of
    # token_ids[i], floored at -9999.0 (an -inf is sent as that); protocol.py CompletionLogProbs.
    found = choice.get("logprobs")
    lps = found.get("token_logprobs") if isinstance(found, dict) else None
    if not isinstance(lps, list) or len(lps) != len(ids):
        why = f"no logprobs.token_logprobs with one per output token ({len(ids)}), got"
        wire.garbage("generate", "/v1/completions", f"{why} {shown(found)}")
    if not all(isinstance(lp, int | float) and not isinstance(lp, bool) for lp in lps):
        wire.garbage("generate", "/v1/completions", f"a token logprob is no number: {shown(lps)}")
    return [[float(lp), token, None] for lp, token in zip(lps, ids, strict=True)]


def _as_sglang(wire: HTTPTransport, answer: dict[str, Any], *, logprobs: bool) -> dict[str, Any]:
    """A ``/v1/completions`` answer in the shape of SGLang's ``/generate``; with ``logprobs``
    (the request asked ``logprobs: 0``) its ``meta_info`` has ``output_token_logprobs``."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        wire.garbage("generate", "/v1/completions", "expected one choice")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        wire.garbage("generate", "/v1/completions", "no token_ids (return_token_ids)")
    usage = answer.get("usage") or {}
    # vLLM's finish reasons (length, stop, abort) are SGLang's names for the same ends.
    reason = str(choice.get("finish_reason"))
    finish: dict[str, Any] = {"type": reason}
    if reason == "length":
        finish["length"] = len(ids)
    meta: dict[str, Any] = {
        "id": answer.get("id"),
        "finish_reason": finish,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens", len(ids)),
    }
    if logprobs:
        meta["output_token_logprobs"] = _output_logprobs(wire, choice, ids)
    return {"text": choice.get("text", ""), "output_ids": ids, "meta_info": meta}


def vllm_http_factory(url: str, **kwargs: Any) -> Callable[[], VLLMHTTPEngine]:
    """A picklable zero-argument factory of ``VLLMHTTPEngine(url, **kwargs)``, for Ray actors;
    the arguments are checked now."""
    kwargs = secret_kwargs(kwargs, ("api_key",))
    VLLMHTTPEngine(url, **kwargs)
    return functools.partial(VLLMHTTPEngine, url, **kwargs)


__all__ = ["MIN_VLLM_VERSION", "VLLMHTTPEngine", "parse_sleep_state", "vllm_http_factory"]
