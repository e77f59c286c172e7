"""NVML readings: what the GPU sampler needs from the driver (``NvmlReader``) and the real reader (``pynvml``).

Called from the sampler thread only (``proxy.gpu.monitor``); tests replace the reader with recorded readings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class DeviceReading:
    index: int
    name: str
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    #: driver/firmware reservation (NVML memory v2); None where only v1 is available (then used = total - free)
    reserved_bytes: int | None = None
    #: percent of time a kernel ran over the driver's last sample period, 0..1; None when unsupported (MIG)
    utilization_ratio: float | None = None


@dataclass(frozen=True)
class ProcReading:
    pid: int
    #: None when the driver cannot tell (NVML_VALUE_NOT_AVAILABLE)
    used_bytes: int | None


class NvmlReader(Protocol):
    """What the sampler needs from NVML. Called from the sampler thread only."""

    def devices(self) -> list[DeviceReading]: ...

    def processes(self, index: int) -> list[ProcReading]: ...

    def close(self) -> None: ...


@runtime_checkable
class DriverReader(Protocol):
    """A reader that also names the driver (the real one does; recorded readers may not)."""

    def driver(self) -> tuple[str, str | None]: ...


Opener = Callable[[], NvmlReader]


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message says why (one log line, and /health)."""


def _text(v: str | bytes) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


class PynvmlReader:
    """The real reader: ``pynvml`` (package ``nvidia-ml-py``), imported lazily."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - it is a dependency, but keep the proxy alive without it
            raise NvmlUnavailable(f"pynvml is not installed ({exc})") from exc
        self._nv: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML init failed: {exc}") from exc
        try:
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        except pynvml.NVMLError as exc:
            self.close()
            raise NvmlUnavailable(f"NVML device query failed: {exc}") from exc
        if not self._handles:
            self.close()
            raise NvmlUnavailable("NVML reports no GPU")
        self._v2 = True

    def _memory(self, h: object) -> tuple[int, int, int, int | None]:
        nv = self._nv
        if self._v2:
            # v2 splits out the driver reservation, as nvidia-smi's memory.used does (v1 counts it as used)
            try:
                m = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
                return int(m.total), int(m.used), int(m.free), int(m.reserved)
            except nv.NVMLError_FunctionNotFound:
                self._v2 = False
            except nv.NVMLError_NotSupported:
                self._v2 = False
        m = nv.nvmlDeviceGetMemoryInfo(h)
        return int(m.total), int(m.used), int(m.free), None

    def devices(self) -> list[DeviceReading]:
        nv = self._nv
        out = []
        for i, h in enumerate(self._handles):
            total, used, free, reserved = self._memory(h)
            try:
                util: float | None = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            except nv.NVMLError_NotSupported:
                util = None
            out.append(DeviceReading(i, self._names[i], self._uuids[i], total, used, free, reserved, util))
        return out

    def processes(self, index: int) -> list[ProcReading]:
        procs = self._nv.nvmlDeviceGetComputeRunningProcesses(self._handles[index])
        return [ProcReading(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs]

    def driver(self) -> tuple[str, str | None]:
        """(driver version, CUDA version the driver supports, e.g. "12.8"; None when it does not say)."""
        nv = self._nv
        cuda: str | None = None
        with contextlib.suppress(Exception):
            v = int(nv.nvmlSystemGetCudaDriverVersion())
            cuda = f"{v // 1000}.{v % 1000 // 10}"
        return _text(nv.nvmlSystemGetDriverVersion()), cuda

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nv.nvmlShutdown()
