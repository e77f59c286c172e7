"""llama.cpp ``llama-server`` (source read at ggml-org/llama.cpp@0c1e57098; tests run the sdist build 11434).

- detect: ``GET /props`` answers 200 (SGLang and vLLM have no ``/props``). While the model loads, a middleware
  answers every path with 503, so a loading server is "cannot tell yet", never another kind.
- health: ``GET /health``: 200 ``{"status":"ok"}``, 503 ``{"error":{"message":"Loading model",..}}`` while loading.
- state: ``/props`` (``default_generation_settings.n_ctx`` per slot, ``total_slots``, ``model_path``,
  ``model_ftype``, ``build_info``), ``/slots`` (busy = ``is_processing`` count; 501 with ``--no-slots``: busy is
  unknown), ``/v1/models`` (served id; ``meta.ftype`` is the numeric ``llama_ftype``).
- tokens: ``POST /v1/chat/completions/input_tokens`` with the chat body (newest builds; the generation path),
  else ``/apply-template`` then ``/tokenize`` with ``add_special`` and ``parse_special`` (``/tokenize`` defaults
  to ``add_special:false``; generation tokenizes with both true).
- cache: ``POST /slots/{id}?action=erase`` for every slot — only with ``--slot-save-path`` (else 501
  ``not_supported_error``); without it a request skips the cache with ``cache_prompt: false``.
- errors: already nested, ``{"error":{"code","message","type"}}``; a context overflow adds ``n_prompt_tokens``
  and ``n_ctx`` (HTTP 400 ``exceed_context_size_error``, also for ``stream:true``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import httpx

from proxy.engines.base import (
    Dialect,
    Facts,
    Message,
    PollError,
    TokenCount,
    as_dict,
    as_int,
    as_str,
    body_message,
    get_json,
    metrics_busy,
    model_card,
    short,
)

#: llama_ftype numbers (``/v1/models`` ``meta.ftype``) of the common GGUF types
FTYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}  # fmt: skip


def ftype_name(v: object) -> str | None:
    if isinstance(v, str):
        return v or None
    i = as_int(v)
    return None if i is None else FTYPE_NAMES.get(i, f"ftype{i}")


class LlamaCpp(Dialect):
    kind = "llamacpp"
    health_path = "/health"
    detect_paths = ("/props",)

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> Facts:
        props = await get_json(client, "/props", timeout)
        if not isinstance(props, dict):
            raise PollError("/props is not an object")
        n_ctx = as_int(as_dict(props.get("default_generation_settings")).get("n_ctx"))
        card: dict[str, Any] = {}
        with contextlib.suppress(PollError, httpx.HTTPError):
            card = model_card(await get_json(client, "/v1/models", timeout))
        busy = None
        with contextlib.suppress(PollError, httpx.HTTPError):
            slots = await get_json(client, "/slots", timeout)
            if isinstance(slots, list):
                busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing") is True)
                if n_ctx is None and slots and isinstance(slots[0], dict):
                    n_ctx = as_int(slots[0].get("n_ctx"))
        return Facts(
            model=as_str(card.get("id")) or as_str(props.get("model_alias")),
            model_path=as_str(props.get("model_path")),
            context_length=n_ctx,
            slots=as_int(props.get("total_slots")),
            busy_slots=busy,
            quantization=as_str(props.get("model_ftype")) or ftype_name(as_dict(card.get("meta")).get("ftype")),
            build=as_str(props.get("build_info")),
        )

    async def busy(self, client: httpx.AsyncClient, timeout: float) -> int | None:
        # /slots is exact (a slot is processing or not); /metrics (--metrics) adds the deferred queue
        with contextlib.suppress(PollError, httpx.HTTPError):
            slots = await get_json(client, "/slots", timeout)
            if isinstance(slots, list):
                return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing") is True)
        return await metrics_busy(client, ("llamacpp:requests_processing", "llamacpp:requests_deferred"), timeout)

    async def count_prompt_tokens(
        self, client: httpx.AsyncClient, model: str | None, messages: Sequence[Message]
    ) -> TokenCount:
        msgs = [dict(m) for m in messages]
        try:
            r = await client.post("/v1/chat/completions/input_tokens", json={"model": model, "messages": msgs})
            n = as_int(r.json().get("input_tokens")) if r.status_code == 200 else None
            if n is not None:
                return TokenCount(n, "input_tokens")
            r = await client.post("/apply-template", json={"messages": msgs})
            if r.status_code != 200:
                return TokenCount(None, f"apply-template HTTP {r.status_code}")
            body = {"content": r.json()["prompt"], "add_special": True, "parse_special": True}
            r = await client.post("/tokenize", json=body)
            if r.status_code != 200:
                return TokenCount(None, f"tokenize HTTP {r.status_code}")
            return TokenCount(len(r.json()["tokens"]), "apply-template+tokenize")
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return TokenCount(None, short(exc, 120))

    async def flush_cache(self, client: httpx.AsyncClient) -> str | None:
        try:
            ids = await self._slot_ids(client)
            if not ids:
                return "slot erase: no slots listed"
            for i in ids:
                r = await client.post(f"/slots/{i}", params={"action": "erase"})
                if r.status_code != 200:
                    return f"slot erase HTTP {r.status_code}: {body_message(r)}"
        except (httpx.HTTPError, PollError) as exc:
            return f"slot erase failed: {short(exc, 120)}"
        return f"slot erase HTTP 200 ({len(ids)} slots)"

    async def _slot_ids(self, client: httpx.AsyncClient) -> list[int]:
        with contextlib.suppress(PollError):
            slots = await get_json(client, "/slots", 10.0)
            if isinstance(slots, list):
                return [i for s in slots if isinstance(s, dict) and (i := as_int(s.get("id"))) is not None]
        # --no-slots: /slots answers 501, the slot ids are still 0 .. total_slots-1
        props = await get_json(client, "/props", 10.0)
        return list(range(as_int(as_dict(props).get("total_slots")) or 0))


DIALECT = LlamaCpp()
