"""The live diagnosis: for every llama.cpp engine running on this machine (the embedded ones included), what
``enginemeter diagnose`` learns from its process, log and model file (``proxy.diagnosis``), in ``/health``
(``diagnosis``) and as metrics; plus each engine's GPU headroom from the GPU sampler. docs/diagnose.md.

Invariants:
- The gathering runs in a task of its own (HTTP: ``/props``) and a thread (``/proc``, the log, the GGUF header);
  it is repeated only when the engine's process changes (checked every ``interval``), and a scrape or
  ``/health`` only formats the last result. GPU figures come from the GPU sampler's cached sample (never NVML).
- A fact nobody can tell is absent, never zero: an engine on another host, of another kind, or whose log has
  no loader lines (llama.cpp logs them at ``-lv 4``) has no layer series.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.core import GaugeMetricFamily, Metric

from proxy.diagnosis import Diagnosis, find_process, gather, with_gpu
from proxy.gpu.attribution import is_local_host, read_pid_file
from proxy.gpu.memory import DeviceMemory, MemoryReading
from proxy.gpu.monitor import GpuMonitor
from proxy.server.record.tasks import held
from proxy.server.request.upstream import Engine

log = logging.getLogger("enginemeter.diagnosis")

PREFIX = "enginemeter"
#: seconds between checks that an engine's process is still the one diagnosed
INTERVAL_S = 30.0


class LiveDiagnosis:
    """Diagnoses local llama.cpp engines; is the Prometheus collector and ``/health`` section for it."""

    def __init__(self, engines: Mapping[str, Engine], gpu: GpuMonitor | None, *, interval: float = INTERVAL_S):
        self.engines = engines
        self.gpu = gpu
        self.interval = interval
        #: engine -> its last diagnosis (replaced whole: the scrape thread reads it without a lock)
        self.results: dict[str, Diagnosis] = {}
        self._local: dict[str, bool] = {}

    def _candidate(self, engine: Engine) -> bool:
        if engine.kind != "llamacpp":
            return False
        if engine.name not in self._local:
            self._local[engine.name] = is_local_host(urlsplit(engine.settings.url).hostname or "")
        return self._local[engine.name]

    def _pid(self, engine: Engine) -> int | None:
        s = engine.settings
        if s.pid is not None:
            return s.pid
        if s.pid_file:
            return read_pid_file(s.pid_file)
        return find_process(s.url).pid

    async def refresh(self, engine: Engine) -> None:
        """Diagnose ``engine`` again if its process is not the one diagnosed last. Never raises."""
        if not self._candidate(engine):
            return
        pid = await asyncio.to_thread(self._pid, engine)
        last = self.results.get(engine.name)
        # an engine served from inside this process (a test's stand-in) is not a llama-server to diagnose
        if pid is None or pid == os.getpid() or (last is not None and last.process.pid == pid):
            return
        t0 = time.monotonic()
        try:
            d = await gather(engine.settings.url, name=engine.name, kind="llamacpp", pid=pid, client=engine.client)
        except Exception:
            log.exception("diagnosis of engine %s failed", engine.name)
            return
        self.results = {**self.results, engine.name: d}
        s = d.started
        log.info(
            "engine %s diagnosed in %.2f s: layers %s/%s on the GPU, weights %s B, KV cache %s B, load %s s%s",
            engine.name,
            time.monotonic() - t0,
            s.layers_offloaded,
            s.layers_total,
            d.shape.weights_bytes if d.shape else None,
            kv_bytes(d),
            s.load_s,
            f" ({'; '.join(d.notes)})" if d.notes else "",
        )

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            for e in list(self.engines.values()):
                await self.refresh(e)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held for the app's lifetime."""
        return held(self.run)

    # ---- GPU figures from the sampler's cache ----------------------------------------------------------

    def _reading(self, name: str) -> MemoryReading | None:
        s = self.gpu.current if self.gpu is not None else None
        if s is None:
            return None
        devices = tuple(DeviceMemory(d.index, d.name, d.used_bytes, d.free_bytes, d.total_bytes) for d in s.devices)
        per_gpu = {i: v for (n, i), v in s.engine_used.items() if n == name}
        if not per_gpu:
            return MemoryReading(s.t_mono, devices)
        known = None if any(v is None for v in per_gpu.values()) else sum(v or 0 for v in per_gpu.values())
        gpus = tuple(sorted(i for i, v in per_gpu.items() if v is None or v > 0))
        return MemoryReading(s.t_mono, devices, known, gpus, s.engine_pids.get(name, ()))

    def headroom(self, name: str) -> int | None:
        """Free memory on the GPUs the engine holds memory on (None: it holds none, or no sample)."""
        r = self._reading(name)
        if r is None or not r.engine_gpus:
            return None
        return sum(d.free_bytes for d in r.devices if d.index in r.engine_gpus)

    # ---- exposition ------------------------------------------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        e = ("engine",)
        fams = {
            "offloaded": GaugeMetricFamily(f"{PREFIX}_engine_layers_offloaded", "Layers llama.cpp put on the GPU (its log: offloaded N/M layers to GPU).", labels=e),
            "layers": GaugeMetricFamily(f"{PREFIX}_engine_layers", "Layers llama.cpp can offload, the output layer included (the M of offloaded N/M).", labels=e),
            "weights": GaugeMetricFamily(f"{PREFIX}_engine_weights_bytes", "Size of the engine's model weights (the GGUF header's tensor data).", labels=e),
            "kv": GaugeMetricFamily(f"{PREFIX}_engine_kv_cache_bytes", "KV cache the engine allocated (its log; else the formula from the model's shape and context).", labels=e),
            "load": GaugeMetricFamily(f"{PREFIX}_engine_load_seconds", "Seconds the engine took to load its model (its log's timestamps).", labels=e),
            "headroom": GaugeMetricFamily(f"{PREFIX}_engine_gpu_headroom_bytes", "Free memory on the GPUs the engine's processes hold memory on (last NVML sample).", labels=e),
        }  # fmt: skip
        for name, d in self.results.items():
            s = d.started
            for key, v in (
                ("offloaded", s.layers_offloaded),
                ("layers", s.layers_total),
                ("load", s.load_s),
                ("weights", d.shape.weights_bytes if d.shape else None),
                ("kv", kv_bytes(d)),
            ):
                if v is not None:
                    fams[key].add_metric([name], v)
        for name in self.engines:
            room = self.headroom(name)
            if room is not None:
                fams["headroom"].add_metric([name], room)
        yield from (f for f in fams.values() if f.samples)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, d in self.results.items():
            j = with_gpu(d, self._reading(name))
            s = d.started
            out[name] = {
                k: v
                for k, v in {
                    "pid": d.process.pid,
                    "log": d.log_path,
                    "flags": d.flags or None,
                    "layers_offloaded": s.layers_offloaded,
                    "layers_total": s.layers_total,
                    "load_s": s.load_s,
                    "weights_bytes": d.shape.weights_bytes if d.shape else None,
                    "kv_cache_bytes": kv_bytes(d),
                    "kv_formula": d.kv.formula if d.kv else None,
                    "flash_attention": s.flash_attention,
                    "resident": j.resident.value if j.resident else None,
                    "resident_why": j.resident.why if j.resident else None,
                    "memory_constraint": j.memory.value if j.memory else None,
                    "memory_why": j.memory.why if j.memory else None,
                    "gpu_headroom_bytes": self.headroom(name),
                    "notes": d.notes or None,
                }.items()
                if v is not None
            }
        return {"diagnosis": out} if out else {}


def kv_bytes(d: Diagnosis) -> int | None:
    """The KV cache as the engine says it allocated it, else the formula's."""
    if d.started.kv_cache_bytes is not None:
        return d.started.kv_cache_bytes
    return d.kv.bytes if d.kv is not None else None
