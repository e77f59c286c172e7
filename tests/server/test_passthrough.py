"""Pass-through routes (proxy/server/passthrough.py) and trace-header forwarding, through the real proxy.

Fast tier: the fault engine (its ``/tokenize``, its recorded request headers) and a small recording engine
written here (embeddings with the served model name, a ``/v1/responses`` SSE stream held at a gate, so the
test can see the first event arrive while the engine still holds the second). Engine tier: a real llama-server
with ``--embeddings`` for ``/v1/embeddings``, ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fakes.fault_engine import FaultEngineConfig, run_in_thread
from proxy.config.settings import EngineSettings, ModelAlias, RouteSettings, Settings, Timeouts
from proxy.embedded import LlamaServer
from proxy.procs.process import free_port
from proxy.server.passthrough import endpoint_of
from tests.helpers import LlamaServerFactory, ProxyFactory, run_uvicorn_app, wait_until

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "vendor=abc"


class Recorder:
    """A tiny OpenAI-ish engine that records every request's path, headers and body."""

    def __init__(self, served: str) -> None:
        self.served = served
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.gate = threading.Event()
        #: /v1/hold: set once the request is in; gone_at: ``time.monotonic()`` when its client went away
        self.holding = threading.Event()
        self.gone_at = 0.0
        self.app = Starlette(
            routes=[
                Route("/v1/hold", self.hold, methods=["POST"]),
                Route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/files/{fid}", self.files, methods=["GET", "DELETE"]),
            ]
        )

    async def record(self, request: Request) -> bytes:
        body = await request.body()
        self.requests.append((request.url.path, dict(request.headers), body))
        return body

    async def hold(self, request: Request) -> Response:
        """Answers nothing until the client (the proxy) goes away; stamps when it did."""
        await self.record(request)
        self.holding.set()
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone_at = time.monotonic()
        return Response(status_code=204)

    async def transcriptions(self, request: Request) -> Response:
        await self.record(request)
        return JSONResponse({"text": "hello"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.served, "object": "model"}]})

    async def embeddings(self, request: Request) -> Response:
        await self.record(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
                "model": self.served,
                "usage": {"prompt_tokens": 2, "total_tokens": 2},
            }
        )

    async def files(self, request: Request) -> Response:
        await self.record(request)
        return JSONResponse({"id": request.path_params["fid"], "deleted": request.method == "DELETE"}, status_code=404)

    async def responses(self, request: Request) -> Response:
        await self.record(request)

        async def events() -> AsyncIterator[bytes]:
            yield b'event: response.created\ndata: {"type":"response.created"}\n\n'
            # the second event waits until the client has seen the first: a buffering proxy would deadlock here
            await anyio.to_thread.run_sync(self.gate.wait, 10.0)
            yield b'event: response.completed\ndata: {"type":"response.completed"}\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def recorders() -> Iterator[tuple[tuple[Recorder, str], tuple[Recorder, str]]]:
    a, b = Recorder("served-a"), Recorder("Org/Served-B")
    with ExitStack() as stack:
        yield (a, stack.enter_context(run_uvicorn_app(a.app))), (b, stack.enter_context(run_uvicorn_app(b.app)))


def two_routes(url_a: str, url_b: str, **kw: Any) -> Settings:
    """Alias ``emb`` -> engine b (as ``Org/Served-B``); every other model -> engine a."""
    t = Timeouts(connect=2, read=20)
    return Settings(
        engines=(
            EngineSettings(name="a", url=url_a, kind="openai", model="served-a", timeouts=t),
            EngineSettings(name="b", url=url_b, kind="vllm", model="Org/Served-B", timeouts=t),
        ),
        models=(ModelAlias(alias="emb", engines={"b": "Org/Served-B"}),),
        routes=(RouteSettings(models=("emb",), primary="b"), RouteSettings(models=("*",), primary="a")),
        **kw,
    )


def test_endpoint_labels() -> None:
    assert endpoint_of("/v1/embeddings") == "embeddings"
    assert endpoint_of("/v1/responses") == endpoint_of("/v1/responses/resp_1/cancel") == "responses"
    assert endpoint_of("/v1/rerank") == endpoint_of("/v1/score") == "rerank"
    assert endpoint_of("/v1/audio/transcriptions") == "audio"
    assert endpoint_of("/tokenize") == endpoint_of("/v1/tokenize") == "tokenize"
    assert endpoint_of("/detokenize") == "detokenize"
    assert endpoint_of("/v1/files/f1") == "other"


def test_embeddings_routed_by_model_alias_mapped_both_ways(
    proxy_factory: ProxyFactory, recorders: tuple[tuple[Recorder, str], tuple[Recorder, str]]
) -> None:
    (a, url_a), (b, url_b) = recorders
    p = proxy_factory(two_routes(url_a, url_b))
    r = p.client.post("/v1/embeddings", json={"model": "emb", "input": "hello"}, headers={"x-request-id": "e1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-enginemeter-engine"] == "b"
    assert r.json()["model"] == "emb"  # the served name mapped back to the client's alias
    assert int(r.headers["content-length"]) == len(r.content)
    assert not a.requests
    path, headers, body = b.requests[-1]
    assert path == "/v1/embeddings"
    assert httpx.Response(200, content=body).json() == {"model": "Org/Served-B", "input": "hello"}
    assert headers["x-request-id"] == "e1"
    (res,) = p.wait_results(1)
    assert (res.endpoint, res.engine, res.role, res.outcome, res.status) == ("embeddings", "b", "primary", "ok", 200)
    assert res.timing.e2e_s is not None and res.timing.e2e_s > 0
    assert p.value("enginemeter_requests_total", engine="b", model="emb", role="primary", stream="false", endpoint="embeddings", outcome="ok") == 1  # fmt: skip
    assert p.value("enginemeter_passthrough_duration_seconds_count", engine="b", model="emb", endpoint="embeddings") == 1  # fmt: skip
    assert p.value("enginemeter_in_flight_requests", engine="b", role="primary") == 0
    # an unknown model follows the * route and becomes the engine's served name, as for generation
    r = p.client.post("/v1/embeddings", json={"model": "whatever", "input": "x"})
    assert r.status_code == 200 and r.headers["x-enginemeter-engine"] == "a"
    assert r.json()["model"] == "whatever"
    assert httpx.Response(200, content=a.requests[-1][2]).json()["model"] == "served-a"


def test_no_model_goes_to_the_default_route_other_methods_and_statuses_pass(
    proxy_factory: ProxyFactory, recorders: tuple[tuple[Recorder, str], tuple[Recorder, str]]
) -> None:
    (a, url_a), (_, url_b) = recorders
    p = proxy_factory(two_routes(url_a, url_b))
    r = p.client.delete("/v1/files/f-7?purpose=x")
    assert r.status_code == 404  # the engine's status, not the proxy's
    assert r.json() == {"id": "f-7", "deleted": True}
    assert a.requests[-1][0] == "/v1/files/f-7"
    (res,) = p.wait_results(1)
    assert (res.endpoint, res.engine, res.outcome, res.status) == ("other", "a", "engine_error", 404)
    # the proxy's own paths are never passed on
    r = p.client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["enginemeter"] is True
    assert p.client.get("/v1/models").json()["data"]  # still the proxy's own list
    # a non-string model is the proxy's 400
    r = p.client.post("/v1/embeddings", json={"model": 3, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert p.value("enginemeter_requests_total", engine="none", model="other", role="primary", stream="false", endpoint="embeddings", outcome="rejected") == 1  # fmt: skip


def test_api_keys_guard_passthrough_routes_and_are_not_forwarded(
    proxy_factory: ProxyFactory, recorders: tuple[tuple[Recorder, str], tuple[Recorder, str]]
) -> None:
    (a, url_a), (_, url_b) = recorders
    p = proxy_factory(two_routes(url_a, url_b, api_keys=frozenset({"sk-team"})))
    r = p.client.post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status_code == 401 and not a.requests
    r = p.client.post("/v1/embeddings", json={"model": "m", "input": "x"}, headers={"authorization": "Bearer sk-team"})
    assert r.status_code == 200
    assert "authorization" not in a.requests[-1][1]  # the client's key stays with the proxy


def test_sse_stream_is_relayed_unbuffered(
    proxy_factory: ProxyFactory, recorders: tuple[tuple[Recorder, str], tuple[Recorder, str]]
) -> None:
    (a, url_a), (_, url_b) = recorders
    p = proxy_factory(two_routes(url_a, url_b))
    with p.client.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"  # arrived while the engine holds the next event
        a.gate.set()
        rest = list(lines)
    assert 'data: {"type":"response.completed"}' in rest
    (res,) = p.wait_results(1)
    assert (res.endpoint, res.stream, res.outcome) == ("responses", True, "ok")


def test_client_disconnect_cancels_the_upstream_stream(
    proxy_factory: ProxyFactory, recorders: tuple[tuple[Recorder, str], tuple[Recorder, str]]
) -> None:
    (a, url_a), (_, url_b) = recorders
    p = proxy_factory(two_routes(url_a, url_b))
    try:
        with p.client.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "stream": True}) as r:
            assert next(r.iter_lines()) == "event: response.created"
        # the client hung up while the engine still holds its second event: recorded at once, not at the gate
        (res,) = p.wait_results(1, timeout=5)
        assert (res.endpoint, res.outcome) == ("responses", "client_disconnect")
        assert not a.gate.is_set()
        wait_until(lambda: p.value("enginemeter_in_flight_requests", engine="a", role="primary") == 0)
    finally:
        a.gate.set()


def test_unreachable_engine_is_a_502(proxy_factory: ProxyFactory) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    p = proxy_factory(
        Settings(
            engines=(EngineSettings(name="gone", url=dead, kind="openai", model="m", timeouts=Timeouts(connect=2)),),
            routes=(RouteSettings(primary="gone"),),
        )
    )
    r = p.client.post("/tokenize", json={"content": "a b"})
    assert r.status_code == 502 and r.json()["error"]["enginemeter"] is True
    (res,) = p.wait_results(1)
    assert (res.endpoint, res.outcome) == ("tokenize", "connect_error")
    assert p.value("enginemeter_in_flight_requests", engine="gone", role="primary") == 0


def fault_requests(url: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = httpx.get(f"{url}/_fake/requests?full=1", timeout=5).json()
    return out


def test_trace_headers_reach_every_engine_never_mirrored_passthrough(proxy_factory: ProxyFactory) -> None:
    with run_in_thread(FaultEngineConfig()) as primary, run_in_thread(FaultEngineConfig()) as shadow:
        t = Timeouts(connect=2, read=20)
        p = proxy_factory(
            Settings(
                engines=(
                    EngineSettings(name="p", url=primary, kind="llamacpp", model="fault-engine", timeouts=t),
                    EngineSettings(name="s", url=shadow, kind="llamacpp", model="fault-engine", timeouts=t),
                ),
                routes=(RouteSettings(primary="p", shadows=("s",)),),
            )
        )
        trace = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with p.client.stream("POST", "/v1/chat/completions", json=body, headers=trace) as r:
            assert r.status_code == 200
            r.read()
        wait_until(lambda: len(p.of("shadow")) == 1 and len(p.of("primary")) == 1)
        r = p.client.post("/tokenize", json={"content": "one two three"}, headers=trace)
        assert r.status_code == 200 and len(r.json()["tokens"]) == 3
        wait_until(lambda: len(p.results) == 3)
        seen_p, seen_s = fault_requests(primary), fault_requests(shadow)
        assert [q["path"] for q in seen_p] == ["/v1/chat/completions", "/tokenize"]
        assert [q["path"] for q in seen_s] == ["/v1/chat/completions"]  # the pass-through was not mirrored
        for q in [*seen_p, *seen_s]:
            assert q["headers"]["traceparent"] == TRACEPARENT
            assert q["headers"]["tracestate"] == TRACESTATE
        assert p.total("enginemeter_mirror_requests_total", result="sent") == 1
        # a request without trace headers sends none
        p.client.post("/tokenize", json={"content": "x"})
        assert "traceparent" not in fault_requests(primary)[-1]["headers"]


def test_llama_server_embeddings_tokenize_detokenize(
    proxy_factory: ProxyFactory, llama_server_factory: LlamaServerFactory
) -> None:
    server: LlamaServer = llama_server_factory(extra_args=["--embeddings", "--pooling", "mean"])
    p = proxy_factory(
        Settings(
            engines=(EngineSettings(name="llama", url=server.url, kind="llamacpp"),),
            models=(ModelAlias(alias="embedder", engines={"llama": "tiny"}),),
            routes=(RouteSettings(models=("*",), primary="llama"),),
        )
    )
    direct = httpx.post(f"{server.url}/v1/embeddings", json={"model": "tiny", "input": "hello world"}, timeout=30)
    assert direct.status_code == 200, direct.text
    r = p.client.post("/v1/embeddings", json={"model": "embedder", "input": "hello world"})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"] == direct.json()["data"][0]["embedding"]
    assert r.json()["model"] == "embedder"
    tokens = p.client.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert tokens == httpx.post(f"{server.url}/tokenize", json={"content": "hello world"}, timeout=10).json()["tokens"]
    text = p.client.post("/detokenize", json={"tokens": tokens}).json()["content"]
    assert text.strip() == "hello world"
    p.wait_results(3)
    assert [r.endpoint for r in p.results] == ["embeddings", "tokenize", "detokenize"]
    assert all(r.outcome == "ok" and r.engine == "llama" for r in p.results)


# ------------------------------------------------------------------------------ paths, intake, hang-ups (issue 20)


def raw_request(
    url: str, method: str, target: str, body: bytes = b"", **headers: str
) -> tuple[int, bytes, dict[str, str]]:
    """One request whose target goes on the wire exactly as written (httpx would resolve ``..`` client-side)."""
    u = httpx.URL(url)
    conn = http.client.HTTPConnection(u.host, u.port, timeout=30)
    try:
        conn.request(method, target, body=body or None, headers={"content-type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def assert_proxy_404(status: int, body: bytes, headers: dict[str, str]) -> str:
    assert status == 404, (status, body[:300])
    err = json.loads(body)["error"]
    assert err["enginemeter"] is True and err["code"] == 404, err
    assert "x-enginemeter-engine" not in headers  # no engine was involved
    message: str = err["message"]
    return message


#: targets that must never reach an engine: (method, target, what the 404 says)
ESCAPES = [
    ("GET", "/v1/../slots", "Not Found"),
    ("POST", "/v1/../completion", "Not Found"),
    ("POST", "/v1/%2e%2e/slots/0?action=erase", "Not Found"),
    ("POST", "/v1/..%2fslots/0?action=erase", "Not Found"),
    ("POST", "/v1/%2E%2E%2Fslots/0?action=erase", "Not Found"),
    ("GET", "/v1/%252e%252e/slots", "encoded dot"),
    ("GET", "/v1/%252fslots", "encoded dot"),
    ("GET", "/v1/..%5cslots", "encoded dot"),
    ("GET", "/tokenize/../slots", "Not Found"),
    ("POST", "/tokenize/", "Not Found"),  # not a redirect to /tokenize either
    ("GET", "/v1/embeddings/../../slots", "Not Found"),
    ("POST", "/v1/./chat/completions", "only at /v1/chat/completions"),
    ("POST", "/v1//chat/completions", "only at /v1/chat/completions"),
    ("POST", "/v1/chat/completions/", "only at /v1/chat/completions"),
    ("POST", "/v1/x/../completions", "only at /v1/completions"),
    ("POST", "//v1/%63hat/completions", "only at /v1/chat/completions"),
    ("GET", "/v1/models/", "only at /v1/models"),
]


@pytest.mark.parametrize(("method", "target", "says"), ESCAPES)
def test_paths_are_confined_before_routing_and_forwarding(
    proxy_factory: ProxyFactory, method: str, target: str, says: str
) -> None:
    with run_in_thread(FaultEngineConfig()) as engine:
        p = proxy_factory(Settings(engines=(EngineSettings(name="e", url=engine, kind="llamacpp"),), routes=(RouteSettings(primary="e"),)))  # fmt: skip
        body = b'{"model":"m","prompt":"hi","messages":[{"role":"user","content":"hi"}]}' if method == "POST" else b""
        assert says in assert_proxy_404(*raw_request(p.url, method, target, body))
        assert fault_requests(engine) == []  # nothing reached the engine, on no path
        assert p.results == []


def test_a_normalised_path_in_the_pass_through_set_is_forwarded_in_its_normal_form(proxy_factory: ProxyFactory) -> None:
    with run_in_thread(FaultEngineConfig()) as engine:
        p = proxy_factory(Settings(engines=(EngineSettings(name="e", url=engine, kind="llamacpp"),), routes=(RouteSettings(primary="e"),)))  # fmt: skip
        for target in ("//tokenize", "/v1/../tokenize", "/./tokenize?x=1"):
            status, body, _ = raw_request(p.url, "POST", target, b'{"content":"a b"}')
            assert status == 200, body
        assert [q["path"] for q in fault_requests(engine)] == ["/tokenize"] * 3  # never the client's raw string


def test_llama_server_slots_and_native_routes_are_out_of_reach(
    proxy_factory: ProxyFactory, llama_server_factory: LlamaServerFactory, tmp_path: Path
) -> None:
    """The attack of issue 20 on a real llama-server behind an api key: erasing a slot or reading /slots (the
    prompts in flight) through ``/v1/..`` with the engine's own key, and its native /completion unmeasured."""
    key = "engine-secret"
    server = llama_server_factory(extra_args=["--api-key", key, "--slot-save-path", str(tmp_path), "--metrics"])
    auth = {"authorization": f"Bearer {key}"}
    p = proxy_factory(
        Settings(
            engines=(EngineSettings(name="llama", url=server.url, kind="llamacpp", api_key=key),),
            routes=(RouteSettings(primary="llama"),),
        )
    )
    r = p.client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "the prompt in slot zero"}]})  # fmt: skip
    assert r.status_code == 200, r.text

    def prompt_tokens() -> float:
        text = httpx.get(f"{server.url}/metrics", headers=auth, timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("llamacpp:prompt_tokens_total"))  # fmt: skip

    before = prompt_tokens()
    for method, target, _ in ESCAPES:
        body = b'{"prompt":"escape","n_predict":4,"messages":[{"role":"user","content":"x"}]}'
        status, got, headers = raw_request(p.url, method, target, body if method == "POST" else b"")
        assert_proxy_404(status, got, headers)
        assert b"n_ctx" not in got and b"slot zero" not in got
    assert prompt_tokens() == before  # /completion was never reached
    # the slot's cache is still there: erasing it now, directly, erases tokens
    erased = httpx.post(f"{server.url}/slots/0?action=erase", headers=auth, timeout=10)
    assert erased.status_code == 200 and erased.json()["n_erased"] > 0, erased.text
    assert [r.endpoint for r in p.results] == ["chat"]


@pytest.mark.parametrize(
    ("case", "raw"),
    [
        ("nested 5,000 deep", b'{"content":' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("nested 300 deep", b'{"content":' + b"[" * 300 + b"]" * 300 + b"}"),
        ("lone surrogate", b'{"content":"a\\ud800b"}'),
        ("lone surrogate in the model", b'{"model":"\\udfff","content":"a"}'),
        ("NaN", b'{"content":"a","x":NaN}'),
        ("Infinity", b'{"content":"a","x":[-Infinity]}'),
        ("invalid UTF-8", b'{"content":"\xff\xfe"}'),
        ("cut off", b'{"content":"a'),
        ("an array", b'[{"content":"a"}]'),
    ],
)
def test_hostile_json_on_pass_through_is_one_counted_400(proxy_factory: ProxyFactory, case: str, raw: bytes) -> None:
    with run_in_thread(FaultEngineConfig()) as engine:
        p = proxy_factory(Settings(engines=(EngineSettings(name="e", url=engine, kind="llamacpp"),), routes=(RouteSettings(primary="e"),)))  # fmt: skip
        # as JSON, and as curl -d sends it (a form: llama.cpp reads the body as JSON whatever its type)
        for ctype in ("application/json", "application/x-www-form-urlencoded"):
            r = p.client.post("/tokenize", content=raw, headers={"content-type": ctype})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["enginemeter"] is True
        assert fault_requests(engine) == []
        assert p.total("enginemeter_requests_total", endpoint="tokenize", outcome="rejected", engine="none") == 2
        assert p.total("enginemeter_requests_total") == 2


def test_a_multipart_body_passes_as_bytes(
    proxy_factory: ProxyFactory, recorders: tuple[tuple[Recorder, str], tuple[Recorder, str]]
) -> None:
    (a, url_a), (_, url_b) = recorders
    p = proxy_factory(two_routes(url_a, url_b))
    files = {"file": ("x.wav", b"{NaN \xff not json", "audio/wav")}
    r = p.client.post("/v1/audio/transcriptions", files=files, data={"model": "m"})
    assert r.status_code == 200, r.text
    path, _, body = a.requests[-1]
    assert path == "/v1/audio/transcriptions" and b"{NaN \xff not json" in body


def test_a_pass_through_body_that_trickles_gets_a_408(proxy_factory: ProxyFactory) -> None:
    with run_in_thread(FaultEngineConfig()) as engine:
        p = proxy_factory(Settings(engines=(EngineSettings(name="e", url=engine, kind="llamacpp"),), routes=(RouteSettings(primary="e"),)))  # fmt: skip
        p.gateway.body_timeout_s = 0.5
        u = httpx.URL(p.url)
        with socket.create_connection((u.host, u.port)) as s:
            s.settimeout(10)
            s.sendall(
                b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"
            )
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data
        assert json.loads(body)["error"]["enginemeter"] is True
        assert fault_requests(engine) == []
        assert p.total("enginemeter_requests_total", endpoint="tokenize", outcome="rejected") == 1


def test_a_client_that_leaves_before_the_engine_answers_cancels_the_upstream_request(
    proxy_factory: ProxyFactory, recorders: tuple[tuple[Recorder, str], tuple[Recorder, str]]
) -> None:
    (a, url_a), (_, url_b) = recorders
    p = proxy_factory(two_routes(url_a, url_b))  # read timeout 20 s: the old code noticed only then
    u = httpx.URL(p.url)
    s = socket.create_connection((u.host, u.port))
    body = b'{"model":"m","input":"x"}'
    s.sendall(b"POST /v1/hold HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    assert a.holding.wait(10), "the engine never got the request"
    t_hangup = time.monotonic()
    s.close()
    gone_at = wait_until(lambda: a.gone_at, timeout=5, message="the engine seeing the hang-up")
    print(f"hang-up -> engine: {(gone_at - t_hangup) * 1e3:.1f} ms")
    assert gone_at - t_hangup < 1.0
    (res,) = p.wait_results(1)
    assert (res.endpoint, res.outcome) == ("other", "client_disconnect")
    wait_until(lambda: p.value("enginemeter_in_flight_requests", engine="a", role="primary") == 0)
    assert p.total("enginemeter_requests_total", outcome="timeout") == 0


def test_engine_credentials_in_the_url_reach_every_route(proxy_factory: ProxyFactory) -> None:
    with run_in_thread(FaultEngineConfig()) as primary, run_in_thread(FaultEngineConfig()) as shadow:
        p = proxy_factory(
            Settings(
                engines=(
                    EngineSettings(name="p", url=primary.replace("http://", "http://user:p%40ss@"), kind="llamacpp", model="m"),
                    EngineSettings(name="s", url=shadow.replace("http://", "http://u2:pw2@"), kind="llamacpp", model="m", api_key="sk-s"),
                ),
                routes=(RouteSettings(primary="p", shadows=("s",)),),
            )
        )  # fmt: skip
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for stream in (True, False):
            assert p.client.post("/v1/chat/completions", json={**body, "stream": stream}).status_code == 200
        assert p.client.post("/tokenize", json={"content": "a"}).status_code == 200
        wait_until(lambda: len(fault_requests(shadow)) == 2)
        basic = "Basic " + base64.b64encode(b"user:p@ss").decode()
        assert [q["headers"].get("authorization") for q in fault_requests(primary)] == [basic] * 3
        # an api_key wins over the URL's credentials (one header, one credential), on the shadow's pool too
        assert [q["headers"].get("authorization") for q in fault_requests(shadow)] == ["Bearer sk-s"] * 2


def test_the_proxys_errors_never_show_an_engines_address(proxy_factory: ProxyFactory) -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    p = proxy_factory(
        Settings(
            engines=(EngineSettings(name="gone", url=dead, kind="llamacpp", model="m", timeouts=Timeouts(connect=2)),),
            routes=(RouteSettings(primary="gone"),),
        )
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answers = [
        p.client.post("/v1/chat/completions", json={**body, "stream": True}),
        p.client.post("/v1/chat/completions", json=body),
        p.client.post("/tokenize", json={"content": "a"}),
    ]
    for r in answers:
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["enginemeter"] is True and "'gone' is unreachable: Connection refused" in err["message"], err
        assert str(port) not in r.text and "127.0.0.1" not in r.text
