"""A fault-injecting look-alike of llama.cpp ``llama-server``, for tests and benchmarks.

Pure asyncio HTTP/1.1, no framework: the bytes, their timing and abrupt closes are exactly what a test asks
for, and one process serves hundreds of concurrent streams on a small machine.

Wire shapes follow llama.cpp (engines.md §1): for ``/v1/chat/completions`` the 200 headers go out at "slot
start", before the first token; the role chunk ``{"role":"assistant","content":null}`` is written together
with the first token; then one event per token; the final write is the finish chunk (``delta:{}``) plus,
with ``stream_options.include_usage``, a usage chunk with ``choices:[]``; ``timings`` sit on the last event;
then ``data: [DONE]``. ``model`` is always the server's own name. ``usage.completion_tokens`` counts the EOS
token when the stream ends with ``finish_reason:"stop"`` (llama.cpp's ``n_decoded`` does), so it is
``tokens + 1`` then. ``/v1/completions`` (``choices[0].text``, usage always on the final event) and the
native ``/completion`` (no ``[DONE]``), ``/tokenize`` and ``/apply-template`` are emulated too, so the SGLang
emulator can sit on top of this fake.

The fake tokenizer is a word splitter: one token per whitespace-led word, BOS id 1 prepended with
``add_special``; chat prompts are rendered with a ChatML template. A prompt of ``n_ctx`` tokens or more gets
llama.cpp's 400 ``exceed_context_size_error``.

Behaviour per request comes from the ``x-fault`` request header, over the server's defaults (CLI flags), as
``key=value`` items or bare flags separated by commas, semicolons or spaces, e.g.
``x-fault: tokens=8, cadence_ms=5, die_after=3``. The knobs are the fields of ``Knobs``. Counts of events
(``die_after`` and friends) count token events, which hold ``multi`` tokens each.

Test hooks: ``GET /_fake/requests`` (the parsed bodies of the last POSTs, oldest first; ``?full=1`` adds
method, path and headers), ``DELETE /_fake/requests``, ``GET /_fake/stats`` (``active``, ``completed``,
``cancelled`` = the client went away first, ``failed`` = a fault ended it, ``rejected`` = answered with an
error status, ``requests``) and ``DELETE /_fake/stats`` (zero the counters but ``active``).

    python -m fakes.fault_engine --port 8081 --tokens 64 --cadence-ms 20 --ttft-ms 50
    server = await serve(FaultEngineConfig(port=0))           # in a running loop
    with run_in_thread(FaultEngineConfig()) as url: ...       # from synchronous code
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import http
import json
import random
import re
import signal
import socket
import string
import struct
import threading
import time
import traceback
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "FaultEngine",
    "FaultEngineConfig",
    "KnobError",
    "Knobs",
    "RecordedRequest",
    "apply_chat_template",
    "fake_tokenize",
    "main",
    "run_in_thread",
    "serve",
]

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


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def parsed_body(self) -> Any:
        """The body as JSON, else as text, ``None`` when empty."""
        if not self.body:
            return None
        try:
            return json.loads(self.body)
        except ValueError:
            return self.body.decode("utf-8", "replace")


@dataclass(slots=True)
class _Stats:
    active: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    requests: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Outcome(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"  # a fault ended it; the connection is still usable
    DIED = "died"  # a fault closed the connection
    REJECTED = "rejected"
    CANCELLED = "cancelled"


# ----------------------------------------------------------------------------------------------------------
# fake tokenizer and template


_WORD = re.compile(r"\s*(?:<\|[a-z_]+\|>|[^\s<]+|<)")


def fake_tokenize(text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """One id per whitespace-led word or special token; stable across runs."""
    ids = [
        SPECIAL_IDS[piece.lstrip()]
        if parse_special and piece.lstrip() in SPECIAL_IDS
        else 10 + zlib.crc32(piece.encode()) % 32000
        for piece in _WORD.findall(text)
    ]
    return [BOS_ID, *ids] if add_special else ids


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def apply_chat_template(messages: list[Any]) -> str:
    """ChatML rendering with the generation prompt, as llama.cpp's default template does."""
    out = [
        f"<|im_start|>{m.get('role', 'user')}\n{_text_of(m.get('content'))}<|im_end|>\n"
        for m in messages
        if isinstance(m, dict)
    ]
    return "".join(out) + "<|im_start|>assistant\n"


def _prompt_text(path_kind: _Kind, body: dict[str, Any]) -> str:
    if path_kind is _Kind.CHAT:
        messages = body.get("messages")
        return apply_chat_template(messages if isinstance(messages, list) else [])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return str(prompt)


def _count_prompt(path_kind: _Kind, body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if path_kind is not _Kind.CHAT and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # token ids are used as given, no BOS added
    return len(fake_tokenize(_prompt_text(path_kind, body), add_special=True))


def _piece(i: int) -> str:
    return PIECES[i % len(PIECES)]


def _rand_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=32))


# ----------------------------------------------------------------------------------------------------------
# llama.cpp response shapes


class _Kind(enum.Enum):
    CHAT = "chat"  # /v1/chat/completions
    CMPL = "cmpl"  # /v1/completions
    NATIVE = "native"  # /completion, /completions


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _error_body(message: str, code: int, type_: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "error": {"code": code, "message": message, "type": type_ or _ERROR_TYPES.get(code, "server_error"), **extra}
    }


_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


@dataclass(slots=True)
class _Clock:
    """Generation timestamps (loop clock, s) for llama.cpp's ``timings``."""

    t_slot: float
    t_first: float | None = None
    t_last: float | None = None

    def timings(self, prompt_n: int, cache_n: int, n_gen: int) -> dict[str, Any]:
        t_first = self.t_first if self.t_first is not None else self.t_slot
        t_last = self.t_last if self.t_last is not None else t_first
        prompt_ms = (t_first - self.t_slot) * 1e3
        predicted_ms = (t_last - t_first) * 1e3
        steps = max(n_gen - 1, 0)  # "the first token is free"
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n > 0 else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": n_gen,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
        }


@dataclass(slots=True)
class _Plan:
    """One completion request, resolved."""

    kind: _Kind
    knobs: Knobs
    stream: bool
    include_usage: bool
    timings_per_token: bool
    prompt_tokens: int
    n_tokens: int  # content tokens to emit
    hit_limit: bool  # ends on the token limit ("length") rather than EOS ("stop")
    prompt_text: str
    model: str
    cmpl_id: str = field(default_factory=lambda: "chatcmpl-" + _rand_id())
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n_decoded(self) -> int:
        return self.n_tokens if self.hit_limit else self.n_tokens + 1  # the EOS token counts

    @property
    def finish_reason(self) -> str:
        return "length" if self.hit_limit else "stop"

    @property
    def cache_n(self) -> int:
        return min(self.knobs.cached, self.prompt_tokens)

    def usage(self) -> dict[str, Any]:
        return {
            "completion_tokens": self.n_decoded,
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.n_decoded + self.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cache_n},
        }

    def timings(self, clock: _Clock, n_gen: int) -> dict[str, Any]:
        return clock.timings(self.prompt_tokens - self.cache_n, self.cache_n, n_gen)

    # -- stream events -----------------------------------------------------------------------------------

    def _chat_chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish_reason, "index": 0, "delta": delta}],
            "created": self.created,
            "id": self.cmpl_id,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": "chat.completion.chunk",
        }

    def token_events(self, text: str, first: bool, n_gen: int, clock: _Clock) -> bytes:
        """The write for one token event: for chat the role chunk rides along with the first token."""
        timings = self.timings(clock, n_gen) if self.timings_per_token else None
        objs: list[dict[str, Any]]
        if self.kind is _Kind.CHAT:
            objs = [self._chat_chunk({"content": text})]
            if first:
                objs.insert(0, self._chat_chunk({"role": "assistant", "content": None}))
        elif self.kind is _Kind.CMPL:
            objs = [
                {
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}],
                    "created": self.created,
                    "model": self.model,
                    "system_fingerprint": BUILD_INFO,
                    "object": "text_completion",
                    "id": self.cmpl_id,
                }
            ]
        else:
            objs = [
                {
                    "index": 0,
                    "content": text,
                    "tokens": fake_tokenize(text),
                    "stop": False,
                    "id_slot": -1,
                    "tokens_predicted": n_gen,
                    "tokens_evaluated": self.prompt_tokens,
                }
            ]
        if timings is not None:
            objs[-1]["timings"] = timings
        return b"".join(_event(o) for o in objs)

    def final_events(self, clock: _Clock) -> bytes:
        timings = self.timings(clock, self.n_decoded)
        if self.kind is _Kind.CHAT:
            objs = [self._chat_chunk({}, self.finish_reason)]
            if self.include_usage:
                usage_chunk = self._chat_chunk({})
                usage_chunk["choices"] = []
                usage_chunk["usage"] = self.usage()
                objs.append(usage_chunk)
            objs[-1]["timings"] = timings
            return b"".join(_event(o) for o in objs)
        if self.kind is _Kind.CMPL:
            return _event(self.cmpl_response("", timings))
        return _event(self.native_response("", timings))

    @property
    def terminator(self) -> bytes:
        return b"" if self.kind is _Kind.NATIVE else b"data: [DONE]\n\n"

    # -- whole responses ---------------------------------------------------------------------------------

    def text(self) -> str:
        return "".join(_piece(i) for i in range(self.n_tokens))

    def chat_response(self, timings: dict[str, Any]) -> dict[str, Any]:
        return {
            "choices": [
                {
                    "finish_reason": self.finish_reason,
                    "index": 0,
                    "message": {"role": "assistant", "content": self.text()},
                }
            ],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": "chat.completion",
            "usage": self.usage(),
            "id": self.cmpl_id,
            "timings": timings,
        }

    def cmpl_response(self, text: str, timings: dict[str, Any]) -> dict[str, Any]:
        return {
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": self.finish_reason}],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": BUILD_INFO,
            "object": "text_completion",
            "usage": self.usage(),
            "id": self.cmpl_id,
            "timings": timings,
        }

    def native_response(self, text: str, timings: dict[str, Any]) -> dict[str, Any]:
        return {
            "index": 0,
            "content": text,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": self.n_decoded,
            "tokens_evaluated": self.prompt_tokens,
            "generation_settings": {"n_predict": -1, "stream": self.stream},
            "prompt": self.prompt_text,
            "has_new_line": False,
            "truncated": False,
            "stop_type": "limit" if self.hit_limit else "eos",
            "stopping_word": "",
            "tokens_cached": self.prompt_tokens + self.n_decoded - 1,
            "timings": timings,
        }

    def whole_response(self, clock: _Clock) -> dict[str, Any]:
        timings = self.timings(clock, self.n_decoded)
        if self.kind is _Kind.CHAT:
            return self.chat_response(timings)
        if self.kind is _Kind.CMPL:
            return self.cmpl_response(self.text(), timings)
        return self.native_response(self.text(), timings)


# ----------------------------------------------------------------------------------------------------------
# HTTP/1.1


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes
    keep_alive: bool


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_reason(status)}", "Server: llama.cpp", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _json_response(status: int, obj: Any, *, keep_alive: bool = True) -> bytes:
    body = _dumps(obj)
    headers = [
        ("Content-Type", "application/json; charset=utf-8"),
        ("Content-Length", str(len(body))),
        ("Keep-Alive", "timeout=5, max=100") if keep_alive else ("Connection", "close"),
    ]
    return _head(status, headers) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_SSE_HEAD: Final = _head(
    200,
    [
        ("X-Accel-Buffering", "no"),
        ("Content-Type", "text/event-stream"),
        ("Transfer-Encoding", "chunked"),
        ("Keep-Alive", "timeout=5, max=100"),
    ],
)
_LAST_CHUNK: Final = b"0\r\n\r\n"


class _Conn:
    """One client connection: a read buffer shared by the request parser and the disconnect watcher."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.eof = False

    async def fill(self) -> bool:
        if self.eof:
            return False
        try:
            data = await self.reader.read(65536)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def wait_gone(self) -> None:
        """Return once the client has closed its side (pipelined bytes stay in ``buf``)."""
        while await self.fill():
            pass

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _read_line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD_BYTES:
                raise _BadRequest(400, "line too long")
            if not await self.fill():
                raise _BadRequest(400, "truncated request")
        line = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return line

    async def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise _BadRequest(400, "truncated body")
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            try:
                size = int(bytes((await self._read_line()).split(b";")[0]).strip(), 16)
            except ValueError:
                raise _BadRequest(400, "bad chunk size") from None
            if size == 0:
                while await self._read_line():  # trailers
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise _BadRequest(413, "body too large")
            body += await self._read_exact(size)
            if await self._read_exact(2) != b"\r\n":
                raise _BadRequest(400, "bad chunk")

    async def read_request(self) -> _Request | None:
        """The next request, or ``None`` when the client closed between requests."""
        while True:
            while self.buf[:2] == b"\r\n":  # stray CRLFs between requests are allowed
                del self.buf[:2]
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buf) > MAX_HEAD_BYTES:
                raise _BadRequest(431, "request header too large")
            if not await self.fill():
                if self.buf.strip():
                    raise _BadRequest(400, "truncated request")
                return None
        head = bytes(self.buf[:end]).decode("latin-1")
        del self.buf[: end + 4]
        request_line, *header_lines = head.split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "bad request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                raise _BadRequest(400, "bad header line")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked()
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest(400, "bad content-length") from None
            if length < 0 or length > MAX_BODY_BYTES:
                raise _BadRequest(413, "body too large")
            body = await self._read_exact(length)
        connection = headers.get("connection", "").lower()
        keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
        url = urlsplit(target)
        return _Request(method.upper(), url.path or "/", parse_qs(url.query), headers, body, keep_alive)


async def _forever() -> None:
    await asyncio.Event().wait()


# ----------------------------------------------------------------------------------------------------------
# the server


class FaultEngine:
    """State and request handling of one fake engine; ``start()`` binds it to a socket."""

    def __init__(self, config: FaultEngineConfig | None = None) -> None:
        self.config = config or FaultEngineConfig()
        self.stats = _Stats()
        self.recorded: deque[RecordedRequest] = deque(maxlen=self.config.record_limit)
        self.server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._routes: dict[tuple[str, str], Callable[[_Conn, _Request], Awaitable[bool]]] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/health"): self._health,
            ("GET", "/props"): self._props,
            ("GET", "/models"): self._models,
            ("GET", "/v1/models"): self._models,
            ("GET", "/slots"): self._slots,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._cmpl,
            ("POST", "/completion"): self._native,
            ("POST", "/completions"): self._native,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/apply-template"): self._apply_template,
            ("GET", "/_fake/requests"): self._get_requests,
            ("DELETE", "/_fake/requests"): self._delete_requests,
            ("GET", "/_fake/stats"): self._get_stats,
            ("DELETE", "/_fake/stats"): self._delete_stats,
        }

    @property
    def url(self) -> str:
        if self.server is None or not self.server.sockets:
            raise RuntimeError("the fault engine is not started")
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> asyncio.Server:
        self.server = await asyncio.start_server(
            self._handle, self.config.host, self.config.port, limit=MAX_HEAD_BYTES, backlog=1024
        )
        return self.server

    async def aclose(self) -> None:
        """Stop listening and drop every open connection."""
        if self.server is not None:
            self.server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        # aborted transports end every handler by themselves; cancelling them instead would trip Python
        # 3.11's start_server callback, which calls task.exception() on a cancelled task
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks), timeout=5)
            for task in stuck:
                task.cancel()
        if self.server is not None:
            await self.server.wait_closed()

    # -- connection loop ---------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        conn = _Conn(reader, writer)
        try:
            while True:
                try:
                    request = await conn.read_request()
                except _BadRequest as exc:
                    await conn.send(_json_response(exc.status, _error_body(str(exc), exc.status), keep_alive=False))
                    break
                if request is None:
                    break
                if not await self._dispatch(conn, request) or not request.keep_alive:
                    break
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug here must not take the server down; say so loudly
            traceback.print_exc()
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _dispatch(self, conn: _Conn, request: _Request) -> bool:
        """Answer one request; False when the connection must close."""
        if request.method == "POST" and not request.path.startswith("/_fake/"):
            self.recorded.append(
                RecordedRequest(request.method, request.path, tuple(request.headers.items()), request.body)
            )
        handler = self._routes.get((request.method, request.path))
        if handler is None:
            await conn.send(_json_response(404, _error_body("File Not Found", 404)))
            return True
        return await handler(conn, request)

    # -- small endpoints ---------------------------------------------------------------------------------

    async def _reply(self, conn: _Conn, status: int, obj: Any) -> bool:
        await conn.send(_json_response(status, obj))
        return True

    async def _health(self, conn: _Conn, request: _Request) -> bool:
        return await self._reply(conn, 200, {"status": "ok"})

    def _params(self) -> dict[str, Any]:
        k = self.config.knobs
        return {
            "n_predict": -1,
            "seed": 4294967295,
            "temperature": 0.8,
            "top_k": 40,
            "top_p": 0.95,
            "min_p": 0.05,
            "repeat_last_n": 64,
            "repeat_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stream": True,
            "fault_defaults": {f.name: getattr(k, f.name) for f in fields(k)},
        }

    async def _props(self, conn: _Conn, request: _Request) -> bool:
        cfg = self.config
        return await self._reply(
            conn,
            200,
            {
                "default_generation_settings": {"params": self._params(), "n_ctx": cfg.n_ctx},
                "total_slots": cfg.total_slots,
                "model_alias": cfg.model,
                "model_path": f"/models/{cfg.model}.gguf",
                "modalities": {"vision": False, "video": False, "audio": False},
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": False,
                "chat_template": _CHAT_TEMPLATE,
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "build_info": BUILD_INFO,
                "is_sleeping": False,
            },
        )

    async def _models(self, conn: _Conn, request: _Request) -> bool:
        name = self.config.model
        return await self._reply(
            conn,
            200,
            {
                "models": [
                    {
                        "name": name,
                        "model": name,
                        "modified_at": "",
                        "size": "",
                        "digest": "",
                        "type": "model",
                        "description": "",
                        "tags": [""],
                        "capabilities": ["completion"],
                        "parameters": "",
                        "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""]},
                    }
                ],
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "aliases": [name],
                        "tags": [],
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "llamacpp",
                        "meta": {
                            "vocab_type": 2,
                            "n_vocab": 32003,
                            "n_ctx": self.config.n_ctx,
                            "n_ctx_train": self.config.n_ctx,
                            "n_embd": 64,
                            "n_params": 1_000_000,
                            "size": 4_000_000,
                            "ftype": "F16",
                        },
                    }
                ],
            },
        )

    async def _slots(self, conn: _Conn, request: _Request) -> bool:
        busy = self.stats.active
        slots = [
            {"id": i, "n_ctx": self.config.n_ctx, "speculative": False, "is_processing": i < busy}
            for i in range(self.config.total_slots)
        ]
        if request.query.get("fail_on_no_slot") and busy >= self.config.total_slots:
            return await self._reply(conn, 503, _error_body("no slot available", 503))
        return await self._reply(conn, 200, slots)

    async def _metrics(self, conn: _Conn, request: _Request) -> bool:
        message = "This server does not support metrics endpoint. Start it with `--metrics`"
        return await self._reply(conn, 501, _error_body(message, 501))

    def _json_body(self, request: _Request) -> dict[str, Any] | bytes:
        """The request's JSON object, or the error response to send."""
        try:
            body = json.loads(request.body)
        except ValueError as exc:
            return _json_response(500, _error_body(f"[json.exception.parse_error.101] parse error: {exc}", 500))
        if not isinstance(body, dict):
            return _json_response(400, _error_body("request body must be a JSON object", 400))
        return body

    async def _tokenize(self, conn: _Conn, request: _Request) -> bool:
        body = self._json_body(request)
        if isinstance(body, bytes):
            await conn.send(body)
            return True
        content = body.get("content", "")
        tokens = fake_tokenize(
            _text_of(content),
            add_special=bool(body.get("add_special", False)),
            parse_special=bool(body.get("parse_special", True)),
        )
        return await self._reply(conn, 200, {"tokens": tokens})

    async def _apply_template(self, conn: _Conn, request: _Request) -> bool:
        body = self._json_body(request)
        if isinstance(body, bytes):
            await conn.send(body)
            return True
        messages = body.get("messages")
        if not isinstance(messages, list):
            return await self._reply(conn, 400, _error_body("'messages' is required", 400))
        return await self._reply(conn, 200, {"prompt": apply_chat_template(messages)})

    async def _get_requests(self, conn: _Conn, request: _Request) -> bool:
        if request.query.get("full", ["0"])[0] not in ("", "0", "false"):
            out: list[Any] = [
                {"method": r.method, "path": r.path, "headers": dict(r.headers), "body": r.parsed_body()}
                for r in self.recorded
            ]
        else:
            out = [r.parsed_body() for r in self.recorded]
        return await self._reply(conn, 200, out)

    async def _delete_requests(self, conn: _Conn, request: _Request) -> bool:
        self.recorded.clear()
        return await self._reply(conn, 200, {"cleared": True})

    async def _get_stats(self, conn: _Conn, request: _Request) -> bool:
        return await self._reply(conn, 200, self.stats.as_dict())

    async def _delete_stats(self, conn: _Conn, request: _Request) -> bool:
        self.stats = _Stats(active=self.stats.active)
        return await self._reply(conn, 200, self.stats.as_dict())

    # -- completions -------------------------------------------------------------------------------------

    async def _chat(self, conn: _Conn, request: _Request) -> bool:
        return await self._completion(conn, request, _Kind.CHAT)

    async def _cmpl(self, conn: _Conn, request: _Request) -> bool:
        return await self._completion(conn, request, _Kind.CMPL)

    async def _native(self, conn: _Conn, request: _Request) -> bool:
        return await self._completion(conn, request, _Kind.NATIVE)

    def _plan(self, kind: _Kind, knobs: Knobs, body: dict[str, Any]) -> _Plan | bytes:
        if kind is _Kind.CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _json_response(400, _error_body("'messages' is required and must be a non-empty array", 400))
        elif "prompt" not in body:
            return _json_response(400, _error_body('"prompt" must be provided', 400))
        if kind is _Kind.CMPL and body.get("echo"):
            return _json_response(400, _error_body("Only no echo is supported", 400))
        # n_predict wins over max_completion_tokens and max_tokens, as in llama.cpp
        limit = -1
        for key in ("max_tokens", "max_completion_tokens", "n_predict"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                limit = value
        prompt_tokens = knobs.prompt_tokens if knobs.prompt_tokens is not None else _count_prompt(kind, body)
        n_tokens, hit_limit = knobs.tokens, False
        if 0 <= limit <= n_tokens:  # the EOS would be token limit+1: the limit ends it first
            n_tokens, hit_limit = limit, True
        room = self.config.n_ctx - prompt_tokens
        if 0 <= room <= n_tokens:
            n_tokens, hit_limit = room, True
        stream_options = body.get("stream_options")
        return _Plan(
            kind=kind,
            knobs=knobs,
            stream=bool(body.get("stream", False)),
            include_usage=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
            timings_per_token=bool(body.get("timings_per_token", False)),
            prompt_tokens=prompt_tokens,
            n_tokens=n_tokens,
            hit_limit=hit_limit,
            prompt_text=_prompt_text(kind, body),
            model=self.config.model,
        )

    async def _completion(self, conn: _Conn, request: _Request, kind: _Kind) -> bool:
        self.stats.requests += 1
        try:
            knobs = self.config.knobs.merged(request.headers.get("x-fault", ""))
        except KnobError as exc:
            self.stats.rejected += 1
            return await self._reply(conn, 400, _error_body(str(exc), 400))
        body = self._json_body(request)
        plan = body if isinstance(body, bytes) else self._plan(kind, knobs, body)
        if isinstance(plan, bytes):
            self.stats.rejected += 1
            await conn.send(plan)
            return True
        self.stats.active += 1
        try:
            outcome = await self._race(conn, self._produce(conn, plan))
        finally:
            self.stats.active -= 1
        if outcome is _Outcome.COMPLETED:
            self.stats.completed += 1
        elif outcome is _Outcome.CANCELLED:
            self.stats.cancelled += 1
        elif outcome is _Outcome.REJECTED:
            self.stats.rejected += 1
        else:
            self.stats.failed += 1
        return outcome not in (_Outcome.DIED, _Outcome.CANCELLED)

    async def _race(self, conn: _Conn, producer_coro: Awaitable[_Outcome]) -> _Outcome:
        """Run the response producer until it finishes or the client goes away, whichever is first."""
        producer = asyncio.ensure_future(producer_coro)
        watcher = asyncio.ensure_future(conn.wait_gone())
        try:
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if producer in done:
                try:
                    return producer.result()
                except (ConnectionError, OSError):
                    return _Outcome.CANCELLED
            return _Outcome.CANCELLED
        finally:
            for task in (producer, watcher):
                task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)

    async def _produce(self, conn: _Conn, plan: _Plan) -> _Outcome:
        loop = asyncio.get_running_loop()
        k = plan.knobs
        if k.queue_ms > 0:
            await asyncio.sleep(k.queue_ms / 1e3)
        if k.hang_before_headers or (k.hang and not plan.stream):
            await _forever()
        if k.status is not None:
            extra: dict[str, Any] = {}
            message = f"fault injected: status {k.status}"
            if k.error_type == "exceed_context_size_error":
                extra = {"n_prompt_tokens": plan.prompt_tokens, "n_ctx": self.config.n_ctx}
                message = self._ctx_message(plan.prompt_tokens)
            await conn.send(_json_response(k.status, _error_body(message, k.status, k.error_type, **extra)))
            return _Outcome.REJECTED
        if plan.prompt_tokens >= self.config.n_ctx:
            body = _error_body(
                self._ctx_message(plan.prompt_tokens),
                400,
                "exceed_context_size_error",
                n_prompt_tokens=plan.prompt_tokens,
                n_ctx=self.config.n_ctx,
            )
            await conn.send(_json_response(400, body))
            return _Outcome.REJECTED
        if k.error_after == 0:  # llama.cpp answers a first-result error as a plain HTTP error
            await conn.send(_json_response(500, _error_body("fault injected: error after 0 tokens", 500)))
            return _Outcome.FAILED
        clock = _Clock(t_slot=loop.time())
        if plan.stream:
            return await self._produce_stream(conn, plan, clock)
        return await self._produce_whole(conn, plan, clock)

    def _ctx_message(self, n_prompt: int) -> str:
        return (
            f"request ({n_prompt} tokens) exceeds the available context size ({self.config.n_ctx} tokens), "
            "try increasing it"
        )

    def _due(self, plan: _Plan, clock: _Clock, token_index: int) -> float:
        """When token ``token_index`` (0-based; ``n_tokens`` is the EOS) is generated."""
        return clock.t_slot + (plan.knobs.ttft_ms + token_index * plan.knobs.cadence_ms) / 1e3

    async def _wait_until(self, conn: _Conn, due: float, ping: bool) -> None:
        loop = asyncio.get_running_loop()
        if ping:
            await asyncio.sleep(max(0.0, (due - loop.time()) / 2))
            await conn.send(_chunk(b":\n\n"))
        await asyncio.sleep(max(0.0, due - loop.time()))

    async def _die(self, conn: _Conn, rst: bool) -> _Outcome:
        sock = conn.writer.get_extra_info("socket")
        if rst and sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.writer.transport.abort()
        else:
            conn.writer.close()
        return _Outcome.DIED

    async def _produce_stream(self, conn: _Conn, plan: _Plan, clock: _Clock) -> _Outcome:
        loop = asyncio.get_running_loop()
        k = plan.knobs
        await conn.send(_SSE_HEAD)
        if k.hang or k.stall_after == 0:
            await _forever()
        if k.die_after == 0:
            return await self._die(conn, k.rst)
        for events, start in enumerate(range(0, plan.n_tokens, k.multi), start=1):
            last = min(start + k.multi, plan.n_tokens) - 1
            await self._wait_until(conn, self._due(plan, clock, last), k.ping)
            now = loop.time()
            if clock.t_first is None:
                clock.t_first = now
            clock.t_last = now
            text = "".join(_piece(i) for i in range(start, last + 1))
            await conn.send(_chunk(plan.token_events(text, events == 1, last + 1, clock)))
            if k.malformed_after == events:
                await conn.send(_chunk(b"data: {not json\n\n"))
            if k.die_after == events:
                return await self._die(conn, k.rst)
            if k.error_after == events:
                error = {"error": _error_body(f"fault injected: error after {events} events", 500)["error"]}
                await conn.send(_chunk(_event(error)) + _LAST_CHUNK)
                return _Outcome.FAILED
            if k.stall_after == events:
                await _forever()
        if not plan.hit_limit:  # the EOS token takes one more step
            await self._wait_until(conn, self._due(plan, clock, plan.n_tokens), k.ping)
            now = loop.time()
            clock.t_first = now if clock.t_first is None else clock.t_first
            clock.t_last = now
        await conn.send(_chunk(plan.final_events(clock)))
        if plan.terminator:
            await conn.send(_chunk(plan.terminator))
        await conn.send(_LAST_CHUNK)
        return _Outcome.COMPLETED

    async def _produce_whole(self, conn: _Conn, plan: _Plan, clock: _Clock) -> _Outcome:
        loop = asyncio.get_running_loop()
        k = plan.knobs

        def at_event(n: int) -> float:
            return clock.t_slot if n == 0 else self._due(plan, clock, min(n * k.multi, plan.n_tokens) - 1)

        for after, action in ((k.die_after, "die"), (k.error_after, "error"), (k.stall_after, "stall")):
            if after is not None and after * k.multi <= plan.n_tokens:
                await asyncio.sleep(max(0.0, at_event(after) - loop.time()))
                if action == "die":
                    return await self._die(conn, k.rst)
                if action == "error":
                    body = _error_body(f"fault injected: error after {after} events", 500)
                    await conn.send(_json_response(500, body))
                    return _Outcome.FAILED
                await _forever()
        end = self._due(plan, clock, max(plan.n_tokens - (1 if plan.hit_limit else 0), 0))
        await asyncio.sleep(max(0.0, end - loop.time()))
        clock.t_first = self._due(plan, clock, 0)
        clock.t_last = loop.time()
        if k.malformed_after is not None:
            raw = b"{not json"
            head = [("Content-Type", "application/json; charset=utf-8"), ("Content-Length", str(len(raw)))]
            await conn.send(_head(200, head) + raw)
            return _Outcome.FAILED
        await conn.send(_json_response(200, plan.whole_response(clock)))
        return _Outcome.COMPLETED


# ----------------------------------------------------------------------------------------------------------
# entry points


async def serve(config: FaultEngineConfig | None = None) -> asyncio.Server:
    """Start a fault engine in the running loop; close it with ``server.close()``."""
    return await FaultEngine(config).start()


@contextlib.contextmanager
def run_in_thread(config: FaultEngineConfig | None = None) -> Iterator[str]:
    """Run a fault engine on its own event loop in a daemon thread; yields its base URL."""
    loop = asyncio.new_event_loop()
    engine = FaultEngine(config)
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(engine.start())
        except BaseException as exc:
            failure.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(engine.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="fault-engine", daemon=True)
    thread.start()
    if not ready.wait(timeout=30):
        raise RuntimeError("the fault engine did not start within 30 s")
    if failure:
        raise failure[0]
    try:
        yield engine.url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)


def _parse_args(argv: list[str] | None) -> FaultEngineConfig:
    p = argparse.ArgumentParser(prog="python -m fakes.fault_engine", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="fault-engine", help="the name every response reports")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--slots", type=int, default=4, help="total_slots in /props and /slots")
    p.add_argument("--record-limit", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--cadence-ms", type=float, default=20.0)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--queue-ms", type=float, default=0.0)
    p.add_argument("--multi", type=int, default=1)
    p.add_argument("--ping", action="store_true")
    p.add_argument("--fault", default="", help="default knobs in x-fault syntax, e.g. 'die_after=5'")
    args = p.parse_args(argv)
    knobs = Knobs(
        tokens=args.tokens,
        cadence_ms=args.cadence_ms,
        ttft_ms=args.ttft_ms,
        queue_ms=args.queue_ms,
        multi=args.multi,
        ping=args.ping,
    )
    try:
        knobs = knobs.merged(args.fault)
    except KnobError as exc:
        p.error(str(exc))
    return FaultEngineConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        n_ctx=args.n_ctx,
        total_slots=args.slots,
        record_limit=args.record_limit,
        knobs=knobs,
    )


async def _main_async(config: FaultEngineConfig) -> None:
    engine = FaultEngine(config)
    await engine.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {engine.url}", flush=True)
    await stop.wait()
    await engine.aclose()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_main_async(_parse_args(argv)))


if __name__ == "__main__":
    main()
