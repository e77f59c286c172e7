"""Routing through the real proxy (uvicorn, real sockets) to fault engines: split, pin, fallback, headers.

The engines are ``fakes.fault_engine`` look-alikes of llama-server: routing is about which engine gets
the request, which the fakes record (``/_fake/stats``) and the proxy names in ``x-enginemeter-engine``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.settings import EngineSettings, RouteSettings, Settings, Timeouts
from proxy.procs.process import free_port
from proxy.server.record.result import Result
from tests.helpers import ProxyUnderTest, start_proxy, wait_until

MSGS = [{"role": "user", "content": "route me somewhere"}]


@dataclass
class Env:
    proxy: ProxyUnderTest
    engines: dict[str, str]

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def results(self) -> list[Result]:
        return self.proxy.results

    def served(self, name: str) -> int:
        r = httpx.get(f"{self.engines[name]}/_fake/stats", timeout=5)
        return int(r.json()["requests"])

    def value(self, name: str, **labels: str) -> float:
        return self.proxy.value(name, **labels)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with ExitStack() as stack:
        fast = Knobs(tokens=3, cadence_ms=0, ttft_ms=0)
        engines = {
            n: stack.enter_context(run_in_thread(FaultEngineConfig(model=f"model-{n}", knobs=fast)))
            for n in ("a", "b", "c")
        }
        # streams two token events, then the connection dies: a failure *after* the first byte
        engines["flaky"] = stack.enter_context(
            run_in_thread(FaultEngineConfig(model="flaky", knobs=Knobs(tokens=8, cadence_ms=5, die_after=2)))
        )
        engines["dead"] = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
        t = Timeouts(connect=2, read=10)
        settings = Settings(
            engines=tuple(EngineSettings(name=n, url=u, kind="llamacpp", timeouts=t) for n, u in engines.items()),
            routes=(
                RouteSettings(models=("split",), primary="a", split={"a": 1, "b": 3}, sticky_header="x-session-id"),
                RouteSettings(models=("pin",), primary="a", pinnable=("b",)),
                RouteSettings(models=("fallback",), primary="dead", fallback=("a",)),
                RouteSettings(models=("late",), primary="flaky", fallback=("a",)),
            ),
        )
        # module scope: one proxy for every test here
        yield Env(proxy=start_proxy(stack, settings), engines=engines)


def chat(env: Env, model: str, *, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": model, "messages": MSGS, "max_tokens": 3, **body}
    return env.proxy.client.post("/v1/chat/completions", json=payload, headers=headers or {}, timeout=20)


# ------------------------------------------------------------------------------------------------- split


def test_split_is_sticky_by_header_and_by_user(env: Env) -> None:
    for i in range(12):
        seen = {chat(env, "split", headers={"x-session-id": f"s{i}"}).headers["x-enginemeter-engine"] for _ in range(3)}
        assert len(seen) == 1, f"session s{i} moved between engines: {seen}"
        seen = {chat(env, "split", user=f"user-{i}").headers["x-enginemeter-engine"] for _ in range(3)}
        assert len(seen) == 1, f"user-{i} moved between engines: {seen}"


def test_split_follows_the_weights(env: Env) -> None:
    n = 200
    before = {e: env.served(e) for e in ("a", "b")}
    counts = Counter(
        chat(env, "split", headers={"x-session-id": f"k{i}"}).headers["x-enginemeter-engine"] for i in range(n)
    )
    assert set(counts) == {"a", "b"}
    # weights 1:3 -> b should get about 75 %; a generous band (binomial sd is 3 %)
    assert 0.6 < counts["b"] / n < 0.9, counts
    # the header tells the truth: the engines saw exactly these requests
    assert env.served("a") - before["a"] == counts["a"]
    assert env.served("b") - before["b"] == counts["b"]


# --------------------------------------------------------------------------------------------------- pin


def test_pin_header_picks_an_allowed_engine(env: Env) -> None:
    before = env.served("b")
    r = chat(env, "pin", headers={"x-enginemeter-engine": "b"})
    assert r.status_code == 200
    assert r.headers["x-enginemeter-engine"] == "b"
    assert r.json()["model"] == "pin"  # the client's alias comes back, not the engine's name
    assert env.served("b") == before + 1
    # a split engine may be pinned on a split route too
    assert chat(env, "split", headers={"x-enginemeter-engine": "a", "x-session-id": "k1"}).headers[
        "x-enginemeter-engine"
    ] == ("a")


def test_pin_to_a_disallowed_engine_is_a_400(env: Env) -> None:
    before = env.served("c")
    r = chat(env, "pin", headers={"x-enginemeter-engine": "c"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["enginemeter"] is True
    assert err["param"] == "x-enginemeter-engine"
    assert env.served("c") == before


# ---------------------------------------------------------------------------------------------- fallback


@pytest.mark.parametrize("stream", [False, True])
def test_fallback_when_the_primary_refuses_connections(env: Env, stream: bool) -> None:
    before = env.served("a")
    refused = env.value(
        "enginemeter_requests_total",
        engine="dead",
        model="other",
        role="primary",
        stream=str(stream).lower(),
        endpoint="chat",
        outcome="connect_error",
    )
    r = chat(env, "fallback", stream=stream, headers={"x-request-id": f"fb-{stream}"})
    assert r.status_code == 200
    assert r.headers["x-enginemeter-engine"] == "a"
    assert r.headers["x-request-id"] == f"fb-{stream}"  # the client's id is echoed ...
    rid = r.headers["x-enginemeter-request-id"]  # ... the proxy's own names the attempts
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    assert env.served("a") == before + 1
    wait_until(lambda: sum(1 for x in env.results if x.request_id == rid) == 2, timeout=10)
    mine = [x for x in env.results if x.request_id == rid]
    assert [(x.engine, x.outcome) for x in mine] == [("dead", "connect_error"), ("a", "ok")]
    assert (
        env.value(
            "enginemeter_requests_total",
            engine="dead",
            model="other",
            role="primary",
            stream=str(stream).lower(),
            endpoint="chat",
            outcome="connect_error",
        )
        == refused + 1
    )


def test_no_fallback_after_the_first_byte(env: Env) -> None:
    before = env.served("a")
    with httpx.stream(
        "POST",
        f"{env.url}/v1/chat/completions",
        json={"model": "late", "messages": MSGS, "max_tokens": 8, "stream": True},
        headers={"x-request-id": "late-1"},
        timeout=20,
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-enginemeter-engine"] == "flaky"
        rid = r.headers["x-enginemeter-request-id"]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    docs = [json.loads(e) for e in events if e != "[DONE]"]
    content = [d for d in docs if d.get("choices") and d["choices"][0]["delta"].get("content")]
    assert content, "the first token events reached the client"
    assert "error" in docs[-1] and docs[-1]["error"]["enginemeter"] is True
    wait_until(lambda: any(x.request_id == rid for x in env.results), timeout=10)
    assert [(x.engine, x.outcome) for x in env.results if x.request_id == rid] == [("flaky", "upstream_broken")]
    assert env.served("a") == before, "the fallback engine must not be tried once bytes were sent"


def test_unknown_model_is_a_404_from_the_proxy(env: Env) -> None:
    r = chat(env, "nope")
    assert r.status_code == 404
    assert r.json()["error"]["enginemeter"] is True
    assert r.headers["x-enginemeter-request-id"]
