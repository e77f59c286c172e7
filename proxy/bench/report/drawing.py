"""The one seam to matplotlib: pyplot loaded on the first chart, not on import (it is the optional ``report``
extra, and ``python -X importtime`` shows ``matplotlib.pyplot`` alone taking longer than this whole package
without it, 1.4–2.6 s against 0.4–1.7 s on a busy 2-core machine: a caller that never draws must not pay it),
plain tick labels, an axis an outlier cannot flatten, and the SVG written the same way for every chart (the same
data gives the same file).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, hash-salted for reproducible SVG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plt.rcParams["svg.hashsalt"] = "enginemeter"  # the same data gives the same file
    return plt


def plain(ax: Any) -> None:
    """Plain tick labels on both axes (``900``, ``0.9``, ``55,000`` — never ``9×10⁻¹``); on a log axis the minor
    ticks at 2 and 5 of each decade are labelled when the axis spans less than two decades (else none).
    Idempotent: an axis already labelled is left alone."""
    # lazy for the same reason as pyplot(): only a chart being drawn needs it
    from matplotlib.ticker import FuncFormatter, LogFormatter, NullFormatter, ScalarFormatter

    for axis, scale, lim in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()), (ax.yaxis, ax.get_yscale(), ax.get_ylim())):
        if not isinstance(axis.get_major_formatter(), ScalarFormatter | LogFormatter):
            continue  # labels of their own (settings, prompt classes, the loads measured): matplotlib 3.11's
            # set_yticks(ticks, labels) installs a FuncFormatter, older ones a FixedFormatter
        if scale == "linear":
            axis.set_major_formatter(FuncFormatter(lambda v, _: tick(v)))
        elif scale == "log":
            axis.set_major_formatter(FuncFormatter(lambda v, _: tick(v)))
            few = lim[0] > 0 and lim[1] / lim[0] < 100
            axis.set_minor_formatter(
                FuncFormatter(lambda v, _: tick(v) if _lead(v) in (2, 5) else "") if few else NullFormatter()
            )


def tick(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4g}" if abs(v) >= 1e-4 else f"{v:.1e}"


def _lead(v: float) -> int:
    return round(v / 10 ** math.floor(math.log10(v))) if v > 0 else 0


def robust_top(ax: Any, tops: Sequence[float]) -> bool:
    """A linear axis whose largest value is an outlier (over 3× the 90th percentile of what is drawn) is cut at
    1.5× that percentile, so one wild reading cannot flatten every other point; True when cut (the chart says
    so)."""
    xs = sorted(v for v in tops if v is not None and math.isfinite(v) and v > 0)
    if len(xs) < 3:
        return False
    p90 = xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
    if xs[-1] <= 3 * p90:
        return False
    ax.set_ylim(bottom=0, top=1.5 * p90)
    ax.text(
        0.99,
        0.98,
        f"axis cut at {tick(1.5 * p90)}: outliers above (see the data checks)",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=6,
        color="0.3",
    )
    return True


def save(fig: Any, path: Path) -> Path:
    """Lay the figure out, label every axis plainly, write it as SVG (no date: the same data gives the same file)
    and close it. The layout is computed with the labels the axes have at the call: a chart that wants it computed
    with the plain ones calls ``plain`` on its axes first (the bench report's charts do; the live and tune charts
    have always been laid out before)."""
    fig.tight_layout()
    for ax in fig.axes:
        plain(ax)
    fig.savefig(path, format="svg", metadata={"Date": None})
    import matplotlib.pyplot as plt  # loaded already: the figure came from it

    plt.close(fig)
    return path
