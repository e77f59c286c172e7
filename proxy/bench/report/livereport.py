"""``Live`` (``proxy.bench.live.livedata``) -> the report of mirrored traffic in ``out``: report.md, report.html,
verdict.json, the charts and switch-plan.md.

It is the bench report's document (the verdict through the gates, the engines, the protocol, the tables) with
the live sections right after the verdict: the anytime-valid verdict per regime (``proxy.sequential``), the
pairs by cause, the sampling the traffic carried, greedy-output agreement, and the live charts. ``verdict.json``
gains ``live``: each engine pair's streams (pairs, ``delta``, interval, decision, decided after).

The document is assembled here from ``proxy.bench.report.document``'s public pieces (``document``, the two renderers,
``verdict_json``), so both files still come from one list of blocks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.bench.live.livedata import Live, greedy_text
from proxy.bench.live.log import CAUSE_TEXT
from proxy.bench.report import switchplan
from proxy.bench.report.charts import (
    CHART_FILES,
    LIVE_CHART_FILES,
    live_concurrency_chart,
    live_delta_chart,
    make_charts,
)
from proxy.bench.report.document import Block, document, make_headline, verdict_json
from proxy.bench.report.render import render_html, render_md
from proxy.bench.verdict.decide import decide_all
from proxy.sequential import ALPHA, MIN_PAIRS, PLANNED_PAIRS, STREAMS

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


def live_blocks(live: Live, charts: dict[str, Path]) -> list[Block]:
    out = [Block("h2", "Live verdict (anytime-valid, per regime)"),
           Block("p", METHOD.format(m=f"{live.min_effect:.0%}", n=MIN_PAIRS, t=PLANNED_PAIRS))]  # fmt: skip
    for shadow, v in live.verdicts.items():
        out.append(Block("h3", f"{shadow} vs {live.primary} (primary)"))
        out.append(Block("ul", items=v.lines()))
    out.append(Block("h2", "Pairs by cause"))
    causes = [c for c in CAUSE_TEXT if c != "engine"]
    rows = []
    for shadow, o in live.outcomes.items():
        fails = "; ".join(f"{e}: " + ", ".join(f"{k} {n}" for k, n in sorted(f.items())) + f" ({o.failure_rate(e):.1%})"
                          for e, f in sorted(o.failures.items())) or "0"  # fmt: skip
        rows.append([f"{live.primary} → {shadow}", str(o.total), *[str(o.by_cause.get(c, 0)) for c in causes], fails])
    out.append(Block("p", "Every mirrored pair of the report, by why it ended. Only engine-side failures count "
                     f"against an engine; up to {live.max_error_rate:.0%} of the pairs they are left out and stated, "
                     "above that they stop the verdict at the data gate. " + "; ".join(
                         f"*{c}*: {t}" for c, t in CAUSE_TEXT.items()) + "."))  # fmt: skip
    out.append(Block("table", header=["pair", "pairs", *causes, "engine-side failures"], rows=rows))
    lost = {k: n for k, n in live.lost.items() if n}
    if lost:
        out.append(Block("p", "Copies the mirror never paired (not in the log): " + ", ".join(
            f"{k} {n}" for k, n in sorted(lost.items())) + " (`enginemeter_mirror_requests_total`)."))  # fmt: skip
    out.append(Block("h2", "Sampling as carried"))
    out.append(Block("p", "What each engine really got, per pair, after the proxy's per-kind mapping: the "
                     "parameter sets (canonical: top_k 0/-1 = off), how many pairs carried each, the max_tokens "
                     "asked, and the params the proxy dropped for the engine's kind or filled in from its "
                     "`sampling_defaults` (the client did not send them)."))  # fmt: skip
    rows = []
    for engine, groups in live.sampling.items():
        for g in groups:
            sets = "; ".join(f"{p} ×{n}" for p, n in g.params[:3]) + (
                f"; +{len(g.params) - 3} more" if len(g.params) > 3 else ""
            )
            rows.append([engine, g.group, str(g.pairs), sets or "–", ", ".join(map(str, g.max_tokens)) or "–",
                         ", ".join(f"{k} ×{n}" for k, n in sorted(g.dropped.items())) or "none",
                         ", ".join(f"{k} ×{n}" for k, n in sorted(g.defaulted.items())) or "none"])  # fmt: skip
    out.append(Block("table", header=["engine", "group", "pairs", "sampling", "max_tokens", "dropped", "filled in"],
                     rows=rows))  # fmt: skip
    out.append(Block("h2", "Greedy outputs"))
    rnd = live.data.results.random_weights
    out.append(Block("ul", items=[greedy_text(live.primary, s, g, rnd) for s, g in live.greedy.items()]))
    if charts:
        out.append(Block("h2", "Live charts"))
        for title, p in charts.items():
            out += [Block("h3", title), Block("img", text=title, path=p.name)]
    return out


def write_live_report(live: Live, out: Path) -> dict[str, Any]:
    """Like ``report.write_report``, with the live sections; returns the verdicts, the live verdicts and paths."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (*CHART_FILES, *LIVE_CHART_FILES):
        (out / f"{name}.svg").unlink(missing_ok=True)  # a chart this run does not draw must not survive
    d = live.data
    charts, note = make_charts(d, out)
    extra: dict[str, Path] = {}
    delta = live_delta_chart({s: v.history or {} for s, v in live.verdicts.items()}, live.min_effect, live.primary, out)
    if delta is not None:
        extra["The shadow's speed ratio per regime as the pairs arrived"] = delta
    conc = live_concurrency_chart(live.points, out)
    if conc is not None:
        extra["TTFT and decode tok/s by observed concurrency"] = conc
    verdicts = decide_all(d.results)
    h = make_headline(d, verdicts)
    blocks = document(d, charts, note, verdicts, h=h)
    at = next((i for i, b in enumerate(blocks) if b.kind == "h2" and b.text == "Engines"), len(blocks))
    blocks[at:at] = live_blocks(live, extra)
    (out / "report.md").write_text(render_md(blocks), encoding="utf-8")
    (out / "report.html").write_text(render_html(blocks, out), encoding="utf-8")
    plan = {s: switchplan.Outputs(g.pairs, g.pairs - g.differ, greedy_text(live.primary, s, g))
            for s, g in live.greedy.items()}  # fmt: skip
    listen = next((r.listen for r in reversed(live.selection.runs) if r.listen), None)
    (out / switchplan.FILE).write_text(switchplan.markdown(d, verdicts, plan, listen=listen), encoding="utf-8")
    vj = verdict_json(
        verdicts, h, interrupted=False, live=[v.to_json() for v in live.verdicts.values()], switch_plan=switchplan.FILE
    )
    (out / "verdict.json").write_text(json.dumps(vj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {"report_md": out / "report.md", "report_html": out / "report.html", "verdict_json": out / "verdict.json",
            "switch_plan": out / switchplan.FILE, "charts": [*charts.values(), *extra.values()], "verdicts": verdicts,
            "live": live.verdicts, "headline": h}  # fmt: skip
