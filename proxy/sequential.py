"""Anytime-valid decisions on a stream of mirrored pairs: asymptotic confidence sequences. Pure, no I/O, no clock.

A live comparison is looked at whenever someone opens ``/health`` or runs ``enginemeter report --log``: a
fixed-sample interval checked after every pair declares a difference that is not there far more often than its
5 % (each look is another chance). A **confidence sequence** is a sequence of intervals that covers the true
value at *every* time at once with probability 1 − α, so it may be looked at after every pair.

The method: the Gaussian-mixture asymptotic confidence sequence (AsympCS) of Waudby-Smith, Arbour, Sinha, Kennedy and
Ramdas, "Time-uniform central limit theory and asymptotic confidence sequences" (Annals of Statistics, 2024;
arXiv:2103.06476), which is Robbins' normal-mixture boundary with the running sample variance plugged in:

    mean_t ± sd_t · sqrt( 2 (t ρ² + 1) / (t² ρ²) · log( sqrt(t ρ² + 1) / α ) )

with ρ chosen so the boundary is tightest at ``PLANNED_PAIRS`` (ρ² = (−2 log α + log(−2 log α + 1)) / t*). It
asks only for independent pairs with a finite variance (no bound, no known variance, no distribution), which is
what paired log-ratios of latencies are; the price is width (about 1.5× a fixed-sample interval at t*), and
validity that is asymptotic: ``MIN_PAIRS`` pairs are taken before anything is decided.

Each observation is ``log(shadow / primary)`` of one time metric of one comparable pair (so + is "the shadow is
slower", the bench's sign). The first time the interval clears a region, that is the **decision**, and it is
final (a confidence sequence is valid at a data-dependent time, so "decided after N pairs" keeps its 1 − α):

- ``faster``: the whole interval below ``−log(1 + m)``: the shadow is faster by at least ``m`` (speed ratio);
- ``slower``: the whole interval above ``+log(1 + m)``;
- ``tie``: the whole interval inside ``±log(1 + m)``: no difference as large as ``m``;
- ``not yet``: anything else.

The interval shown is always the current one (it contains the current estimate). Live traffic drifts — the
mix of prompts changes, another client loads an engine, a shadow falls behind and queues — and then the mean
the pairs estimate moves. While the current interval says something else than the decision (by the same rule),
``drift`` is set: the decision stands as what was true up to then, and the sentence says what the current interval
says ("was slower …; now … faster"), never the decision's direction beside an interval that contradicts it.

``m`` is the minimum effect (``MIN_EFFECT``, 5 %): below it a difference is not worth a switch, and a small
systematic A/A bias (the shadow's copy starts a few microseconds after the primary) stays below it.

Streams are per regime — a pair that ran alone with a short prompt (single-request decode: TPOT), a pair that
overlapped other mirrored requests (under load: TTFT and e2e per output token), a pair that ran alone with a long
prompt (long context: TTFT) — ``STREAMS``. One engine pair's live verdict has ``len(STREAMS)`` streams; each runs
at α / ``len(STREAMS)`` (Bonferroni), so the chance that *any* of them ever declares a difference that is not
there is at most α = 5 % however often it is looked at.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from proxy.judge import judge
from proxy.notation import band, count, faster, faster_interval, unit

ALPHA = 0.05
MIN_EFFECT = 0.05
#: nothing is decided before this many pairs in a stream: the plug-in variance of the first few pairs is often
#: too small, and the interval with it (measured: 10 pairs let 1.7 % of A/A streams cross at a nominal 1.25 %; 30
#: pairs, 1.35 %)
MIN_PAIRS = 30
#: where the boundary is tightest (the tuning parameter ρ)
PLANNED_PAIRS = 100
#: a pair whose prompt is at least this long (tokens) and ran alone is long context (the bench's "long" class)
LONG_PROMPT_TOKENS = 1024

Regime = Literal["decode", "load", "long"]
Finding = Literal["not yet", "faster", "slower", "tie"]
DECISIONS: tuple[Finding, ...] = ("not yet", "faster", "slower", "tie")
REGIME_LABEL: Mapping[str, str] = {"decode": "single-request decode", "load": "under load", "long": "long context"}


@dataclass(frozen=True, slots=True)
class Stream:
    regime: Regime
    #: the pair's figure, per side: ``tpot_s``, ``ttft_s`` (upstream) or ``e2e_per_token_s``
    metric: str
    label: str


STREAMS: tuple[Stream, ...] = (
    Stream("decode", "tpot_s", "TPOT"),
    Stream("load", "ttft_s", "TTFT"),
    Stream("load", "e2e_per_token_s", "e2e per output token"),
    Stream("long", "ttft_s", "TTFT"),
)


def regime_of(concurrency: int | None, prompt_tokens: int | None) -> Regime | None:
    """``concurrency``: how many mirrored requests overlapped the pair (itself included); 1 = it ran alone."""
    if concurrency is None or concurrency < 1:
        return None
    if concurrency > 1:
        return "load"
    return "long" if prompt_tokens is not None and prompt_tokens >= LONG_PROMPT_TOKENS else "decode"


def rho2(alpha: float, planned: int = PLANNED_PAIRS) -> float:
    """The mixture's tuning parameter that makes the boundary tightest at ``planned`` observations."""
    la = -2 * math.log(alpha)
    return (la + math.log(la + 1)) / planned


def margin(t: int, alpha: float, r2: float) -> float:
    """Half-width of the unit-variance boundary after ``t`` observations."""
    return math.sqrt(2 * (t * r2 + 1) / (t * t * r2) * math.log(math.sqrt(t * r2 + 1) / alpha))


@dataclass(frozen=True, slots=True)
class Interval:
    """A stream's state: Δ = shadow / primary − 1 of the (geometric) mean, and its anytime-valid interval."""

    n: int
    estimate: float | None
    lo: float | None  # None: unbounded (fewer than MIN_PAIRS)
    hi: float | None
    decision: Finding
    #: the pair count at which the decision was made (None while "not yet")
    decided_after: int | None
    #: the current interval has left the decided region: the traffic changed since the decision (which stands)
    drift: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "pairs": self.n,
            "delta": self.estimate,
            "interval": [self.lo, self.hi],
            "decision": self.decision,
            "decided_after": self.decided_after,
            "drift": self.drift,
        }


@dataclass
class ConfidenceSequence:
    """One stream of log-ratios; ``add`` is O(1) (Welford's running mean and variance)."""

    alpha: float = ALPHA
    min_effect: float = MIN_EFFECT
    min_pairs: int = MIN_PAIRS
    planned: int = PLANNED_PAIRS
    n: int = 0
    mean: float = 0.0
    _m2: float = 0.0
    lo: float = -math.inf  # the current interval, in log space
    hi: float = math.inf
    decision: Finding = "not yet"
    decided_after: int | None = None
    drift: bool = False
    _r2: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._r2 = rho2(self.alpha, self.planned)

    def add(self, x: float) -> None:
        if not math.isfinite(x):
            return
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self._m2 += d * (x - self.mean)
        if self.n < max(2, self.min_pairs):
            return
        sd = math.sqrt(max(self._m2 / (self.n - 1), 1e-12))
        w = sd * margin(self.n, self.alpha, self._r2)
        lo, hi = self.lo, self.hi = self.mean - w, self.mean + w
        now = current(lo, hi, self.min_effect)
        if self.decision == "not yet":
            if now != "not yet":
                self.decision = now
                self.decided_after = self.n
        else:  # the sentence follows the current interval: drift while it says something else than the decision
            self.drift = now != self.decision

    def state(self) -> Interval:
        bounded = math.isfinite(self.lo) and math.isfinite(self.hi)
        return Interval(
            n=self.n,
            estimate=math.expm1(self.mean) if self.n else None,
            lo=math.expm1(self.lo) if bounded else None,
            hi=math.expm1(self.hi) if bounded else None,
            decision=self.decision,
            decided_after=self.decided_after,
            drift=self.drift,
        )


_SAID: dict[str, Finding] = {"win": "faster", "loss": "slower", "tie": "tie", "unresolved": "not yet"}


def current(lo: float, hi: float, min_effect: float) -> Finding:
    """What an interval of ``log(shadow / primary)`` says, by ``proxy.judge`` (the bench's rule; + is slower, so the
    gain is its negation): faster, slower, tie or not yet. With no minimum effect a tie is never said."""
    said = _SAID[judge(-hi, -lo, math.log1p(min_effect))]
    return "not yet" if said == "tie" and min_effect <= 0 else said


def observation(stream: Stream, primary: Mapping[str, object], shadow: Mapping[str, object]) -> float | None:
    """``log(shadow / primary)`` of the stream's metric, from two sides shaped like the comparison record's."""
    a, b = side_value(primary, stream.metric), side_value(shadow, stream.metric)
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return math.log(b / a)


def side_value(side: Mapping[str, object], metric: str) -> float | None:
    if metric == "e2e_per_token_s":
        e2e, n = side.get("e2e_s"), side.get("completion_tokens")
        if isinstance(e2e, int | float) and isinstance(n, int) and n > 0:
            return float(e2e) / n
        return None
    key = "upstream_ttft_s" if metric == "ttft_s" and side.get("upstream_ttft_s") is not None else metric
    v = side.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass
class LiveVerdict:
    """Every stream of one engine pair (primary = baseline, shadow = candidate)."""

    primary: str
    shadow: str
    alpha: float = ALPHA
    min_effect: float = MIN_EFFECT
    streams: dict[Stream, ConfidenceSequence] = field(default_factory=dict)
    #: (pair count in the stream, Δ, lo, hi) after each observation, for the chart (None: not kept)
    history: dict[Stream, list[tuple[int, float, float | None, float | None]]] | None = None

    def __post_init__(self) -> None:
        per = self.alpha / len(STREAMS)
        self.streams = {s: ConfidenceSequence(alpha=per, min_effect=self.min_effect) for s in STREAMS}

    def add(self, regime: Regime | None, primary: Mapping[str, object], shadow: Mapping[str, object]) -> None:
        for s, cs in self.streams.items():
            if s.regime != regime:
                continue
            x = observation(s, primary, shadow)
            if x is None:
                continue
            cs.add(x)
            if self.history is not None:
                st = cs.state()
                self.history.setdefault(s, []).append((st.n, st.estimate or 0.0, st.lo, st.hi))

    def states(self) -> dict[Stream, Interval]:
        return {s: cs.state() for s, cs in self.streams.items()}

    def lines(self) -> list[str]:
        return [sentence(self.shadow, self.primary, s, st, self.min_effect) for s, st in self.states().items()]

    def to_json(self) -> dict[str, object]:
        return {
            "primary": self.primary,
            "shadow": self.shadow,
            "alpha": self.alpha,
            "min_effect": self.min_effect,
            "streams": [
                {
                    "regime": s.regime,
                    "metric": s.metric,
                    **st.to_json(),
                    "text": sentence(self.shadow, self.primary, s, st, self.min_effect),
                }
                for s, st in self.states().items()
            ],
        }


def sentence(shadow: str, primary: str, s: Stream, st: Interval, min_effect: float) -> str:
    """One line a person reads, in the bench's notation (``proxy.notation``), that follows the current interval:
    "under load (TTFT): np4 is faster than np1 beyond the band ±5.0 %, decided after 30 pairs (37 now: 44 % faster,
    anytime-valid interval 21–71 % faster)"; once the current interval says something else (``drift``): "… np4 was
    slower than np1 beyond the band ±5.0 % after 30 pairs; now, after 602 pairs, it is ×2.7 faster (…)"."""
    where = f"{REGIME_LABEL[s.regime]} ({s.label})"
    if st.n == 0:
        return f"{where}: no pairs yet"
    m = band(min_effect)
    said = {
        "faster": f"{shadow} is faster than {primary} beyond the band {m}",
        "slower": f"{shadow} is slower than {primary} beyond the band {m}",
        "tie": f"a tie between {shadow} and {primary}, inside the band {m}",
    }
    now: Finding = "not yet"
    if st.lo is not None and st.hi is not None:
        now = current(math.log1p(st.lo), math.log1p(st.hi), min_effect)
    if st.decision in said and now == st.decision:
        return f"{where}: {said[st.decision]}, decided after {st.decided_after} pairs ({st.n} now: {speed(st)})"
    if st.decision in said:
        was = said[st.decision].replace(" is ", " was ", 1).replace("a tie between", "was a tie between", 1)
        return (
            f"{where}: {was} after {st.decided_after} pairs — the traffic has changed since: now, after {st.n} "
            f"pairs, {_now(now, st, shadow, primary, m)}"
        )
    need = f"; nothing is decided before {MIN_PAIRS} pairs" if st.n < MIN_PAIRS else ""
    return f"{where}: not yet — {count(st.n, 'pair')} ({shadow} {speed(st)}){need}"


def _now(d: Finding, st: Interval, shadow: str, primary: str, m: str) -> str:
    """What the current interval says (``d``), in words: its own answer, never the decision's."""
    if d == "tie":
        return f"a tie, inside the band {m} ({speed(st)})"
    if d == "not yet":
        return f"{shadow} and {primary} are not separated ({speed(st)})"
    return f"{shadow} is {speed(st)}"


def speed(st: Interval) -> str:
    """The state as the shadow's speed ratio over the primary (the primary's time over the shadow's), in one unit:
    "44 % faster, anytime-valid interval 21–71 % faster"."""
    if st.estimate is None:
        return "no estimate"
    r = 1 / (1 + st.estimate)
    if st.lo is None or st.hi is None:
        return faster(r)
    lo, hi = 1 / (1 + st.hi), 1 / (1 + st.lo)  # a higher time ratio is a lower speed ratio
    u = unit(r, lo, hi)
    return f"{faster(r, u)}, anytime-valid interval {faster_interval(lo, hi, u)}"


def replay(
    pairs: Iterable[tuple[Regime | None, Mapping[str, object], Mapping[str, object]]],
    primary: str,
    shadow: str,
    *,
    alpha: float = ALPHA,
    min_effect: float = MIN_EFFECT,
    history: bool = False,
) -> LiveVerdict:
    """The live verdict of a stream of (regime, primary side, shadow side), in the order they were compared."""
    v = LiveVerdict(primary, shadow, alpha=alpha, min_effect=min_effect, history={} if history else None)
    for regime, p, s in pairs:
        v.add(regime, p, s)
    return v
