"""``free_port``: ports for servers that bind them later come from below the kernel's ephemeral
range, are never handed out twice in one process, and are free when handed out."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from rollout_lifecycle import free_port
from rollout_lifecycle.backends import ports


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process that has handed out no port yet (the suite's own ports stay handed out)."""
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.delenv(ports.PORTS_ENV, raising=False)
    yield


def bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_pair() -> tuple[int, int]:
    """Two adjacent ports of ``PORT_RANGE`` that nothing holds now."""
    low, high = ports.PORT_RANGE
    for port in range(low, high):
        if bindable(port) and bindable(port + 1):
            return port, port + 1
    pytest.fail(f"no two adjacent free ports in {ports.PORT_RANGE}")


def test_ports_come_from_below_the_ephemeral_range_and_never_twice(fresh: None) -> None:
    low, high = ports.PORT_RANGE
    assert high < ports._ephemeral_low()  # on this machine the range is usable as such
    handed = [free_port() for _ in range(200)]
    assert len(set(handed)) == 200
    assert all(low <= p <= high for p in handed)


def test_a_port_something_listens_on_is_not_handed_out(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = free_pair()
    monkeypatch.setattr(ports, "PORT_RANGE", (first, second))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", first))
        listener.listen()
        assert free_port() == second


def test_once_the_range_is_handed_out_the_kernel_picks_a_port_not_handed_out_before(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = free_pair()
    monkeypatch.setattr(ports, "PORT_RANGE", (first, second))
    assert {free_port(), free_port()} == {first, second}
    third = free_port()
    assert third not in (first, second) and third >= ports._ephemeral_low()
    assert bindable(third)


def test_a_range_reaching_into_the_ephemeral_one_is_cut_at_its_start(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = free_pair()
    monkeypatch.setattr(ports, "PORT_RANGE", (first, second))
    # The ephemeral range starts at ``second``: only ``first`` lies below it.
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: second)
    assert free_port() == first
    assert free_port() not in (first, second)


def test_the_environment_narrows_the_range_for_one_process(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = free_pair()
    monkeypatch.setenv(ports.PORTS_ENV, f"{first}-{second}")
    assert sorted([free_port(), free_port()]) == [first, second]
    for bad in ("21000", "21000-20000", "x-y", "80-90", "21000-70000"):
        monkeypatch.setenv(ports.PORTS_ENV, bad)
        with pytest.raises(ValueError, match="ROLLOUT_LIFECYCLE_PORTS must be LOW-HIGH") as err:
            free_port()
        assert repr(bad) in str(err.value)
