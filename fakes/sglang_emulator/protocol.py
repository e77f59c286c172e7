"""SGLang's wire shapes: the flat error body, request validation, and the response chunks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse

# ----------------------------------------------------------------------------------------------------------
# errors


class _APIError(Exception):
    """An error answered before any stream starts, in SGLang's flat shape."""

    def __init__(self, message: str, type_: str = "BadRequestError", code: int = 400) -> None:
        super().__init__(message)
        self.message, self.type, self.code = message, type_, code

    def response(self) -> JSONResponse:
        return _error_response(self.message, self.type, self.code)


def _error_response(message: str, type_: str, code: int) -> JSONResponse:
    body = {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    return JSONResponse(body, status_code=code)


def _validation_error(errors: list[dict[str, Any]]) -> _APIError:
    # http_server.py remaps FastAPI's 422 to 400 with type "Bad Request"
    return _APIError(str(errors), HTTPStatus.BAD_REQUEST.phrase, 400)


def _streaming_error(message: str, type_: str, code: int) -> str:
    # serving_base.create_streaming_error_response uses json.dumps (with its default spaces)
    error = {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    return f"data: {json.dumps({'error': error})}\n\n"


# ----------------------------------------------------------------------------------------------------------
# request validation (a small stand-in for SGLang's pydantic models)

_INT = (int,)
_NUM = (int, float)
_FIELD_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "model": (str,),
    "stream": (bool,),
    "temperature": _NUM,
    "top_p": _NUM,
    "top_k": _INT,
    "min_p": _NUM,
    "max_tokens": _INT,
    "max_completion_tokens": _INT,
    "n": _INT,
    "seed": _INT,
    "presence_penalty": _NUM,
    "frequency_penalty": _NUM,
    "repetition_penalty": _NUM,
    "ignore_eos": (bool,),
    "stream_options": (dict,),
    "stop": (str, list),
}


async def _read_body(request: Request, required: str | None) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json":
        raise _validation_error(
            [
                {
                    "loc": ["header", "content-type"],
                    "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                    "type": "value_error",
                }
            ]
        )
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        raise _validation_error([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}]) from None
    if not isinstance(body, dict):
        raise _validation_error(
            [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}]
        )
    errors: list[dict[str, Any]] = []
    if required is not None and required not in body:
        errors.append({"type": "missing", "loc": ("body", required), "msg": "Field required", "input": body})
    for key, types in _FIELD_TYPES.items():
        value = body.get(key)
        if value is None:
            continue
        bad_bool = isinstance(value, bool) and bool not in types
        if bad_bool or not isinstance(value, types):
            errors.append(
                {
                    "type": "type_error",
                    "loc": ("body", key),
                    "msg": f"Input should be {types[0].__name__}",
                    "input": value,
                }
            )
    if errors:
        raise _validation_error(errors)
    return body


# ----------------------------------------------------------------------------------------------------------
# response shapes


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _usage(prompt: int, completion: int, cached: int | None, *, drop_none: bool = False) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }
    return {k: v for k, v in usage.items() if v is not None} if drop_none else usage


def _chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    matched_stop: int | str | None = None,
    usage: dict[str, Any] | None = None,
) -> str:
    # sse_utils.build_sse_content: msgspec structs, StreamDelta/StreamChunk omit defaults, StreamChoice does not
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "matched_stop": matched_stop}
        ],
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {_dumps(chunk)}\n\n"


def _matched(finish: Mapping[str, Any] | None) -> int | str | None:
    return None if finish is None else finish.get("matched")
