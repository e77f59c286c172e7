"""Paired comparison of two engines on the same requests: a confidence interval, an effect size, the smallest
effect the run could detect and run-to-run variation. Pure, deterministic (seeded).

Pairs are grouped by repeat: within a repeat the i-th request of each engine had the same prompt (and, cold,
the same unique prefix), so ``(base_i, cand_i)`` is a pair. The estimate is the relative difference of the
means, ``mean(cand) / mean(base) - 1``. Its 95 % interval is the union of two intervals:

- a **two-level bootstrap** (resample the repeats, then the pairs inside each), which carries the spread of
  the requests inside a repeat;
- a **repeat-level Student-t interval** on the per-repeat log-ratios ``log(mean_cand_g / mean_base_g)`` with
  ``n_repeats - 1`` degrees of freedom: the repeats are the independent units (the machine may be busier in
  one than the next), and with 3-8 of them a percentile bootstrap is too narrow (it cannot see variation that
  a handful of repeats did not happen to show). With one value per repeat (aggregate throughput) this is the
  interval that counts.

So a difference between repeats widens the interval in proportion to the difference it has to resolve: a
noisy figure can still decide when its difference is large (an 8x throughput gap with 24 % run-to-run
variation), and a small one cannot. The effect size is Cohen's d_z of the paired log-ratios.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

N_BOOT = 2000
#: two-sided 97.5 % quantiles of Student's t, by degrees of freedom (1-30); above 30 the normal's 1.96 + a
#: small correction
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)  # fmt: skip


def t975(df: int) -> float:
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.96 + 2.4 / df  # within 0.3 % of the exact quantile above 30 degrees of freedom


@dataclass(frozen=True, slots=True)
class Paired:
    n_pairs: int
    n_groups: int
    base_mean: float
    cand_mean: float
    rel: float  # cand_mean / base_mean - 1
    lo: float  # 95 % interval of rel (the union of the bootstrap and the repeat-level t interval)
    hi: float
    effect: float | None  # Cohen's d_z of log(cand/base); None with fewer than 2 pairs or no spread
    #: the two intervals the union is made of (the report shows which one was wider)
    boot: tuple[float, float] = (0.0, 0.0)
    t_interval: tuple[float, float] | None = None
    #: standard deviation of the per-repeat log-ratios (None with one repeat): what more repeats average out
    rep_sd: float | None = None

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def repeats_needed(self, margin: float) -> int | None:
        """Repeats after which the interval's half-width would be ``margin`` (relative), at the observed
        repeat-to-repeat spread; None when the spread is unknown or no finite number gets there."""
        if margin <= 0:
            return None
        sd = self.rep_sd
        if sd is None:
            return None
        if sd == 0:
            return max(self.n_groups, 2)
        # the half-width on the log scale is t(n-1) * sd / sqrt(n); solve by stepping n (t depends on n)
        target = math.log1p(margin)
        for n in range(2, 1001):
            if t975(n - 1) * sd / math.sqrt(n) <= target:
                return max(n, self.n_groups)
        return None


def _t_interval(groups: Sequence[Sequence[tuple[float, float]]]) -> tuple[tuple[float, float] | None, float | None]:
    logs = []
    for g in groups:
        sb = sum(b for b, _ in g)
        sc = sum(c for _, c in g)
        if sb > 0 and sc > 0:
            logs.append(math.log(sc / sb))
    if len(logs) < 2:
        return None, None
    m = statistics.mean(logs)
    sd = statistics.stdev(logs)
    h = t975(len(logs) - 1) * sd / math.sqrt(len(logs))
    return (math.expm1(m - h), math.expm1(m + h)), sd


def paired_bootstrap(
    groups: Sequence[Sequence[tuple[float, float]]], n_boot: int = N_BOOT, seed: int = 0
) -> Paired | None:
    groups = [list(g) for g in groups if g]
    pairs = [p for g in groups for p in g]
    if not pairs:
        return None
    sb = sum(b for b, _ in pairs)
    sc = sum(c for _, c in pairs)
    if sb <= 0:
        return None
    rel = sc / sb - 1
    boots = boot_ratios(groups, n_boot, seed)
    blo = boots[int(0.025 * (len(boots) - 1))]
    bhi = boots[math.ceil(0.975 * (len(boots) - 1))]
    ti, rep_sd = _t_interval(groups)
    lo, hi = (min(blo, ti[0]), max(bhi, ti[1])) if ti else (blo, bhi)
    logs = [math.log(c / b) for b, c in pairs if b > 0 and c > 0]
    effect = None
    if len(logs) >= 2:
        sd = statistics.stdev(logs)
        effect = statistics.mean(logs) / sd if sd > 0 else None
    return Paired(
        len(pairs), len(groups), sb / len(pairs), sc / len(pairs), rel, lo, hi, effect, (blo, bhi), ti, rep_sd
    )


def boot_ratios(groups: Sequence[Sequence[tuple[float, float]]], n_boot: int, seed: int) -> list[float]:
    """The two-level bootstrap's ``sum(cand) / sum(base) - 1`` per resample, sorted (resamples whose base sums to 0
    left out). Repeats of one size (every bench cell) are drawn at once with numpy: the same Mersenne Twister
    stream as ``random.Random(seed)`` (its state handed over), the same ``floor(u * n)`` picks and the sums
    accumulated in the same order, so the figures are those of ``_boot_ratios_loop`` to the last bit, 3-5x
    sooner (the bench's cells call it per figure and engine pair). Repeats of different sizes take the loop."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        return _boot_ratios_loop(groups, n_boot, seed)
    n_groups, m = len(groups), sizes.pop()
    _, mt_state, _ = random.Random(seed).getstate()
    mt = np.random.RandomState()
    mt.set_state(("MT19937", np.array(mt_state[:-1], dtype=np.uint32), mt_state[-1], 0, 0.0))
    g_draws = n_groups if n_groups > 1 else 0  # one repeat is not resampled (``random.choices`` not called)
    u = mt.random_sample(n_boot * (g_draws + n_groups * m)).reshape(n_boot, -1)
    picked = np.floor(u[:, :g_draws] * float(n_groups)).astype(np.intp) if g_draws else np.zeros((n_boot, 1), np.intp)
    inner = np.floor(u[:, g_draws:] * float(m)).astype(np.intp).reshape(n_boot, n_groups, m)
    pairs = np.array(groups, dtype=np.float64)  # (repeat, pair, base|cand)
    drawn = pairs[picked[:, :, None], inner]  # (resample, repeat drawn, pair drawn, base|cand)
    # add.accumulate sums left to right, as ``tb += b`` does (a plain sum would pair them up and round otherwise)
    sums = np.add.accumulate(drawn.reshape(n_boot, -1, 2), axis=1)[:, -1]
    tb, tc = sums[:, 0], sums[:, 1]
    keep = tb > 0
    return sorted((tc[keep] / tb[keep] - 1).tolist())


def _boot_ratios_loop(groups: Sequence[Sequence[tuple[float, float]]], n_boot: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    boots: list[float] = []
    for _ in range(n_boot):
        tb = tc = 0.0
        for g in rng.choices(groups, k=len(groups)) if len(groups) > 1 else groups:
            for b, c in rng.choices(g, k=len(g)):
                tb += b
                tc += c
        if tb > 0:
            boots.append(tc / tb - 1)
    boots.sort()
    return boots


def variation(per_repeat: Sequence[float]) -> float | None:
    """Run-to-run variation: coefficient of variation (stdev / mean) of one figure's per-repeat values."""
    v = [x for x in per_repeat if x is not None]
    if len(v) < 2:
        return None
    m = statistics.mean(v)
    return statistics.stdev(v) / m if m > 0 else None
