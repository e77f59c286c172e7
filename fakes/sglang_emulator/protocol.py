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


#: where FastAPI's handler sits in 0.5.17's http_server.py (captured for chat; the others by the same rule)
_HANDLERS: Final = {
    "/v1/chat/completions": ("openai_v1_chat_completions", 1702),
    "/v1/completions": ("openai_v1_completions", 1690),
    "/v1/tokenize": ("openai_v1_tokenize", 1760),
    "/tokenize": ("openai_v1_tokenize", 1760),
}
_HTTP_SERVER_PY: Final = "/usr/local/lib/python3.12/dist-packages/sglang/srt/entrypoints/http_server.py"


def _validation_error(errors: list[dict[str, Any]], path: str = "/v1/chat/completions") -> _APIError:
    """FastAPI's 422, which http_server.py answers as 400 ``"Bad Request"``, its message ``str()`` of the
    ``RequestValidationError`` as FastAPI 0.12x writes it: the count, each error, the handler's location."""
    func, line = _HANDLERS.get(path, ("openai_v1_chat_completions", 1702))
    n = len(errors)
    lines = "".join(f"  {e!r}\n" for e in errors)
    message = (
        f"{n} validation error{'' if n == 1 else 's'}:\n{lines}\n"
        f'  File "{_HTTP_SERVER_PY}", line {line}, in {func}\n    POST {path} {errors!r}'
    )
    return _APIError(message, HTTPStatus.BAD_REQUEST.phrase, 400)


def _streaming_error(message: str, type_: str, code: int) -> str:
    # serving_base.create_streaming_error_response uses json.dumps (with its default spaces)
    error = {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    return f"data: {json.dumps({'error': error})}\n\n"


# ----------------------------------------------------------------------------------------------------------
# request validation (a small stand-in for SGLang's pydantic models)

#: pydantic's error type and message per expected JSON type
_EXPECTED: Final[dict[type, tuple[str, str]]] = {
    int: ("int_type", "Input should be a valid integer"),
    float: ("float_type", "Input should be a valid number"),
    bool: ("bool_type", "Input should be a valid boolean"),
    str: ("string_type", "Input should be a valid string"),
    dict: ("dict_type", "Input should be a valid dictionary"),
    list: ("list_type", "Input should be a valid list"),
}
_INT = (int,)
_NUM = (float, int)
_FIELD_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "messages": (list,),
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
    path = request.url.path
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json":
        raise _validation_error(
            [
                {
                    "loc": ["header", "content-type"],
                    "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                    "type": "value_error",
                }
            ],
            path,
        )
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        error = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {}}
        raise _validation_error([error], path) from None
    if not isinstance(body, dict):
        error = {"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary or object to extract fields from", "input": body}  # fmt: skip
        raise _validation_error([error], path)
    errors: list[dict[str, Any]] = []
    if required is not None and required not in body:
        errors.append({"type": "missing", "loc": ("body", required), "msg": "Field required", "input": body})
    for key, types in _FIELD_TYPES.items():
        value = body.get(key)
        if value is None or (key == "messages" and required != "messages"):
            continue
        bad_bool = isinstance(value, bool) and bool not in types
        if bad_bool or not isinstance(value, types):
            kind, msg = _EXPECTED[types[0]]
            errors.append({"type": kind, "loc": ("body", key), "msg": msg, "input": value})
    if errors:
        raise _validation_error(errors, path)
    return body


# ----------------------------------------------------------------------------------------------------------
# response shapes


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _usage(
    prompt: int, completion: int, cached: int | None, *, drop_none: bool = False, details: bool = False
) -> dict[str, Any]:
    """``UsageInfo``; ``details``: with the ``completion_tokens_details`` key (0.5.23; 0.5.17 never sends it)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "reasoning_tokens": 0,
    }
    if details:
        usage["completion_tokens_details"] = None
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
