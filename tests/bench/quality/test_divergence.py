"""The agreement arithmetic: KL over the top-k + rest is a lower bound of the full KL, zero only for the same
distribution; same top token with ties; where greedy outputs part; the bootstrap over prompts."""

from __future__ import annotations

import math
import random

import pytest

from proxy.bench.quality.divergence import (
    PromptScore,
    bootstrap,
    figures,
    first_part,
    kl_topk,
    percentile,
    score_prompt,
    top_id,
)


def _dist(rng: random.Random, n: int, sharp: float) -> list[float]:
    logits = [rng.gauss(0, sharp) for _ in range(n)]
    m = max(logits)
    z = math.log(sum(math.exp(x - m) for x in logits)) + m
    return [x - z for x in logits]


def _top(lps: list[float], k: int) -> dict[int, float]:
    return dict(sorted(enumerate(lps), key=lambda kv: -kv[1])[:k])


def _full_kl(p: list[float], q: list[float]) -> float:
    return sum(math.exp(a) * (a - b) for a, b in zip(p, q, strict=True))


@pytest.mark.parametrize("seed", range(20))
def test_the_top_k_kl_is_a_lower_bound_of_the_full_kl_and_nears_it_as_k_grows(seed: int) -> None:
    rng = random.Random(seed)
    p = _dist(rng, 400, 3.0)
    q = [x + rng.gauss(0, 0.3) for x in p]
    z = math.log(sum(math.exp(x) for x in q))
    q = [x - z for x in q]
    full = _full_kl(p, q)
    small, large = kl_topk(_top(p, 5), _top(q, 5)), kl_topk(_top(p, 100), _top(q, 100))
    assert 0 <= small <= full + 1e-9
    assert small <= large + 1e-9 <= full + 2e-9
    assert large > 0.5 * full


def test_the_same_distribution_gives_zero_and_another_gives_more() -> None:
    rng = random.Random(1)
    p = _top(_dist(rng, 200, 3.0), 20)
    assert kl_topk(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    shifted = {i: lp - 0.5 if i == top_id(p) else lp for i, lp in p.items()}
    assert kl_topk(p, shifted) > 1e-3


def test_an_id_missing_from_the_candidate_is_bounded_by_its_smallest_listed_probability() -> None:
    base = {1: math.log(0.6), 2: math.log(0.3)}
    cand = {1: math.log(0.6), 3: math.log(0.35)}  # 2 is missing: q(2) <= 0.35, at most the 0.05 unlisted
    got = kl_topk(base, cand)
    q2 = 0.05
    want = 0.3 * math.log(0.3 / q2) + 0.1 * math.log(0.1 / (1 - 0.6 - q2))
    assert got == pytest.approx(want)


def test_same_top_ties_go_to_the_lowest_id_and_first_part_counts_the_shared_prefix() -> None:
    assert top_id({7: -1.0, 3: -1.0, 9: -2.0}) == 3
    assert top_id({}) is None
    assert first_part([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert first_part([1, 2, 3], [1, 2, 3]) == 3
    assert first_part([1, 2], [1, 2, 3]) == 2
    s = score_prompt([{1: -0.1}, {2: -0.2}], [{1: -0.1}, {3: -0.05, 2: -0.3}], [1, 2], [1, 3])
    assert s.same == (True, False) and s.first_part == 1 and s.kl[0] == 0.0 and s.kl[1] > 0


def test_percentile_interpolates_like_llama_perplexity() -> None:
    assert percentile([0.0, 1.0, 2.0, 3.0, 4.0], 0.99) == pytest.approx(3.96)
    assert percentile([5.0], 0.5) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_the_bootstrap_over_prompts_is_seeded_and_brackets_the_estimate() -> None:
    rng = random.Random(3)
    ps = [
        PromptScore(
            tuple(rng.random() * (1 + i % 3) for _ in range(16)),
            tuple(rng.random() < 0.8 for _ in range(16)),
            i % 5,
            16,
        )
        for i in range(24)
    ]
    a, b = figures(ps, n_boot=300), figures(ps, n_boot=300)
    assert a == b
    for f in a.values():
        assert f.low <= f.value <= f.high
        assert f.low < f.high
    one = bootstrap(ps[:1], lambda x: x[0].kl[0])
    assert one.low == one.value == one.high
