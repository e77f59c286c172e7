"""Engines as processes: :class:`LlamaServer` (one ``llama-server``, ready when ``start`` returns, stopped by
process group) and :func:`start_default_engines`, the pair ``enginemeter serve`` runs when none is configured."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self, TextIO

from proxy.embedded.build import EmbeddedError, build_llama_server
from proxy.embedded.model import make_model


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out (free now; a later bind can still lose a race, so callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """HTTP status of GET ``url``; ``None`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class LlamaServer:
    """One ``llama-server`` subprocess on 127.0.0.1, ready when :meth:`start` returns.

    Command: ``llama-server -m MODEL --host HOST --port PORT -c CTX -np N -t THREADS --metrics --no-webui
    [--alias ALIAS] [EXTRA_ARGS]``; ``extra_args`` come last, so they override (``["-c", "8192"]`` works).
    ``-c`` is the total context, split across the ``-np`` slots. The engine runs in its own process group,
    its output goes to ``log_path``; ready means ``GET /health`` answered 200 before ``ready_timeout_s``.
    A port chosen here (``port=None``) that turns out taken is retried with another.
    """

    def __init__(
        self,
        model: Path | str,
        *,
        binary: Path | str | None = None,
        n_parallel: int = 1,
        ctx_size: int = 2048,
        threads: int = 1,
        alias: str | None = None,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        name: str | None = None,
        ready_timeout_s: float = 120.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = Path(model)
        self.binary = Path(binary) if binary is not None else None
        self.n_parallel = n_parallel
        self.ctx_size = ctx_size
        self.threads = threads
        self.alias = alias
        self.extra_args = tuple(extra_args)
        self.host = host
        self.name = name or f"llama-np{n_parallel}"
        self.ready_timeout_s = ready_timeout_s
        self._requested_port = port
        self._port: int | None = port
        self._env = dict(env) if env is not None else None
        self._log_path = log_path
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.ready_s: float | None = None  # seconds from spawn to the first 200 from /health

    # -- what callers read
    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedError("LlamaServer not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise EmbeddedError("LlamaServer not started")
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise EmbeddedError("LlamaServer not started")
        return self._log_path

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n_lines: int = 40) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-n_lines:])

    def __repr__(self) -> str:
        return f"LlamaServer({self.name!r}, url={self._port and self.url!r}, model={self.model.name!r})"

    # -- lifecycle
    def start(self) -> Self:
        if self.is_running():
            return self
        if self.binary is None:
            self.binary = build_llama_server()
        if not self.model.is_file():
            raise EmbeddedError(f"model file {self.model} does not exist")
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        attempts = 3 if self._requested_port is None else 1
        for attempt in range(attempts):
            self._port = self._requested_port or free_port(self.host)
            try:
                self._spawn_and_wait()
                return self
            except EmbeddedError:
                lost_port_race = "bind" in self.log_tail(10).lower() and self._proc is not None
                self.stop()
                if not lost_port_race or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _spawn_and_wait(self) -> None:
        assert self.binary is not None
        self.argv = [
            str(self.binary),
            *("-m", str(self.model), "--host", self.host, "--port", str(self._port)),
            *("-c", str(self.ctx_size), "-np", str(self.n_parallel), "-t", str(self.threads)),
            *("--metrics", "--no-webui"),
            *(("--alias", self.alias) if self.alias else ()),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by this object, closed in stop()
        self._log = log
        log.write(("\n+ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() signals the group, Ctrl-C in a shell doesn't
            env={**os.environ, **self._env} if self._env is not None else None,
        )
        deadline = t0 + self.ready_timeout_s
        health = f"{self.url}/health"
        while True:
            if http_status(health, timeout_s=2.0) == 200:
                self.ready_s = time.monotonic() - t0
                return
            if time.monotonic() >= deadline:
                raise EmbeddedError(
                    f"{self.name}: /health not 200 within {self.ready_timeout_s:g} s; log {self.log_path}:\n"
                    + self.log_tail()
                )
            try:  # the poll interval; returns early if the engine dies
                rc = self._proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                continue
            raise EmbeddedError(f"{self.name}: llama-server exited with {rc}; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code. Idempotent."""
        proc = self._proc
        rc: int | None = None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            rc = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_default_engines(
    workdir: Path,
    *,
    n: int = 2,
    log: TextIO | None = None,
    alias: str = "tiny",
    ctx_per_slot: int = 2048,
    threads: int = 1,
) -> list[LlamaServer]:
    """Start ``n`` engines on the tiny qwen2 model, engine ``i`` with ``-np i+1`` and nothing else changed.

    ``-c`` is ``ctx_per_slot * np`` so every slot has the same context. All serve ``alias``; logs go to
    ``workdir/engine-<i>-np<k>.log``. The binary is built on first use (minutes); the model is cached.
    If any engine fails to start, the ones already running are stopped before the error propagates.
    """
    log = log or sys.stderr
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    binary = build_llama_server(log=log)
    model = make_model(log=log)
    engines: list[LlamaServer] = []
    try:
        for i in range(n):
            np_ = i + 1
            engine = LlamaServer(
                model,
                binary=binary,
                n_parallel=np_,
                ctx_size=ctx_per_slot * np_,
                threads=threads,
                alias=alias,
                log_path=workdir / f"engine-{i}-np{np_}.log",
                name=f"np{np_}",
            )
            engines.append(engine)
            engine.start()
            print(f"embedded: engine {engine.name} at {engine.url} (log {engine.log_path})", file=log, flush=True)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines
