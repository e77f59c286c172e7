"""Paired comparison of two engines on the same requests: a bootstrap confidence interval, an effect size and
run-to-run variation. Pure, deterministic (seeded).

Pairs are grouped by repeat: within a repeat the i-th request of each engine had the same prompt (and, cold,
the same unique prefix), so ``(base_i, cand_i)`` is a pair. The estimate is the relative difference of the
means, ``mean(cand) / mean(base) - 1``. Its 95 % interval comes from a two-level bootstrap: resample the
repeats, then the pairs inside each — so a difference between repeats (the machine got busier) widens the
interval instead of hiding in it. With one value per repeat (aggregate throughput) this is a bootstrap over
repeats. The effect size is Cohen's d_z of the paired log-ratios (mean / standard deviation).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

N_BOOT = 2000


@dataclass(frozen=True, slots=True)
class Paired:
    n_pairs: int
    n_groups: int
    base_mean: float
    cand_mean: float
    rel: float  # cand_mean / base_mean - 1
    lo: float  # 95 % interval of rel
    hi: float
    effect: float | None  # Cohen's d_z of log(cand/base); None with fewer than 2 pairs or no spread


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
    lo = boots[int(0.025 * (len(boots) - 1))]
    hi = boots[math.ceil(0.975 * (len(boots) - 1))]
    logs = [math.log(c / b) for b, c in pairs if b > 0 and c > 0]
    effect = None
    if len(logs) >= 2:
        sd = statistics.stdev(logs)
        effect = statistics.mean(logs) / sd if sd > 0 else None
    return Paired(len(pairs), len(groups), sb / len(pairs), sc / len(pairs), rel, lo, hi, effect)


def variation(per_repeat: Sequence[float]) -> float | None:
    """Run-to-run variation: coefficient of variation (stdev / mean) of one figure's per-repeat values."""
    v = [x for x in per_repeat if x is not None]
    if len(v) < 2:
        return None
    m = statistics.mean(v)
    return statistics.stdev(v) / m if m > 0 else None
