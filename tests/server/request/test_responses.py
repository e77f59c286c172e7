"""``proxy.server.request.responses``: every answer carries the proxy's share of its time as ``Server-Timing``, measured
(the request's own clock), and plausible against what the client itself measured; a stream's final figure
(the engine's first event -> the client's first byte included) is in its Result, the request log's record and
``enginemeter_proxy_delay_seconds``.

Real sockets throughout: the proxy under uvicorn with ``enginemeter serve``'s protocol, in front of a real
llama-server; the client measures its own elapsed time with ``perf_counter``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from proxy.config.settings import EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from proxy.embedded import LlamaServer
from proxy.server.observe.requestlog import to_record
from proxy.server.request.responses import server_timing
from proxy.timing import StreamTimer
from tests.helpers import ProxyFactory, ProxyUnderTest

ALIAS = "tiny-alias"


def settings_for(url: str) -> Settings:
    return Settings(
        engines=(EngineSettings(name="llama", url=url, timeouts=Timeouts(connect=2, read=30)),),
        routes=(RouteSettings(models=(ALIAS,), primary="llama"),),
        models=(ModelAlias(alias=ALIAS),),
    )


@pytest.fixture
def proxy(llama_server: LlamaServer, proxy_factory: ProxyFactory) -> ProxyUnderTest:
    return proxy_factory(settings_for(llama_server.url))


def parse(header: str) -> dict[str, float]:
    """``name;dur=1.234, ...`` -> {name: ms}."""
    out: dict[str, float] = {}
    for metric in header.split(","):
        name, _, params = metric.strip().partition(";")
        assert params.startswith("dur="), header
        out[name] = float(params.removeprefix("dur="))
    return out


def chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": ALIAS,
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}],
    }


def test_a_stream_says_the_proxys_share_at_its_head_and_the_rest_at_its_end(proxy: ProxyUnderTest) -> None:
    t0 = time.perf_counter()
    with proxy.client.stream("POST", "/v1/chat/completions", json=chat(8, stream=True)) as r:
        to_head_ms = (time.perf_counter() - t0) * 1e3
        assert r.status_code == 200
        timing = parse(r.headers["server-timing"])
        r.read()
    assert set(timing) == {"queue", "proxy", "engine"}
    # what the proxy says it took fits inside what the client waited for the head
    assert 0 <= timing["queue"] <= timing["proxy"]
    assert timing["proxy"] > 0 and timing["engine"] > 0
    assert timing["proxy"] + timing["engine"] <= to_head_ms
    (result,) = proxy.wait_results(1)
    t = result.timing
    # the header is the Result's clock, not an estimate
    assert t.overhead_s is not None and timing["proxy"] == pytest.approx(t.overhead_s * 1e3, abs=0.001)
    assert t.handler_wait_s is not None and timing["queue"] == pytest.approx(t.handler_wait_s * 1e3, abs=0.001)
    # the final figure adds the engine's first event -> the client's first byte
    assert t.proxy_delay_s is not None and t.overhead_s < t.proxy_delay_s < to_head_ms / 1e3
    record = to_record(result, route=0)
    assert record["proxy_delay_s"] == t.proxy_delay_s and record["queue_wait_s"] == t.handler_wait_s
    labels = {"engine": "llama", "model": ALIAS, "role": "primary", "stream": "true"}
    assert proxy.value("enginemeter_proxy_delay_seconds_count", **labels) == 1
    assert proxy.value("enginemeter_proxy_delay_seconds_sum", **labels) == pytest.approx(t.proxy_delay_s)


def test_a_whole_answer_says_how_long_the_engine_took_for_all_of_it(proxy: ProxyUnderTest) -> None:
    t0 = time.perf_counter()
    r = proxy.client.post("/v1/chat/completions", json=chat(8, stream=False))
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert r.status_code == 200
    timing = parse(r.headers["server-timing"])
    assert set(timing) == {"queue", "proxy", "engine"}
    assert timing["proxy"] > 0 and timing["engine"] > 0 and timing["proxy"] + timing["engine"] <= elapsed_ms
    (result,) = proxy.wait_results(1)
    assert result.timing.e2e_s is not None
    assert timing["proxy"] + timing["engine"] <= result.timing.e2e_s * 1e3 + 0.001


@pytest.mark.parametrize(
    ("method", "path", "content"),
    [
        ("POST", "/v1/chat/completions", b"{not json"),  # the proxy's own 400
        ("GET", "/health", None),  # a route served through Starlette
        ("GET", "/metrics", None),
        ("GET", "/v1/nowhere/../../etc", None),  # the proxy's own 404, before any route
    ],
    ids=["own-error", "health", "metrics", "own-404"],
)
def test_the_proxys_own_answers_say_how_long_they_took(
    proxy: ProxyUnderTest, method: str, path: str, content: bytes | None
) -> None:
    t0 = time.perf_counter()
    r = proxy.client.request(method, path, content=content)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    timing = parse(r.headers["server-timing"])
    assert set(timing) == {"queue", "proxy"}, r.headers["server-timing"]
    assert 0 <= timing["queue"] <= timing["proxy"] <= elapsed_ms


def test_a_pass_through_answer_says_when_the_engine_answered(proxy: ProxyUnderTest) -> None:
    t0 = time.perf_counter()
    r = proxy.client.post("/tokenize", json={"content": "hello world"})
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert r.status_code == 200
    timing = parse(r.headers["server-timing"])
    assert set(timing) == {"queue", "proxy", "engine"}
    assert timing["proxy"] + timing["engine"] <= elapsed_ms


def test_the_header_reads_the_timer_as_far_as_it_has_come() -> None:
    ms = 1_000_000
    t = StreamTimer(t_received_ns=100 * ms, t_handler_ns=101 * ms)
    t.t_sent_ns = 103 * ms
    assert server_timing(t).startswith("queue;dur=1.000, proxy;dur=3.000")
    t.t_headers_ns = 150 * ms
    assert server_timing(t) == "queue;dur=1.000, proxy;dur=3.000, engine;dur=47.000"
    t.t_first_read_ns = 160 * ms  # a stream's head goes once the first event is in
    assert server_timing(t) == "queue;dur=1.000, proxy;dur=3.000, engine;dur=57.000"
    unstamped = StreamTimer()  # another server: no head stamp, no queue figure
    assert server_timing(unstamped).startswith("proxy;dur=")
