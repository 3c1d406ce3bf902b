"""Configuration: per-phase deadlines and the lifecycle policy.

Everything a transition waits for has a deadline here; nothing in the library waits without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.identity import PROOF_WINDOW
from rollout_lifecycle.contract.values import (
    ALL_TAGS,
    PauseMode,
    Tag,
    check_flag,
    check_int,
    check_seconds,
    member,
    parse_tags,
)

#: The most calls a ``Timeline`` (``LifecycleConfig.timeline_calls``) keeps.
MAX_TIMELINE_CALLS = 1_000_000


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase may take on every engine before the engine counts as timed out."""

    pause: float = 60.0
    flush: float = 120.0
    release: float = 120.0
    resume: float = 300.0
    continue_: float = 60.0
    weight_update: float = 1800.0
    probe: float = 10.0
    #: A replacement engine's start-up (its first answer), in ``recover()``.
    startup: float = 900.0
    #: One hook (or a ``recover()`` factory) from its call to its return. A hook may run a
    #: whole weight update (``update_weights`` from a ``weights_restored`` hook), so the default
    #: is the weight update's. A cancelled call cancels its running hook at once.
    hook: float = 1800.0

    def __post_init__(self) -> None:
        for f in fields(self):
            check_seconds(f"deadline {f.name!r}", getattr(self, f.name))


class DeadEnginePolicy(str, Enum):
    """What a transition does when an engine is found dead."""

    #: The transition fails (``PhaseFailed``); the server goes to ``failed``.
    FAIL = "fail"
    #: The dead engine is left out and the transition goes on with the live ones.
    SKIP = "skip"


@dataclass(frozen=True)
class LifecycleConfig:
    """How a ``RolloutServer`` drives its engines."""

    pause_mode: PauseMode = PauseMode.RETRACT
    deadlines: Deadlines = field(default_factory=Deadlines)
    #: Tags ``offload()`` releases. All three by default (step 3 of the safe sequence,
    #: docs/design.md).
    release_tags: tuple[Tag, ...] = ALL_TAGS
    #: When pause or flush fails, continue generation on the engines that were paused so that
    #: serving is not left stuck.
    continue_on_failure: bool = True
    dead_engines: DeadEnginePolicy = DeadEnginePolicy.FAIL
    #: Pause between flush attempts while an engine is not idle yet.
    flush_retry_interval: float = 0.05
    #: How many of the last public calls ``RolloutServer.timeline`` keeps the spans of (one
    #: span per phase and per engine call); 0 records none.
    timeline_calls: int = 16
    #: Ask every engine for its resident bytes per tag before and after each public call
    #: (``lifecycle/<call>/<tag>_bytes_before`` / ``_after`` metrics). One extra call per engine
    #: on each side of the call, so off by default; engines that do not account memory
    #: (a real SGLang server over HTTP) report nothing.
    memory_metrics: bool = False
    #: Verify every weight write (``update_weights(verify=None)`` follows this): read each
    #: engine's weight fingerprint before and after the push and keep out of serving the
    #: engines that do not hold what their group holds (``core/verify``). Two reads of every
    #: tensor per engine per write, so off by default.
    verify_weights: bool = False
    #: What a verified write does when engines fail verification: raise
    #: ``WeightsNotVerified`` (``FAIL``), or go on without them (``SKIP``). Either way they stay
    #: paused, stale and out of the router until a write reaches them.
    unverified_engines: DeadEnginePolicy = DeadEnginePolicy.FAIL
    #: Seconds for which an engine's answer proves that a call sent to it reaches the same
    #: process, measured from the send of the call it answered: within it, a checked call
    #: reads nothing of an engine that no other controller can have touched (``core/claims``).
    #: No engine restarts faster (``contract.identity.PROOF_WINDOW``); 0 reads the engine
    #: before every checked call. Behind a proxy that may send one connection to another
    #: server, set 0.
    proof_window: float = PROOF_WINDOW
    #: While the server is ``serving``, read each engine's incarnation again every half
    #: ``proof_window`` (``core/renewal``), so that the next ``offload()``'s pause finds every
    #: engine proven and reads nothing first: the read leaves the offload's critical path for
    #: the rollout before it. One identity read per engine per half window while serving (on
    #: SGLang a ``/server_info``), so off by default; it needs a ``proof_window`` above 0.
    renew_proofs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "pause_mode", member(PauseMode, self.pause_mode, "pause_mode"))
        object.__setattr__(
            self, "dead_engines", member(DeadEnginePolicy, self.dead_engines, "dead_engines")
        )
        if not isinstance(self.deadlines, Deadlines):
            raise InvalidArgument(f"deadlines must be a Deadlines, got {self.deadlines!r}")
        object.__setattr__(self, "release_tags", parse_tags(self.release_tags, what="release_tags"))
        check_seconds(
            "flush_retry_interval",
            self.flush_retry_interval,
            maximum=self.deadlines.flush,
        )
        check_flag("continue_on_failure", self.continue_on_failure)
        check_int("timeline_calls", self.timeline_calls, maximum=MAX_TIMELINE_CALLS)
        check_flag("memory_metrics", self.memory_metrics)
        check_flag("verify_weights", self.verify_weights)
        object.__setattr__(
            self,
            "unverified_engines",
            member(DeadEnginePolicy, self.unverified_engines, "unverified_engines"),
        )
        check_seconds("proof_window", self.proof_window, positive=False, maximum=PROOF_WINDOW)
        check_flag("renew_proofs", self.renew_proofs)
        if self.renew_proofs and not self.proof_window:
            raise InvalidArgument(
                "renew_proofs=True needs a proof_window above 0 (it keeps answers proving "
                "their process for that long); with proof_window=0 every checked call reads "
                "its engine, so leave renew_proofs off"
            )
