"""Comparisons -> one answer per regime -> the decision, and what to run next. Pure.

Each regime is judged as the person of that regime feels it, on one **deciding figure**:

- **single request** (c=1): the whole request — first token plus the rest of the answer, at the output length
  measured; TTFT and decode TPOT beside it. When they point different ways the answer says where they cross: the
  **break-even output length** ("sglang is faster for answers under 9 tokens, llama beyond");
- **under load**: output tok/s at the highest concurrency measured; TTFT under load beside it. When the throughput
  does not separate the two — a tie, or unresolved (its interval reaches inside the band) — a TTFT under load
  resolved beyond its own band decides: the same tokens as far as the run can tell, sooner. A throughput resolved
  either way is never overruled by TTFT (it is a trade-off beside it);
- **long prompts**: the whole long request (prefill plus the answer); TTFT and TPOT beside it.

A figure beside the deciding one that points the other way is a **trade-off**, stated with its numbers, never a
veto. The decision reads the regimes:

- a gate failed (parity, data, memory): that gate decides (inconclusive; memory that does not fit: stay);
- a traffic profile was given (``--traffic``): the regimes' cells weighted by it decide (``traffic.weigh``);
- resolved regimes disagree: **depends** — "stay if you serve one request at a time (...), switch for concurrent
  traffic (...)", with where the candidate overtakes as concurrency rises and the output-length break-even;
- a required regime (single request and under load) is unresolved or flagged: **inconclusive**, with the repeats
  that would resolve it; live traffic: a regime the traffic exercised and the anytime-valid verdict has not
  decided yet: **not yet**;
- a required regime was not measured: **partial**;
- otherwise wins and no losses: **switch**; losses and no wins: **stay**; only ties: **stay** ("decode-bound"
  when single-request decode tied and a load measurement backs it).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from proxy.bench.outdir import next_name
from proxy.bench.verdict.comparison import Comparison
from proxy.bench.verdict.inputs import FAILS, STEPS, Decision, LiveFinding, Reason, Results
from proxy.bench.verdict.weighting import TrafficAnswer, crossing
from proxy.engines.startup import without_flags
from proxy.notation import band, faster, faster_interval, unit
from proxy.sequential import MIN_PAIRS

#: (step, the regime as a person names it), in reading order
REGIMES: tuple[tuple[str, str], ...] = (("decode", "single request"), ("throughput", "under load"),
                                        ("long-context", "long prompts"))  # fmt: skip
#: the traffic each regime stands for, in the decision's sentences
SERVES = {"decode": "one request at a time", "throughput": "concurrent traffic", "long-context": "long prompts"}
GATES = ("parity", "data", "memory")


@dataclass(frozen=True, slots=True)
class BreakEven:
    """Where the whole request's time is the same on both engines: the output length in tokens."""

    tokens: float
    #: the engine faster for shorter answers (its first token comes sooner), and the one faster beyond
    shorter: str
    longer: str

    def text(self) -> str:
        return f"{self.shorter} is faster for answers under {self.tokens:.0f} tokens, {self.longer} beyond"

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "faster_shorter": self.shorter, "faster_longer": self.longer}


@dataclass(frozen=True, slots=True)
class RegimeAnswer:
    step: str
    title: str
    #: win | loss | tie | unresolved | flagged | not yet | not measured
    answer: str
    text: str
    cell: str | None = None
    comparisons: tuple[Comparison, ...] = ()
    #: flags that measure it (not measured), or the rerun that resolves it (unresolved)
    fix: str | None = None
    #: the answer in a few words ("sglang is ×7.6 faster (output tok/s at c=64)"), for the summary line
    head: str = ""
    #: the figure that decided (``Comparison.what``)
    decided_by: str | None = None
    #: figures beside it that point the other way, in words
    tradeoffs: tuple[str, ...] = ()
    break_even: BreakEven | None = None
    #: the answer with its interval and band, for the headline's regime lines
    line: str = ""

    def to_json(self) -> dict[str, Any]:
        prim = next((c for c in self.comparisons if c.what == self.decided_by), None)
        return {"regime": self.title, "step": self.step, "answer": self.answer, "text": self.text, "head": self.head,
                "cell": self.cell, "fix": self.fix, "decided_by": self.decided_by, "tradeoffs": list(self.tradeoffs),
                "break_even": self.break_even.to_json() if self.break_even else None,
                "primary": None if prim is None else {
                    "metric": prim.metric, "speed_ratio": prim.speed[0], "ci95": list(prim.speed[1:]),
                    "band": prim.band, "detectable_effect": prim.detectable}}  # fmt: skip


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
            step, "pairs that ran alone with a prompt of 1,024 tokens or more")  # fmt: skip
    if step == "decode":
        return "--concurrency 1 (the single-request cell)"
    if step == "throughput":
        levels = [1]
        while levels[-1] < min(max(4, slots or 4), 64):
            levels.append(levels[-1] * 4)
        return f"--concurrency {','.join(map(str, levels))}"
    return "--prompt-lengths short,long (or 4k, 16k: the longest the context holds)"


def break_even(comps: Sequence[Comparison], base: str, cand: str) -> BreakEven | None:
    """The output length at which the whole request takes as long on both engines, when TTFT and TPOT point
    different ways (each resolved)."""
    ttft = next((c for c in comps if c.metric == "ttft_s"), None)
    tpot = next((c for c in comps if c.metric == "tpot_s"), None)
    if ttft is None or tpot is None or {ttft.outcome, tpot.outcome} != {"win", "loss"}:
        return None
    t_b, t_c, p_b, p_c = ttft.stats.base_mean, ttft.stats.cand_mean, tpot.stats.base_mean, tpot.stats.cand_mean
    if p_b == p_c:
        return None
    n = 1 + (t_c - t_b) / (p_b - p_c)
    if not math.isfinite(n) or n <= 1:
        return None
    # the engine whose first token comes sooner wins the short answers
    return BreakEven(n, cand, base) if ttft.outcome == "win" else BreakEven(n, base, cand)


def answer(
    step: str, title: str, comps: Sequence[Comparison], base: str, cand: str, slots: int | None, live: bool = False
) -> RegimeAnswer:
    mine = [c for c in comps if c.step == step]
    prim = next((c for c in mine if c.primary), None)
    if prim is None:
        flags = _missing_flags(step, slots, live)
        text = f"{title}: not measured — " + (f"needs {flags}" if live else f"add {flags}")
        return RegimeAnswer(step, title, "not measured", text, fix=None if live else flags, head="not measured")
    decider, a = prim, prim.outcome
    if step == "throughput" and a in ("tie", "unresolved"):
        # the throughput does not separate them (an unresolved interval reaches inside the band as a tie's does):
        # whichever serves the first token sooner, when that is resolved; a throughput win or loss stays the answer
        side = next((c for c in mine if not c.primary and c.outcome in ("win", "loss")), None)
        if side is not None:
            decider, a = side, side.outcome
    sides = [c for c in mine if c is not decider]
    against = {"win": "loss", "loss": "win"}.get(a)
    tradeoffs = tuple(c.says(base, cand) for c in sides if c.outcome == against or (a == "tie" and
                      c.outcome in ("win", "loss")))  # fmt: skip
    be = break_even(mine, base, cand) if step in ("decode", "long-context") else None
    who, r, lo, hi = decider.side(base, cand)
    fb, fc = decider.figures()
    figs_ = f"{decider.what}: {base} {fb}, {cand} {fc}"
    u = unit(r, lo, hi)
    ci = f"95% CI {faster_interval(lo, hi, u)}"
    fix: str | None = None
    if a in ("win", "loss"):
        head = f"{who} {faster(r, u)} ({figs_})"
        line = f"{who} is {faster(r, u)} — {figs_} ({ci}; band {band(decider.win_band)})"
    elif a == "tie":
        wide = decider.win_band > decider.min_effect
        head = f"a tie ({figs_})"
        line = f"a tie — {figs_} ({ci}, inside the band {band(decider.win_band)}" + (
            ": the run's noise floor, no smaller difference can be seen in this run)" if wide else ")")  # fmt: skip
    elif a == "flagged":
        head = line = f"cannot decide: {decider.flagged}"
        fix = f"rerun when nothing else uses the engines ({decider.flagged})"
    else:
        n = decider.repeats_to_resolve()
        fix = f"--repeats {n}" if n else None
        head = f"unresolved ({figs_})"
        line = (f"unresolved — {figs_} ({ci} crosses the band {band(decider.win_band)}; "
                + (f"about {n} repeats would resolve it)" if n else "no feasible number of repeats resolves it)"))  # fmt: skip
    if decider is not prim and prim.outcome == "unresolved":
        # an unresolved throughput may lean against the answer: its estimate goes with the answer, in every form
        head += f"; {prim.what} unresolved"
        line += (f"; {prim.what} unresolved: {prim.difference(base, cand)}, reaching inside the band "
                 f"{band(prim.win_band)}")  # fmt: skip
    text = f"{title} ({decider.cell.label()}): {line}"
    if decider is not prim:
        held = "tied" if prim.outcome == "tie" else "did not separate them"
        text += f" — decided by {decider.what}: the deciding figure ({prim.what}) {held}"
    if tradeoffs:
        text += "; trade-off: " + "; ".join(tradeoffs)
    if be is not None:
        text += f"; {be.text()}"
    figs = "; ".join(f"{c.what}: {base} {c.figures()[0]} vs {cand} {c.figures()[1]} ({c.outcome})" for c in mine)
    return RegimeAnswer(step, title, a, f"{text} — {figs}", decider.cell.label(), tuple(mine), fix, head,
                        decider.what, tradeoffs, be, line)  # fmt: skip


def from_live(a: RegimeAnswer, f: LiveFinding, min_pairs: int) -> RegimeAnswer:
    """The regime answered by the anytime-valid live verdict (mirrored traffic): faster = win, slower = loss."""
    ans = {"faster": "win", "slower": "loss", "tie": "tie"}.get(f.finding, "not yet")
    head = f.text if f.pairs else "no pairs yet"
    if ans == "not yet" and f.pairs < min_pairs:
        head = f"not yet — {f.pairs} pairs; nothing is decided before {min_pairs}"
    return replace(a, answer=ans if f.pairs else "not measured", head=head, line=head,
                   text=f"{a.title} (live, anytime-valid): {head}", decided_by=f"{f.metric} (live)")  # fmt: skip


def rerun(command: str | None, flags: str) -> str:
    """The bench command with ``flags`` set (replacing the same flags where the command has them), into a fresh
    ``--out`` (the next name after the run's own: a rerun never writes over the run it improves on)."""
    if not command:
        return f"rerun the bench with {flags} and a fresh --out"
    try:
        argv = shlex.split(command)
        new = shlex.split(flags)
    except ValueError:
        return f"{command} {flags}"
    if "--out" not in {a.split("=", 1)[0] for a in new}:
        old = next((a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
                    for i, a in enumerate(argv) if a.split("=", 1)[0] == "--out"), None)  # fmt: skip
        default = "tune-out" if "tune" in argv[1:2] else "bench-out"
        new += ["--out", next_name(old or default)]
    names = {a for a in new if a.startswith("--")}
    return shlex.join(without_flags(argv, *names) + new)


#: where the report weighed by the traffic goes: beside the per-workload one, never over it
TRAFFIC_OUT = "traffic-report"
_TRAFFIC_HOW = ("put your traffic's share of busy time at each number of requests in flight (percent; the even split "
                "is a placeholder), or --traffic URL/PATH to take it from the proxy's own record (its /metrics, its "
                "comparison or request log)")  # fmt: skip


def even_split(levels: Sequence[float]) -> str:
    """``c1=34,c4=33,c64=33``: the measured concurrency levels, equal whole-percent shares summing to 100."""
    n = len(levels)
    shares = [100 // n + (1 if i < 100 % n else 0) for i in range(n)]
    return ",".join(f"c{c:g}={x}" for c, x in zip(levels, shares, strict=True))


def weigh_next(r: Results, cells: Sequence[Comparison]) -> str:
    """What to run when the answer depends on the traffic: the report on these same results, weighed by a traffic
    profile over the concurrency levels measured (an even split to replace with the user's shares; a live report:
    the profile its own log records), into a fresh ``--out``. A shell comment after the command says what to put."""
    levels = sorted({c.cell.concurrency for c in cells if c.cell.prompt_len == r.base_prompt_len
                     and c.cell.rate is None} or {c.cell.concurrency for c in cells})  # fmt: skip
    spec = even_split(levels) if levels else "c1=50,c16=50"
    if not r.report_command:
        return f"weigh it by your traffic: the report again with --traffic {spec} — {_TRAFFIC_HOW}"
    argv = shlex.split(r.report_command)
    if r.live and "--log" in argv:  # the comparison log records the traffic it mirrored: its own profile
        log = argv[argv.index("--log") + 1]
        return shlex.join([*argv, "--traffic", log, "--out", TRAFFIC_OUT]) + (
            "  # the traffic profile this log recorded (the time at each number of requests in flight); or "
            "--traffic c1=PCT,c4=PCT,… with your own shares")  # fmt: skip
    return shlex.join([*argv, "--traffic", spec, "--out", TRAFFIC_OUT]) + f"  # {_TRAFFIC_HOW}"


def _names(xs: Sequence[RegimeAnswer]) -> str:
    return ", ".join(a.title for a in xs)


def depends_on(regimes: Sequence[RegimeAnswer], cells: Sequence[Comparison], base: str, cand: str,
               base_prompt: str | None) -> str:  # fmt: skip
    """The decision per workload, when the resolved regimes disagree."""
    wins = [a for a in regimes if a.answer == "win"]
    losses = [a for a in regimes if a.answer == "loss"]

    def serves(xs: Sequence[RegimeAnswer]) -> str:
        return " and ".join(f"{SERVES[a.step]} ({a.head})" for a in xs)

    out = f"stay with {base} for {serves(losses)}; switch to {cand} for {serves(wins)}"
    x = crossing(cells, base_prompt)
    if x is not None:
        lo, hi, at = x
        first = next(c for c in cells if c.cell.concurrency == lo and c.cell.prompt_len == base_prompt)
        who, other = (cand, base) if first.log_gain[0] < 0 else (base, cand)
        out += (f". As concurrency rises, {who} overtakes {other} between c={lo} and c={hi} (≈ c={at:.1f} by "
                "interpolation)")  # fmt: skip
    be = next((a.break_even for a in regimes if a.step == "decode" and a.break_even), None)
    if be is not None:
        out += f". One request at a time, {be.text()}"
    return out


def conclude(
    r: Results, base: str, cand: str, reasons: list[Reason], comps: Sequence[Comparison], aa: str | None,
    measured: set[str], slots: int | None, cells: Sequence[Comparison] = (),
    traffic: TrafficAnswer | None = None, live: Mapping[str, LiveFinding] | None = None,
) -> Conclusion:  # fmt: skip
    order = {s: i for i, s in enumerate(STEPS)}
    reasons.sort(key=lambda x: order.get(x.step, len(STEPS)))  # stable: each gate's reasons keep their order
    regimes = tuple(answer(step, title, comps, base, cand, slots, r.live) for step, title in REGIMES)
    if live is not None:
        regimes = tuple(from_live(a, live[a.step], MIN_PAIRS) if a.step in live else a for a in regimes)
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
    if live is not None and not any(f.pairs for f in live.values()):
        return Conclusion("not yet", f"not yet — no pair a regime's live figure can read so far (a non-streamed answer "
                          f"has no TPOT); nothing is decided before {MIN_PAIRS} pairs in a regime", tuple(reasons),
                          "decode", "not yet", regimes, "more mirrored traffic (streamed): the live verdict decides "
                          "by itself")  # fmt: skip
    if live is not None:
        required: tuple[str, ...] = tuple(s for s, f in live.items() if f.pairs)
    else:
        required = ("decode", "throughput")
    wins = [a for a in regimes if a.answer == "win"]
    losses = [a for a in regimes if a.answer == "loss"]
    blocked = [by[s] for s in required if by[s].answer in ("unresolved", "flagged", "not yet")]
    missing = [by[s] for s in required if by[s].answer == "not measured"]
    long = by["long-context"]
    tail = f"; long prompts {long.head}" if long.answer in ("unresolved", "flagged") else ""

    def lean() -> str:
        return "; ".join(f"{a.title}: {a.head}" for a in regimes if a.answer in ("win", "loss", "tie"))

    if traffic is not None:
        nxt = None if traffic.decision != "inconclusive" else next(
            (rerun(r.command, a.fix) for a in regimes if a.fix and a.fix.startswith("--")), None)  # fmt: skip
        decision = (
            "switch" if traffic.decision == "switch" else "stay" if traffic.decision == "stay" else "inconclusive"
        )
        summary = f"{decision.upper()} for this traffic: {traffic.text}" + (
            f" — per regime: {lean()}" if lean() else ""
        )
        return Conclusion(decision, summary, tuple(reasons), None if decision != "inconclusive" else "traffic",
                          None if decision != "inconclusive" else "traffic", regimes, nxt)  # fmt: skip
    if wins and losses:
        summary = f"depends on your traffic: {depends_on(regimes, cells, base, cand, r.base_prompt_len)}"
        return Conclusion("depends", summary, tuple(reasons), None, None, regimes, weigh_next(r, cells))
    if blocked:
        b = blocked[0]
        leaning = f" (so far: {lean()})" if lean() else ""
        if b.answer == "not yet":
            return Conclusion("not yet", f"{_names(blocked)} not decided yet{leaning}: {b.head}", tuple(reasons),
                              b.step, "not yet", regimes, "more mirrored traffic: the live verdict decides by itself")  # fmt: skip
        fixes = [a.fix for a in blocked if a.fix]
        nxt = rerun(r.command, fixes[0]) if fixes and fixes[0].startswith("--") else (
            fixes[0] if fixes else f"no feasible rerun resolves {_names(blocked)}: the difference sits at the band "
            "(a larger effect, a quieter machine or more requests per repeat are the only ways)")  # fmt: skip
        summary = f"{_names(blocked)} {b.answer}{leaning}: {b.text}"
        prim = next((c for c in b.comparisons if c.primary), None)
        return Conclusion("inconclusive", summary, tuple(reasons), b.step, prim.metric if prim else b.answer, regimes,
                          nxt)  # fmt: skip
    if missing:
        flags = " ".join(a.fix or "" for a in missing if a.fix and a.fix.startswith("--")).strip()
        leaning = lean() or "nothing decided"
        summary = (f"partial answer — {leaning}; {_names(missing)} not measured, so neither switch nor stay "
                   f"(add {' and '.join(a.fix or '' for a in missing)})")  # fmt: skip
        return Conclusion("partial", summary + tail, tuple(reasons), missing[0].step, "not measured", regimes,
                          rerun(r.command, flags) if flags else None)  # fmt: skip
    if wins:
        summary = f"{cand} is better on {_names(wins)} and worse on nothing — {lean()}"
        return Conclusion("switch", summary + tail, tuple(reasons), None, None, regimes, None)
    if losses:
        summary = f"{cand} is worse on {_names(losses)} and better on nothing — {lean()}"
        return Conclusion("stay", summary + tail, tuple(reasons), None, None, regimes, None)
    ties = [a for a in regimes if a.answer == "tie"]
    if ties:
        decode_bound = by["decode"].answer == "tie" and by["throughput"].answer == "tie"
        summary = (f"no difference between {base} and {cand} beyond the band on {_names(ties)}"
                   + (" — decode-bound: the same per-token speed alone and under load; switching engines won't fix "
                      "it" if decode_bound else ""))  # fmt: skip
        return Conclusion("stay", summary + tail, tuple(reasons), None, None, regimes, None)
    return Conclusion("inconclusive", "nothing comparable was measured on both engines", tuple(reasons), "data",
                      "cells", regimes, None)  # fmt: skip
