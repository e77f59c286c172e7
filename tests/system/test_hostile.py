"""Hostile clients and broken engines (issue 16): every case against the real proxy on a real socket, in front of
the fault engine (tests/server/request/test_cancel.py has the hang-ups, tests/system/test_fuzz.py the generated requests).

Each test is a row of the fault matrix in docs/reliability.md: what the client gets, what is counted.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import stat
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.configfile import load, quick
from proxy.config.settings import (
    EngineSettings,
    MirrorSettings,
    ModelAlias,
    RouteSettings,
    Settings,
    SettingsError,
    Timeouts,
)
from proxy.server.compose import build_app
from proxy.server.workers.guard import raise_fd_limit, server_options
from tests.helpers import ProxyFactory, ProxyUnderTest, run_uvicorn_app, wait_until

ALIAS = "team-model"
MSGS = [{"role": "user", "content": "hello there"}]


def settings_for(engine_url: str, **kw: Any) -> Settings:
    return Settings(
        engines=(EngineSettings(name="fake", url=engine_url, kind="llamacpp", timeouts=Timeouts(connect=2, read=30)),),
        routes=(RouteSettings(models=(ALIAS,), primary="fake"),),
        models=(ModelAlias(alias=ALIAS, engines={"fake": "served-name"}),),
        **kw,
    )


Start = Callable[..., tuple[str, ProxyUnderTest]]


@pytest.fixture
def start(proxy_factory: ProxyFactory) -> Iterator[Start]:
    with ExitStack() as stack:

        def go(knobs: Knobs | None = None, **kw: Any) -> tuple[str, ProxyUnderTest]:
            knobs = knobs or Knobs(tokens=4)
            engine_url = stack.enter_context(run_in_thread(FaultEngineConfig(model="engine-name", knobs=knobs)))
            return engine_url, proxy_factory(settings_for(engine_url, **kw))

        yield go


def assert_proxy_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err: dict[str, Any] = r.json()["error"]
    assert err["enginemeter"] is True and err["code"] == status
    return err


def post_raw(p: ProxyUnderTest, raw: bytes) -> httpx.Response:
    return p.client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})


def events_of(r: httpx.Response) -> list[bytes]:
    return [e for e in r.content.split(b"\n\n") if e]


# ------------------------------------------------------------------------------------ client input: 400s


@pytest.mark.parametrize(
    ("case", "raw"),
    [
        ("nested 5,000 deep", b'{"model":"team-model","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"),
        (
            "nested 300 deep",
            b'{"model":"team-model","messages":[{"role":"user","content":' + b"[" * 300 + b"]" * 300 + b"}]}",
        ),
        ("lone surrogate in content", b'{"model":"team-model","messages":[{"role":"user","content":"a\\ud800b"}]}'),
        ("lone surrogate in the model", b'{"model":"x\\udfff","messages":[{"role":"user","content":"a"}]}'),
        ("lone surrogate in a key", b'{"model":"team-model","\\ud800":1,"messages":[{"role":"user","content":"a"}]}'),
        ("NaN", b'{"model":"team-model","temperature":NaN,"messages":[{"role":"user","content":"a"}]}'),
        ("Infinity", b'{"model":"team-model","top_p":Infinity,"messages":[{"role":"user","content":"a"}]}'),
        ("-Infinity", b'{"model":"team-model","x":[-Infinity],"messages":[{"role":"user","content":"a"}]}'),
        ("number past a double", b'{"model":"team-model","seed":1e999,"messages":[{"role":"user","content":"a"}]}'),
        ("invalid UTF-8", b'{"model":"team-model","messages":[{"role":"user","content":"\xff\xfe"}]}'),
    ],
)
def test_hostile_bodies_get_one_counted_400(start: Start, case: str, raw: bytes) -> None:
    engine_url, p = start()
    assert_proxy_error(post_raw(p, raw), 400)
    assert p.total("enginemeter_requests_total", outcome="rejected") == 1
    assert p.total("enginemeter_requests_total") == 1
    assert httpx.get(f"{engine_url}/_fake/stats").json()["requests"] == 0


def test_lone_surrogate_model_in_the_quick_form_is_a_400(proxy_factory: ProxyFactory) -> None:
    with run_in_thread(FaultEngineConfig(model="engine-name", knobs=Knobs(tokens=4))) as engine_url:
        p = proxy_factory(quick(Settings(engines=(), routes=()), primary=engine_url))
        for stream in (False, True):
            raw = b'{"model":"\\ud800","stream":%s,"messages":[{"role":"user","content":"a"}]}' % (
                b"true" if stream else b"false"
            )
            assert_proxy_error(post_raw(p, raw), 400)
        assert p.total("enginemeter_requests_total", outcome="rejected") == 2
        assert httpx.get(f"{engine_url}/_fake/stats").json()["requests"] == 0


def test_a_valid_surrogate_pair_passes(start: Start) -> None:
    engine_url, p = start()
    raw = b'{"model":"team-model","messages":[{"role":"user","content":"\\ud83d\\ude00"}]}'
    r = post_raw(p, raw)
    assert r.status_code == 200, r.text
    (got,) = httpx.get(f"{engine_url}/_fake/requests").json()
    assert got["messages"][0]["content"] == "\U0001f600"


def test_a_large_body_is_parsed_and_answered(start: Start) -> None:
    """A 3.5 MB prompt is parsed on the event loop (~5 ms): a worker thread would not spare the loop, since orjson
    holds the GIL for the whole parse (docs/performance.md); what it costs shows in the loop-lag metric."""
    _, p = start()
    big = {"model": ALIAS, "messages": [{"role": "user", "content": "word " * 700_000}]}  # 3.5 MB
    r = p.client.post("/v1/chat/completions", json=big)
    assert r.status_code in (200, 400), r.text  # 400: the fake engine's context is too small, that is all
    if r.status_code == 400:
        assert r.json()["error"].get("enginemeter") is not True  # the engine's answer, not the proxy refusing it


# ------------------------------------------------------------------------------------------ responses


def test_non_stream_answer_with_spaced_json_is_json_not_sse(start: Start) -> None:
    _, p = start(Knobs(tokens=3, spaced=True))
    r = p.client.post("/v1/chat/completions", json={"model": ALIAS, "messages": MSGS})
    assert r.status_code == 200
    assert not r.content.startswith(b"data:"), r.content[:80]
    doc = r.json()
    assert doc["model"] == ALIAS
    assert doc["choices"][0]["message"]["content"]


def test_an_sse_event_without_data_does_not_end_the_stream(start: Start) -> None:
    _, p = start(Knobs(tokens=4, nodata_after=1))
    r = p.client.post("/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": True})
    events = events_of(r)
    assert b"event: ping" in events
    assert events[-1] == b"data: [DONE]"
    assert p.wait_results(1)[0].outcome == "ok"


def test_an_engine_event_nested_too_deep_is_an_in_band_error(start: Start) -> None:
    _, p = start(Knobs(tokens=6, deep_after=2))
    r = p.client.post("/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": True})
    last = json.loads(events_of(r)[-1][6:])
    assert last["error"]["enginemeter"] is True and last["error"]["code"] == 502
    assert p.wait_results(1)[0].outcome == "upstream_broken"
    assert p.total("enginemeter_requests_total", outcome="client_disconnect") == 0


def test_an_engine_event_over_the_size_limit_is_an_in_band_error(start: Start) -> None:
    _, p = start(Knobs(tokens=6, big_event_after=2))
    t0 = time.perf_counter()
    r = p.client.post("/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": True})
    took = time.perf_counter() - t0
    last = json.loads(events_of(r)[-1][6:])
    assert "exceeds" in last["error"]["message"] and last["error"]["enginemeter"] is True
    assert p.wait_results(1)[0].outcome == "upstream_broken"
    assert took < 5, f"a 10 MiB event took {took:.1f}s"


def test_http_1_0_clients_get_no_chunked_encoding(start: Start) -> None:
    _, p = start(Knobs(tokens=4))
    u = urlsplit(p.url)
    for stream in (True, False):
        body = json.dumps({"model": ALIAS, "messages": MSGS, "stream": stream}).encode()
        with socket.create_connection((u.hostname or "", u.port or 0)) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, payload = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding" not in head.lower()
        length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))  # fmt: skip
        assert length == len(payload)
        if stream:
            assert payload.endswith(b"data: [DONE]\n\n")


# ---------------------------------------------------------------------------------------------- engines


def test_engine_redirects_are_not_followed(start: Start) -> None:
    with run_in_thread(FaultEngineConfig(model="other")) as other_url:
        _, p = start(Knobs(status=307, location=f"{other_url}/v1/chat/completions"))
        for stream in (True, False):
            r = p.client.post("/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": stream})
            err = assert_proxy_error(r, 502)
            assert "redirect" in err["message"]
        assert httpx.get(f"{other_url}/_fake/stats").json()["requests"] == 0
        assert p.total("enginemeter_requests_total", outcome="upstream_broken") == 2


def test_an_engine_that_closes_without_answering_gets_the_request_once(start: Start) -> None:
    engine_url, p = start(Knobs(drop=True))
    # a kept-alive connection first, so a "stale connection" retry would have something to retry on
    httpx.get(f"{engine_url}/_fake/stats")
    for stream in (True, False):
        r = p.client.post("/v1/chat/completions", json={"model": ALIAS, "messages": MSGS, "stream": stream})
        assert_proxy_error(r, 502)
    assert httpx.get(f"{engine_url}/_fake/stats").json()["requests"] == 2  # one each, never a second copy


# ---------------------------------------------------------------------------------------- connections


@pytest.fixture
def guarded(proxy_factory: ProxyFactory) -> Iterator[Callable[[], tuple[str, str]]]:
    """The proxy with short connection limits: 0.5 s header deadline, 4 KiB head; (proxy url, engine url)."""
    with ExitStack() as stack:

        def go() -> tuple[str, str]:
            engine_url = stack.enter_context(run_in_thread(FaultEngineConfig(model="engine-name")))
            app = build_app(settings_for(engine_url))
            app.state.gateway.body_timeout_s = 0.5
            url = stack.enter_context(run_uvicorn_app(app, **server_options(header_timeout_s=0.5, max_head_bytes=4096)))
            return url, engine_url

        yield go


def connect(url: str) -> socket.socket:
    u = urlsplit(url)
    s = socket.create_connection((u.hostname or "", u.port or 0))
    s.settimeout(10)
    return s


def closed_by_server(s: socket.socket) -> bytes:
    """Everything the server sent until it closed the connection (raises on the 10 s socket timeout)."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_silent_connections_are_closed_at_the_header_deadline(guarded: Callable[[], tuple[str, str]]) -> None:
    url, _ = guarded()
    socks = [connect(url) for _ in range(50)]
    t0 = time.monotonic()
    for s in socks:
        closed_by_server(s)
        s.close()
    assert time.monotonic() - t0 < 3


def test_slowloris_headers_are_cut_off(guarded: Callable[[], tuple[str, str]]) -> None:
    url, _ = guarded()
    s = connect(url)
    t0 = time.monotonic()
    with pytest.raises(OSError):  # noqa: PT012 — the server closes while we still trickle
        for b in b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100:
            s.sendall(bytes([b]))
            time.sleep(0.1)  # the client's pace (slowloris), not synchronisation
    assert time.monotonic() - t0 < 3
    s.close()


def test_a_slow_body_gets_a_408(guarded: Callable[[], tuple[str, str]]) -> None:
    url, engine_url = guarded()
    s = connect(url)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"
    )
    data = closed_by_server(s)
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(body)["error"]["enginemeter"] is True
    assert httpx.get(f"{engine_url}/_fake/stats").json()["requests"] == 0


def test_an_oversized_head_gets_a_431(guarded: Callable[[], tuple[str, str]]) -> None:
    url, _ = guarded()
    for head in (
        b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n",  # one read
        b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-h: aaaaaaaaaaaaaaaaaaaa\r\n" * 400 + b"\r\n",
    ):
        s = connect(url)
        s.sendall(head)
        data = closed_by_server(s)
        s.close()
        assert data.startswith(b"HTTP/1.1 431"), data[:100]
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == 431


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 1024:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        new_soft, new_hard = raise_fd_limit()
        assert new_hard == hard
        assert new_soft == hard or (hard == resource.RLIM_INFINITY and new_soft >= soft)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ----------------------------------------------------------------------------------------- secrets, keys


def test_engine_url_secrets_never_surface(proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture) -> None:
    with run_in_thread(FaultEngineConfig(model="engine-name")) as engine_url:
        secret_url = engine_url.replace("http://", "http://user:hunter2@")
        caplog.set_level(logging.INFO)
        p = proxy_factory(settings_for(secret_url, api_keys=frozenset({"k"})))
        health = p.client.get("/health", headers={"authorization": "Bearer k"}).text  # the detail needs a key
        assert "hunter2" not in health and "user:***@" in health
        assert "hunter2" not in caplog.text
        assert "user:***@" in caplog.text


def test_an_empty_api_key_never_lets_an_empty_bearer_in(start: Start) -> None:
    _, p = start(api_keys=frozenset({""}))
    for auth in ("Bearer", "", "bearer", "Basic x"):  # uvicorn strips "Bearer " to "Bearer"
        r = p.client.post(
            "/v1/chat/completions", json={"model": ALIAS, "messages": MSGS}, headers={"authorization": auth}
        )
        assert_proxy_error(r, 401)


def test_a_numeric_admin_key_is_refused_at_load_and_never_a_500(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("admin_key: 1234\nengines:\n  - name: a\n    url: http://127.0.0.1:9\n")
    with pytest.raises(SettingsError, match="admin_key"):
        load(str(cfg))
    # and should a number reach the gateway anyway (settings built in code), it is compared as text
    with run_in_thread(FaultEngineConfig(model="engine-name")) as engine_url:
        settings = settings_for(engine_url)
        object.__setattr__(settings, "admin_key", 1234)
        p = proxy_factory(settings)
        assert_proxy_error(p.client.get("/admin/mirror", headers={"authorization": "Bearer 99"}), 401)
        assert p.client.get("/admin/mirror", headers={"authorization": "Bearer 1234"}).status_code == 200


# --------------------------------------------------------------------------------------- ids and logs


def test_a_client_request_id_is_echoed_but_pairing_uses_the_proxys(proxy_factory: ProxyFactory, tmp_path: Path) -> None:
    log_path = tmp_path / "pairs.jsonl"
    with run_in_thread(FaultEngineConfig(model="a")) as a, run_in_thread(FaultEngineConfig(model="b")) as b:
        p = proxy_factory(
            Settings(
                engines=(
                    EngineSettings(name="a", url=a, kind="llamacpp"),
                    EngineSettings(name="b", url=b, kind="llamacpp"),
                ),
                routes=(RouteSettings(models=("*",), primary="a", shadows=("b",)),),
                mirror=MirrorSettings(log_path=str(log_path), record_text=True),
            )
        )

        def one(_: int) -> httpx.Response:
            body = {"model": "m", "messages": MSGS, "stream": True}
            return p.client.post("/v1/chat/completions", json=body, headers={"x-request-id": "same"})

        with ThreadPoolExecutor(5) as pool:
            responses = list(pool.map(one, range(5)))
        assert all(r.headers["x-request-id"] == "same" for r in responses)
        assert len({r.headers["x-enginemeter-request-id"] for r in responses}) == 5
        wait_until(lambda: p.value("enginemeter_compared_pairs_total", primary="a", shadow="b") == 5, timeout=10)
        got = httpx.get(f"{a}/_fake/requests?full=1").json()
        assert {r["headers"]["x-request-id"] for r in got} == {"same"}  # sent on to the engine
        assert p.gateway.mirror is not None and p.gateway.mirror.log is not None
        p.gateway.mirror.log.flush()
        assert stat.S_IMODE(os.stat(log_path).st_mode) == 0o600
