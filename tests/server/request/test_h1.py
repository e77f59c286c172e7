"""proxy/server/request/h1.py: the relay's upstream client, against the fault engine on a real socket."""

from __future__ import annotations

import asyncio
import dataclasses
import select
import socket
from collections.abc import Iterator

import pytest

from proxy.config.configfile import load
from proxy.errors import UpstreamConnectError, from_transport_error
from proxy.procs.process import free_port
from proxy.server.request.h1 import H1Streams, _peer_closed
from tests.helpers import ProcessServer

BODY = b'{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}'
PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    args = ("--tokens", "64", "--cadence-ms", "2", "--ttft-ms", "1")
    with ProcessServer("fakes.fault_engine", *args, ready_path="/health") as server:
        yield server.url


def _client(url: str, limit: int = 4) -> H1Streams:
    return H1Streams(load(primary=f"e={url}", env={}).engines[0], limit)


def test_a_whole_response_leaves_its_connection_for_the_next_request(engine_url: str) -> None:
    async def run() -> None:
        h = _client(engine_url)
        r = await h.post(PATH, BODY, HEADERS)
        assert r.status_code == 200
        body = b"".join([c async for c in r.aiter_raw()])
        assert body.rstrip().endswith(b"data: [DONE]")
        conn = r._conn
        await r.aclose()
        r2 = await h.post(PATH, BODY, HEADERS)
        assert r2._conn is conn  # kept alive, reused
        await r2.aread()
        await r2.aclose()
        await h.aclose()

    asyncio.run(run())


def test_a_response_closed_mid_body_closes_its_connection(engine_url: str) -> None:
    async def run() -> None:
        h = _client(engine_url)
        r = await h.post(PATH, BODY.replace(b'"max_tokens":4', b'"max_tokens":64'), HEADERS)
        await anext(r.aiter_raw())
        conn = r._conn
        await r.aclose()
        assert conn.transport is None or conn.transport.is_closing()  # the engine frees its slot
        r2 = await h.post(PATH, BODY, HEADERS)
        assert r2._conn is not conn
        await r2.aread()
        await r2.aclose()
        await h.aclose()

    asyncio.run(run())


def test_a_refused_connection_is_a_connect_error() -> None:
    async def run() -> None:
        h = _client(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(Exception) as info:
            await h.post(PATH, BODY, HEADERS)
        assert isinstance(from_transport_error(info.value, "e"), UpstreamConnectError)
        await h.aclose()

    asyncio.run(run())


# ------------------------------------------------------------------------- pump: the relay's read callback path


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _scripted_engine(script: list[tuple[float, bytes]]) -> tuple[asyncio.Server, str]:
    """A raw HTTP/1.1 engine on a real socket: reads one request, then writes each step's bytes after its pause
    (the engine's cadence), the first step together with the response head."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for pause, data in script:
                await asyncio.sleep(pause)
                writer.write(data)
            await writer.drain()
            await reader.read()  # until the client closes
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


class _SlowOutput:
    """A client that takes ``stall_s`` to accept the first read (a full socket), then keeps up."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.flushes = 0

    def write(self, data: bytes) -> bool:
        return self.flushes == 0

    async def flush(self) -> None:
        self.flushes += 1
        if self.flushes == 1:
            await asyncio.sleep(self.stall_s)  # the slow client, not synchronisation


def _pump(script: list[tuple[float, bytes]], *, stall_s: float, read_s: float) -> list[bytes]:
    got: list[bytes] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        return out.write(data)

    out = _SlowOutput(stall_s)

    async def run() -> None:
        server, url = await _scripted_engine(script)
        e = load(primary=f"e={url}", env={}).engines[0]
        h = H1Streams(dataclasses.replace(e, timeouts=dataclasses.replace(e.timeouts, read=read_s)), 4)
        r = await h.post(PATH, BODY, HEADERS)
        while not r._conn.chunks:  # the first event, as Attempt.open waits for it before relaying
            await r._conn.wait(read_s)
        await r.pump(sink, out)
        await r.aclose()
        await h.aclose()
        server.close()

    asyncio.run(run())
    return got


def test_reads_that_arrive_while_the_pump_flushes_its_first_read_are_relayed_in_order() -> None:
    a, b, c = b"data: A\n\n", b"data: B\n\n", b"data: C\n\n"
    got = _pump([(0, _chunk(a)), (0.01, _chunk(b)), (0.2, _chunk(c) + b"0\r\n\r\n")], stall_s=0.1, read_s=5)
    assert b"".join(got) == a + b + c


def test_a_client_slower_than_the_read_timeout_is_no_engine_timeout() -> None:
    """The engine's socket is paused while the client catches up: that time is not the engine's silence."""
    a, b = b"data: A\n\n", b"data: B\n\n"
    got = _pump([(0, _chunk(a)), (0.02, _chunk(b) + b"0\r\n\r\n")], stall_s=0.4, read_s=0.25)
    assert b"".join(got) == a + b


def test_an_idle_connection_the_engine_closed_is_stale_before_the_loop_reads_its_fin() -> None:
    """The pool's check before a reuse (``_peer_closed``) asks the kernel, not the loop: a FIN (or any bytes) on an
    idle connection that the loop has not read yet still keeps it out of use; an open, silent one passes."""

    async def run() -> None:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            port = srv.getsockname()[1]
            loop = asyncio.get_running_loop()
            lost: list[Exception | None] = []

            class P(asyncio.Protocol):
                def connection_lost(self, exc: Exception | None) -> None:
                    lost.append(exc)

            quiet, _ = await loop.create_connection(P, "127.0.0.1", port)
            quiet_peer, _ = srv.accept()
            talker, _ = await loop.create_connection(P, "127.0.0.1", port)
            talker_peer, _ = srv.accept()
            closer, _ = await loop.create_connection(P, "127.0.0.1", port)
            closer_peer, _ = srv.accept()
            assert not any(_peer_closed(t) for t in (quiet, talker, closer))
            talker_peer.sendall(b"HTTP/1.1 200 OK\r\n")  # bytes nobody asked for
            closer_peer.close()  # the engine's FIN
            for t in (talker, closer):  # wait for the kernel to hold them, without a turn of the loop
                select.select([t.get_extra_info("socket").fileno()], [], [], 10)
            assert _peer_closed(talker) and _peer_closed(closer) and not _peer_closed(quiet)
            assert lost == []  # the loop has not seen any of it
            for t in (quiet, talker, closer):
                t.close()
            quiet_peer.close()
            talker_peer.close()

    asyncio.run(run())
