#!/usr/bin/env python3
"""What work in another thread costs the event loop, by the GIL's switch interval (docs/performance.md, "GIL").

The proxy runs a few things in threads so that they stay off the event loop: the ``/metrics`` exposition
(prometheus-client's ``generate_latest``, pure Python), the request-log writer, the GPU sampler. A thread still
needs the GIL: while it runs Python code, the loop thread gets the GIL back only at the switch interval
(``sys.setswitchinterval``, CPython's default 5 ms), and a C call that holds the GIL (orjson parsing a large
document) keeps it for the whole call. This measures both on one process, no server:

- a timer on the loop every 0.5 ms records how late it fires while a thread renders the exposition of the
  proxy's own ``Metrics`` after traffic (``perf/series.py``: E engines x M aliases, every combination observed),
  once per switch interval;
- the same timer while ``orjson.loads`` parses a large document inline and in a thread.

    .venv/bin/python perf/gil.py [--engines 2 --aliases 1 --scrapes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from series import _result

from proxy.server.metrics import Metrics, observe
from proxy.types import Role


def metrics_after_traffic(engines: int, aliases: int) -> Metrics:
    names = [f"engine{i}" for i in range(engines)]
    models = [f"alias{i}" for i in range(aliases)] + [f"served{i}" for i in range(engines)]
    m = Metrics(CollectorRegistry())
    m.prime(names, models, [])
    roles: tuple[Role, ...] = ("primary", "shadow")
    for e in names:
        for model in models:
            for role in roles:
                for stream in (True, False):
                    observe(m, _result(e, model, role, stream))
    return m


async def lags_during(work: Callable[[], Any], times: int, in_thread: bool) -> list[float]:
    """How late a 0.5 ms timer fired (ms) while ``work`` ran ``times`` times, in a thread or on the loop."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    running = True

    async def probe() -> None:
        while running:
            t = loop.time()
            await asyncio.sleep(0.0005)
            lags.append((loop.time() - t - 0.0005) * 1e3)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    lags.clear()
    for _ in range(times):
        if in_thread:
            await asyncio.to_thread(work)
        else:
            work()
            await asyncio.sleep(0)
    running = False
    await task
    return sorted(lags)


def row(label: str, lags: list[float]) -> str:
    if not lags:
        return f"| {label} | - | - | - | 0 |"
    p = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
    return f"| {label} | {lags[len(lags) // 2]:.2f} | {p:.2f} | {lags[-1]:.2f} | {len(lags)} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--aliases", type=int, default=1)
    ap.add_argument("--scrapes", type=int, default=5)
    args = ap.parse_args()
    m = metrics_after_traffic(args.engines, args.aliases)
    t0 = time.perf_counter()
    size = len(generate_latest(m.registry))
    print(f"exposition: {size} bytes, {(time.perf_counter() - t0) * 1e3:.1f} ms to render (one thread, alone)")
    doc = orjson.dumps(
        [{"id": i, "is_processing": False, "params": {"n": [1, 2, 3], "s": "x" * 50}} for i in range(100_000)]
    )
    print(f"document: {len(doc)} bytes of JSON")
    print("\n| work (loop timer every 0.5 ms) | lag p50 ms | lag p99 ms | lag max ms | probes |\n|---|---|---|---|---|")
    for interval in (0.005, 0.001, 0.0005):
        sys.setswitchinterval(interval)
        lags = asyncio.run(lags_during(lambda: generate_latest(m.registry), args.scrapes, in_thread=True))
        print(row(f"{args.scrapes} scrapes in a thread, switch interval {interval * 1e3:g} ms", lags))
    sys.setswitchinterval(0.005)
    for in_thread in (False, True):
        lags = asyncio.run(lags_during(lambda: orjson.loads(doc), 1, in_thread=in_thread))
        print(row(f"orjson.loads of the document {'in a thread' if in_thread else 'on the loop'}", lags))


if __name__ == "__main__":
    main()
