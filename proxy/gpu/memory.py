"""GPU memory at a moment: the devices' used/free/total and one engine's processes, read on demand.

The proxy's collectors sample on a timer (``proxy.gpu.monitor``); a launch or a diagnosis needs a reading *now*
(before launch, loaded and idle, peak while a phase runs, after stop). Both read through the same seams: the
NVML reader (``proxy.gpu.nvml``; ``opener`` is injectable, so tests replay recorded readings) and the
attribution of GPU processes to an engine (``proxy.gpu.attribution``: by the engine's pid and its
descendants, else by the process listening on its URL's port).

No NVML (library, driver or GPU missing) is not an error: every reading then has ``devices == ()``,
``engine_bytes is None`` and a ``note`` saying why, and ``available`` is False.
Reads block (NVML, ``/proc``): ``read`` is for threads and sync callers, ``aread``/``watch`` for an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from proxy.config.settings import EngineSettings
from proxy.gpu.attribution import Attributor
from proxy.gpu.monitor import sample
from proxy.gpu.nvml import NvmlReader, NvmlUnavailable, Opener, PynvmlReader


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    name: str
    used_bytes: int
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class MemoryReading:
    """One reading. ``engine_bytes``: the engine's processes on every GPU (None: unknown, see ``note``)."""

    t_mono: float
    devices: tuple[DeviceMemory, ...] = ()
    engine_bytes: int | None = None
    #: GPUs the engine holds memory on, and its GPU processes
    engine_gpus: tuple[int, ...] = ()
    engine_pids: tuple[int, ...] = ()
    note: str | None = None

    @property
    def device_used_bytes(self) -> int | None:
        return sum(d.used_bytes for d in self.devices) if self.devices else None

    def on_engine_gpus(self) -> tuple[DeviceMemory, ...]:
        """The devices the engine holds memory on (all of them when it holds none: where it would go)."""
        mine = tuple(d for d in self.devices if d.index in self.engine_gpus)
        return mine or self.devices

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "t_mono" and v not in (None, ())}
        out["devices"] = [asdict(d) for d in self.devices]
        return out


@dataclass
class Peak:
    """The highest readings seen while a ``watch`` ran (None: nothing known)."""

    engine_bytes: int | None = None
    device_used_bytes: int | None = None
    samples: int = 0
    last: MemoryReading | None = None

    def add(self, r: MemoryReading) -> None:
        self.samples += 1
        self.last = r
        if r.engine_bytes is not None:
            self.engine_bytes = max(r.engine_bytes, self.engine_bytes or 0)
        used = r.device_used_bytes
        if used is not None:
            self.device_used_bytes = max(used, self.device_used_bytes or 0)


@dataclass
class GpuMemory:
    """Reads GPU memory on demand; opens NVML at the first read and keeps it until ``close``."""

    #: opens the NVML reader; None: the real one (``pynvml``)
    opener: Opener | None = None
    #: /proc, for the attribution
    proc: Path = Path("/proc")
    reader: NvmlReader | None = None
    reason: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _opened: bool = False

    @property
    def available(self) -> bool:
        self._open()
        return self.reader is not None

    def _open(self) -> None:
        with self._lock:
            if self._opened:
                return
            self._opened = True
            try:
                self.reader = (self.opener or PynvmlReader)()
            except NvmlUnavailable as exc:
                self.reason = str(exc)
            except Exception as exc:  # a driver in a bad state: no GPU readings, never a crash
                self.reason = f"{type(exc).__name__}: {exc}"

    def read(self, name: str = "engine", *, pid: int | None = None, url: str | None = None) -> MemoryReading:
        """The devices now, and the memory of the engine rooted at ``pid`` (else listening on ``url``'s port)."""
        self._open()
        now = time.monotonic()
        if self.reader is None:
            return MemoryReading(now, note=f"no GPU readings: {self.reason}")
        who = EngineSettings(name=name, url=url or "http://127.0.0.1:1", pid=pid) if (pid or url) else None
        attributor = Attributor([who] if who else [], self.proc)
        try:
            with self._lock:
                s = sample(self.reader, attributor, {})
        except Exception as exc:
            return MemoryReading(now, note=f"NVML read failed: {type(exc).__name__}: {exc}")
        devices = tuple(DeviceMemory(d.index, d.name, d.used_bytes, d.free_bytes, d.total_bytes) for d in s.devices)
        if who is None:
            return MemoryReading(now, devices)
        per_gpu = {i: v for (n, i), v in s.engine_used.items() if n == name}
        roots = attributor.roots[name]
        if not roots.pids:
            return MemoryReading(now, devices, note=roots.note or "engine process not found")
        known = None if any(v is None for v in per_gpu.values()) else sum(v or 0 for v in per_gpu.values())
        return MemoryReading(
            now,
            devices,
            engine_bytes=known,
            engine_gpus=tuple(sorted(i for i, v in per_gpu.items() if v is None or v > 0)),
            engine_pids=s.engine_pids.get(name, ()),
            note=None if known is not None else "NVML cannot tell this process's memory",
        )

    def gpu_pids(self) -> set[int]:
        """Pids of every GPU compute process now (empty without NVML or when the read fails)."""
        with self._lock:
            r = self.reader
            if r is None:
                return set()
            with contextlib.suppress(Exception):
                return {p.pid for d in r.devices() for p in r.processes(d.index)}
        return set()

    async def aread(self, name: str = "engine", *, pid: int | None = None, url: str | None = None) -> MemoryReading:
        return await asyncio.to_thread(self.read, name, pid=pid, url=url)

    @contextlib.asynccontextmanager
    async def watch(
        self, name: str = "engine", *, pid: int | None = None, url: str | None = None, period_s: float = 0.5
    ) -> AsyncIterator[Peak]:
        """Sample every ``period_s`` while the block runs (a phase: generating, say); yields the ``Peak``,
        which also holds one reading taken before the block and one at its end (so a phase shorter than a period,
        or than the reading thread's turn on a busy machine, still has its two)."""
        peak = Peak()
        if not await asyncio.to_thread(lambda: self.available):  # opening NVML blocks: not on the loop
            yield peak
            return

        async def loop() -> None:
            while True:
                await asyncio.sleep(period_s)  # the sampling period
                peak.add(await self.aread(name, pid=pid, url=url))

        peak.add(await self.aread(name, pid=pid, url=url))

        task = asyncio.create_task(loop())
        try:
            yield peak
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            peak.add(await self.aread(name, pid=pid, url=url))

    def close(self) -> None:
        with self._lock:
            if self.reader is not None:
                self.reader.close()
                self.reader = None
