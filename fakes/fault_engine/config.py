"""The fake's settings: server config, per-request ``Knobs`` (parsed from ``x-fault``), fixed vocabulary."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final

BUILD_INFO: Final = "b7000-fa4e1f3c"
BOS_TOKEN: Final = "<|endoftext|>"
EOS_TOKEN: Final = "<|im_end|>"
SPECIAL_IDS: Final = {BOS_TOKEN: 1, EOS_TOKEN: 2, "<|im_start|>": 3}
BOS_ID: Final = SPECIAL_IDS[BOS_TOKEN]
EOS_ID: Final = SPECIAL_IDS[EOS_TOKEN]
MAX_HEAD_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 32 * 1024 * 1024

# Generated text cycles through these pieces; one is non-ASCII so UTF-8 handling gets exercised.
PIECES: Final = ("Hello", " world", ",", " this", " is", " a", " fake", " caf\u00e9", " token", " stream", ".")

_CHAT_TEMPLATE: Final = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


class KnobError(ValueError):
    """An ``x-fault`` header that cannot be parsed."""


def _flag(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("", "1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


@dataclass(frozen=True, slots=True)
class Knobs:
    """Per-request behaviour. Times in ms on the event loop's clock, counts in token events."""

    tokens: int = 16  # content tokens to generate (the request's max_tokens/n_predict caps it)
    cadence_ms: float = 0.0  # gap between generated tokens
    ttft_ms: float = 0.0  # slot start (headers) -> first token
    queue_ms: float = 0.0  # request -> slot start: the wait before any status line
    multi: int = 1  # tokens per content event
    ping: bool = False  # ":\n\n" SSE comment in every wait after the headers
    burst: bool = (
        False  # stream: the token events made at their cadence, written all at once with the end (per-event faults off)
    )
    cached: int = 0  # prompt tokens reported as cache hits (cache_n, cached_tokens)
    prompt_tokens: int | None = None  # override the counted prompt tokens
    die_after: int | None = None  # close the socket after K token events (no terminating chunk)
    rst: bool = False  # with die_after: close with a TCP RST instead of a FIN
    malformed_after: int | None = None  # send "data: {not json" after K token events, then go on
    error_after: int | None = None  # in-band {"error":...} after K events, end without [DONE]; 0: HTTP 500
    stall_after: int | None = None  # send nothing more after K token events, until the client leaves
    hang: bool = False  # headers, then nothing (= stall_after=0)
    hang_before_headers: bool = False  # no status line at all, until the client leaves
    status: int | None = None  # answer with this HTTP status and a llama.cpp error body
    error_type: str | None = None  # the error body's type (default: llama.cpp's type for the status)
    location: str | None = None  # with status (a 3xx): the Location header to send
    drop: bool = False  # read the request, then close the connection without a byte of answer
    spaced: bool = False  # JSON written with spaces after ':' and ',' ("model": "x"), non-stream bodies too
    nodata_after: int | None = None  # an SSE event with no data field ("event: ping") after K token events
    deep_after: int | None = None  # an event nested 5,000 arrays deep after K token events
    big_event_after: int | None = None  # one 10 MiB event (in 64 KiB writes) after K token events

    def merged(self, header: str) -> Knobs:
        """These knobs overridden by an ``x-fault`` header value."""
        changes: dict[str, Any] = {}
        for item in re.split(r"[,;\s]+", header.strip()):
            if not item:
                continue
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            convert = _KNOB_TYPES.get(key)
            if convert is None:
                raise KnobError(f"unknown x-fault knob {key!r}; known: {', '.join(sorted(_KNOB_TYPES))}")
            if not sep and convert is not _flag:
                raise KnobError(f"x-fault knob {key!r} needs a value ({key}=...)")
            try:
                changes[key] = convert(raw.strip())
            except ValueError:
                raise KnobError(f"bad value for x-fault knob {key!r}: {raw!r}") from None
        knobs = replace(self, **changes)
        if knobs.multi < 1 or knobs.tokens < 0:
            raise KnobError("x-fault needs multi >= 1 and tokens >= 0")
        return knobs


_KNOB_TYPES: Final[dict[str, Callable[[str], Any]]] = {
    "tokens": int,
    "cadence_ms": float,
    "ttft_ms": float,
    "queue_ms": float,
    "multi": int,
    "ping": _flag,
    "burst": _flag,
    "cached": int,
    "prompt_tokens": int,
    "die_after": int,
    "rst": _flag,
    "malformed_after": int,
    "error_after": int,
    "stall_after": int,
    "hang": _flag,
    "hang_before_headers": _flag,
    "status": int,
    "error_type": str,
    "location": str,
    "drop": _flag,
    "spaced": _flag,
    "nodata_after": int,
    "deep_after": int,
    "big_event_after": int,
}
assert set(_KNOB_TYPES) == {f.name for f in fields(Knobs)}


@dataclass(frozen=True, slots=True)
class FaultEngineConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; FaultEngine.url tells which
    model: str = "fault-engine"  # reported as `model` in every response, like llama.cpp's --alias
    n_ctx: int = 4096  # per-slot context; prompts of n_ctx tokens or more are refused
    total_slots: int = 4
    record_limit: int = 256  # POST bodies kept for /_fake/requests
    knobs: Knobs = field(default_factory=Knobs)  # defaults for requests without x-fault
    reuse_port: bool = False  # SO_REUSEPORT: several engine processes share one port (perf/overhead.py at scale)
