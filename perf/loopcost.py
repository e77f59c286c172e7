#!/usr/bin/env python3
"""What the event loop pays for work it does not see: threads, C calls that hold the GIL, a full garbage
collection (docs/performance.md, third pass).

The proxy runs a few things in threads so that they stay off the event loop: the ``/metrics`` exposition
(prometheus-client's ``generate_latest``, pure Python), the request-log writer, the GPU sampler. A thread still
needs the GIL: while it runs Python code, the loop thread gets the GIL back only at the switch interval
(``sys.setswitchinterval``, CPython's default 5 ms), and a C call that holds the GIL (orjson parsing a large
document) keeps it for the whole call. This measures both on one process, no server:

- a timer on the loop every 0.5 ms records how late it fires while a thread renders the exposition of the
  proxy's own ``Metrics`` after traffic (``perf/series.py``: E engines x M aliases, every combination observed),
  once per switch interval;
- the same timer while ``orjson.loads`` parses a large document inline and in a thread;
- a full collection (``gc.collect()``) of the heap ``enginemeter serve`` has after start-up (the app built by
  ``build_app``, every stage imported), before and after ``gc.freeze()``;
- what the fake engine's ``/slots`` cost the proxy's engine-state poll with the 100,000 slots the bench gave it.

    .venv/bin/python perf/loopcost.py [--engines 2 --aliases 1 --scrapes 5]
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

from proxy.server.record.metrics import Metrics, observe
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
    full_collection()
    slots_answer()


def full_collection() -> None:
    """A full collection of the start-up heap of ``enginemeter serve``, as it is and frozen (``settle_process``)."""
    import gc

    from proxy.config.settings import EngineSettings, RouteSettings, Settings
    from proxy.server.compose import build_app

    settings = Settings(
        engines=(EngineSettings(name="e", url="http://127.0.0.1:9"),),
        routes=(RouteSettings(models=("*",), primary="e"),),
    )
    app = build_app(settings)
    gc.collect()
    print()
    for frozen in (False, True):
        if frozen:
            gc.freeze()
        tracked = len(gc.get_objects())
        pauses = []
        for _ in range(5):
            t0 = time.perf_counter()
            gc.collect()
            pauses.append((time.perf_counter() - t0) * 1e3)
        print(
            f"a full collection after start-up, {'frozen' if frozen else 'as it is'}: {tracked} objects tracked,"
            f" {gc.get_freeze_count()} frozen: {min(pauses):.2f}-{max(pauses):.2f} ms"
        )
    gc.unfreeze()
    del app


def slots_answer() -> None:
    """What the proxy's engine-state poll parsed every 10 s in the bench before: the fake engine's /slots with the
    100,000 slots perf/overhead.py gave it (now: twice the streams, at least 64)."""
    import httpx

    from fakes.fault_engine import FaultEngineConfig, run_in_thread

    print()
    for n in (100_000, 64):
        with run_in_thread(FaultEngineConfig(total_slots=n)) as url:
            body = httpx.get(url + "/slots").content
            t0 = time.perf_counter()
            slots = orjson.loads(body)
            t1 = time.perf_counter()
            busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing") is True)
            t2 = time.perf_counter()
        print(
            f"the fake engine's /slots with {n} slots: {len(body)} bytes, parsed in {(t1 - t0) * 1e3:.2f} ms,"
            f" counted ({busy} busy) in {(t2 - t1) * 1e3:.2f} ms: on the proxy's loop every engine-state poll"
        )


if __name__ == "__main__":
    main()
