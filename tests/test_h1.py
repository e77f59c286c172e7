"""proxy/server/h1.py: the relay's upstream client, against the fault engine on a real socket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from proxy.configfile import load
from proxy.errors import UpstreamConnectError, from_transport_error
from proxy.server.h1 import H1Streams
from tests.helpers import ProcessServer, free_port

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
