"""The proxy in front of a real llama-server: relay, alias round trip, usage, timing agreement, disconnects.

Everything runs over real sockets: llama-server processes from tests/conftest.py and the proxy under a real
uvicorn server (tests/helpers.py:run_uvicorn_app). Clients are the official ``openai`` SDK and raw httpx.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from proxy.config.configfile import load
from proxy.config.settings import EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from proxy.embedded import LlamaServer
from tests.helpers import ProxyFactory, wait_until
from tests.helpers import ProxyUnderTest as Proxy

ALIAS = "team-model"
MSGS: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a story about a robot who learns to paint."}
]


def settings_for(engine_url: str, **kw: Any) -> Settings:
    s = Settings(
        engines=(EngineSettings(name="llama", url=engine_url, timeouts=Timeouts(connect=2, read=30)),),
        routes=(RouteSettings(models=(ALIAS,), primary="llama"),),
        models=(ModelAlias(alias=ALIAS),),
    )
    return replace(s, **kw)


@pytest.fixture
def proxy(llama_server: LlamaServer, proxy_factory: ProxyFactory) -> Proxy:
    return proxy_factory(settings_for(llama_server.url))


def sdk(p: Proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0, timeout=60)


# ------------------------------------------------------------------------------------------ relaying


def test_chat_stream_alias_round_trip_and_usage_stripped(proxy: Proxy) -> None:
    stream = sdk(proxy).chat.completions.create(
        model=ALIAS,
        messages=MSGS,
        stream=True,
        max_tokens=16,
        temperature=0,
    )
    chunks = list(stream)
    assert chunks, "no chunks"
    assert {c.model for c in chunks} == {ALIAS}
    assert all(c.choices for c in chunks), "the usage chunk must be stripped when the client did not ask"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text
    (r,) = proxy.wait_results(1)
    assert r.outcome == "ok"
    assert r.usage is not None and r.usage.completion_tokens == 16
    assert proxy.value("enginemeter_usage_events_stripped_total", engine="llama") == 1


def test_chat_stream_usage_kept_when_asked(proxy: Proxy) -> None:
    chunks = list(
        sdk(proxy).chat.completions.create(
            model=ALIAS,
            messages=MSGS,
            stream=True,
            max_tokens=8,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens == 8
    assert last.model == ALIAS


def test_chat_non_stream(proxy: Proxy) -> None:
    r = sdk(proxy).chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=8)
    assert r.model == ALIAS
    assert r.usage is not None and r.usage.completion_tokens == 8
    (res,) = proxy.wait_results(1)
    assert res.engine_timings is not None and res.engine_timings.predicted_n == 8


def test_completions_stream_and_non_stream(proxy: Proxy) -> None:
    client = sdk(proxy)
    r = client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=8)
    assert r.model == ALIAS
    assert r.choices[0].text
    chunks = list(client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=8, stream=True))
    assert {c.model for c in chunks} == {ALIAS}
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    results = proxy.wait_results(2)
    assert [r.outcome for r in results] == ["ok", "ok"]
    assert results[1].n_token_events >= 1


def test_engine_receives_explicit_sampling(proxy: Proxy, llama_server: LlamaServer) -> None:
    """llama-server's /slots shows the params the last task ran with: the proxy's explicit defaults."""
    sdk(proxy).chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=4, seed=7)
    slots = httpx.get(f"{llama_server.url}/slots").json()
    params = [s["params"] for s in slots if s.get("params", {}).get("seed") == 7]
    assert params, slots
    p = params[0]
    assert p["temperature"] == pytest.approx(0.8)
    assert p["top_k"] == 40
    assert p["top_p"] == pytest.approx(0.95)
    assert p["min_p"] == pytest.approx(0.05)
    assert proxy.value("enginemeter_params_total", engine="llama", param="temperature", action="defaulted") >= 1


def test_proxy_decode_rate_agrees_with_llama_server(proxy: Proxy) -> None:
    """Generous bound here; the tight figure is in bench/ and docs/performance.md."""
    for _ in range(3):
        list(
            sdk(proxy).chat.completions.create(
                model=ALIAS,
                messages=MSGS,
                stream=True,
                max_tokens=128,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
    results = proxy.wait_results(3)
    ratios = []
    for r in results:
        assert r.engine_timings is not None and r.engine_timings.predicted_per_second
        assert r.timing.decode_tps is not None
        ratios.append(r.timing.decode_tps / r.engine_timings.predicted_per_second)
    best = min(ratios, key=lambda x: abs(1 - x))
    assert 0.5 < best < 1.5, ratios


def test_chunks_are_forwarded_one_by_one(proxy: Proxy) -> None:
    """A buffering proxy delivers everything at once; ours forwards each engine write as it arrives."""
    arrivals: list[float] = []
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/chat/completions",
        json={"model": ALIAS, "messages": MSGS, "stream": True, "max_tokens": 64, "ignore_eos": True},
        timeout=30,
    ) as r:
        for _ in r.iter_raw():
            arrivals.append(time.perf_counter())
    assert len(arrivals) >= 16, f"only {len(arrivals)} reads: the stream was buffered"
    assert arrivals[-1] - arrivals[0] > 0


def test_client_disconnect_frees_the_engine_slot(llama_server_factory: Any, proxy_factory: ProxyFactory) -> None:
    engine: LlamaServer = llama_server_factory(np=1, extra_args=["-c", "8192"])
    p = proxy_factory(settings_for(engine.url))

    def busy() -> bool:
        return any(s.get("is_processing") for s in httpx.get(f"{engine.url}/slots").json())

    with httpx.stream(
        "POST",
        f"{p.url}/v1/chat/completions",
        json={"model": ALIAS, "messages": MSGS, "stream": True, "max_tokens": 7000, "ignore_eos": True},
        timeout=30,
    ) as r:
        it = r.iter_raw()
        next(it)
        assert busy()
        t0 = time.perf_counter()
    # leaving the block closed the client connection mid-stream
    wait_until(lambda: not busy(), timeout=5.0, interval=0.01)
    freed_after = time.perf_counter() - t0
    assert freed_after < 1.0, f"slot still busy {freed_after:.3f}s after the client left"
    (res,) = p.wait_results(1)
    assert res.outcome == "client_disconnect"
    assert res.usage is None or (res.usage.completion_tokens or 0) < 7000


# ------------------------------------------------------------------------------------------ errors


def test_engine_4xx_passes_through(llama_server_factory: Any, proxy_factory: ProxyFactory) -> None:
    engine: LlamaServer = llama_server_factory(np=1, extra_args=["-c", "256"])
    p = proxy_factory(settings_for(engine.url))
    long = [{"role": "user", "content": "word " * 2000}]
    for stream in (False, True):
        r = httpx.post(
            f"{p.url}/v1/chat/completions", json={"model": ALIAS, "messages": long, "stream": stream}, timeout=30
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error"
        assert "enginemeter" not in err
    assert [x.outcome for x in p.wait_results(2)] == ["engine_error", "engine_error"]


def test_engine_down_is_a_marked_502(proxy_factory: ProxyFactory) -> None:
    from proxy.procs.process import free_port

    p = proxy_factory(settings_for(f"http://127.0.0.1:{free_port()}"))
    r = httpx.post(f"{p.url}/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": True})
    assert r.status_code == 502
    assert r.json()["error"]["enginemeter"] is True
    assert p.wait_results(1)[0].outcome == "connect_error"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1,2]", 400, None),
        (json.dumps({"model": ALIAS}).encode(), 400, "messages"),
        (json.dumps({"model": ALIAS, "messages": MSGS, "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "no-such-model", "messages": MSGS}).encode(), 404, "model"),
    ],
)
def test_bad_client_input_gets_a_clear_error(proxy: Proxy, body: bytes, status: int, param: str | None) -> None:
    r = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["enginemeter"] is True
    assert err["param"] == param
    assert proxy.total("enginemeter_requests_total", engine="none", outcome="rejected") == 1
    assert proxy.results == []  # nothing reached an engine


def test_oversized_body_is_413(llama_server: LlamaServer, proxy_factory: ProxyFactory) -> None:
    p = proxy_factory(settings_for(llama_server.url, max_body_bytes=1000))
    big = {"model": ALIAS, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{p.url}/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["enginemeter"] is True
    # chunked upload without content-length is bounded too
    r = httpx.post(f"{p.url}/v1/chat/completions", content=iter([json.dumps(big).encode()]))
    assert r.status_code == 413


def test_client_keys(llama_server: LlamaServer, proxy_factory: ProxyFactory) -> None:
    p = proxy_factory(settings_for(llama_server.url, api_keys=frozenset({"k1"})))
    body = {"model": ALIAS, "messages": MSGS, "max_tokens": 2}
    assert httpx.post(f"{p.url}/v1/chat/completions", json=body).status_code == 401
    ok = httpx.post(f"{p.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer k1"})
    assert ok.status_code == 200


def test_models_health_and_quick_form(llama_server: LlamaServer, proxy_factory: ProxyFactory) -> None:
    p = proxy_factory(load(primary=llama_server.url, env={}))
    health = httpx.get(f"{p.url}/health").json()
    assert health["status"] == "ok"
    (eng,) = health["engines"]
    assert eng["kind"] == "llamacpp" and eng["up"] is True and eng["model"] == "tiny"
    models = httpx.get(f"{p.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    # quick form: any model name routes to the primary and comes back as sent
    r = sdk(p).chat.completions.create(model="whatever", messages=MSGS, max_tokens=2)
    assert r.model == "whatever"
