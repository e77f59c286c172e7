"""Results -> per-regime answers -> switch | stay | partial | inconclusive. Pure: no I/O, no clock.

Gates first, in a fixed order (``proxy.bench.verdict.gates``); a failed gate stops the verdict there (which gate,
which check, why):

1. **parity**: prompt tokens, effective sampling (what the per-kind mapping dropped included), max tokens,
   output lengths, context per slot, quantization (normalized: F16 = FP16 = float16; bf16 ≠ f16); slots below
   the offered concurrency are stated;
2. **data**: every engine answered without errors, every judged cell has >= ``min_repeats`` repeats, the
   judged cache phase is what it says (cold: nothing served from the prompt cache; warm: cached tokens seen);
3. **memory**: the candidate's per-engine peak against the user's budget, or its GPU's total when it held
   that GPU alone; device-wide readings are not judged.

Then the speed, one **regime** at a time, the order the people deciding read it (``proxy.bench.verdict.regimes``;
the decision from their answers: ``proxy.bench.verdict.conclusion``):

- **single request** (step ``decode``): TPOT at concurrency 1, the base cell (decode tok/s = 1/TPOT); TTFT
  beside it;
- **under load** (step ``throughput``): aggregate output tok/s at the highest concurrency (or request rate)
  measured on both; TTFT under load beside it;
- **long prompts** (step ``long-context``): TTFT at the longest prompt class, concurrency 1; TPOT beside it.

Each comparison is paired per request (``evidence``, ``stats.paired_bootstrap``): a 95 % interval of the relative
difference whose width grows with the run-to-run variation. It is judged against a **band**: the larger of
``min_effect`` (practical significance, ``--min-effect``) and the **noise floor** (the baseline against its
own second pass, A/A, in the same run; without one, the run-to-run variation). A win needs the whole
interval beyond the band, a tie the whole interval inside it; anything else is *unresolved*, with the
repeats that would resolve it. An A/A pass whose own interval excludes 0 is a **protocol bias** (order,
drift): it is named, and its size is added to the band a win must clear, never silently to the floor. A cell
where an engine was busy with requests the bench did not send is *flagged* and cannot decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.suite import length_rank
from proxy.bench.verdict.checks import first_repeat
from proxy.bench.verdict.comparison import Comparison
from proxy.bench.verdict.conclusion import conclude
from proxy.bench.verdict.evidence import Evidence
from proxy.bench.verdict.gates.datagate import data_gate
from proxy.bench.verdict.gates.memorygate import CAVEAT, memory_gate
from proxy.bench.verdict.gates.paritygate import discount_for, parity_gate, quant_differs
from proxy.bench.verdict.inputs import Cell, Decision, EngineInfo, Reason, Req, Results, Sample
from proxy.bench.verdict.regimes import RegimeAnswer
from proxy.bench.verdict.weighting import TrafficAnswer, weigh
from proxy.notation import band, figure

__all__ = [
    "Cell",
    "Comparison",
    "EngineInfo",
    "Reason",
    "RegimeAnswer",
    "Req",
    "Results",
    "Sample",
    "Verdict",
    "decide",
    "decide_all",
]


def discounted_tag(discounted: str | None, differs: str | None = None) -> str:
    """``" (discounted)"`` after a decision whose answer includes more than the engines (a declared precision
    difference), else ``""``; ``differs``: a faster candidate answers differently (a quality bound crossed):
    ``" (discounted; faster, but answers differently: same top token 80.6 % [77.4–83.6] < 90%)"``."""
    tags = ["discounted"] if discounted else []
    if differs:
        tags.append(f"faster, but answers differently: {differs}")
    return f" ({'; '.join(tags)})" if tags else ""


@dataclass(frozen=True, slots=True)
class Verdict:
    baseline: str
    candidate: str
    decision: Decision
    summary: str
    reasons: tuple[Reason, ...]
    comparisons: tuple[Comparison, ...] = ()
    stopped_at: str | None = None  # the gate (or regime step) that decided against a full answer
    stopped_check: str | None = None
    noise_source: str | None = None
    regimes: tuple[RegimeAnswer, ...] = ()
    #: what to run next (inconclusive / partial): the flags to add, or that no feasible rerun resolves it
    next_step: str | None = None
    #: a declared quantization difference was accepted: what the answer includes besides the engines (None: clean)
    discounted: str | None = None
    #: one comparison per measured cell of the concurrency sweep and of each prompt class (their regimes' figures:
    #: the whole request at c=1, output tok/s above): what a traffic profile is weighed with, where they cross
    cells: tuple[Comparison, ...] = ()
    #: the answer for the traffic given (``--traffic``); None: none given
    traffic: TrafficAnswer | None = None
    #: what stands beside the answer without changing it (a memory excess a setting makes, within 2 % of the budget)
    caveats: tuple[str, ...] = ()
    #: a SWITCH whose candidate answers differently (``proxy.bench.quality``: a bound its agreement or accuracy
    #: crosses, said in the tag: "faster, but answers differently: ..."); None: within the bounds or not measured
    differs: str | None = None

    @property
    def tag(self) -> str:
        """What follows the decision wherever it is written: ``discounted_tag``."""
        return discounted_tag(self.discounted, self.differs)

    def to_json(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "candidate": self.candidate,
            "decision": self.decision,
            "summary": self.summary,
            "caveats": list(self.caveats),
            "traffic": self.traffic.to_json() if self.traffic else None,
            "cells": [
                {
                    "cell": c.cell.label(),
                    "concurrency": c.cell.concurrency,
                    "prompt": c.cell.prompt_len,
                    "figure": c.what,
                    "speed_ratio": c.speed[0],
                    "ci95": list(c.speed[1:]),
                    "outcome": c.outcome,
                }
                for c in self.cells
            ],
            "stopped_at": {"gate": self.stopped_at, "check": self.stopped_check or "unnamed"}
            if self.stopped_at
            else None,
            "regimes": [a.to_json() for a in self.regimes],
            "next_step": self.next_step,
            "discounted": self.discounted,
            "answers_differently": self.differs,
            "reasons": [
                {"gate": x.step, "check": x.check, "outcome": x.outcome, "decisive": x.decisive, "text": x.text}
                for x in self.reasons
            ],
            "comparisons": [c.to_json() for c in self.comparisons],
        }


def decide_all(r: Results) -> list[Verdict]:
    """One verdict per candidate engine (every engine but the baseline and its A/A pass)."""
    return [decide(r, e.name) for e in r.engines if e.name != r.baseline and e.aa_of is None]


def judged_phase(samples: Sequence[Sample]) -> str | None:
    """cache-cold is the fair comparison; warm-cache results are reported, not judged, when both exist."""
    caches = {s.cell.cache for s in samples}
    return "cold" if "cold" in caches else "live" if "live" in caches else "warm" if caches else None


def decide(r: Results, candidate: str) -> Verdict:
    """The candidate against the baseline: the gates, then the regimes (see the module docstring)."""
    base = r.baseline
    infos = {e.name: e for e in r.engines}
    if base not in infos or candidate not in infos:
        missing = base if base not in infos else candidate
        why = f"engine {missing!r} has no results"
        reason = Reason("data", "inconclusive", why, "engines")
        return Verdict(base, candidate, "inconclusive", why, (reason,), (), "data", "engines")
    aa = next((e.name for e in r.engines if e.aa_of == base), None)
    samples = [s for s in r.samples if s.engine in (base, candidate, aa)]
    judged = judged_phase(samples)
    by: dict[tuple[str, Cell], list[Sample]] = {}
    for s in samples:
        if s.cell.cache == judged:
            by.setdefault((s.engine, s.cell), []).append(s)
    common = {c for (e, c) in by if e == base} & {c for (e, c) in by if e == candidate}
    # live blocks are slices of the traffic in time, not repeats after a missing warm-up: none is left out
    cold = [] if r.live else _cold_first_repeats(by, common, (base, candidate, aa))
    reasons: list[Reason] = data_gate(r, samples, base, candidate, judged, common, by)
    reasons += parity_gate(r, infos[base], infos[candidate], max((c.concurrency for c in common), default=None))
    reasons += r.extra_parity
    reasons += memory_gate(r, samples, base, candidate)
    if cold:
        why = "repeat 0 left out where it ran cold (no warm-up before it, far from the other repeats): "
        reasons.append(Reason("data", "note", why + "; ".join(cold), "first repeat"))
    reqs: dict[tuple[str, Cell, int], dict[int, Req]] = {}
    for q in r.requests:
        if q.ok and q.cell.cache == judged:
            reqs.setdefault((q.engine, q.cell, q.repeat), {})[q.index] = q
    ev = Evidence(r, base, candidate, aa, by, reqs)
    comps = _regime_comparisons(ev, common)
    reasons += [Reason(c.step, c.outcome, _text(c, base, candidate), c.metric) for c in comps]
    cells = [] if r.live else _cells(ev, common)
    answer = weigh(r.traffic, cells, base, candidate, r.base_prompt_len) if r.traffic is not None and cells else None
    slots = [e.slots for e in (infos[base], infos[candidate]) if e.slots]
    live = r.live_findings.get(candidate) if r.live else None
    c = conclude(r, base, candidate, reasons, comps, max(slots) if slots else None, cells, answer, live)
    b, k = infos[base], infos[candidate]
    qual = r.quality.get(candidate)
    #: on random weights the agreement measures the network's noise: said in the discount, never a tag
    rnd = bool(r.random_of(base, candidate))
    return Verdict(
        base,
        candidate,
        c.decision,
        c.summary,
        c.reasons,
        tuple(comps),
        c.stopped_at,
        c.stopped_check,
        "A/A pass" if aa else "run-to-run variation",
        c.regimes,
        c.next_step,
        discount_for(r, b, k) if r.accept_quantization_difference and quant_differs(b, k) else None,
        tuple(cells),
        answer,
        tuple(x.text for x in c.reasons if x.check == CAVEAT),
        qual.differs if qual is not None and c.decision == "switch" and not rnd else None,
    )


def _regime_comparisons(ev: Evidence, common: set[Cell]) -> list[Comparison]:
    """Each regime's comparisons, its deciding figure first: single request (c=1, the base cell), under load (the
    highest concurrency or rate measured on both), long prompts (the longest prompt class at c=1)."""
    r = ev.r
    comps: list[Comparison] = []

    def compare(step: str, cell: Cell, metric: str, unit: str, higher: bool, what: str, primary: bool) -> None:
        comp = ev.compare(step, what, cell, metric, unit, higher, metric != "output_tps", primary)
        if comp is not None:
            comps.append(comp)

    base_mt, base_pl = r.base_max_tokens, r.base_prompt_len
    c1 = [c for c in common if c.concurrency == 1 and c.rate is None]
    single = _pick(c1, base_mt, base_pl)
    if single is not None:
        if r.live or not ev.has(single, "e2e_s"):  # mirrored pairs' answers differ in length
            compare("decode", single, "tpot_s", "s/token", False, "single-request decode (TPOT)", True)
        else:
            compare("decode", single, "e2e_s", "s", False, f"whole request, {_tokens(single)}", True)
            compare("decode", single, "tpot_s", "s/token", False, "decode (TPOT)", False)
        compare("decode", single, "ttft_s", "s", False, "TTFT", False)

    conc = [
        c for c in common if (c.concurrency > 1 or c.rate is not None) and (base_pl is None or c.prompt_len == base_pl)
    ]
    conc = [c for c in conc if base_mt is None or c.max_tokens == base_mt] or conc
    if conc:
        top = max(conc, key=lambda c: (c.rate or 0, c.concurrency))
        if r.live:  # mirrored pairs: no aggregate throughput; the busiest observed-concurrency group, per request
            compare("throughput", top, "ttft_s", "s", False, "TTFT under load (observed)", True)
            compare("throughput", top, "tpot_s", "s/token", False, "decode under load (observed)", False)
        else:
            compare("throughput", top, "output_tps", "tok/s", True, f"output tok/s at c={top.concurrency}", True)
            compare("throughput", top, "ttft_s", "s", False, f"TTFT at c={top.concurrency}", False)

    longs = [c for c in c1 if c.prompt_len != base_pl and c.prompt_len != "mixed"]
    longs = [c for c in longs if base_mt is None or c.max_tokens == base_mt] or longs
    if longs and not r.live:
        longest = max(longs, key=lambda c: length_rank(c.prompt_len))
        if base_pl is None or length_rank(longest.prompt_len) > length_rank(base_pl):
            p = longest.prompt_len
            if ev.has(longest, "e2e_s"):
                compare("long-context", longest, "e2e_s", "s", False, f"whole {p}-prompt request", True)
                compare("long-context", longest, "ttft_s", "s", False, f"TTFT ({p} prompt)", False)
            else:
                compare("long-context", longest, "ttft_s", "s", False, f"TTFT ({p} prompt)", True)
            compare("long-context", longest, "tpot_s", "s/token", False, f"decode after a {p} prompt (TPOT)", False)
    return comps


def _cold_first_repeats(
    by: dict[tuple[str, Cell], list[Sample]], common: set[Cell], engines: Sequence[str | None]
) -> list[str]:
    """Repeat 0 of a cell, left out of every comparison in it when one engine's repeat 0 sits far from its other
    repeats (``checks.first_repeat``: a cell measured without a warm-up — a protocol artifact, not the engine's
    speed) and 3 repeats or more remain. Returns what was left out, in words."""
    said: list[str] = []
    mine = [s for (e, c), ss in by.items() if e in engines and c in common for s in ss]
    for x in first_repeat(mine):
        cell = x.cell
        if not x.outlier or any(len({s.repeat for s in by.get((e, cell), [])} - {0}) < 3 for e in engines if e):
            continue
        if all((e, cell) not in by or all(s.repeat != 0 for s in by[(e, cell)]) for e in engines if e):
            continue  # already left out for another engine or figure
        for e in engines:
            if e and (e, cell) in by:
                by[(e, cell)] = [s for s in by[(e, cell)] if s.repeat != 0]
        name = {"ttft_s": "TTFT", "tpot_s": "TPOT", "output_tps": "output tok/s"}.get(x.metric, x.metric)
        said.append(
            f"{cell.label()} ({x.engine}'s {name} {figure(x.metric, x.first)} against "
            f"{figure(x.metric, x.others_median)} in the other repeats)"
        )
    return said


def _tokens(cell: Cell) -> str:
    return f"{cell.max_tokens}-token answer" if cell.max_tokens else "its answer"


def _cells(ev: Evidence, common: set[Cell]) -> list[Comparison]:
    """One comparison per measured cell at the base output length, in each regime's own figure: the whole
    request at c=1, output tok/s above (what a traffic profile is weighed with)."""
    out = []
    mts = {c.max_tokens for c in common}
    mt = ev.r.base_max_tokens if ev.r.base_max_tokens in mts else (min(mts) if mts else None)
    for cell in sorted(
        (c for c in common if c.max_tokens == mt and c.rate is None),
        key=lambda c: (length_rank(c.prompt_len), c.concurrency),
    ):
        if cell.concurrency == 1 and ev.has(cell, "e2e_s"):
            what = f"whole request ({cell.prompt_len} prompt, c=1)"
            comp = ev.compare("cell", what, cell, "e2e_s", "s", False, True, True)
        else:
            what = f"output tok/s ({cell.prompt_len} prompt, c={cell.concurrency})"
            comp = ev.compare("cell", what, cell, "output_tps", "tok/s", True, False, True)
        if comp is not None:
            out.append(comp)
    return out


def _text(comp: Comparison, base: str, cand: str) -> str:
    o, cell, what = comp.outcome, comp.cell.label(), comp.what
    nums = comp.numbers(base, cand)
    if o == "flagged":
        return f"{what} ({cell}): cannot decide — {comp.flagged}: {nums}"
    if o == "tie":
        wide = (
            " (the noise floor, wider than the minimum effect: no smaller difference can be seen in this run)"
            if comp.win_band > comp.min_effect
            else ""
        )
        return f"{what} ({cell}): tie — the interval sits inside the band {band(comp.win_band)}{wide}: {nums}"
    if o == "unresolved":
        worst = max(comp.variation.items(), key=lambda kv: kv[1] or 0, default=("", None))
        cause = f"; run-to-run variation {worst[1]:.0%} on {worst[0]} widens it" if worst[1] and worst[1] > 0.1 else ""
        n = comp.repeats_to_resolve()
        fix = f"; about {n} repeats would resolve it" if n else "; no feasible number of repeats resolves it"
        return f"{what} ({cell}): unresolved — the interval crosses the band {band(comp.win_band)}{cause}{fix}: {nums}"
    who = cand if o == "win" else base
    return f"{what} ({cell}): {who} is better beyond the band {band(comp.win_band)}: {nums}"


def _pick(cells: Sequence[Cell], max_tokens: int | None, prompt_len: str | None) -> Cell | None:
    if not cells:
        return None
    exact = [
        c
        for c in cells
        if (max_tokens is None or c.max_tokens == max_tokens) and (prompt_len is None or c.prompt_len == prompt_len)
    ]
    return sorted(exact or cells, key=lambda c: (c.max_tokens, c.prompt_len))[0]
