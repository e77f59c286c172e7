"""The way to switch, decided from the measurements: the mirrored rollout when both engines can be resident at once
(their measured peaks together within the budget, or on different GPUs or hosts), else the swap on one GPU (one
engine at a time: the baseline stopped, the candidate launched, the traffic held meanwhile) with its expected
outage; the rollout's steps and the swap's watch timed at the traffic's recorded rate, and the swap's bounds sized
from the measured load time. Pure: ``Data`` in, figures out; the switch plan renders them
(``proxy.bench.report.switchplan``). docs/bench.md#the-switch-plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from proxy.bench.verdict.data import Data
from proxy.config.switching import DEFAULT_STEPS, RolloutSettings, SwapSettings
from proxy.notation import gib

Way = Literal["rollout", "swap"]

#: the rate assumed when no traffic was recorded (``--traffic``): a few requests a minute, a small service
ASSUMED_RATE = 0.1
#: a rollout step should finish within this at the traffic's rate; a smaller share that would not is left out
STEP_TARGET_S = 3600.0
#: the shares the rollout's steps are picked from: the config's defaults
LADDER: tuple[float, ...] = DEFAULT_STEPS
#: the hold queue's wait: the measured outage times this, plus a fixed margin (seconds). Twice, as the candidate's
#: ready timeout: a launch the bench measured may have found warm caches (vLLM's compile, Triton's kernels), and a
#: first launch on a machine takes longer: vLLM FP8 on the 2026-12-07 H100 was ready after 78.5 s in a bench and
#: 170.5 s on the machine's first launch, the swap's (docs/gpu-results/h100-2026-12-07-swap-3b); at 1.5x the plan's
#: queue would have refused the requests held longest
WAIT_FACTOR, WAIT_MARGIN_S = 2.0, 30.0
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def _peak(d: Data, engine: str) -> int | None:
    """The engine's measured GPU memory peak: its samples' (the reading while it generated), else its launch's."""
    got = [s.gpu_mem_peak_bytes for s in d.results.samples if s.engine == engine and s.gpu_mem_peak_bytes]
    launched = [
        ((s.get("launch") or {}).get("memory") or {}).get("peak", {}).get("engine_bytes")
        for s in d.stints
        if s.get("engine") == engine
    ]
    got += [int(x) for x in launched if isinstance(x, int) and x > 0]
    return max(got, default=None)


def _gpus(d: Data, engine: str) -> frozenset[int]:
    return frozenset(g for s in d.results.samples if s.engine == engine for g in s.gpus)


def _host(d: Data, engine: str) -> str | None:
    url = next((e.get("url") for e in d.engines_meta if e.get("name") == engine), None)
    try:
        host = urlsplit(url).hostname if url else None
    except ValueError:
        return None
    return "localhost" if host in _LOOPBACK else host


@dataclass(frozen=True)
class Resident:
    """What will be resident at once, and the way that follows: ``way`` None when the bench cannot tell."""

    way: Way | None
    peaks: dict[str, int | None]
    limit: int | None
    limit_what: str
    why: str

    def together(self) -> int | None:
        return None if any(p is None for p in self.peaks.values()) else sum(p or 0 for p in self.peaks.values())


def resident(d: Data, baseline: str, candidate: str) -> Resident:
    """Rollout when both engines fit at once (their peaks summed within the budget, else the card), or run on
    different GPUs (both read, none shared, side by side) or hosts; swap when the sum does not fit."""
    peaks = {e: _peak(d, e) for e in (baseline, candidate)}
    total = max((s.gpu_mem_total_bytes or 0 for s in d.results.samples), default=0) or None
    budget = d.results.memory_budget_bytes
    limit, what = (budget, "budget") if budget else (total, "card")
    ga, gb = _gpus(d, baseline), _gpus(d, candidate)
    ha, hb = _host(d, baseline), _host(d, candidate)
    if ha and hb and ha != hb:
        return Resident(
            "rollout", peaks, limit, what, f"{baseline} and {candidate} run on different hosts ({ha}, {hb})"
        )
    if ga and gb and not ga & gb and not d.results.time_shared:
        on = f"GPU {','.join(map(str, sorted(ga)))} and GPU {','.join(map(str, sorted(gb)))}"
        return Resident("rollout", peaks, limit, what, f"{baseline} and {candidate} run on different GPUs ({on})")
    both = sum(p for p in peaks.values() if p is not None)
    figures = " + ".join(f"{e} {gib(p)}" for e, p in peaks.items())
    if None in peaks.values() or limit is None:
        unknown = [e for e, p in peaks.items() if p is None]
        return Resident(
            None,
            peaks,
            limit,
            what,
            f"not measured: the GPU memory peak of {' and '.join(unknown)}"
            if unknown
            else "no budget and no card size read",
        )
    if both <= limit:
        return Resident("rollout", peaks, limit, what, f"{figures} = {gib(both)} fit the {what} {gib(limit)} together")
    return Resident("swap", peaks, limit, what, f"{figures} = {gib(both)} exceed the {what} {gib(limit)}")


@dataclass(frozen=True)
class Outage:
    """The swap's expected outage: the candidate's measured launch → ready and its first warm-up requests (the
    baseline's stop and its memory coming back are not timed by the bench)."""

    ready_s: float | None
    warmup_s: float | None
    warmup_requests: int

    @property
    def seconds(self) -> float | None:
        return None if self.ready_s is None else self.ready_s + (self.warmup_s or 0.0)


def outage(d: Data, engine: str, warmup_requests: int | None = None) -> Outage:
    n = SwapSettings(candidate=engine).warmup_requests if warmup_requests is None else warmup_requests
    ready = [
        float(la["ready_s"])
        for s in d.stints
        if s.get("engine") == engine and isinstance((la := s.get("launch") or {}).get("ready_s"), int | float)
    ]
    first = sorted(
        (r for r in d.requests if r.get("engine") == engine and r.get("phase") == "warmup" and r.get("e2e_s")),
        key=lambda r: float(r.get("t_s") or 0.0),
    )[:n]
    warm = sum(float(r["e2e_s"]) for r in first) if first else None
    return Outage(max(ready) if ready else None, warm, n)


@dataclass(frozen=True)
class Rate:
    """Requests per second of the traffic the plan is timed at; ``assumed``: none was recorded."""

    per_s: float
    source: str
    assumed: bool

    def text(self) -> str:
        per = f"{self.per_s * 60:.3g} requests a minute" if self.per_s < 1 else f"{self.per_s:.3g} requests a second"
        if self.assumed:
            return (
                f"{per} (assumed: no traffic recorded; give `--traffic` the proxy's request log or comparison log "
                "and the plan is timed at its rate)"
            )
        return f"{per} ({self.source})"


def rate(d: Data) -> Rate:
    t = d.results.traffic
    if t is not None and t.requests and t.span_s and t.span_s > 0:
        return Rate(t.requests / t.span_s, t.source, False)
    return Rate(ASSUMED_RATE, "assumed", True)


@dataclass(frozen=True)
class Step:
    share: float
    #: requests the route must see for the step's counts (pairs; the candidate's own requests at its share)
    requests: int
    seconds: float


def step_time(share: float, r: float, s: RolloutSettings) -> Step:
    """A step lasts its dwell at least, until a regime has its pairs (every request mirrored: one pair each) and,
    above share 0, the candidate served its requests."""
    need = max(s.min_pairs, math.ceil(s.min_requests / share) if share > 0 else 0)
    return Step(share, need, max(s.min_dwell_s, need / r))


def steps(r: float, s: RolloutSettings | None = None, target_s: float = STEP_TARGET_S) -> tuple[Step, ...]:
    """The rollout's steps: shadow first, then each share of ``LADDER`` whose step finishes within ``target_s`` at
    ``r`` requests a second, then the whole route."""
    s = s or RolloutSettings(candidate="-")
    kept = [x for x in LADDER if x in (0.0, 1.0) or step_time(x, r, s).seconds <= target_s]
    return tuple(step_time(x, r, s) for x in kept)


def skipped(r: float, s: RolloutSettings | None = None, target_s: float = STEP_TARGET_S) -> list[Step]:
    s = s or RolloutSettings(candidate="-")
    kept = {x.share for x in steps(r, s, target_s)}
    return [step_time(x, r, s) for x in DEFAULT_STEPS if x not in kept]


def watch_s(r: float, s: SwapSettings) -> float:
    """The swap's watch at ``r``: its dwell at least, until the candidate served ``min_requests`` in a regime."""
    return max(s.min_dwell_s, s.min_requests / r)


@dataclass(frozen=True)
class Bounds:
    """The swap's settings sized from the measurements (None: the config's default)."""

    queue_max_wait_s: float | None
    queue_max_requests: int | None
    ready_timeout_s: float | None
    drain_timeout_s: float | None


def _up(x: float, to: float = 10.0) -> float:
    return math.ceil(x / to) * to


def bounds(d: Data, baseline: str, out: Outage, r: Rate) -> Bounds:
    """The hold queue waits the measured outage with margin; it holds at least twice what arrives meanwhile at the
    recorded rate; the candidate may take twice its load time; the baseline's drain, twice its longest request."""
    dflt = SwapSettings(candidate="-")
    wait = _up(WAIT_FACTOR * out.seconds + WAIT_MARGIN_S) if out.seconds is not None else None
    count = None
    if wait is not None and not r.assumed:
        count = max(dflt.queue_max_requests, math.ceil(2 * r.per_s * wait))
    ready = max(dflt.ready_timeout_s, _up(2 * out.ready_s, 60)) if out.ready_s is not None else None
    longest = max((float(x["e2e_s"]) for x in d.requests if x.get("engine") == baseline and x.get("e2e_s")), default=0)
    drain = max(dflt.drain_timeout_s, _up(2 * longest)) if longest else None
    return Bounds(wait, count, ready, drain)


def span(seconds: float) -> str:
    """Seconds in the unit a person plans in."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


# ---- in words ---------------------------------------------------------------------------------------------


def steps_lines(d: Data, candidate: str) -> list[str]:
    """The rollout's steps timed at the traffic's rate: what each needs and how long it lasts."""
    ro = RolloutSettings(candidate=candidate, error_budget=d.results.max_error_rate)
    r = rate(d)
    kept = steps(r.per_s, ro)
    out = [
        f"**The steps at the traffic's rate**, {r.text()}: each lasts {ro.min_dwell_s:g} s at least, until a regime "
        f"has {ro.min_pairs} pairs (every request is mirrored: one pair each; a regime with a tenth of the traffic "
        f"needs ten times as many requests) and the candidate served {ro.min_requests} requests at its share:",
        "",
        "| step | share | requests the route must see | lasts, at that rate |",
        "|---|---|---|---|",
        *(
            f"| {i} | {'0 (shadow)' if x.share == 0 else f'{x.share:.0%}'} | {x.requests:,} | {span(x.seconds)} |"
            for i, x in enumerate(kept)
        ),
        "",
        f"The whole rollout: about {span(sum(x.seconds for x in kept))}, if no step is held by a slower "
        "or failing candidate.",
    ]
    gone = skipped(r.per_s, ro)
    if gone:
        out[-1] += (
            " Left out, each longer than the "
            + span(STEP_TARGET_S)
            + (
                " a step may take at this rate: "
                + ", ".join(f"{x.share:.0%} ({x.requests:,} requests: {span(x.seconds)})" for x in gone)
                + "."
            )
        )
    return [*out, ""]


def way_lines(d: Data, baseline: str, candidate: str) -> list[str]:
    """Why this way: what will be resident at once, from the measured peaks."""
    at = resident(d, baseline, candidate)
    if at.way == "swap":
        return [
            f"**The swap, one engine at a time**: {at.why}; both cannot be resident, so the mirrored rollout (every "
            f"request on both engines) cannot run on this GPU. The proxy stops {baseline}, waits for its GPU memory "
            f"to come back, launches {candidate}, holds the requests meanwhile, then watches {candidate} against "
            f"{baseline}'s figures from before and swaps back by itself (docs/routing.md#swap).",
            "",
        ]
    if at.way == "rollout":
        return [f"**The mirrored rollout, both engines resident**: {at.why}.", ""]
    return [
        f"**The mirrored rollout, if both engines fit at once**: whether they do is not known ({at.why}). The "
        "rollout keeps both resident; if they do not fit together on your GPU, switch with a swap instead "
        "(docs/routing.md#swap: a route with `swap:`, both engines launched by serve).",
        "",
    ]
