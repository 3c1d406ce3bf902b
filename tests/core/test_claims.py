"""Engine claims (``core/claims.py``) in this process: a claim locks the address of every engine
that has one until released, another claimant is refused naming the holder and keeps nothing
it had locked, the lock files and their directory, and engines without an address.

Claims between servers driving stand-in servers, and across processes (a claim dies with its
process), are ``tests/system/test_claims_between_controllers.py``'s.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
from core.loopback import loopback

from rollout_lifecycle import (
    EngineClaimed,
    EngineGroup,
    InvalidArgument,
    RolloutServer,
    SimulatedEngine,
)
from rollout_lifecycle.backends.engine import incarnation_of
from rollout_lifecycle.contract.identity import COARSE
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.core.claims import LOCK_DIR_ENV, Claims, HostClaims, describe, lock_dir
from rollout_lifecycle.core.ledger import EngineRecord

A, B = loopback(1), loopback(2)


@pytest.fixture(autouse=True)
def locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own lock directory (the host-wide one by default)."""
    directory = tmp_path / "locks"
    monkeypatch.setenv(LOCK_DIR_ENV, str(directory))
    return directory


def mode(path: Path) -> int | None:
    """The permission bits of ``path``; None if there is nothing there."""
    return stat.S_IMODE(path.stat().st_mode) if path.exists() else None


def lock_files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


class Addresses:
    """Each engine's worker URL, as ``WorkerUrls`` answers it (None: it has none)."""

    def __init__(self, urls: dict[str, str | None]) -> None:
        self.urls = urls

    async def of(self, records: Sequence[EngineRecord]) -> dict[str, str | None]:
        return {r.id: self.urls[r.id] for r in records}


def claims(server: str, *urls: str | None) -> Claims:
    """The claims of a server whose engines ``actor/<i>`` are at ``urls``."""
    records = [EngineRecord(f"actor/{i}", "actor", None) for i in range(len(urls))]
    addresses = Addresses({r.id: url for r, url in zip(records, urls, strict=True)})
    return Claims(server, lambda: records, addresses)  # type: ignore[arg-type]


async def test_a_claim_holds_every_address_until_it_is_released() -> None:
    lease = await claims("trainer", A, B).claim("offload")
    # the same engine, spelled another way: one address
    for spelling in ("localhost", "127.1", "2130706433", "0x7f000001"):
        other = claims("operator", A.replace("127.0.0.1", spelling))
        with pytest.raises(EngineClaimed) as refused:
            await other.claim("pause")
        error = refused.value
        assert error.engine == f"address:{url_identity(A)}"
        assert (error.details["server"], error.details["call"]) == ("trainer", "offload")
        assert error.details["pid"] == os.getpid()
        assert f"pid {os.getpid()} on " in error.holder and "server 'trainer'" in error.holder
    lease.release()
    again = await other.claim("pause")  # free once released
    again.release()


async def test_a_claim_in_another_lock_directory_is_refused_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two containers on one host network, each with its own /tmp: the abstract socket of the
    # network namespace is shared, whatever the directory.
    lease = await claims("trainer", A).claim("offload")
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "another"))
    with pytest.raises(EngineClaimed) as refused:
        await claims("operator", A).claim("pause")
    # what it can tell of the holder without its lock file: the pid its socket answers with
    assert refused.value.details == {"seen": "socket", "pid": os.getpid()}
    assert f"pid {os.getpid()} in this network namespace" in refused.value.holder
    lease.release()
    (await claims("operator", A).claim("pause")).release()


async def test_a_refused_claim_keeps_none_of_the_addresses_it_had_locked() -> None:
    lease = await claims("first", B).claim("pause")
    with pytest.raises(EngineClaimed, match="server 'first'"):
        await claims("second", A, B).claim("offload")  # A is locked first (sorted), then B
    only_a = await claims("third", A).claim("offload")  # A was let go
    only_a.release()
    lease.release()


async def test_the_lock_file_says_who_holds_it_and_keeps_only_the_count_on_release(
    locks: Path,
) -> None:
    lease = await claims("trainer", A).claim("onload")
    (name,) = lock_files(locks)
    written = json.loads((locks / name).read_text())
    holder = written["holder"]
    assert (holder["server"], holder["call"], holder["pid"]) == ("trainer", "onload", os.getpid())
    assert describe(holder).startswith(f"pid {os.getpid()} on {holder['host']}, ")
    lease.release()
    left = json.loads((locks / name).read_text())
    assert "holder" not in left  # a later claimant reads no stale holder
    assert left["epoch"] == written["epoch"] == 1  # claims taken so far
    assert lock_files(locks) == [name]  # the file stays, for the next claim


async def test_a_claim_tells_whether_anyone_else_claimed_since_this_store_did() -> None:
    store = HostClaims()
    first = store.acquire(["address:x"], {"server": "trainer"})
    assert not first.continuous("address:x")  # (never held before)
    first.release()
    second = store.acquire(["address:x"], {"server": "trainer"})
    assert second.continuous("address:x")  # nobody between
    second.release()
    HostClaims().acquire(["address:x"], {"server": "operator"}).release()  # someone else
    third = store.acquire(["address:x"], {"server": "trainer"})
    assert not third.continuous("address:x")
    third.release()


async def test_an_incarnation_is_claimed_whatever_address_reaches_it() -> None:
    # Two spellings no resolver tells apart (a port forward): one process, one claim.
    store, other = HostClaims(), HostClaims()
    lease = store.acquire(["address:http://a:1", "incarnation:abc"], {"server": "trainer"})
    with pytest.raises(EngineClaimed, match="server 'trainer'"):
        other.acquire(["address:http://b:2", "incarnation:abc"], {"server": "operator"})
    later = other.acquire(["address:http://b:2"], {"server": "operator"})  # (not named yet)
    with pytest.raises(EngineClaimed):
        later.extend(["incarnation:abc"])  # named at first contact: refused there
    later.release()
    lease.release()


async def test_engines_without_an_address_are_not_claimed(locks: Path) -> None:
    lease = await claims("first", None, A, None).claim("pause")
    assert len(lock_files(locks)) == 1
    second = await claims("second", None).claim("pause")  # nothing to contend for
    second.release()
    lease.release()


async def test_one_server_given_twice_under_two_spellings_is_refused_naming_both() -> None:
    other = A.replace("127.0.0.1", "localhost")
    with pytest.raises(
        InvalidArgument, match=rf"actor/0 \({A}\) and actor/1 \({other}\) are one server"
    ):
        await claims("trainer", A, other).claim("pause")


async def test_simulated_engines_without_an_address_are_not_claimed(locks: Path) -> None:
    engines = [SimulatedEngine(f"e{i}", token_latency=0.001) for i in range(2)]
    first = RolloutServer([EngineGroup("actor", engines)], name="first")
    await first.pause()
    await first.resume()
    assert lock_files(locks) == []


def test_a_holder_is_described_by_what_it_wrote() -> None:
    assert describe({}) == "another controller (it has not said who it is yet)"
    assert describe({"pid": 7, "host": "h"}) == "pid 7 on h"
    full = {
        "pid": 7,
        "host": "h",
        "server": "trainer",
        "call": "offload",
        "command": "ctl offload",
        "since": "2026-01-01T00:00:00Z",
    }
    assert describe(full) == (
        "pid 7 on h, server 'trainer', call offload(), command 'ctl offload', "
        "since 2026-01-01T00:00:00Z"
    )


async def test_the_lock_directory_is_made_for_every_user_of_the_host(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert lock_dir() == locks and mode(locks) is None
    (await claims("trainer", A).claim("pause")).release()
    assert mode(locks) == 0o1777  # sticky and writable by all, as /tmp
    monkeypatch.delenv(LOCK_DIR_ENV)
    assert lock_dir() == Path(tempfile.gettempdir()) / "rollout-lifecycle-locks"


async def test_a_lock_directory_that_cannot_hold_files_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv(LOCK_DIR_ENV, str(not_a_directory))
    with pytest.raises(
        InvalidArgument, match=f"{LOCK_DIR_ENV}=.* is not a directory; set {LOCK_DIR_ENV}"
    ):
        await claims("trainer", A).claim("pause")
    under = not_a_directory / "locks"
    monkeypatch.setenv(LOCK_DIR_ENV, str(under))
    with pytest.raises(
        InvalidArgument, match=f"{LOCK_DIR_ENV}={under} cannot be made \\(not a dir"
    ):
        await claims("trainer", A).claim("pause")


async def test_two_engines_showing_one_process_are_refused_unless_its_name_is_coarse() -> None:
    records = [EngineRecord(f"actor/{i}", "actor", None) for i in range(2)]
    addresses = Addresses({"actor/0": A, "actor/1": B})  # (a port forward, say)
    server = Claims("trainer", lambda: records, addresses)  # type: ignore[arg-type]
    lease = await server.claim("pause")
    try:
        for record in records:
            record.incarnation = "ab12"  # both showed this process at first contact
        with pytest.raises(InvalidArgument, match=rf"actor/0 \({A}\) and actor/1 \({B}\) are one"):
            await server.named(lease, records)
        # vLLM names a process by its start time, to the clock tick: two started together may
        # share it, so it tells nothing of two engines (and claims nothing)
        coarse = incarnation_of({"startup_time": "1764400000.12"})
        assert coarse is not None and coarse.startswith(COARSE)
        assert not incarnation_of({"startup_time": "1", "random_seed": 7}).startswith(COARSE)
        for record in records:
            record.incarnation = coarse
        await server.named(lease, records)
        other = HostClaims().acquire([f"incarnation:{coarse}"], {"server": "operator"})
        other.release()
    finally:
        lease.release()


async def test_a_refused_claimant_takes_no_lock_the_holder_could_meet(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claimant refused at a key's socket reads who holds it without locking its file: a
    lock of its, however short, could meet the holder's own lock of the file, taken just after
    its socket, and refuse the holder too (both refused: seen once in a race of two
    controllers)."""
    lease = await claims("trainer", A).claim("offload")
    taken: list[int] = []
    real = fcntl.flock

    def watched(fd: int, op: int) -> None:
        taken.append(op)
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", watched)
    with pytest.raises(EngineClaimed) as refused:
        await claims("operator", A).claim("pause")
    assert taken == []
    assert refused.value.details["server"] == "trainer"  # (the file names the holder)
    lease.release()
