"""Workload shapes and per-cell figures: open-loop arrivals, percentiles, goodput. Pure.

- Arrivals (``--request-rate R``): inter-arrival times drawn from a gamma distribution with shape
  ``burstiness`` and mean ``1/R`` — shape 1 is a Poisson process; below 1 burstier, above 1 more regular
  (the vLLM/SGLang bench convention). The schedule is seeded per cell repeat, so every engine gets the
  same arrival times.
- Percentiles are linear-interpolated (numpy's default), so p50 is the median.
- Goodput (``--goodput ttft:500,tpot:50,e2el:2000``, milliseconds): requests that met every SLO, per second
  of the repeat's wall time (vLLM's definition), and as a fraction of the requests sent.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s", "e2e": "e2e_s"}


def arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets in seconds from the start of the repeat for ``n`` requests (the first at 0)."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    shape = max(burstiness, 1e-3)
    scale = 1.0 / (rate * shape)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(shape, scale)
        out.append(t)
    return out


def percentile(vals: Sequence[float], q: float) -> float | None:
    s = sorted(vals)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def parse_goodput(spec: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for part in (spec or "").replace(" ", ",").split(","):
        if not part:
            continue
        k, sep, v = part.partition(":")
        if not sep or k not in SLO_KEYS:
            raise ValueError(f"--goodput takes ttft:MS,tpot:MS,e2el:MS; got {part!r}")
        try:
            out[k] = float(v)
        except ValueError:
            raise ValueError(f"--goodput: {part!r} is not KEY:milliseconds") from None
    return out


def meets_slo(req: Mapping[str, object], slo: Mapping[str, float]) -> bool:
    if not req.get("ok"):
        return False
    for k, ms in slo.items():
        v = req.get(SLO_KEYS[k])
        if not isinstance(v, int | float) or v * 1000 > ms:
            return False
    return True
