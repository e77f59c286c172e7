"""GPU memory while a cell repeat runs, per engine where anything can tell.

Sources, best first: a launched engine's own processes (``ProcessMemory``: NVML through the launcher's pid
attribution, ``proxy.gpu.memory``), the proxy's ``/metrics`` per-engine gauges
(``enginemeter_engine_gpu_memory_used_bytes`` then ``..._peak_bytes``: the proxy attributes GPU processes to
engines through /proc), then its device gauge, then NVML locally (whole device, read through the seam tests
replay: ``proxy.gpu.nvml``, ``opener``). Only a per-engine source can judge "memory fits"; a device-wide reading
includes whatever else runs on that GPU (the other engine too), and the verdict says so instead of judging.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from proxy.gpu.memory import GpuMemory
from proxy.gpu.nvml import NvmlReader, Opener, PynvmlReader
from proxy.gpu.scraped import PROCESS, read_memory


class MemorySource(Protocol):
    """Where a cell repeat's GPU memory peak comes from (``sample_record`` reads the last three)."""

    source: str
    gpus: dict[str, tuple[int, ...]]
    total_bytes: int | None

    def watch(
        self, client: httpx.AsyncClient | None, engine: str
    ) -> AbstractAsyncContextManager[dict[str, int | None]]: ...


class MemoryProbe:
    """Polls GPU memory while a cell repeat runs; ``box["peak"]`` is the highest reading (None: unknown)."""

    gpus: dict[str, tuple[int, ...]]
    total_bytes: int | None

    def __init__(self, metrics_url: str | None, opener: Opener = PynvmlReader) -> None:
        self.metrics_url = metrics_url
        self.source = "unknown"
        self.gpus = {}
        self.total_bytes = None
        self._nvml: NvmlReader | None = None
        if metrics_url is None:
            try:
                self._nvml = opener()  # NvmlUnavailable without a GPU
                self.source = "NVML (whole device)"
            except Exception:  # no driver, no GPU: memory stays unknown
                self._nvml = None

    def _nvml_used(self) -> tuple[int, int]:
        """(used, total) over every device; used is total - free (NVML's v1 figure: the driver's reservation
        counts as used), as this source has always read it."""
        assert self._nvml is not None
        devices = self._nvml.devices()
        return sum(d.total_bytes - d.free_bytes for d in devices), sum(d.total_bytes for d in devices)

    async def read(self, client: httpx.AsyncClient | None, engine: str) -> int | None:
        if self.metrics_url and client is not None:
            try:
                r = await client.get(self.metrics_url, timeout=5)
            except httpx.HTTPError:
                return None
            m = read_memory(r.text, engine)
            self.source = m.source
            if m.gpus:
                self.gpus[engine] = m.gpus
            self.total_bytes = m.total_bytes or self.total_bytes
            return m.used_bytes
        if self._nvml is not None:
            try:
                used, self.total_bytes = await asyncio.to_thread(self._nvml_used)
                return used
            except Exception:
                return None
        return None

    @contextlib.asynccontextmanager
    async def watch(
        self, client: httpx.AsyncClient | None, engine: str, period_s: float = 0.5
    ) -> AsyncIterator[dict[str, int | None]]:
        box: dict[str, int | None] = {"peak": None}

        async def loop() -> None:
            while True:
                v = await self.read(client, engine)
                if v is not None:
                    box["peak"] = max(v, box["peak"] or 0)
                await asyncio.sleep(period_s)  # sampling period, not synchronisation

        if self.metrics_url is None and self._nvml is None:
            yield box
            return
        task = asyncio.create_task(loop())
        try:
            yield box
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            v = await self.read(client, engine)
            if v is not None:
                box["peak"] = max(v, box["peak"] or 0)


@dataclass
class ProcessMemory:
    """A launched engine's processes on the GPU, read through NVML by its pid while each repeat runs; ``peak``
    keeps the highest reading of the whole run on it (the launch's "peak while generating")."""

    memory: GpuMemory
    name: str
    pid: int
    period_s: float = 0.5
    source: str = PROCESS
    gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)
    total_bytes: int | None = None
    peak_bytes: int | None = None
    peak_device_bytes: int | None = None

    @contextlib.asynccontextmanager
    async def watch(self, client: httpx.AsyncClient | None, engine: str) -> AsyncIterator[dict[str, int | None]]:
        box: dict[str, int | None] = {"peak": None}
        async with self.memory.watch(self.name, pid=self.pid, period_s=self.period_s) as peak:
            yield box
        box["peak"] = peak.engine_bytes
        if peak.engine_bytes is not None:
            self.peak_bytes = max(peak.engine_bytes, self.peak_bytes or 0)
        if peak.device_used_bytes is not None:
            self.peak_device_bytes = max(peak.device_used_bytes, self.peak_device_bytes or 0)
        last = peak.last
        if last is not None and last.engine_gpus:
            self.gpus[engine] = last.engine_gpus
            self.total_bytes = sum(d.total_bytes for d in last.on_engine_gpus()) or None
        if last is None or not last.devices:
            self.source = "unknown"
