"""Comparisons -> one answer per regime -> the decision, and what to run next. Pure.

A regime's answer weighs all its figures (single request: decode TPOT and TTFT; under load: output tok/s and
TTFT; long prompts: TTFT and TPOT): a win when one wins and none loses, a loss likewise, *mixed* when they
disagree, a tie only when every figure ties, else unresolved. The decision reads the regimes in order:

- a gate failed (parity, data, memory): that gate decides (inconclusive; memory that does not fit: stay);
- a regime is *mixed*, or one regime wins where another loses: **inconclusive** — it depends on the workload;
- a required regime (single request and under load; with live traffic, single request only) is unresolved or
  flagged: **inconclusive**, with the repeats that would resolve it, or the statement that none will;
- a required regime was not measured: **partial** — what the measured regimes say, what is missing and the
  flags that measure it; never switch or stay;
- otherwise wins and no losses: **switch**; losses and no wins: **stay**; only ties: **stay**, and
  "decode-bound" only when single-request decode tied *and* a load measurement backs it.

Long prompts are judged when measured; unresolved there is said, and does not hold back the decision.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from proxy.bench.verdict.comparison import Comparison
from proxy.bench.verdict.model import FAILS, STEPS, Decision, Reason, Results
from proxy.bench.verdict.notation import band, pct

#: (step, the regime as a person names it), in reading order
REGIMES: tuple[tuple[str, str], ...] = (("decode", "single request"), ("throughput", "under load"),
                                        ("long-context", "long prompts"))  # fmt: skip
GATES = ("parity", "data", "memory")


@dataclass(frozen=True, slots=True)
class RegimeAnswer:
    step: str
    title: str
    #: win | loss | tie | mixed | unresolved | flagged | not measured
    answer: str
    text: str
    cell: str | None = None
    comparisons: tuple[Comparison, ...] = ()
    #: flags that measure it (not measured), or the rerun that resolves it (unresolved)
    fix: str | None = None
    #: the answer in a few words ("sglang faster by 14 % [+12 … +16 %]"), for the summary line
    head: str = ""

    def to_json(self) -> dict[str, Any]:
        prim = next((c for c in self.comparisons if c.primary), None)
        return {"regime": self.title, "step": self.step, "answer": self.answer, "text": self.text,
                "cell": self.cell, "fix": self.fix,
                "primary": None if prim is None else {
                    "metric": prim.metric, "rel": prim.stats.rel, "ci95": [prim.stats.lo, prim.stats.hi],
                    "gain": list(prim.gain), "band": prim.band, "detectable_effect": prim.detectable}}  # fmt: skip


class Conclusion(NamedTuple):
    decision: Decision
    summary: str
    reasons: tuple[Reason, ...]
    stopped_at: str | None
    stopped_check: str | None
    regimes: tuple[RegimeAnswer, ...]
    next_step: str | None


def _missing_flags(step: str, slots: int | None, live: bool = False) -> str:
    if live:
        return {"decode": "pairs that ran alone (observed c=1)", "throughput": "pairs at observed concurrency ≥ 2"}.get(
            step, "enginemeter bench --prompt-lengths short,long (mirrored prompts are of mixed length)")  # fmt: skip
    if step == "decode":
        return "--concurrency 1 (the single-request cell)"
    if step == "throughput":
        levels = [1]
        while levels[-1] < min(max(4, slots or 4), 64):
            levels.append(levels[-1] * 4)
        return f"--concurrency {','.join(map(str, levels))}"
    return "--prompt-lengths short,long (or 4k, 16k: the longest the context holds)"


def answer(
    step: str, title: str, comps: Sequence[Comparison], base: str, cand: str, slots: int | None, live: bool = False
) -> RegimeAnswer:
    mine = [c for c in comps if c.step == step]
    prim = next((c for c in mine if c.primary), None)
    if prim is None:
        flags = _missing_flags(step, slots, live)
        text = f"{title}: not measured — " + (f"needs {flags}" if live else f"add {flags}")
        return RegimeAnswer(step, title, "not measured", text, fix=None if live else flags, head="not measured")
    outs = {c.outcome for c in mine}
    # every figure of the regime counts: under load, no queueing (TTFT) is a win as much as more tokens/s
    if "flagged" in outs:
        a = "flagged"
    elif "win" in outs and "loss" in outs:
        a = "mixed"
    elif "win" in outs or "loss" in outs:
        a = "win" if "win" in outs else "loss"
    elif outs == {"tie"}:
        a = "tie"
    else:
        a = "unresolved"
    # the figure the line leads with: the regime's main one when it carries the answer, else one that does
    lead = {"mixed": "win", "tie": "tie"}.get(a, a)
    prim = next((c for c in mine if c.outcome == lead and c.primary), None) or next(
        (c for c in mine if c.outcome == lead), prim)  # fmt: skip
    g, lo, hi = (math.expm1(x) for x in prim.log_gain)  # speed ratio - 1: ×2 faster is +100 %, ×2 slower -50 %
    figs = "; ".join(f"{c.what}: {base} {c.figures()[0]} vs {cand} {c.figures()[1]} ({c.outcome})" for c in mine)
    ci = f"{pct(g)} (95% CI {pct(lo)} … {pct(hi)})"
    what = prim.what.split(" (")[0]
    fix: str | None = None
    if a == "win":
        short = f"{cand} faster by {pct(g)} [{pct(lo)} … {pct(hi)}] ({what})"
        head = f"{short}, beyond ±{band(prim.win_band)}"
    elif a == "loss":
        slow = [1 / (1 + x) - 1 for x in (g, hi, lo)]  # how much longer the candidate takes, + is slower
        short = f"{cand} slower by {pct(slow[0])} [{pct(slow[1])} … {pct(slow[2])}] ({what})"
        head = f"{short}, beyond ±{band(prim.win_band)}"
    elif a == "tie":
        short = head = f"tie: within ±{band(prim.band)} ({what} {ci})"
    elif a == "mixed":
        short = head = "mixed: " + ", ".join(f"{c.what} {c.outcome}" for c in mine if c.outcome in ("win", "loss"))
    elif a == "flagged":
        short = head = f"cannot decide: {prim.flagged}"
        fix = f"rerun when nothing else uses the engines ({prim.flagged})"
    else:
        n = prim.repeats_to_resolve()
        fix = f"--repeats {n}" if n else None
        short = f"unresolved ({what} {ci})"
        why = (f"inside the noise floor ±{band(prim.win_band)}, wider than the minimum effect {prim.min_effect:.0%}"
               if prim.coarse else f"crosses ±{band(prim.win_band)}")  # fmt: skip
        head = (f"unresolved: {what} {ci} {why}; "
                + (f"about {n} repeats would resolve it" if n else "no feasible number of repeats resolves it"))  # fmt: skip
    return RegimeAnswer(step, title, a, f"{title} ({prim.cell.label()}): {head} — {figs}", prim.cell.label(),
                        tuple(mine), fix, short)  # fmt: skip


def rerun(command: str | None, flags: str) -> str:
    """The bench command with ``flags`` set (replacing the same flags where the command has them)."""
    if not command:
        return f"rerun the bench with {flags}"
    try:
        argv = shlex.split(command)
        new = shlex.split(flags)
    except ValueError:
        return f"{command} {flags}"
    names = {a for a in new if a.startswith("--")}
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in names:
            skip = "=" not in a
            continue
        out.append(a)
    return shlex.join(out + new)


def conclude(
    r: Results, base: str, cand: str, reasons: list[Reason], comps: Sequence[Comparison], aa: str | None,
    measured: set[str], slots: int | None,
) -> Conclusion:  # fmt: skip
    order = {s: i for i, s in enumerate(STEPS)}
    reasons.sort(key=lambda x: order.get(x.step, len(STEPS)))  # stable: each gate's reasons keep their order
    regimes = tuple(answer(step, title, comps, base, cand, slots, r.live) for step, title in REGIMES)
    required = ("decode",) if r.live else ("decode", "throughput")
    failed = next((x for x in reasons if x.step in GATES and x.outcome in FAILS), None)
    if failed is not None:
        stop = order[failed.step]
        reasons = [replace(x, decisive=False) if order.get(x.step, 99) > stop else x for x in reasons]
        gate_fails = [x for x in reasons if x.step == failed.step and x.outcome in FAILS]
        more = f" (+{len(gate_fails) - 1} more)" if len(gate_fails) > 1 else ""
        decision: Decision = "stay" if failed.outcome == "stay" else "inconclusive"
        check = f" ({failed.check})" if failed.check else ""
        summary = f"stopped at the {failed.step} gate{check}: {failed.text}{more}"
        return Conclusion(decision, summary, tuple(reasons), failed.step, failed.check or failed.step, regimes, None)
    by = {a.step: a for a in regimes}
    wins = [a for a in regimes if a.answer in ("win", "mixed")]
    losses = [a for a in regimes if a.answer in ("loss", "mixed")]
    blocked = [by[s] for s in required if by[s].answer in ("unresolved", "flagged")]
    missing = [by[s] for s in required if by[s].answer == "not measured"]
    long = by["long-context"]
    tail = f"; long prompts {long.head}" if long.answer in ("unresolved", "flagged") else ""

    def names(xs: Sequence[RegimeAnswer]) -> str:
        return ", ".join(a.title for a in xs)

    def lean() -> str:
        return "; ".join(f"{a.title}: {a.head}" for a in regimes if a.answer in ("win", "loss", "tie"))

    if wins and losses:
        first = next(a for a in regimes if a.answer in ("loss", "mixed"))
        summary = (
            f"mixed: {cand} wins on {names(wins)} but loses on {names(losses)} — the choice depends on your workload"
        )
        return Conclusion("inconclusive", summary, tuple(reasons), first.step, "mixed", regimes,
                          "weigh the regimes by your traffic (the summary table); no rerun changes a resolved difference")  # fmt: skip
    if blocked:
        b = blocked[0]
        fixes = [a.fix for a in blocked if a.fix]
        nxt = rerun(r.command, fixes[0]) if fixes and fixes[0].startswith("--") else (
            fixes[0] if fixes else f"no feasible rerun resolves {names(blocked)}: the difference sits at the band "
            "(a larger effect, a quieter machine or more requests per repeat are the only ways)")  # fmt: skip
        leaning = f" (so far: {lean()})" if lean() else ""
        summary = f"{names(blocked)} {b.answer}{leaning}: {b.text}"
        prim = next((c for c in b.comparisons if c.primary), None)
        return Conclusion("inconclusive", summary, tuple(reasons), b.step, prim.metric if prim else b.answer, regimes,
                          nxt)  # fmt: skip
    if missing:
        flags = " ".join(a.fix or "" for a in missing if a.fix and a.fix.startswith("--")).strip()
        leaning = lean() or "nothing decided"
        summary = (f"partial answer — {leaning}; {names(missing)} not measured, so neither switch nor stay "
                   f"(add {' and '.join(a.fix or '' for a in missing)})")  # fmt: skip
        return Conclusion("partial", summary + tail, tuple(reasons), missing[0].step, "not measured", regimes,
                          rerun(r.command, flags) if flags else None)  # fmt: skip
    if wins:
        summary = f"{cand} is better on {names(wins)} and worse on nothing — {lean()}"
        return Conclusion("switch", summary + tail, tuple(reasons), None, None, regimes, None)
    if losses:
        summary = f"{cand} is worse on {names(losses)} and better on nothing — {lean()}"
        return Conclusion("stay", summary + tail, tuple(reasons), None, None, regimes, None)
    ties = [a for a in regimes if a.answer == "tie"]
    if ties:
        decode_bound = by["decode"].answer == "tie" and by["throughput"].answer == "tie"
        summary = (f"no difference between {base} and {cand} beyond the band on {names(ties)}"
                   + (" — decode-bound: the same per-token speed alone and under load; switching engines won't fix "
                      "it" if decode_bound else ""))  # fmt: skip
        return Conclusion("stay", summary + tail, tuple(reasons), None, None, regimes, None)
    return Conclusion("inconclusive", "nothing comparable was measured on both engines", tuple(reasons), "data",
                      "cells", regimes, None)  # fmt: skip
