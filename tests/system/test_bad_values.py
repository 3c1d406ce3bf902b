"""Bad values in public parameters: each raises ``InvalidArgument`` naming the parameter and the
value, before anything is started or sent; never a ``TypeError``, an ``OverflowError``, a
``ValueError`` from deep inside, or silent acceptance.

One table row per (parameter, bad value). Numbers of seconds are refused when not an int or a
float (a bool included), not finite, out of range (negative, or past the one-week bound, so that
no wait overflows later); flags are refused unless they are real bools (``"no"`` is not false).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import pytest

from rollout_lifecycle import InvalidArgument
from rollout_lifecycle.backends.actor import start_engine_actor
from rollout_lifecycle.backends.engine import EngineHost
from rollout_lifecycle.backends.hosted import (
    HostedEngine,
    MultiEngineActorBody,
    start_multi_engine_actor,
)
from rollout_lifecycle.backends.http.wire import HTTPTimeouts
from rollout_lifecycle.backends.router import SGLangRouter
from rollout_lifecycle.backends.sglang.client import SGLangHTTPEngine
from rollout_lifecycle.backends.sglang.launch import LaunchedSGLangEngine
from rollout_lifecycle.backends.weights import FromDisk, FromDistributed, FromTensor
from rollout_lifecycle.contract.values import MAX_SECONDS, check_seconds, parse_tags
from rollout_lifecycle.core.config import DeadEnginePolicy, Deadlines, LifecycleConfig
from rollout_lifecycle.core.generation import GenerationClient
from rollout_lifecycle.core.group import EngineGroup
from rollout_lifecycle.core.requests import MAX_REQUEST_INT, Request
from rollout_lifecycle.core.server import RolloutServer
from rollout_lifecycle.core.timeline import Timeline
from rollout_lifecycle.testing import (
    barrier_violations,
    cycle_order_violations,
    cycle_phase_of,
    cycle_rounds,
    released_ops,
    simulated_engine_actors,
    simulated_multi_engine_actors,
)
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.simulated import SimulatedEngine, fleet_factories
from rollout_lifecycle.testing.standin import StandInServer, create_app, serve

HUGE = 10**400  # an int no float holds
#: Bad numbers of seconds (positive ones wanted).
SECONDS = [None, "1", True, [1], math.nan, math.inf, -math.inf, -1, -0.5, 0, 0.0, 1e308, HUGE]
#: Bad numbers of seconds where 0 is fine.
SECONDS0 = [v for v in SECONDS if v != 0 or isinstance(v, bool)]
#: Bad flags.
FLAGS = [None, "no", "yes", "", 1, 0, 1.0]
#: Bad ints >= 0 (``low`` adds the value just below the minimum).
INTS = [None, "3", True, 1.5, math.nan, -1, HUGE]
#: Bad ints >= 0 where any large int is fine (a count of "as many as there are").
SMALL_INTS = INTS[:-1]
#: Bad non-empty strings.
STRINGS = [None, 1, b"x", True, ""]

Case = Any  # a pytest.param


def rows(name: str, call: Callable[[Any], object], values: Iterable[Any]) -> list[Case]:
    """One row per bad value of parameter ``name``; ``call(value)`` must refuse it."""
    return [pytest.param(name, call, v, id=f"{name}={_label(v)}") for v in values]


def _label(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def sim(**kw: Any) -> SimulatedEngine:
    return SimulatedEngine(**kw)


def http(**kw: Any) -> SGLangHTTPEngine:
    return SGLangHTTPEngine("http://127.0.0.1:1", **kw)


def launched(**kw: Any) -> LaunchedSGLangEngine:
    return LaunchedSGLangEngine("m", **{"port": 30000, **kw})


def standin(**kw: Any) -> StandInServer:
    return StandInServer(**kw)


def server() -> RolloutServer:
    return RolloutServer([EngineGroup("actor", [SimulatedEngine("s")])])


def client(**kw: Any) -> GenerationClient:
    return GenerationClient(server(), **kw)


async def _generate(request: object, group: object = None) -> Any:
    c = client()
    try:
        return await c.generate(request, group=group)  # type: ignore[arg-type]
    finally:
        await c.server.groups[0].records[0].handle.backend.close()


async def _generate_batch(requests: object) -> Any:
    c = client()
    try:
        return await c.generate_batch(requests)  # type: ignore[arg-type]
    finally:
        await c.server.groups[0].records[0].handle.backend.close()


async def _server_generate_batch(requests: object) -> Any:
    s = server()
    try:
        return await s.generation.generate_batch(requests)  # type: ignore[arg-type]
    finally:
        await s.groups[0].records[0].handle.backend.close()


def distributed(**kw: Any) -> FromDistributed:
    args: dict[str, Any] = {"names": ["w"], "dtypes": ["f"], "shapes": [[1]], "group_name": "g"}
    return FromDistributed(**{**args, **kw})


def joining(**kw: Any) -> FromDistributed:
    group = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3}
    return distributed(**{**group, "rank_offsets": {"a": 1}, **kw})


def host() -> EngineHost:
    return EngineHost(SimulatedEngine("h"))


async def _host_call(op: str, *args: Any) -> Any:
    h = host()
    try:
        return await getattr(h, op)(*args)
    finally:
        await h.close()


async def _multi_call(index: object, op: object = "label") -> Any:
    body = MultiEngineActorBody([lambda: SimulatedEngine("m")])
    try:
        return await body.call(index, op)  # type: ignore[arg-type]
    finally:
        await body.close()


DEADLINE_FIELDS = [
    "pause",
    "flush",
    "release",
    "resume",
    "continue_",
    "weight_update",
    "probe",
    "startup",
    "hook",
]
HTTP_TIMEOUT_FIELDS = [
    "connect",
    "control",
    "memory",
    "weights",
    "probe",
    "generate",
    "flush_margin",
]

CASES: list[Case] = [
    # -- the one seconds checker, positive and not ---------------------------------------------
    *rows("what", lambda v: check_seconds("what", v), SECONDS),
    *rows("what", lambda v: check_seconds("what", v, positive=False), SECONDS0),
    # -- LifecycleConfig, Deadlines, tags -------------------------------------------------------
    *rows("pause_mode", lambda v: LifecycleConfig(pause_mode=v), [None, 1, "pause", [], True]),
    *rows("deadlines", lambda v: LifecycleConfig(deadlines=v), [None, {}, 60, "fast"]),
    *rows(
        "release_tags",
        lambda v: LifecycleConfig(release_tags=v),
        [None, "weights", b"weights", [], ["weight"], 1, {"weights": 1}, [None], [["w"]]],
    ),
    *rows("continue_on_failure", lambda v: LifecycleConfig(continue_on_failure=v), FLAGS),
    *rows("dead_engines", lambda v: LifecycleConfig(dead_engines=v), [None, 0, "ignore", {}]),
    *rows(
        "flush_retry_interval",
        lambda v: LifecycleConfig(flush_retry_interval=v),
        [*SECONDS, 121.0],  # past the flush deadline (120 s)
    ),
    *rows("timeline_calls", lambda v: LifecycleConfig(timeline_calls=v), [*INTS, 10**7]),
    *rows("memory_metrics", lambda v: LifecycleConfig(memory_metrics=v), FLAGS),
    *(
        case
        for f in DEADLINE_FIELDS
        for case in rows(f, lambda v, f=f: Deadlines(**{f: v}), [*SECONDS, MAX_SECONDS + 1])
    ),
    *rows("tags", lambda v: parse_tags(v), [None, 3, "kv_cache", {"kv_cache": 1}, [1.5]]),
    # -- HTTP client ----------------------------------------------------------------------------
    *(
        case
        for f in HTTP_TIMEOUT_FIELDS
        for case in rows(f, lambda v, f=f: HTTPTimeouts(**{f: v}), SECONDS)
    ),
    *rows("url", lambda v: SGLangHTTPEngine(v), [None, 1, "", "ftp://x", b"http://x"]),
    *rows("timeouts", lambda v: http(timeouts=v), [{}, 5, "fast"]),
    *rows("retries", lambda v: http(retries=v), [*INTS, 10**6]),
    *rows("retry_backoff", lambda v: http(retry_backoff=v), SECONDS0),
    *rows("transport", lambda v: http(transport=v), ["x", 1]),
    *rows("label", lambda v: http(label=v), [1, "", True]),
    *rows("weight_selector", lambda v: http(weight_selector=v), [None, 1, "both", []]),
    *rows("check_version", lambda v: http(check_version=v), FLAGS),
    *rows("ready timeout", lambda v: run(http().ready(v)), SECONDS[1:]),  # None: the default
    *rows("flush timeout", lambda v: run(http().flush_cache(v)), SECONDS0),
    # -- launched server ------------------------------------------------------------------------
    *rows("model_path", lambda v: LaunchedSGLangEngine(v, port=30000), STRINGS),
    *rows("port", lambda v: launched(port=v), [*INTS, 0, 65536]),
    *rows("host", lambda v: launched(host=v), STRINGS),
    *rows("extra_args", lambda v: launched(extra_args=v), [None, "--x", b"x", [1], 3]),
    *rows("python", lambda v: launched(python=v), [1, "", True]),
    *rows("memory_saver", lambda v: launched(memory_saver=v), FLAGS),
    *rows("command", lambda v: launched(command=v), ["sglang", [], [1], 3]),
    *rows("env", lambda v: launched(env=v), [1, "A=b", {"A": 1}]),
    *rows("startup_timeout", lambda v: launched(startup_timeout=v), SECONDS),
    *rows("stop_grace", lambda v: launched(stop_grace=v), SECONDS),
    *rows("timeouts", lambda v: launched(timeouts=v), [{}, 5]),
    *rows("weight_selector", lambda v: launched(weight_selector=v), [None, "both"]),
    # -- simulated engine -----------------------------------------------------------------------
    *rows("label", lambda v: sim(label=v), STRINGS),
    *rows("token_latency", lambda v: sim(token_latency=v), SECONDS0),
    *rows("health_timeout", lambda v: sim(health_timeout=v), SECONDS0),
    *rows(
        "op_latency",
        lambda v: sim(op_latency=v),
        [
            1,
            "fast",
            {"bogus": 1.0},
            {"pause_generation": math.nan},
            {"pause_generation": 1e308},
            {"pause_generation": True},
            {"pause_generation": (2.0, 1.0)},
            {"pause_generation": (1.0,)},
            {"pause_generation": (0.0, math.inf)},
        ],
    ),
    *rows("seed", lambda v: sim(seed=v), [1.5, "1", True]),
    *rows(
        "memory_bytes",
        lambda v: sim(memory_bytes=v),
        [1, "x", {"vram": 1}, {"weights": -1}, {"weights": 1.5}, {"weights": True}],
    ),
    *rows("weight_version", lambda v: sim(weight_version=v), [None, 1]),
    *rows("weights_cpu_backup", lambda v: sim(weights_cpu_backup=v), FLAGS),
    *rows("dp_dummy_batches", lambda v: sim(dp_dummy_batches=v), FLAGS),
    *rows("check_model_paths", lambda v: sim(check_model_paths=v), FLAGS),
    *rows("packed_weights", lambda v: sim(packed_weights=v), FLAGS),
    *rows("max_running", lambda v: sim(max_running=v), [*INTS, 0]),
    *rows("gpu_memory_bytes", lambda v: sim(gpu_memory_bytes=v), [*INTS[1:-1], "1"]),
    *rows("count", lambda v: fleet_factories(v, label="f", seed=None), [*INTS, 0, 10**7]),
    *rows("option", lambda v: fleet_factories(1, label="f", seed=None, **{v: 1}), ["bogus"]),
    # -- stand-in server ------------------------------------------------------------------------
    *rows("startup_timeout", lambda v: standin(startup_timeout=v), SECONDS),
    *rows("history_file", lambda v: standin(history_file=v), [1, "", b"/tmp/x", True]),
    *rows("model_path", lambda v: standin(model_path=v), [1, "", True]),
    *rows("option", lambda v: standin(**{v: 1}), ["bogus"]),
    *rows("token_latency", lambda v: standin(token_latency=v), [math.nan, 1e308]),
    *rows("weights_cpu_backup", lambda v: standin(weights_cpu_backup=v), ["no"]),
    *rows("timeout", lambda v: standin().stop(v), SECONDS0),
    *rows("timeout", lambda v: standin().wait_dead(v), SECONDS0),
    *rows("rule", lambda v: standin().inject(v), [None, "pause", 1, [("path", "/x")]]),
    *rows("host", lambda v: serve(host=v, port=0), [None, 1]),
    *rows("port", lambda v: serve(port=v), [*INTS, 65536]),
    *rows("print_ready", lambda v: serve(port=0, print_ready=v), FLAGS),
    *rows("allow_remote", lambda v: serve(port=0, allow_remote=v), FLAGS),
    *rows("engine_options", lambda v: serve(port=0, engine_options=v), [1, {"bogus": 1}]),
    *rows("engine", lambda v: create_app(v), [None, "sim"]),
    *rows("history_file", lambda v: create_app(sim(), history_file=v), [1, ""]),
    *rows("model_path", lambda v: create_app(sim(), model_path=v), STRINGS),
    *rows("on_death", lambda v: create_app(sim(), on_death=v), [1, "exit"]),
    # -- fault injection ------------------------------------------------------------------------
    *rows("inner", lambda v: FaultyEngine(v), [None, "engine", 1]),
    *rows("label", lambda v: FaultyEngine(sim(), label=v), [1, "", True]),
    *rows("op", lambda v: FaultyEngine(sim()).arm(v, "reject"), [None, 1, "pause", []]),
    *rows("kind", lambda v: FaultyEngine(sim()).arm("pause_generation", v), [None, 1, "crash"]),
    *rows(
        "count",
        lambda v: FaultyEngine(sim()).arm("pause_generation", "die", count=v),
        [*SMALL_INTS, 0],
    ),
    *rows(
        "seconds",
        lambda v: FaultyEngine(sim()).arm("pause_generation", "slow", seconds=v),
        SECONDS,
    ),
    # -- generation -----------------------------------------------------------------------------
    *rows("server", lambda v: GenerationClient(v), [None, "server", 1]),
    *rows("hold_timeout", lambda v: client(hold_timeout=v), SECONDS),
    *rows("request_timeout", lambda v: client(request_timeout=v), SECONDS),
    *rows("max_resubmissions", lambda v: client(max_resubmissions=v), [*INTS, 10**7]),
    *rows(
        "request",
        lambda v: run(_generate(v)),
        [
            None,
            "hi",
            [1, 2],
            {},
            {"text": 1},
            {"text": ""},
            {"input_ids": "12"},
            {"input_ids": [True]},
            {"input_ids": [-1]},
            {"text": "a", "input_ids": [1]},
            {"text": "a", "sampling_params": []},
            {"text": "a", "sampling_params": {"max_new_tokens": True}},
            {"text": "a", "sampling_params": {"max_new_tokens": 0}},
            {"text": "a", "stream": "no"},
            {"text": "a", "stream": 1},
            {"text": "a", "rid": 1},
        ],
    ),
    *rows("group", lambda v: run(_generate({"text": "a"}, v)), [1, "nope", True, ["actor"]]),
    # (absurd ints: checked on the request alone, as generate() does before anything is sent)
    *rows(
        "max_new_tokens",
        lambda v: Request.prepare({"text": "a", "sampling_params": {"max_new_tokens": v}}, None),
        [1e18, MAX_REQUEST_INT + 1, 10**30, HUGE],
    ),
    *rows(
        "token id",
        lambda v: Request.prepare({"input_ids": [1, v]}, None),
        [1.0, MAX_REQUEST_INT + 1, 10**30, HUGE],
    ),
    *rows(
        "requests",
        lambda v: run(_generate_batch(v)),
        [None, "ab", b"ab", {"text": "a"}, 1, [None], [{"text": 1}], ({"text": "a"}, "b")],
    ),
    *rows("requests", lambda v: run(_server_generate_batch(v)), [None, "ab", {"text": "a"}]),
    # -- weight strategies ----------------------------------------------------------------------
    *rows("model_path", lambda v: FromDisk(v), STRINGS),
    *rows(
        "payload",
        lambda v: FromTensor(v),
        [None, "abc", b"abc", 1, [1], [None], {"a": [1]}, {"a": "x"}, {1: ["x"]}],
    ),
    *rows("names", lambda v: distributed(names=v), [None, "w", [1], [], b"w"]),
    *rows("dtypes", lambda v: distributed(dtypes=v), [None, "f", [None], ["f", "g"]]),
    *rows("shapes", lambda v: distributed(shapes=v), [None, "1", [1], [["a"]], [[-1]], [[True]]]),
    *rows("group_name", lambda v: distributed(group_name=v), STRINGS),
    *rows("load_format", lambda v: distributed(load_format=v), [1, ""]),
    *rows("backend", lambda v: distributed(backend=v), STRINGS),
    *rows("master_address", lambda v: joining(master_address=v), [1, ""]),
    *rows("master_port", lambda v: joining(master_port=v), ["29500", True, 0, 65536, 1.5]),
    *rows("world_size", lambda v: joining(world_size=v), ["3", True, 1, 2.5]),
    *rows(
        "rank_offsets",
        lambda v: joining(rank_offsets=v),
        [1, ["a"], {"a": 0}, {"a": 3}, {"a": "1"}, {"a": True}, {1: 1}],
    ),
    # -- Ray actors (refused before Ray is asked for anything) ---------------------------------
    *rows("factory", lambda v: start_engine_actor(v), [None, "f"]),
    *rows("name", lambda v: start_engine_actor(SimulatedEngine, name=v), [1, ""]),
    *rows("factories", lambda v: start_multi_engine_actor(v), [None, "f", [], [1]]),
    *rows("factories", lambda v: MultiEngineActorBody(v), [None, [], [1]]),
    *rows("actors", lambda v: simulated_multi_engine_actors(v, 1), [*INTS, 0]),
    *rows("engines_per_actor", lambda v: simulated_multi_engine_actors(1, v), [*INTS, 0]),
    *rows("index", lambda v: HostedEngine(object(), v), INTS),
    *rows("index", lambda v: run(_multi_call(v)), [*INTS, 1]),
    *rows("op", lambda v: run(_multi_call(0, v)), [None, "_hosts", []]),
    *rows("count", lambda v: simulated_engine_actors(v), [*INTS, 0]),
    # -- the router -----------------------------------------------------------------------------
    *rows("url", lambda v: SGLangRouter(v), [None, 1, "", "ftp://x", "http://h:99999"]),
    *rows("timeout", lambda v: SGLangRouter("http://127.0.0.1:1", timeout=v), SECONDS),
    *rows("settle", lambda v: SGLangRouter("http://127.0.0.1:1", settle=v), SECONDS),
    *rows("router", lambda v: RolloutServer([EngineGroup("a", [sim()])], router=v), [1, "r"]),
    # -- timeline -------------------------------------------------------------------------------
    *rows("max_calls", lambda v: Timeline(v), [*INTS, 10**7]),
    *rows("name", lambda v: Timeline(name=v), STRINGS),
    *rows("path", lambda v: Timeline().export_chrome_trace(v), [None, 1, "", b"/tmp/t.json"]),
    *rows("path", lambda v: Timeline().plot_gantt(v), [None, 1, ""]),
    *rows(
        "max_engines",
        lambda v: Timeline().plot_gantt("/tmp/never.png", max_engines=v),
        [*SMALL_INTS, 0],
    ),
    *rows("title", lambda v: Timeline().plot_gantt("/tmp/never.png", title=v), [1, b"t"]),
    # -- testing helpers ------------------------------------------------------------------------
    *rows("histories", lambda v: cycle_order_violations(v), [None, [], {"a": None}, {"a": [1]}]),
    *rows("histories", lambda v: barrier_violations(v), [None, {"a": "x"}, {"a": [None]}]),
    *rows(
        "scopes",
        lambda v: barrier_violations({}, scopes=v),
        ["round", 1.5, [2.0, 1.0], [float("nan")], ["0"]],
    ),
    *rows("gone", lambda v: barrier_violations({}, gone=v), [[1.0], {"a": "soon"}]),
    *rows("ordered", lambda v: barrier_violations({}, ordered=v), [None, "yes", 1]),
    *rows("phases", lambda v: barrier_violations({}, phases=v), ["pause", [], ["drain"], 3]),
    *rows("history", lambda v: cycle_rounds(v), [None, "x", [1]]),
    *rows("history", lambda v: released_ops(v), [None, 1]),
    *rows("entry", lambda v: cycle_phase_of(v), [None, "op"]),
    # -- the engine host (the body of every engine actor) ---------------------------------------
    *rows("backend", lambda v: EngineHost(v), [None, "engine"]),
    *rows("mode", lambda v: run(_host_call("pause_generation", v)), [None, "stop", 1]),
    *rows("deadline", lambda v: run(_host_call("flush_cache", v)), SECONDS0),
    *rows("retry_interval", lambda v: run(_host_call("flush_cache", 1.0, v)), SECONDS0),
    *rows(
        "tags",
        lambda v: run(_host_call("release_memory_occupation", v)),
        [None, "weights", ["weight"], []],
    ),
]


def _shown(value: object) -> str:
    """What the message must show of the value: the start of its repr (nan/inf as Python
    writes them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return repr(value)[:20]


@pytest.mark.parametrize(("name", "call", "value"), CASES)
def test_bad_value_is_refused_naming_it(
    name: str, call: Callable[[Any], object], value: Any
) -> None:
    with pytest.raises(InvalidArgument) as info:
        call(value)
    message = str(info.value)
    assert isinstance(info.value, InvalidArgument) and message
    assert info.value.__cause__ is None or isinstance(info.value.__cause__, InvalidArgument)
    if not isinstance(value, list | dict | tuple):  # a container: the bad item is named
        assert _shown(value) in message, message


@pytest.mark.parametrize(
    ("call", "value"),
    [
        pytest.param(lambda v: LifecycleConfig(release_tags=v), None, id="release_tags"),
        pytest.param(lambda v: LifecycleConfig(continue_on_failure=v), "no", id="flag"),
        pytest.param(lambda v: Deadlines(pause=v), 1e308, id="deadline"),
        pytest.param(lambda v: client(hold_timeout=v), math.nan, id="hold_timeout"),
        pytest.param(lambda v: run(_generate_batch(v)), None, id="requests"),
        pytest.param(lambda v: http(retries=v), HUGE, id="huge int"),
    ],
)
def test_message_names_the_value(call: Callable[[Any], object], value: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        call(value)
    assert _shown(value) in str(info.value)


def test_good_values_still_pass() -> None:
    assert check_seconds("x", 1) == 1.0 and check_seconds("x", 0, positive=False) == 0.0
    assert check_seconds("x", MAX_SECONDS) == MAX_SECONDS
    assert Deadlines(pause=MAX_SECONDS).pause == MAX_SECONDS
    config = LifecycleConfig(
        pause_mode="abort",
        dead_engines=DeadEnginePolicy.SKIP,
        release_tags=["kv_cache"],
        continue_on_failure=False,
        timeline_calls=0,
        flush_retry_interval=120,
    )
    assert config.continue_on_failure is False and config.flush_retry_interval == 120
    SimulatedEngine(token_latency=0, weights_cpu_backup=True, dp_dummy_batches=False)
    FromDistributed(["w"], ["f"], [(1, 2)], "g", None, "h", 1, 2, {"a": 1})
    FromTensor({"a": ["x"]})
    Timeline(0, name="t")
    HostedEngine(object(), 0)


def test_request_ints_up_to_the_bound_pass_and_one_too_long_to_print_is_refused() -> None:
    request = {"input_ids": [0, MAX_REQUEST_INT], "sampling_params": {"max_new_tokens": 1}}
    assert Request.prepare(request, None).prompt_ids == [0, MAX_REQUEST_INT]
    bound = {"text": "a", "sampling_params": {"max_new_tokens": MAX_REQUEST_INT}}
    assert Request.prepare(bound, None).max_new == MAX_REQUEST_INT
    # an int whose digits Python refuses to print (over 4300) is named by its size
    for bad in (
        {"input_ids": [10**5000]},
        {"text": "a", "sampling_params": {"max_new_tokens": 10**5000}},
    ):
        with pytest.raises(InvalidArgument, match="5000 digits"):
            Request.prepare(bad, None)
