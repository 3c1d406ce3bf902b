"""One controller per engine: a claim on what identifies each engine, held for a whole call.

Two controllers that drive the same engines without knowing of each other (two ``ctl`` runs
with different state files, a ``ctl`` beside a training process, two containers on one host)
each keep records the other makes false; the second release of a tag kills the engine. So
every public call of a ``RolloutServer`` first *claims* each engine it drives. A claim is taken
on every key that identifies the engine: its address (``url_identity`` of its server URL, every
spelling of this machine one host) and, once the engine has answered, its incarnation (the
process: two spellings the resolver cannot tell apart, a port forward, still meet there). A key
another controller holds is refused at once with ``EngineClaimed`` naming the holder, before
anything is sent.

Claims live in a ``ClaimStore`` (the small interface a store held elsewhere, a cluster's, can
take). ``HostClaims``, the default, holds each key twice, both released by the kernel when the
process ends however it ends (SIGKILL included), so a dead controller's claim is taken over
with nothing to clean up:

- an abstract Unix socket named after the key (Linux): abstract names belong to the network
  namespace, which is exactly the set of processes that reach an engine at the same loopback
  address: every controller of the host, and containers on the host's network whatever their
  ``/tmp``. Its holder answers a connection with its pid (``SO_PEERCRED``);
- an exclusive ``flock`` on a file named after the key in the lock directory
  (``$ROLLOUT_LIFECYCLE_LOCK_DIR``, else ``<tmp>/rollout-lifecycle-locks``), which says who
  holds it, and counts the claims taken (its *epoch*). Containers share it only where they
  share that directory (a volume); elsewhere (no abstract namespace) it is the lock itself.

What claims cannot see: controllers on other hosts or in another network namespace. Against
those the checks before every call that could kill an engine still hold (``EngineHost.checked``:
a restarted engine, or one paused or continued behind the records' back, refuses the call),
but a release or resume another controller made while the engine stayed paused is not visible
to them (SGLang reports no released tags).

*Continuity.* A claim also says whether anyone else claimed an engine since this server's last
call released it (the epoch is the one it left): if not, nothing another controller did can have
changed the engine since its last answer, and the checks before the call's first commands need
not read its pause state again (``EngineRecord.unwatched``). Engines without a server URL (a
simulated engine in this process or in a Ray actor) are reachable only through this process's
handles: they are not locked, and their continuity is kept in this process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import inspect
import json
import os
import secrets
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rollout_lifecycle.contract.commands import Observe
from rollout_lifecycle.contract.exceptions import EngineClaimed, InvalidArgument
from rollout_lifecycle.contract.identity import distinguishes
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.runner import PhaseRunner, WorkerUrls

#: Where the lock files are, unless ``ROLLOUT_LIFECYCLE_LOCK_DIR`` names another directory.
LOCK_DIR_ENV = "ROLLOUT_LIFECYCLE_LOCK_DIR"
#: The prefix of the abstract socket names (Linux) that hold claims in the network namespace.
_ABSTRACT = "\0rollout-lifecycle/claim/"
#: The read that names an engine's process before its first claim.
_IDENTIFY = Observe(paused=False, purpose="identify", identify=True)


def lock_dir() -> Path:
    """The host's lock directory: ``$ROLLOUT_LIFECYCLE_LOCK_DIR``, else
    ``<tmp>/rollout-lifecycle-locks`` (made sticky and writable by all, as ``/tmp`` is, so that
    the controllers of every user on the host share it)."""
    given = os.environ.get(LOCK_DIR_ENV)
    return Path(given) if given else Path(tempfile.gettempdir()) / "rollout-lifecycle-locks"


def _fix() -> str:
    return f"set {LOCK_DIR_ENV} to a directory every controller on this host can write"


def make_lock_dir(directory: Path) -> None:
    """Make ``directory`` if missing (sticky, writable by all); ``InvalidArgument`` naming the
    setting and the fix when it cannot be made."""
    if directory.is_dir():
        return
    given = os.environ.get(LOCK_DIR_ENV)
    where = f"{LOCK_DIR_ENV}={directory}" if given else f"the lock directory {directory}"
    if directory.exists() or directory.is_symlink():
        raise InvalidArgument(f"{where} is not a directory; {_fix()}")
    try:
        directory.mkdir(parents=True)
        os.chmod(directory, 0o1777)
    except FileExistsError:
        if not directory.is_dir():
            raise InvalidArgument(f"{where} is not a directory; {_fix()}") from None
    except OSError as exc:
        why = (exc.strerror or type(exc).__name__).lower()
        raise InvalidArgument(f"{where} cannot be made ({why}); {_fix()}") from None


def key_name(key: str) -> str:
    """The name a key's lock file and socket carry."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def describe(holder: Mapping[str, Any]) -> str:
    """A holder as an error names it."""
    if holder.get("seen") == "socket":  # no lock file of it here: another lock directory
        who = f"pid {holder['pid']}" if holder.get("pid") else "a process this one cannot see"
        return f"{who} in this network namespace (another container, or another lock directory)"
    if not holder:
        return "another controller (it has not said who it is yet)"
    parts = [f"pid {holder.get('pid')} on {holder.get('host')}"] if holder.get("pid") else []
    if holder.get("server"):
        parts.append(f"server {holder['server']!r}")
    if holder.get("call"):
        parts.append(f"call {holder['call']}()")
    if holder.get("command"):
        parts.append(f"command {holder['command']!r}")
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    return ", ".join(parts) or "another controller"


class Lease(Protocol):
    """Keys held for one call."""

    #: What every command sent under the lease carries, ``[scope, epoch]`` (the engine host
    #: refuses a command whose lease is older than one it has served: ``EngineHost.fenced``);
    #: None for a store whose claims need no fence (the host's: its locks die with their holder).
    fence: list[Any] | None

    def release(self) -> None:
        """Let every key go (idempotent)."""
        ...

    def continuous(self, key: str) -> bool:
        """Whether nobody else held ``key`` between this store's previous claim of it and this
        one (False the first time)."""
        ...

    def extend(self, keys: Sequence[str]) -> Awaitable[None] | None:
        """Hold ``keys`` too; ``EngineClaimed`` (the lease unchanged) if another holds one. A
        store held elsewhere answers with an awaitable (the call's loop is not blocked)."""
        ...


class ClaimStore(Protocol):
    """Where claims are held: keys, exclusive between controllers."""

    #: Whether every controller of the cluster sees the store's claims (a store held in the
    #: cluster, ``lease.ClusterClaims``): then an engine reached by a handle any of them
    #: can hold (a Ray actor) is claimed too, by what names it (``contract.seam.identity``).
    cluster_wide: bool

    def acquire(self, keys: Sequence[str], holder: Mapping[str, Any]) -> Lease | Awaitable[Lease]:
        """Hold every key of ``keys`` for ``holder``, or none: ``EngineClaimed`` naming who holds
        the first one another holds. A store held elsewhere answers with an awaitable."""
        ...


class _Held:
    """One key held by ``HostClaims``: its socket and its lock file."""

    __slots__ = ("fd", "key", "sock")

    def __init__(self, key: str, sock: socket.socket | None, fd: int) -> None:
        self.key, self.sock, self.fd = key, sock, fd


class HostClaims:
    """Claims held on this host (see the module docstring): an abstract socket and a lock file
    per key, and the epoch each key's file had when this store last let it go."""

    cluster_wide = False

    def __init__(self, directory: Callable[[], Path] = lock_dir) -> None:
        self._directory = directory
        #: A name for this store's writes in the lock files (its epochs are its own).
        self._token = secrets.token_hex(8)
        #: The epoch this store left in each key's file when it last let the key go.
        self._left: dict[str, int] = {}

    def acquire(self, keys: Sequence[str], holder: Mapping[str, Any]) -> Lease:
        return _HostLease(self, keys, dict(holder))

    # -- one key --------------------------------------------------------------------------------

    def take(self, key: str, holder: Mapping[str, Any]) -> tuple[_Held, bool]:
        """Hold ``key``; whether nobody else held it since this store last did."""
        name = key_name(key)
        sock = _bind_abstract(name)
        if sock is False:
            found = self._holder_of(name)
            raise EngineClaimed(key, describe(found), found)
        directory = self._directory()
        make_lock_dir(directory)
        try:
            fd = _open_lock(directory / f"{name}.lock", key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                found = _read(fd).get("holder") or {}
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise InvalidArgument(
                        f"cannot lock the controller lock of engine {key} ({exc.strerror}); "
                        f"{_fix()}"
                    ) from None
                raise EngineClaimed(key, describe(found), found) from None
        except BaseException:
            if isinstance(sock, socket.socket):
                sock.close()
            raise
        written = _read(fd)
        count = written.get("epoch")
        epoch = count if isinstance(count, int) else 0
        same = written.get("owner") == self._token and self._left.get(key) == epoch
        _write(fd, {"epoch": epoch + 1, "owner": self._token, "holder": dict(holder)})
        return _Held(key, sock if isinstance(sock, socket.socket) else None, fd), same

    def give_back(self, held: _Held) -> None:
        """Let ``held`` go; its file keeps the epoch (and no holder)."""
        with contextlib.suppress(OSError, ValueError):
            epoch = int(_read(held.fd).get("epoch", 0))
            _write(held.fd, {"epoch": epoch, "owner": self._token})
            self._left[held.key] = epoch
        with contextlib.suppress(OSError):
            os.close(held.fd)  # (closing the descriptor drops its lock)
        if held.sock is not None:
            held.sock.close()

    def _holder_of(self, name: str) -> dict[str, Any]:
        """Who holds the key ``name`` (its socket is held): what its lock file says when the
        process it names is the one holding the socket (or it names no process), else the pid
        that process answers with (it locks another directory, or has not written the file
        yet).

        Read without locking the file: a prober's lock, however short, can make the holder's
        own lock of the file fail between its socket and its file, and then both are refused."""
        pid = _peer_pid(name)
        with contextlib.suppress(OSError):
            fd = os.open(self._directory() / f"{name}.lock", os.O_RDONLY)
            try:
                found = _read(fd).get("holder")
            finally:
                os.close(fd)
            # (its file is the socket's holder's when it names the same pid, or names none)
            if isinstance(found, dict) and found and found.get("pid", pid) == pid:
                return found
        return {"seen": "socket", "pid": pid}


class _HostLease:
    """The keys ``HostClaims`` holds for one call."""

    fence: list[Any] | None = None

    def __init__(self, store: HostClaims, keys: Sequence[str], holder: dict[str, Any]) -> None:
        self._store, self._holder = store, holder
        self._held: list[_Held] = []
        self._same: dict[str, bool] = {}
        self.extend(keys)

    def extend(self, keys: Sequence[str]) -> None:
        added: list[_Held] = []
        try:
            for key in sorted(set(keys) - self._same.keys()):
                held, same = self._store.take(key, self._holder)
                added.append(held)
                self._same[key] = same
        except BaseException:
            for held in added:
                self._same.pop(held.key, None)
                self._store.give_back(held)
            raise
        self._held += added

    def continuous(self, key: str) -> bool:
        return self._same.get(key, False)

    def release(self) -> None:
        held, self._held = self._held, []
        for one in held:
            self._store.give_back(one)


def _bind_abstract(name: str) -> socket.socket | bool:
    """A listening abstract socket named after a key; False when another process holds the
    name; True where there is no abstract namespace (not Linux: the lock file alone holds)."""
    if not sys.platform.startswith("linux"):
        return True
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_ABSTRACT + name)
        sock.listen(8)  # (never accepted: a prober learns the pid from the connection alone)
    except OSError as exc:
        sock.close()
        return exc.errno != errno.EADDRINUSE  # (no abstract namespace here: the file holds)
    sock.set_inheritable(False)
    return sock


def _peer_pid(name: str) -> int | None:
    """The pid of the process holding the abstract socket ``name`` (as this process's pid
    namespace numbers it; None when it cannot be seen, in another container say)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(_ABSTRACT + name)
            raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid = struct.unpack("3i", raw)[0]
    return pid if pid > 0 else None


def _open_lock(path: Path, key: str) -> int:
    """An open descriptor of a key's lock file (created, writable by all, if missing)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise InvalidArgument(
            f"cannot open the controller lock {path} of engine {key} ({exc.strerror}); {_fix()}"
        ) from None
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # (a file another user made is left as it is)
    return fd


def _read(fd: int) -> dict[str, Any]:
    """What a lock file holds (empty if nothing, or unreadable)."""
    try:
        data = os.pread(fd, 64 * 1024, 0)
        found = json.loads(data.decode()) if data else {}
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write(fd: int, content: Mapping[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(content).encode(), 0)


#: Engines reachable only through this process's handles: the server that last claimed each
#: (by the handle's identity) and how many claims it had then made (this process's epochs).
_IN_PROCESS: dict[Hashable, tuple[int, int]] = {}


class Claims:
    """The claims of one server: asks each engine its address once, claims its keys for a
    call, and tells each record whether another controller may have touched its engine since
    its last answer (``EngineRecord.unwatched``)."""

    def __init__(
        self,
        server: str,
        records: Callable[[], Iterable[EngineRecord]],
        urls: WorkerUrls,
        runner: PhaseRunner | None = None,
        deadline: float = 10.0,
        store: ClaimStore | None = None,
    ) -> None:
        self._server = server
        self._records = records
        self._urls = urls
        #: Reads the engines first met (``hold``), within ``deadline``.
        self._runner, self._deadline = runner, deadline
        self._store: ClaimStore = store if store is not None else HostClaims()
        #: This server's claims of in-process engines, counted (see ``_IN_PROCESS``).
        self._count = 0
        #: The lease of the call in progress (None between calls).
        self._lease: Lease | None = None

    async def addresses(self, records: Sequence[EngineRecord]) -> dict[str, str]:
        """The address (``url_identity``) of each of ``records`` that has one, by engine id;
        ``InvalidArgument`` when two engines are one server under two spellings."""
        urls = await self._urls.of(list(records))
        found: dict[str, str] = {}
        first: dict[str, str] = {}
        for record in records:
            url = urls.get(record.id)
            if not url:
                continue
            key = url_identity(url)
            if key in first:
                other = first[key]
                raise InvalidArgument(
                    f"engines {other} ({urls[other]}) and {record.id} ({url}) are one server, "
                    f"{key}: give each engine once"
                )
            first[key] = record.id
            found[record.id] = key
        return found

    def holder(self, call: str) -> dict[str, Any]:
        """What a claim says of its holder."""
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "server": self._server,
            "call": call,
            "command": " ".join(sys.argv[:4])[:200],
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    async def claim(self, call: str) -> Lease:
        """Claim every engine of the server for ``call`` (each by its address and, known, its
        incarnation); the lease, which releases them. ``EngineClaimed`` (nothing held) when
        another controller holds one; ``InvalidArgument`` for one engine given twice."""
        return (await self._claim(call))[0]

    async def _claim(self, call: str) -> tuple[Lease, dict[str, str]]:
        """``claim``, and the addresses it claimed by (``addresses``)."""
        records = list(self._records())
        addresses = await self.addresses(records)
        shared = self._store.cluster_wide
        keys = [_keys(addresses.get(r.id), r, shared) for r in records]
        found = self._store.acquire([k for ks in keys for k in ks], self.holder(call))
        lease = await found if inspect.isawaitable(found) else found
        self._count += 1
        # (this claim's mark, and the one the claim before it left: one pair per claim, not
        # per engine)
        before, mark = (id(self), self._count - 1), (id(self), self._count)
        for record, held in zip(records, keys, strict=True):
            if held:
                watched = all(lease.continuous(k) for k in held)
            else:
                watched = _claimed_again(record, before, mark)
            if not watched:
                record.lost_sight()
        return lease, addresses

    def _fenced(self, lease: Lease) -> Callable[[], None]:
        """Keep ``lease`` as the call's, its fence on every command the runner sends while it
        is held; what lets the lease go (and the fence with it)."""
        runner = self._runner
        self._lease = lease
        if runner is not None:
            runner.fence = lease.fence

        def release() -> None:
            if runner is not None:
                runner.fence = None
            self._lease = None
            lease.release()

        return release

    async def hold(self, call: str) -> Callable[[], None]:
        """Claim the engines for ``call`` (``claim``); what lets them go. An engine with an
        address whose process the records do not know yet is read first (a read beside the
        lifecycle, ``PhaseRunner.ask``, marked ``identify``): two engines that turn out to be
        one process are refused (``InvalidArgument``) and its incarnation is claimed too
        (``named``), so that two controllers that spell it differently meet there, before
        anything is sent."""
        lease, addresses = await self._claim(call)
        try:
            await self._identify(lease, [r for r in self._records() if r.alive], addresses)
        except BaseException:
            lease.release()
            raise
        return self._fenced(lease)

    async def _identify(
        self, lease: Lease, live: Sequence[EngineRecord], urls: Mapping[str, str]
    ) -> None:
        """Read the engines of ``live`` with an address (``urls``: ``addresses`` of them, or
        of more) whose process the records do not know yet, and claim their incarnations under
        ``lease`` (``hold``)."""
        unnamed = tuple(
            r for r in live if (r.incarnation is None or r.capabilities is None) and r.id in urls
        )
        if unnamed and self._runner is not None:
            # (a read beside the lifecycle: an engine that does not answer is the call's
            # to find, and one whose incarnation is not known is read by its first check)
            found = await self._runner.ask(_IDENTIFY, unnamed, self._deadline)
            for record in unnamed:
                answer = found.get(record.id)
                if isinstance(answer, Mapping) and isinstance(answer.get("incarnation"), str):
                    record.met(answer["incarnation"], answer.get("capabilities"))
            await self.named(lease, unnamed)

    async def admit(self, records: Sequence[EngineRecord]) -> None:
        """Claim engines joining the fleet in the call in progress (``core/membership``), as
        ``hold`` claimed the others: by address (and shared handle), then by incarnation.
        ``EngineClaimed`` when another controller holds one; the lease keeps the rest."""
        lease = self._lease
        if lease is None:
            raise RuntimeError("engines join only within a call, which holds its claims")
        addresses = await self.addresses(list(self._records()))
        shared = self._store.cluster_wide
        extended = lease.extend([k for r in records for k in _keys(addresses.get(r.id), r, shared)])
        if inspect.isawaitable(extended):
            await extended
        await self._identify(lease, [r for r in records if r.alive], addresses)

    async def named(self, lease: Lease, records: Sequence[EngineRecord]) -> None:
        """Claim the incarnations ``records`` showed for the first time under ``lease`` (their
        first contact), after refusing two engines that are one process: ``InvalidArgument``
        naming both spellings."""
        urls = await self._urls.of(list(self._records()))
        seen: dict[str, EngineRecord] = {}
        for record in self._records():
            if record.alive and distinguishes(record.incarnation):
                assert record.incarnation is not None
                other = seen.get(record.incarnation)
                if other is not None:
                    raise InvalidArgument(
                        f"engines {other.id} ({urls.get(other.id) or 'no URL'}) and {record.id} "
                        f"({urls.get(record.id) or 'no URL'}) are one server process (incarnation "
                        f"{record.incarnation}): give each engine once"
                    )
                seen[record.incarnation] = record
        extended = lease.extend(
            [f"incarnation:{r.incarnation}" for r in records if distinguishes(r.incarnation)]
        )
        if inspect.isawaitable(extended):
            await extended


def _claimed_again(record: EngineRecord, before: tuple[int, int], mark: tuple[int, int]) -> bool:
    """Whether the claim that left ``before`` (a server's id, its claim count) made the last
    claim of ``record``'s engine, reachable only through this process's handles, so that no
    other server claimed it since; the engine is marked claimed by ``mark`` now."""
    key = record.key
    same = _IN_PROCESS.get(key) == before
    _IN_PROCESS[key] = mark
    return same


def _keys(address: str | None, record: EngineRecord, shared: bool = False) -> Sequence[str]:
    """What a claim of ``record``'s engine holds: its address and, once known, its
    incarnation. An engine without an address has nothing to claim, unless the store is the
    cluster's (``shared``) and its handle names it for every process of the cluster (a Ray
    actor's id, not an object of this process): then that name."""
    if address is None:
        found = record.key
        if shared and isinstance(found, tuple) and found and found[0] != "object":
            return ["handle:" + "/".join(str(part) for part in found)]
        return ()  # (one empty tuple for every such engine, not a new list per engine per claim)
    keys = [f"address:{address}"]
    if distinguishes(record.incarnation):
        keys.append(f"incarnation:{record.incarnation}")
    return keys


__all__ = [
    "LOCK_DIR_ENV",
    "ClaimStore",
    "Claims",
    "HostClaims",
    "Lease",
    "describe",
    "key_name",
    "lock_dir",
    "make_lock_dir",
]
