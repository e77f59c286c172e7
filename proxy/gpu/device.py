"""The GPU a run measured on, as NVML names it: model, count, driver and CUDA version. Two runs are joined only
when these agree where both recorded them (``proxy.bench.verdict.merge``). No NVML: None, and nothing is compared."""

from __future__ import annotations

import contextlib
from typing import Any

from proxy.gpu.nvml import DriverReader, NvmlUnavailable, Opener, PynvmlReader


def gpu_facts(opener: Opener = PynvmlReader) -> dict[str, Any] | None:
    """``{"model", "count", "driver", "cuda"}`` of this machine's GPUs, or None without NVML."""
    try:
        reader = opener()
    except NvmlUnavailable:
        return None
    except Exception:  # a driver in a bad state: no facts, never a crash
        return None
    try:
        devices = reader.devices()
        driver, cuda = reader.driver() if isinstance(reader, DriverReader) else ("unknown", None)
        names = sorted({d.name for d in devices})
        return {"model": ", ".join(names), "count": len(devices), "driver": driver, "cuda": cuda} if devices else None
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            reader.close()
