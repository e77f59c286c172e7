"""``Live`` (``proxy.bench.live.livedata``) -> the report of mirrored traffic in ``out``: report.md, report.html,
verdict.json, the charts (the bench report's and the live ones, drawn here) and switch-plan.md.

It is the bench report's document (the verdict through the gates, the engines, the protocol, the tables) with
the live sections right after the verdict: the anytime-valid verdict per regime (``proxy.sequential``), the
pairs by cause, the sampling the traffic carried, greedy-output agreement, and the live charts. ``verdict.json``
gains ``live``: each engine pair's streams (pairs, ``delta``, interval, decision, decided after).

The document is assembled here from ``proxy.bench.report.document``'s public pieces (``document``, ``verdict_json``,
``write_files``), so both files still come from one list of blocks.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.live.facts import greedy_text
from proxy.bench.live.livedata import Live
from proxy.bench.live.log import CAUSE_TEXT
from proxy.bench.report import switchplan
from proxy.bench.report.blocks import Block
from proxy.bench.report.charts import CHART_FILES, make_charts
from proxy.bench.report.document import clear_charts, document, make_headline, verdict_json, write_files
from proxy.bench.report.drawing import pyplot, save
from proxy.bench.verdict.decide import decide_all
from proxy.sequential import ALPHA, MIN_PAIRS, PLANNED_PAIRS, STREAMS

LIVE_CHART_FILES = ("live_delta_over_pairs", "live_by_concurrency")
METHOD = (
    "Each regime's difference is tracked as the pairs arrive with an anytime-valid confidence sequence (the "
    "Gaussian-mixture asymptotic confidence sequence of Waudby-Smith et al., 2024) on the paired log-ratios "
    "shadow/primary, so it may be looked at after every pair without inflating false wins: the chance that any of "
    f"an engine pair's {len(STREAMS)} streams ever declares a difference that is not there is at most "
    f"{ALPHA:.0%} (each runs at {ALPHA / len(STREAMS):.2%}). A decision, once made, stands (it is valid at the pair "
    "it was made); if the traffic later changes so much that the current interval leaves the decided region, the "
    "line says so. Faster/slower needs the whole interval beyond the minimum "
    "effect ({m}); a tie needs it inside; nothing is decided before {n} pairs in a regime (tightest near {t}). "
    "Regimes: single-request decode = pairs that ran alone with a prompt under 1,024 tokens (TPOT); under load = "
    "pairs that overlapped other mirrored requests (upstream TTFT, and e2e per output token); long context = pairs "
    'that ran alone with a prompt of 1,024 tokens or more (TTFT). See docs/bench.md, "Live traffic".'
)


def live_blocks(live: Live, charts: Mapping[str, Path]) -> list[Block]:
    """The live sections: the anytime-valid verdict per regime, the pairs by cause, the sampling carried, greedy
    outputs and the live charts."""
    out = [
        Block("h2", "Live verdict (anytime-valid, per regime)"),
        Block("p", METHOD.format(m=f"{live.min_effect:.0%}", n=MIN_PAIRS, t=PLANNED_PAIRS)),
    ]
    for shadow, v in live.verdicts.items():
        out.append(Block("h3", f"{shadow} vs {live.primary} (primary)"))
        out.append(Block("ul", items=v.lines()))
    out += _cause_blocks(live)
    out += _sampling_blocks(live)
    out.append(Block("h2", "Greedy outputs"))
    rnd = live.data.results.random_weights
    out.append(Block("ul", items=[greedy_text(live.primary, s, g, rnd) for s, g in live.greedy.items()]))
    if charts:
        out.append(Block("h2", "Live charts"))
        for title, p in charts.items():
            out += [Block("h3", title), Block("img", text=title, path=p.name)]
    return out


def _cause_blocks(live: Live) -> list[Block]:
    causes = [c for c in CAUSE_TEXT if c != "engine"]
    rows = []
    for shadow, o in live.outcomes.items():
        fails = (
            "; ".join(
                f"{e}: " + ", ".join(f"{k} {n}" for k, n in sorted(f.items())) + f" ({o.failure_rate(e):.1%})"
                for e, f in sorted(o.failures.items())
            )
            or "0"
        )
        rows.append([f"{live.primary} → {shadow}", str(o.total), *[str(o.by_cause.get(c, 0)) for c in causes], fails])
    text = (
        "Every mirrored pair of the report, by why it ended. Only engine-side failures count "
        f"against an engine; up to {live.max_error_rate:.0%} of the pairs they are left out and stated, "
        "above that they stop the verdict at the data gate. "
        + "; ".join(f"*{c}*: {t}" for c, t in CAUSE_TEXT.items())
        + "."
    )
    out = [Block("h2", "Pairs by cause"), Block("p", text)]
    out.append(Block("table", header=["pair", "pairs", *causes, "engine-side failures"], rows=rows))
    lost = {k: n for k, n in live.lost.items() if n}
    if lost:
        never = ", ".join(f"{k} {n}" for k, n in sorted(lost.items()))
        out.append(
            Block(
                "p", f"Copies the mirror never paired (not in the log): {never} (`enginemeter_mirror_requests_total`)."
            )
        )
    return out


def _sampling_blocks(live: Live) -> list[Block]:
    text = (
        "What each engine really got, per pair, after the proxy's per-kind mapping: the "
        "parameter sets (canonical: top_k 0/-1 = off), how many pairs carried each, the max_tokens "
        "asked, and the params the proxy dropped for the engine's kind or filled in from its "
        "`sampling_defaults` (the client did not send them)."
    )
    rows = []
    for engine, groups in live.sampling.items():
        for g in groups:
            sets = "; ".join(f"{p} ×{n}" for p, n in g.params[:3]) + (
                f"; +{len(g.params) - 3} more" if len(g.params) > 3 else ""
            )
            rows.append(
                [
                    engine,
                    g.group,
                    str(g.pairs),
                    sets or "–",
                    ", ".join(map(str, g.max_tokens)) or "–",
                    ", ".join(f"{k} ×{n}" for k, n in sorted(g.dropped.items())) or "none",
                    ", ".join(f"{k} ×{n}" for k, n in sorted(g.defaulted.items())) or "none",
                ]
            )
    header = ["engine", "group", "pairs", "sampling", "max_tokens", "dropped", "filled in"]
    return [Block("h2", "Sampling as carried"), Block("p", text), Block("table", header=header, rows=rows)]


def write_live_report(live: Live, out: Path) -> dict[str, Any]:
    """Like ``report.write_report``, with the live sections; returns the verdicts, the live verdicts and paths."""
    clear_charts(out, (*CHART_FILES, *LIVE_CHART_FILES))
    d = live.data
    charts, note = make_charts(d, out)
    extra = live_charts(live, out)
    verdicts = decide_all(d.results)
    h = make_headline(d, verdicts)
    blocks = document(d, charts, note, verdicts, h=h)
    at = next((i for i, b in enumerate(blocks) if b.kind == "h2" and b.text == "Engines"), len(blocks))
    blocks[at:at] = live_blocks(live, extra)
    plan = {
        s: switchplan.Outputs(g.pairs, g.pairs - g.differ, greedy_text(live.primary, s, g))
        for s, g in live.greedy.items()
    }
    listen = next((r.listen for r in reversed(live.selection.runs) if r.listen), None)
    plan_md = switchplan.markdown(d, verdicts, plan, listen=listen)
    live_json = [v.to_json() for v in live.verdicts.values()]
    vj = verdict_json(verdicts, h, interrupted=False, live=live_json, switch_plan=switchplan.FILE)
    return {
        **write_files(out, blocks, plan_md, vj),
        "charts": [*charts.values(), *extra.values()],
        "verdicts": verdicts,
        "live": live.verdicts,
        "headline": h,
    }


# ---- the live charts -------------------------------------------------------------------------------------


def live_charts(live: Live, out: Path) -> dict[str, Path]:
    """Draw the live charts into ``out``: title -> file of each drawn."""
    extra: dict[str, Path] = {}
    delta = live_delta_chart({s: v.history or {} for s, v in live.verdicts.items()}, live.min_effect, live.primary, out)
    if delta is not None:
        extra["The shadow's speed ratio per regime as the pairs arrived"] = delta
    conc = live_concurrency_chart(live.points, out)
    if conc is not None:
        extra["TTFT and decode tok/s by observed concurrency"] = conc
    return extra


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
    plt = pyplot()
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
                ax.fill_between(
                    [b[0] for b in band],
                    [b[1] for b in band],
                    [b[2] for b in band],
                    color=f"C{i}",
                    alpha=0.25,
                    linewidth=0,
                )
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
    return save(fig, out / "live_delta_over_pairs.svg")


def live_concurrency_chart(points: Sequence[tuple[str, int, float | None, float | None]], out: Path) -> Path | None:
    """TTFT (upstream, ms, log) and decode tok/s by observed concurrency, per engine: the median of the pairs at
    each level, bars from the 25th to the 75th percentile. ``points``: (engine, concurrency, TTFT s, tok/s)."""
    plt = pyplot()
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
            ax.errorbar(
                xs,
                med,
                yerr=[
                    [m - qq[0] for m, qq in zip(med, q, strict=True)],
                    [qq[2] - m for m, qq in zip(med, q, strict=True)],
                ],
                marker="o",
                capsize=3,
                color=f"C{i}",
                label=n,
            )
        if idx == 2 and drew:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("observed concurrency (mirrored requests overlapping the pair)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if drew:
            ax.legend(fontsize=7)
    fig.suptitle("Live traffic by observed concurrency — median, bars = 25th–75th percentile", fontsize=9)
    return save(fig, out / "live_by_concurrency.svg")
