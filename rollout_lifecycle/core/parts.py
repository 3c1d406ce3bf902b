"""What the clients of the ledger and the runner within one server share: ``Parts``, and
``Client``, the base that puts them at hand (the phases, the reconciler, the weight writer,
recovery)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollout_lifecycle.core.config import LifecycleConfig
from rollout_lifecycle.core.hooks import Hooks
from rollout_lifecycle.core.ledger import Fleet
from rollout_lifecycle.core.runner import PhaseRunner
from rollout_lifecycle.core.states import ServerState


@dataclass
class Versions:
    """The weight version generation must see: set by a versioned update, checked before
    every continue."""

    expected: str | None = None
    #: An unversioned push raised, and no write has completed since: it may have written part
    #: of the weights, and no version tells which engines hold what, so none may continue.
    interrupted: bool = False

    def wanted(self) -> str | None:
        """The version a ``StaleWeights`` names: none after an interrupted push (new weights
        are wanted, whatever version the engines report)."""
        return None if self.interrupted else self.expected


@dataclass(frozen=True)
class Parts:
    """What the clients of the ledger and the runner (phases, weight writes, recovery) share
    within one server."""

    name: str
    fleet: Fleet
    runner: PhaseRunner
    config: LifecycleConfig
    hooks: Hooks
    versions: Versions
    #: Writes the server's journal (a no-op without one).
    journal: Callable[[], None]
    #: The server's state.
    state: Callable[[], ServerState]


class Client:
    """A client of the ledger and the runner: the server's parts, at hand."""

    def __init__(self, parts: Parts) -> None:
        self._name = parts.name
        self._fleet = parts.fleet
        self._runner = parts.runner
        self._config = parts.config
        self._hooks = parts.hooks
        self._versions = parts.versions
        self._journal = parts.journal
        self._state = parts.state


__all__ = ["Client", "Parts", "Versions"]
