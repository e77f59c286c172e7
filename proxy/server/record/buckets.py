"""The histograms' bucket boundaries: a default per settings family, which ``metrics.buckets.<family>`` in the
settings replaces (docs/metrics.md#buckets), and the fixed ones of ratios, deltas and the event loop.

Dense where typical values sit; the keys of ``DEFAULT_BUCKETS`` are ``settings.BUCKET_KEYS``.
"""

from __future__ import annotations

from proxy.config.settings import BUCKET_KEYS

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
