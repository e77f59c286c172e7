"""Connection limits below the ASGI app: what uvicorn's httptools protocol does not bound by itself.

``GuardedHttpToolsProtocol`` adds to uvicorn's protocol (``server_options()`` gives it to ``uvicorn.run``):

- a **header-read deadline** (``HEADER_TIMEOUT_S``): from the moment a connection opens (or a kept-alive one
  starts its next request) to the end of the request head. A connection that sends nothing, or sends its head
  a byte at a time (slowloris), is closed when it runs out. uvicorn arms its ``timeout_keep_alive`` only after a
  response, so a connection that never sent a request stayed open forever.
- a **head size limit** (``MAX_HEAD_BYTES``): request line plus headers; over it -> 431 and close, before
  httptools has buffered more than the limit (a 64 MiB header used to get a 200).
- a connection whose response is done while its request body is still arriving (an error answered early) is
  closed after the keep-alive timeout unless its next request has begun; a slow body trickling in after the
  answer used to hold it open forever.
- a warning in the log when open client connections pass 80 % of half the file-descriptor limit (each stream
  also holds an upstream socket); ``raise_fd_limit()`` raises the soft ``RLIMIT_NOFILE`` to the hard one at start.

The request *body* deadline is the app's (``Gateway.read_body``): it knows which routes read a body.

The protocol also tells the app's ``LoopWatch`` (``proxy.server.loopwatch``) when a request head is whole, so the
time a request then waits for the event loop is measured (``enginemeter_requests_queued``, its ``t_received_ns``).

``server_config()`` is the one uvicorn configuration ``enginemeter serve`` runs, in its own process and in every
``--workers`` worker alike: these limits, one log format, and the graceful-shutdown timeout
(``SHUTDOWN_TIMEOUT_S``, ``--shutdown-timeout``): after SIGTERM/SIGINT the proxy stops accepting, waits that long
for requests in progress (streams included), then cancels what is left (each closes its upstream connection and
ends in its one outcome) and exits.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.server.loopwatch import LoopWatch, settle_process

log = logging.getLogger("enginemeter")

HEADER_TIMEOUT_S = 10.0
#: after SIGTERM/SIGINT, requests in progress get this long to finish before they are cancelled (``--shutdown-timeout``)
SHUTDOWN_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 * 1024
#: uvicorn's default; said here so the choice is visible (idle kept-alive client connections)
KEEPALIVE_TIMEOUT_S = 5.0

_warned_at = 0.0


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (systemd's default soft limit is 1,024). Returns
    (soft, hard) after the change; never raises."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError) as exc:
        log.warning("could not raise the open-file limit: %s", exc)
        return resource.getrlimit(resource.RLIMIT_NOFILE)


def _fd_soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header-read deadline and a head size limit (module docstring)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    max_head_bytes: int = MAX_HEAD_BYTES
    #: told of every request head (``guarded_protocol(loop_watch=...)``: the app's)
    loop_watch: LoopWatch | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = True
        self._head_bytes = 0
        self._parsed_head = 0
        self._too_large = False
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()
        n = len(self.connections)
        limit = _fd_soft_limit() // 2
        if n > 0.8 * limit:
            global _warned_at
            now = time.monotonic()
            if now - _warned_at > 10:
                _warned_at = now
                log.warning(
                    "%d open client connections: near the open-file limit (%d; each stream also holds an "
                    "upstream socket)",
                    n,
                    _fd_soft_limit(),
                )

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self._too_large = True
            self.send_400_response("request head too large")

    def on_message_begin(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, n: int) -> None:
        # counts the parsed head (the data_received count also holds body bytes that came in the same read)
        self._parsed_head += n
        if self._parsed_head > self.max_head_bytes:
            self._too_large = True
            raise ValueError("request head too large")  # httptools -> HttpParserCallbackError -> our 431

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._parsed_head = 0
        self._disarm_head_timer()
        if self.loop_watch is not None:
            self.loop_watch.accepted(self.scope)  # type: ignore[arg-type]  # a TypedDict is a MutableMapping at run time
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if cycle is not None and cycle.more_body and not self.transport.is_closing():
            # answered before the body was whole (an error): the rest is discarded as it comes, for at most the
            # keep-alive timeout (closing at once would reset the connection under the client's answer); a body
            # trickling in after that no longer holds the connection
            self._linger = self.loop.call_later(self.timeout_keep_alive, self._linger_over)

    def _linger_over(self) -> None:
        self._linger = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if not self._too_large:
            super().send_400_response(msg)
            return
        body = (
            b'{"error":{"message":"request head (request line and headers) exceeds '
            + str(self.max_head_bytes).encode()
            + b' bytes","type":"invalid_request_error","param":null,"code":431,"enginemeter":true}}'
        )
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        self.transport.close()


def guarded_protocol(
    *,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_head_bytes: int = MAX_HEAD_BYTES,
    loop_watch: LoopWatch | None = None,
) -> type:
    """The protocol class with other limits (tests use short ones), telling ``loop_watch`` of each request."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes, "loop_watch": loop_watch},
    )


def server_options(**limits: Any) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config``: the guarded protocol and keep-alive timeout
    (``limits``: ``guarded_protocol``'s)."""
    return {
        "http": guarded_protocol(**limits) if limits else GuardedHttpToolsProtocol,
        "timeout_keep_alive": KEEPALIVE_TIMEOUT_S,
    }


def server_config(
    app: Any, *, log_level: str = "info", shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S, **limits: Any
) -> uvicorn.Config:
    """The uvicorn configuration of ``enginemeter serve``, one process or each of ``--workers N``: the connection
    limits above, the graceful-shutdown timeout, uvicorn's loggers into the root handler (one log format); the
    protocol tells the app's ``LoopWatch`` of each request (``app.state.gateway.loop_watch``, if it has one)."""
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    watch = getattr(gateway, "loop_watch", None)
    if watch is not None:
        limits.setdefault("loop_watch", watch)
    return uvicorn.Config(
        app,
        log_config=None,
        log_level=log_level,
        access_log=False,
        # typed int, used as asyncio.timeout()'s delay: fractions work
        timeout_graceful_shutdown=shutdown_timeout_s,  # type: ignore[arg-type]
        **server_options(**limits),
    )


class Server(uvicorn.Server):
    """The server of ``enginemeter serve`` (one process or each worker): once it serves (the app's start-up done,
    the socket listening) it settles the process (``loopwatch.settle_process``: ``gc.freeze()``, the GIL's switch
    interval) and calls ``on_started``."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            settle_process()
            if self._on_started is not None:
                self._on_started()
