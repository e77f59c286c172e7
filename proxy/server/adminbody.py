"""An admin route's request body: read bounded, parsed bounded, refused with the proxy's own errors.

``read_admin_body`` refuses a body over ``MAX_ADMIN_BODY`` from its declared ``content-length`` before reading a
byte of it, and otherwise stops reading at the first chunk that crosses the limit (never 30 MiB read to refuse at
64 KiB); a body not whole within ``ADMIN_BODY_TIMEOUT_S`` is a 408. ``admin_object`` parses it as a JSON object
of known fields: invalid or too deeply nested JSON is a 400 (``json`` raises ``RecursionError`` on deep nesting,
which would otherwise escape as a plain-text 500). Every refusal is a ``ProxyError``, rendered as the OpenAI-style
envelope marked ``"enginemeter": true``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import ClientDisconnect, Request

from proxy.errors import BadRequest, PayloadTooLarge, RequestTimeout

#: the largest admin body accepted (a command is a few dozen bytes)
MAX_ADMIN_BODY = 64 * 1024
#: an admin body must be whole within this long
ADMIN_BODY_TIMEOUT_S = 10.0
#: the deepest nesting an admin body may have (its documents are flat objects)
MAX_ADMIN_DEPTH = 32


async def read_admin_body(request: Request, limit: int = MAX_ADMIN_BODY) -> bytes:
    """The body, at most ``limit`` bytes: ``PayloadTooLarge`` (413) from the declared length or at the first chunk
    past it, ``RequestTimeout`` (408) when it is not whole in time, ``BadRequest`` when the client goes away."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(ADMIN_BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {ADMIN_BODY_TIMEOUT_S:g} s") from None
    except ClientDisconnect:
        raise BadRequest("the client went away before its body was whole") from None
    return b"".join(chunks)


def _depth(raw: bytes) -> int:
    """The deepest nesting of brackets in ``raw`` outside strings (an upper bound of the JSON's depth)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def admin_object(raw: bytes, fields: set[str]) -> dict[str, Any]:
    """``raw`` as a JSON object whose keys are all in ``fields`` (empty: ``{}``), else ``BadRequest`` (400):
    invalid JSON, nesting past ``MAX_ADMIN_DEPTH``, not an object, an unknown field."""
    if raw.count(b"[") + raw.count(b"{") > MAX_ADMIN_DEPTH and _depth(raw) > MAX_ADMIN_DEPTH:
        raise BadRequest(f"request body is nested too deeply (more than {MAX_ADMIN_DEPTH} levels)")
    try:
        doc = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as exc:  # RecursionError: belt and braces behind the depth check
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = set(doc) - fields
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)}", param=sorted(unknown)[0])
    return doc
