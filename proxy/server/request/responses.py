"""What the client gets back from the proxy itself: the ASGI response of a relayed stream (``RelayResponse``), the
proxy's own errors (``error_response``), and on every response the proxy's share of the time (``Server-Timing``).

``Server-Timing`` (W3C; browsers' developer tools and any HTTP client read it), all in milliseconds, measured by
the request's ``StreamTimer`` (``perf_counter_ns``), never estimated:

- ``queue``: the request head was parsed -> the proxy's handler started (time it waited for the event loop;
  only under ``enginemeter serve``'s protocol, which stamps the head);
- ``proxy``: the head was parsed -> the request was written to the engine (``queue`` included): what the proxy
  added before the engine saw the request. A response the proxy makes itself (its errors, ``/health``,
  ``/metrics``): the head was parsed -> the response's head;
- ``engine``: the request was written -> the engine's first event (a stream), its whole body (non-stream
  generation), or its response head (pass-through routes, which relay the body as it comes).

A stream's head goes out once the engine's first event is in, so that is all it can say. What the proxy adds
after it (the engine's first event -> the client's first byte) is in the request's ``proxy_delay_s``
(``enginemeter_proxy_delay_seconds``, the request log). One header a request; nothing per chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from proxy.errors import ProxyError
from proxy.server.record.loopwatch import T_HANDLER, T_RECEIVED
from proxy.server.request.output import BufferOutput, Output, SendOutput, start
from proxy.server.request.relay import Attempt
from proxy.timing import StreamTimer

log = logging.getLogger("enginemeter.relay")

SERVER_TIMING = b"server-timing"


def server_timing(timer: StreamTimer) -> str:
    """The ``Server-Timing`` value for a request timed by ``timer``, as far as it has come (module docstring)."""
    t0 = timer.t_received_ns
    parts = []
    if timer.t_handler_ns:
        parts.append(f"queue;dur={(timer.t_handler_ns - t0) / 1e6:.3f}")
    sent = timer.t_sent_ns
    if sent:
        parts.append(f"proxy;dur={(sent - t0) / 1e6:.3f}")
        answer = timer.t_first_read_ns or timer.t_done_ns or timer.t_headers_ns
        if answer:
            parts.append(f"engine;dur={(answer - sent) / 1e6:.3f}")
    else:
        parts.append(f"proxy;dur={(time.perf_counter_ns() - t0) / 1e6:.3f}")
    return ", ".join(parts)


def scope_timer(scope: Scope) -> StreamTimer:
    """The request's clock from what the server's protocol and the app stamped in ``scope``
    (``proxy.server.record.loopwatch``); started now when nothing was stamped."""
    return StreamTimer(scope.get(T_RECEIVED), scope.get(T_HANDLER, 0))


class ServerTimingMiddleware:
    """Pure ASGI: a response that has no ``Server-Timing`` of its own gets the proxy's time to its head (the routes
    served through Starlette: ``/health``, ``/metrics``, ``/v1/models``, admin; the generation and pass-through
    routes set theirs)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], object]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # type: ignore[misc]
            return
        timer = scope_timer(scope)

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == SERVER_TIMING for k, _ in headers):
                    headers.append((SERVER_TIMING, server_timing(timer).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, timed)  # type: ignore[misc]


class RelayResponse:
    """ASGI response for an SSE relay. A client hang-up is noticed by the caller's watcher
    (``Gateway.respond``), which cancels this response; the relay's ``finally`` closes the upstream.

    The chunks go straight to the client's socket when ``send`` is uvicorn's own (``output.socket_output``), else
    through ``send``. ``on_end`` runs just before the response's last message (the watcher stops there: uvicorn
    reports a finished response as a disconnect).

    HTTP/1.0 has no chunked encoding and uvicorn's httptools protocol cannot end a body by closing the
    connection, so an HTTP/1.0 client gets the stream whole, with a Content-Length, once it has ended.
    """

    media_type = "text/event-stream"

    def __init__(self, attempt: Attempt, headers: dict[str, str]) -> None:
        self.attempt = attempt
        self.on_end: Callable[[], None] = _nothing
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
            (SERVER_TIMING, server_timing(attempt.timer).encode()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope.get("http_version") == "1.0":
                buffer = BufferOutput()
                await self.attempt.relay(buffer)
                whole = b"".join(buffer.chunks)
                headers = [*self.headers, (b"content-length", str(len(whole)).encode())]
                self.on_end()
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": whole, "more_body": False})
                return
            output = await start(send, {"type": "http.response.start", "status": 200, "headers": self.headers})
            _say_path(output)
            await self.attempt.relay(output)
            await output.flush()  # a head still held (nothing was written) goes before the end
            self.on_end()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-send; the relay's finally records it
        finally:
            if not self.attempt.finished:  # the relay closes it in its finally: this is for what never started
                with anyio.CancelScope(shield=True):
                    await self.attempt.close()


def _nothing() -> None:
    return None


_said: set[type] = set()


def _say_path(output: Output) -> None:
    """Log once per process which way streamed chunks go (an operator can tell the fast path from the fallback)."""
    kind = type(output)
    if kind not in _said:
        _said.add(kind)
        if isinstance(output, SendOutput):
            how = "through the server's ASGI send (not uvicorn's httptools protocol, or a middleware wraps send)"
        else:
            how = "straight to the client's socket (uvicorn's httptools protocol)"
        log.info("stream chunks go %s", how)


def error_response(
    exc: ProxyError,
    request_id: str,
    engine: str | None = None,
    headers: dict[str, str] | None = None,
    timer: StreamTimer | None = None,
) -> Response:
    """The proxy's own error (OpenAI-style envelope marked ``"enginemeter": true``) as a JSON response; with the
    request's ``timer``, its ``Server-Timing`` (else ``ServerTimingMiddleware`` adds one where it runs)."""
    headers = {"x-enginemeter-request-id": request_id, **(headers or {})}
    if engine:
        headers["x-enginemeter-engine"] = engine
    if timer is not None:
        headers["server-timing"] = server_timing(timer)
    return Response(exc.to_bytes(), status_code=exc.status, headers=headers, media_type="application/json")
