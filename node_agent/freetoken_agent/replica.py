"""Engine lifecycle: one ``freetoken serve`` subprocess per assigned model.

``Replica.run()`` is a supervisor task: start the engine, poll ``/health``, mark it ready,
and restart it with exponential backoff when the process exits or stops answering. The
backoff resets once an engine has stayed ready for ``stable_seconds``. ``Replica.stop()``
sends SIGTERM, then SIGKILL after ``stop_timeout``. Engines die with the agent (Linux
parent-death signal), so a killed agent never leaves orphans holding VRAM.

A ``source.url`` model is fetched into the agent's model store before the first start (and
a ``source.path`` file with a ``sha256`` checked), in a thread, while the replica is ``starting``
with a message that counts the bytes (fetch.py); a fetch that fails is retried with the same
backoff, resuming its download.

States (``FreeTokenNode.status.replicas[].state``): starting -> ready -> (failed -> starting)*
-> stopped. Only the supervisor task mutates a replica; other tasks read its fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from .assignments import Assignment
from .engine_api import CacheInfo, EngineClient, EngineUnreachable
from .fetch import FetchError, FetchStopped, UrlSource, check_file, fetch, gigabytes, redact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchConfig:
    """How engines are started and supervised (shared by every replica of an agent)."""

    engine_command: tuple[str, ...]
    bind_host: str = "127.0.0.1"
    address: str = "127.0.0.1"  # how others reach the engine (endpoint URL)
    port_offset: int = 0
    log_dir: str | None = None
    health_interval: float = 1.0
    start_timeout: float = 900.0
    failure_threshold: int = 3
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    admin_token: str | None = None  # None: a fresh random token per engine
    stable_seconds: float = 60.0
    stop_timeout: float = 15.0
    model_store: str | None = None   # where source.url models are downloaded (None: url sources fail)
    refused_retry: float = 900.0     # the wait after a download that came whole and was refused

    def __post_init__(self) -> None:
        if not self.engine_command:
            raise ValueError("engine_command must not be empty")
        if self.health_interval <= 0 or self.backoff_initial <= 0:
            raise ValueError("health_interval and backoff_initial must be > 0")
        if self.backoff_max < self.backoff_initial:
            raise ValueError("backoff_max must be >= backoff_initial")
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")


FETCH_LOG_SECONDS = 30.0     # a download's progress is logged this often


def backoff_delay(failures_in_a_row: int, initial: float, maximum: float) -> float:
    """Seconds to wait before restart number ``failures_in_a_row`` (1-based): 1, 2, 4, ... max."""
    return min(maximum, initial * (2 ** max(0, failures_in_a_row - 1)))


def serve_command(a: Assignment, launch: LaunchConfig, cpu_expert_fraction: float | None,
                  model_path: str | None = None) -> list[str]:
    """The ``freetoken serve`` command line for one replica (docs/contracts.md); its secrets go
    through ``serve_env``, never the command line (which ``ps`` shows to every local user).

    The engine starts with a one-expert cache: it refuses a start size larger than the model
    (which the agent cannot know before loading), whereas ``POST /admin/cache`` clamps. The
    budget is applied once the engine is ready (``Replica._became_ready``). ``model_path``: where
    a fetched ``source.url`` model lies (default: the assignment's ``path``)."""
    cmd = [*launch.engine_command, "serve", "--host", launch.bind_host,
           "--port", str(a.port + launch.port_offset), "--served-model-name", a.served_name,
           "--device", a.engine.device]
    model = model_path if model_path is not None else a.path
    if model is not None:
        cmd += ["--model", model]
    if a.engine.dtype:
        cmd += ["--dtype", a.engine.dtype]
    if a.engine.context_length is not None:
        cmd += ["--max-context", str(a.engine.context_length)]
    if a.engine.decode_pause_ms is not None:
        cmd += ["--decode-pause-ms", f"{a.engine.decode_pause_ms:g}"]
    if a.engine.prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(a.engine.prefill_chunk)]
    if a.engine.state_checkpoints is not None:
        cmd += ["--state-checkpoints", str(a.engine.state_checkpoints)]
    if a.engine.speculative_tokens is not None:
        cmd += ["--speculative-tokens", str(a.engine.speculative_tokens)]
    if a.engine.speculative_method != "ngram":   # the engine's default; sent only when it differs
        cmd += ["--speculative-method", a.engine.speculative_method]
    cmd += ["--expert-cache-experts", "1"]
    if cpu_expert_fraction is not None:
        cmd += ["--cpu-expert-fraction", f"{cpu_expert_fraction:.4f}"]
    return cmd


def serve_env(admin_token: str, api_key: str | None) -> dict[str, str]:
    """The engine's environment: the agent's, plus its admin token and API key (the engine reads
    ``FREETOKEN_ADMIN_TOKEN`` / ``FREETOKEN_API_KEY``); an inherited key is never passed on."""
    env = {k: v for k, v in os.environ.items() if k not in ("FREETOKEN_API_KEY", "FREETOKEN_ADMIN_TOKEN")}
    env["FREETOKEN_ADMIN_TOKEN"] = admin_token
    if api_key:
        env["FREETOKEN_API_KEY"] = api_key
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Replica:
    """One assigned model and the engine process serving it."""

    def __init__(self, assignment: Assignment, launch: LaunchConfig, *,
                 api_key: str | None = None,
                 launch_args: Callable[[Assignment], tuple[int | None, float | None]] = lambda a: (None, None),
                 on_ready: Callable[["Replica"], Awaitable[None]] | None = None,
                 on_restart: Callable[["Replica"], None] | None = None) -> None:
        self.assignment = assignment
        self.launch = launch
        self.api_key = api_key          # the key the next start gets (the agent updates it on rotation)
        self.started_key = api_key      # the key the running engine has
        self.admin_token = launch.admin_token or secrets.token_urlsafe(24)
        self.port = assignment.port + launch.port_offset
        self.endpoint = f"http://{url_host(launch.address)}:{self.port}"
        self.client = EngineClient(f"http://{url_host(_loopback_for(launch.bind_host))}:{self.port}",
                                   self.admin_token)
        self.state = "starting"
        self.message = ""
        self.fetched: tuple[int, int | None] | None = None   # (bytes so far, size) while fetching
        self.restarts = 0
        self.pid: int | None = None
        self.cache: CacheInfo | None = None
        self.resize_lock = asyncio.Lock()
        self._launch_args = launch_args
        self._on_ready = on_ready
        self._on_restart = on_restart
        self._proc: asyncio.subprocess.Process | None = None
        self._budget: int | None = None
        self._stopping = asyncio.Event()
        self._stop_fetch = threading.Event()     # the same, for a fetch running in a thread
        self._task: asyncio.Task | None = None

    @property
    def key(self) -> str:
        return self.assignment.key

    @property
    def serving(self) -> bool:
        """Ready and not being stopped: the only state in which its cache may be resized."""
        return self.state == "ready" and not self._stopping.is_set()

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"replica:{self.key}")

    async def _model_path(self) -> str | None:
        """The model the engine loads: a ``source.url`` fetched into the store first, a
        ``source.path`` file checked against its ``sha256``. Raises FetchError / FetchStopped."""
        a = self.assignment
        if a.url is not None:
            if self.launch.model_store is None:
                raise FetchError("this agent has no model store for source.url (--model-store)")
            where, logged = redact(a.url), time.monotonic()

            def progress(done: int, total: int | None) -> None:     # the fetch's thread: single stores
                nonlocal logged
                self.fetched = (done, total)
                self.message = f"fetching {gigabytes(done)} of {gigabytes(total)} GB from {where}"
                if time.monotonic() - logged >= FETCH_LOG_SECONDS:
                    logged = time.monotonic()
                    log.info("replica %s: %s", self.key, self.message)
            self.message = f"fetching {where}"
            try:
                path = await asyncio.to_thread(fetch, UrlSource(a.url, a.sha256), self.launch.model_store,
                                               progress=progress, stop=self._stop_fetch)
            finally:
                self.fetched = None
            self.message = ""
            return path
        if a.sha256 is not None and a.path is not None:
            self.message = f"checking the sha256 of {a.path}"
            await asyncio.to_thread(check_file, a.path, a.sha256, self._stop_fetch)
            self.message = ""
        return a.path

    async def _spawn(self, model_path: str | None) -> asyncio.subprocess.Process:
        self._budget, cpu_fraction = self._launch_args(self.assignment)
        cmd = serve_command(self.assignment, self.launch, cpu_fraction, model_path)
        self.started_key = self.api_key
        out = None
        if self.launch.log_dir:
            os.makedirs(self.launch.log_dir, exist_ok=True)
            out = open(os.path.join(self.launch.log_dir, f"{self.key}.log"), "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=out, env=serve_env(self.admin_token, self.api_key),
                stderr=asyncio.subprocess.STDOUT if out else None, preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()
        log.info("started engine %s pid %d on port %d", self.key, proc.pid, self.port)
        return proc

    async def _watch(self, proc: asyncio.subprocess.Process) -> tuple[str, float | None]:
        """Supervise until the engine dies or stops answering; (reason, seconds it was ready)."""
        started, ready_at, failures = time.monotonic(), None, 0
        while not self._stopping.is_set():
            if proc.returncode is not None:
                break
            try:
                code, body = await self.client.health()
                ok = code == 200 and body.get("status") == "ok"
                if code == 503 and body.get("status") == "error":
                    return f"engine error: {body.get('error')}", _since(ready_at)
            except EngineUnreachable:
                ok = False
            if ok:
                failures = 0
                if ready_at is None:
                    ready_at = time.monotonic()
                    await self._became_ready()
            elif ready_at is not None:
                failures += 1
                if failures >= self.launch.failure_threshold:
                    return f"{failures} health checks failed", _since(ready_at)
            elif time.monotonic() - started > self.launch.start_timeout:
                return f"not healthy after {self.launch.start_timeout:.0f} s", None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.launch.health_interval)
        if proc.returncode is not None:
            return f"engine exited with code {proc.returncode}", _since(ready_at)
        return "stopped", _since(ready_at)

    async def _became_ready(self) -> None:
        try:
            async with self.resize_lock:
                self.cache = await self.client.cache()
                if self._budget:  # the engine clamps to [min_experts, max_experts]
                    self.cache = await self.client.resize(self._budget)
        except EngineUnreachable as exc:
            log.warning("engine %s: %s", self.key, exc)
        if self._on_ready is not None:
            await self._on_ready(self)
        self.state, self.message = "ready", ""

    async def _start_once(self) -> tuple[str, float | None, bool]:
        """Fetch the model if needed, start the engine, supervise it: (why it ended, seconds
        ready, whether a download came whole and was refused)."""
        try:
            model_path = await self._model_path()
        except FetchStopped:
            return "stopped", None, False
        except FetchError as exc:
            return str(exc), None, exc.refused
        try:
            self._proc = await self._spawn(model_path)
        except OSError as exc:
            return f"cannot start engine: {exc}", None, False
        self.pid = self._proc.pid
        try:
            return (*await self._watch(self._proc), False)
        finally:
            await self._terminate()

    async def run(self) -> None:
        failures_in_a_row = 0
        while not self._stopping.is_set():
            self.state, self.cache = "starting", None
            reason, ready_for, refused = await self._start_once()
            if self._stopping.is_set():
                break
            if ready_for is not None and ready_for >= self.launch.stable_seconds:
                failures_in_a_row = 0
            failures_in_a_row += 1
            self.state, self.message, self.cache = "failed", reason, None
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart(self)
            delay = backoff_delay(failures_in_a_row, self.launch.backoff_initial, self.launch.backoff_max)
            if refused:      # the next try would download the same bytes again: not so soon
                delay = max(delay, self.launch.refused_retry)
                self.message = f"{reason} (tried again in {delay / 60:.0f} min, or when the model's source changes)"
            log.warning("engine %s: %s; restarting in %.1f s", self.key, reason, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
        self.state, self.cache = "stopped", None

    async def _terminate(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.launch.stop_timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def stop(self) -> None:
        """Stop supervising and end the engine; returns once the process is gone."""
        self._stopping.set()
        self._stop_fetch.set()
        if self._task is not None:
            await self._task
        else:
            await self._terminate()
        self.state = "stopped"
        await self.client.aclose()


def _since(t: float | None) -> float | None:
    return None if t is None else time.monotonic() - t


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _loopback_for(bind_host: str) -> str:
    """The agent talks to its engines locally: a wildcard bind is reached over loopback."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host
