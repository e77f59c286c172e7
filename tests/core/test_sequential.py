"""proxy/sequential.py: the anytime-valid live verdict. Pure and seeded: no engine, fast.

The property that matters is about looking: a stream checked after *every* pair must not declare a difference
that is not there more often than its nominal α, over any number of looks. A fixed-sample 95 % interval checked
the same way does (the control below), so the test can fail.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from proxy.sequential import (
    MIN_PAIRS,
    STREAMS,
    ConfidenceSequence,
    LiveVerdict,
    Regime,
    regime_of,
    replay,
    sentence,
)

Draw = Callable[[random.Random], float]


def normal(rng: random.Random) -> float:
    return rng.gauss(0.0, 0.2)


def gamma_log_ratio(rng: random.Random) -> float:
    """log(b / a) of two latencies from one skewed distribution: what an A/A pair of engines gives."""
    return math.log(rng.gammavariate(2.0, 1.0) / rng.gammavariate(2.0, 1.0))


def ever_declared(draw: Draw, seeds: int, n: int, *, alpha: float, min_effect: float) -> float:
    """The share of seeded A/A streams whose interval ever excluded no-difference (or ±min_effect)."""
    hits = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        cs = ConfidenceSequence(alpha=alpha, min_effect=min_effect)
        for _ in range(n):
            cs.add(draw(rng))
            if cs.decision in ("faster", "slower"):
                hits += 1
                break
    return hits / seeds


def naive_ever_declared(draw: Draw, seeds: int, n: int) -> float:
    """The same looks with a fixed-sample 95 % interval (mean ± 1.96 sd/√t): the peeking problem."""
    hits = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        mean, m2 = 0.0, 0.0
        for k in range(1, n + 1):
            x = draw(rng)
            d = x - mean
            mean += d / k
            m2 += d * (x - mean)
            if k >= MIN_PAIRS and abs(mean) > 1.96 * math.sqrt(m2 / (k - 1) / k):
                hits += 1
                break
    return hits / seeds


def test_an_aa_stream_checked_after_every_pair_never_declares_a_win_over_a_long_run() -> None:
    """Fixed seed, 20,000 pairs, every one looked at: no win, no loss; it does end up calling the tie."""
    rng = random.Random(2024)
    v = LiveVerdict("np1", "np1-twin")
    seen: set[str] = set()
    for _ in range(20_000):
        side = {"tpot_s": 0.01, "upstream_ttft_s": 0.05}
        twin = {"tpot_s": 0.01 * math.exp(gamma_log_ratio(rng)), "upstream_ttft_s": 0.05}
        v.add("decode", side, twin)
        seen.add(v.streams[STREAMS[0]].decision)
    st = v.states()[STREAMS[0]]
    assert "faster" not in seen and "slower" not in seen
    assert st.decision == "tie" and st.decided_after is not None and st.decided_after < 20_000
    assert st.lo is not None and st.hi is not None and -0.05 < st.lo < 0 < st.hi < 0.05


def test_the_empirical_false_declaration_rate_stays_within_the_nominal_alpha() -> None:
    """α = 5 %, no minimum effect (the hardest case: any excluded zero counts), 400 seeded streams of 500
    pairs each, looked at after every pair. The bound allows three binomial standard errors over α."""
    seeds, n, alpha = 400, 500, 0.05
    bound = alpha + 3 * math.sqrt(alpha * (1 - alpha) / seeds)
    for draw in (normal, gamma_log_ratio):
        rate = ever_declared(draw, seeds, n, alpha=alpha, min_effect=0.0)
        assert rate <= bound, (draw.__name__, rate)
    # the control: the same looks at a fixed-sample interval declare far more often
    assert naive_ever_declared(normal, seeds, n) > 3 * bound


def test_a_real_difference_is_declared_within_a_bounded_number_of_pairs_and_stays_declared() -> None:
    """The shadow 20 % faster on TPOT with the A/A noise above: declared faster (≥ 5 %) within 150 pairs, and
    the decision, the interval's shrinking and its side never change afterwards."""
    rng = random.Random(7)
    cs = ConfidenceSequence(alpha=0.05 / len(STREAMS))
    decisions = []
    for _ in range(2_000):
        cs.add(math.log(0.8) + gamma_log_ratio(rng) * 0.5)
        decisions.append(cs.decision)
        st = cs.state()
        if st.lo is not None and st.hi is not None:
            assert st.estimate is not None and st.lo <= st.estimate <= st.hi
    assert cs.decided_after is not None and MIN_PAIRS <= cs.decided_after <= 150
    assert set(decisions[cs.decided_after - 1 :]) == {"faster"}  # never flips back
    assert set(decisions[: cs.decided_after - 1]) == {"not yet"}
    assert not cs.drift
    st = cs.state()
    assert st.hi is not None and st.hi < -0.05 and st.estimate is not None and -0.25 < st.estimate < -0.15


def test_a_decision_stands_and_drift_after_it_is_flagged() -> None:
    """The shadow is faster for 200 pairs, then much slower (it fell behind and queues): the decision made
    stays, and the stream says the traffic changed since."""
    rng = random.Random(3)
    cs = ConfidenceSequence(alpha=0.05 / len(STREAMS))
    for _ in range(200):
        cs.add(math.log(0.5) + rng.gauss(0, 0.2))
    assert (cs.decision, cs.drift) == ("faster", False)
    at = cs.decided_after
    for _ in range(600):
        cs.add(math.log(3.0) + rng.gauss(0, 0.2))
    st = cs.state()
    assert (st.decision, st.decided_after, st.drift) == ("faster", at, True)
    assert st.lo is not None and st.estimate is not None and st.lo <= st.estimate and st.lo > -0.05
    assert "the traffic has changed since" in sentence("b", "a", STREAMS[0], st, 0.05)


def test_nothing_is_decided_before_the_minimum_number_of_pairs() -> None:
    cs = ConfidenceSequence()
    for _ in range(MIN_PAIRS - 1):
        cs.add(math.log(0.1))  # ten times faster, every time
    assert cs.state().decision == "not yet" and cs.state().lo is None
    cs.add(math.log(0.1))
    assert cs.state().decision == "faster" and cs.decided_after == MIN_PAIRS


def test_regimes_and_the_pairs_each_stream_reads() -> None:
    assert regime_of(1, 30) == "decode" and regime_of(1, 2000) == "long" and regime_of(3, 30) == "load"
    assert regime_of(None, 30) is None and regime_of(1, None) == "decode"
    fast = {"upstream_ttft_s": 0.01, "tpot_s": 0.01, "e2e_s": 0.2, "completion_tokens": 20}
    slow = {"upstream_ttft_s": 0.05, "tpot_s": 0.02, "e2e_s": 0.8, "completion_tokens": 20}
    load: Regime = "load"
    decode: Regime = "decode"
    regimes: list[Regime | None] = [load] * 40 + [decode] * 5 + [None] * 5
    pairs = [(r, slow, fast) for r in regimes]
    v = replay(pairs, "np1", "np4", history=True)
    by = {(s.regime, s.metric): st for s, st in v.states().items()}
    assert by[("load", "ttft_s")].decision == "faster" and by[("load", "ttft_s")].n == 40
    assert by[("load", "e2e_per_token_s")].decision == "faster"
    assert by[("decode", "tpot_s")].n == 5 and by[("decode", "tpot_s")].decision == "not yet"
    assert by[("long", "ttft_s")].n == 0
    assert v.history is not None and len(v.history[STREAMS[1]]) == 40
    lines = v.lines()
    assert lines[1].startswith(
        "under load (TTFT): np4 is faster than np1 beyond the band ±5.0 %, decided after 30 pairs (40 now: ×"
    )
    assert lines[0].startswith("single-request decode (TPOT): not yet — 5 pairs")
    assert lines[3] == "long context (TTFT): no pairs yet"
    doc = v.to_json()
    assert doc["alpha"] == 0.05 and len(doc["streams"]) == len(STREAMS)  # type: ignore[arg-type]


def test_a_sentence_for_each_decision() -> None:
    from proxy.sequential import Interval

    s = STREAMS[0]
    tie = Interval(n=80, estimate=0.01, lo=-0.03, hi=0.04, decision="tie", decided_after=60)
    assert sentence("b", "a", s, tie, 0.05) == (
        "single-request decode (TPOT): a tie between b and a, inside the band ±5.0 %, decided after 60 pairs "
        "(80 now: 1.0 % slower, anytime-valid interval between 4.0 % slower and 3.1 % faster)"
    )
    slow = Interval(n=50, estimate=0.3, lo=0.2, hi=0.4, decision="slower", decided_after=44)
    assert sentence("b", "a", s, slow, 0.05) == (
        "single-request decode (TPOT): b is slower than a beyond the band ±5.0 %, decided after 44 pairs "
        "(50 now: 30 % slower, anytime-valid interval 20–40 % slower)"
    )
    # the bench's notation: a speed ratio in words, never a signed Δ, the interval in the estimate's unit
    fast = Interval(n=119, estimate=-0.7, lo=-0.8, hi=-0.5, decision="faster", decided_after=30)
    assert sentence("b", "a", s, fast, 0.05) == (
        "single-request decode (TPOT): b is faster than a beyond the band ±5.0 %, decided after 30 pairs "
        "(119 now: ×3.3 faster, anytime-valid interval ×2.0–×5.0 faster)"
    )
    # issue 45: the sentence follows the current interval — never "slower" beside an interval that says faster
    moved = Interval(n=602, estimate=-0.63, lo=-0.7, hi=-0.55, decision="slower", decided_after=30, drift=True)
    assert sentence("b", "a", s, moved, 0.05) == (
        "single-request decode (TPOT): b was slower than a beyond the band ±5.0 % after 30 pairs — the traffic has "
        "changed since: now, after 602 pairs, b is ×2.7 faster, anytime-valid interval ×2.2–×3.3 faster"
    )
    few = Interval(n=1, estimate=-0.407, lo=None, hi=None, decision="not yet", decided_after=None)
    assert sentence("b", "a", s, few, 0.05) == (
        "single-request decode (TPOT): not yet — 1 pair (b 69 % faster); nothing is decided before 30 pairs"
    )
