"""GPU memory via NVML: a sampler thread fills a cache; a Prometheus collector reads only that cache.

Invariants:
- A scrape never calls NVML and never walks ``/proc``: ``GpuMonitor.collect`` formats the last sample. NVML can
  therefore never stall a stream or a scrape, however slow the driver is.
- No NVML library, no driver or ``collectors.gpu: false`` -> the collectors are off, one log line says why,
  ``/health`` says so, and the GPU metrics are *absent* (never zero: zero would read as an idle, empty GPU).
- A failed sample (an NVML error mid-run) drops the current-value series until the next good sample;
  ``enginemeter_gpu_sample_success`` goes to 0 and the sample age keeps growing. Peaks survive.

Attribution of GPU processes to engines (no psutil: the three ``/proc`` reads below are all we need):
the engine's root pids come from its config ``pid``, else its ``pid_file`` (re-read every sample), else, when
the engine's URL host is this machine, the processes holding a listening socket on its port
(``/proc/net/tcp{,6}`` -> socket inode -> ``/proc/*/fd``). A GPU process belongs to the engine whose root is
its nearest ancestor (itself included, ``/proc/<pid>/stat`` ppid chain), so SGLang/vLLM worker children count.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import anyio.to_thread
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.settings import EngineSettings

if TYPE_CHECKING:
    from proxy.server.app import Gateway

log = logging.getLogger("enginemeter.gpu")

PREFIX = "enginemeter"
PROC = Path("/proc")
#: how often a port-based attribution is looked up again even when its pids are still alive
REFRESH_S = 30.0


# --------------------------------------------------------------------------------------------- readings


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

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nv.nvmlShutdown()


# --------------------------------------------------------------------------------------------- /proc


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """Socket inodes of TCP sockets in LISTEN state on ``port`` (any address, IPv4 and IPv6)."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(f) < 10 or f[3] != "0A":
                continue
            if int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(f[9]))
    inodes.discard(0)
    return inodes


def pids_holding(inodes: set[int], proc: Path = PROC) -> set[int]:
    """Pids with an open fd on one of the socket ``inodes`` (processes we may not inspect are skipped)."""
    if not inodes:
        return set()
    wanted = {f"socket:[{i}]" for i in inodes}
    found: set[int] = set()
    with os.scandir(proc) as procs:
        for entry in procs:
            if entry.name.isdigit() and _holds(entry.path, wanted):
                found.add(int(entry.name))
    return found


def _holds(pid_dir: str, wanted: set[str]) -> bool:
    try:
        with os.scandir(f"{pid_dir}/fd") as fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) in wanted:
                        return True
                except OSError:
                    continue
    except OSError:
        pass
    return False


def parent_pid(pid: int, proc: Path = PROC) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..." and comm may contain spaces and parentheses
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def alive(pid: int, proc: Path = PROC) -> bool:
    return (proc / str(pid)).exists()


def read_pid_file(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine: loopback, unspecified, or an address we can bind to."""
    if host in ("localhost", "", socket.gethostname()):
        return True
    try:
        addrs = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for a in addrs:
        ip = ipaddress.ip_address(a.split("%", 1)[0])
        if ip.is_loopback or ip.is_unspecified:
            return True
        fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.bind((a, 0))  # only an address of one of our interfaces can be bound
            return True
        except OSError:
            continue
    return False


@dataclass
class _Roots:
    pids: frozenset[int] = frozenset()
    source: str = "none"  # pid | pid_file | port | none
    note: str | None = None
    looked_up: float = 0.0


class Attributor:
    """Maps GPU process pids to engine names. Used from the sampler thread only."""

    def __init__(self, engines: Sequence[EngineSettings], proc: Path = PROC, refresh_s: float = REFRESH_S) -> None:
        self.engines = list(engines)
        self.proc = proc
        self.refresh_s = refresh_s
        self.roots: dict[str, _Roots] = {e.name: _Roots() for e in self.engines}
        self._local: dict[str, bool] = {}

    def _lookup(self, e: EngineSettings, now: float) -> _Roots:
        if e.pid is not None:
            return _Roots(frozenset({e.pid}), "pid", None if alive(e.pid, self.proc) else "pid not running", now)
        if e.pid_file:
            pid = read_pid_file(e.pid_file)
            if pid is None:
                return _Roots(frozenset(), "pid_file", f"cannot read a pid from {e.pid_file}", now)
            return _Roots(frozenset({pid}), "pid_file", None if alive(pid, self.proc) else "pid not running", now)
        parts = urlsplit(e.url)
        host = parts.hostname or ""
        if e.name not in self._local:
            self._local[e.name] = is_local_host(host)
        if not self._local[e.name]:
            return _Roots(frozenset(), "none", f"{host} is not this host; set pid or pid_file", now)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        pids = pids_holding(listening_inodes(port, self.proc), self.proc)
        return _Roots(frozenset(pids), "port", None if pids else f"no local process listens on port {port}", now)

    def refresh(self, now: float | None = None) -> dict[str, _Roots]:
        now = time.monotonic() if now is None else now
        for e in self.engines:
            r = self.roots[e.name]
            stale = now - r.looked_up >= self.refresh_s or not r.pids or not all(alive(p, self.proc) for p in r.pids)
            if e.pid_file or stale:
                self.roots[e.name] = self._lookup(e, now)
        return self.roots

    def owner(self, pid: int, max_depth: int = 64) -> str | None:
        """The engine whose root pid is ``pid`` or its nearest ancestor."""
        by_pid = {p: name for name, r in self.roots.items() for p in r.pids}
        cur: int | None = pid
        for _ in range(max_depth):
            if cur is None or cur <= 0:
                return None
            if cur in by_pid:
                return by_pid[cur]
            if cur == 1:
                return None
            cur = parent_pid(cur, self.proc)
        return None


# --------------------------------------------------------------------------------------------- sampling


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
            name = attributor.owner(p.pid)
            if name is None:
                other[idx] += p.used_bytes or 0
                continue
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


Opener = Callable[[], NvmlReader]


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


def install(gw: Gateway, *, opener: Opener | None = None, proc: Path = PROC) -> GpuMonitor:
    """Extension installer: register the collector on the gateway's registry; sample during the lifespan."""
    c = gw.settings.collectors
    mon = GpuMonitor(
        gw.settings.engines, interval=c.gpu_interval, enabled=c.gpu, opener=opener or PynvmlReader, proc=proc
    )
    gw.registry.register(mon)
    gw.health_extras.append(mon.health)
    gw.lifespan_hooks.append(mon.running)
    return mon
