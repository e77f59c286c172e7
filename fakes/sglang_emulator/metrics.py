"""SGLang's Prometheus metrics (``metrics_collector.py``), fed by the emulator's requests.

The families are those real SGLang 0.5.17 served on the H200 (tests/fixtures/engines/sglang-0.5.17/
metrics_after.txt) that the emulator can fill honestly — a subset of its 69, with its names, label sets and
buckets; 0.5.23 adds ``request_time_per_output_token_seconds`` and ``num_aborted_requests_total`` (its source).
Scheduler gauges show what the engine last published (``SGLangEmulator.published_now``), not the live count.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_go_float = cast(Callable[[float], str], floatToGoString)  # prometheus_client leaves it untyped

if TYPE_CHECKING:
    from fakes.sglang_emulator.engine import SGLangEmulator

# metrics_collector.py defaults
TTFT_BUCKETS: Final = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS: Final = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS: Final = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
    0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
#: prompt/generation token histograms, as 0.5.17 served them
TOKENS_BUCKETS: Final = (
    100.0, 300.0, 500.0, 700.0, 1000.0, 1500.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0, 7000.0, 8000.0,
    9000.0, 10000.0, 12500.0, 15000.0, 17500.0, 20000.0, 22500.0, 25000.0, 27500.0, 30000.0, 35000.0, 40000.0,
    60000.0, 80000.0, 100000.0, 200000.0, 300000.0, 400000.0, 600000.0, 800000.0, 1e6, 1.1e6,
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
                cumulative.append((_go_float(bound), float(acc)))
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
        self.prompt_hist = _Hist(TOKENS_BUCKETS)
        self.uncached_hist = _Hist(TOKENS_BUCKETS)
        self.generation_hist = _Hist(TOKENS_BUCKETS)
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

    def recent_throughput(self) -> float:
        self._trim(time.monotonic())
        return sum(n for _, n in self.recent_tokens) / THROUGHPUT_WINDOW_S

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
            self.cached_tokens.inc((*self.base, "device"), cached)
        self.e2e.observe(labels, e2e_s)
        self.prompt_hist.observe(self.base, prompt)
        self.uncached_hist.observe(self.base, prompt - cached)
        self.generation_hist.observe(self.base, generated)
        self.recent_finished.append((time.monotonic(), prompt, cached))

    def collect(self) -> Iterator[Metric]:
        base = ["model_name", "engine_type"]
        stream = [*base, "is_streaming"]
        newer = not self.engine.config.v0517
        yield self.ttft.family(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stream
        )
        yield self.itl.family(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", base
        )
        if newer:
            yield self.tpot.family(
                "sglang:request_time_per_output_token_seconds",
                "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
                stream,
            )
        yield self.e2e.family(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", stream
        )
        yield self.prompt_hist.family("sglang:prompt_tokens_histogram", "Histogram of prompt token length.", base)
        yield self.uncached_hist.family(
            "sglang:uncached_prompt_tokens_histogram", "Histogram of uncached (compute) prompt token length.", base
        )
        yield self.generation_hist.family(
            "sglang:generation_tokens_histogram", "Histogram of generation token length.", base
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
        if newer:
            yield self.num_aborted.family("sglang:num_aborted_requests", "Number of requests aborted.", base)
        yield from self._scheduler_gauges()

    def _scheduler_gauges(self) -> Iterator[Metric]:
        engine = self.engine
        now = time.monotonic()
        self._trim(now)
        labelnames = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
        labels = [*self.base, "0", "0", "0"]
        pub = engine.published_now()
        prompt = sum(p for _, p, _ in self.recent_finished)
        cached = sum(c for _, _, c in self.recent_finished)
        pool = engine.max_total_num_tokens
        usage = pub.used_tokens / pool if pool else 0.0
        values = {
            "num_running_reqs": ("The number of running requests.", pub.running),
            "num_queue_reqs": ("The number of requests in the waiting queue.", pub.queued),
            "num_grammar_queue_reqs": ("The number of requests in the grammar waiting queue.", 0),
            "gen_throughput": ("The generation throughput (token/s).", pub.gen_throughput),
            "cache_hit_rate": ("The prefix cache hit rate.", cached / prompt if prompt else 0.0),
            "token_usage": ("The token usage.", usage),
            "full_token_usage": ("The token usage for full attention layers.", usage),
            "num_used_tokens": ("The number of used tokens.", pub.used_tokens),
            "kv_used_tokens": ("Number of actively used token slots in the KV cache pool.", pub.used_tokens),
            "kv_available_tokens": ("Number of free token slots in the KV cache pool.", pool - pub.used_tokens),
            "kv_evictable_tokens": ("Number of evictable (radix-cached) token slots in the KV cache pool.", 0),
            "max_total_num_tokens": ("Maximum total number of tokens in the KV cache pool.", pool),
            "context_len": ("Maximum context length.", engine.context_length),
        }
        for name, (doc, value) in values.items():
            gauge = GaugeMetricFamily(f"sglang:{name}", doc, labels=labelnames)
            gauge.add_metric(labels, float(value))
            yield gauge
