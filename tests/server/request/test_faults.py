"""Fault injection: what the client sees and what is recorded when the engine misbehaves.

The engine is fakes/fault_engine/ (a llama.cpp look-alike with exact control over bytes, timing and
abrupt closes); the proxy runs under a real uvicorn server on a real socket.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.settings import EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from proxy.server.record.result import Result
from tests.helpers import ProxyFactory, ProxyUnderTest, wait_until

ALIAS = "team-model"
MSGS = [{"role": "user", "content": "hello there"}]


@dataclass
class Setup:
    engine_url: str
    proxy: ProxyUnderTest

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def registry(self) -> CollectorRegistry:
        return self.proxy.registry

    def result(self) -> Result:
        return self.proxy.wait_results(1)[0]


@pytest.fixture(params=[None, "h11"], ids=["socket", "asgi-send"])
def setup(proxy_factory: ProxyFactory, request: pytest.FixtureRequest) -> Iterator[Callable[..., Setup]]:
    """The proxy on the production server (the relay writes to the client's socket, ``output.SocketOutput``) and
    on uvicorn's h11 protocol (through ASGI ``send``, ``output.SendOutput``): every fault reads the same."""
    with ExitStack() as stack:

        def start(knobs: Knobs, read_timeout: float = 30.0) -> Setup:
            engine_url = stack.enter_context(run_in_thread(FaultEngineConfig(model="engine-name", knobs=knobs)))
            timeouts = Timeouts(connect=2, read=read_timeout)
            settings = Settings(
                engines=(EngineSettings(name="fake", url=engine_url, kind="llamacpp", timeouts=timeouts),),
                routes=(RouteSettings(models=(ALIAS,), primary="fake"),),
                models=(ModelAlias(alias=ALIAS, engines={"fake": "served-name"}),),
            )
            return Setup(engine_url, proxy_factory(settings, http=request.param))

        yield start


def stream_events(url: str, body: dict[str, Any] | None = None) -> list[bytes]:
    body = body or {"model": ALIAS, "messages": MSGS, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_raw())
    return [e for e in raw.split(b"\n\n") if e]


def test_engine_receives_the_normalized_body(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=3))
    stream_events(s.url, {"model": ALIAS, "messages": MSGS, "stream": True, "max_completion_tokens": 3, "mirostat": 2})
    (got,) = httpx.get(f"{s.engine_url}/_fake/requests").json()
    assert got == {
        "model": "served-name",
        "messages": MSGS,
        "stream": True,
        "max_tokens": 3,
        "mirostat": 2,  # llama.cpp takes mirostat
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "stream_options": {"include_usage": True},
    }


def test_stream_bytes_pass_untouched_except_the_model(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=4, ping=True, cadence_ms=5))
    events = stream_events(
        s.url, {"model": ALIAS, "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert b":" in events  # keep-alive comments pass
    data = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert {d["model"] for d in data} == {ALIAS}
    assert events[-1] == b"data: [DONE]"
    assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] >= 4
    assert "timings" in data[-1]


def test_chunks_keep_their_cadence(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=12, cadence_ms=40))
    arrivals: list[float] = []
    with httpx.stream(
        "POST", f"{s.url}/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": True}
    ) as r:
        for _ in r.iter_raw():
            arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(gaps) >= 10
    assert statistics.median(gaps) > 0.020, gaps  # not buffered into one burst
    res = s.result()
    assert res.timing.gaps_s
    assert statistics.median(res.timing.gaps_s) == pytest.approx(0.040, abs=0.015)


def test_engine_dying_mid_stream_gives_one_in_band_error(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=10, die_after=3))
    events = stream_events(s.url)
    last = json.loads(events[-1][6:])
    assert last["error"]["enginemeter"] is True
    assert last["error"]["code"] == 502
    assert sum(1 for e in events if b'"content":"' in e) == 3
    assert s.result().outcome == "upstream_broken"


def test_malformed_sse_gives_one_in_band_error(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=10, malformed_after=2))
    events = stream_events(s.url)
    last = json.loads(events[-1][6:])
    assert last["error"]["enginemeter"] is True
    assert "malformed" in last["error"]["message"]
    assert s.result().outcome == "upstream_broken"


def test_engine_in_band_error_passes_through(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=10, error_after=2))
    events = stream_events(s.url)
    last = json.loads(events[-1][6:])
    assert "error" in last
    assert "enginemeter" not in last["error"]
    assert s.result().outcome == "engine_error"


def test_no_headers_in_time_is_a_504(setup: Any) -> None:
    s: Setup = setup(Knobs(hang_before_headers=True), read_timeout=0.5)
    r = httpx.post(f"{s.url}/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": True}, timeout=10)
    assert r.status_code == 504
    assert r.json()["error"]["enginemeter"] is True
    assert s.result().outcome == "timeout"


def test_stall_after_first_byte_is_an_in_band_timeout(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=10, stall_after=2), read_timeout=0.5)
    events = stream_events(s.url)
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == 504
    assert s.result().outcome == "timeout"


def test_engine_status_passes_through(setup: Any) -> None:
    s: Setup = setup(Knobs(status=503))
    r = httpx.post(f"{s.url}/v1/chat/completions", json={"model": ALIAS, "messages": MSGS}, timeout=10)
    assert r.status_code == 503
    assert "enginemeter" not in r.json()["error"]
    assert s.result().outcome == "engine_error"


def test_client_disconnect_cancels_the_upstream(setup: Any) -> None:
    s: Setup = setup(Knobs(tokens=1000, cadence_ms=20))
    with httpx.stream(
        "POST", f"{s.url}/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": True}
    ) as r:
        next(r.iter_raw())
    t0 = time.perf_counter()
    wait_until(lambda: httpx.get(f"{s.engine_url}/_fake/stats").json()["cancelled"] == 1, timeout=5, interval=0.01)
    assert time.perf_counter() - t0 < 1.0
    assert s.result().outcome == "client_disconnect"
    assert s.registry.get_sample_value("enginemeter_in_flight_requests", {"engine": "fake", "role": "primary"}) == 0
