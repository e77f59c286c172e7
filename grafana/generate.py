"""Generate enginemeter's Grafana dashboards (and the Kubernetes copies of dashboards and rules) from plain dicts.

Source of truth: this file for dashboards, ``deploy/prometheus/rules/*.yml`` for rules. Outputs, all committed:

* ``grafana/dashboards/*.json``                        — provisioned by Grafana (compose, systemd hosts)
* ``deploy/kubernetes/base/dashboards/*.json``         — same bytes, for kustomize's configMapGenerator
  (kustomize refuses files outside the kustomization root, so the copy lives there)
* ``deploy/kubernetes/base/prometheusrule.yaml``       — the rule files wrapped in a PrometheusRule

Why plain dicts (the vLLM pattern) and not grafanalib / grafana-foundation-sdk: the JSON stays readable in review,
no dependency pins a Grafana schema flavour, and the only thing a library would check (field names) is covered by
the live test that runs every query against a real Prometheus. Minimum Grafana: 10.4 (schemaVersion 39).

    python grafana/generate.py           # rewrite the files
    python grafana/generate.py --check   # exit 1 if any committed file differs (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from grafana.panels import (  # noqa: E402
    ENG,
    FAILED,
    LENGTH,
    RATIO,
    RI,
    TOKS,
    Json,
    dashboard,
    datasource_var,
    heatmap,
    mean,
    pair_ratio,
    panel,
    q,
    query_var,
    rate,
    row,
    target,
)

DASH_DIR = ROOT / "grafana" / "dashboards"
K8S_DASH_DIR = ROOT / "deploy" / "kubernetes" / "base" / "dashboards"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
K8S_RULE = ROOT / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml"

# ------------------------------------------------------------------------------------------- dashboards

ER = "{{engine}} · {{role}}"


def engine_comparison() -> Json:
    lat = [
        panel("TTFT p50 / p95 / p99", "Client-felt time to first token (proxy received → first token event), per engine and role. Primary and shadow side by side: the shadow got the same prompt at the same moment.",
              [target(q(x, "enginemeter_time_to_first_token_seconds"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.95, 0.99)], "s"),
        panel("TPOT p50 / p95", "Time per output token after the first: (last − first token) / (completion tokens − 1).",
              [target(q(x, "enginemeter_time_per_output_token_seconds"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.95)], "s"),
        panel("Decode rate (proxy-measured) p50 / mean", "Tokens per second after the first token, measured by the proxy from chunk arrival times.",
              [target(q(0.5, "enginemeter_decode_tokens_per_second"), f"p50 {ER}"),
               target(mean("enginemeter_decode_tokens_per_second"), f"mean {ER}")], TOKS),
        panel("Inter-chunk gap p50 / p99", "Gap between consecutive token-carrying chunks. p99 shows stalls (batching hiccups, preemption) that averages hide.",
              [target(q(x, "enginemeter_inter_chunk_seconds"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.99)], "s"),
        panel("End-to-end duration p50 / p95 / p99", "Proxy received → response finished, any outcome.",
              [target(q(x, "enginemeter_request_duration_seconds"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.95, 0.99)], "s"),
        panel("Proxy overhead p50 / p99", "Proxy received → request sent upstream: what enginemeter itself adds before the engine sees the request.",
              [target(q(x, "enginemeter_proxy_overhead_seconds"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.99)], "s"),
        panel("Proxy delay p50 / p99", "Everything enginemeter added to the client's time to first byte: received → sent upstream (waiting for the event loop included), plus for streams the engine's first event → the client's first byte. Each response also says its own share in its Server-Timing header.",
              [target(q(x, "enginemeter_proxy_delay_seconds"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.99)], "s"),
        panel("Prefill speed p50 / p10", "(prompt − cached prompt tokens) / upstream TTFT: uncached prompt tokens the engine prefilled per second before its first token. A lower bound (queueing is in the denominator); p10 is the slow tail. On long prompts the figure that most separates llama.cpp from SGLang and vLLM.",
              [target(q(x, "enginemeter_prefill_tokens_per_second"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.1)], TOKS, w=24),
    ]  # fmt: skip
    thr = [
        panel("Output tokens / s", "Completion tokens per second (engine-reported usage), summed over replicas.",
              [target(rate("enginemeter_completion_tokens_total"), ER)], TOKS),
        panel("Prompt tokens / s", "Prompt tokens per second (engine usage), and the part served from the prompt cache.",
              [target(rate("enginemeter_prompt_tokens_total"), f"prompt {ER}"),
               target(rate("enginemeter_cached_prompt_tokens_total"), f"cached {ER}")], TOKS),
        panel("Requests / s by outcome", "Finished requests per second by engine, role and outcome (ok, engine_error, timeout, …).",
              [target(rate("enginemeter_requests_total", "engine, role, outcome"), "{{engine}} · {{role}} · {{outcome}}")], "reqps"),
        panel("Failed share", "Share of requests that did not end ok (client disconnects and requests the proxy rejected excluded).",
              [target(f"{rate('enginemeter_requests_total', sel=FAILED)} / ({rate('enginemeter_requests_total')} > 0)", ER)],
              "percentunit", min_=0),
        panel("In flight", "Requests in progress right now, summed over replicas.",
              [target(f"sum by (engine, role) (enginemeter_in_flight_requests{{{ENG}}})", ER)], "short", min_=0),
        panel("Cached-prompt share", "Share of prompt tokens the engine served from its prompt cache. A gap between engines means TTFT comparisons are not like for like. Needs SGLang --enable-cache-report and vLLM --enable-prompt-tokens-details.",
              [target(f"{rate('enginemeter_cached_prompt_tokens_total')} / ({rate('enginemeter_prompt_tokens_total')} > 0)", ER)],
              "percentunit", min_=0, max_=1),
        panel("Finish reasons / s", "Successful requests by why the answer ended: stop (the model finished), length (cut at max_tokens or the context), tool_calls, other (abort, content filter, none reported).",
              [target(rate("enginemeter_finish_reasons_total", "engine, role, reason"), "{{engine}} · {{role}} · {{reason}}")], "reqps", w=12),
        panel("Truncated share (finish reason length)", "Share of successful answers cut off at max_tokens or the context. An engine that truncates more produces shorter answers: its per-request latency looks better than it is.",
              [target(f"{rate('enginemeter_finish_reasons_total', sel=LENGTH)} / ({rate('enginemeter_finish_reasons_total')} > 0)", ER)],
              "percentunit", w=12, min_=0, max_=1),
    ]  # fmt: skip
    mirror = [
        panel("Token-count mismatch rate", "Share of compared primary/shadow pairs whose prompt or completion token counts differ (tokenizer or chat-template drift).",
              [target(pair_ratio("enginemeter_token_count_mismatches_total", "primary, shadow, kind"), "{{primary}} vs {{shadow}} · {{kind}}")],
              "percentunit", min_=0, max_=1),
        panel("Output mismatch rate", "Share of greedy pairs whose output text differs, and of pairs whose finish reasons differ.",
              [target(pair_ratio("enginemeter_output_mismatches_total"), "text {{primary}} vs {{shadow}}"),
               target(pair_ratio("enginemeter_finish_reason_mismatches_total"), "finish {{primary}} vs {{shadow}}")],
              "percentunit", min_=0, max_=1),
        panel("Shadow / primary ratio p50", "Per pair: shadow value / primary value for TTFT, TPOT and decode rate. Above 1 for ttft/tpot means the shadow is slower.",
              [target(q(0.5, "enginemeter_shadow_ratio", "primary, shadow, metric", sel=""), "{{metric}} {{shadow}}/{{primary}}")], RATIO),
        panel("Token-count delta p5 / p95", "Shadow minus primary token count per pair.",
              [target(q(x, "enginemeter_token_count_delta", "primary, shadow, kind", sel=""), f"p{int(x * 100)} {{{{kind}}}}") for x in (0.05, 0.95)], "short"),
        panel("Mirror copies / s by fate", "Shadow copies sent, or dropped (queue full, sampled out, …).",
              [target(f"sum by (engine, result) (rate(enginemeter_mirror_requests_total{{{ENG}}}[{RI}]))", "{{engine}} · {{result}}")], "reqps"),
        panel("Compared pairs / s", "Primary/shadow pairs the comparison stage saw.",
              [target(f"sum by (primary, shadow) (rate(enginemeter_compared_pairs_total[{RI}]))", "{{primary}} vs {{shadow}}")], "reqps"),
        panel("Live verdict: shadow vs primary", "The live verdict per regime and metric: shadow / primary - 1 (below 0: the shadow takes less time) with its anytime-valid interval, safe to look at after every pair. A decision is made when the interval clears the minimum effect (docs/bench.md, Live traffic).",
              [target("max by (primary, shadow, regime, metric) (enginemeter_live_delta_ratio)", "Δ {{shadow}} vs {{primary}} · {{regime}} {{metric}}"),
               target("max by (primary, shadow, regime, metric) (enginemeter_live_interval_low_ratio)", "low {{shadow}} vs {{primary}} · {{regime}} {{metric}}"),
               target("max by (primary, shadow, regime, metric) (enginemeter_live_interval_high_ratio)", "high {{shadow}} vs {{primary}} · {{regime}} {{metric}}")],
              "percentunit", w=16),
        panel("Live decisions", "The current decision of each stream of the live verdict (not_yet, faster, slower, tie: the shadow against the primary) and the pairs it rests on.",
              [target("max by (primary, shadow, regime, metric, decision) (enginemeter_live_decision) == 1", "{{shadow}} vs {{primary}} · {{regime}} {{metric}}: {{decision}}"),
               target("max by (primary, shadow, regime, metric) (enginemeter_live_pairs)", "pairs {{shadow}} vs {{primary}} · {{regime}} {{metric}}")],
              "short", w=8),
    ]  # fmt: skip
    rollout = [
        panel("Rollout share", "Share of each rollout route's unpinned traffic sent to its candidate (routes[].rollout, docs/routing.md#rollout): it climbs through the steps while the live verdict on the step's pairs finds the candidate not slower and its errors within budget; 0 after a rollback or an abort, 1 once complete.",
              [target("max by (route, baseline, candidate) (enginemeter_rollout_share)", "route {{route}}: {{candidate}} (from {{baseline}})")],
              "percentunit", w=8, min_=0, max_=1),
        panel("Rollout state and cause", "The current state (running, paused, rolled_back, aborted, complete) and its cause: what a running step waits for (pairs, not_yet, requests, dwell), why it rolled back (slower, errors), who paused or aborted it (admin, config). /admin/rollout and /health say more, in words.",
              [target("max by (route, state) (enginemeter_rollout_state) == 1", "route {{route}}: {{state}}"),
               target("max by (route, cause) (enginemeter_rollout_cause) == 1", "route {{route}} cause: {{cause}}"),
               target("max by (route) (enginemeter_rollout_step)", "route {{route}} step")], "short", w=8, min_=0),
        panel("Rollbacks", "Rollbacks per route and cause since the rollout's state file began: slower and errors are the rollout's own (alert EnginemeterRolloutRolledBack), admin and config are aborts.",
              [target("max by (route, cause) (enginemeter_rollout_rollbacks_total)", "route {{route}}: {{cause}}")],
              "short", w=8, min_=0),
        panel("Rollout step: pairs and the candidate's attempts", "What the current step has judged: comparable pairs per regime (the test needs rollout.min_pairs in each exercised one), and the candidate's attempts there (served and mirrored) by result, against rollout.error_budget.",
              [target("max by (route, regime) (enginemeter_rollout_step_pairs)", "route {{route}} pairs · {{regime}}"),
               target("max by (route, result) (enginemeter_rollout_step_attempts)", "route {{route}} attempts · {{result}}")],
              "short", w=16, min_=0),
        panel("Time at the step", "Seconds since the current step (or state) began; a step advances after rollout.min_dwell_s at least.",
              [target("max by (route) (enginemeter_rollout_step_seconds)", "route {{route}}")], "s", w=8, min_=0),
    ]  # fmt: skip
    loop = [
        panel("Event-loop lag p50 / p99", "How late the proxy's 0.1 s timer fired, per replica (its workers merged): how long its event loop was busy elsewhere, and so how long every stream's next chunk waited. An idle loop shows 0–1 ms (libuv's timer grain); EnginemeterEventLoopSaturated fires above 50 ms (p99 over 5 minutes).",
              [target(q(x, "enginemeter_event_loop_lag_seconds", "instance", sel=""), f"p{int(x * 100)} {{{{instance}}}}") for x in (0.5, 0.99)],
              "s", min_=0, thresholds=[(None, "green"), (0.05, "red")]),
        panel("Requests waiting for the loop", "Requests whose head the server has parsed and whose handler has not started (or pipelined behind the request before them), and how long requests waited before their handler ran (p99). Both stay near 0 on a proxy with CPU to spare.",
              [target("sum by (instance) (enginemeter_requests_queued)", "queued {{instance}}"),
               target(q(0.99, "enginemeter_request_queue_seconds", "instance", sel=""), "wait p99 {{instance}}")], "short", min_=0),
        panel("GC pauses p99 by generation", "Garbage-collector pauses of the proxy processes (enginemeter serve freezes its start-up objects, so a full collection scans only what was made since).",
              [target(q(0.99, "enginemeter_gc_pause_seconds", "instance, generation", sel=""), "gen {{generation}} {{instance}}")], "s", min_=0),
        panel("GC collections / s", "Collections per second and generation.",
              [target(f"sum by (instance, generation) (rate(enginemeter_gc_pause_seconds_count[{RI}]))", "gen {{generation}} {{instance}}")], "short", min_=0),
    ]  # fmt: skip
    engine = [
        panel("Engine queue depth", "Requests waiting inside each engine, from its own /metrics: llama.cpp requests_deferred (no free slot), SGLang num_queue_reqs, vLLM num_requests_waiting. A queue that stays above 0 means more slots, a bigger KV pool or more replicas.",
              [target(f"sum by (engine) (llamacpp:requests_deferred{{{ENG}}})", "{{engine}} deferred (llama.cpp)"),
               target(f"sum by (engine) (sglang:num_queue_reqs{{{ENG}}})", "{{engine}} queued (SGLang)"),
               target(f"sum by (engine) (vllm:num_requests_waiting{{{ENG}}})", "{{engine}} waiting (vLLM)")], "short", min_=0),
        panel("Engine running requests", "Requests each engine is running now (llama.cpp requests_processing, SGLang num_running_reqs, vLLM num_requests_running) against the slots the proxy polled (llama.cpp -np, SGLang max running requests).",
              [target(f"sum by (engine) (llamacpp:requests_processing{{{ENG}}})", "{{engine}} running (llama.cpp)"),
               target(f"sum by (engine) (sglang:num_running_reqs{{{ENG}}})", "{{engine}} running (SGLang)"),
               target(f"sum by (engine) (vllm:num_requests_running{{{ENG}}})", "{{engine}} running (vLLM)"),
               target(f"max by (engine) (enginemeter_engine_slots{{{ENG}}})", "{{engine}} slots")], "short", min_=0),
        panel("KV-cache use", "Share of the engine's preallocated KV pool in use: SGLang token_usage, vLLM kv_cache_usage_perc. The pool itself is ~0.9 of the card by design; full here means queueing and preemption (alert EnginemeterKVCachePressure above 0.9 for 10 min). llama.cpp has no KV gauge: its line is the longest sequence so far over the per-slot context (a high-water mark).",
              [target(f"max by (engine) (sglang:token_usage{{{ENG}}})", "{{engine}} (SGLang)"),
               target(f"max by (engine) (vllm:kv_cache_usage_perc{{{ENG}}})", "{{engine}} (vLLM)"),
               target(f"max by (engine) (llamacpp:n_tokens_max{{{ENG}}}) / on (engine) (max by (engine) (enginemeter_engine_context_length{{{ENG}}}) > 0)",
                      "{{engine}} longest sequence / slot context (llama.cpp)")],
              "percentunit", min_=0, max_=1, thresholds=[(None, "green"), (0.9, "red")]),
        panel("Engine-native generated tokens / s", "From the engines' own /metrics (llama-server --metrics, SGLang --enable-metrics, vLLM), not from the proxy: a cross-check of the proxy's count that also shows traffic bypassing the proxy.",
              [target(f"sum by (engine) (rate(llamacpp:tokens_predicted_total{{{ENG}}}[{RI}]))", "{{engine}} (llama.cpp)"),
               target(f"sum by (engine) (rate(sglang:generation_tokens_total{{{ENG}}}[{RI}]))", "{{engine}} (SGLang)"),
               target(f"sum by (engine) (rate(vllm:generation_tokens_total{{{ENG}}}[{RI}]))", "{{engine}} (vLLM)")], TOKS),
        panel("Decode rate: engine-reported vs proxy-measured", "p50 of llama.cpp's own timings.predicted_per_second next to the proxy's measurement. A large gap means the proxy or the network path is slowing the stream.",
              [target(q(0.5, "enginemeter_engine_decode_tokens_per_second", "engine"), "engine-reported {{engine}}"),
               target(q(0.5, "enginemeter_decode_tokens_per_second", "engine"), "proxy-measured {{engine}}")], TOKS),
        panel("Engine queue time p50 / p95", "Upstream TTFT minus engine-reported prompt time: how long requests wait for a slot.",
              [target(q(x, "enginemeter_engine_queue_seconds"), f"p{int(x * 100)} {ER}") for x in (0.5, 0.95)], "s"),
        panel("Slots busy / total", "Busy slots against the engine's parallel slots (llama.cpp -np, SGLang max running requests), as the proxy's state poll sees them.",
              [target(f"sum by (engine) (enginemeter_engine_busy_slots{{{ENG}}})", "busy {{engine}}"),
               target(f"max by (engine) (enginemeter_engine_slots{{{ENG}}})", "slots {{engine}}")], "short", w=24, min_=0),
    ]  # fmt: skip
    dist = [
        heatmap("TTFT distribution · $engine", "Time to first token of successful streams, per bucket over time: bimodal cells (cache hits vs misses, short vs long prompts) that p50/p99 lines hide.",
                "enginemeter_time_to_first_token_seconds", "s"),
        heatmap("Inter-chunk gap distribution · $engine", "Gaps between token-carrying chunks: a band at the decode step (4–5 ms for a 7B on an H200), stalls above it.",
                "enginemeter_inter_chunk_seconds", "s"),
        heatmap("End-to-end duration distribution · $engine", "Proxy received → response finished, every outcome.",
                "enginemeter_request_duration_seconds", "s"),
        heatmap("Prefill speed distribution · $engine", "(prompt − cached tokens) / upstream TTFT per request, tokens/s.",
                "enginemeter_prefill_tokens_per_second", TOKS),
        heatmap("Prompt tokens distribution · $engine", "Prompt length per request (engine usage): the load shape behind every latency figure.",
                "enginemeter_request_prompt_tokens", "short"),
        heatmap("Completion tokens distribution · $engine", "Completion length per request (engine usage).",
                "enginemeter_request_completion_tokens", "short"),
    ]  # fmt: skip
    gpu = [
        panel("GPU memory per GPU", "Used and total memory of each GPU on the proxy's host (NVML). Absent, not zero, on hosts without NVML.",
              [target("max by (gpu) (enginemeter_gpu_memory_used_bytes)", "used gpu {{gpu}}"),
               target("max by (gpu) (enginemeter_gpu_memory_total_bytes)", "total gpu {{gpu}}")], "bytes", w=8, min_=0),
        panel("GPU memory per engine (with peak)", "Memory held by each engine's processes on each GPU, and the peak since the proxy started. vLLM and SGLang take ~0.9 of the card at start by design (--gpu-memory-utilization, --mem-fraction-static): a flat high line is their preallocated pool, see KV-cache use for how full it is.",
              [target(f"max by (engine, gpu) (enginemeter_engine_gpu_memory_used_bytes{{{ENG}}})", "{{engine}} gpu {{gpu}}"),
               target(f"max by (engine, gpu) (enginemeter_engine_gpu_memory_peak_bytes{{{ENG}}})", "peak {{engine}} gpu {{gpu}}")], "bytes", w=8, min_=0),
        panel("GPU utilization", "Share of time a kernel was running, per GPU.",
              [target("max by (gpu) (enginemeter_gpu_utilization_ratio)", "gpu {{gpu}}")], "percentunit", w=8, min_=0, max_=1),
    ]  # fmt: skip
    diagnosis = [
        panel("Layers on the GPU", "llama.cpp engines on the proxy's host: layers offloaded to the GPU out of all (the output layer counted), from the engine's log (`offloaded N/M layers to GPU`; llama.cpp 11434 logs it at -lv 4). Below all: the rest run on the CPU (docs/diagnose.md).",
              [target(f"max by (engine) (enginemeter_engine_layers_offloaded{{{ENG}}})", "offloaded {{engine}}", instant=True),
               target(f"max by (engine) (enginemeter_engine_layers{{{ENG}}})", "of {{engine}}", instant=True)],
              "short", kind="stat", w=6),
        panel("Model weights and KV cache", "Weights (the GGUF header) and the KV cache the engine allocated (its log, else 2 × layers × KV heads × head dim × context × bytes). Compare the weights with the GPU memory per engine panel: well below means not resident.",
              [target(f"max by (engine) (enginemeter_engine_weights_bytes{{{ENG}}})", "weights {{engine}}"),
               target(f"max by (engine) (enginemeter_engine_kv_cache_bytes{{{ENG}}})", "KV cache {{engine}}")], "bytes", w=6, min_=0),
        panel("Model load time", "Seconds from `loading model` to `model loaded` in the engine's log.",
              [target(f"max by (engine) (enginemeter_engine_load_seconds{{{ENG}}})", "{{engine}}", instant=True)], "s", kind="stat", w=6),
        panel("GPU headroom per engine", "Free memory on the GPUs each engine's processes use (NVML). Much free with a slow engine: memory is not the constraint — tune batching and slots, or compare engines.",
              [target(f"max by (engine) (enginemeter_engine_gpu_headroom_bytes{{{ENG}}})", "{{engine}}")], "bytes", w=6, min_=0),
    ]  # fmt: skip
    info = [
        panel("Engine info", "What each engine reports about itself: kind, served model and the rest of enginemeter_engine_info's labels.",
              [target(f"max by (engine, kind, model, quantization, build) (enginemeter_engine_info{{{ENG}}})", instant=True, fmt="table")], "none", kind="table", w=8,
              transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}]),
        panel("Engine up and context length", "Engine health as the proxy sees it (1 = up) and its context length in tokens.",
              [target(f"max by (engine) (enginemeter_engine_up{{{ENG}}})", "up {{engine}}", instant=True),
               target(f"max by (engine) (enginemeter_engine_context_length{{{ENG}}})", "context {{engine}}", instant=True)],
              "short", kind="stat", w=8, thresholds=[(None, "red"), (1, "green")]),
        panel("Route drift", "Per route and field: 1 when primary and shadow disagree on something that makes the comparison unfair (model, context, sampling defaults, …).",
              [target("max by (route, field) (enginemeter_route_drift)", "{{route}} · {{field}}")], "short", w=8, min_=0,
              thresholds=[(None, "green"), (1, "red")]),
    ]  # fmt: skip
    return dashboard(
        "enginemeter-compare",
        "enginemeter · Engine comparison",
        "Primary vs shadow engines side by side, from the enginemeter proxy's measurements.",
        [
            datasource_var(),
            query_var("engine", "Engine", "label_values(enginemeter_in_flight_requests, engine)"),
            query_var("model", "Model", 'label_values(enginemeter_requests_total{engine=~"$engine"}, model)'),
        ],
        [
            row("Latency"),
            *lat,
            row("Proxy event loop"),
            *loop,
            row("Throughput and outcomes"),
            *thr,
            row("Primary vs shadow"),
            *mirror,
            row("Rollout"),
            *rollout,
            row("Engine internals"),
            *engine,
            row("Distributions · $engine", repeat="engine"),
            *dist,
            row("GPU"),
            *gpu,
            row("Engine diagnosis (llama.cpp)"),
            *diagnosis,
            row("Engine info and drift"),
            *info,
        ],
    )


def overview() -> Json:
    """The wall screen: recording rules only (cheap to refresh), summed across replicas, no engine filter."""
    stats = [
        panel("Requests / s", "All finished requests per second, all replicas.",
              [target("sum(engine_model_role:enginemeter_requests:rate5m)", "req/s")], "reqps", kind="stat", w=4, h=5),
        panel("Failed share", "Requests that did not end ok (client disconnects and rejected requests excluded), all engines.",
              [target("sum(engine_model_role:enginemeter_requests_failed:rate5m) / (sum(engine_model_role:enginemeter_requests:rate5m) > 0)", "failed")],
              "percentunit", kind="stat", w=4, h=5, thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")]),
        panel("Output tokens / s", "Completion tokens per second, all engines and replicas.",
              [target("sum(engine_model_role:enginemeter_completion_tokens:rate5m)", "tok/s")], TOKS, kind="stat", w=4, h=5),
        panel("In flight", "Requests in progress on all replicas.",
              [target("sum(enginemeter_in_flight_requests)", "in flight")], "short", kind="stat", w=4, h=5),
        panel("Engines up", "Engine scrape targets answering (Prometheus `up`) out of all configured.",
              [target('sum(up{job=~"llamacpp|sglang|vllm"})', "up"), target('count(up{job=~"llamacpp|sglang|vllm"})', "configured")],
              "short", kind="stat", w=4, h=5),
        panel("Alerts firing", "enginemeter alerts currently firing.",
              [target('count(ALERTS{alertstate="firing", alertname=~"Enginemeter.*"}) or vector(0)', "firing")],
              "short", kind="stat", w=4, h=5, thresholds=[(None, "green"), (1, "red")]),
    ]  # fmt: skip
    series_loop = [
        panel("Proxy event-loop lag p99 by replica", "Recorded p99 of how late each replica's 0.1 s timer fired over 5 minutes: a saturated proxy shows here first (EnginemeterEventLoopSaturated above 50 ms). An idle loop shows 0–1 ms.",
              [target("max by (instance) (instance:enginemeter_event_loop_lag_seconds:p99_5m)", "{{instance}}")], "s", w=8, min_=0,
              thresholds=[(None, "green"), (0.05, "red")]),
    ]  # fmt: skip
    series = [
        panel("TTFT p95 by engine", "Recorded p95 time to first token over 5 minutes, per engine and role.",
              [target("max by (engine, role) (engine_model_role:enginemeter_time_to_first_token_seconds:p95_5m)", ER)], "s", w=8),
        panel("TPOT p95 by engine", "Recorded p95 time per output token over 5 minutes.",
              [target("max by (engine, role) (engine_model_role:enginemeter_time_per_output_token_seconds:p95_5m)", ER)], "s", w=8),
        panel("E2E p95 by engine", "Recorded p95 request duration over 5 minutes.",
              [target("max by (engine, role) (engine_model_role:enginemeter_request_duration_seconds:p95_5m)", ER)], "s", w=8),
        panel("Output tokens / s by engine", "Recorded completion-token rate per engine and role.",
              [target("sum by (engine, role) (engine_model_role:enginemeter_completion_tokens:rate5m)", ER)], TOKS, w=8),
        panel("Shadow / primary TTFT and TPOT ratio", "Recorded p50 of the per-pair shadow/primary ratio. The ShadowSlowerThanPrimary alert fires above 1.5 for 10 minutes.",
              [target('primary_shadow_metric:enginemeter_shadow_ratio:p50_5m{metric=~"ttft|tpot"}', "{{metric}} {{shadow}}/{{primary}}")], RATIO, w=8,
              thresholds=[(None, "green"), (1.5, "red")]),
        panel("Mismatch rates", "Recorded share of pairs whose token counts (per kind) or greedy output texts differ.",
              [target("primary_shadow_kind:enginemeter_token_count_mismatches:ratio_rate5m", "{{primary}} vs {{shadow}} · {{kind}}"),
               target("primary_shadow:enginemeter_output_mismatches:ratio_rate5m", "text {{primary}} vs {{shadow}}")], "percentunit", w=8, min_=0, max_=1),
        panel("Requests / s per replica", "Finished requests per proxy replica: uneven lines mean the load balancer is not spreading load.",
              [target(f'sum by (instance) (rate(enginemeter_requests_total{{job="enginemeter"}}[{RI}]))', "{{instance}}")], "reqps", w=8),
        panel("GPU memory used share", "Used / total memory per GPU on every proxy host. ~0.9 is vLLM/SGLang preallocation by design; GPUMemoryNearFull fires above 98 %.",
              [target("max by (instance, gpu) (enginemeter_gpu_memory_used_bytes / enginemeter_gpu_memory_total_bytes)", "{{instance}} gpu {{gpu}}")],
              "percentunit", w=8, min_=0, max_=1, thresholds=[(None, "green"), (0.98, "red")]),
        panel("KV-cache use by engine", "Recorded share of each SGLang/vLLM engine's KV pool in use. KVCachePressure fires above 90 % for 10 minutes.",
              [target("engine:kv_cache_usage:ratio", "{{engine}}")], "percentunit", w=8, min_=0, max_=1,
              thresholds=[(None, "green"), (0.9, "red")]),
        panel("Versions", "enginemeter build per replica: during a rollout two versions show up.",
              [target('count by (version) (enginemeter_build_info{job="enginemeter"})', instant=True, fmt="table")], "none", kind="table", w=8),
    ]  # fmt: skip
    return dashboard(
        "enginemeter-overview",
        "enginemeter · Overview",
        "Wall screen: load, errors, latency and primary/shadow agreement across all replicas and engines.",
        [datasource_var()],
        [row("Now"), *stats, row("Trends"), *series, *series_loop],
    )


DASHBOARDS = {"engine-comparison.json": engine_comparison, "overview.json": overview}


# ------------------------------------------------------------------------------------------- rules for kubernetes


def prometheus_rule() -> str:
    groups: list[Json] = []
    for f in sorted(RULES_DIR.glob("*.yml")):
        groups.extend(yaml.safe_load(f.read_text())["groups"])
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "enginemeter",
            "labels": {"app.kubernetes.io/name": "enginemeter", "release": "prometheus"},
        },
        "spec": {"groups": groups},
    }
    head = "# Generated by grafana/generate.py from deploy/prometheus/rules/*.yml — do not edit.\n"
    return head + yaml.safe_dump(doc, sort_keys=False, width=1000, allow_unicode=True)


def outputs() -> Iterator[tuple[Path, str]]:
    for name, build in DASHBOARDS.items():
        text = json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        yield DASH_DIR / name, text
        yield K8S_DASH_DIR / name, text
    yield K8S_RULE, prometheus_rule()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if a committed file is not what the generator makes")
    args = ap.parse_args(argv)
    stale = []
    for path, text in outputs():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path.relative_to(ROOT))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("out of date (run python grafana/generate.py):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
