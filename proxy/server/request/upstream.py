"""Per engine: an ``httpx.AsyncClient`` (probes, health, engine state) and a ``StreamClient`` for the relay's
generation requests, both with explicit timeouts and pool limits; kind and model probing; cheap reachability
checks. Transport errors are mapped to ``proxy.errors`` in one place (``errors.from_transport_error``).

The relay's stream client is ``proxy.server.request.h1.H1Streams`` (plain asyncio connections and httptools; it replaced
an aiohttp client whose request path cost ~1 ms of CPU a request: docs/performance.md). Tests
fake engines as real servers on 127.0.0.1 (``fakes/``); the httpx client takes a ``transport``
(``httpx.MockTransport``) for probe and poll tests.

Probing (only when the config leaves ``kind`` / ``model`` out) and health checks are the engine dialects'
(``proxy.engines``): detection in dialect order (llama.cpp ``/props``, SGLang ``/server_info``, vLLM
``/version``, else openai), the served model from ``GET /v1/models``; health from each kind's cheap readiness
path (SGLang: ``/ready``, or ``/health`` on versions without it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import httpx

from proxy import engines
from proxy.config.settings import EngineSettings
from proxy.errors import redact_url
from proxy.server.request.h1 import H1Streams, authorization
from proxy.types import EngineKind

if TYPE_CHECKING:
    from proxy.server.request.output import Output

log = logging.getLogger("enginemeter.upstream")

#: idle upstream connections are dropped before the engine drops them: llama.cpp (cpp-httplib) and uvicorn-based
#: engines (SGLang, vLLM) close a kept-alive connection after 5 s idle, and reusing one that the engine is closing
#: fails with "Server disconnected without sending a response"
KEEPALIVE_EXPIRY_S = 4.0


def make_client(e: EngineSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The engine's httpx client for probes, health and state polls (``transport``: a test's MockTransport).

    Generation requests never go through it (``H1Streams``), so a handful of connections is all it holds.
    """
    t = e.timeouts
    # the engine's credentials, as the relay sends them (h1.authorization); never part of the base URL, which
    # httpx logs each request with
    credentials = authorization(e)
    headers = {"authorization": credentials} if credentials else {}
    limit = e.max_connections
    return httpx.AsyncClient(
        base_url=httpx.URL(e.url).copy_with(username=None, password=None),
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
    """What the relay needs of a response (``h1._H1Response``)."""

    @property
    def status_code(self) -> int: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def pump(self, sink: Callable[[bytes], bool], output: Output) -> None:
        """The rest of the body to ``sink`` from the connection's read callback (``h1._H1Response.pump``)."""
        ...

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
    #: the relay's client for generation requests; made on first use (``proxy.server.request.h1.H1Streams``)
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
