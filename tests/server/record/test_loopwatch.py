"""``proxy.server.record.loopwatch``: a busy event loop shows in the metrics (lag, queued requests, GC pauses), a stream
leaves no reference cycles for the collector, and ``enginemeter serve`` freezes what its start-up made.

The proxy runs under a real uvicorn with ``enginemeter serve``'s protocol in front of a real llama-server; the
loop is made busy from outside the product: the test schedules a blocking call on the proxy's own loop
(``loop.call_soon_threadsafe(time.sleep, ...)``), the way a CPU-bound section of a request would hold it.
"""

from __future__ import annotations

import asyncio
import gc
import re
import socket
import time
from typing import Any

import httpx

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.settings import EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from proxy.embedded import LlamaServer
from tests.helpers import ProcessServer, ProxyFactory, ProxyUnderTest, wait_until

ALIAS = "tiny-alias"
LAG = "enginemeter_event_loop_lag_seconds"


def settings_for(url: str) -> Settings:
    return Settings(
        engines=(EngineSettings(name="llama", url=url, timeouts=Timeouts(connect=2, read=30)),),
        routes=(RouteSettings(models=(ALIAS,), primary="llama"),),
        models=(ModelAlias(alias=ALIAS),),
    )


def body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": ALIAS,
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count slowly from one to a thousand."}],
    }


def slow_lags(p: ProxyUnderTest, over_s: float) -> float:
    """Lag probes that fired more than ``over_s`` late (``over_s`` must be a bucket boundary)."""
    return p.value(f"{LAG}_count") - p.value(f"{LAG}_bucket", le=str(over_s))


def loop_of(p: ProxyUnderTest) -> asyncio.AbstractEventLoop:
    watch = p.gateway.loop_watch
    assert watch is not None
    loop = wait_until(lambda: watch.loop, timeout=10, message="the loop watch to start")
    assert loop is not None
    return loop


def test_a_blocked_event_loop_shows_in_the_lag_metric_and_in_the_stream_it_stalled(
    llama_server: LlamaServer, proxy_factory: ProxyFactory
) -> None:
    p = proxy_factory(settings_for(llama_server.url))
    loop = loop_of(p)
    wait_until(lambda: p.value(f"{LAG}_count") >= 3, timeout=10, message="the lag probe to run")
    assert slow_lags(p, 0.25) == 0  # an idle proxy: no probe was 250 ms late
    with p.client.stream("POST", "/v1/chat/completions", json=body(256)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the stream is under way
        loop.call_soon_threadsafe(time.sleep, 0.4)  # the loop held for 400 ms, as a CPU-bound section would
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    # the probe due next fired late by the block less the part of its 0.1 s interval already gone: >= 0.3 s
    wait_until(lambda: slow_lags(p, 0.25) >= 1, timeout=10, message="a lag probe over 250 ms")
    # the same stall, seen by the stream: the engine kept decoding while the proxy could not read
    (result,) = p.wait_results(1)
    assert result.outcome == "ok"
    assert max(result.timing.gaps_s) >= 0.35
    assert result.loop_stalled  # and the Result says so: its figures hold the proxy's wait (the swap's watch counts it)


def test_requests_pipelined_behind_a_stream_count_as_queued_until_their_turn(
    llama_server: LlamaServer, proxy_factory: ProxyFactory
) -> None:
    """Accepted (their heads parsed) but not yet handled: the server holds pipelined requests until the response
    before them is done, so for as long as the stream runs the gauge says 2."""
    import json

    p = proxy_factory(settings_for(llama_server.url))
    host, port = p.url.removeprefix("http://").split(":")
    waited = p.value("enginemeter_request_queue_seconds_count")

    def request(b: dict[str, Any], close: bool = False) -> bytes:
        data = json.dumps(b).encode()
        extra = b"connection: close\r\n" if close else b""
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        return head + extra + b"content-length: %d\r\n\r\n" % len(data) + data

    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request(body(256)) + request(body(1, stream=False)) + request(body(1, stream=False), close=True))
        wait_until(lambda: p.value("enginemeter_requests_queued") == 2, timeout=10, message="2 requests queued")
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    assert received.count(b"HTTP/1.1 200 OK") == 3, received[-500:]
    assert p.value("enginemeter_requests_queued") == 0
    assert p.value("enginemeter_request_queue_seconds_count") - waited == 3


def test_garbage_collections_reach_the_pause_metric(proxy_factory: ProxyFactory) -> None:
    with run_in_thread() as url:
        p = proxy_factory(settings_for(url))
        loop_of(p)
        before = p.value("enginemeter_gc_pause_seconds_count", generation="2")
        gc.collect()  # the proxy runs in this process: its hook sees this collection
        wait_until(
            lambda: p.value("enginemeter_gc_pause_seconds_count", generation="2") > before,
            timeout=10,
            message="the probe to move the pause into the histogram",
        )
        assert p.value("enginemeter_gc_pause_seconds_sum", generation="2") > 0


def _ours(o: object) -> bool:
    kind = type(o)
    return kind.__module__.startswith("proxy.") or issubclass(kind, BaseException)


def test_a_stream_leaves_no_reference_cycles_for_the_collector(proxy_factory: ProxyFactory) -> None:
    """Everything a request made is freed when it ends, by reference counting; nothing waits for the garbage
    collector (whose pauses every stream feels). Before, each request left its hang-up watcher's CancelledError
    with its traceback and frames, and the upstream connection with its parser, in cycles (~40 objects)."""
    knobs = Knobs(tokens=8, cadence_ms=1, ttft_ms=1)
    with run_in_thread(FaultEngineConfig(knobs=knobs)) as url:
        p = proxy_factory(settings_for(url))
        for _ in range(3):  # warm: first-use caches (labelled children, compiled paths) are no garbage
            p.client.post("/v1/chat/completions", json=body(8)).read()
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for stream in (True, True, False, True):
                with p.client.stream("POST", "/v1/chat/completions", json=body(8, stream)) as r:
                    assert r.status_code == 200
                    r.read()
            p.wait_results(7)
            gc.collect()
            ours = [o for o in gc.garbage if _ours(o)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert ours == [], sorted({type(o).__qualname__ for o in ours})


def test_serve_freezes_its_start_up_objects_and_shortens_the_gil_switch_interval() -> None:
    with (
        run_in_thread() as url,
        ProcessServer(
            "proxy.cli", "serve", "--primary", url, "--listen", "127.0.0.1:{port}", ready_path="/health"
        ) as server,
    ):
        line = wait_until(
            lambda: re.search(
                r"gc: (\d+) start-up objects frozen \(gc.freeze\); GIL switch interval 0.5 ms", server.output()
            ),
            timeout=10,
            message="the gc line in the log",
        )
        assert line is not None and int(line.group(1)) > 10_000
        # and it keeps serving: a stream through it, with its Server-Timing
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json={**body(4), "model": "x"})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            assert "proxy;dur=" in r.headers["server-timing"]
