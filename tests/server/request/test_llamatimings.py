"""The proxy-measured ``timings`` block (proxy/server/request/llamatimings.py) through the real proxy: the SGLang
emulator (on the fault engine) gets one on its usage event and in its non-stream body; llama.cpp-shaped
answers (the fault engine speaks llama.cpp) keep their own, byte for byte; off by default."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import httpx
import pytest

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from fakes.sglang_emulator import EmulatorConfig
from fakes.sglang_emulator import run_in_thread as run_emulator
from proxy.config.settings import EngineSettings, RouteSettings, Settings, Timeouts
from proxy.embedded import LlamaServer
from proxy.server.request.llamatimings import timings_block
from proxy.timing import StreamTimer, Usage
from tests.helpers import ProxyFactory, ProxyUnderTest

MSGS = [{"role": "user", "content": "count to ten please"}]
TOKENS = 8


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[str, str]]:
    """(fault engine = llama.cpp-shaped, SGLang emulator on another fault engine)."""
    with ExitStack() as stack:
        knobs = Knobs(tokens=TOKENS, cadence_ms=2)
        llama = stack.enter_context(run_in_thread(FaultEngineConfig(knobs=knobs)))
        backend = stack.enter_context(run_in_thread(FaultEngineConfig(knobs=knobs)))
        sglang = stack.enter_context(run_emulator(EmulatorConfig(backend=backend, served_model_name="Qwen/Tiny")))
        yield llama, sglang


def settings(llama: str, sglang: str, **kw: Any) -> Settings:
    t = Timeouts(connect=2, read=20)
    return Settings(
        engines=(
            EngineSettings(name="llama", url=llama, kind="llamacpp", model="fault-engine", timeouts=t),
            EngineSettings(name="sg", url=sglang, kind="sglang", model="Qwen/Tiny", timeouts=t),
        ),
        routes=(RouteSettings(models=("*",), primary="sg", pinnable=("llama",)),),
        **kw,
    )


def stream_events(p: ProxyUnderTest, engine: str, *, usage: bool = True) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"model": "m", "messages": MSGS, "stream": True, "max_tokens": TOKENS}
    if usage:
        body["stream_options"] = {"include_usage": True}
    out = []
    with p.client.stream("POST", "/v1/chat/completions", json=body, headers={"x-enginemeter-engine": engine}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def test_block_fields() -> None:
    t = StreamTimer(t_received_ns=1_000_000)
    t.t_sent_ns = 2_000_000
    t.token(52_000_000)  # 50 ms after sent
    t.token(92_000_000)
    t.token(132_000_000)  # 2 gaps of 40 ms
    b = timings_block(t, Usage(prompt_tokens=100, completion_tokens=3, cached_tokens=60), stream=True)
    assert (b["prompt_n"], b["cache_n"], b["predicted_n"]) == (40, 60, 3)
    assert b["prompt_ms"] == 50.0 and b["prompt_per_second"] == 800.0 and b["prompt_per_token_ms"] == 1.25
    assert b["predicted_ms"] == 80.0 and b["predicted_per_token_ms"] == 40.0 and b["predicted_per_second"] == 25.0
    assert b["total_ms"] is not None and b["total_ms"] >= 130.0
    assert b["measured_by"] == "enginemeter"
    nb = timings_block(t, None, stream=False)
    assert nb["prompt_ms"] is None and nb["predicted_ms"] is None and nb["predicted_n"] is None


def test_sglang_gets_a_block_llama_cpp_keeps_its_own(proxy_factory: ProxyFactory, engines: tuple[str, str]) -> None:
    llama, sglang = engines
    p = proxy_factory(settings(llama, sglang, add_timings=True))
    events = stream_events(p, "sg")
    (last,) = [e for e in events if e.get("usage")]
    t = last["timings"]
    assert t["measured_by"] == "enginemeter"
    assert t["predicted_n"] == last["usage"]["completion_tokens"] == TOKENS
    assert t["prompt_n"] == last["usage"]["prompt_tokens"] - (t["cache_n"] or 0)
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert last["model"] == "m"  # the client's name, as on every other event
    assert sum("timings" in e for e in events) == 1
    # non-stream: counts, the total, no prefill/decode split
    r = p.client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": TOKENS})
    doc = r.json()
    assert doc["timings"]["predicted_n"] == doc["usage"]["completion_tokens"] == TOKENS
    assert doc["timings"]["prompt_ms"] is None and doc["timings"]["total_ms"] > 0
    assert doc["model"] == "m"
    # llama.cpp-shaped answers are untouched: the engine's own block, as the engine sent it
    via_proxy = [e for e in stream_events(p, "llama") if "timings" in e]
    assert via_proxy and all("measured_by" not in e["timings"] for e in via_proxy)
    direct = httpx.post(
        f"{llama}/v1/chat/completions", json={"model": "x", "messages": MSGS, "max_tokens": TOKENS}, timeout=10
    ).json()
    body = p.client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": MSGS, "max_tokens": TOKENS},
        headers={"x-enginemeter-engine": "llama"},
    ).json()
    assert set(body["timings"]) == set(direct["timings"])


def test_off_by_default_per_engine_setting_and_no_usage_no_block(
    proxy_factory: ProxyFactory, engines: tuple[str, str]
) -> None:
    llama, sglang = engines
    p = proxy_factory(settings(llama, sglang))
    assert not any("timings" in e for e in stream_events(p, "sg"))
    s = settings(llama, sglang)
    on = replace(s, engines=(s.engines[0], replace(s.engines[1], add_timings=True)))
    p2 = proxy_factory(on)
    assert any("timings" in e for e in stream_events(p2, "sg"))
    # the block rides on the usage event: a client that did not ask for usage gets neither
    assert not any("timings" in e or e.get("usage") for e in stream_events(p2, "sg", usage=False))


def test_real_llama_server_untouched_emulated_sglang_measured(
    proxy_factory: ProxyFactory, llama_server: LlamaServer
) -> None:
    with run_emulator(EmulatorConfig(backend=llama_server.url, served_model_name="Qwen/Tiny")) as sglang:
        t = Timeouts(connect=2, read=60)
        p = proxy_factory(
            Settings(
                engines=(
                    EngineSettings(name="llama", url=llama_server.url, kind="llamacpp", timeouts=t),
                    EngineSettings(name="sg", url=sglang, kind="sglang", timeouts=t),
                ),
                routes=(RouteSettings(models=("*",), primary="sg", pinnable=("llama",)),),
                add_timings=True,
            )
        )
        body = {"model": "tiny", "messages": MSGS, "max_tokens": TOKENS, "temperature": 0}
        own = p.client.post("/v1/chat/completions", json=body, headers={"x-enginemeter-engine": "llama"}).json()
        assert "measured_by" not in own["timings"]
        assert own["timings"]["predicted_n"] == TOKENS and own["timings"]["prompt_ms"] > 0
        events = stream_events(p, "llama")
        assert [e for e in events if "timings" in e]
        assert all("measured_by" not in e["timings"] for e in events if "timings" in e)
        (last,) = [e for e in stream_events(p, "sg") if e.get("usage")]
        assert last["timings"]["measured_by"] == "enginemeter"
        assert last["timings"]["predicted_n"] == TOKENS
        assert last["timings"]["prompt_n"] == last["usage"]["prompt_tokens"] - last["timings"]["cache_n"]
