"""vLLM (sources read: 0.33.0; run on the H200: 0.26.0).

- detect: ``GET /version`` answers ``{"version": "0.26.0"}`` (SGLang 0.5.17 answers 404 there).
- health: ``GET /health``: 200, 503 when the engine is dead; empty body. The HTTP server only listens once the
  engine is ready, so "starting" is "connection refused".
- state: ``/v1/models`` (served id, ``root``, ``max_model_len``), ``/version`` (the build), busy =
  ``vllm:num_requests_running`` summed over engines on ``/metrics``. No ``/server_info`` outside dev mode (404
  on 0.26.0), and nothing reports ``max_num_seqs``: slots stay unknown. No dtype or quantization either.
- tokens: ``POST /tokenize`` with ``{"model","messages","add_generation_prompt":true}`` ->
  ``{"count","max_model_len","tokens"}``.
- cache: ``POST /reset_prefix_cache`` exists only with ``VLLM_SERVER_DEV_MODE=1`` (else 404).
- stream: the last content chunk carries ``finish_reason`` (no separate finish chunk); ``proxy.stream`` reads
  it wherever it comes.
- errors: nested ``{"error":{"message","type","param","code"}}`` (a context overflow: 400, ``param``
  ``"input_tokens"``); releases before the 2025 protocol split sent the flat SGLang-like shape, nested here.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence

import httpx

from proxy.engines.base import (
    Dialect,
    Facts,
    Message,
    PollError,
    TokenCount,
    as_int,
    as_str,
    get_json,
    metrics_busy,
    model_card,
    short,
)

_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


class Vllm(Dialect):
    kind = "vllm"
    health_path = "/health"
    detect_paths = ("/version",)

    def is_mine(self, path: str, r: httpx.Response) -> bool:
        try:
            doc = r.json()
        except ValueError:
            return False
        return isinstance(doc, dict) and "version" in doc

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> Facts:
        card = model_card(await get_json(client, "/v1/models", timeout))
        build = None
        with contextlib.suppress(PollError, httpx.HTTPError):
            v = await get_json(client, "/version", timeout)
            build = as_str(v.get("version")) if isinstance(v, dict) else None
        busy = None
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get("/metrics", timeout=timeout)
            found = _RUNNING.findall(r.text) if r.status_code == 200 else []
            busy = round(sum(float(x) for x in found)) if found else None
        return Facts(
            model=as_str(card.get("id")),
            model_path=as_str(card.get("root")),
            context_length=as_int(card.get("max_model_len")),
            busy_slots=busy,
            build=build,
        )

    async def busy(self, client: httpx.AsyncClient, timeout: float) -> int | None:
        return await metrics_busy(client, ("vllm:num_requests_running", "vllm:num_requests_waiting"), timeout)

    async def count_prompt_tokens(
        self, client: httpx.AsyncClient, model: str | None, messages: Sequence[Message]
    ) -> TokenCount:
        body = {"model": model, "messages": [dict(m) for m in messages], "add_generation_prompt": True}
        try:
            r = await client.post("/tokenize", json=body)
            if r.status_code != 200:
                return TokenCount(None, f"tokenize HTTP {r.status_code}")
            return TokenCount(int(r.json()["count"]), "tokenize")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            return TokenCount(None, short(exc, 120))

    async def flush_cache(self, client: httpx.AsyncClient) -> str | None:
        try:
            r = await client.post("/reset_prefix_cache", timeout=30)
        except httpx.HTTPError as exc:
            return f"reset_prefix_cache failed: {type(exc).__name__}"
        if r.status_code == 404:
            return "reset_prefix_cache HTTP 404 (needs VLLM_SERVER_DEV_MODE=1)"
        return f"reset_prefix_cache HTTP {r.status_code}"


DIALECT = Vllm()
