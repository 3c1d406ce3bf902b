"""The server's internal events: what the parts that follow the lifecycle subscribe to, instead
of being called by name from the middle of it.

Three events. ``RecordsChanged``: the records just changed in a way worth keeping (an intent
recorded before a send, a phase's outcomes written, a state entered, an engine replaced); the
journal subscribes, and a journal that raises before a send stops the send. ``PhaseSettled``
(defined with the phase result it carries, in ``core.runner``, which publishes it): a phase's
calls all answered or missed their deadline; the metrics and the timeline subscribe,
and the generation client (held requests look again: a group paused around a weight update is
continued inside a phase, with no state change). ``StateEntered``: the server entered a state;
the generation client subscribes, and the router binding (which engines serve follows the
state: ``Fleet.serves``). Subscribers run in order of subscription, on the server's loop; what
one raises reaches the publisher. ``publish`` is for subscribers that return nothing;
``deliver`` also waits, in turn, for what a subscriber returns to await (the router's sync).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout_lifecycle.core.states import ServerState


@dataclass(frozen=True)
class RecordsChanged:
    """The records changed: a journal writes them now."""


@dataclass(frozen=True)
class StateEntered:
    """The server entered ``state`` from ``previous``."""

    state: ServerState
    previous: ServerState


@dataclass(frozen=True)
class CallEnded:
    """The public call ``call`` ended: ``outcome`` is ``ok``, ``error`` or ``cancelled``, after
    ``seconds`` under the lock, or ``claimed`` when another controller held one of its engines
    and it never began (``seconds`` 0)."""

    call: str
    outcome: str
    seconds: float


@dataclass(frozen=True)
class WeightsVerified:
    """A verified write read ``checked`` engines' fingerprints; ``failed`` are the ids of those
    that failed (marked stale and unverified)."""

    checked: int
    failed: tuple[str, ...]


#: The one ``RecordsChanged`` (it carries nothing).
RECORDS_CHANGED = RecordsChanged()

E = TypeVar("E")


class Bus:
    """Publish an event to the subscribers of its type."""

    def __init__(self) -> None:
        self._subscribers: dict[type, list[Callable[[Any], Awaitable[None] | None]]] = {}

    def subscribe(
        self, kind: type[E], subscriber: Callable[[E], Awaitable[None] | None]
    ) -> Callable[[], None]:
        """Call ``subscriber(event)`` for every event of type ``kind``; returns a remover."""
        subscribers = self._subscribers.setdefault(kind, [])
        subscribers.append(subscriber)

        def remove() -> None:
            if subscriber in subscribers:
                subscribers.remove(subscriber)

        return remove

    def has(self, kind: type) -> bool:
        """Whether anyone follows events of type ``kind``."""
        return bool(self._subscribers.get(kind))

    def publish(self, event: object) -> None:
        """Hand ``event`` to each subscriber of its type, in order (none may return an awaitable:
        ``deliver`` is for those)."""
        for subscriber in tuple(self._subscribers.get(type(event), ())):
            started = subscriber(event)
            if started is not None:
                if inspect.iscoroutine(started):
                    started.close()  # (never to be awaited)
                raise TypeError(f"a subscriber to {type(event).__name__} needs Bus.deliver")

    async def deliver(self, event: object) -> None:
        """Hand ``event`` to each subscriber of its type, in order, awaiting what one returns
        before the next is called."""
        for subscriber in tuple(self._subscribers.get(type(event), ())):
            started = subscriber(event)
            if inspect.isawaitable(started):
                await started


__all__ = [
    "RECORDS_CHANGED",
    "Bus",
    "CallEnded",
    "RecordsChanged",
    "StateEntered",
    "WeightsVerified",
]
