"""What the contract scenarios share: requests of a known length, requests held in flight,
deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from rollout_lifecycle.testing.sse import asse_events
from rollout_lifecycle.testing.waits import until

Kind = Literal["standin", "real"]

#: The stand-in's seconds per generated token: close to the real CPU server's 50-100 tokens/s,
#: so that "requests in flight" means the same on both.
STANDIN_TOKEN_LATENCY = 0.015
#: Deadline for a request or a control call that should answer (a generous bound, not a sleep).
CALL_TIMEOUT = 120.0


@dataclass
class Target:
    """One server under test, whichever kind it is."""

    kind: Kind
    url: str
    admin_key: str | None = None
    api_key: str | None = None
    #: The process that serves HTTP (SGLang's main process: its scheduler is a child).
    pid: int | None = None
    _exited: Callable[[float], bool] = field(repr=False, default=lambda _: False)
    _disposable: Callable[[], Target] | None = field(repr=False, default=None)
    _restart: Callable[[], object] | None = field(repr=False, default=None)
    _give_back: Callable[[], object] | None = field(repr=False, default=None)

    def headers(self, key: str | None = None) -> dict[str, str]:
        """``Authorization: Bearer KEY`` for ``key`` (by default the control key: the admin
        key when the server has one, else the api key); no header for a keyless server."""
        key = key if key is not None else (self.admin_key or self.api_key)
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    def client(self, timeout: float = CALL_TIMEOUT) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers=self.headers(), timeout=timeout, trust_env=False
        )

    def exited(self, within: float) -> bool:
        """Whether the server process has exited, waiting up to ``within`` seconds."""
        return self._exited(within)

    def disposable(self) -> Target:
        """A fresh keyless server this test may kill (stopped when the test ends)."""
        assert self._disposable is not None, "only the shared keyless target hands these out"
        return self._disposable()

    def restart(self) -> None:
        """Stop a disposable server and start a new one at the same URL; returns once it is
        ready."""
        assert self._restart is not None, "only a disposable target restarts"
        self._restart()

    def give_back(self) -> None:
        """Hand a disposable server that is as fresh as a new one (only restarted since) back
        to be the next disposable one, instead of stopping it (where its kind keeps spares)."""
        assert self._restart is not None, "only a disposable target is given back"
        if self._give_back is not None:
            self._give_back()


#: The system calls in which an event loop waits for its sockets, by machine (epoll_wait,
#: epoll_pwait, epoll_pwait2), as ``/proc/PID/syscall`` numbers them.
_EPOLL_WAITS = {"x86_64": {"232", "281", "441"}, "aarch64": {"22", "441"}}


@contextlib.asynccontextmanager
async def stopped(pid: int) -> AsyncIterator[None]:
    """The process stopped (SIGSTOP) while its event loop waits for its sockets, until the block
    ends, then continued: a server stalled for as long as the test says, while the kernel still
    takes connections and bytes for it. (Stopped in the middle of other work, a loop reads its
    sockets first when it goes on; stopped in its wait, it runs its due timers first.)"""
    waits = _EPOLL_WAITS[platform.machine()]
    for _attempt in range(100):
        await until(lambda: _syscall(pid) in waits, what=f"process {pid} to wait for events")
        os.kill(pid, signal.SIGSTOP)
        await until(lambda: _process_state(pid) == "T", what=f"process {pid} to stop")
        if _syscall(pid) in waits:
            break
        os.kill(pid, signal.SIGCONT)  # it woke up just before the stop: again
    else:
        raise AssertionError(f"process {pid} never stopped while waiting for events")
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _syscall(pid: int) -> str:
    """The number of the system call the process's main thread is blocked in (``running``)."""
    return Path(f"/proc/{pid}/syscall").read_text().split()[0]


#: Both servers' keep-alive: uvicorn closes a connection this long after its last answer.
# sglang: environ.py SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt(5); vllm: envs.py
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5
KEEP_ALIVE_S = 5.0


async def through_a_stall(target: Target, engine: Any) -> None:
    """A call the HTTP client may not repeat (an abort of nothing), sent while the server is
    stalled past the keep-alive of the connection a call safe to repeat left just before; it
    must be answered once the server goes on (``HTTPTransport`` gives it a connection of its
    own)."""
    assert target.pid is not None
    port = host_port(target)[1]
    await engine.check_version()  # leaves a kept connection, idle for less than the expiry
    answered = time.monotonic()
    async with stopped(target.pid):
        call = asyncio.ensure_future(engine.abort_request(rid="nothing-by-this-name"))
        await until(lambda: unread_bytes(port) > 0, what="the call to reach the server")
        # Stopped, not slowed: past this instant the keep-alive is due on the server.
        await asyncio.sleep(answered + KEEP_ALIVE_S + 0.5 - time.monotonic())
    await asyncio.wait_for(call, CALL_TIMEOUT)


def unread_bytes(port: int) -> int:
    """Bytes the kernel holds for the listener on loopback ``port`` that its process has not
    read (``rx_queue`` of the port's connections in ``/proc/net/tcp``)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rpartition(":")[2], 16) == port:
            total += int(fields[4].partition(":")[2], 16)
    return total


def host_port(target: Target) -> tuple[str, int]:
    """The host and port ``target`` listens on."""
    url = urlsplit(target.url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def _process_state(pid: int) -> str:
    """The state letter in ``/proc/PID/stat`` (``T``: stopped by a signal)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def gen_request(tokens: int, i: int = 0, rid: str | None = None) -> dict[str, Any]:
    """A generate request of exactly ``tokens`` new tokens (random weights: no eos)."""
    body: dict[str, Any] = {
        "input_ids": [11 + i, 23, 5 + i, 42],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }
    if rid is not None:
        body["rid"] = rid
    return body


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    answer = await client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


async def held(client: httpx.AsyncClient, url: str = "") -> int:
    """The requests the scheduler of the server at ``url`` (by default the client's) holds,
    running or waiting, from ``/v1/loads`` (a request on its way, or held before the scheduler
    by a pause, is not counted)."""
    # sglang: entrypoints/v1_loads.py get_loads; the scheduler republishes its load after every
    # prefill (scheduler.py publish_load_snapshot(force=batch.forward_mode.is_extend())).
    running, waiting = await loads(client, url)
    return running + waiting


async def loads(client: httpx.AsyncClient, url: str = "") -> tuple[int, int]:
    """The requests the scheduler runs, and those it holds waiting, from ``/v1/loads``."""
    answer = await client.get(f"{url}/v1/loads", params={"include": "core"})
    assert answer.status_code == 200, answer.text
    loads = answer.json()["loads"]
    return (
        sum(x["num_running_reqs"] for x in loads),
        sum(x["num_waiting_reqs"] for x in loads),
    )


async def running_all(
    client: httpx.AsyncClient,
    futures: Sequence[asyncio.Future[Any]],
    wanted: int,
    *,
    urls: Sequence[str] = ("",),
    deadline: float = CALL_TIMEOUT,
    every: float = 0.005,
) -> None:
    """Return once the schedulers at ``urls`` run ``wanted`` requests between them, none
    waiting, in one sweep of ``/v1/loads`` (a server republishes it after every prefill): a
    pause then finds each one decoding (a request still waiting when a retract pause comes is
    not retracted). Fails if one of ``futures`` finished first (make the requests longer)."""
    counts: list[tuple[int, int]] = []

    async def all_running() -> bool:
        assert not any(f.done() for f in futures), "a request finished before the pause"
        counts[:] = [await loads(client, url) for url in urls]
        return sum(r for r, _ in counts) >= wanted and not any(w for _, w in counts)

    try:
        await until(
            all_running,
            what=f"the servers to run {wanted} requests",
            deadline=deadline,
            every=every,
        )
    except AssertionError as error:
        raise AssertionError(f"{error}; (running, waiting) per server: {counts}") from None


async def in_flight(
    client: httpx.AsyncClient, n: int, tokens: int, *, rids: list[str] | None = None
) -> list[asyncio.Task[dict[str, Any]]]:
    """Start ``n`` generate requests and return once the scheduler runs all of them
    (``running_all``)."""
    tasks = [
        asyncio.create_task(
            generate(client, gen_request(tokens, i, None if rids is None else rids[i]))
        )
        for i in range(n)
    ]
    await running_all(client, tasks, n)
    return tasks


def finish_type(answer: dict[str, Any]) -> str:
    kind: str = answer["meta_info"]["finish_reason"]["type"]
    return kind


# ------------------------------------------------------------------ vLLM

#: The vLLM stand-in's seconds per generated token, and the tokens of a request that must be
#: seen running: short on the stand-in; on the real CPU server (~450 tokens/s) 3,000 tokens are
#: needed for a request to be seen decoding before it ends.
VLLM_STANDIN_TOKEN_LATENCY = 0.005
VLLM_TOKENS: dict[Kind, int] = {"standin": 400, "real": 3000}


@dataclass
class VLLMTarget(Target):
    """One vLLM server under test: a ``Target`` that also names a checkpoint a reload from disk
    succeeds from, and the tokens of a request long enough to be seen running."""

    model_path: str = ""

    @property
    def tokens(self) -> int:
        return VLLM_TOKENS[self.kind]


class Streamed:
    """One streamed ``/v1/completions`` request: ``decoding`` is set once its first token came
    back (the request is running in the scheduler), ``done`` holds its finish reason and the
    number of tokens it streamed."""

    def __init__(self, url: str, tokens: int, request_id: str | None = None) -> None:
        self.tokens = tokens
        self.decoding = asyncio.Event()
        body: dict[str, Any] = {
            "prompt": [1, 2, 3, 4],
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        if request_id is not None:
            body["request_id"] = request_id
        self.done: asyncio.Future[tuple[str | None, int]] = asyncio.ensure_future(
            self._run(url, body)
        )

    async def _run(self, url: str, body: dict[str, Any]) -> tuple[str | None, int]:
        count, reason = 0, None
        async with (
            httpx.AsyncClient(timeout=CALL_TIMEOUT, trust_env=False) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as answer,
        ):
            assert answer.status_code == 200, await answer.aread()
            async for event in asse_events(answer.aiter_bytes()):
                choice = event["choices"][0]
                count += len(choice.get("token_ids") or [])
                reason = choice.get("finish_reason") or reason
                if count:
                    self.decoding.set()
        return reason, count

    async def started(self) -> Streamed:
        """Return once a token has come back; fail at once if the request ended first."""
        waiting = asyncio.ensure_future(self.decoding.wait())
        await asyncio.wait(
            [waiting, self.done], timeout=CALL_TIMEOUT, return_when="FIRST_COMPLETED"
        )
        waiting.cancel()
        assert self.decoding.is_set(), f"the stream never decoded: {self.done!r}"
        assert not self.done.done(), "the request ended before the scenario began: make it longer"
        return self

    async def result(self) -> tuple[str | None, int]:
        return await asyncio.wait_for(self.done, CALL_TIMEOUT)
