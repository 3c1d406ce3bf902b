"""``core/parts.py``: the clients of a server's ledger and runner (phases, recovery) hold the
server's own parts, not copies."""

from __future__ import annotations

from rollout_lifecycle import EngineGroup, RolloutServer, SimulatedEngine
from rollout_lifecycle.core.parts import Client


def test_the_servers_clients_share_its_one_fleet_runner_and_versions() -> None:
    """Phases and recovery are ``Client``s of the server's own parts: one fleet of records, one
    runner, one expected version (a copy would let their views of the engines drift)."""
    server = RolloutServer([EngineGroup("actor", [SimulatedEngine(), SimulatedEngine()])])
    clients = [server._phases, server._recovery]  # the wiring under test
    assert all(isinstance(c, Client) for c in clients)
    for client in clients:
        assert client._fleet is server.fleet
        assert client._runner is server._runner
        assert client._versions is server._versions
        assert client._state() is server.state
