"""Results -> per-regime answers -> switch | stay | partial | inconclusive. Pure: no I/O, no clock.

Gates first, in a fixed order; a failed gate stops the verdict there (which gate, which check, why):

1. **parity**: prompt tokens, effective sampling (what the per-kind mapping dropped included), max tokens,
   output lengths, context per slot, quantization (normalized: F16 = FP16 = float16; bf16 ≠ f16); slots below
   the offered concurrency are stated;
2. **data**: every engine answered without errors, every judged cell has >= ``min_repeats`` repeats, the
   judged cache phase is what it says (cold: nothing served from the prompt cache; warm: cached tokens seen);
3. **memory**: the candidate's per-engine peak against the user's budget, or its GPU's total when it held
   that GPU alone; device-wide readings are not judged.

Then the speed, one **regime** at a time, the order the people deciding read it (``proxy.bench.regimes``):

- **single request** (step ``decode``): TPOT at concurrency 1, the base cell (decode tok/s = 1/TPOT); TTFT
  beside it;
- **under load** (step ``throughput``): aggregate output tok/s at the highest concurrency (or request rate)
  measured on both; TTFT under load beside it;
- **long prompts** (step ``long-context``): TTFT at the longest prompt class, concurrency 1; TPOT beside it.

Each comparison is paired per request (``stats.paired_bootstrap``): a 95 % interval of the relative
difference whose width grows with the run-to-run variation. It is judged against a **band**: the larger of
``min_effect`` (practical significance, ``--min-effect``) and the **noise floor** (the baseline against its
own second pass, A/A, in the same run; without one, the run-to-run variation). A win needs the whole
interval beyond the band, a tie the whole interval inside it; anything else is *unresolved*, with the
repeats that would resolve it. An A/A pass whose own interval excludes 0 is a **protocol bias** (order,
drift): it is named, and its size is added to the band a win must clear, never silently to the floor. A cell
where an engine was busy with requests the bench did not send is *flagged* and cannot decide.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.gates import data_gate, discount, memory_gate, parity_gate, quant_differs
from proxy.bench.model import Cell, Decision, EngineInfo, Outcome, Reason, Req, Results, Sample
from proxy.bench.regimes import REGIMES, RegimeAnswer, band, conclude
from proxy.bench.stats import Paired, paired_bootstrap, variation
from proxy.bench.suite import length_rank

__all__ = ["Cell", "Comparison", "EngineInfo", "Reason", "RegimeAnswer", "Req", "Results", "Sample", "Verdict",
           "decide", "decide_all"]  # fmt: skip

#: more repeats than this is not a rerun anyone will make: "no feasible number resolves it"
MAX_FEASIBLE_REPEATS = 30


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
    base_repeats: tuple[float, ...] = ()  # per-repeat medians
    cand_repeats: tuple[float, ...] = ()
    min_effect: float = 0.05
    #: |Δ| of an A/A pass whose interval excludes 0 (a protocol bias); 0 when it includes 0 or there is none
    bias: float = 0.0
    #: why this cell cannot decide (an engine busy with other clients); None: it can
    flagged: str | None = None
    #: the regime's deciding metric (the others are shown beside it and can only make it "mixed")
    primary: bool = True
    #: the baseline against its own second pass, where there is one
    aa: Paired | None = None

    @property
    def gain(self) -> tuple[float, float, float]:
        """(estimate, lo, hi) of the candidate's improvement: + is better whatever the metric's direction."""
        s = self.stats
        return (s.rel, s.lo, s.hi) if self.higher_is_better else (-s.rel, -s.hi, -s.lo)

    @property
    def log_gain(self) -> tuple[float, float, float]:
        """The same on the log-ratio scale, where judging happens: ×2 faster and ×2 slower are equally far from
        equal (on the relative scale a 16× faster TTFT is "-94 %" while noise can reach "+126 %")."""
        s = self.stats
        e, lo, hi = _log(s.rel), _log(s.lo), _log(s.hi)
        return (e, lo, hi) if self.higher_is_better else (-e, -hi, -lo)

    @property
    def band(self) -> float:
        """What a tie must stay inside, relative: the larger of the minimum effect and the noise floor."""
        return max(self.min_effect, self.floor)

    @property
    def win_band(self) -> float:
        """What a win (or loss) must clear, relative: the band, plus a protocol bias when the A/A pass showed one."""
        floor = math.expm1(_log(self.floor) + _log(self.bias)) if self.bias else self.floor
        return max(self.min_effect, floor)

    @property
    def outcome(self) -> Outcome:
        if self.flagged:
            return "flagged"
        _, lo, hi = self.log_gain
        if lo > _log(self.win_band):
            return "win"
        if hi < -_log(self.win_band):
            return "loss"
        # a tie is equivalence at the margin the user asked for: inside ±min_effect, with the floor (and any
        # protocol bias) no wider; inside a wider floor it only says "no bigger than this run's noise":
        # unresolved, never a tie — a noisier A/A pass must not make a tie, hence a stay, easier
        m = _log(self.min_effect)
        if self.win_band <= self.min_effect and -m <= lo and hi <= m:
            return "tie"
        return "unresolved"

    @property
    def coarse(self) -> bool:
        """Inside the floor (plus bias), but that is wider than the minimum effect: no tie can be shown."""
        _, lo, hi = self.log_gain
        w = _log(self.win_band)
        return self.win_band > self.min_effect and -w <= lo and hi <= w

    @property
    def detectable(self) -> float:
        """The smallest difference (relative) this run could have called: the band plus the interval's spread."""
        _, lo, hi = self.log_gain
        return math.expm1(_log(self.win_band) + (hi - lo) / 2)

    def repeats_to_resolve(self) -> int | None:
        """Repeats that would resolve an unresolved comparison at the spread seen; None: no feasible number."""
        est = abs(self.log_gain[0])
        if self.coarse and self.aa is not None:  # the floor is what needs narrowing: more repeats of the A/A
            n = self.aa.repeats_needed(self.min_effect / 2)
            return n if n is not None and n <= MAX_FEASIBLE_REPEATS else None
        wb, b = _log(self.win_band), _log(self.min_effect)
        margin = est - wb if est > wb else b - est
        if margin < 0.1 * b:  # the estimate sits on the threshold: more data moves it, not the answer
            return None
        n = self.stats.repeats_needed(math.expm1(margin))
        return n if n is not None and n <= MAX_FEASIBLE_REPEATS else None

    def figures(self) -> tuple[str, str]:
        """Baseline and candidate figures as a person reads them (decode in tok/s, times in ms)."""
        s = self.stats
        return _show(self.metric, s.base_mean), _show(self.metric, s.cand_mean)

    def numbers(self, base: str, cand: str) -> str:
        s = self.stats
        eff = f", d_z {s.effect:+.2f}" if s.effect is not None else ""
        fb, fc = self.figures()
        floor = f"noise floor ±{band(self.floor)} ({self.floor_source})"
        if self.bias:
            floor += f", protocol bias {self.bias:.1%} added for a win"
        return (
            f"{base} {fb} vs {cand} {fc}: Δ {s.rel:+.1%} (95% CI {s.lo:+.1%} … {s.hi:+.1%}{eff}, {s.n_pairs} pairs "
            f"in {s.n_groups} repeats); min effect {self.min_effect:.0%}, {floor}"
        )

    def to_json(self) -> dict[str, Any]:
        s = self.stats
        return {"step": self.step, "metric": self.metric, "cell": self.cell.label(), "outcome": self.outcome,
                "primary": self.primary, "base_mean": s.base_mean, "cand_mean": s.cand_mean, "rel": s.rel,
                "ci95": [s.lo, s.hi], "ci95_bootstrap": list(s.boot),
                "ci95_repeats_t": list(s.t_interval) if s.t_interval else None, "effect_size_dz": s.effect,
                "pairs": s.n_pairs, "repeats": s.n_groups, "noise_floor": self.floor,
                "noise_floor_source": self.floor_source, "protocol_bias": self.bias or None,
                "min_effect": self.min_effect, "band": self.band, "detectable_effect": self.detectable,
                "repeats_to_resolve": self.repeats_to_resolve() if self.outcome == "unresolved" else None,
                "flagged": self.flagged, "variation": dict(self.variation)}  # fmt: skip


def _log(rel: float) -> float:
    """log(1 + rel), kept finite for an interval end at or below -100 %."""
    return math.log(max(1 + rel, 1e-9))


def _show(metric: str, v: float) -> str:
    if metric == "tpot_s":
        return f"{1 / v:.0f} tok/s ({v * 1000:.2f} ms/token)" if v > 0 else "–"
    if metric.endswith("_s"):
        return f"{v * 1000:.1f} ms" if v < 10 else f"{v:.1f} s"
    return f"{_fmt(v)} tok/s" if metric.endswith("tps") else _fmt(v)


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

    def to_json(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline, "candidate": self.candidate, "decision": self.decision,
            "summary": self.summary,
            "stopped_at": {"gate": self.stopped_at, "check": self.stopped_check or "unnamed"} if self.stopped_at
            else None,
            "regimes": [a.to_json() for a in self.regimes], "next_step": self.next_step,
            "discounted": self.discounted,
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


def judged_phase(samples: Sequence[Sample]) -> str | None:
    """cache-cold is the fair comparison; warm-cache results are reported, not judged, when both exist."""
    caches = {s.cell.cache for s in samples}
    return "cold" if "cold" in caches else "live" if "live" in caches else "warm" if caches else None


def decide(r: Results, candidate: str) -> Verdict:
    base = r.baseline
    infos = {e.name: e for e in r.engines}
    if base not in infos or candidate not in infos:
        missing = base if base not in infos else candidate
        why = f"engine {missing!r} has no results"
        return Verdict(base, candidate, "inconclusive", why, (Reason("data", "inconclusive", why, "engines"),), (),
                       "data", "engines")  # fmt: skip
    aa = next((e.name for e in r.engines if e.aa_of == base), None)
    samples = [s for s in r.samples if s.engine in (base, candidate, aa)]
    judged = judged_phase(samples)
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
    measured: dict[str, Cell | None] = {}

    def compare(step: str, cell: Cell, metric: str, unit: str, higher: bool, what: str, primary: bool) -> None:
        per_req = metric != "output_tps"
        comp = _compare(r, by, reqs, step, what, cell, metric, unit, higher, base, candidate, aa, per_req, primary)
        if comp is None:
            return
        measured.setdefault(step, cell)
        comps.append(comp)
        reasons.append(Reason(step, comp.outcome, _text(comp, base, candidate), metric))

    base_mt, base_pl = r.base_max_tokens, r.base_prompt_len
    c1 = [c for c in common if c.concurrency == 1 and c.rate is None]
    single = _pick(c1, base_mt, base_pl)
    if single is not None:
        compare("decode", single, "tpot_s", "s/token", False, "single-request decode (TPOT)", True)
        compare("decode", single, "ttft_s", "s", False, "single-request TTFT", False)

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
            compare("throughput", top, "output_tps", "tok/s", True, "concurrent throughput", True)
            compare("throughput", top, "ttft_s", "s", False, "TTFT under load", False)

    longs = [c for c in c1 if c.prompt_len != base_pl and c.prompt_len != "mixed"]
    longs = [c for c in longs if base_mt is None or c.max_tokens == base_mt] or longs
    if longs and not r.live:
        longest = max(longs, key=lambda c: length_rank(c.prompt_len))
        if base_pl is None or length_rank(longest.prompt_len) > length_rank(base_pl):
            compare("long-context", longest, "ttft_s", "s", False, "long-context TTFT", True)
            compare("long-context", longest, "tpot_s", "s/token", False, "long-context decode (TPOT)", False)
    slots = [e.slots for e in (infos[base], infos[candidate]) if e.slots]
    c = conclude(r, base, candidate, reasons, comps, aa, {s for s, _ in REGIMES if s in measured},
                 max(slots) if slots else None)  # fmt: skip
    noise = "A/A pass" if aa else "run-to-run variation"
    b, k = infos[base], infos[candidate]
    discounted = discount(b, k) if r.accept_quantization_difference and quant_differs(b, k) else None
    return Verdict(base, candidate, c.decision, c.summary, c.reasons, tuple(comps), c.stopped_at, c.stopped_check,
                   noise, c.regimes, c.next_step, discounted)  # fmt: skip


def _text(comp: Comparison, base: str, cand: str) -> str:
    o, cell, what = comp.outcome, comp.cell.label(), comp.what
    nums = comp.numbers(base, cand)
    if o == "flagged":
        return f"{what} ({cell}): cannot decide — {comp.flagged}: {nums}"
    if o == "tie":
        return f"{what} ({cell}): tie — the interval sits inside ±{band(comp.band)}: {nums}"
    if o == "unresolved" and comp.coarse:
        n = comp.repeats_to_resolve()
        fix = f"; about {n} repeats would narrow it" if n else ""
        return (
            f"{what} ({cell}): unresolved — inside the noise floor ±{comp.floor:.1%}, which is wider than the "
            f"minimum effect {comp.min_effect:.0%}: no tie can be shown at that margin{fix}: {nums}"
        )
    if o == "unresolved":
        worst = max(comp.variation.items(), key=lambda kv: kv[1] or 0, default=("", None))
        cause = (f"; run-to-run variation {worst[1]:.0%} on {worst[0]} widens it" if worst[1] and worst[1] > 0.1
                 else "")  # fmt: skip
        n = comp.repeats_to_resolve()
        fix = f"; about {n} repeats would resolve it" if n else "; no feasible number of repeats resolves it"
        return f"{what} ({cell}): unresolved — the interval crosses ±{band(comp.win_band)}{cause}{fix}: {nums}"
    who = cand if o == "win" else base
    return f"{what} ({cell}): {who} is better beyond ±{band(comp.win_band)}: {nums}"


def _groups(
    by: Mapping[tuple[str, Cell], Sequence[Sample]], reqs: Mapping[tuple[str, Cell, int], Mapping[int, Req]],
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
    per_req: bool, primary: bool,
) -> Comparison | None:  # fmt: skip
    groups, means = _groups(by, reqs, base, cand, cell, metric, per_req)
    stats = paired_bootstrap(groups)
    if stats is None:
        return None
    var: dict[str, float | None] = {base: variation(means[base]), cand: variation(means[cand])}
    aa_stats = None
    if aa is not None:
        aa_groups, aa_means = _groups(by, reqs, base, aa, cell, metric, per_req)
        aa_stats = paired_bootstrap(aa_groups)
        var[aa] = variation(aa_means[aa])
    bias = 0.0
    if aa_stats is not None:
        a_src = f"A/A: {aa} vs {base} Δ {aa_stats.rel:+.1%}, CI {aa_stats.lo:+.1%} … {aa_stats.hi:+.1%}"
        lo, hi = _log(aa_stats.lo), _log(aa_stats.hi)  # the floor is symmetric on the log-ratio scale
        if lo > 0 or hi < 0:  # the baseline differs from itself: order or drift, not noise
            bias = math.expm1(abs(_log(aa_stats.rel)))
            floor = max(r.min_floor, math.expm1((hi - lo) / 2))
            src = f"{a_src} — excludes 0: a protocol bias; the floor is its spread"
        else:
            floor = max(r.min_floor, math.expm1(max(-lo, hi)))
            src = a_src
    else:
        floor = max([r.min_floor, *(v for v in var.values() if v is not None)])
        src = "no A/A pass: run-to-run variation"
    flagged = next((r.flags[(e, cell)] for e in (base, cand, aa) if e and (e, cell) in r.flags), None)
    return Comparison(step, what, metric, unit, higher, cell, stats, floor, src, var, tuple(means[base]),
                      tuple(means[cand]), r.min_effect, bias, flagged, primary, aa_stats)  # fmt: skip


def _pick(cells: Sequence[Cell], max_tokens: int | None, prompt_len: str | None) -> Cell | None:
    if not cells:
        return None
    exact = [
        c
        for c in cells
        if (max_tokens is None or c.max_tokens == max_tokens) and (prompt_len is None or c.prompt_len == prompt_len)
    ]
    return sorted(exact or cells, key=lambda c: (c.max_tokens, c.prompt_len))[0]
