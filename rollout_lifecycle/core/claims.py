"""One controller per engine: a host-wide lock per engine address, held for a whole call.

Two controllers that drive the same engines without knowing of each other (two ``ctl`` runs
with different state files, a ``ctl`` beside a training process) each keep records the other
makes false; the second release of a tag kills the engine. So every public call of a
``RolloutServer`` first *claims* each engine it drives: an exclusive ``flock`` on a file named
after the engine's address (``url_identity`` of its server URL), in a directory every process on
the host shares. A claim that another process (or another server in this one) holds is refused
at once with ``EngineClaimed``, naming the holder; the kernel drops a lock when its process
dies, however it dies, so a dead controller's claim is taken over by the next one with nothing
to clean up.

What it cannot see: controllers on other hosts, or with another lock directory. There the
checks before every call that could kill an engine still hold (``EngineHost.checked``): a
restarted engine, or one paused or continued behind the records' back, refuses the call; a
release or resume that another controller made and the records miss is not visible to them
(SGLang reports no released tags), so run every controller of a fleet on one host.

Engines without a server URL (a simulated engine in this process or in a Ray actor) are only
reachable through this process's handles and are not claimed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rollout_lifecycle.contract.exceptions import EngineClaimed, InvalidArgument
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.runner import WorkerUrls

#: Where the lock files are, unless ``ROLLOUT_LIFECYCLE_LOCK_DIR`` names another directory.
LOCK_DIR_ENV = "ROLLOUT_LIFECYCLE_LOCK_DIR"


def lock_dir() -> Path:
    """The host's lock directory: ``$ROLLOUT_LIFECYCLE_LOCK_DIR``, else
    ``<tmp>/rollout-lifecycle-locks`` (made sticky and writable by all, as ``/tmp`` is, so that
    the controllers of every user on the host share it)."""
    given = os.environ.get(LOCK_DIR_ENV)
    return Path(given) if given else Path(tempfile.gettempdir()) / "rollout-lifecycle-locks"


def _open_lock(directory: Path, key: str) -> int:
    """An open descriptor of ``key``'s lock file (created, writable by all, if missing)."""
    if not directory.exists():
        with contextlib.suppress(FileExistsError):
            directory.mkdir(parents=True)
            os.chmod(directory, 0o1777)
    name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"
    path = directory / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot open the controller lock {path} of engine {key} ({exc.strerror}); set "
            f"{LOCK_DIR_ENV} to a directory every controller on this host can write"
        ) from None
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # (a file another user made is left as it is)
    return fd


def _holder(fd: int) -> dict[str, Any]:
    """What the holder of a lock wrote into it (empty if it has not yet, or cannot be read)."""
    try:
        data = os.pread(fd, 64 * 1024, 0)
        found = json.loads(data.decode()) if data else {}
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def describe(holder: dict[str, Any]) -> str:
    """A holder as an error names it."""
    if not holder:
        return "another controller (it has not said who it is yet)"
    parts = [f"pid {holder.get('pid')} on {holder.get('host')}"]
    if holder.get("server"):
        parts.append(f"server {holder['server']!r}")
    if holder.get("call"):
        parts.append(f"call {holder['call']}()")
    if holder.get("command"):
        parts.append(f"command {holder['command']!r}")
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    return ", ".join(parts)


class Claims:
    """The claims of one server: asks each engine its address once, locks them for a call."""

    def __init__(
        self, server: str, records: Callable[[], Iterable[EngineRecord]], urls: WorkerUrls
    ) -> None:
        self._server = server
        self._records = records
        self._urls = urls

    async def _keys(self) -> list[str]:
        """The addresses (``url_identity``) of the engines that have one, sorted."""
        urls = await self._urls.of(list(self._records()))
        return sorted({url_identity(u) for u in urls.values() if u})

    async def claim(self, call: str) -> Callable[[], None]:
        """Lock every engine of the server that has an address, for ``call``; returns what
        releases them. ``EngineClaimed`` (nothing locked) when another controller holds one."""
        keys = await self._keys()
        held: list[int] = []
        try:
            directory = lock_dir()
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "server": self._server,
                "call": call,
                "command": " ".join(sys.argv[:4])[:200],
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            text = json.dumps(holder).encode()
            for key in keys:
                fd = _open_lock(directory, key)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    found = _holder(fd)
                    os.close(fd)
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    raise EngineClaimed(key, describe(found), found) from None
                held.append(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, text, 0)
        except BaseException:
            _release(held)
            raise
        return lambda: _release(held)


def _release(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # (closing the descriptor drops its lock)


__all__ = ["LOCK_DIR_ENV", "Claims", "describe", "lock_dir"]
