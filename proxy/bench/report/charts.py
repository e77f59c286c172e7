"""The report's charts, as SVG (vector: sharp on screen and in print). Latency axes are logarithmic: TTFT
spans milliseconds to seconds between a short prompt at c=1 and a long one under load.

Needs matplotlib (the ``report`` extra, Agg backend, through ``proxy.bench.report.drawing``); without it the
report says so and has tables only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.report.drawing import plain, pyplot, robust_top, save
from proxy.bench.suite import length_rank
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import Verdict
from proxy.bench.verdict.inputs import Results, Sample

CHART_FILES = ("verdict_forest", "ttft_vs_load", "decode_vs_load", "throughput_vs_load", "ttft_vs_prompt_length",
               "latency_vs_throughput", "memory")  # fmt: skip
#: the A/A pass is the baseline measured again: drawn as noise around it, not as a third engine
AA_STYLE = {"color": "0.6", "linestyle": ":", "marker": "."}
NO_MATPLOTLIB = "Charts skipped: matplotlib is not installed (pip install 'enginemeter[report]')."
NO_MEMORY = "No memory chart: GPU memory was unknown (no proxy /metrics given and no NVML device)."

#: a chart of one figure against the load or the prompt length: (file, title, x key, value, y label, y scale, log y)
LoadSpec = tuple[str, str, str, Callable[[Sample], Any], str, float, bool]
#: draws one chart on pyplot: its figure, or None when it has nothing to draw (its figure closed)
Draw = Callable[[Any], Any]


def _style(d: Data, name: str, index: int) -> dict[str, Any]:
    e = next((e for e in d.results.engines if e.name == name), None)
    if e is not None and e.aa_of:
        return dict(AA_STYLE)
    return {"color": f"C{index}", "marker": "o"}


def _label(d: Data, name: str) -> str:
    e = next((e for e in d.results.engines if e.name == name), None)
    return f"{name} (A/A: noise)" if e is not None and e.aa_of else name


def _load_key(r: Results) -> str:
    """What the load axis counts: open-loop arrival rates, else concurrent requests."""
    return "rate" if any(s.cell.rate is not None for s in r.samples) else "concurrency"


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
    """Draw the bench report's charts into ``out``: title -> file of each chart drawn, and a note on what is
    missing (no matplotlib, no memory readings)."""
    plt = pyplot()
    if plt is None:
        return {}, NO_MATPLOTLIB
    charts: dict[str, Path] = {}
    for fname, title, draw in _drawings(d, verdicts):
        fig = draw(plt)
        if fig is not None:
            for ax in fig.axes:
                plain(ax)  # laid out with the labels it shows
            charts[title] = save(fig, out / f"{fname}.svg")
    return charts, None if _memory_peaks(d.results) else NO_MEMORY


def _drawings(d: Data, verdicts: Sequence[Verdict]) -> list[tuple[str, str, Draw]]:
    """Each chart in the report's order: (file name, title, how to draw it)."""
    return [
        ("verdict_forest", "The verdict's comparisons", lambda plt: _forest_figure(plt, verdicts)),
        *((s[0], s[1], lambda plt, s=s: _load_figure(plt, d, s)) for s in _load_specs(d.results)),
        ("latency_vs_throughput", "Latency vs throughput", lambda plt: _latency_figure(plt, d)),
        ("memory", "GPU memory peak", lambda plt: _memory_figure(plt, d)),
    ]


def _forest_figure(plt: Any, verdicts: Sequence[Verdict]) -> Any:
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * sum(len(v.comparisons) for v in verdicts) + 1.2))
    if not forest(verdicts, ax):
        plt.close(fig)
        return None
    ax.set_title("Each comparison: the speed ratio with its 95 % interval against the band", fontsize=9)
    return fig


def _load_text(key: str) -> str:
    return "request rate (req/s)" if key == "rate" else "concurrent requests"


def _load_specs(r: Results) -> list[LoadSpec]:
    key = _load_key(r)
    lk = _load_text(key)
    return [
        ("ttft_vs_load", f"TTFT vs {lk}", key, lambda s: s.ttft_s, "TTFT (ms, log)", 1000.0, True),
        ("decode_vs_load", f"Per-request decode tok/s vs {lk}", key, lambda s: s.decode_tps, "decode tok/s", 1.0, False),
        ("throughput_vs_load", f"Aggregate output tok/s vs {lk}", key, lambda s: s.output_tps, "output tok/s", 1.0, False),
        ("ttft_vs_prompt_length", "TTFT vs prompt length (c=1)", "prompt_len", lambda s: s.ttft_s, "TTFT (ms, log)", 1000.0, True),
    ]  # fmt: skip


def _series(
    r: Results, cache: str, engine: str, value: Callable[[Sample], Any], key: str
) -> tuple[list[Any], list[list[float]]]:
    """One engine's values by ``key`` (the load, or the prompt length at c=1), the other cell axes at the base."""
    base_mt, base_pl = r.base_max_tokens, r.base_prompt_len
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


def _load_figure(plt: Any, d: Data, spec: LoadSpec) -> Any:
    _, title, key, value, ylabel, scale, logy = spec
    r = d.results
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    tops: list[float] = []
    for cache in sorted({s.cell.cache for s in r.samples}):
        for ni, n in enumerate(e.name for e in r.engines):
            xs, vals = _series(r, cache, n, value, key)
            if xs:
                tops += _draw_series(ax, d, n, ni, cache, xs, vals, key, scale)
    if not tops:
        plt.close(fig)
        return None
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
        ax.set_xlabel(_load_text(key))
    else:
        ax.set_xlabel("prompt length class")
    ax.set_ylabel(ylabel)
    ax.set_title(title + " — median, bars = min–max over repeats", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def _draw_series(
    ax: Any, d: Data, n: str, ni: int, cache: str, xs: list[Any], vals: list[list[float]], key: str, scale: float
) -> list[float]:
    """One engine's median with min–max bars; returns the tops drawn."""
    ys = [statistics.median(v) * scale for v in vals]
    lo = [(statistics.median(v) - min(v)) * scale for v in vals]
    hi = [(max(v) - statistics.median(v)) * scale for v in vals]
    pos = list(range(len(xs))) if key == "prompt_len" else xs
    st = _style(d, n, ni)
    if "linestyle" not in st:
        st["linestyle"] = "-" if cache != "warm" else "--"
    ax.errorbar(pos, ys, yerr=[lo, hi], capsize=3, label=f"{_label(d, n)} ({cache})", **st)
    if key == "prompt_len":
        ax.set_xticks(pos, [str(x) for x in xs])
    return [max(v) * scale for v in vals]


def _levels(r: Results, engine: str, judged: str | None) -> dict[float, list[Sample]]:
    """The engine's samples at the base cell of the judged cache, by load level."""
    levels: dict[float, list[Sample]] = {}
    for s in r.samples:
        c = s.cell
        if (
            s.engine == engine
            and c.cache == judged
            and c.max_tokens == r.base_max_tokens
            and c.prompt_len == r.base_prompt_len
            and s.output_tps
        ):
            levels.setdefault(c.rate if c.rate is not None else float(c.concurrency), []).append(s)
    return levels


def _latency_points(levels: dict[float, list[Sample]], q: str) -> list[tuple[float, float, float]]:
    """(output tok/s, TTFT quantile ``q`` in s, load) per level: medians over repeats."""
    xy: list[tuple[float, float, float]] = []
    for load in sorted(levels):
        raw: list[Any] = [
            (s.percentiles or {}).get(q) or (s.ttft_s if q == "ttft_p50_s" else None) for s in levels[load]
        ]
        yv = [float(y) for y in raw if isinstance(y, int | float) and y > 0]
        if yv:
            xy.append((statistics.median(float(s.output_tps or 0) for s in levels[load]), statistics.median(yv), load))
    return xy


def _latency_figure(plt: Any, d: Data) -> Any:
    """Latency vs throughput: one point per load level (median over repeats), joined in load order; where the
    curve bends upward the engine is out of capacity."""
    r = d.results
    caches = sorted({s.cell.cache for s in r.samples})
    judged = caches[0] if caches else None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    drew = False
    for ni, n in enumerate(e.name for e in r.engines):
        levels = _levels(r, n, judged)
        for q, marker in (("ttft_p50_s", "o"), ("ttft_p99_s", "^")):
            xy = _latency_points(levels, q)
            if not xy:
                continue
            drew = True
            few = q == "ttft_p99_s" and any(s.n_ok < 100 for lv in levels.values() for s in lv)
            ax.plot(
                [p[0] for p in xy],
                [p[1] * 1000 for p in xy],
                marker=marker,
                color=_style(d, n, ni)["color"],
                linestyle="-" if q == "ttft_p50_s" else ":",
                label=f"{_label(d, n)} TTFT {q[5:8]}" + (" (<100 requests: ≈ max)" if few else ""),
            )
            if q == "ttft_p50_s":
                for x, y, load in xy:
                    ax.annotate(f"{load:g}", (x, y * 1000), fontsize=6, xytext=(3, -8), textcoords="offset points")
    if not drew:
        plt.close(fig)
        return None
    ax.set_yscale("log")
    ax.set_xlabel("aggregate output tok/s (median over repeats)")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(f"Latency vs throughput ({judged} cache; points labelled with their {_load_key(r)})", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def _memory_peaks(r: Results) -> dict[str, int]:
    mem: dict[str, int] = {}
    for s in r.samples:
        if s.gpu_mem_peak_bytes is not None:
            mem[s.engine] = max(mem.get(s.engine, 0), s.gpu_mem_peak_bytes)
    return mem


def _memory_figure(plt: Any, d: Data) -> Any:
    mem = _memory_peaks(d.results)
    if not mem:
        return None
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(mem), [v / 2**30 for v in mem.values()], color=[_style(d, n, i)["color"] for i, n in enumerate(mem)])
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory peak during the bench", fontsize=9)
    if d.results.memory_budget_bytes:
        ax.axhline(d.results.memory_budget_bytes / 2**30, color="red", linestyle="--", label="budget")
        ax.legend(fontsize=7)
    return fig


Spread = tuple[float, float, float] | None


def tune_chart(flag: str, points: Sequence[tuple[str, Spread, Spread]], conc: int | None, out: Path) -> Path | None:
    """``enginemeter tune``: single-request decode tok/s and concurrent output tok/s per setting (median, bars
    min–max over repeats); None without matplotlib or data."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tune.svg"
    path.unlink(missing_ok=True)  # a chart this run does not draw must not survive
    plt = pyplot()
    if plt is None or not any(a or b for _, a, b in points):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = list(range(len(points)))
    for i, (label, color) in enumerate(
        (("single request (c=1) decode tok/s", "C0"), (f"concurrent output tok/s (c={conc or '?'})", "C1"))
    ):
        pts = [(x, v) for x, pt in zip(xs, points, strict=True) if (v := pt[1] if i == 0 else pt[2])]
        if not pts:
            continue
        ys = [v[0] for _, v in pts]
        lo = [v[0] - v[1] for _, v in pts]
        hi = [v[2] - v[0] for _, v in pts]
        ax.errorbar([x for x, _ in pts], ys, yerr=[lo, hi], capsize=3, marker="o", color=color, label=label)
    robust_top(ax, [v[2] for pt in points for v in pt[1:] if v])
    plain(ax)  # before the settings' own x labels replace it: the y axis keeps it
    ax.set_xticks(xs, [p[0] for p in points])
    ax.set_xlabel(flag)
    ax.set_ylabel("tok/s")
    ax.set_title(f"tok/s by {flag} — median, bars = min–max over repeats", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)
