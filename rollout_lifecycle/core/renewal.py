"""Keeping a serving fleet's engines proven (``LifecycleConfig.renew_proofs``).

The pause is the one checked call of a training step that reads an engine's incarnation before
it is sent: it comes after a rollout, long after the last answer that proved the process
(``EngineRecord.proven_until``), and a serving engine's pause state cannot prove it (a new
process is not paused either). That read sits on the offload's critical path, and on a busy
server it waits behind the server's own work: SGLang 0.5.23 answers ``/server_info`` only once
its scheduler has (``http_server.server_info`` awaits
``TokenizerManager.get_internal_state``, which the scheduler answers between two steps).

``Renewal`` moves the read into the rollout. While the server is ``serving`` and no public call
runs, it reads the incarnation of every live engine every half ``proof_window``. A read that
shows the incarnation the record holds, through the handle the record still holds, proves the
process from the read's send (``EngineRecord.renewed``), exactly as an answer to a call does; so
the pause that follows finds it proven and goes out at once. A read that shows anything else
(another incarnation, no answer, an error) proves nothing and changes no record: the next
checked call reads the engine itself and takes in what it shows, as without renewal. The reads
go beside the lifecycle, like ``probe()``: no claim, no journal, no timeline entry.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterable, Mapping

from rollout_lifecycle.contract.commands import Observe
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.core.bus import StateEntered
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.runner import PhaseRunner
from rollout_lifecycle.core.states import ServerState

#: The read: the incarnation alone (on SGLang one ``/server_info``), marked as a renewal's.
RENEW = Observe(paused=False, purpose="renew", identify=True)


class Renewal:
    """Renews the proof of a server's engines while it serves (see the module)."""

    def __init__(
        self,
        name: str,
        runner: PhaseRunner,
        records: Callable[[], Iterable[EngineRecord]],
        state: Callable[[], ServerState],
        busy: Callable[[], bool],
        deadline: float,
    ) -> None:
        self._name = name
        self._runner = runner
        self._records = records
        self._state = state
        self._busy = busy
        self._deadline = deadline
        self._task: asyncio.Task[None] | None = None

    @property
    def interval(self) -> float:
        """Seconds between two rounds: half the proof window, so that a round's reads prove
        each engine past the next round."""
        return self._runner.proof_window / 2

    def entered(self, event: StateEntered) -> None:
        """The server entered a state: on ``serving``, start the rounds unless they run."""
        if event.state is ServerState.SERVING and (self._task is None or self._task.done()):
            # (made in an empty context, which the task copies: it runs inside no call, not
            # the one that entered ``serving``)
            self._task = contextvars.Context().run(
                asyncio.get_running_loop().create_task,
                self._rounds(),
                name=f"rollout-lifecycle renewal {self._name}",
            )

    async def _rounds(self) -> None:
        """A round every ``interval`` until the server leaves ``serving``; none while a public
        call runs (it reads the engines it needs itself)."""
        interval = self.interval
        while True:
            await asyncio.sleep(interval)
            if self._state() is not ServerState.SERVING:
                return
            if self._busy():
                continue
            try:
                # (every engine, each round: a proof lasts one window from a send in the past,
                # so none would outlast the next round's answer for certain)
                await self.renew()
            except Exception as exc:  # (a round that failed is skipped, never the rounds)
                logger().warning("proofs.not_renewed", server=self._name, error=repr(exc))

    async def renew(self) -> list[str]:
        """Read every live engine whose incarnation its record knows; the ids of those the
        read proved again.

        An engine of several processes is left out: every checked call reads it whatever its
        proof (``EngineRecord.expect``)."""
        due = [r for r in self._records() if _renewable(r)]
        if not due:
            return []
        sent = asyncio.get_running_loop().time()
        handles = [r.handle for r in due]
        answers = await self._runner.ask(RENEW, due, self._deadline)
        until = sent + self._runner.proof_window
        proved: list[str] = []
        for record, handle in zip(due, handles, strict=True):
            said = answers.get(record.id)
            seen = said.get("incarnation") if isinstance(said, Mapping) else None
            # (a record given another handle meanwhile, by recover(), describes another engine)
            if record.handle is handle and record.renewed(seen, until):
                proved.append(record.id)
        if len(proved) < len(due):
            left = sorted({r.id for r in due} - set(proved))
            logger().info("proofs.not_renewed", server=self._name, engines=left)
        logger().debug("proofs.renewed", server=self._name, engines=len(proved))
        return proved


def _renewable(record: EngineRecord) -> bool:
    caps = record.capabilities
    return record.alive and record.incarnation is not None and caps is not None and caps.ranks == 1
