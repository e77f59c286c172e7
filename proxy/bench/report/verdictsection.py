"""The report's verdict section: per candidate, its decision and why, the regimes with their figures, the answer
for the traffic (or each measured cell), the gates and comparisons in words, the comparisons' statistics, and
its greedy-output agreement. Pure: the verdicts in, blocks out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from proxy.bench.report.agreement import Agreement, agreement_blocks
from proxy.bench.report.blocks import Block
from proxy.bench.report.tables import num
from proxy.bench.verdict.decide import Verdict
from proxy.bench.verdict.regimes import GATES
from proxy.bench.verdict.weighting import TrafficAnswer
from proxy.notation import band, faster, faster_interval

_MARK = {"ok": "✓", "inconclusive": "✗", "win": "▲", "loss": "▼", "tie": "=", "flagged": "⚑", "unresolved": "?",
         "stay": "■", "note": "·"}  # fmt: skip


def verdict_section(
    verdicts: Sequence[Verdict], agreements: Mapping[str, Agreement], random_weights: Mapping[str, str]
) -> list[Block]:
    out = [Block("h2", "Verdict")]
    for v in verdicts:
        out += verdict_blocks(v)
        ag = agreements.get(v.candidate)
        if ag is not None:
            out += agreement_blocks(ag, v.baseline, v.candidate, random_weights)
    if not verdicts:
        text = (
            "Only one engine: nothing to compare here. Join this run with another one's results "
            "(`enginemeter report --results A/results.jsonl B/results.jsonl`)."
        )
        out.append(Block("p", text))
    return out


def next_block(step: str) -> Block:
    """What to run next: a command as code, anything else as words."""
    return Block("p", f"**Next:** `{step}`" if step.startswith("enginemeter ") else f"**Next:** {step}")


def verdict_blocks(v: Verdict) -> list[Block]:
    out = [
        Block("h3", f"{v.candidate} vs {v.baseline} (baseline): **{v.decision.upper()}**{v.tag}"),
        Block("p", v.summary),
    ]
    if v.discounted:
        out.append(Block("p", f"**Discounted:** this answer {v.discounted}."))
    for c in v.caveats:
        out.append(Block("p", f"**Caveat:** {c}"))
    if v.next_step:
        out.append(next_block(v.next_step))
    out.append(_regime_table(v))
    out += _traffic_blocks(v, v.traffic) if v.traffic is not None else _cell_blocks(v) if v.cells else []
    out += _reason_lists(v)
    if v.comparisons:
        out.append(_comparison_table(v))
    return out


def _regime_table(v: Verdict) -> Block:
    rows = []
    for a in v.regimes:
        if not a.comparisons:
            rows.append([a.title, f"**{a.answer}**" + (f" ({a.fix})" if a.fix else ""), "–", "–", "–", "–", "–", "–"])
            continue
        for i, comp in enumerate(a.comparisons):
            fb, fc = comp.figures()
            decides = comp.what == a.decided_by
            rows.append(
                [
                    a.title if i == 0 else "",
                    f"**{a.answer}**" if i == 0 else "",
                    comp.what + (" (decides)" if decides else ""),
                    fb,
                    fc,
                    comp.difference(v.baseline, v.candidate),
                    band(comp.win_band),
                    comp.outcome,
                ]
            )
    header = ["regime", "regime's answer", "figure", v.baseline, v.candidate, "difference (95% CI)", "band"]
    return Block("table", header=[*header, "this figure"], rows=rows)


def _traffic_blocks(v: Verdict, traffic: TrafficAnswer) -> list[Block]:
    """The answer for the traffic given, and the measured cell each part of it was weighed by."""
    notes = "" if not traffic.notes else " (" + "; ".join(traffic.notes) + ")"
    rows = [
        [
            f"c={p.concurrency:g}",
            p.prompt,
            f"{p.weight:.0%}",
            p.cell.cell.label(),
            p.cell.what,
            faster(p.cell.speed[0]),
            p.cell.outcome,
        ]
        for p in traffic.parts
    ]
    header = ["traffic at", "prompts", "share", "measured cell", "figure", f"{v.candidate} vs {v.baseline}", "cell"]
    return [Block("p", f"*For your traffic:* {traffic.text}{notes}"), Block("table", header=header, rows=rows)]


def _cell_blocks(v: Verdict) -> list[Block]:
    rows = [
        [
            c.cell.prompt_len,
            str(c.cell.concurrency),
            c.what,
            *c.figures(),
            faster(c.speed[0]),
            faster_interval(*c.speed[1:]),
            c.outcome,
        ]
        for c in v.cells
    ]
    header = ["prompt", "c", "figure", v.baseline, v.candidate, f"{v.candidate} vs {v.baseline}", "95% CI", "cell"]
    return [
        Block("p", "*Each measured cell* (what `--traffic` weighs: the whole request at c=1, output tok/s above):"),
        Block("table", header=header, rows=rows),
    ]


def _reason_lists(v: Verdict) -> list[Block]:
    """The gates, then each comparison, in words: a mark, the step and check, the outcome and why."""
    out = []
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
    return out


def _comparison_table(v: Verdict) -> Block:
    rows = [
        [
            c.step,
            c.metric,
            c.cell.label(),
            num(c.stats.base_mean),
            num(c.stats.cand_mean),
            faster(c.speed[0]),
            faster_interval(*c.speed[1:]),
            f"{abs(c.stats.effect):.2f}" if c.stats.effect is not None else "–",
            band(c.floor),
            f"{c.bias:.1%}" if c.bias else "–",
            band(c.detectable),
            ", ".join(f"{k} {val:.0%}" for k, val in c.variation.items() if val is not None) or "–",
            c.outcome,
        ]
        for c in v.comparisons
    ]
    header = ["step", "metric", "cell", v.baseline, v.candidate, f"{v.candidate} vs {v.baseline}", "95% CI"]
    header += ["effect size d_z", "noise floor", "A/A bias", "detectable", "run-to-run CV", "outcome"]
    return Block("table", header=header, rows=rows)
