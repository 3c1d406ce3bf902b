"""The simulated engine's state: its options, memory per tag, requests, weight version and
history, and what it reports of itself (``state()``, ``stats()``, ``memory()``, ``history()``,
its server arguments). The other parts of ``SimulatedEngine`` (its call front end, scheduler,
weight and lifecycle calls) each receive this one object; the constants and request record they
share live here too.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_lifecycle.backends.engine import CHECKING, incarnation_of
from rollout_lifecycle.contract.exceptions import EngineDead, InvalidArgument
from rollout_lifecycle.contract.identity import PROOF_WINDOW
from rollout_lifecycle.contract.values import (
    ALL_TAGS,
    PauseMode,
    Tag,
    check_flag,
    check_int,
    check_seconds,
)

GIB = 1 << 30

#: Resident bytes per tag when ``memory_bytes`` does not say otherwise.
DEFAULT_MEMORY_BYTES: Mapping[str, int] = {
    Tag.WEIGHTS.value: 16 * GIB,
    Tag.KV_CACHE.value: 40 * GIB,
    Tag.CUDA_GRAPH.value: 2 * GIB,
}

#: The operations whose duration ``op_latency`` can set (and that ``history()`` records).
LIFECYCLE_OPS: tuple[str, ...] = (
    "pause_generation",
    "continue_generation",
    "flush_cache",
    "release_memory_occupation",
    "resume_memory_occupation",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "init_weights_update_group",
    "destroy_weights_update_group",
    "update_weight_version",
    "weight_version",
    "server_info",
    "ready",
    "ping",
    "observe",
    "health",
    "abort_request",
)

SIM_VERSION = "0.5.23"

#: The weight version a server starts with when ``--weight-version`` is not given.
# sglang: arg_groups/fields/serving.py (weight_version defaults to "default")
DEFAULT_WEIGHT_VERSION = "default"
#: What a fresh simulated engine's weights hold (the same checkpoint on every engine).
INITIAL_CONTENT = "initial"
#: The tensors the simulated model holds (``/weights_checker`` answers a digest for each).
SIM_TENSORS: tuple[str, ...] = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "lm_head.weight",
)

VOCAB = 32000
KNOWN_TAGS = frozenset(t.value for t in ALL_TAGS)
# SGLang resumes in this order within one call, whatever order the tags were given in.
RESUME_ORDER: tuple[str, ...] = (Tag.CUDA_GRAPH.value, Tag.WEIGHTS.value, Tag.KV_CACHE.value)
# A forward pass touches these; cuda_graph being released only costs speed, not correctness.
FORWARD_TAGS: tuple[str, ...] = (Tag.WEIGHTS.value, Tag.KV_CACHE.value)
# Whatever released weights hold after a resume without a CPU backup decodes to this token.
GARBAGE_TOKEN = 0
# KV cache bytes per token slot, for the token capacity /server_info reports.
KV_BYTES_PER_TOKEN = 128 * 1024


@dataclass(eq=False)
class SimRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    future: asyncio.Future[dict[str, Any]]
    internal: bool = False
    output: list[int] = field(default_factory=list)
    num_retractions: int = 0
    # (version before a change, output tokens generated under it), one per change seen while
    # the request was live in the scheduler. sglang: utils/weight_versions.py WeightVersionEvent
    version_events: list[tuple[str, int]] = field(default_factory=list)
    cached_tokens: int = 0
    on_garbage: bool = False

    def __post_init__(self) -> None:
        self.key = sum((i + 1) * t for i, t in enumerate(self.prompt)) % VOCAB


#: Where a process's start-up values come from (never a seeded generator: see ``start_process``).
_SYSTEM_RANDOM = random.SystemRandom()

#: History entries per tuple of older entries (see ``SimState.record``).
HISTORY_CHUNK = 16


#: The most requests ``max_running`` may let run at once.
MAX_RUNNING = 1_000_000
#: SGLang's ``--disaggregation-mode`` values (``arg_groups/fields/disagg.py``).
DISAGGREGATION_MODES = ("null", "prefill", "decode")
#: SGLang's default ``--disaggregation-bootstrap-port``.
DEFAULT_BOOTSTRAP_PORT = 8998
#: The most data-parallel ranks a simulated server reports.
MAX_DP_SIZE = 1024


def seconds_of(value: object) -> float | None:
    """``value`` as seconds if it is a finite number >= 0, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def requested_tags(tags: Sequence[Tag | str] | None) -> tuple[object, ...] | str | None:
    """The tags a call asked for, as its history records them (tag names, not ``Tag``s)."""
    if tags is None or isinstance(tags, str):
        return tags
    return tuple(t.value if isinstance(t, Tag) else t for t in tags)


def _check_seconds(name: str, value: object) -> float:
    return check_seconds(name, value, positive=False)


def detokenize(tokens: Sequence[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in tokens)


def version_spans(
    events: Sequence[tuple[str, int]], current: str, count: int
) -> list[dict[str, Any]]:
    """``meta_info["weight_versions"]`` of a request that finished with ``count`` tokens.

    sglang: utils/weight_versions.py compute_weight_version_spans (scheduler side) followed by
    add_weight_versions_to_meta_info (tokenizer side, which hides spans past the output).
    """
    spans: list[dict[str, Any]] = []
    for version, raw_end in [*events, (current, count)]:
        end = min(raw_end, count)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    visible = [s for s in spans if s["start"] < count or s["start"] == 0]
    return [{**s, "end": min(s["end"], count)} for s in visible]


def check_op_latency(
    op_latency: Mapping[str, float | tuple[float, float]] | None,
) -> dict[str, float | tuple[float, float]]:
    """``op_latency`` checked: seconds or a (low, high) range per op of ``LIFECYCLE_OPS``."""
    if op_latency is None:
        return {}
    if not isinstance(op_latency, Mapping):
        raise InvalidArgument(f"op_latency must be a mapping, got {op_latency!r}")
    out: dict[str, float | tuple[float, float]] = {}
    for op, value in op_latency.items():
        if op not in LIFECYCLE_OPS:
            raise InvalidArgument(
                f"unknown op {op!r} in op_latency; valid: {', '.join(LIFECYCLE_OPS)}"
            )
        if isinstance(value, tuple):
            if len(value) != 2:
                raise InvalidArgument(
                    f"op_latency[{op!r}] must be seconds or a (low, high) pair, got {value!r}"
                )
            low = _check_seconds(f"op_latency[{op!r}] low", value[0])
            high = _check_seconds(f"op_latency[{op!r}] high", value[1])
            if low > high:
                raise InvalidArgument(f"op_latency[{op!r}] range has low > high: {value!r}")
            out[op] = (low, high)
        else:
            out[op] = _check_seconds(f"op_latency[{op!r}]", value)
    return out


def check_memory(memory_bytes: Mapping[str, int] | None) -> dict[str, int]:
    """The bytes each tag holds resident: ``DEFAULT_MEMORY_BYTES`` with ``memory_bytes`` over it."""
    capacity = dict(DEFAULT_MEMORY_BYTES)
    if memory_bytes is None:
        return capacity
    if not isinstance(memory_bytes, Mapping):
        raise InvalidArgument(f"memory_bytes must be a mapping, got {memory_bytes!r}")
    for tag, nbytes in memory_bytes.items():
        name = tag.value if isinstance(tag, Tag) else tag
        if name not in KNOWN_TAGS:
            raise InvalidArgument(
                f"unknown memory tag {tag!r} in memory_bytes; valid: "
                f"{', '.join(sorted(KNOWN_TAGS))}"
            )
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidArgument(f"memory_bytes[{name!r}] must be an int >= 0, got {nbytes!r}")
        capacity[name] = nbytes
    return capacity


class SimState:
    """What one simulated SGLang server holds: its options, the process's state (memory per tag,
    paused, weight version, session and groups, the request queues), the counters and the
    history that outlive restarts; and what it reports of them.

    The scheduler, the call front end and the weight and lifecycle calls read and write these
    fields; ``SimState`` itself changes nothing but the history, and signals each change
    (``notify``) to whoever waits on one (``wait_changed``).
    """

    def __init__(
        self,
        label: str = "sim",
        *,
        token_latency: float = 0.005,
        op_latency: Mapping[str, float | tuple[float, float]] | None = None,
        seed: int | None = None,
        memory_bytes: Mapping[str, int] | None = None,
        weight_version: str = DEFAULT_WEIGHT_VERSION,
        weights_cpu_backup: bool = False,
        dp_dummy_batches: bool = False,
        health_timeout: float = 20.0,
        max_running: int = 1024,
        dp_size: int = 1,
        gpu_memory_bytes: int | None = None,
        check_model_paths: bool = False,
        packed_weights: bool = False,
        model_path: str | None = None,
        disaggregation_mode: str = "null",
        disaggregation_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
    ) -> None:
        if not isinstance(label, str) or not label:
            raise InvalidArgument(f"label must be a non-empty string, got {label!r}")
        self.label = label
        self.token_latency = _check_seconds("token_latency", token_latency)
        self.health_timeout = _check_seconds("health_timeout", health_timeout)
        self.op_latency = check_op_latency(op_latency)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise InvalidArgument(f"seed must be an int or None, got {seed!r}")
        self._seed = seed
        self._rng: random.Random | None = None
        self.capacity = check_memory(memory_bytes)
        if not isinstance(weight_version, str):
            raise InvalidArgument(f"weight_version must be a string, got {weight_version!r}")
        check_int("max_running", max_running, minimum=1, maximum=MAX_RUNNING)
        if gpu_memory_bytes is not None and (
            not isinstance(gpu_memory_bytes, int)
            or isinstance(gpu_memory_bytes, bool)
            or gpu_memory_bytes < 0
        ):
            raise InvalidArgument(
                f"gpu_memory_bytes must be an int >= 0 or None, got {gpu_memory_bytes!r}"
            )
        self.gpu_memory_bytes = gpu_memory_bytes
        self.external_bytes = 0
        self.max_running = max_running
        #: The data-parallel ranks it reports (``dp_size``): with more than one it refuses
        #: tensor and collective weight writes (``SimWeights``), as SGLang does.
        self.dp_size = check_int("dp_size", dp_size, minimum=1, maximum=MAX_DP_SIZE)
        #: What it says it serves as (SGLang's ``--disaggregation-mode``: ``null``, or a
        #: ``prefill`` or ``decode`` half of a pair) and its bootstrap port. It generates as a
        #: regular server all the same: the KV transfer between halves needs a GPU.
        if disaggregation_mode not in DISAGGREGATION_MODES:
            modes = ", ".join(DISAGGREGATION_MODES)
            raise InvalidArgument(
                f"disaggregation_mode must be one of {modes}, got {disaggregation_mode!r}"
            )
        self.disaggregation_mode = disaggregation_mode
        self.bootstrap_port = check_int(
            "disaggregation_bootstrap_port",
            disaggregation_bootstrap_port,
            minimum=1,
            maximum=65535,
        )
        self.weights_cpu_backup = check_flag("weights_cpu_backup", weights_cpu_backup)
        self.dp_dummy_batches = check_flag("dp_dummy_batches", dp_dummy_batches)
        self.check_model_paths = check_flag("check_model_paths", check_model_paths)
        #: Whether it serves its weights packed, as a quantized model does: a session's begin
        #: unpacks them to the layout a load writes and its end packs them again, so inside a
        #: session its checksum reads other bytes (sglang: model_loader/loader.py
        #: DefaultModelLoader.restore_weights_before_loading and postprocess_weights).
        self.packed_weights = check_flag("packed_weights", packed_weights)
        if model_path is not None and (not isinstance(model_path, str) or not model_path):
            raise InvalidArgument(f"model_path must be a non-empty string, got {model_path!r}")
        self.initial_version = weight_version
        #: The checkpoint a (re)started process loads: what its weights hold at first.
        self.initial_content = INITIAL_CONTENT if model_path is None else model_path
        self.closed = False
        #: When the last call reached the process (the loop's clock): a restart answers no
        #: sooner than ``PROOF_WINDOW`` after it (``SimulatedEngine.restart``).
        self.last_call_at = -math.inf
        # The newest history entries, and older finished ones as tuples of their items, in
        # tuples of ``HISTORY_CHUNK`` (see ``record``). The history, like the counters, is what
        # a test sees of every process that served at this engine's place, restarts included.
        self.recent: list[dict[str, Any]] = []
        self.archive: list[tuple[tuple[tuple[str, Any], ...], ...]] = []
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "submitted",
                # requests that arrived while the engine was paused (held in its front end)
                "arrived_paused",
                "completed",
                "aborted",
                "retractions",
                "prefills",
                "prefix_hits",
                "steps",
                "dummy_steps",
                "tokens",
                "garbage_tokens",
                "flushes",
                "weight_updates",
                "health_checks",
                "restarts",
            ),
            0,
        )
        self.health_seq = 0
        # Set and replaced at each change (``notify``); the scheduler makes a new one per loop.
        self.changed: asyncio.Event | None = None
        self.process = -1
        self.start_process()

    def start_process(self) -> None:
        """The state of a server process that has just started: every tag resident, not
        paused, the initial weights and version, nothing queued, a new incarnation."""
        # Which process this is (0 for the first): a call a restarted process took is lost.
        self.process += 1
        # The front end hands the scheduler one flush at a time, in arrival order.
        # sglang: communicator.py FanOutCommunicator.queueing_call (flush_cache_communicator)
        self.flush_queue: asyncio.Lock | None = None
        self.flush_waiters = 0  # flushes waiting for the one running to end
        # What names this process in /server_info: the durations of its start-up, and the
        # random seed drawn when none is given (sglang: observability/startup_time.py;
        # arg_groups/serving_hook.py). Drawn from the system's randomness, never the seed, so
        # that two processes (a restart, or two engines built with one seed) never share them.
        draw = _SYSTEM_RANDOM.uniform
        # Kept as numbers only (``startup_time()`` adds the empty ``cuda_graph`` entry), so that
        # CPython's collector does not track the dict: see ``record``.
        self.startup_durations: dict[str, float] = {
            "load_weight": draw(0.01, 0.1),
            "kv_cache_allocation": draw(0.1, 1.0),
            "scheduler_e2e": draw(1.0, 5.0),
            "tokenizer_e2e": draw(10.0, 30.0),
        }
        self.random_seed = _SYSTEM_RANDOM.randint(0, 1 << 30)
        self.incarnation = incarnation_of(
            {"startup_time": self.startup_time(), "random_seed": self.random_seed}
        )
        # The scheduler's version (stamped on output tokens) and the tokenizer's (what
        # /model_info reports) are kept apart: a weight update whose trailing flush fails moves
        # the first and not the second.
        # sglang: weight_updater.py update_weights_from_* (record_weight_version_after_update
        # before flush_cache_after_weight_update); tokenizer_control_mixin.py
        # _update_weight_version_if_provided only on success.
        self.weight_version = self.initial_version
        self.served_version = self.initial_version
        # Data-parallel ranks whose process is gone while the rest of the server lives on
        # (``SimulatedEngine.lose_rank``); a dict used as a set (see ``released``). And the
        # seconds a slow rank takes to answer each call that waits for every rank
        # (``SimulatedEngine.slow_rank``). A new process has every rank, at full speed.
        self.lost_ranks: dict[int, None] = {}
        self.slow_ranks: dict[int, float] = {}
        self.weights_valid = True
        # What the weights hold (``SimWeights.fingerprint``): the checkpoint every engine
        # starts from, then what each write wrote; per tensor where a write named tensors.
        self.weights_content = self.initial_content
        self.tensor_content: dict[str, str] | None = None
        # Why the next forward pass kills the process (a backend's half-loaded weights), or
        # None: the default, under which no forward pass dies for this reason.
        self.forward_fault: str | None = None
        # The released tags, and below the cached prompts, are dicts used as sets (keys, None
        # values): a dict of strings, or an empty one, is not tracked by CPython's collector,
        # where every set is. See ``record`` for why a large in-process fleet cares.
        self.released: dict[str, None] = {}
        self.paused = False
        self.pause_mode: PauseMode | None = None
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        # Requests that arrived while paused wait in the tokenizer front end, not in the
        # scheduler: no scheduler abort and no idleness check sees them.
        # sglang: tokenizer_manager.py generate_request (is_pause_cond.wait_for before sending)
        self.front: list[SimRequest] = []
        # New requests wait in the front end though the scheduler runs: a drain (the vLLM
        # stand-in's wait pause, as vLLM's PAUSED_NEW queues adds and keeps stepping).
        self.hold_arrivals = False
        self.in_flight: dict[str, SimRequest] = {}
        self.prefix_cache: dict[tuple[int, ...], None] = {}
        self.session_open = False
        self.session_selector: str | None = None
        self.groups: dict[str, dict[str, Any]] = {}
        self.flush_pending = False
        self.healthy = True
        self.dead = False
        self.death_reason: str | None = None

    @property
    def rng(self) -> random.Random:
        """The generator of drawn latencies (seeded by ``seed``), made at its first draw: an
        engine without latency ranges never needs one."""
        if self._rng is None:
            self._rng = random.Random(self._seed)
        return self._rng

    def startup_time(self) -> dict[str, Any]:
        """``/server_info``'s ``startup_time`` of this process (a new dict each call)."""
        return {**self.startup_durations, "cuda_graph": {}}

    # ----------------------------------------------------------------------------- changes

    def notify(self) -> None:
        """Wake whoever waits for the state to change."""
        if self.changed is not None:
            self.changed.set()
            self.changed = asyncio.Event()

    async def wait_changed(self, timeout: float | None) -> bool:
        """Wait for the next change; False if ``timeout`` seconds pass first."""
        event = self.changed
        if event is None:
            event = self.changed = asyncio.Event()
        if timeout is None:
            await event.wait()
            return True
        if timeout <= 0:
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def check_alive(self, op: str) -> None:
        """Refuse ``op`` as a dead or closed server does: ``EngineDead``."""
        if self.dead:
            raise EngineDead(self.label, op, f"engine is dead: {self.death_reason}")
        if self.closed:
            raise EngineDead(self.label, op, "engine is closed")

    def is_idle(self, *, ignore_waiting: bool) -> bool:
        """The scheduler's idleness: nothing running and, unless ignored, nothing waiting.

        The front end's held requests never count: the scheduler has not seen them.
        """
        # sglang: scheduler.py Scheduler.is_fully_idle(ignore_waiting=...)
        return not self.running and (ignore_waiting or not self.waiting)

    # ----------------------------------------------------------------------------- history

    async def new_process_may_answer(self) -> None:
        """Wait until a new process could answer at this engine's address: ``PROOF_WINDOW``
        after the old one's last call (a real server takes seconds to start, once the old one
        has let its port go); calls that come meanwhile reach the old one."""
        loop = asyncio.get_running_loop()
        while (wait := self.last_call_at + PROOF_WINDOW - loop.time()) > 0:  # noqa: ASYNC110
            await asyncio.sleep(wait)  # (a time, not an event: calls meanwhile move it on)

    def record(self, op: str, purpose: str | None = None, **fields: Any) -> dict[str, Any]:
        """Append the history entry of a call that starts now; the caller fills in its end. A
        read an engine host makes to check the engine is marked ``check_of`` its ``purpose``
        (given, or ``CHECKING``'s).

        Entries hold only strings, numbers, None and tuples of those (``history()`` turns the
        tuples into lists), and older finished entries are kept as tuples of tuples, which
        CPython's collector stops tracking: a fleet of thousands of in-process engines keeps
        millions of entries, and every full collection would otherwise visit each one.
        """
        entry: dict[str, Any] = {
            "op": op,
            "engine": self.label,
            "tags": None,
            "mode": None,
            "start": time.monotonic(),
            "end": None,
            "outcome": "pending",
            "detail": None,
            **fields,
        }
        check = CHECKING.get() if purpose is None else purpose
        if check is not None:  # a read the engine host makes to check the engine
            entry["check_of"] = check
        try:  # noqa: SIM105 (``suppress`` costs a context manager on every call of the fleet)
            self.last_call_at = asyncio.get_running_loop().time()
        except RuntimeError:  # (a call made outside any loop)
            pass
        recent = self.recent
        recent.append(entry)
        if len(recent) >= 2 * HISTORY_CHUNK:
            chunk = recent[:HISTORY_CHUNK]
            if all(e["end"] is not None for e in chunk):  # finished: nothing writes to them
                self.archive.append(tuple(tuple(e.items()) for e in chunk))
                del recent[:HISTORY_CHUNK]
        return entry

    def history(self) -> list[dict[str, Any]]:
        """Every lifecycle call that has returned (or raised), in order of start; a copy."""
        return [
            {k: list(v) if isinstance(v, tuple) else v for k, v in entry.items()}
            for entry in itertools.chain(
                (dict(items) for chunk in self.archive for items in chunk), self.recent
            )
            if entry["end"] is not None
        ]

    def take_history(self) -> list[dict[str, Any]]:
        """``history()``, and forget what it returns; calls still running stay for a later take."""
        taken = self.history()
        self.archive.clear()
        self.recent = [entry for entry in self.recent if entry["end"] is None]
        return taken

    # ----------------------------------------------------------------------------- reports

    def pause_value(self) -> str | None:
        """The mode of the current pause as its name, or None."""
        return None if self.pause_mode is None else self.pause_mode.value

    def released_tags(self) -> list[str]:
        """The memory tags released now, in tag order."""
        return [t.value for t in ALL_TAGS if t.value in self.released]

    def memory(self) -> dict[str, int]:
        """Resident bytes per tag; a dead engine's process holds none."""
        return {
            t.value: 0 if self.dead or t.value in self.released else self.capacity[t.value]
            for t in ALL_TAGS
        }

    def resident_bytes(self) -> int:
        return sum(self.memory().values())

    def set_external_memory(self, nbytes: int) -> None:
        """Say how many bytes other processes (the trainer) hold on this engine's GPU."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidArgument(f"external memory must be an int >= 0, got {nbytes!r}")
        self.external_bytes = nbytes

    def state(self) -> dict[str, Any]:
        """What SGLang keeps to itself, for tests (see ``SimulatedEngine.state``)."""
        return {
            "label": self.label,
            "dead": self.dead,
            "paused": self.paused,
            "pause_mode": self.pause_value(),
            "released_tags": self.released_tags(),
            "weights_valid": self.weights_valid,
            "flush_pending": self.flush_pending,
            "flush_waiters": self.flush_waiters,
            "weight_update_session_open": self.session_open,
            # lifecycle calls that have started and not returned (their latency included)
            "in_flight": [e["op"] for e in self.recent if e["end"] is None],
        }

    def stats(self) -> dict[str, int]:
        """Counters of the work done so far and the current queues."""
        return {
            **self.counts,
            "prefix_cache_size": len(self.prefix_cache),
            "running": len(self.running),
            "waiting": len(self.waiting),
            "held": len(self.front),
            "in_flight": len(self.in_flight),
        }

    def server_args(self) -> dict[str, Any]:
        """The resolved server arguments this engine stands for (a subset of SGLang's)."""
        return {
            "model_path": "simulated/" + self.label,
            "tokenizer_path": "simulated/" + self.label,
            "weight_version": self.initial_version,
            "enable_memory_saver": True,
            "enable_weights_cpu_backup": self.weights_cpu_backup,
            "max_running_requests": self.max_running,
            "api_key": None,
            "admin_api_key": None,
            "random_seed": self.random_seed,
            "dp_size": self.dp_size,
            "tp_size": 1,
            "disaggregation_mode": self.disaggregation_mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
        }

    def memory_usage(self) -> dict[str, Any]:
        """``memory_usage`` of ``/server_info``'s internal state, in GB."""

        # What the scheduler measured at load, in GB; a release does not change it.
        # sglang: scheduler_components/memory_usage.py build_memory_usage
        def gb(tag: str) -> float:
            return round(self.capacity[tag] / GIB, 3)

        return {
            "weight": gb(Tag.WEIGHTS.value),
            "kvcache": gb(Tag.KV_CACHE.value),
            "startup_available": round(sum(self.capacity.values()) / GIB, 3),
            "token_capacity": self.capacity[Tag.KV_CACHE.value] // KV_BYTES_PER_TOKEN,
            "token_capacity_swa": None,
            "graph": {"decode": gb(Tag.CUDA_GRAPH.value)},
        }
