"""GPU memory as a running proxy's ``/metrics`` reports it: per engine (the proxy attributes GPU processes to
engines through /proc: ``enginemeter_engine_gpu_memory_used_bytes``, then ``..._peak_bytes``) or per device. Pure.

``PER_ENGINE`` names the sources that can judge "memory fits": a device-wide reading includes whatever else runs
on that GPU (the other engine too), and the verdict says so instead of judging.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)")
#: the launched engine's own processes (NVML, attributed by its pid)
PROCESS = "launched engine's processes (NVML)"
PER_ENGINE = frozenset({"proxy engine gauge", "proxy engine peak", PROCESS})


def parse_metrics(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        with contextlib.suppress(ValueError):
            yield m.group(1), labels, float(m.group(3))


@dataclass(frozen=True, slots=True)
class MemReading:
    used_bytes: int | None
    source: str
    gpus: tuple[int, ...] = ()  # the GPUs this engine holds memory on (per-engine sources only)
    total_bytes: int | None = None  # installed memory of those GPUs (of all, for a device-wide source)


def read_memory(text: str, engine: str) -> MemReading:
    """The engine's GPU memory now (or its peak, or the device's) from the proxy's /metrics."""
    used: dict[int, float] = {}
    peak: dict[int, float] = {}
    device: dict[int, float] = {}
    total: dict[int, float] = {}
    for name, labels, v in parse_metrics(text):
        gpu = int(labels["gpu"]) if labels.get("gpu", "").isdigit() else -1
        if name == "enginemeter_engine_gpu_memory_used_bytes" and labels.get("engine") == engine:
            used[gpu] = used.get(gpu, 0) + v
        elif name == "enginemeter_engine_gpu_memory_peak_bytes" and labels.get("engine") == engine:
            peak[gpu] = peak.get(gpu, 0) + v
        elif name == "enginemeter_gpu_memory_used_bytes":
            device[gpu] = device.get(gpu, 0) + v
        elif name == "enginemeter_gpu_memory_total_bytes":
            total[gpu] = total.get(gpu, 0) + v

    def of(vals: dict[int, float], source: str, per_engine: bool) -> MemReading:
        gpus = tuple(sorted(g for g, x in vals.items() if x > 0)) if per_engine else tuple(sorted(vals))
        tot = [total[g] for g in gpus if g in total]
        return MemReading(int(sum(vals.values())), source, gpus, int(sum(tot)) if tot else None)

    if used:
        return of(used, "proxy engine gauge", True)
    if peak:
        return of(peak, "proxy engine peak", True)
    if device:
        return of(device, "proxy device gauge", False)
    return MemReading(None, "unknown")


def memory_from_metrics(text: str, engine: str) -> tuple[int | None, str]:
    m = read_memory(text, engine)
    return m.used_bytes, m.source
