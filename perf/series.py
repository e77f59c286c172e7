#!/usr/bin/env python3
"""How many series /metrics exports, by the number of engines and model aliases (docs/metrics.md#series).

No engine, no server: the proxy's own ``Metrics`` primed as the app's start-up primes it (``Metrics.prime`` with
every engine, every alias and every engine's served name), then fed one finished ``Result`` per combination that
traffic can produce — every engine x model label x role (primary, shadow) x stream (true, false), ok, with every
timing, token and engine-timings figure set (llama.cpp's answers carry all of them) — through ``observe``, the
code every request goes through. Series are the exposition's sample lines (a histogram: one per bucket, plus
``_sum`` and ``_count``); the collectors (GPU, engine state) are not counted.

    .venv/bin/python perf/series.py                    # the table for 1..3 engines x 1..3 aliases, and 45 x 45
    .venv/bin/python perf/series.py --engines 45 --aliases 1

Each engine is given its own served model name, as a config of distinct models has; that name is a model label
too (``Attempts.model_label``), so M aliases and E engines make E + M model labels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, generate_latest

from proxy.server.record.metrics import Metrics, observe
from proxy.server.record.result import Result
from proxy.timing import EngineTimings, StreamTiming, Usage
from proxy.types import Role

TIMING = StreamTiming(
    ttft_s=0.1, upstream_ttft_s=0.09, headers_s=0.01, overhead_s=0.0002, tpot_s=0.01, decode_tps=100.0,
    e2e_s=1.0, queue_s=0.01, gaps_s=(0.01, 0.02), handler_wait_s=0.0001, proxy_delay_s=0.0003,
)  # fmt: skip
ENGINE_TIMINGS = EngineTimings(
    prompt_ms=50.0, prompt_n=10, cache_n=2, predicted_n=64, predicted_ms=640.0, predicted_per_second=100.0
)


def count(engines: int, aliases: int) -> tuple[int, int, int]:
    """(series at start, series once every combination served traffic, exposition bytes then)."""
    names = [f"engine{i}" for i in range(engines)]
    models = [f"alias{i}" for i in range(aliases)] + [f"served{i}" for i in range(engines)]
    m = Metrics(CollectorRegistry())
    m.prime(names, models, [])

    def series() -> int:
        return sum(len(fam.samples) for fam in m.registry.collect())

    primed = series()
    roles: tuple[Role, ...] = ("primary", "shadow")
    for e in names:
        for model in models:
            for role in roles:
                for stream in (True, False):
                    observe(m, _result(e, model, role, stream))
    return primed, series(), len(generate_latest(m.registry))


def _result(engine: str, model: str, role: Role, stream: bool) -> Result:
    return Result(
        request_id="r", engine=engine, engine_kind="llamacpp", role=role, model=model, endpoint="chat",
        stream=stream, outcome="ok", status=200, timing=TIMING,
        usage=Usage(prompt_tokens=10, completion_tokens=64, cached_tokens=2), engine_timings=ENGINE_TIMINGS,
        finish_reason="length", n_token_events=64, greedy=False,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int)
    ap.add_argument("--aliases", type=int)
    args = ap.parse_args()
    grid = [(args.engines, args.aliases)] if args.engines else [(e, a) for e in (1, 2, 3) for a in (1, 2, 3)]
    if not args.engines:
        grid.append((45, 45))
    print(f"{'engines':>7} {'aliases':>7} {'model labels':>12} {'at start':>9} {'with traffic':>12} {'bytes':>10}")
    for e, a in grid:
        primed, full, size = count(e, a)
        print(f"{e:>7} {a:>7} {e + a:>12} {primed:>9} {full:>12} {size:>10}")


if __name__ == "__main__":
    main()
