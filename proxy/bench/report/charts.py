"""The report's charts, as SVG (vector: sharp on screen and in print). Latency axes are logarithmic: TTFT
spans milliseconds to seconds between a short prompt at c=1 and a long one under load.

Needs matplotlib (the ``report`` extra, Agg backend); without it the report says so and has tables only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.bench.suite import length_rank
from proxy.bench.verdict.data import Data

if TYPE_CHECKING:
    from proxy.bench.verdict.decide import Verdict

CHART_FILES = ("verdict_forest", "ttft_vs_load", "decode_vs_load", "throughput_vs_load", "ttft_vs_prompt_length",
               "latency_vs_throughput", "memory")  # fmt: skip
#: the A/A pass is the baseline measured again: drawn as noise around it, not as a third engine
AA_STYLE = {"color": "0.6", "linestyle": ":", "marker": "."}


def _style(d: Data, name: str, index: int) -> dict[str, Any]:
    e = next((e for e in d.results.engines if e.name == name), None)
    if e is not None and e.aa_of:
        return dict(AA_STYLE)
    return {"color": f"C{index}", "marker": "o"}


def _label(d: Data, name: str) -> str:
    e = next((e for e in d.results.engines if e.name == name), None)
    return f"{name} (A/A: noise)" if e is not None and e.aa_of else name


def plain(ax: Any) -> None:
    """Plain tick labels on both axes (``900``, ``0.9``, ``55,000`` — never ``9×10⁻¹``); on a log axis the minor
    ticks at 2 and 5 of each decade are labelled when the axis spans less than two decades (else none)."""
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
            axis.set_minor_formatter(FuncFormatter(lambda v, _: tick(v) if _lead(v) in (2, 5) else "") if few
                                     else NullFormatter())  # fmt: skip


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
    ax.text(0.99, 0.98, f"axis cut at {tick(1.5 * p90)}: outliers above (see the data checks)",
            transform=ax.transAxes, ha="right", va="top", fontsize=6, color="0.3")  # fmt: skip
    return True


def forest(verdicts: Sequence[Verdict], ax: Any) -> bool:
    """Each comparison's speed ratio (the candidate's speed over the baseline's: ×2 is "×2.0 faster", ×0.5 "×2.0
    slower") with its 95 % interval, log scale, the band a win must clear shaded around ×1; primary figures
    filled, the ones beside them hollow."""
    rows: list[tuple[str, Any]] = []
    for v in verdicts:
        for c in v.comparisons:
            rows.append((f"{v.candidate}: {c.what}", c))
    if not rows:
        return False
    for i, (_, c) in enumerate(rows):
        e, lo, hi = (math.exp(x) for x in c.log_gain)
        y = len(rows) - 1 - i
        wb = 1 + c.win_band
        ax.fill_betweenx([y - 0.4, y + 0.4], 1 / wb, wb, color="0.85", linewidth=0)
        color = {"win": "C2", "loss": "C3", "tie": "C0"}.get(c.outcome, "0.3")
        ax.plot([max(lo, 1e-3), hi], [y, y], color=color, linewidth=2)
        ax.plot([e], [y], marker="o", color=color, markerfacecolor=color if c.primary else "white")
    ax.axvline(1.0, color="0.4", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [lab for lab, _ in reversed(rows)], fontsize=7)
    ax.set_xlabel("candidate's speed ratio (log; < 1: slower); grey: the band a win must clear", fontsize=9)
    return True


def make_charts(d: Data, out: Path, verdicts: Sequence[Verdict] = ()) -> tuple[dict[str, Path], str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, "Charts skipped: matplotlib is not installed (pip install 'enginemeter[report]')."
    plt.rcParams["svg.hashsalt"] = "enginemeter"  # the same data gives the same file
    r = d.results
    names = [e.name for e in r.engines]
    charts: dict[str, Path] = {}
    caches = sorted({s.cell.cache for s in r.samples})
    base_mt, base_pl = r.base_max_tokens, r.base_prompt_len
    open_loop = any(s.cell.rate is not None for s in r.samples)
    load_key = "rate" if open_loop else "concurrency"

    def series(cache: str, engine: str, value: Callable[[Any], Any], key: str) -> tuple[list[Any], list[list[float]]]:
        pts: dict[Any, list[float]] = {}
        for s in r.samples:
            if s.engine != engine or s.cell.cache != cache:
                continue
            c = s.cell
            if key in ("concurrency", "rate") and (c.max_tokens != base_mt or c.prompt_len != base_pl):
                continue
            if key == "rate" and c.rate is None:
                continue
            if key == "prompt_len" and (c.concurrency != 1 or c.max_tokens != base_mt or c.rate is not None):
                continue
            v = value(s)
            if isinstance(v, int | float):
                pts.setdefault(getattr(c, key), []).append(float(v))
        xs = sorted(pts, key=lambda x: length_rank(x) if isinstance(x, str) else x)
        return xs, [pts[x] for x in xs]

    def save(fig: Any, fname: str, title: str) -> None:
        for ax in fig.axes:
            plain(ax)
        fig.tight_layout()
        p = out / f"{fname}.svg"
        fig.savefig(p, format="svg", metadata={"Date": None})
        plt.close(fig)
        charts[title] = p

    fig, ax = plt.subplots(figsize=(7.5, 0.45 * sum(len(v.comparisons) for v in verdicts) + 1.2))
    if forest(verdicts, ax):
        ax.set_title("Each comparison: the speed ratio with its 95 % interval against the band", fontsize=9)
        save(fig, "verdict_forest", "The verdict's comparisons")
    else:
        plt.close(fig)

    lk = "request rate (req/s)" if open_loop else "concurrent requests"
    specs = [
        ("ttft_vs_load", f"TTFT vs {lk}", load_key, lambda s: s.ttft_s, "TTFT (ms, log)", 1000.0, True),
        ("decode_vs_load", f"Per-request decode tok/s vs {lk}", load_key, lambda s: s.decode_tps, "decode tok/s", 1.0, False),
        ("throughput_vs_load", f"Aggregate output tok/s vs {lk}", load_key, lambda s: s.output_tps, "output tok/s", 1.0, False),
        ("ttft_vs_prompt_length", "TTFT vs prompt length (c=1)", "prompt_len", lambda s: s.ttft_s, "TTFT (ms, log)", 1000.0, True),
    ]  # fmt: skip
    for fname, title, key, value, ylabel, scale, logy in specs:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        drew = False
        tops: list[float] = []
        for cache in caches:
            for ni, n in enumerate(names):
                xs, vals = series(cache, n, value, key)
                if not xs:
                    continue
                drew = True
                ys = [statistics.median(v) * scale for v in vals]
                lo = [(statistics.median(v) - min(v)) * scale for v in vals]
                hi = [(max(v) - statistics.median(v)) * scale for v in vals]
                pos = list(range(len(xs))) if key == "prompt_len" else xs
                st = _style(d, n, ni)
                if "linestyle" not in st:
                    st["linestyle"] = "-" if cache != "warm" else "--"
                ax.errorbar(pos, ys, yerr=[lo, hi], capsize=3, label=f"{_label(d, n)} ({cache})", **st)
                tops += [max(v) * scale for v in vals]
                if key == "prompt_len":
                    ax.set_xticks(pos, [str(x) for x in xs])
        if not drew:
            plt.close(fig)
            continue
        if logy:
            ax.set_yscale("log")
        else:
            robust_top(ax, tops)
        if key in ("concurrency", "rate"):
            ax.set_xscale("log", base=2)
            loads = {s.cell.rate if key == "rate" else float(s.cell.concurrency) for s in r.samples}
            ticks = sorted(x for x in loads if x is not None)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel(lk)
        else:
            ax.set_xlabel("prompt length class")
        ax.set_ylabel(ylabel)
        ax.set_title(title + " — median, bars = min–max over repeats", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        save(fig, fname, title)

    # latency vs throughput: one point per load level (median over repeats), joined in load order; where the
    # curve bends upward the engine is out of capacity
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    drew = False
    judged = caches[0] if caches else None
    for ni, n in enumerate(names):
        levels: dict[float, list[Any]] = {}
        for s in r.samples:
            c = s.cell
            if (
                s.engine == n
                and c.cache == judged
                and c.max_tokens == base_mt
                and c.prompt_len == base_pl
                and s.output_tps
            ):
                levels.setdefault(c.rate if c.rate is not None else float(c.concurrency), []).append(s)
        for q, marker in (("ttft_p50_s", "o"), ("ttft_p99_s", "^")):
            xy: list[tuple[float, float, float]] = []
            for load in sorted(levels):
                raw: list[Any] = [
                    (s.percentiles or {}).get(q) or (s.ttft_s if q == "ttft_p50_s" else None) for s in levels[load]
                ]
                yv = [float(y) for y in raw if isinstance(y, int | float) and y > 0]
                if yv:
                    xy.append(
                        (statistics.median(float(s.output_tps) for s in levels[load]), statistics.median(yv), load)
                    )
            if xy:
                drew = True
                few = q == "ttft_p99_s" and any(s.n_ok < 100 for lv in levels.values() for s in lv)
                st = _style(d, n, ni)
                ax.plot([p[0] for p in xy], [p[1] * 1000 for p in xy], marker=marker, color=st["color"],
                        linestyle="-" if q == "ttft_p50_s" else ":",
                        label=f"{_label(d, n)} TTFT {q[5:8]}" + (" (<100 requests: ≈ max)" if few else ""))  # fmt: skip
                if q == "ttft_p50_s":
                    for x, y, load in xy:
                        ax.annotate(f"{load:g}", (x, y * 1000), fontsize=6, xytext=(3, -8), textcoords="offset points")
    if drew:
        ax.set_yscale("log")
        ax.set_xlabel("aggregate output tok/s (median over repeats)")
        ax.set_ylabel("TTFT (ms, log)")
        ax.set_title(f"Latency vs throughput ({judged} cache; points labelled with their {load_key})", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        save(fig, "latency_vs_throughput", "Latency vs throughput")
    else:
        plt.close(fig)

    mem: dict[str, int] = {}
    for s in r.samples:
        if s.gpu_mem_peak_bytes is not None:
            mem[s.engine] = max(mem.get(s.engine, 0), s.gpu_mem_peak_bytes)
    note = None
    if mem:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(list(mem), [v / 2**30 for v in mem.values()],
               color=[_style(d, n, i)["color"] for i, n in enumerate(mem)])  # fmt: skip
        ax.set_ylabel("GiB")
        ax.set_title("GPU memory peak during the bench", fontsize=9)
        if r.memory_budget_bytes:
            ax.axhline(r.memory_budget_bytes / 2**30, color="red", linestyle="--", label="budget")
            ax.legend(fontsize=7)
        save(fig, "memory", "GPU memory peak")
    else:
        note = "No memory chart: GPU memory was unknown (no proxy /metrics given and no NVML device)."
    return charts, note


# ---- live traffic (enginemeter report --log) ------------------------------------------------------------

LIVE_CHART_FILES = ("live_delta_over_pairs", "live_by_concurrency")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plt.rcParams["svg.hashsalt"] = "enginemeter"
    return plt


def live_delta_chart(
    histories: Mapping[str, Mapping[Any, Sequence[tuple[int, float, float | None, float | None]]]],
    min_effect: float,
    primary: str,
    out: Path,
) -> Path | None:
    """The shadow's speed ratio per regime as the pairs arrived (the primary's time over the shadow's, of the
    running geometric mean: above 1 the shadow is faster, the notation's ratio) and its anytime-valid interval,
    one panel per stream (``proxy.sequential.STREAMS``), one colour per shadow; the grey band is the minimum
    effect (inside it: no difference worth a switch). ``histories``: shadow -> stream -> (pairs, Δ, lo, hi) after
    each pair, Δ = shadow / primary − 1 of the time (``proxy.sequential.Interval``)."""
    plt = _pyplot()
    streams = [s for s in dict.fromkeys(k for h in histories.values() for k, v in h.items() if v)]
    if plt is None or not streams:
        return None
    fig, axes = plt.subplots(len(streams), 1, figsize=(6.4, 2.4 * len(streams)), squeeze=False)
    for ax, stream in zip(axes[:, 0], streams, strict=True):
        for i, (shadow, h) in enumerate(histories.items()):
            pts = h.get(stream) or ()
            if not pts:
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [1 / (1 + p[1]) for p in pts], color=f"C{i}", label=f"{shadow} vs {primary}")
            # a higher time ratio is a lower speed ratio: the interval's ends swap
            band = [(p[0], 1 / (1 + p[3]), 1 / (1 + p[2])) for p in pts if p[2] is not None and p[3] is not None]
            if band:
                ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color=f"C{i}",
                                alpha=0.25, linewidth=0)  # fmt: skip
        ax.axhspan(1 / (1 + min_effect), 1 + min_effect, color="grey", alpha=0.2, linewidth=0)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("pairs in this regime")
        ax.set_ylabel("shadow's speed ratio (log)")
        label = getattr(stream, "label", str(stream))
        regime = {"decode": "single-request decode", "load": "under load", "long": "long context"}.get(
            getattr(stream, "regime", ""), ""
        )
        ax.set_title(f"{regime}: {label} — running estimate, shaded: anytime-valid interval", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "live_delta_over_pairs.svg"
    for a in fig.axes:
        plain(a)
    fig.savefig(p, format="svg", metadata={"Date": None})
    plt.close(fig)
    return p


def live_concurrency_chart(points: Sequence[tuple[str, int, float | None, float | None]], out: Path) -> Path | None:
    """TTFT (upstream, ms, log) and decode tok/s by observed concurrency, per engine: the median of the pairs at
    each level, bars from the 25th to the 75th percentile. ``points``: (engine, concurrency, TTFT s, tok/s)."""
    plt = _pyplot()
    if plt is None or not points:
        return None
    names = list(dict.fromkeys(p[0] for p in points))
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
    for ax, idx, scale, ylabel in ((axes[0], 2, 1000.0, "TTFT (ms, log)"), (axes[1], 3, 1.0, "decode tok/s")):
        drew = False
        for i, n in enumerate(names):
            by: dict[int, list[float]] = {}
            for p in points:
                v = p[idx]
                if p[0] == n and isinstance(v, int | float) and v > 0:
                    by.setdefault(p[1], []).append(float(v) * scale)
            xs = sorted(by)
            if not xs:
                continue
            q = [statistics.quantiles(by[x], n=4) if len(by[x]) > 1 else [by[x][0]] * 3 for x in xs]
            med = [statistics.median(by[x]) for x in xs]
            drew = True
            ax.errorbar(xs, med, yerr=[[m - qq[0] for m, qq in zip(med, q, strict=True)],
                                       [qq[2] - m for m, qq in zip(med, q, strict=True)]],
                        marker="o", capsize=3, color=f"C{i}", label=n)  # fmt: skip
        if idx == 2 and drew:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("observed concurrency (mirrored requests overlapping the pair)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if drew:
            ax.legend(fontsize=7)
    fig.suptitle("Live traffic by observed concurrency — median, bars = 25th–75th percentile", fontsize=9)
    fig.tight_layout()
    path = out / "live_by_concurrency.svg"
    for a in fig.axes:
        plain(a)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


Spread = tuple[float, float, float] | None


def tune_chart(flag: str, points: Sequence[tuple[str, Spread, Spread]], conc: int | None, out: Path) -> Path | None:
    """``enginemeter tune``: single-request decode tok/s and concurrent output tok/s per setting (median, bars
    min–max over repeats); None without matplotlib or data."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tune.svg"
    path.unlink(missing_ok=True)  # a chart this run does not draw must not survive
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not any(a or b for _, a, b in points):
        return None
    plt.rcParams["svg.hashsalt"] = "enginemeter"
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = list(range(len(points)))
    for i, (label, color) in enumerate((("single request (c=1) decode tok/s", "C0"),
                                        (f"concurrent output tok/s (c={conc or '?'})", "C1"))):  # fmt: skip
        pts: list[tuple[int, tuple[float, float, float]]] = []
        for x, pt in zip(xs, points, strict=True):
            v = pt[1] if i == 0 else pt[2]
            if v:
                pts.append((x, v))
        if not pts:
            continue
        ys = [v[0] for _, v in pts]
        lo = [v[0] - v[1] for _, v in pts]
        hi = [v[2] - v[0] for _, v in pts]
        ax.errorbar([x for x, _ in pts], ys, yerr=[lo, hi], capsize=3, marker="o", color=color, label=label)
    robust_top(ax, [v[2] for pt in points for v in pt[1:] if v])
    plain(ax)
    ax.set_xticks(xs, [p[0] for p in points])
    ax.set_xlabel(flag)
    ax.set_ylabel("tok/s")
    ax.set_title(f"tok/s by {flag} — median, bars = min–max over repeats", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    for a in fig.axes:
        plain(a)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path
