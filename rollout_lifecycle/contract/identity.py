"""Engine identity: which process an engine's record describes, and when the engine disagrees.

A record is only worth acting on while the process behind the engine is the one it describes
and nobody else changed that process's state. An engine's *incarnation* names its process (for
SGLang, what ``/server_info`` says of its start-up, which no two processes share); what an
engine reports of itself (``EngineHost.observe``: the incarnation, and whether it is paused
where it can tell) is compared here with what its record expects (``EngineRecord.expect``).
Both the engine host, before a checked call, and the phase runner, reading a probe, use the
one comparison.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_lifecycle.contract.outcome import Outcome

#: Seconds within which no new process can answer at an engine's address after its process
#: answered a call: the default of ``LifecycleConfig.proof_window``, and how long the
#: simulator and the stand-in take at least to come back after a restart. A new process binds
#: the port only once it has started, and it starts only once the old one has let the port go:
#: SGLang 0.5.23 binds it after loading the model (``http_server.launch_server``: uvicorn's
#: ``Server.run`` after ``_launch_subprocesses``), vLLM 0.32 after importing itself and parsing
#: its arguments (``api_server.run_server``: ``create_server_socket`` before the engine
#: starts); both take seconds, importing the server's own modules alone (``docs/design.md``,
#: "One process, one record", with the times measured). Two seconds: a proof then outlasts one
#: phase of 10,000 in-process engines (about 0.6 s), whose checked calls need no read of their
#: own.
PROOF_WINDOW = 2.0

#: The prefix of an incarnation that names a process by its start time alone (vLLM's: the
#: Prometheus ``process_start_time_seconds``, to the clock tick), which two processes started
#: together may share: it tells a restart, not two engines apart.
COARSE = "start-time:"


def distinguishes(incarnation: str | None) -> bool:
    """Whether ``incarnation`` names one process among all (two engines showing it are one)."""
    return incarnation is not None and not incarnation.startswith(COARSE)


#: What a record expects of its engine before a checked call: its incarnation (None: not known
#: yet) and whether it is paused (None: the record does not say, or it need not be checked).
Expectation = Sequence[Any]

_RESTARTED, _CONFLICT = Outcome.RESTARTED, Outcome.CONFLICT


def paused_words(paused: bool | None) -> str:
    """A pause state as a message shows it."""
    return "paused" if paused else "serving (not paused)" if paused is not None else "unknown"


def disagreement(
    expected: Expectation, observed: Mapping[str, Any]
) -> tuple[Outcome, str, str] | None:
    """How an engine's report (``observe()``: ``incarnation``, ``paused``) disagrees with its
    record's expectation (``[incarnation, paused]``); None when nothing contradicts it.

    A different incarnation is ``RESTARTED`` (another process answers at the address); a pause
    state other than the one the record holds is ``CONFLICT``. Returns the outcome and the two
    views in words (the record's, the engine's). Unknowns on either side contradict nothing:
    an engine that cannot say whether it is paused, or a record that has not seen its engine's
    incarnation yet.
    """
    incarnation, paused = expected[0], expected[1]
    found = observed.get("incarnation")
    if incarnation is not None and found is not None and found != incarnation:
        return _RESTARTED, f"incarnation {incarnation}", f"incarnation {found}"
    reported = observed.get("paused")
    if paused is not None and reported is not None and bool(reported) != bool(paused):
        return _CONFLICT, paused_words(paused), paused_words(bool(reported))
    return None


__all__ = ["COARSE", "PROOF_WINDOW", "Expectation", "disagreement", "distinguishes", "paused_words"]
