"""An sglang-router (the SGLang Model Gateway) that a ``RolloutServer`` keeps in step with its
fleet: a client of the router's worker API, and a launcher for tests and the demo.

The worker API of sglang-router 0.3.2 (checked against the router itself; the legacy
``/add_worker`` and ``/remove_worker`` answer 404 there):

* ``GET /workers``: ``{"workers": [{"id", "url", "is_healthy", ...}], "total", ...}``.
* ``POST /workers`` with ``{"url": ...}`` (and ``"api_key"`` for a worker that wants one):
  ``202`` and ``{"worker_id", ...}``. The worker is added by a background job that probes it
  first; until that job is done the worker is not listed (a paused worker's ``/health`` does
  not answer, so the job waits for it).
* ``POST /workers`` with ``"worker_type"`` (``"prefill"`` with ``"bootstrap_port"``, or
  ``"decode"``) registers one half of a prefill/decode pair, in either mode of the router; the
  listing names each worker's ``worker_type`` (``"regular"`` by default) and a prefill worker's
  ``bootstrap_port``. A router launched with ``--pd-disaggregation`` pairs a prefill and a
  decode worker for each request, and answers ``503`` ("No decode workers available") while it
  lists a half without the other. A second ``POST`` for a listed URL answers ``202`` and its job
  then fails ("already exists"): the first registration's type stays.
* ``DELETE /workers/{id}``: ``202``; the worker is taken out by a background job.
* With ``--control-plane-api-keys 'id:name:admin:KEY'`` every worker call needs
  ``Authorization: Bearer KEY``: ``401`` without it or with a wrong one.

Both changes are asynchronous, so ``add`` and ``remove`` wait (up to ``settle`` seconds) until
the router lists the worker healthy, or no longer lists it.

Each call opens its own connection and closes it before it returns (``add`` and ``remove`` keep
one for their whole wait): a connection belongs to the event loop that opened it, and a trainer
that runs each step in a fresh loop (``asyncio.run``) would otherwise leave one open socket
behind per step, held by a client whose loop is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_lifecycle.backends.ports import free_port
from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.contract.capabilities import WORKER_TYPES
from rollout_lifecycle.contract.exceptions import InvalidArgument, RouterError
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.contract.values import check_flag, check_seconds

#: How often ``add`` and ``remove`` look whether the router has done the change.
_POLL_S = 0.05
#: How much of an error answer goes into an exception message.
_BODY_LIMIT = 300


@dataclass(frozen=True)
class RouterWorker:
    """One worker as the router lists it: its type (``regular``, or the ``prefill`` or
    ``decode`` half of a prefill/decode pair) and a prefill worker's bootstrap port."""

    id: str
    url: str
    healthy: bool
    worker_type: str = "regular"
    bootstrap_port: int | None = None


class SGLangRouter:
    """A client of one sglang-router's worker API.

    ``url``: the router's base URL. ``api_key``: its control-plane key (``Bearer``), if it was
    started with one. ``worker_api_key``: the key the router must send to the workers (their
    ``--api-key``), if any. ``timeout``: each HTTP call. ``settle``: how long ``add`` and
    ``remove`` wait for the router's background job.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | Secret | None = None,
        worker_api_key: str | Secret | None = None,
        timeout: float = 10.0,
        settle: float = 60.0,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"router url must be an http(s) URL, got {url!r}")
        url_identity(url)  # refuses what no client could reach (a query, a bad port, ...)
        self._url = url.rstrip("/")
        self._key = as_secret(api_key, what="api_key")
        self._worker_key = as_secret(worker_api_key, what="worker_api_key")
        self._timeout = check_seconds("timeout", timeout)
        self._settle = check_seconds("settle", settle)

    def __repr__(self) -> str:
        return f"SGLangRouter({self._url!r})"

    @property
    def url(self) -> str:
        """The router's base URL."""
        return self._url

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[httpx.AsyncClient]:
        """A client for one call, closed when the call ends (see the module docstring)."""
        headers = {"Authorization": f"Bearer {self._key.reveal()}"} if self._key else {}
        async with httpx.AsyncClient(
            base_url=self._url, headers=headers, timeout=self._timeout, trust_env=False
        ) as client:
            yield client

    async def _call(
        self, client: httpx.AsyncClient, method: str, path: str, body: object = None
    ) -> Any:
        what = f"{method} {self._url}{path}"
        try:
            response = await client.request(method, path, json=body)
        except httpx.TimeoutException:
            raise RouterError(self._url, f"{what}: no answer within {self._timeout}s") from None
        except httpx.HTTPError as exc:
            raise RouterError(self._url, f"{what}: unreachable ({type(exc).__name__})") from None
        if response.status_code == 401:
            raise RouterError(
                self._url, f"{what}: 401, the router refused the control-plane key", 401
            )
        if response.status_code >= 400:
            text = response.text[:_BODY_LIMIT]
            raise RouterError(
                self._url, f"{what}: {response.status_code} {text}", response.status_code
            )
        try:
            return response.json()
        except ValueError:
            raise RouterError(
                self._url, f"{what}: answered {response.text[:_BODY_LIMIT]!r}, not JSON"
            ) from None

    async def workers(self) -> list[RouterWorker]:
        """The workers the router lists now."""
        async with self._session() as client:
            return await self._workers(client)

    async def _workers(self, client: httpx.AsyncClient) -> list[RouterWorker]:
        found = await self._call(client, "GET", "/workers")
        rows = found.get("workers") if isinstance(found, dict) else None
        if not isinstance(rows, list):
            raise RouterError(self._url, f"GET /workers answered {str(found)[:_BODY_LIMIT]!r}")
        return [
            RouterWorker(
                str(w.get("id")),
                str(w.get("url")),
                bool(w.get("is_healthy")),
                str(w.get("worker_type") or "regular"),
                port if isinstance(port := w.get("bootstrap_port"), int) else None,
            )
            for w in rows
            if isinstance(w, dict)
        ]

    async def find(self, url: str) -> RouterWorker | None:
        """The listed worker at ``url`` (``localhost`` and ``127.0.0.1`` are one host)."""
        key = url_identity(url)
        async with self._session() as client:
            return await self._find(client, key)

    async def _find(self, client: httpx.AsyncClient, key: str) -> RouterWorker | None:
        for worker in await self._workers(client):
            with contextlib.suppress(InvalidArgument):
                if url_identity(worker.url) == key:
                    return worker
        return None

    async def add(
        self, url: str, *, worker_type: str = "regular", bootstrap_port: int | None = None
    ) -> None:
        """Register the worker at ``url`` as ``worker_type`` (``regular``, or a ``prefill``
        worker with its ``bootstrap_port``, or a ``decode`` one), and wait until the router
        lists it healthy. A worker listed at ``url`` as another type is refused
        (``RouterError``): the router keeps the first registration of a URL (0.3.2 answers
        ``202`` to the second, then its job fails), so ``remove`` it first."""
        if worker_type not in WORKER_TYPES:
            types = ", ".join(WORKER_TYPES)
            raise InvalidArgument(f"worker_type must be one of {types}, got {worker_type!r}")
        key = url_identity(url)
        async with self._session() as client:
            found = await self._find(client, key)
            if found is None:
                body: dict[str, Any] = {"url": url}
                if worker_type != "regular":
                    body["worker_type"] = worker_type
                if bootstrap_port is not None:
                    body["bootstrap_port"] = bootstrap_port
                if self._worker_key is not None:
                    body["api_key"] = self._worker_key.reveal()
                await self._call(client, "POST", "/workers", body)
            elif found.worker_type != worker_type:
                raise RouterError(
                    self._url,
                    f"worker {url} is listed as {found.worker_type}, not {worker_type}: "
                    f"remove it first",
                )
            await self._wait(
                client, url, key, lambda w: w is not None and w.healthy, "listed healthy"
            )

    async def remove(self, url: str) -> None:
        """Take the worker at ``url`` out, and wait until the router no longer lists it."""
        key = url_identity(url)
        async with self._session() as client:
            worker = await self._find(client, key)
            if worker is None:
                return
            await self._call(client, "DELETE", f"/workers/{worker.id}")
            await self._wait(client, url, key, lambda w: w is None, "gone")

    async def _wait(
        self,
        client: httpx.AsyncClient,
        url: str,
        key: str,
        done: Callable[[RouterWorker | None], bool],
        what: str,
    ) -> None:
        deadline = time.monotonic() + self._settle
        while True:
            if done(await self._find(client, key)):
                return
            if time.monotonic() >= deadline:
                raise RouterError(self._url, f"worker {url} not {what} within {self._settle}s")
            await asyncio.sleep(_POLL_S)

    async def close(self) -> None:
        """Nothing to close: no connection outlives the call that opened it. Safe to call any
        number of times, from any event loop, for code that closes what it opened."""


class LaunchedRouter:
    """An sglang-router started as a child process on loopback (tests, the demo).

    Its health checks keep the router's defaults: a server bound to it takes workers out before
    it pauses them and puts them back once they serve, so the router never probes a paused
    worker (whose ``/health`` does not answer). ``worker_urls``: the workers to start with.
    ``api_key``: the control-plane key to require. ``prefill_decode``: launch it in
    prefill/decode mode (``--pd-disaggregation``). ``extra_args``: more ``sglang-router
    launch`` flags. Use as an async context manager, or ``await wait_ready()`` then ``stop()``.
    """

    def __init__(
        self,
        worker_urls: Sequence[str] = (),
        *,
        api_key: str | Secret | None = None,
        policy: str = "round_robin",
        startup_timeout: float = 60.0,
        prefill_decode: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self._key = as_secret(api_key, what="api_key")
        self._startup = check_seconds("startup_timeout", startup_timeout)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            _router_command(),
            "launch",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--prometheus-port", str(free_port()),
            "--policy", policy,
            "--log-level", "warn",
            *(["--worker-urls", *worker_urls] if worker_urls else []),
            *(["--pd-disaggregation"] if check_flag("prefill_decode", prefill_decode) else []),
            *extra_args,
        ]  # fmt: skip
        env = dict(os.environ)
        if self._key is not None:
            argv += ["--control-plane-api-keys", f"rl:rollout-lifecycle:admin:{self._key.reveal()}"]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        self._proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def client(self, **options: Any) -> SGLangRouter:
        """A client of this router (with its key)."""
        return SGLangRouter(self.url, api_key=self._key, **options)

    async def wait_ready(self) -> LaunchedRouter:
        """Wait until the router answers ``/workers`` (``RouterError`` if it exits first)."""
        deadline = time.monotonic() + self._startup
        client = self.client(timeout=2.0)
        while True:
            if self._proc.poll() is not None:
                raise RouterError(
                    self.url, f"the router exited with {self._proc.returncode}: {self.output()}"
                )
            with contextlib.suppress(RouterError):
                await client.workers()
                return self
            if time.monotonic() >= deadline:
                raise RouterError(self.url, f"not up within {self._startup}s: {self.output()}")
            await asyncio.sleep(0.1)

    def output(self) -> str:
        """The router's output so far (its last 2,000 characters)."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the router (SIGTERM, then SIGKILL after ``timeout``)."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()

    async def __aenter__(self) -> LaunchedRouter:
        return await self.wait_ready()

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()


def _router_command() -> str:
    """The ``sglang-router`` command next to this interpreter, else on the PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "sglang-router")
    found = beside if os.path.exists(beside) else shutil.which("sglang-router")
    if found is None:
        raise InvalidArgument(
            "sglang-router is not installed: pip install 'rollout-lifecycle[router]'"
        )
    return found


__all__ = ["LaunchedRouter", "RouterWorker", "SGLangRouter"]
