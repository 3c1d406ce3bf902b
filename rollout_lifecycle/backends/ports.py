"""Loopback ports for the servers that the library and its users start as child processes.

A child binds its port well after the port was chosen: an SGLang server loads its model first,
which takes tens of seconds on a loaded machine. A port found with ``bind(0)`` lies in the
kernel's ephemeral range, and the kernel may hand the same port to any ``bind(0)`` or outgoing
connection in that window. Two servers launched close together can then be given one port, and
the second one exits at start-up.

``free_port`` avoids this in three ways:
- it draws from a range below the ephemeral one, which the kernel never hands out by itself;
- it never gives the same port twice in one process;
- it checks that nothing holds the port now.

SGLang 0.5.23 picks the ports its own children bind later in the same way:
``sglang/srt/utils/network.py get_free_port_below_ephemeral``, over 22000-29999. The range here
therefore ends below 22000. Ray's worker ports default to 10002-19999, so the range starts
at 20000.

Two processes that launch servers at once on one machine (two trainers, two test runs) can
still draw the same port, each in the window before its server binds it: give each its own
part of the range with ``ROLLOUT_LIFECYCLE_PORTS=LOW-HIGH`` in its environment.
"""

from __future__ import annotations

import os
import random
import socket
import threading

from rollout_lifecycle.contract.exceptions import InvalidArgument

#: Where ``free_port`` draws from: above Ray's default worker ports (10002-19999), below the
#: range SGLang draws its own children's ports from (22000-29999).
PORT_RANGE: tuple[int, int] = (20000, 21999)
#: The environment variable that narrows ``PORT_RANGE`` for one process (``LOW-HIGH``).
PORTS_ENV = "ROLLOUT_LIFECYCLE_PORTS"
#: Candidates tried per call before falling back to a port the kernel picks.
_ATTEMPTS = 64

_lock = threading.Lock()
_handed_out: set[int] = set()
_rng = random.SystemRandom()  # no state shared with seeded ``random`` users or forked children


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int]:
    """The range ``free_port`` draws from: ``PORT_RANGE``, or the one ``PORTS_ENV`` names."""
    text = os.environ.get(PORTS_ENV)
    if not text:
        return PORT_RANGE
    low_text, dash, high_text = text.partition("-")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        low = high = -1
    if not dash or not 1024 <= low <= high <= 65535:
        raise InvalidArgument(
            f"{PORTS_ENV} must be LOW-HIGH, two ports from 1024 to 65535 in order (such as "
            f"20000-20999), got {text!r}"
        )
    return low, high


def _bindable(host: str, port: int) -> bool:
    # No SO_REUSEADDR: a port with a listener, a connection or a TIME_WAIT on it counts as taken.
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` for a server that binds it later.

    Nothing is bound to the port now, and this process has not handed it out before. It comes
    from ``PORT_RANGE`` (or the part of it ``ROLLOUT_LIFECYCLE_PORTS`` names), below the
    kernel's ephemeral range. Only when no candidate there is
    free does it fall back to a port the kernel picks, which another process can still take
    before the server binds it. Raises ``OSError`` if ``host`` cannot be bound at all.
    """
    low, high = port_range()
    high = min(high, _ephemeral_low() - 1)
    with _lock:
        if high >= low:
            candidates = [p for p in range(low, high + 1) if p not in _handed_out]
            for port in _rng.sample(candidates, min(_ATTEMPTS, len(candidates))):
                if _bindable(host, port):
                    _handed_out.add(port)
                    return port
        for _ in range(_ATTEMPTS):
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host}: {_ATTEMPTS} kernel picks were all handed out before")


__all__ = ["PORT_RANGE", "free_port"]
