"""The HTTP client's connections: a call safe to repeat reuses a pooled connection idle for less
than the pool's keep-alive expiry (SGLang closes idle connections after 5 s), not one idle for
longer; a call sent once never reuses one (a server that stalls past its keep-alive drops a call
written onto a kept connection: ``tests/wire/test_wire_endpoints.py``). And a call costs no
search of the import path (sniffio is installed)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rollout_lifecycle import SGLangHTTPEngine
from rollout_lifecycle.backends.http.transport import KEEPALIVE_EXPIRY_S, HTTPTransport
from rollout_lifecycle.backends.sglang.api import ENDPOINTS

#: SGLang's keep-alive: it closes a connection idle this long.
# sglang: environ.py SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt(5)
SGLANG_KEEP_ALIVE_S = 5.0


class CountingServer:
    """An HTTP/1.1 server on loopback that answers every request ``{}`` on a kept-alive
    connection and counts the connections opened to it."""

    def __init__(self) -> None:
        self.connections = 0
        #: Per request, whether it asked the server to close the connection after answering.
        self.closing: list[bool] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.closing.append(b"\r\nconnection: close\r\n" in head.lower())
                length = 0
                for line in head.decode().split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: 2\r\n\r\n{}"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_the_pool_lets_a_connection_go_well_before_sglang_closes_it() -> None:
    assert KEEPALIVE_EXPIRY_S <= SGLANG_KEEP_ALIVE_S / 2
    server = CountingServer()
    async with server as url:
        engine = SGLangHTTPEngine(url)
        try:
            assert await engine.server_info() == {}
            assert server.connections == 1
            # Idle past the expiry (the condition itself, not a race): a new connection.
            await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)
            assert await engine.server_info() == {}
            assert server.connections == 2
        finally:
            await engine.close()


def _wire(url: str) -> HTTPTransport:
    return HTTPTransport(
        url,
        "pool",
        admin_key=None,
        api_key=None,
        connect_timeout=5.0,
        retries=0,
        retry_backoff=0.1,
        transport=None,
        keepalive_expiry=60.0,
    )


async def test_a_connection_idle_for_less_than_the_expiry_is_reused() -> None:
    server = CountingServer()
    async with server as url:
        wire = _wire(url)
        try:
            for _ in range(3):
                await wire.request(ENDPOINTS["server_info"], None, 30.0)
                await asyncio.sleep(0.5)
            assert server.connections == 1
        finally:
            await wire.close()


@pytest.mark.parametrize("op", ["resume_memory_occupation", "release_memory_occupation"])
async def test_a_call_sent_once_gets_a_connection_of_its_own_every_time(op: str) -> None:
    assert not ENDPOINTS[op].repeatable
    server = CountingServer()
    async with server as url:
        wire = _wire(url)
        try:
            await wire.request(ENDPOINTS["server_info"], None, 30.0)
            for n in range(1, 4):
                await wire.request(ENDPOINTS[op], {"tags": ["kv_cache"]}, 30.0)
                assert server.connections == 1 + n  # a new one each time, none reused
            await wire.request(ENDPOINTS["server_info"], None, 30.0)
            assert server.connections == 4  # the pooled one is still there for the others
            # The server is asked to close the once-only ones (their TIME_WAIT is its own).
            assert server.closing == [False, True, True, True, False]
        finally:
            await wire.close()


async def test_a_call_finds_its_async_library_without_a_failed_import() -> None:
    # httpcore asks which async library it runs under for every lock and event of every
    # request (httpcore 1.0: ``_synchronization.current_async_library``, ``import sniffio``).
    # Without sniffio each ask is a failed import, a search of ``sys.path`` on the event loop
    # (4 to 6 per request, ~60 us each on a quiet machine, stat calls that wait for a CPU on a
    # busy one); with it, the module is imported once and stays.
    sys.modules.pop("sniffio", None)
    server = CountingServer()
    async with server as url:
        wire = _wire(url)
        try:
            await wire.request(ENDPOINTS["server_info"], None, 30.0)
        finally:
            await wire.close()
    assert "sniffio" in sys.modules, "install sniffio (a dependency of rollout-lifecycle)"
