"""The GPU a run measured on, as NVML names it: model, count and driver. Two runs are joined only when these
agree where both recorded them (``proxy.bench.merge``). No NVML: None, and nothing is compared."""

from __future__ import annotations

import contextlib
from typing import Any


def _text(v: str | bytes) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def gpu_facts() -> dict[str, Any] | None:
    """``{"model", "count", "driver", "cuda"}`` of this machine's GPUs, or None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU
        return None
    try:
        n = pynvml.nvmlDeviceGetCount()
        names = sorted({_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(n)})
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda: str | None = None
        with contextlib.suppress(Exception):
            v = int(pynvml.nvmlSystemGetCudaDriverVersion())
            cuda = f"{v // 1000}.{v % 1000 // 10}"
        return {"model": ", ".join(names), "count": n, "driver": driver, "cuda": cuda} if n else None
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
