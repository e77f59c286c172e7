"""``enginemeter tune``'s answer: the table (``proxy.bench.report.tunetable``), the best setting per regime and the
rule, read from the bench's own verdicts of each setting against the first (``proxy.bench.verdict.decide``). Pure
but for the chart and a look for a free ``--out`` name.

The rule (the people who asked for this tool, docs/tune.md): if a setting raises throughput under load (or single-
request decode) beyond the noise floor — or, where the throughput does not separate the settings, cuts TTFT under
load beyond its floor (``proxy.bench.verdict.regimes``) — **tuning helps** — keep llama.cpp with it, and when
its memory peak rose with it the bottleneck is batching and KV allocation (keep tuning: ``-b``/``-ub``, ``-c``);
if no setting is better beyond the noise and every estimate sits inside it, **tuning is flat** — and with memory
not full, the limit is the engine's: compare engines next (the bench command is given). Memory nearly full (≥ 90 % of the
budget or of the GPU) changes the advice to freeing memory first. An estimate beyond the noise floor whose
interval still reaches inside it is neither: **unresolved**, with the repeats that would decide it.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.bench.outdir import fresh, held
from proxy.bench.report.blocks import Block
from proxy.bench.report.charts import tune_chart
from proxy.bench.report.tunetable import Row, setting_rows, table
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import Comparison, Verdict, decide_all
from proxy.bench.verdict.regimes import GATES, rerun
from proxy.notation import band, faster, faster_ci, faster_interval, gib

#: a peak this close to the budget (or the GPU's total) is "memory is full"
FULL = 0.90


@dataclass
class TuneSummary:
    flag: str
    rows: list[Row]
    rule: str  # helps | flat | unresolved | inconclusive
    lines: list[str]
    best: dict[str, str | None]
    bench_command: str | None
    blocks: list[Block] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "flag": self.flag,
            "rule": self.rule,
            "text": self.lines,
            "best": self.best,
            "bench_command": self.bench_command,
            "settings": [r.to_json() for r in self.rows],
        }

    def json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n"

    def table_text(self) -> str:
        header, rows = table(self.flag, self.rows)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join(fmt.format(*r).rstrip() for r in (header, *rows))


def _winning(v: Verdict, step: str) -> Comparison | None:
    """The comparison that carries a regime's win (its primary figure when that won)."""
    wins = [c for c in v.comparisons if c.step == step and c.outcome == "win"]
    return next((c for c in wins if c.primary), wins[0] if wins else None)


def _gain(c: Comparison) -> str:
    """The candidate's gain in words, one notation (``proxy.notation``): "output tok/s at c=16 90 %
    faster (78–104 % faster)"."""
    r, lo, hi = c.speed
    return f"{c.what} {faster_ci(r, lo, hi)}"


def _memory(d: Data, rows: Sequence[Row]) -> tuple[str, float | None]:
    """("full" | "not full" | "unknown", the fullest share)."""
    r = d.results
    peaks = [x.memory_peak_bytes for x in rows if x.memory_peak_bytes is not None]
    if not peaks:
        return "unknown", None
    totals = [s.gpu_mem_total_bytes for s in r.samples if s.gpu_mem_total_bytes]
    cap = r.memory_budget_bytes or (max(totals) if totals else None)
    if not cap:
        return "unknown", None
    share = max(peaks) / cap
    return ("full" if share >= FULL else "not full"), share


BENCH_OUT = Path("bench-out")


def bench_command(best: Row, flag: str) -> str:
    """What to run next: this setting against SGLang, each launched alone (edit the SGLang command's model)."""
    sglang = "python -m sglang.launch_server --model-path MODEL --port {port}"
    return shlex.join(
        [
            "enginemeter",
            "bench",
            "--launch",
            f"llama={best.command}",
            "--launch",
            f"sglang={sglang}",
            "--out",
            str(BENCH_OUT if not held(BENCH_OUT) else fresh(BENCH_OUT)),
        ]
    )


def best_setting(usable: Sequence[Verdict], step: str) -> tuple[Verdict, Comparison] | None:
    """The setting that wins this regime most (a regime that also lost a figure is a trade-off). Among the
    settings that win it, the largest gain over both of its figures (the primary — concurrent throughput,
    single-request decode — and the one beside it, TTFT), each the point estimate of its log ratio against
    the first setting: a setting that gives up less on one figure than it gains on the other is the better one.
    Ties go to the primary figure. CI saw both ways of ranking one figure at a time pick the setting a user
    would not: -np 2 over -np 4 at c=4 on throughput +19 % vs +16 % (overlapping) while -np 4's TTFT was ×12
    and -np 2's ×1.7; then -np 2 (+11 % [+8.6 … +14 %]) over -np 4 (throughput unresolved, +3 %) while
    -np 4's TTFT under load was ×10.6 and -np 2's ×1.6."""
    wins = [
        (v, c)
        for v in usable
        if (c := _winning(v, step)) is not None and any(a.step == step and a.answer == "win" for a in v.regimes)
    ]
    if not wins:
        return None

    def figure(v: Verdict, primary: bool) -> float:
        return next((x.log_gain[0] for x in v.comparisons if x.step == step and x.primary is primary), 0.0)

    return max(wins, key=lambda vc: (figure(vc[0], True) + figure(vc[0], False), figure(vc[0], True)))


def summarize(d: Data, out: Path) -> TuneSummary:
    """The tune's answer from its results: each setting's row, the best per regime, the rule and its lines."""
    t = (d.runs[0].get("config") or {}).get("tune") or {}
    flag = str(t.get("flag") or "setting")
    names = list(t.get("names") or [e.name for e in d.results.engines if not e.aa_of])
    values = [str(v) for v in (t.get("values") or names)]
    commands = [next((str(e.get("launch") or "") for e in d.engines_meta if e["name"] == n), "") for n in names]
    verdicts = {v.candidate: v for v in decide_all(d.results)}
    rows = setting_rows(d, names, values, commands)
    _answer_regimes(rows[1:], verdicts)
    usable = [verdicts[r.name] for r in rows[1:] if r.name in verdicts and verdicts[r.name].stopped_at not in GATES]
    first = rows[0]
    by_name = {r.name: r for r in rows}
    b_load, b_single = best_setting(usable, "throughput"), best_setting(usable, "decode")
    lines = [_best_line(flag, first, by_name, b_single, b_load)]
    command: str | None = None
    best = b_load or b_single
    if best is not None:
        rule = "helps"
        lines += _helps(flag, first, by_name[best[0].candidate], *best)
    elif not usable and len(rows) > 1:
        rule = "inconclusive"
        v0 = next(iter(verdicts.values()), None)
        lines.append("tune could not compare the settings: " + (v0.summary if v0 else "no verdict"))
    elif looks := _looks_different(usable):
        rule = "unresolved"
        lines.append(_unresolved(d, flag, by_name, looks))
    else:
        rule = "flat"
        command = bench_command(first, flag)
        lines += _flat(d, flag, rows, by_name, usable, command)
    best_names: dict[str, str | None] = {
        "single_request": b_single[0].candidate if b_single else first.name,
        "under_load": b_load[0].candidate if b_load else first.name,
    }
    s = TuneSummary(flag, rows, rule, lines, best_names, command)
    s.blocks = _blocks(s, d, out)
    return s


def _answer_regimes(rows: Sequence[Row], verdicts: Mapping[str, Verdict]) -> None:
    """Each later setting's regime answers against the first (or the gate its verdict stopped at)."""
    for row in rows:
        v = verdicts.get(row.name)
        if v is not None:
            regimes = {a.step: a.answer for a in v.regimes}
            gate = v.stopped_at in GATES
            row.single = f"stopped at {v.stopped_at}" if gate else regimes.get("decode", "–")
            row.under_load = f"stopped at {v.stopped_at}" if gate else regimes.get("throughput", "–")


def _best_line(
    flag: str,
    first: Row,
    by_name: Mapping[str, Row],
    b_single: tuple[Verdict, Comparison] | None,
    b_load: tuple[Verdict, Comparison] | None,
) -> str:
    def best(b: tuple[Verdict, Comparison] | None) -> str:
        if b is None:
            return f"{flag} {first.value} (no other setting faster beyond the noise)"
        return f"{flag} {by_name[b[0].candidate].value} ({_gain(b[1])})"

    load = f"under load (c={first.concurrency or '?'})"
    return f"best setting per regime: single request: {best(b_single)}; {load}: {best(b_load)}"


def _helps(flag: str, first: Row, row: Row, v: Verdict, c: Comparison) -> list[str]:
    """Tuning helps: the setting to keep and its gain, what it gives up, and what its memory says."""
    extra = ""
    if c.metric != "output_tps":
        tps = next((x for x in v.comparisons if x.metric == "output_tps"), None)
        if tps is not None:  # TTFT decided: the throughput did not separate them, and how far it leans
            extra = f"; {tps.what} {faster(tps.speed[0])}, {tps.outcome}" + (
                f" (95% CI {faster_interval(*tps.speed[1:])}, band {band(tps.win_band)})"
                if tps.outcome == "unresolved"
                else ""
            )
    lines = [f"tuning helps: keep llama.cpp with {flag} {row.value} ({_gain(c)}{extra})"]
    for x in v.comparisons:
        if x.outcome == "loss":
            lines.append(
                f"  trade-off: {flag} {row.value} loses {_gain(x)} ({x.cell.label()}) — weigh it by your traffic"
            )
    if row.memory_peak_bytes is None or not first.memory_peak_bytes:
        return [*lines, "  memory not measured here (no GPU readings): the rule's memory half is open"]
    grew = row.memory_peak_bytes > 1.05 * first.memory_peak_bytes
    tight = (
        ": throughput rises while memory tightens — the bottleneck is batching and KV allocation; "
        "keep tuning llama.cpp (-b/-ub at this setting, then -c)"
    )
    lines.append(
        f"  memory peak {gib(first.memory_peak_bytes)} ({flag} {first.value}) → "
        f"{gib(row.memory_peak_bytes)} ({flag} {row.value})" + (tight if grew else "")
    )
    return lines


def _looks_different(usable: Sequence[Verdict]) -> list[tuple[Verdict, Comparison]]:
    """Estimates beyond the band whose interval still reaches inside it: not flat, not decided."""
    return [
        (v, c)
        for v in usable
        for c in v.comparisons
        if c.step in ("decode", "throughput")
        and c.outcome == "unresolved"
        and abs(c.log_gain[0]) > math.log1p(c.win_band)
    ]


def _unresolved(d: Data, flag: str, by_name: Mapping[str, Row], looks: Sequence[tuple[Verdict, Comparison]]) -> str:
    v, c = max(looks, key=lambda vc: abs(vc[1].log_gain[0]))
    n = c.repeats_to_resolve()
    fix = rerun(d.results.command, f"--repeats {n}") if n else "a quieter machine or more requests per repeat"
    return (
        f"not decided: {flag} {by_name[v.candidate].value} looks different ({_gain(c)}, {c.cell.label()}) "
        f"but the interval reaches inside this run's noise floor {band(c.win_band)} — neither 'helps' "
        f"nor 'flat'; next: {fix}"
    )


def _flat(
    d: Data, flag: str, rows: Sequence[Row], by_name: Mapping[str, Row], usable: Sequence[Verdict], command: str
) -> list[str]:
    """Tuning is flat: how flat, the settings that were slower, and what memory says to do next."""
    memory, share = _memory(d, rows)
    ties = all(a.answer in ("tie", "not measured") for v in usable for a in v.regimes)
    how = (
        "every difference inside the minimum effect"
        if ties
        else "every estimate inside this run's noise floor, no setting better beyond it"
    )
    worse = [
        f"{flag} {by_name[v.candidate].value}"
        for v in usable
        if v.decision == "stay" and any(a.answer == "loss" for a in v.regimes)
    ]
    how += f"; {', '.join(worse)} slower" if worse else ""
    if memory == "full":
        line = (
            f"tuning is flat ({how}) but memory is nearly full ({share:.0%} of the budget or GPU): free "
            "memory first (a smaller -c, a quantized KV cache -ctk/-ctv q8_0), then compare engines"
        )
    elif memory == "not full":
        line = (
            f"tuning is flat ({how}) and memory is not full (peak {share:.0%} of the budget or GPU): "
            "the limit is the engine's — compare engines next:"
        )
    else:
        line = f"tuning is flat ({how}; memory not measured: no GPU readings) — compare engines next:"
    return [line, f"  {command}"]


def _blocks(s: TuneSummary, d: Data, out: Path) -> list[Block]:
    header, rows = table(s.flag, s.rows)
    blocks = [
        Block("h2", f"Tuning {s.flag}: {s.rule}"),
        Block("ul", items=[x.strip() for x in s.lines]),
        Block(
            "p",
            f"Each {s.flag} launched alone with the same requests, the first one again at the end for the "
            "noise floor; each later setting judged against the first (its verdict below). Prompt eval and "
            "decode are per token at concurrency 1 (prompt eval from llama.cpp's own timings); memory is the "
            "engine's peak while generating.",
        ),
        Block("table", header=header, rows=rows),
    ]
    chart = tune_chart(s.flag, [(r.value, r.single_tps, r.concurrent_tps) for r in s.rows], s.rows[0].concurrency, out)
    if chart is not None:
        blocks += [Block("h3", f"tok/s by {s.flag}"), Block("img", text=f"tok/s by {s.flag}", path=chart.name)]
    return blocks
