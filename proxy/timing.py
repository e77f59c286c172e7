"""Per-request clocks and the figures derived from them. ``time.perf_counter_ns`` only.

Timestamps (all ``perf_counter_ns``, 0 = did not happen):

- ``t_received_ns``   the server parsed the client request's head (``enginemeter serve``'s protocol stamps it:
                      ``proxy.server.record.loopwatch``); else the proxy's handler started (before reading the body)
- ``t_handler_ns``    the proxy's handler started: after ``t_received_ns`` by the time the request waited for the
                      event loop (0: not stamped apart, the handler's start is ``t_received_ns``)
- ``t_sent_ns``       the normalized request is handed to the upstream connection
- ``t_headers_ns``    upstream response headers arrived (llama.cpp: slot start; SGLang: first token; vLLM: at once)
- ``t_first_token_ns`` first event whose delta has non-empty ``content``, ``reasoning_content``/``reasoning``
                      or ``tool_calls`` (completions: non-empty ``text``) — never the role-only event
- ``t_last_token_ns`` the last such event (not the finish or usage event)
- ``t_first_read_ns`` the read that held the stream's first event (streams)
- ``t_first_byte_ns`` the first bytes of the response body were written to the client (streams)
- ``t_done_ns``       the stream (or non-stream body) ended, whatever the outcome

Derived (seconds unless named otherwise):

- ``ttft_s`` = first − received: TTFT as the client feels it
- ``upstream_ttft_s`` = first − sent: the engine's TTFT as seen from the proxy
- ``overhead_s`` = sent − received: what the proxy added before the engine saw the request (event-loop queueing
  included)
- ``handler_wait_s`` = handler − received: the part of it the request waited for the event loop
- ``proxy_delay_s`` = overhead + (first byte − first read) for streams: everything the proxy added to the
  client's time to first byte (before the engine saw the request, and between the engine's first event and the
  client's first byte); non-stream: ``overhead_s``
- ``inter_chunk_gaps_ns``: gaps between consecutive token events — per *chunk*, a chunk may carry several tokens
- ``tpot_s`` = (last − first) / (completion_tokens − 1)
- ``decode_tps`` = (completion_tokens − 1) / (last − first), the same definition as llama.cpp's
  ``predicted_per_second`` (the first token is "free": it comes from the prompt batch)
- ``burst``: most of the gaps between token events are under ``BURST_GAP_S`` — the events arrived together (one
  read: a buffering hop, or a reader that fell behind), so their timing says how fast they were read, not how fast
  they were made. ``tpot_s``/``decode_tps`` are then the engine's own (llama.cpp ``timings.predicted_per_second``)
  where it reports them, else None: a burst is a data problem, never a speed (a 16-token burst read ~14 µs apart
  once recorded 54,740 tok/s for an engine doing 358)
- ``e2e_s`` = done − received
- ``queue_s`` (llama.cpp) = upstream TTFT − engine ``prompt_ms``
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

NS = 1_000_000_000
#: token events closer than this came in one read: no engine makes a token in 100 µs (10,000 tok/s per request)
BURST_GAP_S = 100e-6


class StreamTimer:
    """Mutable clock for one request on one engine. The hot path only calls ``token()``."""

    __slots__ = (
        "gaps_ns",
        "n_token_events",
        "t_done_ns",
        "t_first_byte_ns",
        "t_first_read_ns",
        "t_first_token_ns",
        "t_handler_ns",
        "t_headers_ns",
        "t_last_token_ns",
        "t_received_ns",
        "t_sent_ns",
    )

    def __init__(self, t_received_ns: int | None = None, t_handler_ns: int = 0) -> None:
        self.t_received_ns = time.perf_counter_ns() if t_received_ns is None else t_received_ns
        self.t_handler_ns = t_handler_ns
        self.t_sent_ns = 0
        self.t_first_read_ns = 0
        self.t_first_byte_ns = 0
        self.t_headers_ns = 0
        self.t_first_token_ns = 0
        self.t_last_token_ns = 0
        self.t_done_ns = 0
        self.n_token_events = 0
        self.gaps_ns = array("q")

    def sent(self) -> None:
        self.t_sent_ns = time.perf_counter_ns()

    def headers(self) -> None:
        self.t_headers_ns = time.perf_counter_ns()

    def token(self, t_ns: int) -> None:
        """A token-carrying event arrived at ``t_ns`` (the read time of the bytes holding it)."""
        if self.t_first_token_ns == 0:
            self.t_first_token_ns = t_ns
        else:
            self.gaps_ns.append(t_ns - self.t_last_token_ns)
        self.t_last_token_ns = t_ns
        self.n_token_events += 1

    def first_byte(self) -> None:
        """The response's first body bytes went to the client (once per request: the relay's first write)."""
        if self.t_first_byte_ns == 0:
            self.t_first_byte_ns = time.perf_counter_ns()

    def done(self) -> None:
        if self.t_done_ns == 0:
            self.t_done_ns = time.perf_counter_ns()

    def retry(self) -> StreamTimer:
        """A fresh clock for the next engine of a fallback, received (and handled) when this one was."""
        return StreamTimer(self.t_received_ns, self.t_handler_ns)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class EngineTimings:
    """What the engine says about itself (llama.cpp ``timings``)."""

    prompt_ms: float | None = None
    prompt_n: int | None = None
    cache_n: int | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    predicted_per_second: float | None = None

    @classmethod
    def from_json(cls, t: Any) -> EngineTimings | None:
        if not isinstance(t, dict):
            return None
        return cls(
            prompt_ms=_num(t.get("prompt_ms")),
            prompt_n=_int(t.get("prompt_n")),
            cache_n=_int(t.get("cache_n")),
            predicted_n=_int(t.get("predicted_n")),
            predicted_ms=_num(t.get("predicted_ms")),
            predicted_per_second=_num(t.get("predicted_per_second")),
        )


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    f = _num(v)
    return int(f) if f is not None else None


def usage_from_json(u: Any) -> Usage | None:
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is None and isinstance(u.get("cached_tokens"), int):
        cached = u["cached_tokens"]  # some SGLang builds report it top-level
    pt, ct = u.get("prompt_tokens"), u.get("completion_tokens")
    return Usage(
        prompt_tokens=pt if isinstance(pt, int) else None,
        completion_tokens=ct if isinstance(ct, int) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
    )


@dataclass(frozen=True, slots=True)
class StreamTiming:
    ttft_s: float | None
    upstream_ttft_s: float | None
    headers_s: float | None
    overhead_s: float | None
    tpot_s: float | None
    decode_tps: float | None
    e2e_s: float | None
    queue_s: float | None
    gaps_s: tuple[float, ...] = field(default=())
    handler_wait_s: float | None = None
    proxy_delay_s: float | None = None
    burst: bool = False

    @classmethod
    def derive(cls, t: StreamTimer, usage: Usage | None, engine: EngineTimings | None) -> StreamTiming:
        def span(a: int, b: int) -> float | None:
            return (b - a) / NS if a and b and b >= a else None

        ttft = span(t.t_received_ns, t.t_first_token_ns)
        up_ttft = span(t.t_sent_ns, t.t_first_token_ns)
        n = usage.completion_tokens if usage else None
        decode_window = span(t.t_first_token_ns, t.t_last_token_ns)
        tpot = decode_tps = None
        burst = is_burst(t.gaps_ns)
        if burst:
            own = engine.predicted_per_second if engine is not None and (engine.predicted_n or 0) > 1 else None
            if own:
                tpot, decode_tps = 1 / own, own
        elif n is not None and n > 1 and decode_window:
            tpot = decode_window / (n - 1)
            decode_tps = (n - 1) / decode_window
        queue = None
        if up_ttft is not None and engine is not None and engine.prompt_ms is not None:
            queue = max(0.0, up_ttft - engine.prompt_ms / 1000)
        overhead = span(t.t_received_ns, t.t_sent_ns)
        delay = overhead
        relay = span(t.t_first_read_ns, t.t_first_byte_ns)
        if delay is not None and relay is not None:
            delay += relay
        return cls(
            ttft_s=ttft,
            upstream_ttft_s=up_ttft,
            headers_s=span(t.t_sent_ns, t.t_headers_ns),
            overhead_s=overhead,
            tpot_s=tpot,
            decode_tps=decode_tps,
            e2e_s=span(t.t_received_ns, t.t_done_ns),
            queue_s=queue,
            gaps_s=tuple(g / NS for g in t.gaps_ns),
            handler_wait_s=span(t.t_received_ns, t.t_handler_ns),
            proxy_delay_s=delay,
            burst=burst,
        )


def is_burst(gaps_ns: Any) -> bool:
    """Most gaps between token events under ``BURST_GAP_S``: the events came in one read."""
    short = sum(1 for g in gaps_ns if g < BURST_GAP_S * NS)
    return short > 0 and 2 * short >= len(gaps_ns)
