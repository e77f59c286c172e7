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
from dataclasses import dataclass, field

import httpx

from proxy.settings import EngineKind, EngineSettings

log = logging.getLogger("enginemeter.upstream")

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
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit, keepalive_expiry=30),
        headers=headers,
        transport=transport,
        # the proxy forwards bytes as they are; never let httpx decode or re-encode them
        trust_env=False,
    )


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
