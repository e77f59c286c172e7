"""One streamed chat request, timed exactly as the proxy times its upstream, and the JSONL writer.

Timing is the proxy's: ``SSEFramer`` + ``StreamTimer`` + ``StreamTiming.derive``, events read by
``proxy.stream.read_event`` (the one reader shared with the relay and the perf harness) — so TTFT/TPOT/decode
tok/s mean the same here and in ``/metrics``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from proxy.config.settings import MIRROR_HEADER
from proxy.sse import SSEFramer
from proxy.stream import error_text, loads, read_event
from proxy.timing import EngineTimings, StreamTimer, StreamTiming, Usage

CHAT_PATH = "/v1/chat/completions"
#: every bench request says so: through a mirroring proxy it is then never copied to a shadow (a copy would
#: pre-warm the shadow's cache with the "cold" prompts and land in the comparison log); engines ignore it
NO_MIRROR = {MIRROR_HEADER: "off"}
_NEVER_SEEN = "Server disconnected without sending a response"


class Writer:
    """Appends one JSON object per line and flushes each: Ctrl-C keeps everything that finished."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[str] = path.open("w", encoding="utf-8")

    def write(self, rec: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


@dataclass
class RequestOutcome:
    ok: bool
    status: int
    error: str | None
    timing: StreamTiming
    usage: Usage | None
    engine: EngineTimings | None
    finish_reason: str | None
    n_token_events: int
    t_start_ns: int
    t_done_ns: int
    retried: bool = False
    #: the generated text (choice 0's content, reasoning first): greedy outputs are compared across engines
    text: str = ""

    @property
    def cached_tokens(self) -> int | None:
        return cached_tokens(self.usage, self.engine)


def cached_tokens(usage: Usage | None, engine: EngineTimings | None) -> int | None:
    """Cached prompt tokens: the usage field (OpenAI ``prompt_tokens_details.cached_tokens``, SGLang's
    top-level ``cached_tokens``), else llama.cpp's ``timings.cache_n``."""
    if usage is not None and usage.cached_tokens is not None:
        return usage.cached_tokens
    return engine.cache_n if engine is not None else None


async def send_one(client: httpx.AsyncClient, body: bytes, headers: Mapping[str, str]) -> RequestOutcome:
    """POST one streaming chat request and time it exactly as the proxy times its upstream.

    A kept-alive connection the server closed before answering (llama-server's cpp-httplib closes idle
    keep-alive connections after 5 s and every connection after a fixed number of requests; a client can win
    that race) is retried once with a fresh clock: the engine never saw that request. Through the proxy the
    same event comes back as its 502 "closed the connection: Server disconnected without sending a response".
    """
    o = await _send_once(client, body, headers)
    if not o.ok and o.error and _NEVER_SEEN in o.error and o.status in (0, 502):  # 502: the proxy relaying it
        o = await _send_once(client, body, headers)
        o.retried = True
    return o


async def _send_once(client: httpx.AsyncClient, body: bytes, headers: Mapping[str, str]) -> RequestOutcome:
    timer = StreamTimer()
    framer = SSEFramer()
    usage: Usage | None = None
    engine_t: EngineTimings | None = None
    finish: str | None = None
    status = 0
    error: str | None = None
    parts: list[str] = []
    try:
        timer.sent()
        async with client.stream("POST", CHAT_PATH, content=body, headers={**headers, **NO_MIRROR}) as resp:
            timer.headers()
            status = resp.status_code
            if status != 200:
                raw = await resp.aread()
                error = f"HTTP {status}: {error_text(raw)}"
            else:
                async for chunk in resp.aiter_raw():
                    t_ns = time.perf_counter_ns()
                    for ev in framer.feed(chunk):
                        if ev.is_comment or not ev.data or ev.is_done:
                            continue
                        try:
                            info = read_event(loads(ev.data), with_text=True)
                        except ValueError:
                            error = "malformed SSE event"
                            continue
                        if info.error is not None:
                            error = f"in-stream error: {info.error[:200]}"
                            continue
                        if info.token:
                            timer.token(t_ns)
                        if info.text:
                            parts.append(info.text)
                        finish = info.finish_reason or finish
                        usage = info.usage or usage
                        engine_t = info.timings or engine_t
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    timer.done()
    if error is None and timer.t_first_token_ns == 0:
        error = "no token received"
    if usage is None or usage.completion_tokens is None:
        # no usage from the engine: fall back to token events (chunks; may undercount)
        usage = Usage(
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=timer.n_token_events or None,
            cached_tokens=usage.cached_tokens if usage else None,
        )
    timing = StreamTiming.derive(timer, usage, engine_t)
    return RequestOutcome(
        ok=error is None,
        status=status,
        error=error,
        timing=timing,
        usage=usage,
        engine=engine_t,
        finish_reason=finish,
        n_token_events=timer.n_token_events,
        t_start_ns=timer.t_received_ns,
        t_done_ns=timer.t_done_ns,
        text="".join(parts),
    )
