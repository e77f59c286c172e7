"""One completion's response over time: queueing, TTFT, cadence, and every fault knob (die, stall, error,
malformed, status)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import socket
import struct
from typing import Any

from fakes.fault_engine.config import FaultEngineConfig, Knobs
from fakes.fault_engine.http1 import _LAST_CHUNK, _SSE_HEAD, _chunk, _Conn, _forever, _head, _json_response
from fakes.fault_engine.shapes import _Clock, _count_prompt, _error_body, _event, _Kind, _piece, _Plan, _prompt_text


class _Outcome(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"  # a fault ended it; the connection is still usable
    DIED = "died"  # a fault closed the connection
    REJECTED = "rejected"
    CANCELLED = "cancelled"


def _plan(kind: _Kind, knobs: Knobs, body: dict[str, Any], config: FaultEngineConfig) -> _Plan | bytes:
    """One completion request resolved against the knobs and the context size, or the 400 to send."""
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
    room = config.n_ctx - prompt_tokens
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
        model=config.model,
    )


async def produce(conn: _Conn, plan: _Plan, n_ctx: int) -> _Outcome:
    """Send one completion's response, its faults included; says how it ended."""
    loop = asyncio.get_running_loop()
    k = plan.knobs
    if k.queue_ms > 0:
        await asyncio.sleep(k.queue_ms / 1e3)
    if k.hang_before_headers or (k.hang and not plan.stream):
        await _forever()
    if k.drop:
        return await _die(conn, rst=False)
    if k.status is not None and k.location is not None:
        await conn.send(_head(k.status, [("Location", k.location), ("Content-Length", "0")]))
        return _Outcome.REJECTED
    if k.status is not None:
        extra: dict[str, Any] = {}
        message = f"fault injected: status {k.status}"
        if k.error_type == "exceed_context_size_error":
            extra = {"n_prompt_tokens": plan.prompt_tokens, "n_ctx": n_ctx}
            message = _ctx_message(plan.prompt_tokens, n_ctx)
        await conn.send(_json_response(k.status, _error_body(message, k.status, k.error_type, **extra)))
        return _Outcome.REJECTED
    if plan.prompt_tokens >= n_ctx:
        body = _error_body(
            _ctx_message(plan.prompt_tokens, n_ctx),
            400,
            "exceed_context_size_error",
            n_prompt_tokens=plan.prompt_tokens,
            n_ctx=n_ctx,
        )
        await conn.send(_json_response(400, body))
        return _Outcome.REJECTED
    if k.error_after == 0:  # llama.cpp answers a first-result error as a plain HTTP error
        await conn.send(_json_response(500, _error_body("fault injected: error after 0 tokens", 500)))
        return _Outcome.FAILED
    clock = _Clock(t_slot=loop.time())
    if plan.stream:
        return await _produce_stream(conn, plan, clock)
    return await _produce_whole(conn, plan, clock)


def _ctx_message(n_prompt: int, n_ctx: int) -> str:
    return f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"


def _due(plan: _Plan, clock: _Clock, token_index: int) -> float:
    """When token ``token_index`` (0-based; ``n_tokens`` is the EOS) is generated."""
    return clock.t_slot + (plan.knobs.ttft_ms + token_index * plan.knobs.cadence_ms) / 1e3


async def _wait_until(conn: _Conn, due: float, ping: bool) -> None:
    loop = asyncio.get_running_loop()
    if ping:
        await asyncio.sleep(max(0.0, (due - loop.time()) / 2))
        await conn.send(_chunk(b":\n\n"))
    await asyncio.sleep(max(0.0, due - loop.time()))


async def _die(conn: _Conn, rst: bool) -> _Outcome:
    sock = conn.writer.get_extra_info("socket")
    if rst and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.writer.transport.abort()
    else:
        conn.writer.close()
    return _Outcome.DIED


async def _produce_stream(conn: _Conn, plan: _Plan, clock: _Clock) -> _Outcome:
    loop = asyncio.get_running_loop()
    k = plan.knobs
    await conn.send(_SSE_HEAD)
    if k.hang or k.stall_after == 0:
        await _forever()
    if k.die_after == 0:
        return await _die(conn, k.rst)
    held: list[bytes] = []  # burst: the token events, written in one go with the end (a buffering hop)
    for events, start in enumerate(range(0, plan.n_tokens, k.multi), start=1):
        last = min(start + k.multi, plan.n_tokens) - 1
        await _wait_until(conn, _due(plan, clock, last), k.ping)
        now = loop.time()
        if clock.t_first is None:
            clock.t_first = now
        clock.t_last = now
        text = "".join(_piece(i) for i in range(start, last + 1))
        event = _chunk(plan.token_events(text, events == 1, last + 1, clock))
        if k.burst:
            held.append(event)
            continue
        await conn.send(event)
        if k.malformed_after == events:
            await conn.send(_chunk(b"data: {not json\n\n"))
        if k.nodata_after == events:
            await conn.send(_chunk(b"event: ping\n\n"))
        if k.deep_after == events:
            await conn.send(_chunk(b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n\n"))
        if k.big_event_after == events:
            await conn.send(_chunk(b'data: {"pad":"'))
            for _ in range(160):  # 10 MiB
                await conn.send(_chunk(b"x" * 65536))
            await conn.send(_chunk(b'"}\n\n'))
        if k.die_after == events:
            return await _die(conn, k.rst)
        if k.error_after == events:
            error = {"error": _error_body(f"fault injected: error after {events} events", 500)["error"]}
            await conn.send(_chunk(_event(error)) + _LAST_CHUNK)
            return _Outcome.FAILED
        if k.stall_after == events:
            await _forever()
    if not plan.hit_limit:  # the EOS token takes one more step
        await _wait_until(conn, _due(plan, clock, plan.n_tokens), k.ping)
        now = loop.time()
        clock.t_first = now if clock.t_first is None else clock.t_first
        clock.t_last = now
    await conn.send(b"".join(held) + _chunk(plan.final_events(clock)))
    if plan.terminator:
        await conn.send(_chunk(plan.terminator))
    await conn.send(_LAST_CHUNK)
    return _Outcome.COMPLETED


async def _produce_whole(conn: _Conn, plan: _Plan, clock: _Clock) -> _Outcome:
    loop = asyncio.get_running_loop()
    k = plan.knobs

    def at_event(n: int) -> float:
        return clock.t_slot if n == 0 else _due(plan, clock, min(n * k.multi, plan.n_tokens) - 1)

    for after, action in ((k.die_after, "die"), (k.error_after, "error"), (k.stall_after, "stall")):
        if after is not None and after * k.multi <= plan.n_tokens:
            await asyncio.sleep(max(0.0, at_event(after) - loop.time()))
            if action == "die":
                return await _die(conn, k.rst)
            if action == "error":
                body = _error_body(f"fault injected: error after {after} events", 500)
                await conn.send(_json_response(500, body))
                return _Outcome.FAILED
            await _forever()
    end = _due(plan, clock, max(plan.n_tokens - (1 if plan.hit_limit else 0), 0))
    await asyncio.sleep(max(0.0, end - loop.time()))
    clock.t_first = _due(plan, clock, 0)
    clock.t_last = loop.time()
    if k.malformed_after is not None:
        raw = b"{not json"
        head = [("Content-Type", "application/json; charset=utf-8"), ("Content-Length", str(len(raw)))]
        await conn.send(_head(200, head) + raw)
        return _Outcome.FAILED
    if k.spaced:
        raw = json.dumps(plan.whole_response(clock), ensure_ascii=False).encode()  # ", " and ": "
        head = [("Content-Type", "application/json; charset=utf-8"), ("Content-Length", str(len(raw)))]
        await conn.send(_head(200, head) + raw)
        return _Outcome.COMPLETED
    await conn.send(_json_response(200, plan.whole_response(clock)))
    return _Outcome.COMPLETED
