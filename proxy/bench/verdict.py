"""Results -> stay | switch | inconclusive, through gates in a fixed order. Pure: no I/O, no clock.

1. **data**: every engine answered without errors, every judged cell has >= ``min_repeats`` repeats, the
   judged cache phase is what it says (cold: nothing served from the prompt cache; warm: cached tokens seen);
2. **parity**: prompt tokens, effective sampling (what the per-kind mapping dropped included), max tokens,
   output lengths, context per slot, quantization (normalized: F16 = FP16 = float16; bf16 ≠ f16); slots below
   the offered concurrency are stated;
3. **memory**: the candidate's per-engine peak against the user's budget, or its GPU's total when it held
   that GPU alone; device-wide readings are not judged;
4. **decode**: single-request decode speed (concurrency 1, base cell), judged on TPOT (decode tok/s = 1/TPOT;
   the mean of a time stays robust when a starved client reads several chunks at once); a tie reads
   "decode-bound";
5. **throughput**: aggregate output tok/s and per-request TTFT (queueing included) at the highest concurrency
   (or request rate) measured on both;
6. **long context**: TTFT and TPOT at the longest prompt class, concurrency 1.

A failed gate stops the verdict there (which gate, which check, why); later steps are still computed and
shown, marked not decisive. Steps 4-6 compare per-request pairs (``stats.paired_bootstrap``): a 95 % interval
of the relative difference and an effect size, judged against the **noise floor** — the same comparison of the
baseline with its own second pass (A/A) in the same run, or, without one, the run-to-run variation. A win needs
the whole interval beyond the floor; a tie needs it inside; an interval across the floor is *unresolved*; a
figure whose run-to-run variation exceeds ``max_variation`` (20 %) is refused (*noisy*). Decision: wins and no
losses -> switch; losses and no wins, or only ties -> stay; both -> inconclusive (mixed).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.bench.gates import data_gate, memory_gate, parity_gate
from proxy.bench.model import FAILS, STEPS, Cell, Decision, EngineInfo, Outcome, Reason, Req, Results, Sample
from proxy.bench.stats import Paired, paired_bootstrap, variation
from proxy.bench.suite import length_rank

__all__ = ["Cell", "Comparison", "EngineInfo", "Reason", "Req", "Results", "Sample", "Verdict", "decide", "decide_all"]


@dataclass(frozen=True, slots=True)
class Comparison:
    step: str
    what: str
    metric: str
    unit: str
    higher_is_better: bool
    cell: Cell
    stats: Paired
    floor: float
    floor_source: str
    variation: Mapping[str, float | None]
    max_variation: float = 0.20
    base_repeats: tuple[float, ...] = ()  # per-repeat medians
    cand_repeats: tuple[float, ...] = ()

    @property
    def gain(self) -> tuple[float, float, float]:
        """(estimate, lo, hi) of the candidate's improvement: + is better whatever the metric's direction."""
        s = self.stats
        return (s.rel, s.lo, s.hi) if self.higher_is_better else (-s.rel, -s.hi, -s.lo)

    @property
    def outcome(self) -> Outcome:
        worst = max((v for v in self.variation.values() if v is not None), default=0.0)
        if worst > self.max_variation:
            return "noisy"
        _, lo, hi = self.gain
        if lo > self.floor:
            return "win"
        if hi < -self.floor:
            return "loss"
        if -self.floor <= lo and hi <= self.floor:
            return "tie"
        return "unresolved"

    def numbers(self, base: str, cand: str) -> str:
        s = self.stats
        eff = f", d_z {s.effect:+.2f}" if s.effect is not None else ""
        return (
            f"{base} {_fmt(s.base_mean)} vs {cand} {_fmt(s.cand_mean)} {self.unit}: Δ {s.rel:+.1%} "
            f"(95% CI {s.lo:+.1%} … {s.hi:+.1%}{eff}, {s.n_pairs} pairs in {s.n_groups} repeats); "
            f"noise floor ±{self.floor:.1%} ({self.floor_source})"
        )

    def to_json(self) -> dict[str, Any]:
        s = self.stats
        return {"step": self.step, "metric": self.metric, "cell": self.cell.label(), "outcome": self.outcome,
                "base_mean": s.base_mean, "cand_mean": s.cand_mean, "rel": s.rel, "ci95": [s.lo, s.hi],
                "effect_size_dz": s.effect, "pairs": s.n_pairs, "repeats": s.n_groups, "noise_floor": self.floor,
                "noise_floor_source": self.floor_source, "variation": dict(self.variation)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Verdict:
    baseline: str
    candidate: str
    decision: Decision
    summary: str
    reasons: tuple[Reason, ...]
    comparisons: tuple[Comparison, ...] = ()
    stopped_at: str | None = None  # the gate that failed
    stopped_check: str | None = None
    noise_source: str | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline, "candidate": self.candidate, "decision": self.decision,
            "summary": self.summary,
            "stopped_at": {"gate": self.stopped_at, "check": self.stopped_check} if self.stopped_at else None,
            "reasons": [{"gate": x.step, "check": x.check, "outcome": x.outcome, "decisive": x.decisive,
                         "text": x.text} for x in self.reasons],
            "comparisons": [c.to_json() for c in self.comparisons],
        }  # fmt: skip


def _fmt(x: float) -> str:
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def decide_all(r: Results) -> list[Verdict]:
    """One verdict per candidate engine (every engine but the baseline and its A/A pass)."""
    return [decide(r, e.name) for e in r.engines if e.name != r.baseline and e.aa_of is None]


def decide(r: Results, candidate: str) -> Verdict:
    base = r.baseline
    infos = {e.name: e for e in r.engines}
    if base not in infos or candidate not in infos:
        missing = base if base not in infos else candidate
        why = f"engine {missing!r} has no results"
        return Verdict(base, candidate, "inconclusive", why, (Reason("data", "inconclusive", why),), (), "data")
    aa = next((e.name for e in r.engines if e.aa_of == base), None)
    samples = [s for s in r.samples if s.engine in (base, candidate, aa)]
    caches = {s.cell.cache for s in samples}
    # cache-cold is the fair comparison; warm-cache results are reported, not judged, when both exist
    judged = "cold" if "cold" in caches else "live" if "live" in caches else "warm" if caches else None
    by: dict[tuple[str, Cell], list[Sample]] = {}
    for s in samples:
        if s.cell.cache == judged:
            by.setdefault((s.engine, s.cell), []).append(s)
    common = {c for (e, c) in by if e == base} & {c for (e, c) in by if e == candidate}
    offered = max((c.concurrency for c in common), default=None)

    reasons: list[Reason] = data_gate(r, samples, base, candidate, judged, common, by)
    reasons += parity_gate(r, infos[base], infos[candidate], offered)
    reasons += r.extra_parity
    reasons += memory_gate(r, samples, base, candidate)
    reqs: dict[tuple[str, Cell, int], dict[int, Req]] = {}
    for q in r.requests:
        if q.ok and q.cell.cache == judged:
            reqs.setdefault((q.engine, q.cell, q.repeat), {})[q.index] = q
    comps: list[Comparison] = []

    def compare(step: str, cell: Cell | None, metric: str, unit: str, higher: bool, what: str, per_req: bool) -> None:
        if cell is None:
            return
        comp = _compare(r, by, reqs, step, what, cell, metric, unit, higher, base, candidate, aa, per_req)
        if comp is None:
            reasons.append(Reason(step, "note", f"{what}: not measured on both engines ({cell.label()})"))
            return
        comps.append(comp)
        o = comp.outcome
        nums = comp.numbers(base, candidate)
        if o == "noisy":
            worst = max(comp.variation.items(), key=lambda kv: kv[1] or 0)
            text = (f"{what} ({cell.label()}): run-to-run variation {worst[1]:.0%} on {worst[0]} exceeds "
                    f"{r.max_variation:.0%} — refused; rerun with more repeats on a quieter machine: {nums}")  # fmt: skip
        elif o == "tie":
            text = f"{what} ({cell.label()}): tie — the interval sits inside the noise floor: {nums}"
            if step == "decode":
                text += " — decode-bound, switching engines won't fix it"
        elif o == "unresolved":
            text = (f"{what} ({cell.label()}): unresolved — the interval crosses the noise floor (neither a tie "
                    f"nor a difference); more requests or repeats narrow it: {nums}")  # fmt: skip
        else:
            who = candidate if o == "win" else base
            text = f"{what} ({cell.label()}): {who} is better beyond the noise floor: {nums}"
        reasons.append(Reason(step, o, text))

    base_mt, base_pl = r.base_max_tokens, r.base_prompt_len
    c1 = [c for c in common if c.concurrency == 1 and c.rate is None]
    single = _pick(c1, base_mt, base_pl)
    if single is None and common:
        reasons.append(Reason("decode", "note", "no concurrency-1 cell measured on both engines"))
    compare("decode", single, "tpot_s", "s/token", False, "single-request decode (TPOT)", True)

    conc = [
        c for c in common if (c.concurrency > 1 or c.rate is not None) and (base_pl is None or c.prompt_len == base_pl)
    ]
    conc = [c for c in conc if base_mt is None or c.max_tokens == base_mt] or conc
    if r.live:
        reasons.append(Reason("throughput", "note", "live traffic: aggregate throughput and long context are not "
                              "comparable from mirrored pairs — use enginemeter bench"))  # fmt: skip
    elif conc:
        top = max(conc, key=lambda c: (c.rate or 0, c.concurrency))
        compare("throughput", top, "output_tps", "tok/s", True, "concurrent throughput", False)
        compare("throughput", top, "ttft_s", "s", False, "TTFT under load", True)
    elif common:
        reasons.append(Reason("throughput", "note", "no concurrency > 1 cell measured on both engines"))

    longs = [c for c in c1 if c.prompt_len != base_pl and c.prompt_len != "mixed"]
    longs = [c for c in longs if base_mt is None or c.max_tokens == base_mt] or longs
    if longs and not r.live:
        longest = max(longs, key=lambda c: length_rank(c.prompt_len))
        if base_pl is None or length_rank(longest.prompt_len) > length_rank(base_pl):
            compare("long-context", longest, "ttft_s", "s", False, "long-context TTFT", True)
            compare("long-context", longest, "tpot_s", "s/token", False, "long-context decode (TPOT)", True)
        else:
            reasons.append(Reason("long-context", "note", f"no prompt class longer than the base ({base_pl}) measured"))
    elif common and not r.live:
        reasons.append(Reason("long-context", "note", "no longer-prompt cell measured on both engines"))
    return _conclude(base, candidate, reasons, comps, aa)


def _groups(
    r: Results, by: Mapping[tuple[str, Cell], Sequence[Sample]], reqs: Mapping[tuple[str, Cell, int], Mapping[int, Req]],
    x: str, y: str, cell: Cell, metric: str, per_req: bool,
) -> tuple[list[list[tuple[float, float]]], dict[str, list[float]]]:  # fmt: skip
    """Pairs per repeat, and each engine's per-repeat medians (for the run-to-run variation: a median is not
    moved by one starved request)."""
    reps_x = {s.repeat: s for s in by.get((x, cell), [])}
    reps_y = {s.repeat: s for s in by.get((y, cell), [])}
    groups: list[list[tuple[float, float]]] = []
    means: dict[str, list[float]] = {x: [], y: []}
    for rep in sorted(set(reps_x) & set(reps_y)):
        qx, qy = reqs.get((x, cell, rep)), reqs.get((y, cell, rep))
        if per_req and qx and qy:
            pairs = [(getattr(qx[i], metric), getattr(qy[i], metric)) for i in sorted(set(qx) & set(qy))]
            pairs = [
                (float(a), float(b)) for a, b in pairs if isinstance(a, int | float) and isinstance(b, int | float)
            ]
        else:
            a, b = getattr(reps_x[rep], metric), getattr(reps_y[rep], metric)
            pairs = [(float(a), float(b))] if isinstance(a, int | float) and isinstance(b, int | float) else []
        if pairs:
            groups.append(pairs)
            means[x].append(statistics.median(p[0] for p in pairs))
            means[y].append(statistics.median(p[1] for p in pairs))
    return groups, means


def _compare(
    r: Results, by: Mapping[tuple[str, Cell], Sequence[Sample]], reqs: Mapping[tuple[str, Cell, int], Mapping[int, Req]],
    step: str, what: str, cell: Cell, metric: str, unit: str, higher: bool, base: str, cand: str, aa: str | None,
    per_req: bool,
) -> Comparison | None:  # fmt: skip
    groups, means = _groups(r, by, reqs, base, cand, cell, metric, per_req)
    stats = paired_bootstrap(groups)
    if stats is None:
        return None
    var: dict[str, float | None] = {base: variation(means[base]), cand: variation(means[cand])}
    aa_stats = None
    if aa is not None:
        aa_groups, aa_means = _groups(r, by, reqs, base, aa, cell, metric, per_req)
        aa_stats = paired_bootstrap(aa_groups)
        var[aa] = variation(aa_means[aa])
    if aa_stats is not None:
        floor = max(r.min_floor, abs(aa_stats.lo), abs(aa_stats.hi))
        src = f"A/A: {aa} vs {base} Δ {aa_stats.rel:+.1%}, CI {aa_stats.lo:+.1%} … {aa_stats.hi:+.1%}"
    else:
        floor = max([r.min_floor, *(v for v in var.values() if v is not None)])
        src = "no A/A pass: run-to-run variation"
    return Comparison(step, what, metric, unit, higher, cell, stats, floor, src, var, r.max_variation,
                      tuple(means[base]), tuple(means[cand]))  # fmt: skip


def _pick(cells: Sequence[Cell], max_tokens: int | None, prompt_len: str | None) -> Cell | None:
    if not cells:
        return None
    exact = [
        c
        for c in cells
        if (max_tokens is None or c.max_tokens == max_tokens) and (prompt_len is None or c.prompt_len == prompt_len)
    ]
    return sorted(exact or cells, key=lambda c: (c.max_tokens, c.prompt_len))[0]


def _conclude(base: str, cand: str, reasons: list[Reason], comps: list[Comparison], aa: str | None) -> Verdict:
    order = {s: i for i, s in enumerate(STEPS)}
    reasons.sort(key=lambda x: order.get(x.step, len(STEPS)))  # stable: each gate's reasons keep their order
    failed = next((x for x in reasons if x.outcome in FAILS), None)
    noise = "A/A pass" if aa else "run-to-run variation"
    if failed is not None:
        stop = order[failed.step]
        reasons = [replace(x, decisive=False) if order.get(x.step, 99) > stop else x for x in reasons]
        gate_fails = [x for x in reasons if x.step == failed.step and x.outcome in FAILS]
        more = f" (+{len(gate_fails) - 1} more)" if len(gate_fails) > 1 else ""
        decision: Decision = "stay" if failed.outcome == "stay" else "inconclusive"
        check = f" ({failed.check})" if failed.check else ""
        summary = f"stopped at the {failed.step} gate{check}: {failed.text}{more}"
        return Verdict(
            base, cand, decision, summary, tuple(reasons), tuple(comps), failed.step, failed.check or None, noise
        )
    wins = [x for x in reasons if x.outcome == "win"]
    losses = [x for x in reasons if x.outcome == "loss"]
    ties = [x for x in reasons if x.outcome == "tie"]

    def steps(xs: Sequence[Reason]) -> str:
        return ", ".join(sorted({x.step for x in xs}, key=lambda s: order[s]))

    if wins and losses:
        decision, summary = "inconclusive", (f"mixed: {cand} wins on {steps(wins)} but loses on {steps(losses)} — "
                                             "the choice depends on your workload")  # fmt: skip
    elif wins:
        decision, summary = "switch", f"{cand} is better beyond the noise floor on {steps(wins)}, worse on nothing"
    elif losses:
        decision, summary = "stay", f"{cand} is worse beyond the noise floor on {steps(losses)} and better on nothing"
    elif ties:
        decode_tie = any(t.step == "decode" for t in ties)
        decision, summary = "stay", (f"no difference beyond the noise floor between {base} and {cand}"
                                     + (" — decode-bound, switching engines won't fix it" if decode_tie else ""))  # fmt: skip
    else:
        decision, summary = "inconclusive", "nothing comparable was measured on both engines"
    return Verdict(base, cand, decision, summary, tuple(reasons), tuple(comps), None, None, noise)
