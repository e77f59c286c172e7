"""What the answer says of quality: the tag a faster candidate that answers differently gets, the discount line's
figures, the plan item's evidence with its bounds and the random-weights caveat. Pure."""

from __future__ import annotations

from proxy.bench.quality.divergence import Figure
from proxy.bench.quality.readout import RANDOM_CAVEAT, Accuracy, Quality, TokenAgreement, quality_by_candidate
from proxy.bench.verdict.decide import discounted_tag


def _agreement(same: tuple[float, float, float], kl: tuple[float, float, float]) -> TokenAgreement:
    f = {"same_top": Figure(*same), "mean_kl": Figure(*kl), "p99_kl": Figure(*kl), "first_part": Figure(3, 2, 4)}
    return TokenAgreement("a", "b", 32, 2048, 20, "teacher-forced along the baseline's greedy path", f)


def test_the_tag_says_discounted_and_answers_differently_together_or_alone() -> None:
    assert discounted_tag(None) == "" and discounted_tag("x") == " (discounted)"
    assert discounted_tag(None, "same top token 80 %") == " (faster, but answers differently: same top token 80 %)"
    assert discounted_tag("x", "y") == " (discounted; faster, but answers differently: y)"


def test_a_bound_is_crossed_only_by_the_whole_interval() -> None:
    assert Quality(_agreement((0.971, 0.964, 0.977), (0.012, 0.010, 0.014))).differs is None
    assert Quality(_agreement((0.85, 0.80, 0.91), (0.05, 0.04, 0.06))).differs is None  # reaches 90 %
    low = Quality(_agreement((0.806, 0.774, 0.836), (0.0688, 0.0662, 0.0713)))
    assert low.differs == "same top token 80.6 % [77.4–83.6] < 90%"
    assert Quality(_agreement((0.95, 0.93, 0.97), (0.3, 0.2, 0.4))).differs == "mean KL 0.3 [0.2–0.4] > 0.1"
    worse = Accuracy("a", "b", 50, 42, 31, Figure(-0.22, -0.34, -0.1), 0.003, (12, 1))
    both = Quality(_agreement((0.971, 0.964, 0.977), (0.012, 0.010, 0.014)), worse)
    assert both.differs == "accuracy -22.0 pt [-34.0–-10.0]"


def test_the_discount_line_and_the_plan_evidence() -> None:
    q = Quality(_agreement((0.971, 0.964, 0.977), (0.012, 0.010, 0.014)))
    assert q.short() == "same top token 97.1 % [96.4–97.7], mean KL 0.012"
    ev = q.evidence(random_weights=True)
    assert "within the bounds (bounds: same top token ≥ 90% and mean KL ≤ 0.1" in ev and ev.endswith(RANDOM_CAVEAT)
    assert RANDOM_CAVEAT not in q.evidence()
    assert not Quality().measured and Quality().short() == ""


def test_quality_by_candidate_reads_both_kinds_of_record() -> None:
    scored = [[[1, -0.1], [2, -2.5]]] * 3
    recs = [
        {"type": "logprobs", "engine": e, "prompt": i, "path": [1, 1, 1], "scored": scored, "k": 2, "method": "m"}
        for e in ("a", "b")
        for i in range(3)
    ] + [{"type": "eval", "engine": e, "item": 0, "correct": True} for e in ("a", "c")]
    got = quality_by_candidate(recs, "a")
    assert set(got) == {"b", "c"}
    assert got["b"].agreement is not None and got["b"].accuracy is None and got["b"].differs is None
    assert got["c"].agreement is None and got["c"].accuracy is not None and got["c"].accuracy.items == 1
