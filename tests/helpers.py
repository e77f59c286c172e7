"""Shared test helpers: real sockets, real processes, deadlines instead of sleeps.

- :func:`wait_until`: poll a predicate until it is truthy or a deadline passes (then :class:`WaitTimeout`,
  a ``TimeoutError``). Polling is how tests wait; a fixed sleep never is.
- :func:`run_uvicorn_app`: a real uvicorn server in a background thread on a pre-bound 127.0.0.1 socket
  (the pattern of uvicorn's own test helper ``run_server``), yielding its base URL.
- :class:`ProcessServer`: a ``python -m MODULE ...`` subprocess serving HTTP, ready once a URL answers.
- :class:`LlamaServerFactory`: the type of the ``llama_server_factory`` fixture (tests/conftest.py).
- :func:`start_proxy` / :class:`ProxyUnderTest`: the proxy under test, fully wired (``build_app``) on a real
  socket; :class:`ProxyFactory` is the type of the ``proxy_factory`` fixture that starts one per call.
- :func:`uncommented`: a shipped file with one of its commented-out recipes switched on, as its comment says.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, TypeVar

import httpx
from prometheus_client import CollectorRegistry

from proxy.config.settings import Settings
from proxy.procs.process import EngineProcess, free_port, http_status
from proxy.server.record.result import Result

if TYPE_CHECKING:
    from proxy.embedded import LlamaServer
    from proxy.gpu.nvml import Opener
    from proxy.server.app import Gateway

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent


class LlamaServerFactory(Protocol):
    """``llama_server_factory(model=None, np=1, alias="tiny", extra_args=(), ctx_size=2048, threads=1, **kw)``."""

    def __call__(
        self,
        model: Path | None = None,
        np: int = 1,
        alias: str | None = "tiny",
        extra_args: Sequence[str] = (),
        ctx_size: int = 2048,
        threads: int = 1,
        **kwargs: Any,
    ) -> LlamaServer: ...


class WaitTimeout(TimeoutError):
    """A :func:`wait_until` deadline passed with the predicate still falsy."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.01,
    *,
    message: str = "",
    ignore: tuple[type[BaseException], ...] = (Exception,),
) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy; return that value.

    Raises :class:`WaitTimeout` after ``timeout`` s (the predicate is always tried at least once and once
    more at the deadline). Exceptions listed in ``ignore`` count as falsy: by default every ``Exception``,
    since what is polled is often not up yet (``httpx.ConnectError``); the last one is in the timeout
    message. Pass ``ignore=()`` to let any exception propagate at once.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise WaitTimeout(f"not true within {timeout:g} s: {what} (last: {last!r})")
        time.sleep(interval)  # the poll interval, bounded by the deadline above


def start_vllm_emulator(backend: str, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """``python -m fakes.vllm_emulator --backend BACKEND FLAGS`` on a free port, from the repository: the process
    (its output piped) and its URL. :func:`vllm_emulator` when the test needs it serving."""
    port = free_port()
    argv = [sys.executable, "-m", "fakes.vllm_emulator", "--backend", backend, *flags]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def vllm_emulator(backend: str, *flags: str) -> Iterator[str]:
    """The vLLM emulator serving (``/health`` 200; its output in the failure when it exits first); its URL."""
    proc, url = start_vllm_emulator(backend, *flags)

    def up() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        return httpx.get(url + "/health", timeout=1).status_code == 200

    try:
        wait_until(up, 60, 0.2, message="the vLLM emulator did not start", ignore=(httpx.HTTPError,))
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=15)


@contextlib.contextmanager
def run_uvicorn_app(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    factory: bool = False,
    lifespan: Literal["auto", "on", "off"] = "on",
    startup_timeout: float = 10.0,
    shutdown_timeout: float = 10.0,
    **config: Any,
) -> Iterator[str]:
    """Serve ``app`` (an ASGI app, or a ``"module:attr"`` import string; ``factory=True`` if it names a
    factory) with a real uvicorn server in a daemon thread; yield ``http://127.0.0.1:PORT``.

    The socket (``port``, default any free one) is bound here and handed to uvicorn, so there is no window
    in which the port can be taken.
    Startup failure (the lifespan raising, say) raises here. On exit the server is asked to stop
    (``should_exit``), given ``shutdown_timeout`` s, then forced (``force_exit``); extra keyword arguments
    go to ``uvicorn.Config``.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port or 0))
    port = int(sock.getsockname()[1])
    config.setdefault("log_level", "warning")
    config.setdefault("access_log", False)
    config.setdefault("timeout_graceful_shutdown", 5)
    cfg = uvicorn.Config(app, host=host, port=port, lifespan=lifespan, factory=factory, **config)
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    try:
        wait_until(
            lambda: server.started or not thread.is_alive(),
            timeout=startup_timeout,
            message=f"uvicorn on port {port} to start",
        )
        if not server.started:
            raise RuntimeError(f"uvicorn on port {port} exited during startup (see the log output above)")
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=shutdown_timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout=shutdown_timeout)
        sock.close()


class ProcessServer:
    """``python -m MODULE ARGS...`` serving HTTP on 127.0.0.1; a context manager, ready on ``__enter__``.

    ``"{port}"`` inside ``args`` is replaced by the chosen port; without one, ``--port PORT`` is appended.
    The repo root is put on ``PYTHONPATH`` (so ``fakes...`` modules run). Ready means ``GET
    url + ready_path`` answered with a status in ``ready_status`` (any status if ``None``) before
    ``startup_timeout``; dying first raises with the log tail. Output goes to ``log_path``.
    The process is a ``proxy.procs.process.EngineProcess`` (own process group; :meth:`stop` sends SIGTERM, then
    SIGKILL after ``stop_timeout``), so the fixtures run processes the way the product does. ``wrapper`` is a
    command the interpreter runs under (``("prlimit", "--nofile=1024:1024")``: a hard open-file limit).
    """

    def __init__(
        self,
        module: str,
        *args: str,
        port: int | None = None,
        ready_path: str = "/",
        ready_status: Container[int] | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        log_path: Path | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args_ = [a.replace("{port}", str(self.port)) for a in args]
        if not any("{port}" in a for a in args):
            args_ += ["--port", str(self.port)]
        self.argv = [*wrapper, sys.executable, "-m", module, *args_]
        self.ready_path = ready_path
        self.ready_status = ready_status
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {"PYTHONPATH": pythonpath, **(env or {})}
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{module.rsplit('.', 1)[-1]}-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self.process = EngineProcess(self.argv, log_path=log_path, name=module, env=self.env, cwd=REPO)

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self) -> Self:
        def ready() -> bool:
            status = http_status(self.url + self.ready_path)
            return status is not None and (self.ready_status is None or status in self.ready_status)

        try:
            self.process.spawn()
            self.process.wait_ready(ready, self.startup_timeout, interval_s=0.02)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int | None:
        return self.process.stop(self.stop_timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@dataclass
class ProxyUnderTest:
    """The real proxy (``proxy.server.compose.build_app``) on a real uvicorn socket: its gateway, registry and Results."""

    url: str
    registry: CollectorRegistry
    gateway: Gateway
    #: a kept-alive client with ``base_url=url`` (each bare ``httpx.post`` builds a TLS context: ~50 ms)
    client: httpx.Client
    results: list[Result] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def total(self, name: str, **labels: str) -> float:
        """Sum over every sample of ``name`` whose labels include ``labels``."""
        return sum(
            s.value
            for metric in self.registry.collect()
            for s in metric.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def wait_results(self, n: int, timeout: float = 10.0) -> list[Result]:
        wait_until(lambda: len(self.results) >= n, timeout=timeout)
        return self.results

    def of(self, role: str, engine: str | None = None) -> list[Result]:
        """The Results so far of ``role`` (and ``engine``)."""
        return [r for r in list(self.results) if r.role == role and (engine is None or r.engine == engine)]


class ProxyFactory(Protocol):
    """The ``proxy_factory`` fixture (tests/conftest.py): ``proxy_factory(settings, nvml=None)``."""

    def __call__(
        self, settings: Settings, *, nvml: Opener | None = None, http: str | None = None
    ) -> ProxyUnderTest: ...


def start_proxy(
    stack: contextlib.ExitStack, settings: Settings, *, nvml: Opener | None = None, http: str | None = None
) -> ProxyUnderTest:
    """Serve ``build_app(settings)`` until ``stack`` closes; every Result lands in ``.results``.

    ``nvml`` opens the GPU sampler's NVML reader (recorded readings); default: the real one. ``http``: another
    uvicorn protocol (``"h11"``) instead of the production one, where the relay cannot reach the client's socket.
    """
    from proxy.server.compose import build_app
    from proxy.server.workers.guard import server_options

    registry = CollectorRegistry()
    app = build_app(settings, registry=registry, nvml=nvml)
    gateway: Gateway = app.state.gateway
    # the production connection limits (proxy.server.workers.guard), as ``enginemeter serve`` runs it, telling the app's
    # loop watch of each request head
    options = server_options(loop_watch=gateway.loop_watch) if http is None else {"http": http}
    url = stack.enter_context(run_uvicorn_app(app, **options))
    client = stack.enter_context(httpx.Client(base_url=url, timeout=30))
    p = ProxyUnderTest(url=url, registry=registry, gateway=gateway, client=client)
    gateway.attempts.observers.append(p.results.append)
    return p


def uncommented(text: str, first: str) -> str:
    """``text`` with the commented block that starts with the line ``# {first}`` uncommented (the block: that line
    and the commented lines after it indented deeper)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"# {first}")
    indent = lines[start].index("#")
    out = lines[:start]
    i = start
    while i < len(lines) and lines[i].strip().startswith("#") and lines[i].index("#") == indent:
        body = lines[i][indent + 2 :]
        if i > start and not body.startswith(" "):
            break
        out.append(" " * indent + body)
        i += 1
    return "\n".join(out + lines[i:]) + "\n"
