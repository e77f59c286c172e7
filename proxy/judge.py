"""The one rule every comparison is decided by: an interval against a band -> win, loss, tie or unresolved. Pure.

Every claim the tool makes about two engines comes through ``judge``: each figure of a bench cell
(``proxy.bench.verdict.comparison``), the answer for a traffic profile (``proxy.bench.verdict.weighting``) and each
live stream (``proxy.sequential``). The interval is of the candidate's **log gain** (+ = the candidate is better,
whatever the figure's direction: log(base time / candidate time), log(candidate tok/s / base tok/s)); the band is
``log(1 + b)`` for a relative band ``b``:

- **win**: the whole interval beyond +band;
- **loss**: the whole interval beyond −band;
- **tie**: the whole interval inside ±band (the ends included);
- **unresolved**: anything else — the interval reaches across a band's edge.

So "a tie" is said exactly when the interval lies inside the band, and a direction exactly when it lies beyond it:
two screens that show the same interval and band cannot say two things (tests/system/test_oracle.py checks it).
"""

from __future__ import annotations

import math
from typing import Literal

Outcome = Literal["win", "loss", "tie", "unresolved"]


def judge(lo: float, hi: float, band: float) -> Outcome:
    """``lo``, ``hi``: the interval of the candidate's log gain; ``band``: the log band (≥ 0)."""
    if math.isnan(lo) or math.isnan(hi):
        return "unresolved"
    if lo > band:
        return "win"
    if hi < -band:
        return "loss"
    if -band <= lo and hi <= band:
        return "tie"
    return "unresolved"


def judge_ratio(lo: float, hi: float, band: float) -> Outcome:
    """The same for an interval of speed ratios (``lo``, ``hi`` > 0; 1.2 = 20 % faster) and a relative band."""
    if lo <= 0 or hi <= 0:
        return "unresolved"
    return judge(math.log(lo), math.log(hi), math.log1p(band))
