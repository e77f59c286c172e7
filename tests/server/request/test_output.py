"""``proxy.server.request.output``: the relay's direct path to the client's socket exists exactly where uvicorn's httptools
cycle is behind ``send`` (the installed uvicorn, real servers, real sockets), what it writes is a valid chunked
body, the connection stays reusable (the response's end still goes through uvicorn), and a client that stops
reading makes it ask for a flush (uvicorn's flow control) instead of buffering without bound.

The proxy's own relay runs over both outputs in tests/server/request/test_faults.py and tests/server/request/test_cancel.py (``socket`` and
``asgi-send`` ids)."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.settings import EngineSettings, RouteSettings, Settings
from proxy.server.request import responses
from proxy.server.request.output import Output, SendOutput, SocketOutput, socket_output, start
from proxy.server.workers.guard import server_options
from tests.helpers import ProxyFactory, run_uvicorn_app

CHUNKS = [b"data: one\n\n", b"data: two\n\n", b"x" * 70_000, b"data: [DONE]\n\n"]

App = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def relay_app(seen: list[dict[str, Any]], chunks: list[bytes]) -> App:
    """An ASGI app that streams ``chunks`` the way the relay does: head through ``send``, body through the
    output (``socket_output`` or ``SendOutput``), end through ``send``; records what it found."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        note: dict[str, Any] = {"client": scope["client"], "before_start": socket_output(send), "flushes": 0}
        seen.append(note)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        found = socket_output(send)
        note["after_start"] = found
        out: Output = found or SendOutput(send)
        for c in chunks:
            if out.write(c):
                note["flushes"] += 1
                await out.flush()
        await out.flush()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (server_options(), SocketOutput),  # enginemeter serve's protocol (uvicorn's httptools, guarded)
        ({"http": "httptools"}, SocketOutput),
        ({"http": "h11"}, type(None)),
    ],
    ids=["guarded-httptools", "httptools", "h11"],
)
def test_socket_output_only_behind_uvicorns_httptools_send(options: dict[str, Any], expected: type) -> None:
    seen: list[dict[str, Any]] = []
    with (
        run_uvicorn_app(relay_app(seen, CHUNKS), lifespan="off", **options) as url,
        httpx.Client(base_url=url) as client,
    ):
        for _ in range(2):
            r = client.get("/")
            assert r.status_code == 200
            assert r.headers["transfer-encoding"] == "chunked"
            assert r.content == b"".join(CHUNKS)
    assert len(seen) == 2
    for note in seen:
        assert note["before_start"] is None  # nothing to write to before the head is out
        assert type(note["after_start"]) is expected
    assert seen[0]["client"] == seen[1]["client"]  # one kept-alive connection: the cycle ended cleanly


def test_a_client_slower_than_the_writes_makes_the_socket_output_ask_for_a_flush() -> None:
    """16 MiB written without a pause, faster than any socket takes it: uvicorn's flow control pauses writing,
    ``write`` says so, and the writer waits (``flush``) instead of buffering it all."""
    chunks = [bytes([65 + i % 26]) * 65_536 for i in range(256)]  # 16 MiB, more than any socket buffer
    seen: list[dict[str, Any]] = []
    with run_uvicorn_app(relay_app(seen, chunks), lifespan="off", **server_options()) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            got = bytearray()
            while not got.endswith(b"0\r\n\r\n"):
                data = sock.recv(1 << 16)
                assert data, "the server closed before the end of the body"
                got += data
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    assert dechunk(body) == b"".join(chunks)
    (note,) = seen
    assert type(note["after_start"]) is SocketOutput
    assert note["flushes"] > 0  # write_paused was seen and waited out, not 16 MiB buffered


def dechunk(body: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        body = rest[size + 2 :]


@pytest.mark.parametrize(
    ("http", "path"), [(None, "straight to the client's socket"), ("h11", "through the server's ASGI send")]
)
def test_the_proxy_says_which_way_its_stream_chunks_go(
    proxy_factory: ProxyFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    http: str | None,
    path: str,
) -> None:
    """``enginemeter serve``'s server takes the direct path (a silent fallback to the slower ASGI path would show
    here); any other server the ASGI one. Logged once per process and path."""
    monkeypatch.setattr(responses, "_said", set())
    with run_in_thread(FaultEngineConfig(knobs=Knobs(tokens=3))) as engine:
        p = proxy_factory(
            Settings(
                engines=(EngineSettings(name="fake", url=engine, kind="llamacpp"),),
                routes=(RouteSettings(models=("*",), primary="fake"),),
            ),
            http=http,
        )
        with caplog.at_level("INFO", logger="enginemeter.relay"):
            for _ in range(2):
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
                r = p.client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stream chunks go")]
    assert len(said) == 1 and path in said[0], said


class _CountingTransport:
    """The client's transport, recording each write (what went out in one syscall)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.mark.parametrize("first", [b"data: one\n\n", None], ids=["first-chunk", "no-chunk"])
def test_the_head_goes_out_with_the_first_chunk_in_one_write(first: bytes | None) -> None:
    """``start`` holds the head uvicorn formatted and writes it with the first chunk (one syscall and one segment
    fewer per stream); with no chunk, ``flush`` sends it alone before the end. The response stays valid and the
    connection reusable."""
    writes: list[list[bytes]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        counting = _CountingTransport(send.__self__.transport)
        send.__self__.transport = counting
        writes.append(counting.writes)
        out = await start(send, {"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
        assert type(out) is SocketOutput
        if first is not None:
            out.write(first)
            out.write(b"data: two\n\n")
        await out.flush()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    with run_uvicorn_app(app, lifespan="off", **server_options()) as url, httpx.Client(base_url=url) as client:
        for _ in range(2):
            r = client.get("/")
            assert r.status_code == 200 and r.headers["x-a"] == "1"
            assert r.content == (first + b"data: two\n\n" if first else b"")
    for w in writes:
        assert w[0].startswith(b"HTTP/1.1 200 OK\r\n")
        if first is not None:
            assert w[0].endswith(b"\r\n\r\n%x\r\n%b\r\n" % (len(first), first)), w[0]  # head + chunk, one write
            assert len(w) == 3  # head and first chunk, the second chunk, the end
        else:
            assert w[0].endswith(b"\r\n\r\n") and len(w) == 2  # the head alone, then the end
