"""The emulator's HTTP side: vLLM 0.26.0's endpoints and answers over a llama-server backend."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fakes.llama_logprobs import BackendError
from fakes.vllm_emulator.completions import Refused, check_logprobs, complete, prompt_ids, wants_tokens
from fakes.vllm_emulator.config import FINGERPRINT, NOT_FOUND, VERSION, Config, config_kv


def _error(message: str, status: int = 400, param: str | None = None, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class Emulator:
    def __init__(self, config: Config, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = 0
        self.created = int(time.time())
        self.seen: set[str] = set()
        self.n_vocab = 0

    async def vocab(self) -> int:
        """The backend's vocabulary size (``prompt_logprobs: -1`` asks for all of it)."""
        if not self.n_vocab:
            r = await self.client.get("/v1/models")
            data = r.json().get("data") if r.status_code == 200 else None
            meta = (data or [{}])[0].get("meta") or {}
            self.n_vocab = int(meta.get("n_vocab") or 2**31 - 1)
        return self.n_vocab

    async def render(self, body: dict[str, Any]) -> str:
        """The chat template applied by the backend (llama.cpp's ``/apply-template``; it leaves the BOS out)."""
        payload = {"messages": body["messages"]}
        for key in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"):
            if body.get(key) is not None:
                payload[key] = body[key]
        r = await self.client.post("/apply-template", json=payload)
        r.raise_for_status()
        return str(r.json()["prompt"])

    async def tokens(self, text: str, *, add_special: bool) -> list[int]:
        """``text``'s ids; special tokens written in it are parsed, as a Hugging Face tokenizer does."""
        body = {"content": text, "add_special": add_special, "parse_special": True}
        r = await self.client.post("/tokenize", json=body)
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    def check_model(self, body: dict[str, Any]) -> JSONResponse | None:
        model = body.get("model")
        if model is not None and model != self.config.served_model_name:
            return _error(f"The model `{model}` does not exist.", 404, "model", "NotFoundError")
        return None

    async def completions(self, body: dict[str, Any]) -> Response:
        """``/v1/completions`` asking for token ids or log-probabilities (:mod:`.completions`)."""
        try:
            check_logprobs(body, self.config.max_logprobs, await self.vocab())
            prompt = prompt_ids(body.get("prompt"))
            ids = prompt if isinstance(prompt, list) else await self.tokens(prompt, add_special=True)
        except Refused as exc:
            return _error(str(exc), 400, exc.param)
        if (bad := self.overflow(len(ids), {"max_tokens": 16, **body})) is not None:
            return bad
        try:
            return JSONResponse(await complete(self, body, ids))
        except BackendError as exc:
            return _error(str(exc), exc.status, kind="InternalServerError" if exc.status >= 500 else "BadRequestError")

    @property
    def kv_tokens(self) -> int:
        return config_kv[0] or self.config.kv_tokens or max(self.config.max_model_len, 1) * 4

    async def count(self, body: dict[str, Any]) -> int:
        """The prompt's token count (the context check): a chat rendered by the backend's template."""
        text = await self.render(body) if body.get("messages") is not None else str(body.get("prompt", ""))
        return len(await self.tokens(text, add_special=True))

    def overflow(self, n_prompt: int, body: dict[str, Any]) -> JSONResponse | None:
        limit = self.config.max_model_len
        out = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if n_prompt + out <= limit:
            return None
        msg = (
            f"This model's maximum context length is {limit} tokens. However, you requested {out} output tokens "
            f"and your prompt contains at least {n_prompt} input tokens, for a total of at least {n_prompt + out} "
            f"tokens. Please reduce the length of the input prompt or the number of requested output tokens. "
            f"(parameter=input_tokens, value={n_prompt})"
        )
        return _error(msg, 400, "input_tokens")

    def usage(self, u: dict[str, Any]) -> dict[str, Any]:
        p, c = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return {
            "prompt_tokens": p,
            "total_tokens": p + c,
            "completion_tokens": c,
            "prompt_tokens_details": {"cached_tokens": cached, "created_cache_tokens": p - cached},
        }

    def metrics(self) -> str:
        c = self.config
        lab = f'engine="0",model_name="{c.served_model_name}"'
        info = (
            f'_block_size_resolved="True",block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
            f'gpu_memory_utilization="{c.gpu_memory_utilization}",kv_cache_max_concurrency='
            f'"{self.kv_tokens / max(c.max_model_len, 1):.2f}",kv_cache_size_tokens="{self.kv_tokens}",'
            f'num_gpu_blocks="{self.kv_tokens // 16}"'
        )
        return "\n".join(
            [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{lab}}} {float(self.running)}",
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{lab}}} 0.0",
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{lab}}} 0.0",
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge",
                f"vllm:cache_config_info{{{info}}} 1.0",
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{{{lab}}} {float(self.prompt_tokens)}",
                "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{{{lab}}} {float(self.generation_tokens)}",
                "# HELP vllm:request_success_total Count of successfully processed requests.",
                "# TYPE vllm:request_success_total counter",
                f'vllm:request_success_total{{{lab},finished_reason="length"}} {float(self.requests)}',
                "",
            ]
        )

    async def chat(self, request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error("invalid JSON body")
        if (wrong := self.check_model(body)) is not None:
            return wrong
        if path == "/v1/completions" and wants_tokens(body):
            return await self.completions(body)
        n_prompt = await self.count(body)
        if (bad := self.overflow(n_prompt, body)) is not None:
            return bad
        kind = "chatcmpl" if path.endswith("chat/completions") else "cmpl"
        rid = f"{kind}-{secrets.token_hex(8)}"
        fwd = dict(body, model=None)
        fwd.pop("model")
        # a fresh vLLM caches only what it served: a prompt this emulator never saw must not hit the backend's
        # prompt cache, which other engines' runs (the smoke's resident llama-server) filled
        key = json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True)[:512]
        if key not in self.seen:
            self.seen.add(key)
            fwd["cache_prompt"] = False
        if not body.get("stream"):
            self.running += 1
            try:
                r = await self.client.post(path, json=fwd, timeout=None)
            finally:
                self.running -= 1
            doc = r.json()
            if r.status_code != 200:
                return _error(str(doc.get("error", {}).get("message", doc)), r.status_code)
            return JSONResponse(self._whole(doc, rid))
        return StreamingResponse(self._stream(path, fwd, rid), media_type="text/event-stream")

    def _whole(self, doc: dict[str, Any], rid: str) -> dict[str, Any]:
        u = self.usage(doc.get("usage") or {})
        self.requests += 1
        self.prompt_tokens += u["prompt_tokens"]
        self.generation_tokens += u["completion_tokens"]
        for ch in doc.get("choices", []):
            ch.setdefault("stop_reason", None)
            ch["token_ids"] = None
            msg = ch.get("message")
            if isinstance(msg, dict):
                msg.pop("reasoning_content", None)
                msg.update(refusal=None, annotations=None, audio=None, function_call=None, reasoning=None)
        doc.pop("timings", None)
        doc.update(id=rid, model=self.config.served_model_name, created=self.created,
                   system_fingerprint=FINGERPRINT, usage=u, service_tier=None)  # fmt: skip
        return doc

    async def _stream(self, path: str, body: dict[str, Any], rid: str) -> AsyncIterator[bytes]:
        """llama-server's chunks as vLLM's: the finish reason on the last content chunk, the usage chunk after."""
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        body = dict(body, stream_options={"include_usage": True})
        model, created = self.config.served_model_name, int(time.time())

        def frame(doc: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

        def chunk(delta: dict[str, Any], finish: str | None, first: bool = False) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            if not first:
                choice["token_ids"] = None
            doc = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [choice]}  # fmt: skip
            if first:
                doc.update(prompt_token_ids=None, prompt_text=None)
            return doc

        self.running += 1
        held: dict[str, Any] | None = None
        usage: dict[str, Any] | None = None
        try:
            yield frame(chunk({"role": "assistant", "content": ""}, None, first=True))
            async with self.client.stream("POST", path, json=body, timeout=None) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    doc = json.loads(line[6:])
                    if doc.get("usage"):
                        usage = doc["usage"]
                    for ch in doc.get("choices") or []:
                        text = (ch.get("delta") or {}).get("content") or (ch.get("text"))
                        if text:
                            if held is not None:
                                yield frame(held)
                            held = chunk({"content": text}, None)
                        if ch.get("finish_reason"):
                            if held is None:
                                held = chunk({"content": ""}, None)
                            held["choices"][0].update(finish_reason=ch["finish_reason"], stop_reason=None)
            if held is not None:
                yield frame(held)
            u = self.usage(usage or {})
            self.requests += 1
            self.prompt_tokens += u["prompt_tokens"]
            self.generation_tokens += u["completion_tokens"]
            if include_usage:
                yield frame({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [], "usage": u, "system_fingerprint": FINGERPRINT})  # fmt: skip
            yield b"data: [DONE]\n\n"
        finally:
            self.running -= 1


def create_app(config: Config, client: httpx.AsyncClient) -> Starlette:
    emu = Emulator(config, client)

    async def empty(_: Request) -> Response:
        return Response(b"", 200)

    async def not_found(_: Request) -> Response:
        return JSONResponse({"detail": "Not Found"}, 404)

    async def version(_: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def load(_: Request) -> Response:
        return JSONResponse({"server_load": emu.running})

    async def models(_: Request) -> Response:
        perm = {"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission", "created": emu.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False}  # fmt: skip
        card = {"id": config.served_model_name, "object": "model", "created": emu.created, "owned_by": "vllm",
                "root": config.model, "parent": None, "max_model_len": config.max_model_len, "permission": [perm]}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(request: Request) -> Response:
        """``TokenizeChatRequest``: the template renders the BOS and is tokenized without special tokens
        (``add_special_tokens`` false by default; true adds them again); llama-server's template leaves the BOS
        out, so the rendered text is tokenized with them. ``TokenizeCompletionRequest``: ``add_special_tokens``
        true by default."""
        body = await request.json()
        if (wrong := emu.check_model(body)) is not None:
            return wrong
        if body.get("messages") is not None:
            toks = await emu.tokens(await emu.render(body), add_special=True)
            if body.get("add_special_tokens"):
                toks = await emu.tokens("", add_special=True) + toks
        else:
            toks = await emu.tokens(
                str(body.get("prompt", "")), add_special=body.get("add_special_tokens") is not False
            )
        doc = {"count": len(toks), "max_model_len": config.max_model_len, "tokens": toks, "token_strs": None}
        return JSONResponse(doc)

    async def detokenize(request: Request) -> Response:
        """``DetokenizeResponse``: ``{"prompt": text}``, the tokenizer's ``decode`` (special tokens kept)."""
        body = await request.json()
        if (wrong := emu.check_model(body)) is not None:
            return wrong
        r = await client.post("/detokenize", json={"tokens": [int(t) for t in body.get("tokens") or ()]})
        if r.status_code != 200:
            return _error(f"backend /detokenize: HTTP {r.status_code}", 400)
        return JSONResponse({"prompt": r.json()["content"]})

    async def metrics(_: Request) -> Response:
        return Response(emu.metrics(), 200, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat(request: Request) -> Response:
        return await emu.chat(request, "/v1/chat/completions")

    async def completions(request: Request) -> Response:
        return await emu.chat(request, "/v1/completions")

    routes = [
        Route("/health", empty),
        Route("/ping", empty, methods=["GET", "POST"]),
        Route("/version", version),
        Route("/load", load),
        Route("/v1/models", models),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *(Route(p, not_found, methods=["GET", "POST"]) for p in NOT_FOUND),
    ]
    return Starlette(routes=routes)
