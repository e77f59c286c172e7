"""Levels of requests in flight: the proxy records how long it ran at each (``proxy.server.observe.inflight``), the bench
weighs its decision by them (``proxy.bench.live.trafficsource``). Bounded: 0 (idle), 1, 2, 3-4, 5-8, ..., 65-128, 129+.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: (label, lowest count, highest count) of each level
LEVELS: tuple[tuple[str, int, float], ...] = (("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3-4", 3, 4), ("5-8", 5, 8),
                                              ("9-16", 9, 16), ("17-32", 17, 32), ("33-64", 33, 64),
                                              ("65-128", 65, 128), ("129+", 129, math.inf))  # fmt: skip


def level_of(n: int) -> int:
    for i, (_, lo, hi) in enumerate(LEVELS):
        if lo <= n <= hi:
            return i
    return len(LEVELS) - 1


def representative(label: str) -> float:
    """The concurrency a level stands for when a profile is weighed: the geometric middle of its range."""
    for name, lo, hi in LEVELS:
        if name == label:
            return float(lo) if lo == hi else round(math.sqrt(lo * (hi if math.isfinite(hi) else 2 * lo)), 1)
    raise ValueError(f"unknown traffic level {label!r}")


def by_level(shares: Mapping[float, float]) -> dict[str, float]:
    """Concurrency -> share, summed into the levels, in their order: a profile swept from a request log (every count
    in flight) and one the proxy recorded (its levels' representative concurrencies) read alike."""
    out: dict[str, float] = {}
    for k, v in shares.items():
        name = LEVELS[level_of(max(1, math.ceil(k)))][0]
        out[name] = out.get(name, 0.0) + v
    return {name: out[name] for name, _, _ in LEVELS if name in out}
