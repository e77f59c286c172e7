"""GPU memory via NVML: a sampler thread fills a cache; a Prometheus collector reads only that cache.

Invariants:
- A scrape never calls NVML and never walks ``/proc``: ``GpuMonitor.collect`` formats the last sample. NVML can
  therefore never stall a stream or a scrape, however slow the driver is.
- No NVML library, no driver or ``collectors.gpu: false`` -> the collectors are off, one log line says why,
  ``/health`` says so, and the GPU metrics are *absent* (never zero: zero would read as an idle, empty GPU).
- A failed sample (an NVML error mid-run) drops the current-value series until the next good sample;
  ``enginemeter_gpu_sample_success`` goes to 0 and the sample age keeps growing. Peaks survive.

The readings come from ``proxy.gpu.nvml`` (the reader seam: ``opener``); GPU processes are attributed to
engines by ``proxy.gpu.attribution`` (``/proc``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.config.settings import EngineSettings
from proxy.gpu.attribution import PROC, Attributor
from proxy.gpu.nvml import DeviceReading, NvmlReader, NvmlUnavailable, Opener, PynvmlReader

log = logging.getLogger("enginemeter.gpu")

PREFIX = "enginemeter"


@dataclass(frozen=True)
class GpuSample:
    """One successful sample; replaced whole, never mutated, so the scrape thread reads it without a lock."""

    t_mono: float
    devices: tuple[DeviceReading, ...]
    #: (engine, gpu index) -> bytes, for engines whose root pids are known; None when NVML could not tell
    engine_used: Mapping[tuple[str, int], int | None]
    #: engine -> GPU pids attributed to it (all devices)
    engine_pids: Mapping[str, tuple[int, ...]]
    #: gpu index -> bytes used by compute processes attributed to no engine
    other_used: Mapping[int, int]
    #: (engine, gpu index) -> the highest engine_used seen since start
    peaks: Mapping[tuple[str, int], int]


@dataclass
class GpuStatus:
    enabled: bool = False
    reason: str | None = "not started"
    samples: int = 0
    errors: int = 0
    last_success: bool | None = None
    last_error: str | None = None
    last_ok_mono: float | None = None
    attribution: dict[str, dict[str, Any]] = field(default_factory=dict)


def sample(reader: NvmlReader, attributor: Attributor, previous_peaks: Mapping[tuple[str, int], int]) -> GpuSample:
    """Read NVML once and attribute processes. Raises whatever the reader raises."""
    devices = tuple(reader.devices())
    procs = {d.index: reader.processes(d.index) for d in devices}
    roots = attributor.refresh()
    known = [name for name, r in roots.items() if r.pids]
    engine_used: dict[tuple[str, int], int | None] = {(n, d.index): 0 for n in known for d in devices}
    engine_pids: dict[str, set[int]] = {n: set() for n in roots}
    other: dict[int, int] = {d.index: 0 for d in devices}
    for idx, plist in procs.items():
        for p in set(plist):  # NVML has been seen listing one context twice
            names = attributor.owners(p.pid)
            if not names:
                other[idx] += p.used_bytes or 0
                continue
            for name in names:
                engine_pids[name].add(p.pid)
                key = (name, idx)
                cur = engine_used.get(key, 0)
                engine_used[key] = None if cur is None or p.used_bytes is None else cur + p.used_bytes
    peaks = dict(previous_peaks)
    for key, v in engine_used.items():
        if v is not None and v > peaks.get(key, -1):
            peaks[key] = v
    return GpuSample(
        t_mono=time.monotonic(),
        devices=devices,
        engine_used=engine_used,
        engine_pids={n: tuple(sorted(p)) for n, p in engine_pids.items()},
        other_used=other,
        peaks=peaks,
    )


class GpuMonitor:
    """Owns the reader, the sampler thread and the cached sample; is itself the Prometheus collector."""

    def __init__(
        self,
        engines: Sequence[EngineSettings],
        *,
        interval: float = 2.0,
        enabled: bool = True,
        opener: Opener = PynvmlReader,
        proc: Path = PROC,
    ) -> None:
        self.interval = interval
        self.want = enabled
        self.opener = opener
        self.attributor = Attributor(engines, proc)
        self.reader: NvmlReader | None = None
        self.status = GpuStatus()
        self.current: GpuSample | None = None
        self.peaks: Mapping[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def open(self) -> bool:
        """Open NVML (blocking: call from a thread). Logs exactly one line either way."""
        if not self.want:
            self.status = GpuStatus(enabled=False, reason="disabled by configuration (collectors.gpu: false)")
            log.info("GPU collectors off: %s", self.status.reason)
            return False
        try:
            self.reader = self.opener()
        except NvmlUnavailable as exc:
            self.status = GpuStatus(enabled=False, reason=str(exc))
            log.warning("GPU collectors off: %s", exc)
            return False
        except Exception as exc:
            self.status = GpuStatus(enabled=False, reason=f"{type(exc).__name__}: {exc}")
            log.warning("GPU collectors off: %s", self.status.reason)
            return False
        self.status = GpuStatus(enabled=True, reason=None)
        log.info("GPU collectors on: NVML sampled every %.3g s", self.interval)
        return True

    def sample_once(self) -> bool:
        """Take one sample into the cache. Never raises; a failure is counted and clears current values."""
        if self.reader is None:
            return False
        st = self.status
        st.samples += 1
        try:
            s = sample(self.reader, self.attributor, self.peaks)
        except Exception as exc:
            if st.last_success is not False:
                log.warning("GPU sample failed: %s: %s", type(exc).__name__, exc)
            st.errors += 1
            st.last_success = False
            st.last_error = f"{type(exc).__name__}: {exc}"
            self.current = None
            return False
        if st.last_success is False:
            log.info("GPU sampling recovered")
        self.peaks = s.peaks
        self.current = s
        st.last_success = True
        st.last_error = None
        st.last_ok_mono = s.t_mono
        st.attribution = {
            name: {
                "source": r.source,
                "pids": sorted(r.pids),
                "gpu_pids": list(s.engine_pids.get(name, ())),
                **({"note": r.note} if r.note else {}),
            }
            for name, r in self.attributor.roots.items()
        }
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def start(self) -> None:
        if self.reader is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="enginemeter-gpu", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval))
            self._thread = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Lifespan hook: open NVML off the loop, sample in a thread, stop on exit."""
        if await anyio.to_thread.run_sync(self.open):
            self.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(self.stop)

    # ---- exposition ------------------------------------------------------------------------------

    def gpus_of(self, engine: str) -> tuple[int, ...]:
        """The GPU indices ``engine`` holds memory on in the last sample (memory unknown counts as held);
        empty without a sample or without NVML. Reads the cached sample only: never calls NVML."""
        s = self.current
        if s is None:
            return ()
        return tuple(
            sorted(i for (name, i), used in s.engine_used.items() if name == engine and (used is None or used > 0))
        )

    def describe(self) -> Iterable[Metric]:
        return []  # names vary with state; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        st = self.status
        if not st.enabled:
            return  # absent, not zero
        ok = GaugeMetricFamily(f"{PREFIX}_gpu_sample_success", "1 if the last NVML sample succeeded, else 0.")
        ok.add_metric([], 1.0 if st.last_success else 0.0)
        yield ok
        errs = CounterMetricFamily(f"{PREFIX}_gpu_sample_errors", "NVML samples that failed.")
        errs.add_metric([], st.errors)
        yield errs
        if st.last_ok_mono is not None:
            age = GaugeMetricFamily(
                f"{PREFIX}_gpu_sample_age_seconds", "Seconds since the last successful NVML sample, at scrape time."
            )
            age.add_metric([], max(0.0, time.monotonic() - st.last_ok_mono))
            yield age
        peaks = self.peaks
        if peaks:
            pk = GaugeMetricFamily(
                f"{PREFIX}_engine_gpu_memory_peak_bytes",
                "Highest GPU memory used by the engine's processes on this GPU since the proxy started.",
                labels=("engine", "gpu"),
            )
            for (eng, idx), v in sorted(peaks.items()):
                pk.add_metric([eng, str(idx)], v)
            yield pk
        s = self.current
        if s is None:
            return
        dev = ("gpu", "name")
        fams = {
            "used": GaugeMetricFamily(f"{PREFIX}_gpu_memory_used_bytes", "GPU memory in use (NVML; as nvidia-smi memory.used).", labels=dev),
            "free": GaugeMetricFamily(f"{PREFIX}_gpu_memory_free_bytes", "GPU memory free (NVML).", labels=dev),
            "total": GaugeMetricFamily(f"{PREFIX}_gpu_memory_total_bytes", "GPU memory installed (NVML).", labels=dev),
            "reserved": GaugeMetricFamily(f"{PREFIX}_gpu_memory_reserved_bytes", "GPU memory reserved by the driver (NVML v2).", labels=dev),
            "util": GaugeMetricFamily(f"{PREFIX}_gpu_utilization_ratio", "Fraction of the last driver sample period a kernel ran (0..1).", labels=dev),
            "other": GaugeMetricFamily(f"{PREFIX}_gpu_other_processes_memory_used_bytes", "GPU memory used by compute processes attributed to no engine.", labels=("gpu",)),
        }  # fmt: skip
        for d in s.devices:
            lab = [str(d.index), d.name]
            fams["used"].add_metric(lab, d.used_bytes)
            fams["free"].add_metric(lab, d.free_bytes)
            fams["total"].add_metric(lab, d.total_bytes)
            if d.reserved_bytes is not None:
                fams["reserved"].add_metric(lab, d.reserved_bytes)
            if d.utilization_ratio is not None:
                fams["util"].add_metric(lab, d.utilization_ratio)
            fams["other"].add_metric([str(d.index)], s.other_used.get(d.index, 0))
        used = GaugeMetricFamily(
            f"{PREFIX}_engine_gpu_memory_used_bytes",
            "GPU memory used by the engine's processes (its root pid and descendants) on this GPU.",
            labels=("engine", "gpu"),
        )
        for (eng, idx), maybe in sorted(s.engine_used.items()):
            if maybe is not None:
                used.add_metric([eng, str(idx)], maybe)
        nproc = GaugeMetricFamily(
            f"{PREFIX}_engine_gpu_processes",
            "GPU compute processes attributed to the engine (0: its processes hold no GPU memory or were not found).",
            labels=("engine",),
        )
        for eng, pids in sorted(s.engine_pids.items()):
            nproc.add_metric([eng], len(pids))
        yield from (f for f in fams.values() if f.samples)
        yield used
        yield nproc

    def health(self) -> dict[str, Any]:
        st = self.status
        out: dict[str, Any] = {"enabled": st.enabled}
        if not st.enabled:
            out["reason"] = st.reason
            return {"gpu": out}
        s = self.current
        out.update(
            interval_s=self.interval,
            samples=st.samples,
            errors=st.errors,
            last_sample_ok=st.last_success,
            sample_age_s=None if st.last_ok_mono is None else round(time.monotonic() - st.last_ok_mono, 3),
            devices=[
                {"index": d.index, "name": d.name, "used_bytes": d.used_bytes, "total_bytes": d.total_bytes}
                for d in (s.devices if s else ())
            ],
            engines=st.attribution,
        )
        if st.last_error:
            out["last_error"] = st.last_error
        return {"gpu": out}
