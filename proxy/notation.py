"""How the bench writes its numbers, in one place, so the console, report.md, the HTML and the charts say the same.

The rule (docs/bench.md, "Reading the numbers"):

- A difference between two engines is a **speed ratio** ``r`` (the candidate's speed over the baseline's; for a
  time, the baseline's time over the candidate's). It is written with its direction in words and a number that
  is never negative: ``r ≥ 1`` is "N % faster" with N = (r − 1) · 100, ``r < 1`` is "N % slower" with
  N = (1/r − 1) · 100 (how much longer it takes); once the factor reaches 2 it is "×N faster" / "×N slower".
- A statement — an estimate with its interval — is written in one unit, the one its farthest number needs:
  "12 % faster (95% CI 9–15 % faster)", "×1.9 faster (95% CI ×1.8–×2.0 faster)", "between 3 % slower and 5 %
  faster".
- A band (what a tie stays inside, what a win must clear) is "±N %" and, from a factor of 2, "×N either way".
- Figures carry their unit: decode in tok/s (with ms/token), times in ms below 0.1 s, else s (``seconds``); counts
  carry their noun, singular for one (``count``: "1 slot", "12 slots").
"""

from __future__ import annotations

import math


def _p(x: float, more: int = 0) -> str:
    """A non-negative percentage, with a decimal below 10 % (``more``: that many decimals more)."""
    return f"{x * 100:.{1 + more}f} %" if x < 0.1 else f"{x * 100:.{more}f} %"


def _factor(r: float, more: int = 0) -> str:
    return f"×{r:.{1 + more}f}"


def unit(*ratios: float) -> str:
    """The one unit a statement of these speed ratios is written in: × once any of them reaches a factor of 2 (either
    way), else %."""
    ok = [r for r in ratios if math.isfinite(r) and r > 0]
    return "x" if any(max(r, 1 / r) >= 2 for r in ok) else "%"


def faster(r: float, u: str | None = None) -> str:
    """A speed ratio in words: "44 % faster", "×14.2 faster", "16 % slower", "×2.5 slower", "as fast"; ``u``: the
    unit of the statement it belongs to (``unit``)."""
    if not math.isfinite(r) or r <= 0:
        return "not measurable"
    u = u or unit(r)
    if r >= 1:
        return f"{_factor(r)} faster" if u == "x" else f"{_p(r - 1)} faster" if r > 1 else "as fast"
    return f"{_factor(1 / r)} slower" if u == "x" else f"{_p(1 / r - 1)} slower"


def faster_interval(lo: float, hi: float, u: str | None = None) -> str:
    """A speed-ratio interval in one unit: "12–18 % faster", "×1.6–×3.2 faster", "between 3 % slower and 5 %
    faster"."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0:
        return "unbounded"
    u = u or unit(lo, hi)
    if lo >= 1 or hi <= 1:
        a, b, way = (lo, hi, "faster") if lo >= 1 else (1 / hi, 1 / lo, "slower")  # the nearer end first
        for more in (0, 1):  # a decimal more where the ends would read the same ("×2.5–×2.5": no interval)
            ends = (_factor(a, more), _factor(b, more)) if u == "x" else (_p(a - 1, more), _p(b - 1, more))
            if ends[0] != ends[1]:
                break
        return f"{ends[0].removesuffix(' %')}–{ends[1]} {way}"
    return f"between {faster(lo, u)} and {faster(hi, u)}"


def faster_ci(r: float, lo: float, hi: float) -> str:
    """An estimate and its interval in one unit: "×1.9 faster (95% CI ×1.8–×2.0 faster)"."""
    u = unit(r, lo, hi)
    return f"{faster(r, u)} (95% CI {faster_interval(lo, hi, u)})"


def band(x: float) -> str:
    """A band: "±5.0 %", "±21 %", or "×2.4 either way" once it reaches a factor of 2."""
    return f"{_factor(1 + x)} either way" if x >= 1 else f"±{_p(x)}"


def num(x: float) -> str:
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def count(n: float, noun: str, plural: str | None = None) -> str:
    """A count with its noun, singular for one: "1 pair", "602 pairs", "1 slot", "12,288 tokens"."""
    many = plural or f"{noun}s"
    k = int(n) if float(n).is_integer() else n
    return f"{k:,} {noun if k == 1 else many}"


def seconds(v: float) -> str:
    """A time: "35.6 ms", "841 ms", "8.53 s", "120 s"; rounded so no float's tail shows ("1.94 s", never
    "1.9385689999999998 s")."""
    if not math.isfinite(v):
        return "–"
    if v < 0.1:
        return f"{v * 1000:.1f} ms"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    return f"{v:.2f} s" if v < 100 else f"{v:.0f} s"


def figure(metric: str, v: float) -> str:
    """A figure as a person reads it: decode in tok/s (with ms/token), times in ms or s, rates in tok/s."""
    if metric == "tpot_s":
        return f"{1 / v:.0f} tok/s ({v * 1000:.2f} ms/token)" if v > 0 else "–"
    if metric.endswith("_s"):
        return seconds(v)
    return f"{num(v)} tok/s" if metric.endswith("tps") else num(v)


def gib(b: float | None) -> str:
    return "unknown" if b is None else f"{b / 2**30:.2f} GiB"
