"""``Data`` -> verdict + ``report.md`` + self-contained ``report.html`` + SVG charts + ``verdict.json``.

The report is built from whatever the JSONL holds, so an interrupted bench still gets one. The document is
built once as a list of blocks and rendered twice (Markdown, HTML), so both say the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.outdir import read_jsonl
from proxy.bench.report import switchplan
from proxy.bench.report.agreement import Agreement, agreement
from proxy.bench.report.arms import Arms, arms, arms_blocks, weights
from proxy.bench.report.blocks import Block
from proxy.bench.report.charts import CHART_FILES, make_charts
from proxy.bench.report.render import render_html, render_md
from proxy.bench.report.tables import cache_blocks, engine_blocks, parity_blocks, result_blocks
from proxy.bench.report.timeshared import launches_json, timeshared_blocks
from proxy.bench.report.verdictsection import next_block, verdict_section
from proxy.bench.verdict import checks, switchway
from proxy.bench.verdict.data import Data, load_bench
from proxy.bench.verdict.decide import Verdict, decide_all
from proxy.bench.verdict.headline import Headline, answer_table, extrapolated, headline
from proxy.bench.verdict.regimes import weigh_next
from proxy.redact import write_private

__all__ = ["Block", "Data", "load_bench", "read_jsonl", "verdict_json", "write_report"]

HOW_TO_READ = (
    "TTFT = request sent → first token event (non-empty content/reasoning/tool_calls), as the "
    "client feels it. TPOT = (last token − first token) / (completion tokens − 1); decode tok/s is "
    "its inverse (llama.cpp `predicted_per_second` definition); ITL = the gaps between token events "
    "(per chunk). Output tok/s = all completion tokens of a cell repeat / its wall time. The verdict "
    "compares paired requests (same prompt on each engine): each difference is the speed ratio of "
    'the means in words ("12 % faster", "×2.1 slower") with a 95 % bootstrap interval '
    "(repeats, then requests, resampled) and Cohen's d_z; a difference counts only when the whole "
    "interval clears the noise floor measured by the A/A pass. See docs/bench.md."
)


def document(
    d: Data,
    charts: Mapping[str, Path],
    chart_note: str | None,
    verdicts: Sequence[Verdict],
    lead: Sequence[Block] = (),
    agreements: Mapping[str, Agreement] | None = None,
    engine_arms: Sequence[Arms] = (),
    h: Headline | None = None,
) -> list[Block]:
    """The report's blocks: the answer first, the verdict, then the engines, protocol, parity, the results
    tables, the charts and how to read them. ``lead``: a tune's answer (its table and rule), which is then the
    answer: the same lines its terminal printed, never a second answer above them (issue 45)."""
    answer = list(lead) if lead else answer_blocks(h or make_headline(d, verdicts), verdicts, d)
    out = [Block("h1", d.title), *_ended(d), *answer]
    out += verdict_section(verdicts, agreements or {}, d.results.random_weights)
    out += [
        Block("p", q.evidence(random_weights=bool(d.results.random_of(d.results.baseline, c))))
        for c, q in d.results.quality.items()
    ]
    out += arms_blocks(engine_arms, d.engines_meta)
    out += engine_blocks(d)
    out += timeshared_blocks(d.stints, d.stopped)
    out += _protocol_blocks(d)
    out += parity_blocks(d)
    out += result_blocks(d)
    out += cache_blocks(d)
    out += _chart_blocks(charts, chart_note)
    out += _section("Notes", d.notes)
    out += [Block("h2", "How to read this"), Block("p", HOW_TO_READ)]
    return out


def _ended(d: Data) -> list[Block]:
    """A run that did not finish says so first."""
    if d.stopped:
        return [Block("p", f"**Stopped early** — {d.stopped}; the report covers only what finished.")]
    if d.interrupted:
        return [Block("p", "**Interrupted run** — the report covers only what finished.")]
    return []


def _section(title: str, items: Sequence[str]) -> list[Block]:
    return [Block("h2", title), Block("ul", items=list(items))] if items else []


def _protocol_blocks(d: Data) -> list[Block]:
    """The protocol as run, and what the checks of it found."""
    r = d.results
    aa_names = [e.name for e in r.engines if e.aa_of]
    found = checks.summary(list(r.samples), d.positions, r.flags, aa_names)
    return _section("Protocol", d.protocol) + _section("Protocol checks", found)


def _chart_blocks(charts: Mapping[str, Path], note: str | None) -> list[Block]:
    out = [Block("h2", "Charts"), *([Block("p", note)] if note else [])]
    for title, p in charts.items():
        out += [Block("h3", title), Block("img", text=title, path=p.name)]
    return out


def answer_blocks(h: Headline, verdicts: Sequence[Verdict], d: Data | None = None) -> list[Block]:
    """The report's top, as the terminal's first screen (``proxy.cli.screen``): the answer's table (``Table``: the
    deciding figures, the ratios with their intervals, TTFT / TPOT p50 and p99), then the decision in one sentence
    without the table's figures, the traffic and what it extrapolates, how each switch named would go (rollout or
    swap, ``switchway``), notes, trade-offs, caveats, the other candidates and what to run next — no figure said
    twice. ``d``: the data (its requests give the p50/p99 table, its memory and launches the way)."""
    out = [Block("h2", "The answer")]
    if verdicts:
        t = answer_table(verdicts, d.results.requests if d is not None else ())
        out.append(Block("table", header=list(t.header), rows=[list(r) for r in t.rows]))
        if t.latency_rows:
            rows = [[r[0], *r[2:]] for r in t.latency_rows]  # its empty "figure" column: the terminal's alignment
            out.append(Block("table", header=[t.latency_header[0], *t.latency_header[2:]], rows=rows))
    out.append(Block("p", f"**{h.decision.upper()}**{h.tag} — {h.brief}"))
    if h.traffic:
        out.append(Block("p", f"*For the traffic given:* {h.traffic}"))
    items = [f"*{n.replace(': ', ':* ', 1)}" for n in extrapolated(verdicts)] + [f"*note:* {n}" for n in h.notes]
    items += _ways(d, h) if d is not None else []
    items += [f"*trade-off:* {t}" for t in h.tradeoffs] + [f"*caveat:* {c}" for c in h.caveats] + list(h.others)
    if items:
        out.append(Block("ul", items=items))
    if h.next_step:
        out.append(next_block(h.next_step))
    return out


def _ways(d: Data, h: Headline) -> list[str]:
    """How each switch the answer names would go (switch-plan.md holds its config and commands): a guarded rollout
    when both engines fit at once, else a swap and its expected outage — the plan's own figures."""
    ways = []
    for c in h.candidates or ((h.candidate,) if h.candidate else ()):
        r = switchway.resident(d, d.results.baseline, c)
        if r.way == "swap":
            o = switchway.outage(d, c).seconds
            cost = f"about {o:.0f} s without service" if o is not None else "its outage not measured"
            ways.append(f"{c} by a swap, {cost} ({r.why})")
        elif r.way == "rollout":
            ways.append(f"{c} by a guarded rollout, no outage ({r.why})")
    return [f"*how to switch ({switchplan.FILE}):* {'; '.join(ways)}"] if ways else []


def make_headline(d: Data, verdicts: Sequence[Verdict]) -> Headline:
    """The report's one answer: the verdicts read together (a same-file arm is attribution), for the traffic."""
    meta = {m["name"]: m for m in d.engines_meta}
    base = meta.get(d.results.baseline, {})
    relation = {v.candidate: weights(base, meta[v.candidate]) for v in verdicts if v.candidate in meta}
    kinds = {v.candidate: str(meta[v.candidate].get("kind")) for v in verdicts if v.candidate in meta}
    t = d.results.traffic
    # the command that weighs these results by a traffic: any switching verdict's cells give the levels measured
    switch = next((v for v in verdicts if v.decision == "switch" and v.cells), None)
    weigh = weigh_next(d.results, switch.cells) if switch is not None and t is None else None
    traffic = f"{t.text()} ({t.source})" if t is not None else None
    return headline(verdicts, relation, kinds, traffic, ended=bool(d.interrupted or d.stopped), weigh=weigh)


#: 3: the headline (the one answer every screen prints), each verdict's cells, traffic answer and caveats, the
#: traffic profile used, decisions depends and not yet; 4: the headline's ``candidates`` (every switch no other
#: beats beyond the noise; ``candidate`` is null when they are several) and the traffic answer's ``outcome``
VERDICT_VERSION = 4


def verdict_json(verdicts: Sequence[Verdict], h: Headline | None = None, **extra: Any) -> dict[str, Any]:
    """The machine-readable verdict: the headline's decision and its lines, then one entry per candidate."""
    h = h or headline(verdicts)
    return {
        "version": VERDICT_VERSION,
        "decision": h.decision,
        "headline": h.to_json(),
        **extra,
        "verdicts": [v.to_json() for v in verdicts],
    }


def clear_charts(out: Path, names: Iterable[str]) -> None:
    """Make ``out`` and remove its charts of an earlier report: a chart this run does not draw must not survive."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out / f"{name}.svg").unlink(missing_ok=True)


def write_files(out: Path, blocks: Sequence[Block], plan: str, vj: Mapping[str, Any]) -> dict[str, Any]:
    """Write the document as report.md and report.html, the switch plan and verdict.json; their paths."""
    # 0600: they hold the engines' (masked) commands and errors, like the logs
    write_private(out / "report.md", render_md(blocks))
    write_private(out / "report.html", render_html(blocks, out))
    write_private(out / switchplan.FILE, plan)
    write_private(out / "verdict.json", json.dumps(vj, indent=2, ensure_ascii=False) + "\n")
    return {
        "report_md": out / "report.md",
        "report_html": out / "report.html",
        "verdict_json": out / "verdict.json",
        "switch_plan": out / switchplan.FILE,
    }


def write_report(
    d: Data, out: Path, *, lead: Sequence[Block] = (), extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Write report.md, report.html, the charts, verdict.json and switch-plan.md into ``out``; returns the verdicts
    and paths.
    ``lead``: blocks before the verdict (``tune``'s table), ``extra``: keys added to verdict.json."""
    clear_charts(out, CHART_FILES)
    verdicts = decide_all(d.results)
    charts, note = make_charts(d, out, verdicts)
    agreements = {v.candidate: agreement(d.requests, v.baseline, v.candidate) for v in verdicts}
    engine_arms = arms(d.engines_meta, d.results.baseline, verdicts)
    h = make_headline(d, verdicts)
    blocks = document(d, charts, note, verdicts, lead, agreements, engine_arms, h)
    plan_md = switch_plan(d, verdicts, agreements)
    vj = _verdict_json(d, verdicts, h, agreements, engine_arms)
    vj.update(extra or {})
    return {
        **write_files(out, blocks, plan_md, vj),
        "charts": list(charts.values()),
        "verdicts": verdicts,
        "arms_lines": [a.text for a in engine_arms],
        "headline": h,
        "data": d,
    }


def switch_plan(d: Data, verdicts: Sequence[Verdict], agreements: Mapping[str, Agreement] | None = None) -> str:
    """``switch-plan.md`` of a bench's verdicts: each candidate's outputs from its agreement and quality figures."""
    if agreements is None:
        agreements = {v.candidate: agreement(d.requests, v.baseline, v.candidate) for v in verdicts}
    plan = {
        c: switchplan.from_agreement(a, d.results.baseline, c, d.results.quality.get(c)) for c, a in agreements.items()
    }
    return switchplan.markdown(d, verdicts, plan)


def _verdict_json(
    d: Data,
    verdicts: Sequence[Verdict],
    h: Headline,
    agreements: Mapping[str, Agreement],
    engine_arms: Sequence[Arms],
) -> dict[str, Any]:
    """The bench's verdict.json: the verdicts with their output agreement, the arms, the time-shared launches."""
    vj = verdict_json(verdicts, h, interrupted=d.interrupted, switch_plan=switchplan.FILE)
    if d.results.traffic is not None:
        vj["traffic"] = d.results.traffic.to_json()
    for entry, v in zip(vj["verdicts"], verdicts, strict=True):
        entry["output_agreement"] = agreements[v.candidate].to_json()
    if engine_arms:
        vj["arms"] = [a.to_json() for a in engine_arms]
    if d.stints:
        vj["time_shared"] = {"stints": launches_json(d.stints), "stopped": d.stopped}
    if len(d.sources) > 1:
        vj["sources"] = d.sources
    return vj
