#!/usr/bin/env python3
"""The relay's per-chunk path and a request's metrics, timed in one process, no sockets (docs/performance.md).

    .venv/bin/python perf/chunkpath.py [--tree DIR] [--n 200000]

``--tree``: another checkout (``git archive <commit> | tar -x -C DIR``) whose code is timed instead, so a
before/after runs the same harness. What is timed, hot (the same objects again and again, warm caches: a floor,
several times below what the same work costs in a loaded proxy):

- **chunk**: one upstream read of one chat event (llama.cpp's shape, the engine's model name rewritten to the
  client's alias) through the upstream connection's ``data_received`` -> httptools -> the relay's ``_on_chunk``
  (timestamp, frame, parse, token check, rewrite) -> ``SocketOutput.write`` to a transport that drops it;
- **observe**: ``metrics.observe`` of one finished 64-chunk stream (its 63 gaps included) and of a one-token one;
- the pieces of the chunk on their own: the framer, ``orjson.loads``, httptools, the write's framing.

Allocations: ``gc.get_count()`` before and after the chunks (with the collector off) shows what survives them
(GC-tracked objects left behind per chunk: 0 is the target; transient objects are freed by refcount).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

CHUNK_EVENT = {
    "choices": [{"finish_reason": None, "index": 0, "delta": {"content": " tok"}}],
    "created": 1733000000,
    "id": "chatcmpl-abcdefgh",
    "model": "tiny",
    "system_fingerprint": "b11434-abc",
    "object": "chat.completion.chunk",
}


class _Transport:
    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> None:
        self.n += len(data)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Flow:
    write_paused = False

    async def drain(self) -> None:
        pass


class _Cycle:
    disconnected = False

    def __init__(self) -> None:
        self.transport = _Transport()
        self.flow = _Flow()


def per_call_us(fn: Any, n: int) -> float:
    for _ in range(min(n, 1000)):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--n", type=int, default=200_000)
    a = ap.parse_args()
    sys.path.insert(0, str(a.tree.resolve()))
    import httptools
    import httpx
    import orjson
    from prometheus_client import CollectorRegistry

    from proxy.config.settings import EngineSettings
    from proxy.normalize import normalize_request
    from proxy.server.record.metrics import Metrics, observe
    from proxy.server.record.result import Result
    from proxy.server.request.output import SocketOutput
    from proxy.server.request.relay import Attempt
    from proxy.server.request.upstream import Engine
    from proxy.sse import SSEFramer
    from proxy.timing import EngineTimings, StreamTimer, StreamTiming, Usage

    h1 = importlib.import_module(
        "proxy.server.request.h1conn"
        if (a.tree / "proxy/server/request/h1conn.py").exists()
        else "proxy.server.request.h1"
    )
    conn_cls = getattr(h1, "Conn", None) or h1._Conn

    engine = Engine(settings=EngineSettings(name="e", url="http://127.0.0.1:1"), client=httpx.AsyncClient())
    body = {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    norm = normalize_request(body, endpoint="chat", kind="llamacpp", served_model="tiny", defaults={})
    attempt = Attempt(
        request_id="r", endpoint="chat", engine=engine, streams=None, role="primary", model_label="bench",  # type: ignore[arg-type]
        client_model="bench", norm=norm, timer=StreamTimer(), on_result=lambda r: None,
    )  # fmt: skip
    attempt._out = SocketOutput(_Cycle())
    event = b"data: " + json.dumps(CHUNK_EVENT, separators=(",", ":")).encode() + b"\n\n"
    wire = b"%x\r\n%b\r\n" % (len(event), event)
    conn = conn_cls()
    conn.transport = _Transport()
    conn.parser.feed_data(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    conn.sink = attempt._on_chunk

    n = a.n
    gc.disable()
    before = gc.get_count()[0]
    chunk_us = per_call_us(lambda: conn.data_received(wire), n)
    left = gc.get_count()[0] - before
    gc.enable()

    framer = SSEFramer()
    parser = httptools.HttpResponseParser(type("P", (), {"on_body": lambda self, b: None})())
    parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    data = event[6:-2]

    m = Metrics(CollectorRegistry())
    timing = StreamTiming(
        ttft_s=0.05, upstream_ttft_s=0.049, headers_s=0.01, overhead_s=0.0003, tpot_s=0.01, decode_tps=100.0,
        e2e_s=0.7, queue_s=None, gaps_s=tuple(0.01 + i * 1e-5 for i in range(63)),
    )  # fmt: skip
    usage = Usage(prompt_tokens=10, completion_tokens=64, cached_tokens=0)
    long = Result(
        request_id="r", engine="e", engine_kind="llamacpp", role="primary", model="m", endpoint="chat",
        stream=True, outcome="ok", status=200, timing=timing, usage=usage, engine_timings=None,
        finish_reason="length", n_token_events=64, greedy=False,
    )  # fmt: skip
    one_timing = StreamTiming(
        ttft_s=0.05, upstream_ttft_s=0.049, headers_s=0.01, overhead_s=0.0003, tpot_s=None, decode_tps=None,
        e2e_s=0.06, queue_s=0.001, gaps_s=(),
    )  # fmt: skip
    one = Result(
        request_id="r", engine="e", engine_kind="llamacpp", role="primary", model="m", endpoint="chat",
        stream=True, outcome="ok", status=200, timing=one_timing, usage=Usage(10, 1, 0),
        engine_timings=EngineTimings(prompt_ms=40, prompt_n=10, cache_n=0, predicted_n=1), finish_reason="length",
        n_token_events=1, greedy=False,
    )  # fmt: skip
    rows = [
        ("chunk: data_received -> httptools -> _on_chunk -> SocketOutput.write", chunk_us),
        ("  the framer on one read (SSEFramer.feed)", per_call_us(lambda: framer.feed(event), n)),
        ("  orjson.loads of the event", per_call_us(lambda: orjson.loads(data), n)),
        ("  httptools on one chunked read (no callback work)", per_call_us(lambda: parser.feed_data(wire), n)),
        ("  the write's chunked framing (bytes %)", per_call_us(lambda: b"%x\r\n%b\r\n" % (len(event), event), n)),
        ("observe: one finished 64-chunk stream (63 gaps)", per_call_us(lambda: observe(m, long), n // 10)),
        ("observe: one finished 1-token stream", per_call_us(lambda: observe(m, one), n // 10)),
    ]
    print(f"tree {a.tree.resolve()}; Python {sys.version.split()[0]}; {n} calls each (observe: {n // 10})")
    print("\n| what | us a call |\n|---|---|")
    for what, us in rows:
        print(f"| {what} | {us:.2f} |")
    print(f"\nGC-tracked objects left behind by {n} chunks: {left} ({left / n:.4f} a chunk)")


if __name__ == "__main__":
    main()
