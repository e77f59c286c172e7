"""The answer first: one headline made from the verdicts, the same on the console, in report.md, report.html and
verdict.json. Pure.

Every screen opens with the answer's ``Table`` (``answer_table``: one row per workload, the deciding figure for each
engine, each candidate's ratio with its interval, then TTFT / TPOT p50 and p99), then the decision and
``Headline.brief`` (the sentence without the table's figures), then caveats: no figure said twice.

With one candidate the headline is its verdict: the decision in one sentence (for the traffic given, or per
workload), a line per regime with its deciding figure, the trade-offs, the caveats and what to run next. With
several, the candidates are read together:

- a candidate on the baseline's own weights file beside another of the same engine kind on its own format (the
  same-file *arm*) is **attribution**, not a second answer: "on your own file sglang is 9 % slower one request at
  a time — its gains come from its formats and scheduler: switch formats with it";
- among the candidates that say switch, one **beats** another when it is better beyond the noise: for the traffic
  given, the difference of their time-weighted gains has its whole interval above equality (``proxy.judge``) and
  its estimate is at least the minimum effect (a 1 % lead is not worth a choice);
  without a traffic, it leads in a regime (its deciding figure's gain over the other's by ``CLOSE`` or more) and
  trails in none. The answer is every switch no other beats (``candidates``, in verdict.json): one is "switch to
  it"; several are named together, with where each leads and which traffic picks which — never ranked by an
  average of a 16 % gain and a ×10 one, and the same whatever order the results were given in;
- candidates that do not switch say what they say, in a line each.

Decisions a headline can carry: switch (to whom), stay, depends (per workload), partial, not yet, inconclusive. A
deciding verdict that is *discounted* (a declared precision difference accepted) says so on the first line and in
a note: the answer includes that difference, and a same-weights comparison is the clean test.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.bench.verdict.comparison import Comparison
from proxy.bench.verdict.decide import Verdict, discounted_tag
from proxy.bench.verdict.inputs import Req
from proxy.bench.verdict.regimes import REGIMES
from proxy.bench.verdict.workload import percentile
from proxy.judge import judge
from proxy.notation import faster, faster_interval, num, seconds, unit

#: the overall decision of several verdicts when none switches: the most telling first
_RANK = ("depends", "stay", "partial", "not yet", "inconclusive")
#: one switch leads another in a regime when its deciding gain is this factor above the other's (below it: even)
CLOSE = 1.10


@dataclass(frozen=True)
class Headline:
    decision: str
    #: the one sentence a person reads first
    sentence: str
    #: the best switch (None: none)
    candidate: str | None = None
    #: one line per regime of the deciding verdict, with its figure and units
    regimes: tuple[str, ...] = ()
    tradeoffs: tuple[str, ...] = ()
    caveats: tuple[str, ...] = ()
    #: the other candidates, a line each (attribution for a same-file arm)
    others: tuple[str, ...] = ()
    next_step: str | None = None
    #: the traffic profile the answer is for, in words (None: none given)
    traffic: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: the deciding verdict is discounted: what the answer includes besides the engines (a precision difference)
    discounted: str | None = None
    #: every switch no other beats beyond the noise (one: ``candidate``; several: named together, best estimate first)
    candidates: tuple[str, ...] = ()
    #: the deciding switch's candidate answers differently (``Verdict.differs``): the bound it crosses
    differs: str | None = None

    @property
    def brief(self) -> str:
        """The sentence as it follows the answer's table (``Table``): without the figures the table shows (a
        verdict's summary after its decision, a parenthesis of ratios), so no figure is said twice."""
        return _without_figures(_REPEAT.sub("", self.sentence))

    @property
    def tag(self) -> str:
        """What follows the decision: ``proxy.bench.verdict.decide.discounted_tag``."""
        return discounted_tag(self.discounted, self.differs)

    def lines(self) -> list[str]:
        out = [f"{self.decision.upper()}{self.tag}: {self.sentence}"]
        if self.traffic:
            out.append(f"  traffic: {self.traffic}")
        out += [f"  note: {x}" for x in self.notes]
        out += [f"  {x}" for x in self.regimes]
        out += [f"  trade-off: {x}" for x in self.tradeoffs]
        out += [f"  caveat: {x}" for x in self.caveats]
        out += [f"  {x}" for x in self.others]
        if self.next_step:
            out.append(f"  next: {self.next_step}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "sentence": self.sentence,
            "candidate": self.candidate,
            "regimes": list(self.regimes),
            "tradeoffs": list(self.tradeoffs),
            "caveats": list(self.caveats),
            "others": list(self.others),
            "next": self.next_step,
            "traffic": self.traffic,
            "notes": list(self.notes),
            "discounted": self.discounted,
            "answers_differently": self.differs,
            "candidates": list(self.candidates),
        }


def _score(v: Verdict) -> float:
    if v.traffic is not None and math.isfinite(v.traffic.ratio):
        return math.log(v.traffic.ratio)
    gains = [c.log_gain[0] for a in v.regimes for c in a.comparisons if c.what == a.decided_by]
    return sum(gains) / len(gains) if gains else -math.inf


def _regime_lines(v: Verdict, ended: bool = False) -> tuple[str, ...]:
    out = []
    for a in v.regimes:
        if a.answer == "not measured":  # a run cut short had the flags: it ended before the regime's cells
            why = "the run ended before it" if ended else a.fix
            out.append(f"{a.title}: not measured" + (f" ({why})" if why else ""))
            continue
        out.append(f"{a.title}: {a.line or a.head}")
    return tuple(out)


def _tradeoffs(v: Verdict) -> tuple[str, ...]:
    out = [f"{a.title}: {t}" for a in v.regimes for t in a.tradeoffs]
    out += [f"{a.title}: {a.break_even.text()}" for a in v.regimes if a.break_even is not None]
    return tuple(out)


def _attribution(v: Verdict, kind: str | None) -> str:
    single = next((a for a in v.regimes if a.step == "decode" and a.answer != "not measured"), None)
    load = next((a for a in v.regimes if a.step == "throughput" and a.answer != "not measured"), None)
    said = "; ".join(f"{a.title}: {a.head}" for a in (single, load) if a is not None) or v.summary
    engine = kind or v.candidate
    return (
        f"{v.candidate} runs your own weights file: {said} — attribution, not a second answer: where {engine} "
        "wins it is with its own formats and scheduler, so switch formats with it"
    )


def _deciding(v: Verdict) -> dict[str, tuple[str, float]]:
    """regime step -> (title, the candidate's gain over the baseline on the regime's deciding figure, as a ratio)."""
    return {
        a.step: (a.title, math.exp(c.log_gain[0])) for a in v.regimes for c in a.comparisons if c.what == a.decided_by
    }


def _versus(v: Verdict, best: Verdict) -> str:
    """Where ``v`` leads ``best`` and where it trails, regime by regime, both against the same baseline: "against
    llama, per regime — single request: even (20 % against 19 % faster); under load: ahead (×11.9 against ×10.2
    faster); long prompts: behind (×2.5 against ×3.1 faster)". Even: the two gains within ``CLOSE``."""
    mine, theirs = _deciding(v), _deciding(best)
    parts = []
    for step, (title, r) in mine.items():
        if step not in theirs:
            continue
        q = theirs[step][1]
        u = unit(r, q)
        word = "even" if max(r / q, q / r) < CLOSE else "ahead" if r > q else "behind"
        parts.append(f"{title}: {word} ({faster(r, u).rsplit(' ', 1)[0]} against {faster(q, u)})")
    return f"against {v.baseline}, per regime — " + "; ".join(parts) if parts else v.summary


def _one(v: Verdict) -> str:
    if v.traffic is not None and v.decision in ("stay", "inconclusive"):
        what = "stay with " + v.baseline if v.decision == "stay" else "no answer"
        return f"{what} for this traffic: {v.traffic.text}"
    if v.decision == "stay":
        return f"stay with {v.baseline}: {v.summary}"
    return v.summary


def _others(
    verdicts: Sequence[Verdict], main: Verdict, arms: set[str], front: Sequence[Verdict], kinds: Mapping[str, str]
) -> tuple[str, ...]:
    """A line for each verdict but the answer's: attribution for a same-file arm, where a beaten switch trails the
    answer, else its decision and its gain. The members of a set of answers are in the sentence, not here."""
    others = []
    for v in verdicts:
        if v is main or (len(front) > 1 and v in front):
            continue
        if v.candidate in arms:
            others.append(_attribution(v, kinds.get(v.candidate)))
            continue
        r = math.exp(_score(v)) if math.isfinite(_score(v)) else None
        weighed = v.traffic is not None and math.isfinite(v.traffic.ratio)
        how = "for this traffic" if weighed else "its regimes, on average"
        mean = f" ({how}: {faster(r)})" if r is not None else ""
        if v.decision == "switch" and main.decision == "switch":
            others.append(
                f"{v.candidate}: {v.decision.upper()}{v.tag}{mean}, behind {main.candidate}: {_versus(v, main)}"
            )
            continue
        others.append(f"{v.candidate}: {v.decision.upper()}{v.tag}{mean} — {v.summary}")
    return tuple(others)


def _traffic_beats(a: Verdict, b: Verdict) -> bool:
    """``a`` is better than ``b`` for the traffic beyond the noise: the difference of their weighted log gains has
    its whole interval above equality (each side's half-widths combined as independent)."""
    if a.traffic is None or b.traffic is None:
        return False
    ga, la, ha = a.traffic.log_gain
    gb, lb, hb = b.traffic.log_gain
    d = ga - gb
    beyond = judge(d - math.hypot(ga - la, hb - gb), d + math.hypot(ha - ga, gb - lb), 0.0) == "win"
    worth = max((c.min_effect for c in (*a.cells, *b.cells)), default=0.05)
    return beyond and d > math.log1p(worth)  # beyond the noise, and by a difference worth choosing on


def _leads(a: Verdict, b: Verdict) -> list[str]:
    """The regimes (titles) where ``a``'s deciding gain over the baseline exceeds ``b``'s by ``CLOSE`` or more."""
    mine, theirs = _deciding(a), _deciding(b)
    return [t for step, (t, r) in mine.items() if step in theirs and r / theirs[step][1] >= CLOSE]


def _beats(a: Verdict, b: Verdict) -> bool:
    if a.traffic is not None and b.traffic is not None:
        return _traffic_beats(a, b)
    return bool(_leads(a, b)) and not _leads(b, a)


#: the traffic each regime stands for, in the words of "which traffic picks which"
_TRAFFIC_OF = {"single request": "one request at a time", "under load": "under load", "long prompts": "long prompts"}


def _set_sentence(front: Sequence[Verdict]) -> str:
    """Several switches none of which beats the others: where each leads, where they are even, and which traffic
    picks which ("switch to sglang-fp8 or vllm-fp8 — neither leads everywhere: sglang-fp8 leads on long prompts,
    vllm-fp8 under load; a tie one request at a time; your traffic picks: long prompts → sglang-fp8, under load →
    vllm-fp8")."""
    names = " or ".join(v.candidate for v in front)
    if front[0].traffic is not None:
        each = ", ".join(f"{v.candidate} {faster(v.traffic.ratio)}" for v in front if v.traffic is not None)
        base = front[0].baseline
        return f"switch to {names} — this traffic does not separate them beyond the noise ({each} than {base})"
    leads = {v.candidate: list(dict.fromkeys(t for w in front if w is not v for t in _leads(v, w))) for v in front}
    led = {t for ts in leads.values() for t in ts}
    if not led:
        return f"switch to {names} — even in every workload measured (gains within ×{CLOSE:g} of each other): either"
    even = [t for t, _ in _deciding(front[0]).values() if t not in led]
    where = ", ".join(f"{n} on {' and '.join(ts)}" for n, ts in leads.items() if ts).replace(
        "on under load", "under load"
    )
    picks = ", ".join(f"{' or '.join(_TRAFFIC_OF.get(t, t) for t in ts)} → {n}" for n, ts in leads.items() if ts)
    tie = f"; a tie {' and '.join(_TRAFFIC_OF.get(t, t) for t in even)}" if even else ""
    return f"switch to {names} — neither leads everywhere: {where}{tie}; your traffic picks: {picks}"


def headline(
    verdicts: Sequence[Verdict],
    weights: Mapping[str, str] | None = None,
    kinds: Mapping[str, str] | None = None,
    traffic: str | None = None,
    ended: bool = False,
    weigh: str | None = None,
) -> Headline:
    """``weights``: candidate -> how its weights relate to the baseline's ("same file", "same quantization",
    "different precision", "unknown"); ``kinds``: candidate -> engine kind; ``ended``: the run was cut short
    (interrupted or stopped), so what was not measured is what it did not reach; ``weigh``: the command that weighs
    these results by a traffic profile (the next step when the switches are not separated and no traffic is given).
    The answer does not depend on the verdicts' order."""
    if not verdicts:
        return Headline(
            "inconclusive", "one engine measured: nothing to compare (join runs: enginemeter report --results A B)"
        )
    verdicts = sorted(verdicts, key=lambda v: v.candidate)
    weights, kinds = weights or {}, kinds or {}
    arms = {
        v.candidate
        for v in verdicts
        if weights.get(v.candidate) in ("same file", "same quantization")
        and any(
            kinds.get(w.candidate) == kinds.get(v.candidate) and weights.get(w.candidate) == "different precision"
            for w in verdicts
        )
    }
    deciding = [v for v in verdicts if v.candidate not in arms] or list(verdicts)
    switches = sorted((v for v in deciding if v.decision == "switch"), key=lambda v: (-_score(v), v.candidate))
    front = [v for v in switches if not any(_beats(w, v) for w in switches if w is not v)] or switches
    next_step, candidates = None, tuple(v.candidate for v in front)
    if len(front) > 1:
        decision, main, sentence = "switch", front[0], _set_sentence(front)
        if front[0].traffic is None and "neither leads" in sentence:
            next_step = weigh and f"choose between them by your traffic: {weigh}"
    elif switches:
        best = front[0]
        rest = f" (the best of the {len(switches)} that switch)" if len(switches) > 1 else ""
        if best.traffic is not None:
            sentence = f"switch to {best.candidate}{rest} for this traffic: {best.traffic.text}"
        else:
            sentence = f"switch to {best.candidate}{rest}: {best.summary}"
        decision, main = "switch", best
    else:
        main = min(deciding, key=lambda v: (_RANK.index(v.decision) if v.decision in _RANK else 9, -_score(v)))
        decision, sentence = main.decision, _one(main)
    others = _others(verdicts, main, arms, front, kinds)
    notes = (f"this answer is discounted: it {main.discounted}",) if main.discounted else ()
    return Headline(
        decision,
        sentence,
        main.candidate if decision == "switch" and len(front) == 1 else None,
        _regime_lines(main, ended) if len(front) <= 1 else (),
        _tradeoffs(main) if len(front) <= 1 else (),
        tuple(dict.fromkeys(c for v in front or [main] for c in v.caveats)),
        others,
        main.next_step or next_step,
        traffic,
        notes,
        main.discounted,
        candidates,
        main.differs if decision == "switch" else None,
    )


#: the end of a headline sentence that repeats the table's figures (a verdict's summary after its decision)
_REPEAT = re.compile(r" — (per regime: )?(single request|under load|long prompts)(: | \().*$")


def _without_figures(sentence: str) -> str:
    """The sentence without the parentheses that repeat the table's figures ("(llama 20 % faster (whole request,
    …))"); a parenthesis with a "95% CI" stays (the table shows no such interval in words)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(sentence):
        if ch == "(":
            start, depth = (i if depth == 0 else start), depth + 1
        elif ch == ")" and depth:
            depth -= 1
            group = sentence[start : i + 1]
            if depth == 0 and ("faster" in group or "slower" in group) and "95% CI" not in group:
                out.append((start, i + 1))
    text, last = "", 0
    for a, b in out:
        text, last = text + sentence[last:a].rstrip(), b
    return text + sentence[last:]


#: a deciding figure's short name in the table
FIGURE = {"e2e_s": "request time", "output_tps": "output tok/s", "ttft_s": "TTFT", "tpot_s": "TPOT"}


@dataclass(frozen=True)
class Table:
    """The answer's table, the first thing every screen shows (the terminal as columns, report.md and report.html
    as tables: the same strings, ``proxy.notation``): one row per workload measured — its deciding figure for each
    engine and each candidate's speed ratio over the baseline with its 95 % interval — then, per workload, each
    engine's TTFT and TPOT at p50 and p99 in ms (its requests in that cell)."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    latency_header: tuple[str, ...] = ()
    latency_rows: tuple[tuple[str, ...], ...] = ()


def ratio(c: Comparison) -> str:
    """The candidate's speed ratio over the baseline with its interval, in one unit: "×10.2 faster (×8.8–×11.7)",
    "19 % faster (18–19 %)", "2.0 % faster (between 3.0 % slower and 5.0 % faster)"."""
    r, lo, hi = c.speed
    u = unit(r, lo, hi)
    word, ci = faster(r, u), faster_interval(lo, hi, u)
    tail = word.rsplit(" ", 1)[-1]
    if not ci.startswith("between") and ci.endswith(f" {tail}"):
        ci = ci.removesuffix(f" {tail}")
    return f"{word} ({ci})"


def _value(metric: str, v: float) -> str:
    return seconds(v) if metric.endswith("_s") else num(v)


def _decided(v: Verdict, step: str) -> Comparison | None:
    a = next((a for a in v.regimes if a.step == step), None)
    if a is None:
        return None
    return next((c for c in a.comparisons if c.what == a.decided_by), None)


def _cell_name(c: Comparison) -> str:
    cell = c.cell
    if cell.cache == "live":
        return cell.label().removeprefix("live, ")
    return f"c={cell.concurrency}" + ("" if cell.prompt_len in ("short", "mixed") else f" {cell.prompt_len}")


def answer_table(verdicts: Sequence[Verdict], requests: Sequence[Req] = ()) -> Table:
    """The table of these verdicts (one baseline), whatever their order; no latency rows without requests."""
    vs = sorted(verdicts, key=lambda v: v.candidate)
    engines = (vs[0].baseline, *(v.candidate for v in vs)) if vs else ()
    rows, cells = [], []
    for step, title in REGIMES:
        comps = {v.candidate: _decided(v, step) for v in vs}
        first = next((c for c in comps.values() if c is not None), None)
        if first is None:
            continue
        name = f"{title} {_cell_name(first)}"
        cand = ("–" if c is None else f"{_value(c.metric, c.stats.cand_mean)} {ratio(c)}" for c in comps.values())
        rows.append((name, FIGURE.get(first.metric, first.metric), _value(first.metric, first.stats.base_mean), *cand))
        cells.append((name, first))
    if not requests or not cells:
        return Table(("workload", "figure", *engines), tuple(rows))
    latency = tuple((name, "", *(_latency(requests, e, c) for e in engines)) for name, c in cells)
    return Table(("workload", "figure", *engines), tuple(rows), ("TTFT · TPOT p50/p99 (ms)", "", *engines), latency)


def _latency(reqs: Sequence[Req], engine: str, c: Comparison) -> str:
    mine = [r for r in reqs if r.engine == engine and r.cell == c.cell and r.ok]
    parts = []
    for key in ("ttft_s", "tpot_s"):
        vals = [float(x) * 1000 for r in mine if (x := getattr(r, key)) is not None and math.isfinite(x)]
        p50, p99 = percentile(vals, 50), percentile(vals, 99)
        parts.append("–" if p50 is None or p99 is None else f"{num(p50)}/{num(p99)}")
    return " · ".join(parts)


def extrapolated(verdicts: Sequence[Verdict]) -> list[str]:
    """Where the traffic reaches beyond what was measured (concurrency, prompt length): said with the answer."""
    notes = (n for v in verdicts if v.traffic is not None for n in v.traffic.notes)
    return [f"extrapolated: {n}" for n in dict.fromkeys(n for n in notes if "beyond" in n or "not measured" in n)]
