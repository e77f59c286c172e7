"""Per engine: an ``httpx.AsyncClient`` (probes, health, engine state) and a ``StreamClient`` for the relay's
generation requests, both with explicit timeouts and pool limits; kind and model probing; cheap reachability
checks. Transport errors are mapped to ``proxy.errors`` in one place (``errors.from_transport_error``).

The relay's stream client is ``proxy.server.h1.H1Streams`` (plain asyncio connections and httptools; it replaced
``AiohttpStreams``, kept below, whose request path cost ~1 ms of CPU a request: docs/performance.md). Tests
fake engines as real servers on 127.0.0.1 (``fakes/``); the httpx client takes a ``transport``
(``httpx.MockTransport``) for probe and poll tests.

Probing (only when the config leaves ``kind`` / ``model`` out) and health checks are the engine dialects'
(``proxy.engines``): detection in dialect order (llama.cpp ``/props``, SGLang ``/server_info``, vLLM
``/version``, else openai), the served model from ``GET /v1/models``; health from each kind's cheap readiness
path (SGLang: ``/ready``, or ``/health`` on versions without it).
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import httpx
from yarl import URL

from proxy import engines
from proxy.errors import redact_url
from proxy.server.h1 import H1Streams
from proxy.settings import EngineSettings
from proxy.types import EngineKind

log = logging.getLogger("enginemeter.upstream")

#: idle upstream connections are dropped before the engine drops them: llama.cpp (cpp-httplib) and uvicorn-based
#: engines (SGLang, vLLM) close a kept-alive connection after 5 s idle, and reusing one that the engine is closing
#: fails with "Server disconnected without sending a response"
KEEPALIVE_EXPIRY_S = 4.0


def make_client(e: EngineSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The engine's httpx client for probes, health and state polls (``transport``: a test's MockTransport).

    Generation requests never go through it (``AiohttpStreams``), so a handful of connections is all it holds.
    """
    t = e.timeouts
    headers = {"authorization": f"Bearer {e.api_key}"} if e.api_key else {}
    limit = e.max_connections
    # credentials in the URL become Basic auth, never part of the base URL httpx logs each request with
    url = httpx.URL(e.url)
    auth = httpx.BasicAuth(url.username, url.password) if url.username or url.password else None
    return httpx.AsyncClient(
        base_url=url.copy_with(username=None, password=None) if auth else url,
        auth=auth,
        timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
        limits=httpx.Limits(
            max_connections=limit, max_keepalive_connections=limit, keepalive_expiry=KEEPALIVE_EXPIRY_S
        ),
        headers=headers,
        transport=transport,
        # the proxy forwards bytes as they are; never let httpx decode or re-encode them
        trust_env=False,
    )


class UpstreamResponse(Protocol):
    """What the relay needs of a response (``_AiohttpResponse``; ``httpx.Response`` is one as it is)."""

    @property
    def status_code(self) -> int: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class StreamClient(Protocol):
    """Sends a generation request; returns once the response headers are in, the body still unread."""

    async def post(
        self, path: str, content: bytes, headers: dict[str, str], after_write: Callable[[], None] | None = None
    ) -> UpstreamResponse:
        """``after_write``: called once the request is on its way (the engine works while the caller's
        bookkeeping runs), if it got that far."""
        ...

    async def aclose(self) -> None: ...


class AiohttpStreams:
    """Generation requests through one ``aiohttp.ClientSession`` per engine (made on first use, in the loop).

    Timeouts from ``EngineSettings.timeouts``: ``connect`` per new socket, ``pool`` + ``connect`` to get a
    connection at all (aiohttp's ``connect`` covers waiting for a free one), ``read`` between two reads (as
    httpx's). aiohttp has no write timeout; a request body is one small JSON document. Idle connections are
    dropped after ``KEEPALIVE_EXPIRY_S``, before the engine drops them. No cookies, no decompression.
    """

    def __init__(self, e: EngineSettings, max_connections: int) -> None:
        t = e.timeouts
        self._base = e.url.rstrip("/")
        self._limit = max_connections
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=t.pool + t.connect, sock_connect=t.connect, sock_read=t.read
        )
        self._headers = {"authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            headers=self._headers,
            auto_decompress=False,  # the proxy forwards the bytes the engine sent
            cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookies are no other client's business
            trust_env=False,
        )
        return self._session

    async def post(
        self, path: str, content: bytes, headers: dict[str, str], after_write: Callable[[], None] | None = None
    ) -> UpstreamResponse:
        session = self._session or self._open()
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self._base + path)
        # redirects are the relay's to refuse (a POST re-sent to another server), never followed here
        # bodies over 1 MiB as a stream (aiohttp writes them in 64 KiB pieces instead of warning about one write)
        data: bytes | io.BytesIO = content if len(content) < 1 << 20 else io.BytesIO(content)
        resp = await session.post(url, data=data, headers=headers, allow_redirects=False)
        if after_write is not None:
            after_write()
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class _AiohttpResponse:
    __slots__ = ("_resp", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()  # whatever the socket delivered, no generator of our own

    async def aread(self) -> bytes:
        return await self._resp.read()

    async def aclose(self) -> None:
        r = self._resp
        if r.content.at_eof():
            r.release()  # back to the pool
        else:
            r.close()  # cut off mid-body (client gone, error): close, so the engine frees its slot at once


@dataclass
class Engine:
    """An engine at run time: its settings, its client, and what probing learned."""

    settings: EngineSettings
    client: httpx.AsyncClient
    kind: EngineKind | None = None
    model: str | None = None
    up: bool | None = None
    last_error: str | None = None
    info: dict[str, object] = field(default_factory=dict)
    #: the relay's client for generation requests; made on first use (``proxy.server.h1.H1Streams``)
    stream_client: StreamClient | None = None

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def keeps_alive(self) -> bool:
        """Whether the relay may reuse a connection to this engine. Not llama.cpp's: llama-server closes after
        every streamed response though its headers say keep-alive, so a reused connection races its FIN — and
        the relay never retries a request on the same engine (it may already be generating). A full run of the
        test suite still met that race (a 502 "Server disconnected") with the pool learning it only after the
        first close; a fresh connection per request costs one loopback connect."""
        return self.effective_kind != "llamacpp"

    @property
    def streams(self) -> StreamClient:
        if self.stream_client is None:
            self.stream_client = H1Streams(self.settings, self.settings.max_connections, keep_alive=self.keeps_alive)
        return self.stream_client

    async def aclose(self) -> None:
        if self.stream_client is not None:
            await self.stream_client.aclose()
        await self.client.aclose()

    @property
    def effective_kind(self) -> EngineKind:
        return self.kind or "openai"

    async def probe(self, timeout: float = 3.0) -> None:
        """Fill in ``kind`` and ``model`` where the config left them out. Never raises."""
        p = await engines.probe(
            self.client, timeout, kind=self.settings.kind or self.kind, model=self.settings.model or self.model
        )
        self.kind, self.model = p.kind, p.model
        if p.context_length is not None:
            self.info["context_length"] = p.context_length
        self.up = p.error is None
        self.last_error = p.error
        if p.error:
            log.warning("probing engine %s at %s failed: %s", self.name, redact_url(self.settings.url), p.error)

    async def check(self, timeout: float = 2.0) -> dict[str, object]:
        """Cheap reachability check for /health (the kind's readiness path; never a generation where the
        engine has a cheaper signal)."""
        if self.kind is None or self.model is None:
            await self.probe(timeout)
        h = await engines.dialect(self.kind).health(self.client, timeout)
        self.up, self.last_error = h.up, h.error
        return {
            "name": self.name,
            "url": redact_url(self.settings.url),
            "kind": self.kind,
            "model": self.model,
            "up": self.up,
            **({"error": self.last_error} if self.last_error else {}),
        }


async def detect_kind(client: httpx.AsyncClient, timeout: float) -> EngineKind | None:
    """The engine's kind (``proxy.engines.detect``); None while it is loading. Kept for callers of the old name."""
    return await engines.detect(client, timeout)


async def probe_all(all_engines: list[Engine]) -> None:
    await asyncio.gather(*(e.probe() for e in all_engines))
