"""The only module that defines Prometheus metric objects. Every name is documented in docs/metrics.md.

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
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy import __version__
from proxy.sequential import DECISIONS, STREAMS, Interval, Stream
from proxy.server.record.result import Result
from proxy.settings import BUCKET_KEYS, MetricsSettings, RouteSettings
from proxy.types import ENDPOINTS
from proxy.types import OUTCOMES as _OUTCOMES

PREFIX = "enginemeter"

# `_created` series double the exposition for no use on dashboards
disable_created_metrics()  # type: ignore[no-untyped-call]

# Default boundaries, dense where typical values sit; ``metrics.buckets.<family>`` in the settings replaces one
# family's list (docs/metrics.md#buckets). The keys are settings.BUCKET_KEYS.
#: 1 ms .. 10 min; 50 ms steps from 0.1 to 0.3 s and 0.5 s steps from 1 to 3 s, where 7B-70B TTFTs sit
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
    4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
#: 50 ms .. 10 min: whole requests
E2E_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip
#: 0.5 ms .. 10 s: inter-chunk gaps, TPOT; 1 ms steps from 2 to 6 ms (an H200 decodes a 7B at 4-5 ms a token)
GAP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
#: 50 µs .. 1 s: what the proxy itself adds
OVERHEAD_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
#: 0.5 ms .. 10 s: how late the event loop runs (libuv timers are millisecond-grained: an idle loop shows 0-1 ms),
#: how long a request waits for it, how long a garbage collection holds it
LOOP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: OpenTelemetry gen_ai.client.token.usage boundaries
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
TPS_BUCKETS = (1, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 2000, 5000, 10000)
#: prefill tok/s: llama.cpp on a CPU does tens, a GPU engine thousands to tens of thousands on long prompts
PREFILL_BUCKETS = (10, 25, 50, 100, 250, 500, 1000, 2000, 3000, 5000, 7500, 10000, 15000, 20000, 30000, 50000, 100000)
DEFAULT_BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": TTFT_BUCKETS,  # also upstream TTFT, upstream headers, engine prompt time, engine queue time
    "e2e": E2E_BUCKETS,
    "inter_chunk": GAP_BUCKETS,  # also TPOT
    "overhead": OVERHEAD_BUCKETS,
    "tokens": TOKEN_BUCKETS,  # prompt and completion tokens per request
    "decode_tps": TPS_BUCKETS,  # proxy-measured and engine-reported
    "prefill_tps": PREFILL_BUCKETS,
}
assert tuple(DEFAULT_BUCKETS) == BUCKET_KEYS
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)
DELTA_BUCKETS = (-256, -64, -16, -4, -1, 0, 1, 4, 16, 64, 256)

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

REQ = ("engine", "model", "role", "stream")
#: the help texts of the two counters the ``--workers`` supervisor writes (``proxy.server.workers.supervisor.SupervisorCounts``)
WORKER_LOST_HELP = "Requests in flight in a worker process that died (serve --workers N), counted by the supervisor."
WORKER_RESTARTS_HELP = "Worker processes that died and were restarted (serve --workers N)."
#: the traffic profile's counter: every worker's and the supervisor's ticks add up to the whole proxy's seconds
TRAFFIC_HELP = (
    "Seconds the proxy ran with this many generation requests in flight, over all its worker processes "
    "(level: 0, 1, 2, 3-4, 5-8, ..., 129+); counted when the number changes."
)


def _h(name: str, doc: str, buckets: Iterable[float], registry: CollectorRegistry, labels=REQ) -> Histogram:  # type: ignore[no-untyped-def]
    return Histogram(f"{PREFIX}_{name}", doc, labels, buckets=tuple(buckets), registry=registry)


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


def rollout_families(samples: Iterable[RolloutSample]) -> list[Metric]:
    """The rollouts' metrics, built at scrape time from their state (every worker reads the same file)."""
    r = ("route",)
    share = GaugeMetricFamily(f"{PREFIX}_rollout_share", "Share of the route's traffic the rollout sends to its candidate (0 after a rollback or abort, 1 once complete).", labels=(*r, "baseline", "candidate"))  # fmt: skip
    step = GaugeMetricFamily(f"{PREFIX}_rollout_step", "Index of the rollout's current step (0 = the first of rollout.steps).", labels=r)  # fmt: skip
    state = GaugeMetricFamily(f"{PREFIX}_rollout_state", "1 for the rollout's current state (running|paused|rolled_back|aborted|complete), 0 for the others.", labels=(*r, "state"))  # fmt: skip
    cause = GaugeMetricFamily(f"{PREFIX}_rollout_cause", "1 for the cause of the current state: what a running step waits for (pairs|not_yet|requests|dwell), why it rolled back (slower|errors), who paused or aborted it (admin|config); none once complete.", labels=(*r, "cause"))  # fmt: skip
    seconds = GaugeMetricFamily(f"{PREFIX}_rollout_step_seconds", "Seconds since the rollout's current step (or state) began.", labels=r)  # fmt: skip
    pairs = GaugeMetricFamily(f"{PREFIX}_rollout_step_pairs", "Comparable pairs judged at the current step, per regime (decode|load|long).", labels=(*r, "regime"))  # fmt: skip
    attempts = GaugeMetricFamily(f"{PREFIX}_rollout_step_attempts", "The candidate's attempts (served and mirrored) at the current step, by result (ok|error).", labels=(*r, "result"))  # fmt: skip
    rollbacks = CounterMetricFamily(f"{PREFIX}_rollout_rollbacks", "Rollbacks of the rollout, by cause: slower|errors (by itself), admin|config (aborted). Kept in the state file across restarts.", labels=(*r, "cause"))  # fmt: skip
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


@dataclass
class Metrics:
    registry: CollectorRegistry
    settings: MetricsSettings = field(default_factory=MetricsSettings)
    #: labelled children by (metric, labels), for ``observe`` (``child``)
    children: dict[tuple[int, tuple[str, ...]], Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        r = self.registry
        b: dict[str, tuple[float, ...]] = dict(DEFAULT_BUCKETS)
        for family, bounds in self.settings.buckets.items():
            b[family] = bounds
        # ---- proxy core -------------------------------------------------------------------------
        self.requests = Counter(
            f"{PREFIX}_requests", "Requests by final outcome.", ("engine", "model", "role", "stream", "endpoint", "outcome"),
            registry=r,
        )  # fmt: skip
        # multiprocess_mode: how `serve --workers N` merges a gauge over the workers (ignored in one process)
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight_requests", "Requests in progress.", ("engine", "role"), registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.ttft = _h("time_to_first_token_seconds", "Client-felt TTFT: proxy received -> first token event.", b["ttft"], r)  # fmt: skip
        self.upstream_ttft = _h("upstream_time_to_first_token_seconds", "Engine TTFT seen by the proxy: sent upstream -> first token event.", b["ttft"], r)  # fmt: skip
        self.headers = _h("upstream_headers_seconds", "Sent upstream -> upstream response headers.", b["ttft"], r)
        self.overhead = _h("proxy_overhead_seconds", "Proxy received -> sent upstream (what the proxy adds before the engine sees the request, event-loop queueing included).", b["overhead"], r)  # fmt: skip
        self.proxy_delay = _h("proxy_delay_seconds", "Everything the proxy added to the client's time to first byte: received -> sent upstream, plus (streams) the engine's first event -> the client's first byte.", b["overhead"], r)  # fmt: skip
        self.gap = _h("inter_chunk_seconds", "Gap between consecutive token-carrying chunks (a chunk may carry several tokens).", b["inter_chunk"], r)  # fmt: skip
        self.tpot = _h("time_per_output_token_seconds", "(last token - first token) / (completion_tokens - 1).", b["inter_chunk"], r)  # fmt: skip
        self.decode_tps = _h("decode_tokens_per_second", "(completion_tokens - 1) / (last token - first token).", b["decode_tps"], r)  # fmt: skip
        self.e2e = _h(
            "request_duration_seconds",
            "Proxy received -> response finished, any outcome.",
            b["e2e"],
            r,
        )
        # seconds at each number of generation requests in flight (proxy.server.observe.inflight: --traffic's profile)
        self.traffic = Counter(f"{PREFIX}_traffic_seconds", TRAFFIC_HELP, ("level",), registry=r)
        self.prompt_tokens_h = _h("request_prompt_tokens", "Prompt tokens per request (engine usage).", b["tokens"], r)
        self.completion_tokens_h = _h("request_completion_tokens", "Completion tokens per request (engine usage).", b["tokens"], r)  # fmt: skip
        self.prefill_tps = _h("prefill_tokens_per_second", "(prompt tokens - cached prompt tokens) / upstream TTFT: the engine's prefill rate, queueing included.", b["prefill_tps"], r)  # fmt: skip
        self.finish = Counter(
            f"{PREFIX}_finish_reasons", "Successful requests by finish reason (stop|length|tool_calls|other).",
            ("engine", "model", "role", "reason"), registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens (engine usage).", REQ, registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "Completion tokens (engine usage).", REQ, registry=r)  # fmt: skip
        self.cached_tokens = Counter(f"{PREFIX}_cached_prompt_tokens", "Prompt tokens served from the engine's prompt cache.", REQ, registry=r)  # fmt: skip
        self.params = Counter(
            f"{PREFIX}_params", "Client params the proxy dropped, defaulted, renamed or changed for an engine.",
            ("engine", "param", "action"), registry=r,
        )  # fmt: skip
        self.usage_stripped = Counter(f"{PREFIX}_usage_events_stripped", "Usage events removed from client streams that did not ask for usage.", ("engine",), registry=r)  # fmt: skip
        self.rewrites = Counter(f"{PREFIX}_reserialized_events", "Stream events the proxy had to re-serialize (not a plain byte rewrite).", ("engine", "reason"), registry=r)  # fmt: skip
        # ---- what the engine says about itself (llama.cpp timings) -----------------------------------
        self.engine_prompt = _h("engine_prompt_seconds", "Engine-reported prompt processing time (llama.cpp timings.prompt_ms).", b["ttft"], r)  # fmt: skip
        self.engine_decode_tps = _h("engine_decode_tokens_per_second", "Engine-reported decode rate (llama.cpp timings.predicted_per_second).", b["decode_tps"], r)  # fmt: skip
        self.engine_queue = _h("engine_queue_seconds", "Upstream TTFT minus engine-reported prompt time: time queued for a slot.", b["ttft"], r)  # fmt: skip
        # ---- pass-through routes (embeddings, responses, tokenize, ...: proxy/server/passthrough.py) -----
        self.passthrough = Histogram(
            f"{PREFIX}_passthrough_duration_seconds", "Pass-through requests: proxy received -> response finished, any outcome.",
            ("engine", "model", "endpoint"), buckets=b["e2e"], registry=r,
        )  # fmt: skip
        # ---- mirroring and comparison (primary vs shadow) --------------------------------------------
        self.mirror = Counter(
            f"{PREFIX}_mirror_requests", "Shadow copies by fate: sent, or dropped with a reason.",
            ("engine", "result"), registry=r,
        )  # fmt: skip
        self.pairs = Counter(f"{PREFIX}_compared_pairs", "Primary/shadow pairs compared.", ("primary", "shadow"), registry=r)  # fmt: skip
        self.contended = Gauge(
            f"{PREFIX}_pair_contended", "1 while the last compared pair's primary and shadow held memory on the same GPU (their speeds compete), else 0.",
            ("primary", "shadow"), registry=r,
        )  # fmt: skip
        self.token_mismatch = Counter(
            f"{PREFIX}_token_count_mismatches", "Pairs whose token counts differ (kind=prompt|completion).",
            ("primary", "shadow", "kind"), registry=r,
        )  # fmt: skip
        self.output_mismatch = Counter(f"{PREFIX}_output_mismatches", "Greedy pairs whose output text differs.", ("primary", "shadow"), registry=r)  # fmt: skip
        self.finish_mismatch = Counter(f"{PREFIX}_finish_reason_mismatches", "Pairs whose finish reasons differ.", ("primary", "shadow"), registry=r)  # fmt: skip
        self.token_delta = Histogram(
            f"{PREFIX}_token_count_delta", "Shadow minus primary token count per pair.", ("primary", "shadow", "kind"),
            buckets=DELTA_BUCKETS, registry=r,
        )  # fmt: skip
        self.ratio = Histogram(
            f"{PREFIX}_shadow_ratio", "Shadow / primary ratio per pair (metric=ttft|tpot|decode_tps).",
            ("primary", "shadow", "metric"), buckets=RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        # ---- the live verdict (proxy.sequential.LiveVerdict per engine pair; docs/bench.md "Live traffic") -----
        # under serve --workers each worker judges its own share of the pairs: the series are the most recently
        # updated worker's (its /health says the same)
        live = ("primary", "shadow", "regime", "metric")

        def live_gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, (*live, *extra), registry=r, multiprocess_mode="livemostrecent")

        self.live_pairs = live_gauge("live_pairs", "Comparable mirrored pairs the live verdict has judged, per regime and metric.")  # fmt: skip
        self.live_delta = live_gauge("live_delta_ratio", "Live verdict: shadow / primary - 1 of the metric (geometric mean over pairs; below 0 the shadow is faster).")  # fmt: skip
        self.live_low = live_gauge("live_interval_low_ratio", "Live verdict: the anytime-valid interval's lower end of the delta (NaN until bounded).")  # fmt: skip
        self.live_high = live_gauge("live_interval_high_ratio", "Live verdict: the anytime-valid interval's upper end of the delta (NaN until bounded).")  # fmt: skip
        self.live_decision = live_gauge("live_decision", "Live verdict: 1 for the current decision of the stream (not_yet|faster|slower|tie: the shadow against the primary), 0 for the others.", "decision")  # fmt: skip
        # ---- the event loop (proxy/server/record/loopwatch.py): a saturated proxy shows itself here -----------
        self.loop_lag = Histogram(
            f"{PREFIX}_event_loop_lag_seconds", "How late a periodic timer on the event loop fired (every 0.1 s): how long the loop was busy elsewhere.",
            buckets=LOOP_BUCKETS, registry=r,
        )  # fmt: skip
        self.queued = Gauge(
            f"{PREFIX}_requests_queued", "Requests whose head the server has parsed and whose handler has not started yet (waiting for the event loop).",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.handler_wait = Histogram(
            f"{PREFIX}_request_queue_seconds", "Request head parsed -> the proxy's handler started: time a request waited for the event loop.",
            buckets=LOOP_BUCKETS, registry=r,
        )  # fmt: skip
        self.gc_pause = Histogram(
            f"{PREFIX}_gc_pause_seconds", "Garbage-collector pauses of the proxy process, by generation (0|1|2).",
            ("generation",), buckets=LOOP_BUCKETS, registry=r,
        )  # fmt: skip
        # ---- serve --workers N: written by the supervisor when a worker dies (0 in one process) ------------
        self.worker_lost = Counter(f"{PREFIX}_worker_lost_requests", WORKER_LOST_HELP, ("engine", "role"), registry=r)
        self.worker_restarts = Counter(f"{PREFIX}_worker_restarts", WORKER_RESTARTS_HELP, registry=r)
        # ---- build -----------------------------------------------------------------------------------
        self.build = Gauge(
            f"{PREFIX}_build_info", "Always 1; labels carry the version.", ("version",), registry=r,
            multiprocess_mode="max",
        )  # fmt: skip
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
    """Record one finished attempt. Called once per attempt, never per chunk."""
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
