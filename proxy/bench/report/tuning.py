"""``enginemeter tune``'s answer: the table (one row per setting), the best setting per regime and the rule, read
from the bench's own verdicts of each setting against the first (``proxy.bench.verdict.decide``). Pure but for the
chart and a look for a free ``--out`` name.

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
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.bench.outdir import fresh, held
from proxy.bench.report.blocks import Block
from proxy.bench.report.charts import tune_chart
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.decide import Comparison, Verdict, decide_all
from proxy.bench.verdict.inputs import Cell, Sample
from proxy.bench.verdict.regimes import GATES, rerun
from proxy.notation import band, faster, faster_ci, faster_interval, gib

#: a peak this close to the budget (or the GPU's total) is "memory is full"
FULL = 0.90


@dataclass
class Row:
    name: str
    value: str
    command: str
    memory_peak_bytes: int | None = None
    load_s: float | None = None
    prompt_ms_per_token: float | None = None
    decode_ms_per_token: float | None = None
    single_tps: tuple[float, float, float] | None = None  # median, min, max over repeats
    ttft_single_s: float | None = None
    concurrency: int | None = None
    concurrent_tps: tuple[float, float, float] | None = None
    ttft_load_s: float | None = None
    single: str = "baseline"  # the regime answers against the first setting
    under_load: str = "baseline"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "command": self.command,
                "memory_peak_bytes": self.memory_peak_bytes, "load_s": self.load_s,
                "prompt_eval_ms_per_token": self.prompt_ms_per_token, "decode_ms_per_token": self.decode_ms_per_token,
                "single_tps": self.single_tps[0] if self.single_tps else None, "ttft_single_s": self.ttft_single_s,
                "concurrency": self.concurrency,
                "concurrent_tps": self.concurrent_tps[0] if self.concurrent_tps else None,
                "ttft_under_load_s": self.ttft_load_s, "single_request": self.single, "under_load": self.under_load}  # fmt: skip


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
        return {"flag": self.flag, "rule": self.rule, "text": self.lines, "best": self.best,
                "bench_command": self.bench_command, "settings": [r.to_json() for r in self.rows]}  # fmt: skip

    def json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n"

    def table_text(self) -> str:
        header, rows = table(self)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*header), *(fmt.format(*r) for r in rows)])


def _med(vals: Sequence[float | None]) -> float | None:
    v = [float(x) for x in vals if isinstance(x, int | float)]
    return statistics.median(v) if v else None


def _spread(vals: Sequence[float | None]) -> tuple[float, float, float] | None:
    v = [float(x) for x in vals if isinstance(x, int | float)]
    return (statistics.median(v), min(v), max(v)) if v else None


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.1f} ms" if x < 10 else f"{x:.1f} s"


def table(s: TuneSummary) -> tuple[list[str], list[list[str]]]:
    conc = next((r.concurrency for r in s.rows if r.concurrency), None)
    header = [s.flag, "memory peak", "load", "prompt eval", "decode", "single tok/s", f"c={conc or '?'} tok/s",
              "TTFT c=1", f"TTFT c={conc or '?'}", "single request", "under load"]  # fmt: skip
    rows = []
    for r in s.rows:
        rows.append([
            r.value, gib(r.memory_peak_bytes) if r.memory_peak_bytes is not None else "unknown",
            f"{r.load_s:.1f} s" if r.load_s is not None else "–",
            f"{r.prompt_ms_per_token:.2f} ms/token" if r.prompt_ms_per_token is not None else "–",
            f"{r.decode_ms_per_token:.2f} ms/token" if r.decode_ms_per_token is not None else "–",
            f"{r.single_tps[0]:.0f}" if r.single_tps else "–", f"{r.concurrent_tps[0]:.0f}" if r.concurrent_tps else "–",
            _ms(r.ttft_single_s), _ms(r.ttft_load_s), r.single, r.under_load,
        ])  # fmt: skip
    return header, rows


def _rows(d: Data, names: Sequence[str], values: Sequence[str], commands: Sequence[str]) -> list[Row]:
    r = d.results
    judged = "cold" if any(s.cell.cache == "cold" for s in r.samples) else "warm"
    base = Cell(judged, 1, r.base_max_tokens or 0, r.base_prompt_len or "")
    load = [s.cell for s in r.samples if s.cell.cache == judged and s.cell.concurrency > 1 and s.cell.rate is None
            and s.cell.max_tokens == base.max_tokens and s.cell.prompt_len == base.prompt_len]  # fmt: skip
    top = max(load, key=lambda c: c.concurrency, default=None)
    stints = {s.get("engine"): s for s in d.stints if s.get("role") != "aa"}
    out = []
    for name, value, command in zip(names, values, commands, strict=True):
        mine: list[Sample] = [s for s in r.samples if s.engine == name]
        single = [s for s in mine if s.cell == base]
        under = [s for s in mine if s.cell == top]
        la = (stints.get(name) or {}).get("launch") or {}
        peak = ((la.get("memory") or {}).get("peak") or {}).get("engine_bytes")
        if peak is None:
            peaks = [s.gpu_mem_peak_bytes for s in mine if s.gpu_mem_peak_bytes is not None]
            peak = max(peaks) if peaks else None
        prompt = []
        for q in d.requests:
            if (q.get("engine") == name and q.get("phase") == "measure" and q.get("concurrency") == 1
                    and q.get("cache") == judged and q.get("prompt_len") == base.prompt_len):  # fmt: skip
                t = q.get("engine_timings") or {}
                if t.get("prompt_ms") is not None and t.get("prompt_n"):
                    prompt.append(float(t["prompt_ms"]) / float(t["prompt_n"]))
        tpot = _med([s.tpot_s for s in single])
        out.append(Row(name, value, command, peak, la.get("ready_s"), _med(prompt),
                       tpot * 1000 if tpot else None, _spread([1 / s.tpot_s for s in single if s.tpot_s]),
                       _med([s.ttft_s for s in single]), top.concurrency if top else None,
                       _spread([s.output_tps for s in under]), _med([s.ttft_s for s in under])))  # fmt: skip
    return out


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
    return shlex.join(["enginemeter", "bench", "--launch", f"llama={best.command}", "--launch", f"sglang={sglang}",
                       "--out", str(BENCH_OUT if not held(BENCH_OUT) else fresh(BENCH_OUT))])  # fmt: skip


def best_setting(usable: Sequence[Verdict], step: str) -> tuple[Verdict, Comparison] | None:
    """The setting that wins this regime most (a regime that also lost a figure is a trade-off). Among the
    settings that win it, the largest gain over both of its figures (the primary — concurrent throughput,
    single-request decode — and the one beside it, TTFT), each the point estimate of its log ratio against
    the first setting: a setting that gives up less on one figure than it gains on the other is the better one.
    Ties go to the primary figure. CI saw both ways of ranking one figure at a time pick the setting a user
    would not: -np 2 over -np 4 at c=4 on throughput +19 % vs +16 % (overlapping) while -np 4's TTFT was ×12
    and -np 2's ×1.7; then -np 2 (+11 % [+8.6 … +14 %]) over -np 4 (throughput unresolved, +3 %) while
    -np 4's TTFT under load was ×10.6 and -np 2's ×1.6."""
    wins = [(v, c) for v in usable if (c := _winning(v, step)) is not None
            and any(a.step == step and a.answer == "win" for a in v.regimes)]  # fmt: skip
    if not wins:
        return None

    def figure(v: Verdict, primary: bool) -> float:
        return next((x.log_gain[0] for x in v.comparisons if x.step == step and x.primary is primary), 0.0)

    return max(wins, key=lambda vc: (figure(vc[0], True) + figure(vc[0], False), figure(vc[0], True)))


def summarize(d: Data, out: Path) -> TuneSummary:
    t = (d.runs[0].get("config") or {}).get("tune") or {}
    flag = str(t.get("flag") or "setting")
    names = list(t.get("names") or [e.name for e in d.results.engines if not e.aa_of])
    values = [str(v) for v in (t.get("values") or names)]
    commands = [next((str(e.get("launch") or "") for e in d.engines_meta if e["name"] == n), "") for n in names]
    verdicts = {v.candidate: v for v in decide_all(d.results)}
    rows = _rows(d, names, values, commands)
    for row in rows[1:]:
        v = verdicts.get(row.name)
        if v is not None:
            regimes = {a.step: a.answer for a in v.regimes}
            gate = v.stopped_at in GATES
            row.single = f"stopped at {v.stopped_at}" if gate else regimes.get("decode", "–")
            row.under_load = f"stopped at {v.stopped_at}" if gate else regimes.get("throughput", "–")
    usable = [verdicts[r.name] for r in rows[1:] if r.name in verdicts and verdicts[r.name].stopped_at not in GATES]
    first = rows[0]
    by_name = {r.name: r for r in rows}

    b_load, b_single = best_setting(usable, "throughput"), best_setting(usable, "decode")
    memory, share = _memory(d, rows)
    lines: list[str] = []
    conc = first.concurrency
    lines.append("best setting per regime: single request: "
                 + (f"{flag} {by_name[b_single[0].candidate].value} ({_gain(b_single[1])})" if b_single else
                    f"{flag} {first.value} (no other setting faster beyond the noise)")
                 + f"; under load (c={conc or '?'}): "
                 + (f"{flag} {by_name[b_load[0].candidate].value} ({_gain(b_load[1])})" if b_load else
                    f"{flag} {first.value} (no other setting faster beyond the noise)"))  # fmt: skip
    command: str | None = None
    if b_load or b_single:
        rule = "helps"
        v, c = b_load or b_single  # type: ignore[misc]
        row = by_name[v.candidate]
        extra = ""
        if c.metric != "output_tps":
            tps = next((x for x in v.comparisons if x.metric == "output_tps"), None)
            if tps is not None:  # TTFT decided: the throughput did not separate them, and how far it leans
                extra = f"; {tps.what} {faster(tps.speed[0])}, {tps.outcome}" + (
                    f" (95% CI {faster_interval(*tps.speed[1:])}, band {band(tps.win_band)})"
                    if tps.outcome == "unresolved" else "")  # fmt: skip
        lines.append(f"tuning helps: keep llama.cpp with {flag} {row.value} ({_gain(c)}{extra})")
        for x in v.comparisons:
            if x.outcome == "loss":
                lines.append(f"  trade-off: {flag} {row.value} loses {_gain(x)} ({x.cell.label()}) — weigh it by your "
                             "traffic")  # fmt: skip
        if row.memory_peak_bytes is not None and first.memory_peak_bytes:
            grew = row.memory_peak_bytes > 1.05 * first.memory_peak_bytes
            lines.append(f"  memory peak {gib(first.memory_peak_bytes)} ({flag} {first.value}) → "
                         f"{gib(row.memory_peak_bytes)} ({flag} {row.value})"
                         + (": throughput rises while memory tightens — the bottleneck is batching and KV allocation; "
                            "keep tuning llama.cpp (-b/-ub at this setting, then -c)" if grew else ""))  # fmt: skip
        else:
            lines.append("  memory not measured here (no GPU readings): the rule's memory half is open")
    elif not usable and len(rows) > 1:
        rule = "inconclusive"
        v0 = next(iter(verdicts.values()), None)
        lines.append("tune could not compare the settings: " + (v0.summary if v0 else "no verdict"))
    elif looks := [(v, c) for v in usable for c in v.comparisons if c.step in ("decode", "throughput")
                   and c.outcome == "unresolved" and abs(c.log_gain[0]) > math.log1p(c.win_band)]:  # fmt: skip
        # an estimate beyond the band whose interval still reaches inside it: not flat, not decided
        rule = "unresolved"
        v, c = max(looks, key=lambda vc: abs(vc[1].log_gain[0]))
        n = c.repeats_to_resolve()
        fix = rerun(d.results.command, f"--repeats {n}") if n else "a quieter machine or more requests per repeat"
        lines.append(f"not decided: {flag} {by_name[v.candidate].value} looks different ({_gain(c)}, {c.cell.label()}) "
                     f"but the interval reaches inside this run's noise floor {band(c.win_band)} — neither 'helps' "
                     f"nor 'flat'; next: {fix}")  # fmt: skip
    else:
        rule = "flat"
        ties = all(a.answer in ("tie", "not measured") for v in usable for a in v.regimes)
        how = ("every difference inside the minimum effect" if ties else
               "every estimate inside this run's noise floor, no setting better beyond it")  # fmt: skip
        worse = [f"{flag} {by_name[v.candidate].value}" for v in usable if v.decision == "stay" and any(
            a.answer == "loss" for a in v.regimes)]  # fmt: skip
        how += f"; {', '.join(worse)} slower" if worse else ""
        command = bench_command(first, flag)
        if memory == "full":
            lines.append(f"tuning is flat ({how}) but memory is nearly full ({share:.0%} of the budget or GPU): free "
                         "memory first (a smaller -c, a quantized KV cache -ctk/-ctv q8_0), then compare engines")  # fmt: skip
        elif memory == "not full":
            lines.append(f"tuning is flat ({how}) and memory is not full (peak {share:.0%} of the budget or GPU): "
                         "the limit is the engine's — compare engines next:")  # fmt: skip
        else:
            lines.append(f"tuning is flat ({how}; memory not measured: no GPU readings) — compare engines next:")
        lines.append(f"  {command}")
    s = TuneSummary(flag, rows, rule, lines,
                    {"single_request": b_single[0].candidate if b_single else first.name,
                     "under_load": b_load[0].candidate if b_load else first.name}, command)  # fmt: skip
    s.blocks = _blocks(s, d, out)
    return s


def _blocks(s: TuneSummary, d: Data, out: Path) -> list[Block]:
    header, rows = table(s)
    blocks = [Block("h2", f"Tuning {s.flag}: {s.rule}"), Block("ul", items=[x.strip() for x in s.lines]),
              Block("p", f"Each {s.flag} launched alone with the same requests, the first one again at the end for the "
                    "noise floor; each later setting judged against the first (its verdict below). Prompt eval and "
                    "decode are per token at concurrency 1 (prompt eval from llama.cpp's own timings); memory is the "
                    "engine's peak while generating."),
              Block("table", header=header, rows=rows)]  # fmt: skip
    chart = tune_chart(s.flag, [(r.value, r.single_tps, r.concurrent_tps) for r in s.rows], s.rows[0].concurrency, out)
    if chart is not None:
        blocks += [Block("h3", f"tok/s by {s.flag}"), Block("img", text=f"tok/s by {s.flag}", path=chart.name)]
    return blocks
