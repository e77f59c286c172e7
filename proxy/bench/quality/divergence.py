"""Token agreement of a candidate with the baseline, from their top-k next-token log-probabilities. Pure.

Per position (both engines teacher-forced along the same path, so their contexts are identical):

- **KL(base ‖ cand) over the top-k + a rest bucket**: with S the baseline's top-k ids,
  ``Σ_{i∈S} p(i)·log(p(i)/q(i)) + p(rest)·log(p(rest)/q(rest))``, ``p(rest) = 1 − Σ_S p``,
  ``q(rest) = 1 − Σ_S q``. An id of S missing from the candidate's list gets the one thing known of it:
  ``q(i) ≤`` the candidate's smallest listed probability (shared out so that ``Σ_S q`` stays ≤ its listed
  mass). KL over a coarser partition is never larger (log-sum inequality): the figure is a **lower bound** on
  the full-vocabulary KL, exact when the top-k hold nearly all the mass (measured: 83 % of llama-perplexity's
  full KL at k=20 on a random Q4_0 model, 96 % at k=100).
- **same top token**: the most likely id on both sides (ties to the lowest id, as llama-perplexity does).

Per prompt, the **first part**: the first position where the two engines' own greedy outputs differ (the
path's length when they never do).

Aggregates, each with a 95 % **bootstrap over prompts** (positions within one prompt are correlated; resampling
prompts is what makes the interval honest): mean KL and its 99th percentile over the pooled positions
(linear interpolation, as llama-perplexity), the same-top rate, the median first part.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

#: one position: token id -> log-probability
TopK = Mapping[int, float]

N_BOOT = 2000
SEED = 46
_TINY = 1e-12


def top_id(t: TopK) -> int | None:
    """The most likely id (ties: the lowest), None for an empty list."""
    if not t:
        return None
    best = max(t.values())
    return min(i for i, v in t.items() if v == best)


def kl_topk(base: TopK, cand: TopK) -> float:
    """KL(base ‖ cand) over the baseline's listed ids plus one rest bucket: a lower bound on the full KL."""
    if not base:
        return 0.0
    p = {i: math.exp(lp) for i, lp in base.items()}
    q_listed = {i: math.exp(lp) for i, lp in cand.items()}
    floor = min(q_listed.values()) if q_listed else _TINY
    missing = [i for i in p if i not in q_listed]
    # each missing id is below the candidate's smallest listed probability; together they share at most the
    # candidate's unlisted mass
    unlisted = max(1.0 - sum(q_listed.values()), 0.0)
    share = min(floor, unlisted / len(missing)) if missing else 0.0
    q = {i: q_listed.get(i, share) for i in p}
    p_rest = max(1.0 - sum(p.values()), 0.0)
    q_rest = max(1.0 - sum(q.values()), 0.0)
    kl = sum(pi * (math.log(pi) - math.log(max(q[i], _TINY))) for i, pi in p.items() if pi > 0)
    if p_rest > _TINY:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, _TINY)))
    return max(kl, 0.0)


def first_part(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where ``a`` and ``b`` differ; the shorter length when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass(frozen=True)
class PromptScore:
    """One prompt: KL and same-top at each scored position, and where the greedy outputs parted."""

    kl: tuple[float, ...]
    same: tuple[bool, ...]
    first_part: int
    length: int  # the greedy path's length (first_part == length: never parted)


def score_prompt(
    base: Sequence[TopK], cand: Sequence[TopK], base_path: Sequence[int], cand_path: Sequence[int]
) -> PromptScore:
    """The per-position figures of one prompt (``base``/``cand``: both teacher-forced along the same path)."""
    n = min(len(base), len(cand))
    kl = tuple(kl_topk(base[i], cand[i]) for i in range(n))
    same = tuple(top_id(base[i]) == top_id(cand[i]) for i in range(n))
    return PromptScore(kl, same, first_part(base_path, cand_path), len(base_path))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation at ``q·(n−1)`` of the sorted values (llama-perplexity's definition)."""
    s = sorted(values)
    if not s:
        return math.nan
    x = q * (len(s) - 1)
    lo = math.floor(x)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def _mean_kl(ps: Sequence[PromptScore]) -> float:
    vals = [v for p in ps for v in p.kl]
    return statistics.fmean(vals) if vals else math.nan


def _p99_kl(ps: Sequence[PromptScore]) -> float:
    return percentile([v for p in ps for v in p.kl], 0.99)


def _same_rate(ps: Sequence[PromptScore]) -> float:
    n = sum(len(p.same) for p in ps)
    return sum(sum(p.same) for p in ps) / n if n else math.nan


def _median_part(ps: Sequence[PromptScore]) -> float:
    return float(statistics.median(p.first_part for p in ps)) if ps else math.nan


STATS: dict[str, Callable[[Sequence[PromptScore]], float]] = {
    "mean_kl": _mean_kl,
    "p99_kl": _p99_kl,
    "same_top": _same_rate,
    "first_part": _median_part,
}


@dataclass(frozen=True)
class Figure:
    value: float
    low: float
    high: float

    def as_list(self) -> list[float]:
        return [self.value, self.low, self.high]


def bootstrap(
    ps: Sequence[PromptScore], stat: Callable[[Sequence[PromptScore]], float], *, n_boot: int = N_BOOT, seed: int = SEED
) -> Figure:
    """``stat`` over all prompts, with the 2.5-97.5 % percentiles of ``stat`` over prompts resampled."""
    value = stat(ps)
    if len(ps) < 2:
        return Figure(value, value, value)
    rng = random.Random(seed)
    draws = sorted(stat([ps[rng.randrange(len(ps))] for _ in ps]) for _ in range(n_boot))
    return Figure(value, percentile(draws, 0.025), percentile(draws, 0.975))


def figures(ps: Sequence[PromptScore], *, n_boot: int = N_BOOT) -> dict[str, Figure]:
    """Every aggregate of :data:`STATS`, each with its bootstrap interval over prompts."""
    return {name: bootstrap(ps, f, n_boot=n_boot) for name, f in STATS.items()}
