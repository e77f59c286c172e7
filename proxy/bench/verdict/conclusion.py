"""The regimes' answers -> the decision, its summary and what to run next. Pure.

The decision reads the regimes (``proxy.bench.verdict.regimes``):

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

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from proxy.bench.verdict.comparison import Comparison
from proxy.bench.verdict.inputs import FAILS, STEPS, Decision, LiveFinding, Reason, Results
from proxy.bench.verdict.regimes import GATES, REGIMES, RegimeAnswer, answer, from_live, rerun, weigh_next
from proxy.bench.verdict.weighting import TrafficAnswer, crossing
from proxy.sequential import MIN_PAIRS

#: the traffic each regime stands for, in the decision's sentences
SERVES = {"decode": "one request at a time", "throughput": "concurrent traffic", "long-context": "long prompts"}


class Conclusion(NamedTuple):
    decision: Decision
    summary: str
    reasons: tuple[Reason, ...]
    stopped_at: str | None
    stopped_check: str | None
    regimes: tuple[RegimeAnswer, ...]
    next_step: str | None


def conclude(
    r: Results,
    base: str,
    cand: str,
    reasons: list[Reason],
    comps: Sequence[Comparison],
    slots: int | None,
    cells: Sequence[Comparison] = (),
    traffic: TrafficAnswer | None = None,
    live: Mapping[str, LiveFinding] | None = None,
) -> Conclusion:
    """The decision from the gates' reasons (sorted into the gates' order here) and the regimes' comparisons."""
    order = {s: i for i, s in enumerate(STEPS)}
    reasons.sort(key=lambda x: order.get(x.step, len(STEPS)))  # stable: each gate's reasons keep their order
    regimes = tuple(answer(step, title, comps, base, cand, slots, r.live) for step, title in REGIMES)
    if live is not None:
        regimes = tuple(from_live(a, live[a.step], MIN_PAIRS) if a.step in live else a for a in regimes)
    failed = next((x for x in reasons if x.step in GATES and x.outcome in FAILS), None)
    if failed is not None:
        return _stopped(failed, reasons, order, regimes)
    if live is not None and not any(f.pairs for f in live.values()):
        return Conclusion(
            "not yet",
            f"not yet — no pair a regime's live figure can read so far (a non-streamed answer "
            f"has no TPOT); nothing is decided before {MIN_PAIRS} pairs in a regime",
            tuple(reasons),
            "decode",
            "not yet",
            regimes,
            "more mirrored traffic (streamed): the live verdict decides by itself",
        )
    if traffic is not None:
        return _for_traffic(r, traffic, tuple(reasons), regimes)
    by = {a.step: a for a in regimes}
    required = tuple(s for s, f in live.items() if f.pairs) if live is not None else ("decode", "throughput")
    wins = [a for a in regimes if a.answer == "win"]
    losses = [a for a in regimes if a.answer == "loss"]
    blocked = [by[s] for s in required if by[s].answer in ("unresolved", "flagged", "not yet")]
    missing = [by[s] for s in required if by[s].answer == "not measured"]
    long = by["long-context"]
    tail = f"; long prompts {long.head}" if long.answer in ("unresolved", "flagged") else ""
    if wins and losses:
        summary = f"depends on your traffic: {depends_on(regimes, cells, base, cand, r.base_prompt_len)}"
        return Conclusion("depends", summary, tuple(reasons), None, None, regimes, weigh_next(r, cells))
    if blocked:
        return _blocked(r, blocked, tuple(reasons), regimes)
    if missing:
        return _partial(r, missing, tuple(reasons), regimes, tail)
    return _resolved(base, cand, tuple(reasons), regimes, tail)


def depends_on(
    regimes: Sequence[RegimeAnswer], cells: Sequence[Comparison], base: str, cand: str, base_prompt: str | None
) -> str:
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
        out += (
            f". As concurrency rises, {who} overtakes {other} between c={lo} and c={hi} (≈ c={at:.1f} by interpolation)"
        )
    be = next((a.break_even for a in regimes if a.step == "decode" and a.break_even), None)
    if be is not None:
        out += f". One request at a time, {be.text()}"
    return out


def _stopped(
    failed: Reason, reasons: Sequence[Reason], order: Mapping[str, int], regimes: tuple[RegimeAnswer, ...]
) -> Conclusion:
    """A gate failed: it decides; the reasons of the gates after it are shown, not decisive."""
    stop = order[failed.step]
    reasons = [replace(x, decisive=False) if order.get(x.step, 99) > stop else x for x in reasons]
    gate_fails = [x for x in reasons if x.step == failed.step and x.outcome in FAILS]
    more = f" (+{len(gate_fails) - 1} more)" if len(gate_fails) > 1 else ""
    decision: Decision = "stay" if failed.outcome == "stay" else "inconclusive"
    check = f" ({failed.check})" if failed.check else ""
    summary = f"stopped at the {failed.step} gate{check}: {failed.text}{more}"
    return Conclusion(decision, summary, tuple(reasons), failed.step, failed.check or failed.step, regimes, None)


def _lean(regimes: Sequence[RegimeAnswer]) -> str:
    """What the resolved regimes say so far, in a few words each."""
    return "; ".join(f"{a.title}: {a.head}" for a in regimes if a.answer in ("win", "loss", "tie"))


def _names(xs: Sequence[RegimeAnswer]) -> str:
    return ", ".join(a.title for a in xs)


def _for_traffic(
    r: Results, traffic: TrafficAnswer, reasons: tuple[Reason, ...], regimes: tuple[RegimeAnswer, ...]
) -> Conclusion:
    """The traffic profile decides; inconclusive: the first regime's rerun that would resolve it."""
    decision: Decision = (
        "switch" if traffic.decision == "switch" else "stay" if traffic.decision == "stay" else "inconclusive"
    )
    nxt = (
        None
        if traffic.decision != "inconclusive"
        else next((rerun(r.command, a.fix) for a in regimes if a.fix and a.fix.startswith("--")), None)
    )
    lean = _lean(regimes)
    summary = f"{decision.upper()} for this traffic: {traffic.text}" + (f" — per regime: {lean}" if lean else "")
    stopped = None if decision != "inconclusive" else "traffic"
    return Conclusion(decision, summary, reasons, stopped, stopped, regimes, nxt)


def _blocked(
    r: Results, blocked: Sequence[RegimeAnswer], reasons: tuple[Reason, ...], regimes: tuple[RegimeAnswer, ...]
) -> Conclusion:
    """A required regime unresolved or flagged (inconclusive), or not decided yet by the live verdict."""
    b = blocked[0]
    leaning = f" (so far: {_lean(regimes)})" if _lean(regimes) else ""
    if b.answer == "not yet":
        return Conclusion(
            "not yet",
            f"{_names(blocked)} not decided yet{leaning}: {b.head}",
            reasons,
            b.step,
            "not yet",
            regimes,
            "more mirrored traffic: the live verdict decides by itself",
        )
    fixes = [a.fix for a in blocked if a.fix]
    nxt = (
        rerun(r.command, fixes[0])
        if fixes and fixes[0].startswith("--")
        else (
            fixes[0]
            if fixes
            else f"no feasible rerun resolves {_names(blocked)}: the difference sits at the band "
            "(a larger effect, a quieter machine or more requests per repeat are the only ways)"
        )
    )
    summary = f"{_names(blocked)} {b.answer}{leaning}: {b.text}"
    prim = next((c for c in b.comparisons if c.primary), None)
    return Conclusion("inconclusive", summary, reasons, b.step, prim.metric if prim else b.answer, regimes, nxt)


def _partial(
    r: Results,
    missing: Sequence[RegimeAnswer],
    reasons: tuple[Reason, ...],
    regimes: tuple[RegimeAnswer, ...],
    tail: str,
) -> Conclusion:
    """A required regime not measured: neither switch nor stay, with the flags that measure it."""
    flags = " ".join(a.fix or "" for a in missing if a.fix and a.fix.startswith("--")).strip()
    summary = (
        f"partial answer — {_lean(regimes) or 'nothing decided'}; {_names(missing)} not measured, so neither switch "
        f"nor stay (add {' and '.join(a.fix or '' for a in missing)})"
    )
    nxt = rerun(r.command, flags) if flags else None
    return Conclusion("partial", summary + tail, reasons, missing[0].step, "not measured", regimes, nxt)


def _resolved(
    base: str, cand: str, reasons: tuple[Reason, ...], regimes: tuple[RegimeAnswer, ...], tail: str
) -> Conclusion:
    """Every required regime resolved and none against another: switch, stay, or stay on a tie."""
    wins = [a for a in regimes if a.answer == "win"]
    losses = [a for a in regimes if a.answer == "loss"]
    ties = [a for a in regimes if a.answer == "tie"]
    if wins:
        summary = f"{cand} is better on {_names(wins)} and worse on nothing — {_lean(regimes)}"
        return Conclusion("switch", summary + tail, reasons, None, None, regimes, None)
    if losses:
        summary = f"{cand} is worse on {_names(losses)} and better on nothing — {_lean(regimes)}"
        return Conclusion("stay", summary + tail, reasons, None, None, regimes, None)
    if ties:
        by = {a.step: a for a in regimes}
        decode_bound = by["decode"].answer == "tie" and by["throughput"].answer == "tie"
        summary = f"no difference between {base} and {cand} beyond the band on {_names(ties)}" + (
            " — decode-bound: the same per-token speed alone and under load; switching engines won't fix it"
            if decode_bound
            else ""
        )
        return Conclusion("stay", summary + tail, reasons, None, None, regimes, None)
    return Conclusion(
        "inconclusive", "nothing comparable was measured on both engines", reasons, "data", "cells", regimes, None
    )
