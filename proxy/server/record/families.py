"""The proxy's metric families as data: what ``metrics.Metrics`` builds (``FAMILIES``: type, name, labels,
boundaries, how ``serve --workers`` merges a gauge) and the help text of every family named here (``HELP``),
the rollout's scrape-time families and the counters the ``--workers`` supervisor writes included.

Every name is documented in docs/metrics.md. Rules: base units (``_seconds``, ``_bytes``, ``_total``); bounded
labels only (``metrics``' module docstring says which values each takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.server.record.buckets import DELTA_BUCKETS, LOOP_BUCKETS, RATIO_BUCKETS

#: every metric name starts with it (``enginemeter_requests_total``)
PREFIX = "enginemeter"
#: the labels of a request's figures
REQ = ("engine", "model", "role", "stream")
#: a held request's wait during a swap: from no wait to the longest a candidate may take to load
SWAP_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: the labels of a mirrored pair's live verdict
LIVE = ("primary", "shadow", "regime", "metric")


@dataclass(frozen=True)
class Family:
    """One metric object of ``Metrics``: its type, its name after ``PREFIX``, its label names."""

    kind: Literal["counter", "gauge", "histogram"]
    name: str
    labels: tuple[str, ...] = REQ
    #: a histogram's boundaries: a ``buckets.DEFAULT_BUCKETS`` key (``metrics.buckets`` may replace them), or fixed
    buckets: str | tuple[float, ...] = ()
    #: how ``serve --workers N`` merges a gauge over the workers (prometheus-client's ``multiprocess_mode``;
    #: ignored in one process)
    mode: Literal["all", "livesum", "livemostrecent", "max"] = "all"


#: ``Metrics`` attribute -> its family, in the order the registry exposes them
FAMILIES: dict[str, Family] = {
    # ---- proxy core
    "requests": Family("counter", "requests", ("engine", "model", "role", "stream", "endpoint", "outcome")),
    "in_flight": Family("gauge", "in_flight_requests", ("engine", "role"), mode="livesum"),
    "ttft": Family("histogram", "time_to_first_token_seconds", buckets="ttft"),
    "upstream_ttft": Family("histogram", "upstream_time_to_first_token_seconds", buckets="ttft"),
    "headers": Family("histogram", "upstream_headers_seconds", buckets="ttft"),
    "overhead": Family("histogram", "proxy_overhead_seconds", buckets="overhead"),
    "proxy_delay": Family("histogram", "proxy_delay_seconds", buckets="overhead"),
    "gap": Family("histogram", "inter_chunk_seconds", buckets="inter_chunk"),
    "tpot": Family("histogram", "time_per_output_token_seconds", buckets="inter_chunk"),
    "decode_tps": Family("histogram", "decode_tokens_per_second", buckets="decode_tps"),
    "e2e": Family("histogram", "request_duration_seconds", buckets="e2e"),
    # seconds at each number of generation requests in flight (proxy.server.observe.inflight: --traffic's profile)
    "traffic": Family("counter", "traffic_seconds", ("level",)),
    "prompt_tokens_h": Family("histogram", "request_prompt_tokens", buckets="tokens"),
    "completion_tokens_h": Family("histogram", "request_completion_tokens", buckets="tokens"),
    "prefill_tps": Family("histogram", "prefill_tokens_per_second", buckets="prefill_tps"),
    "finish": Family("counter", "finish_reasons", ("engine", "model", "role", "reason")),
    "prompt_tokens": Family("counter", "prompt_tokens"),
    "completion_tokens": Family("counter", "completion_tokens"),
    "cached_tokens": Family("counter", "cached_prompt_tokens"),
    "params": Family("counter", "params", ("engine", "param", "action")),
    "usage_stripped": Family("counter", "usage_events_stripped", ("engine",)),
    "rewrites": Family("counter", "reserialized_events", ("engine", "reason")),
    # ---- what the engine says about itself (llama.cpp timings)
    "engine_prompt": Family("histogram", "engine_prompt_seconds", buckets="ttft"),
    "engine_decode_tps": Family("histogram", "engine_decode_tokens_per_second", buckets="decode_tps"),
    "engine_queue": Family("histogram", "engine_queue_seconds", buckets="ttft"),
    # ---- pass-through routes (embeddings, responses, tokenize, ...: proxy/server/passthrough.py)
    "passthrough": Family("histogram", "passthrough_duration_seconds", ("engine", "model", "endpoint"), "e2e"),
    # ---- mirroring and comparison (primary vs shadow)
    "mirror": Family("counter", "mirror_requests", ("engine", "result")),
    "pairs": Family("counter", "compared_pairs", ("primary", "shadow")),
    "contended": Family("gauge", "pair_contended", ("primary", "shadow")),
    "token_mismatch": Family("counter", "token_count_mismatches", ("primary", "shadow", "kind")),
    "output_mismatch": Family("counter", "output_mismatches", ("primary", "shadow")),
    "finish_mismatch": Family("counter", "finish_reason_mismatches", ("primary", "shadow")),
    "token_delta": Family("histogram", "token_count_delta", ("primary", "shadow", "kind"), DELTA_BUCKETS),
    "ratio": Family("histogram", "shadow_ratio", ("primary", "shadow", "metric"), RATIO_BUCKETS),
    # ---- the live verdict (proxy.sequential.LiveVerdict per engine pair; docs/bench.md "Live traffic"): under
    # serve --workers each worker judges its own share of the pairs, the series are the most recently updated
    # worker's (its /health says the same)
    "live_pairs": Family("gauge", "live_pairs", LIVE, mode="livemostrecent"),
    "live_delta": Family("gauge", "live_delta_ratio", LIVE, mode="livemostrecent"),
    "live_low": Family("gauge", "live_interval_low_ratio", LIVE, mode="livemostrecent"),
    "live_high": Family("gauge", "live_interval_high_ratio", LIVE, mode="livemostrecent"),
    "live_decision": Family("gauge", "live_decision", (*LIVE, "decision"), mode="livemostrecent"),
    # ---- the event loop (proxy/server/record/loopwatch.py): a saturated proxy shows itself here
    "loop_lag": Family("histogram", "event_loop_lag_seconds", (), LOOP_BUCKETS),
    "queued": Family("gauge", "requests_queued", (), mode="livesum"),
    "handler_wait": Family("histogram", "request_queue_seconds", (), LOOP_BUCKETS),
    "gc_pause": Family("histogram", "gc_pause_seconds", ("generation",), LOOP_BUCKETS),
    # ---- a route's swap (proxy/server/switch/swaps.py): how long held requests waited for an engine
    "swap_wait": Family("histogram", "swap_wait_seconds", ("route",), SWAP_WAIT_BUCKETS),
    # ---- serve --workers N: written by the supervisor when a worker dies (0 in one process)
    "worker_lost": Family("counter", "worker_lost_requests", ("engine", "role")),
    "worker_restarts": Family("counter", "worker_restarts", ()),
    # ---- build
    "build": Family("gauge", "build_info", ("version",), mode="max"),
}

#: family name (after ``PREFIX``) -> its help text: ``FAMILIES``' in their order, then the rollout's
HELP = {
    "requests": "Requests by final outcome.",
    "in_flight_requests": "Requests in progress.",
    "time_to_first_token_seconds": "Client-felt TTFT: proxy received -> first token event.",
    "upstream_time_to_first_token_seconds": "Engine TTFT seen by the proxy: sent upstream -> first token event.",
    "upstream_headers_seconds": "Sent upstream -> upstream response headers.",
    "proxy_overhead_seconds": "Proxy received -> sent upstream (what the proxy adds before the engine sees the request, event-loop queueing included).",
    "proxy_delay_seconds": "Everything the proxy added to the client's time to first byte: received -> sent upstream, plus (streams) the engine's first event -> the client's first byte.",
    "inter_chunk_seconds": "Gap between consecutive token-carrying chunks (a chunk may carry several tokens).",
    "time_per_output_token_seconds": "(last token - first token) / (completion_tokens - 1).",
    "decode_tokens_per_second": "(completion_tokens - 1) / (last token - first token).",
    "request_duration_seconds": "Proxy received -> response finished, any outcome.",
    # every worker's ticks and the supervisor's add up to the whole proxy's seconds
    "traffic_seconds": "Seconds the proxy ran with this many generation requests in flight, over all its worker processes (level: 0, 1, 2, 3-4, 5-8, ..., 129+); counted when the number changes.",
    "request_prompt_tokens": "Prompt tokens per request (engine usage).",
    "request_completion_tokens": "Completion tokens per request (engine usage).",
    "prefill_tokens_per_second": "(prompt tokens - cached prompt tokens) / upstream TTFT: the engine's prefill rate, queueing included.",
    "finish_reasons": "Successful requests by finish reason (stop|length|tool_calls|other).",
    "prompt_tokens": "Prompt tokens (engine usage).",
    "completion_tokens": "Completion tokens (engine usage).",
    "cached_prompt_tokens": "Prompt tokens served from the engine's prompt cache.",
    "params": "Client params the proxy dropped, defaulted, renamed or changed for an engine.",
    "usage_events_stripped": "Usage events removed from client streams that did not ask for usage.",
    "reserialized_events": "Stream events the proxy had to re-serialize (not a plain byte rewrite).",
    "engine_prompt_seconds": "Engine-reported prompt processing time (llama.cpp timings.prompt_ms).",
    "engine_decode_tokens_per_second": "Engine-reported decode rate (llama.cpp timings.predicted_per_second).",
    "engine_queue_seconds": "Upstream TTFT minus engine-reported prompt time: time queued for a slot.",
    "passthrough_duration_seconds": "Pass-through requests: proxy received -> response finished, any outcome.",
    "mirror_requests": "Shadow copies by fate: sent, or dropped with a reason.",
    "compared_pairs": "Primary/shadow pairs compared.",
    "pair_contended": "1 while the last compared pair's primary and shadow held memory on the same GPU (their speeds compete), else 0.",
    "token_count_mismatches": "Pairs whose token counts differ (kind=prompt|completion).",
    "output_mismatches": "Greedy pairs whose output text differs.",
    "finish_reason_mismatches": "Pairs whose finish reasons differ.",
    "token_count_delta": "Shadow minus primary token count per pair.",
    "shadow_ratio": "Shadow / primary ratio per pair (metric=ttft|tpot|decode_tps).",
    "live_pairs": "Comparable mirrored pairs the live verdict has judged, per regime and metric.",
    "live_delta_ratio": "Live verdict: shadow / primary - 1 of the metric (geometric mean over pairs; below 0 the shadow is faster).",
    "live_interval_low_ratio": "Live verdict: the anytime-valid interval's lower end of the delta (NaN until bounded).",
    "live_interval_high_ratio": "Live verdict: the anytime-valid interval's upper end of the delta (NaN until bounded).",
    "live_decision": "Live verdict: 1 for the current decision of the stream (not_yet|faster|slower|tie: the shadow against the primary), 0 for the others.",
    "event_loop_lag_seconds": "How late a periodic timer on the event loop fired (every 0.1 s): how long the loop was busy elsewhere.",
    "requests_queued": "Requests whose head the server has parsed and whose handler has not started yet (waiting for the event loop).",
    "request_queue_seconds": "Request head parsed -> the proxy's handler started: time a request waited for the event loop.",
    "gc_pause_seconds": "Garbage-collector pauses of the proxy process, by generation (0|1|2).",
    # the two counters the --workers supervisor writes (proxy.server.workers.supervisor.SupervisorCounts)
    "worker_lost_requests": "Requests in flight in a worker process that died (serve --workers N), counted by the supervisor.",
    "worker_restarts": "Worker processes that died and were restarted (serve --workers N).",
    "swap_wait_seconds": "Seconds a request was held while its route swapped engines (served or refused at the end).",
    "build_info": "Always 1; labels carry the version.",
    # ---- a route's rollout, built at scrape time from its state (metrics.rollout_families)
    "rollout_share": "Share of the route's traffic the rollout sends to its candidate (0 after a rollback or abort, 1 once complete).",
    "rollout_step": "Index of the rollout's current step (0 = the first of rollout.steps).",
    "rollout_state": "1 for the rollout's current state (running|paused|rolled_back|aborted|complete), 0 for the others.",
    "rollout_cause": "1 for the cause of the current state: what a running step waits for (pairs|not_yet|requests|dwell), why it rolled back (slower|errors), who paused or aborted it (admin|config); none once complete.",
    "rollout_step_seconds": "Seconds since the rollout's current step (or state) began.",
    "rollout_step_pairs": "Comparable pairs judged at the current step, per regime (decode|load|long).",
    "rollout_step_attempts": "The candidate's attempts (served and mirrored) at the current step, by result (ok|error).",
    "rollout_rollbacks": "Rollbacks of the rollout, by cause: slower|errors (by itself), admin|config (aborted). Kept in the state file across restarts.",
    # ---- a route's swap, built at scrape time from its state (metrics.swap_families)
    "swap_phase": "1 for the swap's current phase (baseline|draining|stopping|launching|warming|watching|complete|reverting|rolled_back), 0 for the others.",
    "swap_phase_seconds": "Seconds since the swap's current phase began.",
    "swap_held_requests": "Requests held now because no engine of the route can take them (the swap's queue, every worker).",
    "swap_outage_seconds": "The last swap's outage: the baseline's last answer to the first answer of the engine that serves after it.",
    "swap_back_outage_seconds": "The last swap back's outage: the candidate's last answer to the baseline's first answer once it serves again.",
    "swap_rejected": "Requests answered 503 with Retry-After: the swap's queue was full or the request waited its longest.",
    "swap_hung_up": "Held requests whose client hung up before an engine could take them.",
    "swap_transitions": "Transitions of the swap, by the phase entered (every one also a serve console line and an event in the state). Kept in the state file across restarts.",
    "swap_rollbacks": "Swaps back to the baseline, by cause: drain_timeout|memory_not_returned|start_failed|died|errors|slower|aborted|restarted|damaged. Kept in the state file across restarts.",
}
