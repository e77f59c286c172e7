"""The proxy's own metric objects (``Metrics``, built from ``families``' table) and how one finished attempt is
recorded into them (``observe``). Every name is documented in docs/metrics.md.

Where each family the proxy exports is defined:

- ``proxy.server.record.families``: every family of ``Metrics`` (type, name, labels, boundaries) and the help
  text of each, with those of the rollout's families and of the supervisor's counters;
- this module: the ``Metrics`` objects, built from that table, and the rollout's families, built at scrape time
  from its shared state (``rollout_families``, which ``proxy.server.switch.rollouts.Rollouts`` collects);
- ``proxy.server.workers.supervisor``: under ``serve --workers N`` it writes the worker-loss counters and its own
  traffic seconds straight to its multiprocess file (names and help texts from ``families``);
- three collectors build their own families at scrape time, beside the data they read: ``proxy.gpu.monitor``
  (the GPUs, NVML), ``proxy.server.observe.enginestate`` (what each engine says of itself) and
  ``proxy.server.observe.livediagnosis`` (the live diagnosis of local llama.cpp engines).

Rules: base units (``_seconds``, ``_bytes``, ``_total``); bounded labels only — ``engine`` and ``model`` come
from the configuration (an unconfigured client model string becomes ``other``), ``role`` is
``primary|shadow``, ``stream`` is ``true|false``, ``outcome`` and ``param`` are closed sets below.
Observations happen once per request, at its end, except the in-flight gauge; a chunk costs nothing here.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy import __version__
from proxy.config.settings import MetricsSettings, RouteSettings
from proxy.sequential import DECISIONS, STREAMS, Interval, Stream
from proxy.server.record.buckets import DEFAULT_BUCKETS
from proxy.server.record.families import FAMILIES, HELP, PREFIX, Family
from proxy.server.record.metricfiles import batch
from proxy.server.record.result import Result
from proxy.types import ENDPOINTS
from proxy.types import OUTCOMES as _OUTCOMES

# `_created` series double the exposition for no use on dashboards
disable_created_metrics()  # type: ignore[no-untyped-call]

#: closed set of request outcomes; every request ends in exactly one (documented in proxy/types.py)
OUTCOMES = _OUTCOMES
PARAM_ACTIONS = ("dropped", "defaulted", "renamed", "changed", "unknown")
#: closed set of finish reasons counted for ok requests; anything else (abort, content_filter, none) is "other"
FINISH_REASONS = ("stop", "length", "tool_calls", "other")
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "function_call": "tool_calls"}

#: a route's rollout (proxy/server/switch/rollout.py): its states, the cause of the current one (what a running step
#: waits for, why it rolled back, who paused or aborted it), and what a rollback was for (an abort counts as one)
ROLLOUT_STATES = ("running", "paused", "rolled_back", "aborted", "complete")
ROLLOUT_CAUSES = ("none", "pairs", "not_yet", "requests", "dwell", "slower", "errors", "admin", "config")
ROLLBACK_CAUSES = ("slower", "errors", "admin", "config")
ROLLOUT_REGIMES = ("decode", "load", "long")
#: a route's swap (proxy/server/switch/swapstate.py): its phases, and why it went back to the baseline
SWAP_PHASES = ("baseline", "draining", "stopping", "launching", "warming", "watching", "complete", "reverting",
               "rolled_back", "failed")  # fmt: skip
SWAP_CAUSES = ("drain_timeout", "memory_not_returned", "start_failed", "died", "errors", "slower", "aborted",
               "restarted", "damaged")  # fmt: skip


def finish_label(reason: str | None) -> str:
    return _FINISH.get(reason or "", "other")


def configured_pairs(routes: Iterable[RouteSettings]) -> list[tuple[str, str]]:
    """(primary, shadow) engine pairs the configuration can produce: each serving engine of a route (its primary,
    split engines with weight) with each of the route's shadows other than itself."""
    pairs: list[tuple[str, str]] = []
    for route in routes:
        serving = [route.primary, *(e for e, w in route.split.items() if w > 0)]
        for p in serving:
            for s in route.shadows:
                if s != p and (p, s) not in pairs:
                    pairs.append((p, s))
        if route.rollout is not None:  # mirrored both ways while it runs
            for pair in ((route.primary, route.rollout.candidate), (route.rollout.candidate, route.primary)):
                if pair not in pairs:
                    pairs.append(pair)
    return pairs


@dataclass(frozen=True)
class RolloutSample:
    """One route's rollout as a scrape shows it (read from its shared state file)."""

    route: str
    baseline: str
    candidate: str
    step: int
    share: float
    state: str
    cause: str
    step_seconds: float
    pairs: Mapping[str, int]
    attempts: int
    errors: int
    rollbacks: Mapping[str, int]


def _rollout_gauge(name: str, *labels: str) -> GaugeMetricFamily:
    """One of a rollout's gauge families (``name`` in full), labelled by route, with its help text from ``HELP``."""
    return GaugeMetricFamily(name, HELP[name.removeprefix(f"{PREFIX}_")], labels=("route", *labels))


def rollout_families(samples: Iterable[RolloutSample]) -> list[Metric]:
    """The rollouts' metrics, built at scrape time from their state (every worker reads the same file)."""
    share = _rollout_gauge(f"{PREFIX}_rollout_share", "baseline", "candidate")
    step = _rollout_gauge(f"{PREFIX}_rollout_step")
    state = _rollout_gauge(f"{PREFIX}_rollout_state", "state")
    cause = _rollout_gauge(f"{PREFIX}_rollout_cause", "cause")
    seconds = _rollout_gauge(f"{PREFIX}_rollout_step_seconds")
    pairs = _rollout_gauge(f"{PREFIX}_rollout_step_pairs", "regime")
    attempts = _rollout_gauge(f"{PREFIX}_rollout_step_attempts", "result")
    rollbacks = CounterMetricFamily(f"{PREFIX}_rollout_rollbacks", HELP["rollout_rollbacks"], labels=("route", "cause"))
    for s in samples:
        share.add_metric((s.route, s.baseline, s.candidate), s.share)
        step.add_metric((s.route,), s.step)
        for st in ROLLOUT_STATES:
            state.add_metric((s.route, st), 1 if st == s.state else 0)
        for c in ROLLOUT_CAUSES:
            cause.add_metric((s.route, c), 1 if c == s.cause else 0)
        seconds.add_metric((s.route,), s.step_seconds)
        for g in ROLLOUT_REGIMES:
            pairs.add_metric((s.route, g), s.pairs.get(g, 0))
        attempts.add_metric((s.route, "ok"), s.attempts - s.errors)
        attempts.add_metric((s.route, "error"), s.errors)
        for c in ROLLBACK_CAUSES:
            rollbacks.add_metric((s.route, c), s.rollbacks.get(c, 0))
    return [share, step, state, cause, seconds, pairs, attempts, rollbacks]


@dataclass(frozen=True)
class SwapSample:
    """One route's swap as a scrape shows it (read from its shared state file)."""

    route: str
    phase: str
    phase_seconds: float
    held: int
    outage_seconds: float | None
    back_outage_seconds: float | None
    rollbacks: Mapping[str, int]
    transitions: Mapping[str, int]
    rejected: float
    hung_up: float


def swap_families(samples: Iterable[SwapSample]) -> list[Metric]:
    """The swaps' metrics, built at scrape time from their state (every worker reads the same file)."""
    phase = _rollout_gauge(f"{PREFIX}_swap_phase", "phase")
    seconds = _rollout_gauge(f"{PREFIX}_swap_phase_seconds")
    held = _rollout_gauge(f"{PREFIX}_swap_held_requests")
    outage = _rollout_gauge(f"{PREFIX}_swap_outage_seconds")
    back = _rollout_gauge(f"{PREFIX}_swap_back_outage_seconds")
    counters = {
        name: CounterMetricFamily(f"{PREFIX}_{name}", HELP[name], labels=("route",))
        for name in ("swap_rejected", "swap_hung_up")
    }
    rollbacks = CounterMetricFamily(f"{PREFIX}_swap_rollbacks", HELP["swap_rollbacks"], labels=("route", "cause"))
    entered = CounterMetricFamily(f"{PREFIX}_swap_transitions", HELP["swap_transitions"], labels=("route", "phase"))
    for s in samples:
        for p in SWAP_PHASES:
            phase.add_metric((s.route, p), 1 if p == s.phase else 0)
        seconds.add_metric((s.route,), s.phase_seconds)
        held.add_metric((s.route,), s.held)
        if s.outage_seconds is not None:
            outage.add_metric((s.route,), s.outage_seconds)
        if s.back_outage_seconds is not None:
            back.add_metric((s.route,), s.back_outage_seconds)
        counters["swap_rejected"].add_metric((s.route,), s.rejected)
        counters["swap_hung_up"].add_metric((s.route,), s.hung_up)
        for c in SWAP_CAUSES:
            rollbacks.add_metric((s.route, c), s.rollbacks.get(c, 0))
        for p in SWAP_PHASES:
            entered.add_metric((s.route, p), s.transitions.get(p, 0))
    return [phase, seconds, held, outage, back, *counters.values(), rollbacks, entered]


def make_metric(
    family: Family, registry: CollectorRegistry, bounds: Mapping[str, Sequence[float]]
) -> Counter | Gauge | Histogram:
    """The metric object of one ``FAMILIES`` row on ``registry``; a histogram's boundaries named by a settings
    family come from ``bounds`` (the defaults, or what ``metrics.buckets`` put in their place)."""
    name, text, labels = f"{PREFIX}_{family.name}", HELP[family.name], family.labels
    if family.kind == "counter":
        return Counter(name, text, labels, registry=registry)
    if family.kind == "gauge":
        return Gauge(name, text, labels, registry=registry, multiprocess_mode=family.mode)
    buckets = tuple(bounds[family.buckets]) if isinstance(family.buckets, str) else family.buckets
    return Histogram(name, text, labels, buckets=buckets, registry=registry)


class Metrics:
    """The proxy's metric objects on ``registry``: one attribute per ``FAMILIES`` row, made in its order (the
    order /metrics lists them); ``settings.buckets`` replaces a histogram family's default boundaries."""

    requests: Counter
    in_flight: Gauge
    ttft: Histogram
    upstream_ttft: Histogram
    headers: Histogram
    overhead: Histogram
    proxy_delay: Histogram
    gap: Histogram
    tpot: Histogram
    decode_tps: Histogram
    e2e: Histogram
    traffic: Counter
    prompt_tokens_h: Histogram
    completion_tokens_h: Histogram
    prefill_tps: Histogram
    finish: Counter
    prompt_tokens: Counter
    completion_tokens: Counter
    cached_tokens: Counter
    params: Counter
    usage_stripped: Counter
    rewrites: Counter
    engine_prompt: Histogram
    engine_decode_tps: Histogram
    engine_queue: Histogram
    passthrough: Histogram
    mirror: Counter
    pairs: Counter
    contended: Gauge
    token_mismatch: Counter
    output_mismatch: Counter
    finish_mismatch: Counter
    token_delta: Histogram
    ratio: Histogram
    live_pairs: Gauge
    live_delta: Gauge
    live_low: Gauge
    live_high: Gauge
    live_decision: Gauge
    loop_lag: Histogram
    queued: Gauge
    handler_wait: Histogram
    gc_pause: Histogram
    swap_wait: Histogram
    worker_lost: Counter
    worker_restarts: Counter
    build: Gauge

    def __init__(self, registry: CollectorRegistry, settings: MetricsSettings | None = None) -> None:
        self.registry = registry
        self.settings = settings if settings is not None else MetricsSettings()
        #: labelled children by (metric, labels), for ``observe`` (``child``)
        self.children: dict[tuple[int, tuple[str, ...]], Any] = {}
        bounds: dict[str, Sequence[float]] = dict(DEFAULT_BUCKETS)
        for key, replaced in self.settings.buckets.items():
            bounds[key] = replaced
        for attr, family in FAMILIES.items():
            setattr(self, attr, make_metric(family, registry, bounds))
        self.build.labels(__version__).set(1)

    def observe_live(self, primary: str, shadow: str, stream: Stream, st: Interval | None) -> None:
        """One stream of a pair's live verdict as its gauges (``st`` None: no pair yet). Once per comparable
        pair and stream of its regime, off the chunk path; children come from ``child``'s cache."""
        labels = (primary, shadow, stream.regime, stream.metric)
        nan = float("nan")
        child(self, self.live_pairs, *labels).set(st.n if st else 0)
        child(self, self.live_delta, *labels).set(nan if st is None or st.estimate is None else st.estimate)
        child(self, self.live_low, *labels).set(nan if st is None or st.lo is None else st.lo)
        child(self, self.live_high, *labels).set(nan if st is None or st.hi is None else st.hi)
        now = st.decision if st else "not yet"
        for d in DECISIONS:
            child(self, self.live_decision, *labels, d.replace(" ", "_")).set(1 if d == now else 0)

    def prime(self, engines: Iterable[str], models: Iterable[str], pairs: Iterable[tuple[str, str]] = ()) -> None:
        """Create the zero series users query, so dashboards and alerts see 0 rather than nothing.

        ``pairs``: the configured (primary, shadow) pairs (``configured_pairs``); their pair and mismatch counters
        start at 0, so a healthy pair shows a 0 % mismatch rate instead of "No data".
        """
        models = list(models) or ["other"]
        for e in engines:
            for role in ("primary", "shadow"):
                self.in_flight.labels(e, role)
                self.worker_lost.labels(e, role)
            for m in models:
                for stream in ("true", "false"):
                    for outcome in OUTCOMES:
                        self.requests.labels(e, m, "primary", stream, "chat", outcome)
                for reason in FINISH_REASONS:
                    self.finish.labels(e, m, "primary", reason)
        for generation in ("0", "1", "2"):
            self.gc_pause.labels(generation)
        for p, s in pairs:
            self.pairs.labels(p, s)
            self.contended.labels(p, s)
            if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
                # one process: the series start as not_yet. Under --workers a restarted worker's priming would
                # be the most recent value and hide the other workers' decisions (livemostrecent): no priming
                for st in STREAMS:
                    self.observe_live(p, s, st, None)
            for kind in ("prompt", "completion"):
                self.token_mismatch.labels(p, s, kind)
            self.output_mismatch.labels(p, s)
            self.finish_mismatch.labels(p, s)


assert list(Metrics.__annotations__) == list(FAMILIES), "a Metrics attribute per FAMILIES row"


def child(m: Metrics, metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, remembered: ``labels()`` validates and hashes on every call (12 calls a
    request were 5 % of the proxy's CPU at 32 streams); label sets are bounded, and so is this cache."""
    key = (id(metric), labels)
    child = m.children.get(key)
    if child is None:
        child = m.children[key] = metric.labels(*labels)
    return child


def observe_many(h: Histogram, values: Sequence[float]) -> None:
    """``h.observe(v)`` for every ``v``, in one pass: the bucket counts first (a bisect each), then one increment
    per bucket hit and one for the sum. A stream's gaps are one observation per chunk: one by one, each scanned
    the bounds under the value's lock, ~2 us a gap at the request's end (docs/performance.md).

    Reads prometheus-client's ``Histogram`` internals (``_upper_bounds``, per-bucket ``_buckets``, ``_sum``), the
    same in single- and multiprocess mode; ``tests/server/record/test_metrics.py`` holds it to ``observe`` on the installed
    version. A labelled child only (a parent has no buckets)."""
    bounds: list[float] = h._upper_bounds
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect_left(bounds, v)] += 1  # the first bound >= v: observe's `amount <= bound`
    h._sum.inc(math.fsum(values))
    buckets = h._buckets
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


def observe_one(h: Histogram, v: float) -> None:
    """``h.observe(v)`` without its per-call checks and its linear scan of the bounds (a bisect instead): one
    finished request makes ~15 observations (``observe_many``'s internals and test)."""
    h._sum.inc(v)
    h._buckets[bisect_left(h._upper_bounds, v)].inc(1)


def observe(m: Metrics, r: Result) -> None:
    """Record one finished attempt. Called once per attempt, never per chunk; under ``--workers`` its values reach
    the metric files in one write per file (``metricfiles.batch``)."""
    with batch():
        _observe(m, r)


def _observe(m: Metrics, r: Result) -> None:
    stream = "true" if r.stream else "false"
    child(m, m.requests, r.engine, r.model, r.role, stream, r.endpoint, r.outcome).inc()
    if r.endpoint not in ENDPOINTS:  # pass-through: counted and timed end to end, no token figures
        if r.timing.e2e_s is not None:
            observe_one(child(m, m.passthrough, r.engine, r.model, r.endpoint), r.timing.e2e_s)
        return
    lab = (r.engine, r.model, r.role, stream)
    if r.usage_stripped:
        child(m, m.usage_stripped, r.engine).inc(r.usage_stripped)
    if r.reserialized:
        child(m, m.rewrites, r.engine, "reserialized").inc(r.reserialized)
    t = r.timing
    if t.e2e_s is not None:
        observe_one(child(m, m.e2e, *lab), t.e2e_s)
    if t.overhead_s is not None:
        observe_one(child(m, m.overhead, *lab), t.overhead_s)
    if t.proxy_delay_s is not None:
        observe_one(child(m, m.proxy_delay, *lab), t.proxy_delay_s)
    if t.headers_s is not None:
        observe_one(child(m, m.headers, *lab), t.headers_s)
    if r.outcome == "ok":
        child(m, m.finish, r.engine, r.model, r.role, finish_label(r.finish_reason)).inc()
        # latency figures only from successful requests, so error bodies never pose as fast TTFTs
        if t.ttft_s is not None:
            observe_one(child(m, m.ttft, *lab), t.ttft_s)
        if t.upstream_ttft_s is not None:
            observe_one(child(m, m.upstream_ttft, *lab), t.upstream_ttft_s)
        if t.tpot_s is not None:
            observe_one(child(m, m.tpot, *lab), t.tpot_s)
        if t.decode_tps is not None:
            observe_one(child(m, m.decode_tps, *lab), t.decode_tps)
        if t.gaps_s:
            observe_many(child(m, m.gap, *lab), t.gaps_s)
        if t.queue_s is not None:
            observe_one(child(m, m.engine_queue, *lab), t.queue_s)
    u = r.usage
    if u is not None:
        if u.prompt_tokens is not None:
            child(m, m.prompt_tokens, *lab).inc(u.prompt_tokens)
            observe_one(child(m, m.prompt_tokens_h, *lab), u.prompt_tokens)
        if u.completion_tokens is not None:
            child(m, m.completion_tokens, *lab).inc(u.completion_tokens)
            observe_one(child(m, m.completion_tokens_h, *lab), u.completion_tokens)
    cached = u.cached_tokens if u else None
    et = r.engine_timings
    if cached is None and et is not None:
        cached = et.cache_n
    if cached is not None:
        child(m, m.cached_tokens, *lab).inc(cached)
    up_ttft = t.upstream_ttft_s
    if r.outcome == "ok" and u is not None and u.prompt_tokens and up_ttft is not None and up_ttft > 0:
        # the tokens the engine really had to prefill over the time to its first token: a lower bound on its
        # prefill rate (queueing and the first decode step are in the denominator)
        uncached = u.prompt_tokens - min(cached or 0, u.prompt_tokens)
        if uncached > 0:
            observe_one(child(m, m.prefill_tps, *lab), uncached / up_ttft)
    if et is not None and r.outcome == "ok":
        if et.prompt_ms is not None:
            observe_one(child(m, m.engine_prompt, *lab), et.prompt_ms / 1000)
        if et.predicted_per_second is not None and (et.predicted_n or 0) > 1:
            observe_one(child(m, m.engine_decode_tps, *lab), et.predicted_per_second)
