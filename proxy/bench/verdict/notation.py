"""How the bench writes its numbers, in one place: relative differences, bands, figures with their units. Pure."""

from __future__ import annotations


def pct(x: float) -> str:
    """A relative difference the way a person says it: +14 %, +787 %, or ×9.9 once it passes +300 %."""
    return f"×{1 + x:.1f}" if x >= 2 else f"{x:+.0%}" if abs(x) >= 0.1 else f"{x:+.1%}"


def band(x: float) -> str:
    return f"×{1 + x:.1f}" if x >= 1 else f"{x:.1%}"


def num(x: float) -> str:
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def figure(metric: str, v: float) -> str:
    """A figure as a person reads it: decode in tok/s (with ms/token), times in ms or s, rates in tok/s."""
    if metric == "tpot_s":
        return f"{1 / v:.0f} tok/s ({v * 1000:.2f} ms/token)" if v > 0 else "–"
    if metric.endswith("_s"):
        return f"{v * 1000:.1f} ms" if v < 10 else f"{v:.1f} s"
    return f"{num(v)} tok/s" if metric.endswith("tps") else num(v)


def gib(b: float | None) -> str:
    return "unknown" if b is None else f"{b / 2**30:.2f} GiB"
