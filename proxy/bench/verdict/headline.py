"""The answer first: one headline made from the verdicts, the same on the console, in report.md, report.html and
verdict.json. Pure.

With one candidate the headline is its verdict: the decision in one sentence (for the traffic given, or per
workload), a line per regime with its deciding figure, the trade-offs, the caveats and what to run next. With
several, the candidates are read together:

- a candidate on the baseline's own weights file beside another of the same engine kind on its own format (the
  same-file *arm*) is **attribution**, not a second answer: "on your own file sglang is 9 % slower one request at
  a time — its gains come from its formats and scheduler: switch formats with it";
- the **best switch** is the candidate that says switch (for the traffic given) with the largest gain: for the
  traffic, its time-weighted speed ratio; else the mean of its regimes' deciding figures (log scale);
- candidates that do not switch say what they say, in a line each.

Decisions a headline can carry: switch (to whom), stay, depends (per workload), partial, not yet, inconclusive. A
deciding verdict that is *discounted* (a declared precision difference accepted) says so on the first line and in
a note: the answer includes that difference, and a same-weights comparison is the clean test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.bench.verdict.decide import Verdict, discounted_tag
from proxy.notation import faster, unit

#: the overall decision of several verdicts when none switches: the most telling first
_RANK = ("depends", "stay", "partial", "not yet", "inconclusive")
#: two switches whose gains (on average, or for the traffic) are within this factor are a close call: the headline
#: names both and where each leads, and the traffic decides between them
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

    @property
    def tag(self) -> str:
        """What follows the decision: ``proxy.bench.verdict.decide.discounted_tag``."""
        return discounted_tag(self.discounted)

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
    verdicts: Sequence[Verdict], main: Verdict, arms: set[str], close: Sequence[Verdict], kinds: Mapping[str, str]
) -> tuple[str, ...]:
    """A line for each verdict but the deciding one: attribution for a same-file arm, the comparison with the best
    switch for one close behind it, else its decision and its gain."""
    others = []
    for v in verdicts:
        if v is main:
            continue
        if v.candidate in arms:
            others.append(_attribution(v, kinds.get(v.candidate)))
            continue
        r = math.exp(_score(v)) if math.isfinite(_score(v)) else None
        weighed = v.traffic is not None and math.isfinite(v.traffic.ratio)
        how = "for this traffic" if weighed else "its regimes, on average"
        mean = f" ({how}: {faster(r)})" if r is not None else ""
        if v in close:
            b = math.exp(_score(main))
            others.append(
                f"{v.candidate}: {v.decision.upper()}{v.tag} — close to {main.candidate} ({how}: "
                f"×{r:.2f} against ×{b:.2f}): {_versus(v, main)}"
            )
            continue
        others.append(f"{v.candidate}: {v.decision.upper()}{v.tag}{mean} — {v.summary}")
    return tuple(others)


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
    these results by a traffic profile (the next step when two switches are a close call and no traffic is given)."""
    if not verdicts:
        return Headline(
            "inconclusive", "one engine measured: nothing to compare (join runs: enginemeter report --results A B)"
        )
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
    switches = sorted((v for v in deciding if v.decision == "switch"), key=_score, reverse=True)
    close = [v for v in switches[1:] if _score(switches[0]) - _score(v) < math.log(CLOSE)]
    next_step = None
    if switches:
        best = switches[0]
        rest = f" (the best of the {len(switches)} that switch)" if len(switches) > 1 else ""
        if close:
            names = " and ".join(v.candidate for v in close)
            how = "for this traffic" if best.traffic is not None else "on average"
            gap = math.exp(_score(best) - max(_score(v) for v in close)) - 1
            within = "within " if len(close) > 1 else ""
            rest = (
                f" (the best of the {len(switches)} that switch; {names} close behind: {within}{gap * 100:.0f} % "
                f"{how}, see below)"
            )
            if best.traffic is None:
                next_step = weigh and f"choose between them by your traffic: {weigh}"
        if best.traffic is not None:
            sentence = f"switch to {best.candidate}{rest} for this traffic: {best.traffic.text}"
        else:
            sentence = f"switch to {best.candidate}{rest}: {best.summary}"
        decision, main = "switch", best
    else:
        main = min(deciding, key=lambda v: (_RANK.index(v.decision) if v.decision in _RANK else 9, -_score(v)))
        decision, sentence = main.decision, _one(main)
    others = _others(verdicts, main, arms, close, kinds)
    notes = (f"this answer is discounted: it {main.discounted}",) if main.discounted else ()
    return Headline(
        decision,
        sentence,
        main.candidate if decision == "switch" else None,
        _regime_lines(main, ended),
        _tradeoffs(main),
        main.caveats,
        others,
        main.next_step or next_step,
        traffic,
        notes,
        main.discounted,
    )
