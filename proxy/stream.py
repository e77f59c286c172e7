"""What one OpenAI stream event (or non-stream body) says: pure, no I/O, no clock.

The one definition shared by the proxy's relay, the bench's client and the perf harness:

- a **token event** has a choice whose ``delta`` carries non-empty ``content``, ``reasoning_content`` /
  ``reasoning`` or ``tool_calls`` (completions: non-empty ``text``). The role-only first event, the finish event
  and the usage event are not token events, so TTFT never starts on them;
- **text** is choice 0's content (reasoning first), from a delta, a message or a completions choice;
- **finish reason** is choice 0's ``finish_reason`` (vLLM puts it on the last content event, llama.cpp and
  SGLang on a separate event: both are read the same way);
- **usage** and llama.cpp's **timings** may ride on any event (llama.cpp's ``/v1/completions`` puts usage on
  the last content event);
- an **error** is an event whose top-level ``error`` is an object or a string.

The relay calls the small functions directly on its hot path (no per-event record); :func:`read_event` bundles
them for callers that want one record per event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.timing import EngineTimings, Usage, usage_from_json

_TOKEN_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")
_TEXT_KEYS = ("reasoning_content", "reasoning", "content", "text")


def loads(data: bytes | str) -> Any:
    """orjson first; what it refuses and ``json`` accepts (NaN, lone surrogate escapes) still parses the same."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def has_token(choices: list[Any]) -> bool:
    for c in choices:
        if not isinstance(c, dict):
            continue
        d = c.get("delta")
        if isinstance(d, dict):
            for key in _TOKEN_KEYS:
                if d.get(key):
                    return True
        elif c.get("text"):
            return True
    return False


def text_of(choices: list[Any]) -> str:
    """Choice 0's text in this event or body (reasoning first, then content)."""
    parts: list[str] = []
    for c in choices:
        if not isinstance(c, dict) or c.get("index", 0) != 0:
            continue
        d = c.get("delta")
        msg = c.get("message")
        src = d if isinstance(d, dict) else msg if isinstance(msg, dict) else c
        for key in _TEXT_KEYS:
            v = src.get(key)
            if isinstance(v, str):
                parts.append(v)
    return "".join(parts)


def finish_reason_of(choices: list[Any]) -> str | None:
    c0 = choices[0] if choices else None
    if isinstance(c0, dict) and c0.get("finish_reason"):
        return str(c0["finish_reason"])
    return None


def error_message(doc: Any) -> str | None:
    """The message of an in-band or body error (``{"error": {...}}``, ``{"error": "..."}``, SGLang's flat
    ``{"object": "error", "message": ...}``); None when ``doc`` is no error."""
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or "engine error")
    if isinstance(err, str):
        return err or "engine error"
    if doc.get("object") == "error":
        return str(doc.get("message") or "engine error")
    return None


def error_text(raw: bytes, limit: int = 200) -> str:
    """A short, printable message for an error body or event, whatever its shape."""
    try:
        msg = error_message(loads(raw))
    except ValueError:
        msg = None
    return (msg if msg is not None else raw.decode("utf-8", "replace"))[:limit]


@dataclass(frozen=True, slots=True)
class EventInfo:
    token: bool
    text: str
    finish_reason: str | None
    usage: Usage | None
    timings: EngineTimings | None
    error: str | None


def read_event(doc: Any, *, with_text: bool = False) -> EventInfo:
    """Everything the event says (``doc``: the parsed ``data:`` payload or a non-stream body)."""
    if not isinstance(doc, dict):
        return EventInfo(False, "", None, None, None, "event is not a JSON object")
    err = error_message(doc)
    choices = doc.get("choices")
    if not isinstance(choices, list):
        choices = []
    return EventInfo(
        token=has_token(choices),
        text=text_of(choices) if with_text else "",
        finish_reason=finish_reason_of(choices),
        usage=usage_from_json(doc.get("usage")) if doc.get("usage") is not None else None,
        timings=EngineTimings.from_json(doc["timings"]) if doc.get("timings") is not None else None,
        error=err,
    )
