"""One figure of two engines compared on the same requests: its paired interval, its band (minimum effect, noise
floor, protocol bias) and what it says — win, loss, tie, unresolved or flagged. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.bench.verdict.inputs import Assessment, Cell
from proxy.bench.verdict.stats import Paired
from proxy.judge import judge
from proxy.notation import band, faster, faster_interval, figure, unit

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
    #: the regime's deciding figure (the others are shown beside it as trade-offs, never a veto)
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
        e, lo, hi = log_ratio(s.rel), log_ratio(s.lo), log_ratio(s.hi)
        return (e, lo, hi) if self.higher_is_better else (-e, -hi, -lo)

    @property
    def band(self) -> float:
        """What a tie must stay inside, relative: the larger of the minimum effect and the noise floor."""
        return max(self.min_effect, self.floor)

    @property
    def win_band(self) -> float:
        """What a win (or loss) must clear, relative: the band, plus a protocol bias when the A/A pass showed one."""
        floor = math.expm1(log_ratio(self.floor) + log_ratio(self.bias)) if self.bias else self.floor
        return max(self.min_effect, floor)

    @property
    def outcome(self) -> Assessment:
        if self.flagged:
            return "flagged"
        # ``proxy.judge``: a tie is the whole interval inside the band shown: no difference as large as the minimum
        # effect, or — when the run's noise floor (and a protocol bias) is wider — none this run could have seen
        _, lo, hi = self.log_gain
        return judge(lo, hi, log_ratio(self.win_band))

    @property
    def speed(self) -> tuple[float, float, float]:
        """(estimate, lo, hi) as speed ratios of the candidate over the baseline: 1.44 is 44 % faster."""
        g, lo, hi = self.log_gain
        return math.exp(g), math.exp(lo), math.exp(hi)

    def says(self, base: str, cand: str) -> str:
        """The difference in words, from the faster engine's side: "sglang is 44 % faster (the whole request;
        95% CI 38–50 % faster)"."""
        who, r, lo, hi = self.side(base, cand)
        u = unit(r, lo, hi)
        return f"{who} is {faster(r, u)} ({self.what}; 95% CI {faster_interval(lo, hi, u)})"

    def difference(self, base: str, cand: str) -> str:
        """The same without the figure's name: "sglang 44 % faster (38–50 % faster)"."""
        who, r, lo, hi = self.side(base, cand)
        u = unit(r, lo, hi)
        return f"{who} {faster(r, u)} ({faster_interval(lo, hi, u)})"

    def side(self, base: str, cand: str) -> tuple[str, float, float, float]:
        """(the faster engine, its speed ratio over the other, the interval's ends): every number ≥ 1 but the
        interval's near end when it crosses equality."""
        r, lo, hi = self.speed
        return (cand, r, lo, hi) if r >= 1 else (base, 1 / r, 1 / hi, 1 / lo)

    @property
    def coarse(self) -> bool:
        """Inside the floor (plus bias), but that is wider than the minimum effect: no tie can be shown."""
        _, lo, hi = self.log_gain
        w = log_ratio(self.win_band)
        return self.win_band > self.min_effect and -w <= lo and hi <= w

    @property
    def detectable(self) -> float:
        """The smallest difference (relative) this run could have called: the band plus the interval's spread."""
        _, lo, hi = self.log_gain
        return math.expm1(log_ratio(self.win_band) + (hi - lo) / 2)

    def repeats_to_resolve(self) -> int | None:
        """Repeats that would resolve an unresolved comparison at the spread seen; None: no feasible number."""
        est = abs(self.log_gain[0])
        if self.coarse and self.aa is not None:  # the floor is what needs narrowing: more repeats of the A/A
            n = self.aa.repeats_needed(self.min_effect / 2)
            return n if n is not None and n <= MAX_FEASIBLE_REPEATS else None
        wb, b = log_ratio(self.win_band), log_ratio(self.min_effect)
        margin = est - wb if est > wb else b - est
        if margin < 0.1 * b:  # the estimate sits on the threshold: more data moves it, not the answer
            return None
        n = self.stats.repeats_needed(math.expm1(margin))
        return n if n is not None and n <= MAX_FEASIBLE_REPEATS else None

    def figures(self) -> tuple[str, str]:
        """Baseline and candidate figures as a person reads them (decode in tok/s, times in ms)."""
        s = self.stats
        return figure(self.metric, s.base_mean), figure(self.metric, s.cand_mean)

    def numbers(self, base: str, cand: str) -> str:
        s = self.stats
        eff = f", effect size d_z {abs(s.effect):.2f}" if s.effect is not None else ""
        fb, fc = self.figures()
        floor = f"noise floor {band(self.floor)} ({self.floor_source})"
        if self.bias:
            floor += f", protocol bias {self.bias:.1%} added for a win"
        return (
            f"{base} {fb} vs {cand} {fc}: {self.says(base, cand)} ({s.n_pairs} pairs in {s.n_groups} repeats{eff}); "
            f"min effect {self.min_effect:.0%}, {floor}"
        )

    def to_json(self) -> dict[str, Any]:
        s = self.stats
        return {
            "step": self.step,
            "metric": self.metric,
            "cell": self.cell.label(),
            "outcome": self.outcome,
            "primary": self.primary,
            "base_mean": s.base_mean,
            "cand_mean": s.cand_mean,
            "rel": s.rel,
            "ci95": [s.lo, s.hi],
            "ci95_bootstrap": list(s.boot),
            "ci95_repeats_t": list(s.t_interval) if s.t_interval else None,
            "effect_size_dz": s.effect,
            "pairs": s.n_pairs,
            "repeats": s.n_groups,
            "noise_floor": self.floor,
            "noise_floor_source": self.floor_source,
            "protocol_bias": self.bias or None,
            "min_effect": self.min_effect,
            "band": self.band,
            "detectable_effect": self.detectable,
            "repeats_to_resolve": self.repeats_to_resolve() if self.outcome == "unresolved" else None,
            "flagged": self.flagged,
            "variation": dict(self.variation),
        }


def log_ratio(rel: float) -> float:
    """log(1 + rel), kept finite for an interval end at or below -100 %."""
    return math.log(max(1 + rel, 1e-9))
