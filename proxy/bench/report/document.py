"""``Data`` -> verdict + ``report.md`` + self-contained ``report.html`` + SVG charts + ``verdict.json``.

The report is built from whatever the JSONL holds, so an interrupted bench still gets one. The document is
built once as a list of blocks and rendered twice (Markdown, HTML), so both say the same.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.report import agreement as agreement_mod
from proxy.bench.report import arms as arms_mod
from proxy.bench.report import switchplan
from proxy.bench.report import timeshared as launchreport
from proxy.bench.report.blocks import Block
from proxy.bench.report.charts import CHART_FILES, make_charts
from proxy.bench.report.render import render_html, render_md
from proxy.bench.suite import length_rank
from proxy.bench.verdict.checks import summary as protocol_checks
from proxy.bench.verdict.data import Data, load_bench, read_jsonl
from proxy.bench.verdict.decide import Verdict, decide_all
from proxy.bench.verdict.gates import cache_flags
from proxy.bench.verdict.headline import Headline, headline
from proxy.bench.verdict.inputs import Cell
from proxy.bench.verdict.regimes import GATES, weigh_next
from proxy.bench.verdict.workload import meets_slo, percentile
from proxy.notation import band, faster, faster_interval

__all__ = ["Block", "Data", "load_bench", "read_jsonl", "verdict_json", "write_report"]


def _num(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "–"
    if unit == "ms":
        return f"{x * 1000:.1f} ms"
    if abs(x) >= 100:
        return f"{x:.0f}{(' ' + unit) if unit else ''}"
    return f"{x:.{digits}g}{(' ' + unit) if unit else ''}"


def _mib(b: float | None) -> str:
    return "unknown" if b is None else f"{b / 2**20:.0f} MiB"


def _agg(vals: Iterable[float | None], unit: str = "") -> str:
    v = [x for x in vals if isinstance(x, int | float)]
    if not v:
        return "–"
    m = statistics.median(v)
    if len(v) == 1:
        return _num(m, unit)
    return f"{_num(m, unit)} ({_num(min(v), unit)}–{_num(max(v), unit)})"


_MARK = {"ok": "✓", "inconclusive": "✗", "win": "▲", "loss": "▼", "tie": "=", "flagged": "⚑", "unresolved": "?",
         "stay": "■", "note": "·"}  # fmt: skip


def _load(c: Cell) -> str:
    """The c column: the concurrency (with its rate), or a live group's observed range."""
    if c.cache == "live" and c.concurrency_max is not None and c.concurrency_max != c.concurrency:
        return f"{c.concurrency}–{c.concurrency_max}" if c.concurrency_max else f"≥{c.concurrency}"
    return f"{c.concurrency}" + (f" @ {c.rate:g}/s" if c.rate is not None else "")


def _cell_order(c: Cell) -> tuple[Any, ...]:
    return (c.rate or 0, c.concurrency, c.max_tokens, length_rank(c.prompt_len))


def document(d: Data, charts: Mapping[str, Path], chart_note: str | None, verdicts: Sequence[Verdict],
             lead: Sequence[Block] = (), agreements: Mapping[str, agreement_mod.Agreement] | None = None,
             arms: Sequence[arms_mod.Arms] = (), h: Headline | None = None) -> list[Block]:  # fmt: skip
    r = d.results
    out: list[Block] = [Block("h1", d.title)]
    if d.stopped:
        out.append(Block("p", f"**Stopped early** — {d.stopped}; the report covers only what finished."))
    elif d.interrupted:
        out.append(Block("p", "**Interrupted run** — the report covers only what finished."))
    out += answer_blocks(h or make_headline(d, verdicts))
    out += lead
    out.append(Block("h2", "Verdict"))
    for v in verdicts:
        out += _verdict_blocks(v)
        ag = (agreements or {}).get(v.candidate)
        if ag is not None:
            out += agreement_mod.blocks(ag, v.baseline, v.candidate, r.random_weights)
    if not verdicts:
        out.append(Block("p", "Only one engine: nothing to compare here. Join this run with another one's results "
                         "(`enginemeter report --results A/results.jsonl B/results.jsonl`)."))  # fmt: skip
    out += arms_mod.blocks(arms, d.engines_meta)

    out.append(Block("h2", "Engines"))
    rows = []
    measured = {s.engine for s in r.samples}
    meta = {e["name"]: e for e in d.engines_meta}
    for e in d.engines_meta:
        if e.get("aa_of") and e.get("kind") is None:  # an A/A never launched: the same engine, its original's
            keep = ("kind", "model", "quantization", "quantization_source", "slots", "context_per_slot", "info",
                    "dropped")  # fmt: skip
            e = {**e, **{k: v for k, v in meta.get(e["aa_of"], {}).items() if k in keep}}
        tag = " (baseline)" if e["name"] == r.baseline else f" (A/A pass of {e['aa_of']})" if e.get("aa_of") else ""
        if e["name"] not in measured:
            tag += ", not measured (the run ended first)" if d.stopped or d.interrupted else ", not measured"
        q = e.get("quantization") or "undeclared"
        src = e.get("quantization_source")
        dropped = e.get("dropped")
        rows.append([e["name"] + tag, str(e.get("kind")), str(e.get("model")), f"{q} ({src})" if src else q,
                     str(e.get("slots") or "–"), str(e.get("context_per_slot") or (e.get("info") or {}).get("n_ctx") or "–"),
                     "unknown" if dropped is None else ", ".join(dropped) or "none", str(e.get("url") or "–")])  # fmt: skip
    out.append(Block("table", header=["engine", "kind", "model", "quantization", "slots", "context/slot",
                                      "params dropped", "url"], rows=rows))  # fmt: skip
    out += launchreport.blocks(d.stints, d.stopped)
    if d.protocol:
        out.append(Block("h2", "Protocol"))
        out.append(Block("ul", items=d.protocol))
    aa_names = [e.name for e in r.engines if e.aa_of]
    checks = protocol_checks(list(r.samples), d.positions, r.flags, aa_names)
    if checks:
        out.append(Block("h2", "Protocol checks"))
        out.append(Block("ul", items=checks))
    out += _parity_blocks(d)
    caches = sorted({s.cell.cache for s in r.samples}, key=lambda c: ("cold", "live", "warm", c).index(c))
    for cache in caches:
        out.append(Block("h2", f"Results: {cache}" + (" cache" if cache != "live" else " mirrored traffic")))
        out += _cell_tables(d, cache)
        out += _percentile_tables(d, cache)
    out += _cache_blocks(d)
    out.append(Block("h2", "Charts"))
    if chart_note:
        out.append(Block("p", chart_note))
    for title, p in charts.items():
        out.append(Block("h3", title))
        out.append(Block("img", text=title, path=p.name))
    if d.notes:
        out.append(Block("h2", "Notes"))
        out.append(Block("ul", items=d.notes))
    out.append(Block("h2", "How to read this"))
    out.append(Block("p", "TTFT = request sent → first token event (non-empty content/reasoning/tool_calls), as the "
                     "client feels it. TPOT = (last token − first token) / (completion tokens − 1); decode tok/s is "
                     "its inverse (llama.cpp `predicted_per_second` definition); ITL = the gaps between token events "
                     "(per chunk). Output tok/s = all completion tokens of a cell repeat / its wall time. The verdict "
                     "compares paired requests (same prompt on each engine): each difference is the speed ratio of "
                     "the means in words (\"12 % faster\", \"×2.1 slower\") with a 95 % bootstrap interval "
                     "(repeats, then requests, resampled) and Cohen's d_z; a difference counts only when the whole "
                     "interval clears the noise floor measured by the A/A pass. See docs/bench.md."))  # fmt: skip
    return out


def answer_blocks(h: Headline) -> list[Block]:
    """The report's first screen: the decision in one sentence, the regimes with their figures, the trade-offs, the
    caveats and what to run next — the same lines the console ends with (``Headline.lines``)."""
    out = [Block("h2", "The answer"), Block("p", f"**{h.decision.upper()}**{h.tag} — {h.sentence}")]
    if h.traffic:
        out.append(Block("p", f"*For the traffic given:* {h.traffic}"))
    items = [f"*note:* {n}" for n in h.notes] + list(h.regimes) + [f"*trade-off:* {t}" for t in h.tradeoffs]
    items += [f"*caveat:* {c}" for c in h.caveats] + list(h.others)
    if items:
        out.append(Block("ul", items=items))
    if h.next_step:
        out.append(Block("p", f"**Next:** `{h.next_step}`" if h.next_step.startswith("enginemeter ") else
                         f"**Next:** {h.next_step}"))  # fmt: skip
    return out


def _verdict_blocks(v: Verdict) -> list[Block]:
    out = [Block("h3", f"{v.candidate} vs {v.baseline} (baseline): **{v.decision.upper()}**{v.tag}"),
           Block("p", v.summary)]  # fmt: skip
    if v.discounted:
        out.append(Block("p", f"**Discounted:** this answer {v.discounted}."))
    for c in v.caveats:
        out.append(Block("p", f"**Caveat:** {c}"))
    if v.next_step:
        out.append(Block("p", f"**Next:** `{v.next_step}`" if v.next_step.startswith("enginemeter ") else
                         f"**Next:** {v.next_step}"))  # fmt: skip
    rows = []
    for a in v.regimes:
        if not a.comparisons:
            rows.append([a.title, f"**{a.answer}**" + (f" ({a.fix})" if a.fix else ""), "–", "–", "–", "–", "–", "–"])
            continue
        for i, comp in enumerate(a.comparisons):
            fb, fc = comp.figures()
            decides = comp.what == a.decided_by
            rows.append([a.title if i == 0 else "", f"**{a.answer}**" if i == 0 else "",
                         comp.what + (" (decides)" if decides else ""), fb, fc,
                         comp.difference(v.baseline, v.candidate), band(comp.win_band), comp.outcome])  # fmt: skip
    out.append(Block("table", header=["regime", "regime's answer", "figure", v.baseline, v.candidate,
                                      "difference (95% CI)", "band", "this figure"], rows=rows))  # fmt: skip
    if v.traffic is not None:
        out.append(Block("p", f"*For your traffic:* {v.traffic.text}" + ("" if not v.traffic.notes else
                         " (" + "; ".join(v.traffic.notes) + ")")))  # fmt: skip
        rows = [[f"c={p.concurrency:g}", p.prompt, f"{p.weight:.0%}", p.cell.cell.label(), p.cell.what,
                 faster(p.cell.speed[0]), p.cell.outcome] for p in v.traffic.parts]  # fmt: skip
        out.append(Block("table", header=["traffic at", "prompts", "share", "measured cell", "figure",
                                          f"{v.candidate} vs {v.baseline}", "cell"], rows=rows))  # fmt: skip
    elif v.cells:
        rows = [[c.cell.prompt_len, str(c.cell.concurrency), c.what, *c.figures(), faster(c.speed[0]),
                 faster_interval(*c.speed[1:]), c.outcome] for c in v.cells]  # fmt: skip
        out += [Block("p", "*Each measured cell* (what `--traffic` weighs: the whole request at c=1, output tok/s "
                      "above):"),
                Block("table", header=["prompt", "c", "figure", v.baseline, v.candidate, f"{v.candidate} vs "
                                       f"{v.baseline}", "95% CI", "cell"], rows=rows)]  # fmt: skip
    gates = [x for x in v.reasons if x.step in GATES]
    speed = [x for x in v.reasons if x.step not in GATES]
    for title, xs in (("Gates", gates), ("Each comparison", speed)):
        items = []
        for x in xs:
            tail = " — *not decisive* (the verdict stopped at an earlier gate)" if not x.decisive else ""
            check = f"/{x.check}" if x.check else ""
            items.append(f"{_MARK.get(x.outcome, '·')} [{x.step}{check}] {x.outcome}: {x.text}{tail}")
        if items:
            out += [Block("p", f"*{title}:*"), Block("ul", items=items)]
    if v.comparisons:
        rows = [[c.step, c.metric, c.cell.label(), _num(c.stats.base_mean), _num(c.stats.cand_mean),
                 faster(c.speed[0]), faster_interval(*c.speed[1:]),
                 f"{abs(c.stats.effect):.2f}" if c.stats.effect is not None else "–", band(c.floor),
                 f"{c.bias:.1%}" if c.bias else "–", band(c.detectable),
                 ", ".join(f"{k} {val:.0%}" for k, val in c.variation.items() if val is not None) or "–",
                 c.outcome] for c in v.comparisons]  # fmt: skip
        out.append(Block("table", header=["step", "metric", "cell", v.baseline, v.candidate,
                                          f"{v.candidate} vs {v.baseline}", "95% CI", "effect size d_z", "noise floor",
                                          "A/A bias", "detectable", "run-to-run CV", "outcome"], rows=rows))  # fmt: skip
    return out


def _parity_blocks(d: Data) -> list[Block]:
    names = [e.name for e in d.results.engines if not e.aa_of]
    out = [Block("h2", "Prompt-token parity")]
    by: dict[str, dict[str, Any]] = {}
    methods: dict[str, str] = {}
    for t in d.tokenized:
        by.setdefault(t["prompt"], {})[t["engine"]] = t.get("tokens")
        methods[t["engine"]] = str(t.get("method"))
    rows = []
    for pid, m in by.items():
        vals = [m.get(n) for n in names]
        known = [x for x in vals if isinstance(x, int)]
        eq = "–" if len(known) < 2 else ("equal" if len(set(known)) == 1 else "**DIFFER**")
        rows.append([pid, *[str(x) if x is not None else "?" for x in vals], eq])
    if rows:
        out.append(Block("p", "Counted with each engine's own tokenizer before the run ("
                         + "; ".join(f"{n}: {methods.get(n, '?')}" for n in names) + ")."))  # fmt: skip
        out.append(Block("table", header=["prompt", *names, "parity"], rows=rows))
    pt = d.results.prompt_tokens
    keys = [k for k in pt.get(names[0], {}) if k.startswith("usage:")] if names else []
    common = [k for k in keys if all(k in pt.get(n, {}) for n in names)]
    if common:
        diff = [k for k in common if len({pt[n][k] for n in names}) > 1]
        out.append(Block("p", f"Engine-reported `usage.prompt_tokens` of identical requests: {len(common) - len(diff)} "
                         f"of {len(common)} equal on all engines."))  # fmt: skip
    if not rows and not common:
        out.append(Block("p", "No prompt-token counts on both engines."))
    return out


_METRICS = (("TTFT", "ttft_s", "ms"), ("TPOT", "tpot_s", "ms"), ("decode tok/s", "decode_tps", ""),
            ("e2e", "e2e_s", "ms"), ("output tok/s", "output_tps", ""))  # fmt: skip


def _cell_tables(d: Data, cache: str) -> list[Block]:
    r = d.results
    names = [e.name for e in r.engines]
    samples = [s for s in r.samples if s.cell.cache == cache]
    rows = []
    for c in sorted({s.cell for s in samples}, key=_cell_order):
        for n in names:
            mine = [s for s in samples if s.cell == c and s.engine == n]
            if not mine:
                continue
            err = sum(s.n_err for s in mine)
            ok = sum(s.n_ok for s in mine)
            mem = [s.gpu_mem_peak_bytes for s in mine if s.gpu_mem_peak_bytes is not None]
            load = _load(c)
            rows.append([load, str(c.max_tokens), c.prompt_len, n, str(len(mine)),
                         *[_agg((getattr(s, attr) for s in mine), unit) for _, attr, unit in _METRICS],
                         _agg(s.prompt_tokens for s in mine), _agg(s.completion_tokens for s in mine),
                         f"{err}/{ok + err}" if err else "0", _mib(max(mem)) if mem else "unknown"])  # fmt: skip
    header = ["c", "max_tokens", "prompt", "engine", "repeats", *[m[0] for m in _METRICS], "prompt tokens",
              "out tokens", "errors", "GPU mem peak"]  # fmt: skip
    note = ("Each figure: median over repeats (min–max) of the per-repeat median over requests; output tok/s is "
            "per repeat (all requests' completion tokens / wall time). `c @ R/s`: open-loop arrivals at R "
            "requests/s, at most c in flight.")  # fmt: skip
    return [Block("p", note), Block("table", header=header, rows=rows)]


def _percentile_tables(d: Data, cache: str) -> list[Block]:
    by: dict[tuple[str, Cell], list[dict[str, Any]]] = {}
    for q in d.requests:
        if q.get("phase", "measure") == "measure" and q.get("cache") == cache and q.get("ok"):
            rate = q.get("rate")
            cell = Cell(cache, int(q["concurrency"]), int(q["max_tokens"]), str(q["prompt_len"]), rate)
            by.setdefault((str(q["engine"]), cell), []).append(q)
    if not by:
        return []
    slo = d.goodput
    rows = []
    for (engine, c), reqs in sorted(by.items(), key=lambda kv: (_cell_order(kv[0][1]), kv[0][0])):
        row = [_load(c), str(c.max_tokens),
               c.prompt_len, engine, str(len(reqs))]  # fmt: skip
        for attr in ("ttft_s", "tpot_s", "itl_s"):
            vals = [float(g) for q in reqs for g in (q.get(attr) or [])] if attr == "itl_s" else [
                float(q[attr]) for q in reqs if isinstance(q.get(attr), int | float)]  # fmt: skip
            few = len(vals) < 100  # a p99 of fewer than 100 values is the largest or next-to-largest one
            row.append(" / ".join(_num(percentile(vals, p), "ms") + ("†" if p == 99 and few else "")
                                  for p in (50, 90, 99)) if vals else "–")  # fmt: skip
        if slo:
            good = sum(1 for q in reqs if meets_slo(q, slo))
            row.append(f"{good}/{len(reqs)} ({good / len(reqs):.0%})")
        rows.append(row)
    header = ["c", "max_tokens", "prompt", "engine", "requests", "TTFT p50 / p90 / p99", "TPOT p50 / p90 / p99",
              "ITL p50 / p90 / p99"] + (["within SLO (goodput)"] if slo else [])  # fmt: skip
    return [Block("p", "Latency percentiles over every measured request of the cell (all repeats). † p99 of fewer "
                  "than 100 values: it is about the largest one, not a tail estimate."),
            Block("table", header=header, rows=rows)]  # fmt: skip


def _cache_blocks(d: Data) -> list[Block]:
    reqs = [q for q in d.results.requests if q.ok and q.cell.cache in ("cold", "warm")]
    if not reqs:
        return []
    flags = cache_flags(d.results.requests, d.results.shared_prefix)
    by: dict[tuple[str, Cell], list[tuple[int | None, int | None]]] = {}
    for q in reqs:
        by.setdefault((q.engine, q.cell), []).append((q.cached_tokens, q.prompt_tokens))
    rows = []
    for (engine, c), vals in sorted(by.items(), key=lambda kv: (kv[0][1].cache, _cell_order(kv[0][1]), kv[0][0])):
        cached = sum(x or 0 for x, _ in vals)
        prompt = sum(p or 0 for _, p in vals)
        unknown = sum(1 for x, _ in vals if x is None)
        rows.append([c.label(), engine, f"{cached}/{prompt} ({cached / prompt:.0%})" if prompt else "–",
                     str(unknown) if unknown else "0", "**" + flags[(engine, c)] + "**" if (engine, c) in flags else "ok"])  # fmt: skip
    note = ("Cold cells must show no request served from the prompt cache (under half its prompt cached: the chat "
            "template's preamble may be), warm cells cached tokens on every request; a flagged cell in the judged "
            "phase stops the verdict at the data gate.")  # fmt: skip
    if d.results.shared_prefix:
        note += " Shared-prefix suite: cold requests share their document by design, so the cold check is off."
    return [Block("h2", "Cache accounting"), Block("p", note),
            Block("table", header=["cell", "engine", "cached / prompt tokens", "unknown", "check"], rows=rows)]  # fmt: skip


#: 3: the headline (the one answer every screen prints), each verdict's cells, traffic answer and caveats, the
#: traffic profile used, decisions depends and not yet
VERDICT_VERSION = 3


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


def write_report(
    d: Data, out: Path, *, lead: Sequence[Block] = (), extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Write report.md, report.html, the charts, verdict.json and switch-plan.md into ``out``; returns the verdicts
    and paths.
    ``lead``: blocks before the verdict (``tune``'s table), ``extra``: keys added to verdict.json."""
    out.mkdir(parents=True, exist_ok=True)
    for name in CHART_FILES:
        (out / f"{name}.svg").unlink(missing_ok=True)  # a chart this run does not draw must not survive
    verdicts = decide_all(d.results)
    charts, note = make_charts(d, out, verdicts)
    agreements = {v.candidate: agreement_mod.agreement(d.requests, v.baseline, v.candidate) for v in verdicts}
    arms = arms_mod.arms(d.engines_meta, d.results.baseline, verdicts)
    h = make_headline(d, verdicts)
    blocks = document(d, charts, note, verdicts, lead, agreements, arms, h)
    (out / "report.md").write_text(render_md(blocks), encoding="utf-8")
    (out / "report.html").write_text(render_html(blocks, out), encoding="utf-8")
    plan = {c: switchplan.from_agreement(a, d.results.baseline, c) for c, a in agreements.items()}
    (out / switchplan.FILE).write_text(switchplan.markdown(d, verdicts, plan, random_weights=d.results.random_weights),
                                       encoding="utf-8")  # fmt: skip
    vj = verdict_json(verdicts, h, interrupted=d.interrupted, switch_plan=switchplan.FILE)
    if d.results.traffic is not None:
        vj["traffic"] = d.results.traffic.to_json()
    for entry, v in zip(vj["verdicts"], verdicts, strict=True):
        entry["output_agreement"] = agreements[v.candidate].to_json()
    if arms:
        vj["arms"] = [a.to_json() for a in arms]
    if d.stints:
        vj["time_shared"] = {"stints": launchreport.launches_json(d.stints), "stopped": d.stopped}
    if len(d.sources) > 1:
        vj["sources"] = d.sources
    vj.update(extra or {})
    (out / "verdict.json").write_text(json.dumps(vj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {"report_md": out / "report.md", "report_html": out / "report.html", "verdict_json": out / "verdict.json",
            "switch_plan": out / switchplan.FILE, "charts": list(charts.values()), "verdicts": verdicts,
            "arms_lines": [a.text for a in arms], "headline": h}  # fmt: skip


def make_headline(d: Data, verdicts: Sequence[Verdict]) -> Headline:
    """The report's one answer: the verdicts read together (a same-file arm is attribution), for the traffic."""
    meta = {m["name"]: m for m in d.engines_meta}
    base = meta.get(d.results.baseline, {})
    weights = {v.candidate: arms_mod.weights(base, meta[v.candidate]) for v in verdicts if v.candidate in meta}
    kinds = {v.candidate: str(meta[v.candidate].get("kind")) for v in verdicts if v.candidate in meta}
    t = d.results.traffic
    # the command that weighs these results by a traffic: any switching verdict's cells give the levels measured
    switch = next((v for v in verdicts if v.decision == "switch" and v.cells), None)
    weigh = weigh_next(d.results, switch.cells) if switch is not None and t is None else None
    return headline(verdicts, weights, kinds, f"{t.text()} ({t.source})" if t is not None else None,
                    ended=bool(d.interrupted or d.stopped), weigh=weigh)  # fmt: skip
