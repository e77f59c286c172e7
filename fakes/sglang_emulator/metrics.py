"""SGLang's Prometheus metrics (``metrics_collector.py``), fed by the emulator's requests."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from fakes.sglang_emulator.engine import SGLangEmulator

# metrics_collector.py defaults
TTFT_BUCKETS: Final = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS: Final = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS: Final = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
    0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
THROUGHPUT_WINDOW_S: Final = 5.0


class _Hist:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        buckets, total = self.series.setdefault(labels, ([0] * (len(self.bounds) + 1), [0.0]))
        buckets[bisect.bisect_left(self.bounds, value)] += count
        total[0] += value * count

    def family(self, name: str, doc: str, labelnames: list[str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=labelnames)
        for labels, (buckets, total) in self.series.items():
            cumulative, acc = [], 0
            for bound, n in zip((*self.bounds, float("inf")), buckets, strict=True):
                acc += n
                cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(acc)))
            fam.add_metric(list(labels), cumulative, total[0])
        return fam


@dataclass(slots=True)
class _Counters:
    values: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, labels: tuple[str, ...], value: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + value

    def family(self, name: str, doc: str, labelnames: list[str]) -> CounterMetricFamily:
        fam = CounterMetricFamily(name, doc, labels=labelnames)
        for labels, value in self.values.items():
            fam.add_metric(list(labels), value)
        return fam


class _Metrics(Collector):
    """SGLang's metric names, fed by the emulator's requests; rendered without ``_created`` series,
    as SGLang's multiprocess registry does."""

    def __init__(self, engine: SGLangEmulator) -> None:
        self.engine = engine
        self.ttft = _Hist(TTFT_BUCKETS)
        self.itl = _Hist(ITL_BUCKETS)
        self.tpot = _Hist(ITL_BUCKETS)
        self.e2e = _Hist(E2E_BUCKETS)
        self.prompt_tokens = _Counters()
        self.generation_tokens = _Counters()
        self.cached_tokens = _Counters()
        self.num_requests = _Counters()
        self.num_aborted = _Counters()
        self.recent_tokens: deque[tuple[float, int]] = deque()  # (monotonic s, new tokens)
        self.recent_finished: deque[tuple[float, int, int]] = deque()  # (monotonic s, prompt, cached)

    @property
    def base(self) -> tuple[str, str]:
        return (self.engine.served_model_name, "unified")

    def _trim(self, now: float) -> None:
        for q in (self.recent_tokens, self.recent_finished):
            while q and q[0][0] < now - THROUGHPUT_WINDOW_S:
                q.popleft()

    def on_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.recent_tokens.append((now, n))
        self._trim(now)

    def on_finished(self, stream: bool, prompt: int, generated: int, cached: int, e2e_s: float) -> None:
        labels = (*self.base, "true" if stream else "false")
        self.prompt_tokens.inc(labels, prompt)
        self.generation_tokens.inc(labels, generated)
        self.num_requests.inc(labels)
        if cached > 0:
            self.cached_tokens.inc((*self.base, "total"), cached)
        self.e2e.observe(labels, e2e_s)
        self.recent_finished.append((time.monotonic(), prompt, cached))

    def collect(self) -> Iterator[Metric]:
        base = ["model_name", "engine_type"]
        stream = [*base, "is_streaming"]
        yield self.ttft.family(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stream
        )
        yield self.itl.family(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", base
        )
        yield self.tpot.family(
            "sglang:request_time_per_output_token_seconds",
            "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
            stream,
        )
        yield self.e2e.family(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", stream
        )
        yield self.prompt_tokens.family("sglang:prompt_tokens", "Number of prefill tokens processed.", stream)
        yield self.generation_tokens.family(
            "sglang:generation_tokens", "Number of generation tokens processed.", stream
        )
        yield self.cached_tokens.family(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*base, "cache_source"],
        )
        yield self.num_requests.family("sglang:num_requests", "Number of requests processed.", stream)
        yield self.num_aborted.family("sglang:num_aborted_requests", "Number of requests aborted.", base)
        yield from self._scheduler_gauges()

    def _scheduler_gauges(self) -> Iterator[Metric]:
        engine = self.engine
        now = time.monotonic()
        self._trim(now)
        labelnames = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
        labels = [*self.base, "0", "0", "0"]
        running = min(engine.inflight, engine.max_running_requests)
        prompt = sum(p for _, p, _ in self.recent_finished)
        cached = sum(c for _, _, c in self.recent_finished)
        max_total = engine.context_length * engine.max_running_requests
        values = {
            "num_running_reqs": ("The number of running requests.", running),
            "num_queue_reqs": ("The number of requests in the waiting queue.", engine.inflight - running),
            "gen_throughput": (
                "The generation throughput (token/s).",
                sum(n for _, n in self.recent_tokens) / THROUGHPUT_WINDOW_S,
            ),
            "cache_hit_rate": ("The prefix cache hit rate.", cached / prompt if prompt else 0.0),
            "token_usage": ("The token usage.", engine.live_tokens / max_total if max_total else 0.0),
            "num_used_tokens": ("The number of used tokens.", engine.live_tokens),
            "max_total_num_tokens": ("Maximum total number of tokens in the KV cache pool.", max_total),
            "context_len": ("The context length.", engine.context_length),
        }
        for name, (doc, value) in values.items():
            gauge = GaugeMetricFamily(f"sglang:{name}", doc, labels=labelnames)
            gauge.add_metric(labels, float(value))
            yield gauge
