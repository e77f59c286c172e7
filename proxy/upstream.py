"""One ``httpx.AsyncClient`` per engine, with explicit timeouts and pool limits; kind and model probing;
cheap reachability checks. Transport errors are mapped to ``proxy.errors`` in one place (``errors.from_httpx``).

Probing (only when the config leaves ``kind`` / ``model`` out), first answer wins:
``GET /props`` -> llamacpp, ``GET /server_info`` or ``/get_server_info`` -> sglang, ``GET /version`` -> vllm,
else openai. The served model name comes from ``GET /v1/models`` (``data[0].id``).

Health never generates: llama.cpp ``/health``, SGLang ``/ready`` (its ``/health`` runs a 1-token generation),
vLLM ``/health``, others ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from proxy.settings import EngineKind, EngineSettings

log = logging.getLogger("enginemeter.upstream")

#: idle upstream connections are dropped before the engine drops them: llama.cpp (cpp-httplib) and uvicorn-based
#: engines (SGLang, vLLM) close a kept-alive connection after 5 s idle, and reusing one that the engine is closing
#: fails with "Server disconnected without sending a response"
KEEPALIVE_EXPIRY_S = 4.0

HEALTH_PATH: dict[EngineKind, str] = {
    "llamacpp": "/health",
    "sglang": "/ready",
    "vllm": "/health",
    "openai": "/v1/models",
}


def make_client(
    e: EngineSettings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    max_connections: int | None = None,
) -> httpx.AsyncClient:
    t = e.timeouts
    headers = {"authorization": f"Bearer {e.api_key}"} if e.api_key else {}
    limit = max_connections or e.max_connections
    return httpx.AsyncClient(
        base_url=e.url,
        timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
        limits=httpx.Limits(
            max_connections=limit, max_keepalive_connections=limit, keepalive_expiry=KEEPALIVE_EXPIRY_S
        ),
        headers=headers,
        transport=transport if transport is not None else ShardedTransport(limit),
        # the proxy forwards bytes as they are; never let httpx decode or re-encode them
        trust_env=False,
    )


class ShardedTransport(httpx.AsyncBaseTransport):
    """Several small connection pools behind one transport; a request goes to the pool with the fewest in flight.

    Why: httpcore 1.0's pool re-examines every connection on each request start and end, and for each idle one
    it probes the socket (anyio builds an attribute dict with a ``getpeername`` call) and counts the whole
    pool again: O(n^2) per call. One pool of 256 connections cost seconds of CPU per burst of new streams
    (bench/overhead.py: +5.4 s TTFT p50 at 256 streams; docs/performance.md). Pools of <= 8 keep n small.
    Least-loaded choice keeps the shards even, so the total stays ``max_connections`` (rounded up).
    """

    def __init__(self, max_connections: int, per_shard: int = 8, keepalive_expiry: float = KEEPALIVE_EXPIRY_S) -> None:
        n = max(1, -(-max_connections // per_shard))
        size = -(-max_connections // n)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size, keepalive_expiry=keepalive_expiry)
        # one TLS context for all shards: building one costs ~70 ms, per shard that was seconds at start-up
        ssl_context = httpx.create_ssl_context()
        self._shards = [httpx.AsyncHTTPTransport(limits=limits, verify=ssl_context) for _ in range(n)]
        self._in_flight = [0] * n

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        i = self._in_flight.index(min(self._in_flight))
        self._in_flight[i] += 1
        try:
            response = await self._shards[i].handle_async_request(request)
        except BaseException:
            self._in_flight[i] -= 1
            raise
        response.stream = _Released(response.stream, self._in_flight, i)
        return response

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


class _Released(httpx.AsyncByteStream):
    """The response body stream; its close hands the shard's in-flight slot back (once)."""

    def __init__(self, stream: httpx.AsyncByteStream | httpx.SyncByteStream, counts: list[int], i: int) -> None:
        assert isinstance(stream, httpx.AsyncByteStream)
        self._stream, self._counts, self._i, self._open = stream, counts, i, True

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream.__aiter__()  # no generator of our own: one less hop per chunk

    async def aclose(self) -> None:
        if self._open:
            self._open = False
            self._counts[self._i] -= 1
        await self._stream.aclose()


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

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def effective_kind(self) -> EngineKind:
        return self.kind or "openai"

    async def probe(self, timeout: float = 3.0) -> None:
        """Fill in ``kind`` and ``model`` where the config left them out. Never raises."""
        self.kind = self.settings.kind or self.kind
        self.model = self.settings.model or self.model
        try:
            if self.kind is None:
                self.kind = await detect_kind(self.client, timeout)
            if self.model is None:
                r = await self.client.get("/v1/models", timeout=timeout)
                if r.status_code == 200:
                    data = r.json().get("data") or []
                    if data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
                        self.model = data[0]["id"]
            self.up = True
            self.last_error = None
        except (httpx.HTTPError, ValueError) as exc:
            self.up = False
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("probing engine %s at %s failed: %s", self.name, self.settings.url, self.last_error)

    async def check(self, timeout: float = 2.0) -> dict[str, object]:
        """Cheap reachability check for /health."""
        if self.kind is None or self.model is None:
            await self.probe(timeout)
        path = HEALTH_PATH[self.effective_kind]
        try:
            r = await self.client.get(path, timeout=timeout)
            self.up = r.status_code == 200
            self.last_error = None if self.up else f"HTTP {r.status_code} from {path}"
        except httpx.HTTPError as exc:
            self.up = False
            self.last_error = f"{type(exc).__name__}: {exc}"
        return {
            "name": self.name,
            "url": self.settings.url,
            "kind": self.kind,
            "model": self.model,
            "up": self.up,
            **({"error": self.last_error} if self.last_error else {}),
        }


async def detect_kind(client: httpx.AsyncClient, timeout: float) -> EngineKind:
    async def ok(path: str) -> bool:
        try:
            r = await client.get(path, timeout=timeout)
        except httpx.HTTPError:
            raise
        return r.status_code == 200

    if await ok("/props"):
        return "llamacpp"
    if await ok("/server_info") or await ok("/get_server_info"):
        return "sglang"
    if await ok("/version"):
        return "vllm"
    return "openai"


async def probe_all(engines: list[Engine]) -> None:
    await asyncio.gather(*(e.probe() for e in engines))
