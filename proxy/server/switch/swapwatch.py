"""The watch after a swap, pure: the candidate's live figures against the baseline's from before, unpaired.

A swap has no pairs (one engine is resident at a time), so the comparison is of two samples: the baseline's
last ``baseline_window`` requests per regime before the swap, and the candidate's requests since. Each figure —
TTFT, time per output token, the whole request (``METRICS``) — is compared as ``log(candidate) − log(baseline)``
of the geometric means, per *regime*: the level of the client's requests in flight at the request's start as the
proxy counted them (``proxy.levels``; mirrored copies never count).

The baseline's window is fixed before the candidate serves: a fixed-sample normal interval. The candidate is
looked at every tick: an anytime-valid confidence sequence (``proxy.sequential``'s AsympCS), valid however often it
is looked at. The difference's interval is ``[lo_c − hi_b, hi_c − lo_b]``; each side runs at ``ALPHA / (2 ·
streams)`` (Bonferroni over every possible stream, levels × metrics, and the two sides), so the chance of a
false ``slower`` over the whole watch is at most ``ALPHA``.

Decisions (``judge``): ``errors`` when the candidate failed at least ``min_errors`` requests and more than
``error_budget`` of them; ``slower`` when, in a regime with ``regime_share`` of the candidate's requests, a
figure's interval lies wholly above ``log(1 + band)``; ``pass`` after ``min_dwell_s`` once every such regime has
``min_requests`` requests (and, ``gate: not_worse``, every interval's upper end is below the band), its detail
naming the regimes the baseline served that the watch did not judge; else ``None`` (hold) with what it waits for.

Each timed request also adds ``stalled`` (1.0 when the proxy's event loop stalled while it was timed,
``Result.loop_stalled``; else 0.0) to the same sums, whose mean is the share: never judged, it is stated beside a
decision (``slower`` names the regime's counts on both sides, ``pass`` those of the regimes it judged) — a host
whose CPU starves the proxy (an engine's scheduler on the same cores) slows the clients too, so such requests are
not set aside, only counted.

Sums are mergeable (``[n, mean, m2]`` of the log values per ``regime/metric``): under ``--workers`` every worker
reports its own and the owner merges them (``proxy.server.switch.swapstate.merge``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from proxy.config.switching import SwapSettings
from proxy.levels import LEVELS, level_of
from proxy.sequential import ALPHA, MIN_PAIRS, margin, rho2
from proxy.server.record.loopwatch import STALL_S

#: figure -> the Result timing attribute it is read from
METRICS: Mapping[str, str] = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}
#: the 0/1 value per timed request: the proxy's loop stalled while it was timed (stated, never judged)
STALLED = "stalled"
#: every stream the watch could test (the Bonferroni count: fixed, never what the traffic happened to show)
STREAMS = len(LEVELS) * len(METRICS)
#: each side's error rate: both sides of every stream together stay within ALPHA
SIDE_ALPHA = ALPHA / (2 * STREAMS)
Z_BASELINE = NormalDist().inv_cdf(1 - SIDE_ALPHA / 2)
_R2 = rho2(SIDE_ALPHA)


def regime_of(in_flight: int) -> str:
    """The regime of a request that found ``in_flight`` client requests in flight, itself included."""
    return LEVELS[level_of(max(1, in_flight))][0]


def figures_of(timing: Any, stalled: bool = False) -> dict[str, float]:
    """The log figures of one answered request (the ones it has: no TPOT without two tokens), and ``stalled``."""
    out = {STALLED: 1.0 if stalled else 0.0}
    for metric, attr in METRICS.items():
        v = getattr(timing, attr, None)
        if v is not None and v > 0 and math.isfinite(v):
            out[metric] = math.log(v)
    return out


@dataclass
class Window:
    """The baseline's last ``size`` log figures per ``regime/metric`` (this process's)."""

    size: int
    values: dict[str, deque[float]] = field(default_factory=dict)

    def add(self, regime: str, figures: Mapping[str, float]) -> None:
        for metric, x in figures.items():
            key = f"{regime}/{metric}"
            d = self.values.get(key)
            if d is None:
                d = self.values[key] = deque(maxlen=self.size)
            d.append(x)

    def sums(self) -> dict[str, list[float]]:
        out = {}
        for key, d in self.values.items():
            n = len(d)
            if n:
                mean = sum(d) / n
                out[key] = [float(n), mean, sum((x - mean) ** 2 for x in d)]
        return out


@dataclass
class Running:
    """The candidate's running sums per ``regime/metric`` since the watch began (this process's); Welford."""

    sums: dict[str, list[float]] = field(default_factory=dict)

    def add(self, regime: str, figures: Mapping[str, float]) -> None:
        for metric, x in figures.items():
            s = self.sums.setdefault(f"{regime}/{metric}", [0.0, 0.0, 0.0])
            s[0] += 1
            d = x - s[1]
            s[1] += d / s[0]
            s[2] += d * (x - s[1])


def interval(base: list[float] | None, cand: list[float] | None) -> tuple[float, float] | None:
    """The interval of log(candidate / baseline) for one stream; None while either side is too small."""
    if base is None or cand is None or base[0] < MIN_PAIRS or cand[0] < MIN_PAIRS:
        return None
    nb, mb, qb = base
    nc, mc, qc = cand
    wb = Z_BASELINE * math.sqrt(max(qb / (nb - 1), 1e-12) / nb)
    wc = math.sqrt(max(qc / (nc - 1), 1e-12)) * margin(int(nc), SIDE_ALPHA, _R2)
    return (mc - wc) - (mb + wb), (mc + wc) - (mb - wb)


def rows(base: Mapping[str, list[float]], cand: Mapping[str, list[float]]) -> list[dict[str, Any]]:
    """Every stream the candidate has figures in, for /health: counts, the estimate and interval as ratios − 1."""
    out = []
    for key in sorted(cand):
        regime, _, metric = key.partition("/")
        if metric not in METRICS:
            continue
        b, c = base.get(key), cand[key]
        iv = interval(b, c)
        est = math.expm1(c[1] - b[1]) if b is not None and b[0] else None
        out.append(
            {
                "regime": regime,
                "metric": metric,
                "baseline_n": int(b[0]) if b else 0,
                "candidate_n": int(c[0]),
                "delta": est,
                "interval": [math.expm1(iv[0]), math.expm1(iv[1])] if iv else None,
                "baseline_stalled": _share(base, [regime])[0],
                "candidate_stalled": _share(cand, [regime])[0],
            }
        )
    return out


def judge(
    s: SwapSettings,
    band: float,
    base: Mapping[str, list[float]],
    cand: Mapping[str, list[float]],
    counts: Mapping[str, int],
    elapsed_s: float,
) -> tuple[str | None, str]:
    """``("errors"|"slower"|"pass"|None, detail)``: the watch's decision now (module docstring)."""
    attempts, errors = counts.get("attempts", 0), counts.get("errors", 0)
    if errors >= s.min_errors and errors > s.error_budget * attempts:
        return "errors", f"{s.candidate} failed {errors} of {attempts} requests (budget {s.error_budget:.1%})"
    e = math.log1p(band)
    per_regime = {k.partition("/")[0]: int(v[0]) for k, v in cand.items() if k.endswith("/e2e")}
    total = sum(per_regime.values())
    exercised = [r for r, n in per_regime.items() if n and n >= s.regime_share * total]
    waiting = ""
    for regime in exercised:
        for metric in METRICS:
            key = f"{regime}/{metric}"
            iv = interval(base.get(key), cand.get(key))
            if iv is None:
                continue
            if iv[0] > e:
                return "slower", (
                    f"{s.candidate} is slower than the baseline in {metric} at {regime} in flight: "
                    f"{math.expm1(iv[0]):+.1%} to {math.expm1(iv[1]):+.1%} (band +{band:.0%})"
                    + _stalls(base, cand, [regime])
                )
            if s.gate == "not_worse" and not iv[1] < e and not waiting:
                waiting = f"{metric} at {regime} in flight not yet shown within +{band:.0%}"
        if per_regime[regime] < s.min_requests and not waiting:
            waiting = f"{per_regime[regime]} of {s.min_requests} requests at {regime} in flight"
    if not exercised:
        return None, "no request served by the candidate yet"
    if waiting:
        return None, waiting
    if elapsed_s < s.min_dwell_s:
        return None, f"the watch lasts {s.min_dwell_s:g} s at least"
    done = f"{total} requests watched, none slower beyond +{band:.0%}, {errors} failed"
    return "pass", done + _unwatched(base, exercised) + _stalls(base, cand, exercised)


def _share(sums: Mapping[str, list[float]], regimes: list[str]) -> tuple[int, int]:
    """(stalled, timed) requests of one side in ``regimes``."""
    parts = [sums[k] for r in regimes if (k := f"{r}/{STALLED}") in sums]
    return round(sum(n * mean for n, mean, _ in parts)), round(sum(n for n, _, _ in parts))


def _stalls(base: Mapping[str, list[float]], cand: Mapping[str, list[float]], regimes: list[str]) -> str:
    """The requests timed while the proxy's event loop stalled, when the candidate has any: their figures hold the
    proxy's wait (its host's CPU, a collection) as well as the engine's."""
    k, n = _share(cand, regimes)
    if not k:
        return ""
    kb, nb = _share(base, regimes)
    theirs = f" ({kb} of the baseline's {nb})" if nb else ""
    return (
        f"; the proxy's event loop stalled (≥ {STALL_S * 1e3:.0f} ms) while {k} of the candidate's {n} requests"
        f"{theirs} were timed: their figures hold the proxy's wait too"
    )


def _unwatched(base: Mapping[str, list[float]], exercised: list[str]) -> str:
    """The regimes the baseline's window served that the watch did not judge (a pass says nothing of them)."""
    names = [name for name, *_ in LEVELS]
    seen = {k.partition("/")[0] for k, v in base.items() if k.endswith("/e2e") and v[0] >= MIN_PAIRS}
    left = sorted(seen - set(exercised), key=names.index)
    return f"; not watched: {', '.join(left)} in flight (the baseline served them before)" if left else ""
