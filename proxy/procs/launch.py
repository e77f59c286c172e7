"""Launched engines: a user's command line becomes a running engine, ready by its kind's own signal, with GPU
memory read at the moments that matter, then stopped and its memory checked back — one engine at a time.

The command (``--launch NAME='COMMAND'``) is kept verbatim. It is split like a shell would (``shlex``), leading
``NAME=VALUE`` words become the engine's environment, and ``{port}`` anywhere in it is replaced by a port free
at launch (``--port {port}``: several engines, or a relaunch, never collide). What the engine is and where it
listens come from the command line through the engine kinds' dialects (``proxy.engines``): ``llama-server``
is llama.cpp (``--host``/``--port``, default 127.0.0.1:8080), ``python -m sglang.launch_server`` and ``sglang
serve`` are SGLang (default port 30000), ``vllm serve`` and ``python -m vllm.entrypoints.openai.api_server`` are
vLLM (default port 8000). Any other command needs ``--port``; its kind is probed once the port answers (so ``python
-m fakes.sglang_emulator`` is a launched SGLang). A listen address of 0.0.0.0 / :: is reached on loopback.

Ready means every ``ready_paths`` GET of the kind answered 200: llama.cpp ``/health`` (503 while loading), SGLang
``/health`` (503 until its warm-up generation is done), vLLM ``/health`` and ``/v1/models``.

Memory moments (``MemoryReading``, per device and for the engine's processes): ``before`` launch, ``idle``
(loaded, once two readings a ``settle_s`` apart agree within 1 %, or after ``settle_timeout_s``), ``after`` stop.
The caller measures a phase with ``GpuMemory.watch`` (the bench's "peak while generating") and may put it in
``memory["peak"]``. After stop, the launcher waits (``memory_timeout_s``) until the engine's GPU processes are gone
and each device's used memory is back within ``max(256 MiB, 1 %)`` of its ``before`` reading: ``memory_returned``
says whether it came back (None without GPU readings); the next engine should start only when it is not False.

Ctrl-C or a cancelled task at any point — mid-launch included — stops the engine's whole process group before the
exception propagates (``proxy.procs.process``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy import engines
from proxy.gpu.memory import GpuMemory, MemoryReading
from proxy.procs.process import EngineProcess, LaunchError, free_port
from proxy.redact import redact_command
from proxy.types import EngineKind

PORT_PLACEHOLDER = "{port}"
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: how far a device's used memory may stay above its before-launch reading and still count as "came back"
RETURN_SLACK_BYTES = 256 * 2**20
RETURN_SLACK_RATIO = 0.01


@dataclass(frozen=True)
class LaunchSpec:
    """A launch as the user wrote it and as it will run."""

    name: str
    #: verbatim, as given (placeholders unfilled)
    command: str
    #: what runs: the command's words with ``{port}`` filled and the leading NAME=VALUE words taken out
    argv: tuple[str, ...]
    env: Mapping[str, str]
    #: where enginemeter connects (a wildcard listen address becomes loopback)
    host: str
    port: int
    #: from the command line; None: probed once the port answers
    kind: EngineKind | None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def parse_launch(name: str, command: str, *, port: Callable[[], int] = free_port) -> LaunchSpec:
    """``NAME``, ``COMMAND`` -> a ``LaunchSpec``; ``ValueError`` naming what is wrong. ``port`` picks the
    port for ``{port}``."""
    if not _NAME.match(name):
        raise ValueError(f"launch name {name!r}: use letters, digits, '.', '_' and '-'")
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"launch {name}: cannot split the command line ({exc}): {command!r}") from None
    env: dict[str, str] = {}
    while words and _ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        raise ValueError(f"launch {name}: the command has no program: {command!r}")
    if any(PORT_PLACEHOLDER in w for w in words):
        chosen = str(port())
        words = [w.replace(PORT_PLACEHOLDER, chosen) for w in words]
    kind = next((d.kind for d in engines.DIALECTS.values() if d.launched_by(words)), None)
    host, listen_port = engines.dialect(kind).listen_address(words)
    if listen_port is None:
        raise ValueError(
            f"launch {name}: cannot tell which port {words[0]!r} listens on; add --port N (or --port {{port}})"
        )
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    return LaunchSpec(name, command, tuple(words), env, host.strip("[]"), listen_port, kind)


def parse_launch_arg(arg: str, **kwargs: Any) -> LaunchSpec:
    """``NAME=COMMAND`` (the ``--launch`` flag's form) -> a ``LaunchSpec``."""
    name, sep, command = arg.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise ValueError(f"--launch takes NAME='COMMAND', got {arg!r}")
    return parse_launch(name.strip(), command.strip(), **kwargs)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Launched:
    """A launched engine: its spec and process, what was learned while it started, and its memory moments."""

    spec: LaunchSpec
    process: EngineProcess
    kind: EngineKind | None = None
    #: seconds from launch to ready
    ready_s: float | None = None
    #: "before", "idle", "after" (and "peak" where the caller watched a phase)
    memory: dict[str, MemoryReading] = field(default_factory=dict)
    memory_returned: bool | None = None
    returncode: int | None = None
    stopped: bool = False

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def record(self) -> dict[str, Any]:
        """The launch as JSON (a results line, the report's engine table)."""
        return {
            "name": self.spec.name,
            "command": redact_command(self.spec.command),
            "url": self.url,
            "kind": self.kind,
            "log": str(self.log_path),
            "ready_s": None if self.ready_s is None else round(self.ready_s, 3),
            "memory": {k: r.to_json() for k, r in self.memory.items()},
            "memory_returned": self.memory_returned,
            "returncode": self.returncode,
        }


@dataclass
class Launcher:
    """Starts and stops launched engines; logs go to ``out_dir/engines/NAME.log``."""

    out_dir: Path
    memory: GpuMemory = field(default_factory=GpuMemory)
    ready_timeout_s: float = 900.0
    grace_s: float = 30.0
    settle_s: float = 2.0
    settle_timeout_s: float = 30.0
    memory_timeout_s: float = 60.0
    cwd: Path | None = None

    def log_path(self, spec: LaunchSpec) -> Path:
        return Path(self.out_dir) / "engines" / f"{spec.name}.log"

    async def start(self, spec: LaunchSpec) -> Launched:
        """Launch ``spec`` and wait until it is ready; ``LaunchError`` (with the log's last lines) when it
        exits first or is not ready in time. On any error or cancellation the engine is stopped first."""
        if await asyncio.to_thread(_listening, spec.host, spec.port):
            raise LaunchError(
                f"{spec.name}: something already listens on {spec.host}:{spec.port}; stop it or launch with "
                "--port {port}"
            )
        before = await self.memory.aread(spec.name)
        proc = EngineProcess(
            spec.argv, log_path=self.log_path(spec), name=spec.name, command=spec.command, env=spec.env, cwd=self.cwd
        )
        eng = Launched(spec, proc, kind=spec.kind, memory={"before": before})
        proc.spawn()
        try:
            async with httpx.AsyncClient(base_url=spec.url, trust_env=False) as client:
                eng.ready_s = await proc.wait_ready_async(lambda: self._ready(eng, client), self.ready_timeout_s)
            eng.memory["idle"] = await self._settled(eng)
        except BaseException:
            eng.returncode = await proc.stop_async(self.grace_s)
            eng.stopped = True
            raise
        return eng

    async def _ready(self, eng: Launched, client: httpx.AsyncClient) -> bool:
        try:
            if eng.kind is None:
                eng.kind = await engines.detect(client, 2.0)
                if eng.kind is None:
                    return False  # it answers 503 to everything: still loading
            for path in engines.dialect(eng.kind).ready_paths:
                if (await client.get(path, timeout=10.0)).status_code != 200:
                    return False
        except httpx.HTTPError:
            return False
        return True

    async def _settled(self, eng: Launched) -> MemoryReading:
        """The engine loaded and idle: readings ``settle_s`` apart until two agree within 1 %."""
        last = await self.memory.aread(eng.spec.name, pid=eng.pid)  # NVML is open from here on
        if not last.devices:
            return last
        deadline = time.monotonic() + self.settle_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(self.settle_s)  # the settle period between readings
            now = await self.memory.aread(eng.spec.name, pid=eng.pid)
            a, b = last.engine_bytes, now.engine_bytes
            if a is not None and b is not None and abs(b - a) <= 0.01 * max(a, b, 1):
                return now
            last = now
        return last

    async def stop(self, eng: Launched) -> Launched:
        """Stop the engine's process group (SIGTERM, SIGKILL after ``grace_s``), then wait for its GPU memory."""
        if not eng.stopped:
            eng.returncode = await eng.process.stop_async(self.grace_s)
            eng.stopped = True
        eng.memory["after"], eng.memory_returned = await self._memory_back(eng)
        return eng

    async def _memory_back(self, eng: Launched) -> tuple[MemoryReading, bool | None]:
        gone = {p for r in eng.memory.values() for p in r.engine_pids}
        before = {d.index: d.used_bytes for d in eng.memory["before"].devices}
        deadline = time.monotonic() + self.memory_timeout_s
        while True:
            now = await self.memory.aread(eng.spec.name)
            if not now.devices:
                return now, None
            held = gone & await asyncio.to_thread(self.memory.gpu_pids)
            over = [d for d in now.devices if d.used_bytes > before.get(d.index, d.used_bytes) + _slack(d.total_bytes)]
            if not held and not over:
                return now, True
            if time.monotonic() >= deadline:
                return now, False
            await asyncio.sleep(0.5)  # the driver frees a context within a few seconds of the process exiting

    @contextlib.asynccontextmanager
    async def running(self, spec: LaunchSpec) -> AsyncIterator[Launched]:
        """The engine, ready, for the block's duration; stopped (and its memory checked) however it ends."""
        eng = await self.start(spec)
        try:
            yield eng
        finally:
            await asyncio.shield(self.stop(eng))


def _slack(total_bytes: int) -> int:
    return max(RETURN_SLACK_BYTES, int(RETURN_SLACK_RATIO * total_bytes))


def fit_memory_share(name: str, command: str, budget_bytes: int, total_bytes: int) -> tuple[str, str | None]:
    """A launch command whose engine's memory is a setting (SGLang ``--mem-fraction-static``, vLLM
    ``--gpu-memory-utilization``), fitted to ``budget_bytes`` on a card of ``total_bytes``: without the flag it is
    added at the share that fits (the budget less what the engine holds beyond its share, ``reserve_bytes``); a
    given share is checked — its static footprint alone over the budget is a ``ValueError`` naming the share that
    fits. Returns (the command, what was done in words; None: the engine's memory is not a setting)."""
    spec = parse_launch(name, command, port=lambda: 0)
    d = engines.dialect(spec.kind)
    flag = d.memory_share_flag
    if spec.kind is None or flag is None or total_bytes <= 0:
        return command, None
    reserve = d.reserve_bytes(budget_bytes)
    fits = int((budget_bytes - reserve) / total_bytes * 1000) / 1000
    gib = 2**30
    card = f"this {total_bytes / gib:.1f} GiB card"
    given = d.memory_share(spec.argv) if any(w == flag or w.startswith(flag + "=") for w in spec.argv) else None
    if given is None:
        if fits <= 0:
            raise ValueError(
                f"launch {name}: the {budget_bytes / gib:.1f} GiB budget leaves no share for {flag} once "
                f"~{reserve / gib:.1f} GiB is kept for what {spec.kind} holds beside it"
            )
        return (
            f"{command} {flag} {fits:g}",
            f"{name}: {flag} {fits:g} set for the {budget_bytes / gib:.1f} GiB budget on {card}: "
            f"{fits * total_bytes / gib:.1f} GiB up front (weights and KV cache) + ~{reserve / gib:.1f} GiB beside it "
            "(context, graphs, activations)",
        )
    share = given[1]
    static = share * total_bytes
    if static > budget_bytes:
        raise ValueError(
            f"launch {name}: {flag} {share:g} takes {static / gib:.1f} GiB of {card} up front, over the "
            f"{budget_bytes / gib:.1f} GiB budget: use {fits:g} (or leave the flag out: enginemeter sets it)"
        )
    if static + reserve > budget_bytes:
        return command, (
            f"{name}: {flag} {share:g} takes {static / gib:.1f} GiB up front; with ~{reserve / gib:.1f} GiB beside "
            f"it the peak may pass the {budget_bytes / gib:.1f} GiB budget (a small excess is a caveat in the "
            f"verdict): {fits:g} fits"
        )
    return command, f"{name}: {flag} {share:g} checked: {static / gib:.1f} GiB up front fits the budget on {card}"
