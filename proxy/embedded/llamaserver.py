"""Engines as processes: :class:`LlamaServer` (one ``llama-server``, ready when ``start`` returns, stopped by
process group) and :func:`start_default_engines`, the pair ``enginemeter serve`` runs when none is configured.

``LlamaServer`` only builds the command line; running it (own session, log file, readiness, stop) is
``proxy.procs.process.EngineProcess``, the one lifecycle the bench's launched engines use too.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TextIO

from proxy.embedded.build import EmbeddedError, build_llama_server
from proxy.embedded.generate import make_model
from proxy.procs.process import EngineExited, EngineProcess, LaunchError, free_port, http_status

__all__ = ["LlamaServer", "start_default_engines"]


class LlamaServer:
    """One ``llama-server`` subprocess on 127.0.0.1, ready when :meth:`start` returns.

    Command: ``llama-server -m MODEL --host HOST --port PORT -c CTX -np N -t THREADS --metrics --no-webui
    [--alias ALIAS] [EXTRA_ARGS]``; ``extra_args`` come last, so they override (``["-c", "8192"]`` works).
    ``-c`` is the total context, split across the ``-np`` slots. The engine runs in its own process group,
    its output goes to ``log_path``; ready means llama.cpp's own signal (``GET /health`` answered 200) before
    ``ready_timeout_s``. A port chosen here (``port=None``) that turns out taken is retried with another.
    Failures are ``EmbeddedError`` (with the log's last lines).
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
        self._process: EngineProcess | None = None
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
        if self._process is None:
            raise EmbeddedError("LlamaServer not started")
        return self._process.pid

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise EmbeddedError("LlamaServer not started")
        return self._log_path

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def is_running(self) -> bool:
        return self._process is not None and self._process.is_running()

    def log_tail(self, n_lines: int = 40) -> str:
        return "" if self._process is None else self._process.log_tail(n_lines)

    def __repr__(self) -> str:
        return f"LlamaServer({self.name!r}, url={self._port and self.url!r}, model={self.model.name!r})"

    # -- lifecycle
    def command(self) -> list[str]:
        """The command line for the current port."""
        assert self.binary is not None
        return [
            str(self.binary),
            *("-m", str(self.model), "--host", self.host, "--port", str(self._port)),
            *("-c", str(self.ctx_size), "-np", str(self.n_parallel), "-t", str(self.threads)),
            *("--metrics", "--no-webui"),
            *(("--alias", self.alias) if self.alias else ()),
            *self.extra_args,
        ]

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
            self.argv = self.command()
            process = self._process = EngineProcess(self.argv, log_path=self.log_path, name=self.name, env=self._env)
            try:
                process.spawn()
                self.ready_s = process.wait_ready(self._ready, self.ready_timeout_s)
                return self
            except LaunchError as exc:
                lost_port_race = isinstance(exc, EngineExited) and "bind" in process.log_tail(10).lower()
                self.stop()
                if not lost_port_race or attempt == attempts - 1:
                    raise EmbeddedError(str(exc)) from exc
            except BaseException:  # Ctrl-C mid-start: nothing is left running
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _ready(self) -> bool:
        # imported here: importing proxy.embedded needs only the standard library (the dialects import httpx)
        from proxy.engines.llamacpp import DIALECT as LLAMACPP

        return all(http_status(f"{self.url}{path}", timeout_s=2.0) == 200 for path in LLAMACPP.ready_paths)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code. Idempotent."""
        return None if self._process is None else self._process.stop(timeout_s)

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
                # -lv 4: llama.cpp logs its loader (layers offloaded, KV cache, flash attention) only at trace
                # verbosity, and `serve`'s live diagnosis reads those lines from this log
                extra_args=("-lv", "4"),
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
