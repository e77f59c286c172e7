"""The OpenAI-compatible endpoints (``serving_chat.py`` / ``serving_completions.py``): kick-start streaming,
whole responses, ``/tokenize``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fakes.sglang_emulator.config import DEFAULT_MODEL_NAME
from fakes.sglang_emulator.engine import SGLangEmulator, _Job, _Output
from fakes.sglang_emulator.protocol import (
    _APIError,
    _chat_chunk,
    _dumps,
    _matched,
    _read_body,
    _streaming_error,
    _usage,
)

_T = TypeVar("_T")


async def _unless_disconnected(request: Request, awaitable: Awaitable[_T]) -> _T | None:
    """The awaitable's result, or None (having cancelled it) if the client goes away first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled() or not work.done():
        return None
    return work.result()


class _Serving:
    """The OpenAI-compatible endpoints (serving_chat.py / serving_completions.py)."""

    def __init__(self, engine: SGLangEmulator) -> None:
        self.engine = engine

    def _include_usage(self, body: Mapping[str, Any]) -> tuple[bool, bool]:
        default = self.engine.config.stream_response_default_include_usage
        options = body.get("stream_options")
        if options:
            return bool(options.get("include_usage")) or default, bool(options.get("continuous_usage_stats"))
        return default, False

    def _cached(self, cached: int) -> int | None:
        return cached if self.engine.config.enable_cache_report else None

    def _usage(self, prompt: int, completion: int, cached: int | None, *, drop_none: bool = False) -> dict[str, Any]:
        return _usage(prompt, completion, cached, drop_none=drop_none, details=not self.engine.config.v0517)

    async def _kick_start(self, request: Request, stream: AsyncGenerator[str, None]) -> Response:
        """Headers only once the first chunk exists (serving_chat._handle_streaming_request)."""
        first = await _unless_disconnected(request, anext(stream))
        if first is None:
            await stream.aclose()
            return Response(status_code=499)

        async def body() -> AsyncIterator[str]:
            yield first
            async for chunk in stream:
                yield chunk

        # on a client disconnect Starlette cancels the body; closing the generator ends the backend request
        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(stream.aclose))

    async def _prepare(self, request: Request, chat: bool) -> tuple[dict[str, Any], _Job]:
        engine = self.engine
        body = await _read_body(request, "messages" if chat else "prompt")
        if int(body.get("n") or 1) != 1:
            raise _APIError("n > 1 is not supported by the SGLang emulator", "BadRequest", 400)
        if chat:
            if not body["messages"]:
                raise _APIError("Messages cannot be empty.")
            input_ids = await engine.tokenize(await engine.render_chat(body), add_special=True)
        else:
            input_ids = await self._prompt_ids(body["prompt"])
        engine.check_model(str(body.get("model") or DEFAULT_MODEL_NAME))
        job = engine.job(body, input_ids, request.headers.get("x-fault"))
        engine.check_length(input_ids, job.max_new_tokens)
        return body, job

    async def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.engine.tokenize(prompt, add_special=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        raise _APIError("prompt must be a string, one string, or a list of token ids (batches are not emulated)")

    # -- chat --------------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        try:
            body, job = await self._prepare(request, chat=True)
        except _APIError as exc:
            return exc.response()
        model = str(body.get("model") or DEFAULT_MODEL_NAME)
        if job.stream:
            return await self._kick_start(request, self._iter_chat(body, job, model))
        return await self._chat_whole(request, job, model)

    async def _iter_chat(self, body: Mapping[str, Any], job: _Job, model: str) -> AsyncGenerator[str, None]:
        include_usage, continuous = self._include_usage(body)
        created = int(time.time())
        first = True
        finish: dict[str, Any] | None = None
        out = _Output("", 0, len(job.input_ids))
        outputs = self.engine.iter_outputs(job)
        try:
            async for out in outputs:
                if out.aborted_with_status:
                    assert out.finish is not None
                    code: HTTPStatus = out.finish["status_code"]
                    yield _streaming_error(out.finish["message"], code.name, code.value)
                    break
                finish = out.finish or finish
                if first:
                    first = False
                    yield _chat_chunk(
                        job.rid, created, model, {"reasoning_content": None, "role": "assistant", "content": ""}
                    )
                if out.text:
                    usage = self._usage(out.prompt_tokens, out.completion_tokens, None) if continuous else None
                    yield _chat_chunk(
                        job.rid, created, model, {"reasoning_content": None, "content": out.text}, usage=usage
                    )
            if finish is not None:
                yield _chat_chunk(
                    job.rid, created, model, {"reasoning_content": None}, finish["type"], _matched(finish)
                )
            if include_usage:
                usage_chunk = {
                    "id": job.rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(out.prompt_tokens, out.completion_tokens, self._cached(out.cached_tokens)),
                }
                yield f"data: {_dumps(usage_chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()

    async def _collect(self, job: _Job) -> tuple[str, _Output]:
        parts: list[str] = []
        last = _Output("", 0, len(job.input_ids))
        async for last in self.engine.iter_outputs(job):
            if last.aborted_with_status:
                assert last.finish is not None
                code: HTTPStatus = last.finish["status_code"]
                # non-stream aborts are HTTPException(status) -> type str(status), no param key change
                raise _APIError(last.finish["message"], str(code.value), code.value)
            parts.append(last.text)
        return "".join(parts), last

    async def _collect_whole(self, request: Request, job: _Job) -> tuple[str, _Output] | Response:
        """A non-stream answer's text and last output, or the Response that ends it instead (an engine error;
        499 when the client left first)."""
        try:
            collected = await _unless_disconnected(request, self._collect(job))
        except _APIError as exc:
            return exc.response()
        return Response(status_code=499) if collected is None else collected

    async def _chat_whole(self, request: Request, job: _Job, model: str) -> Response:
        collected = await self._collect_whole(request, job)
        if isinstance(collected, Response):
            return collected
        text, last = collected
        return JSONResponse(
            {
                "id": job.rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "reasoning_content": None,
                            "tool_calls": None,
                        },
                        "logprobs": None,
                        "finish_reason": None if last.finish is None else last.finish["type"],
                        "matched_stop": _matched(last.finish),
                    }
                ],
                "usage": self._usage(last.prompt_tokens, last.completion_tokens, self._cached(last.cached_tokens)),
                "metadata": {"weight_version": "default"},
            }
        )

    # -- completions -------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            body, job = await self._prepare(request, chat=False)
        except _APIError as exc:
            return exc.response()
        model = str(body.get("model") or DEFAULT_MODEL_NAME)
        if body.get("echo"):
            return _APIError("echo is not supported by the SGLang emulator").response()
        if job.stream:
            return await self._kick_start(request, self._iter_completion(body, job, model))
        return await self._completion_whole(request, job, model)

    async def _iter_completion(self, body: Mapping[str, Any], job: _Job, model: str) -> AsyncGenerator[str, None]:
        include_usage, continuous = self._include_usage(body)
        created = int(time.time())
        out = _Output("", 0, len(job.input_ids))
        outputs = self.engine.iter_outputs(job)
        try:
            async for out in outputs:
                if out.aborted_with_status:
                    assert out.finish is not None
                    code: HTTPStatus = out.finish["status_code"]
                    yield _streaming_error(out.finish["message"], code.name, code.value)
                    break
                chunk = {
                    "id": job.rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "text": out.text,
                            "logprobs": None,
                            "finish_reason": None if out.finish is None else out.finish["type"],
                            "matched_stop": _matched(out.finish),
                        }
                    ],
                    # pydantic model_dump_json keeps usage: null on every chunk
                    "usage": self._usage(out.prompt_tokens, out.completion_tokens, None) if continuous else None,
                }
                yield f"data: {_dumps(chunk)}\n\n"
            if include_usage:
                usage = self._usage(
                    out.prompt_tokens, out.completion_tokens, self._cached(out.cached_tokens), drop_none=True
                )
                final = {
                    "id": job.rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {_dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()

    async def _completion_whole(self, request: Request, job: _Job, model: str) -> Response:
        collected = await self._collect_whole(request, job)
        if isinstance(collected, Response):
            return collected
        text, last = collected
        return JSONResponse(
            {
                "id": job.rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": None if last.finish is None else last.finish["type"],
                        "matched_stop": _matched(last.finish),
                    }
                ],
                "usage": self._usage(last.prompt_tokens, last.completion_tokens, self._cached(last.cached_tokens)),
                "metadata": {"weight_version": "default"},
            }
        )

    # -- tokenize ----------------------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        engine = self.engine
        try:
            body = await _read_body(request, None)
            prompt, messages = body.get("prompt"), body.get("messages")
            if (prompt is None) == (messages is None):
                raise _APIError("Exactly one of 'prompt' or 'messages' must be provided.")
            max_len = engine.context_length
            if messages is not None:
                ids = await engine.tokenize(await engine.render_chat(body), add_special=True)
                return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})
            add_special = bool(body.get("add_special_tokens", True))
            if isinstance(prompt, list):
                batches = [await engine.tokenize(str(p), add_special=add_special) for p in prompt]
                return JSONResponse({"tokens": batches, "count": [len(b) for b in batches], "max_model_len": max_len})
            ids = await engine.tokenize(str(prompt), add_special=add_special)
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})
        except _APIError as exc:
            return exc.response()
