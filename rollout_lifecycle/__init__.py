"""rollout_lifecycle: an explicit, barrier-synchronised memory lifecycle for SGLang rollout engines.

A ``RolloutServer`` drives ``EngineGroup``s of engines through ``serving -> pausing -> drained ->
released -> weights_restored -> kv_restored -> serving`` so that no engine's memory is released
while a request runs, weights return before the KV cache, and generation resumes only on resident
memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_lifecycle.contract.exceptions import (
    EngineClaimed,
    EngineDead,
    EngineError,
    EngineFenced,
    EngineRejected,
    EngineRestarted,
    EngineStateConflict,
    EngineTimeout,
    EngineUnhealthy,
    EngineUnreachable,
    HookFailed,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LeaseLost,
    LifecycleError,
    PhaseFailed,
    RouterError,
    StaleWeights,
    WeightPushFailed,
    WeightsNotVerified,
)
from rollout_lifecycle.contract.fingerprint import Fingerprint
from rollout_lifecycle.contract.lazy import lazy_names
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.contract.values import ALL_TAGS, KV_TAGS, WEIGHT_TAGS, PauseMode, Tag
from rollout_lifecycle.core.config import DeadEnginePolicy, Deadlines, LifecycleConfig
from rollout_lifecycle.core.generation import (
    GenerationClient,
    GenerationError,
    GenerationTimeout,
    NoLiveEngine,
    TooManyResubmissions,
)
from rollout_lifecycle.core.group import EngineGroup, EngineSnapshot
from rollout_lifecycle.core.ledger import EngineState
from rollout_lifecycle.core.server import (
    HOOK_EVENTS,
    HOOK_PHASES,
    GroupSnapshot,
    LifecycleEvent,
    RolloutServer,
    ServerSnapshot,
    WeightUpdate,
)
from rollout_lifecycle.core.states import TRANSITIONS, Phase, ServerState, mermaid
from rollout_lifecycle.core.timeline import Span, Timeline

if TYPE_CHECKING:
    from rollout_lifecycle.backends.actor import EngineActor, EngineActorBody, start_engine_actor
    from rollout_lifecycle.backends.engine import EngineBackend, EngineHost, incarnation_of
    from rollout_lifecycle.backends.http.wire import HTTPTimeouts
    from rollout_lifecycle.backends.placement import EnginePlacement, PlacementFailed
    from rollout_lifecycle.backends.ports import free_port
    from rollout_lifecycle.backends.router import LaunchedRouter, RouterWorker, SGLangRouter
    from rollout_lifecycle.backends.secret import Secret
    from rollout_lifecycle.backends.sglang.client import SGLangHTTPEngine, sglang_http_factory
    from rollout_lifecycle.backends.sglang.launch import (
        LaunchedSGLangEngine,
        launched_sglang_factory,
    )
    from rollout_lifecycle.backends.vllm.client import VLLMHTTPEngine, vllm_http_factory
    from rollout_lifecycle.backends.vllm.launch import LaunchedVLLMEngine, launched_vllm_factory
    from rollout_lifecycle.backends.weights import FromDisk, FromDistributed, FromTensor
    from rollout_lifecycle.lease import ClusterClaims, ClusterJournal
    from rollout_lifecycle.sync import SyncRolloutServer
    from rollout_lifecycle.testing.simulated import SimulatedEngine

#: Names whose modules load when first asked for: the backends bring Ray or httpx with them, and
#: the lifecycle core imports without either (a backend's engines register its seam on import).
_LAZY: dict[str, str] = {
    "EngineActor": "rollout_lifecycle.backends.actor",
    "EngineActorBody": "rollout_lifecycle.backends.actor",
    "start_engine_actor": "rollout_lifecycle.backends.actor",
    "EngineBackend": "rollout_lifecycle.backends.engine",
    "EngineHost": "rollout_lifecycle.backends.engine",
    "incarnation_of": "rollout_lifecycle.backends.engine",
    "HTTPTimeouts": "rollout_lifecycle.backends.http.wire",
    "ClusterClaims": "rollout_lifecycle.lease",
    "ClusterJournal": "rollout_lifecycle.lease",
    "EnginePlacement": "rollout_lifecycle.backends.placement",
    "PlacementFailed": "rollout_lifecycle.backends.placement",
    "SGLangHTTPEngine": "rollout_lifecycle.backends.sglang.client",
    "sglang_http_factory": "rollout_lifecycle.backends.sglang.client",
    "LaunchedSGLangEngine": "rollout_lifecycle.backends.sglang.launch",
    "launched_sglang_factory": "rollout_lifecycle.backends.sglang.launch",
    "free_port": "rollout_lifecycle.backends.ports",
    "LaunchedRouter": "rollout_lifecycle.backends.router",
    "RouterWorker": "rollout_lifecycle.backends.router",
    "SGLangRouter": "rollout_lifecycle.backends.router",
    "Secret": "rollout_lifecycle.backends.secret",
    "VLLMHTTPEngine": "rollout_lifecycle.backends.vllm.client",
    "vllm_http_factory": "rollout_lifecycle.backends.vllm.client",
    "LaunchedVLLMEngine": "rollout_lifecycle.backends.vllm.launch",
    "launched_vllm_factory": "rollout_lifecycle.backends.vllm.launch",
    "FromDisk": "rollout_lifecycle.backends.weights",
    "FromDistributed": "rollout_lifecycle.backends.weights",
    "FromTensor": "rollout_lifecycle.backends.weights",
    "SyncRolloutServer": "rollout_lifecycle.sync",
    "SimulatedEngine": "rollout_lifecycle.testing.simulated",
}

__version__ = "0.1.0"

__all__ = [
    "ALL_TAGS",
    "HOOK_EVENTS",
    "HOOK_PHASES",
    "KV_TAGS",
    "TRANSITIONS",
    "WEIGHT_TAGS",
    "ClusterClaims",
    "ClusterJournal",
    "DeadEnginePolicy",
    "Deadlines",
    "EngineActor",
    "EngineActorBody",
    "EngineBackend",
    "EngineClaimed",
    "EngineDead",
    "EngineError",
    "EngineFenced",
    "EngineGroup",
    "EngineHost",
    "EngineOutcome",
    "EnginePlacement",
    "EngineRejected",
    "EngineRestarted",
    "EngineSnapshot",
    "EngineState",
    "EngineStateConflict",
    "EngineTimeout",
    "EngineUnhealthy",
    "EngineUnreachable",
    "Fingerprint",
    "FromDisk",
    "FromDistributed",
    "FromTensor",
    "GenerationClient",
    "GenerationError",
    "GenerationTimeout",
    "GroupSnapshot",
    "HTTPTimeouts",
    "HookFailed",
    "IllegalEngineOp",
    "IllegalTransition",
    "InvalidArgument",
    "LaunchedRouter",
    "LaunchedSGLangEngine",
    "LaunchedVLLMEngine",
    "LeaseLost",
    "LifecycleConfig",
    "LifecycleError",
    "LifecycleEvent",
    "NoLiveEngine",
    "Outcome",
    "PauseMode",
    "Phase",
    "PhaseFailed",
    "PlacementFailed",
    "RolloutServer",
    "RouterError",
    "RouterWorker",
    "SGLangHTTPEngine",
    "SGLangRouter",
    "Secret",
    "ServerSnapshot",
    "ServerState",
    "SimulatedEngine",
    "Span",
    "StaleWeights",
    "SyncRolloutServer",
    "Tag",
    "Timeline",
    "TooManyResubmissions",
    "VLLMHTTPEngine",
    "WeightPushFailed",
    "WeightUpdate",
    "WeightsNotVerified",
    "__version__",
    "free_port",
    "incarnation_of",
    "launched_sglang_factory",
    "launched_vllm_factory",
    "mermaid",
    "sglang_http_factory",
    "start_engine_actor",
    "vllm_http_factory",
]


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)
