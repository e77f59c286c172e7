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
- **headroom below the open-file limit** (``fd_budget``): ``raise_fd_limit()`` raises the soft ``RLIMIT_NOFILE`` to
  the hard one at start and the limit and headroom are logged. The headroom (an eighth of the limit, at least
  ``MIN_FD_HEADROOM``) is for what a request needs besides its client socket: an upstream socket (two with a
  shadow copy), the logs. When a new connection finds the process's open files above ``limit - headroom``, the
  oldest *idle* client connections (no request in progress: nothing sent since they opened, or kept alive after
  an answer) are closed until it is below again, so a real request still gets its sockets; with nothing idle to
  close, a warning. Without this, 1,100 idle connections under ``ulimit -n 1024`` left the next real request a
  connection reset. The open files are counted from ``/proc/self/fd`` (at most every ``FD_RECOUNT_S``, the
  change in connections added in between), and only once the connections reach half the budget.

The request *body* deadline is the app's (``Gateway.read_body``): it knows which routes read a body.

The protocol also tells the app's ``LoopWatch`` (``proxy.server.record.loopwatch``) when a request head is whole, so the
time a request then waits for the event loop is measured (``enginemeter_requests_queued``, its ``t_received_ns``).

``server_config()`` is the one uvicorn configuration ``enginemeter serve`` runs, in its own process and in every
``--workers`` worker alike: these limits, one log format, and the graceful-shutdown timeout
(``SHUTDOWN_TIMEOUT_S``, ``--shutdown-timeout``): after SIGTERM/SIGINT the proxy stops accepting, waits that long
for requests in progress (streams included), then cancels what is left (each closes its upstream connection and
ends in its one outcome) and exits.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.server.record.loopwatch import LoopWatch, settle_process

log = logging.getLogger("enginemeter")

HEADER_TIMEOUT_S = 10.0
#: after SIGTERM/SIGINT, requests in progress get this long to finish before they are cancelled (``--shutdown-timeout``)
SHUTDOWN_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 * 1024
#: uvicorn's default; said here so the choice is visible (idle kept-alive client connections)
KEEPALIVE_TIMEOUT_S = 5.0

#: open files kept free below the limit: an eighth of it, at least this many (module docstring)
MIN_FD_HEADROOM = 64
#: the open-file count is read again at most this often; in between it moves with the connections
FD_RECOUNT_S = 0.1

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


def fd_budget(limit: int | None = None) -> tuple[int, int]:
    """(open files allowed before idle connections are closed, headroom) under ``limit`` (the soft limit)."""
    limit = _fd_soft_limit() if limit is None else limit
    if limit == resource.RLIM_INFINITY or limit <= 0:
        limit = 1 << 20
    headroom = min(max(MIN_FD_HEADROOM, limit // 8), limit // 2)
    return limit - headroom, headroom


def open_fds() -> int | None:
    """This process's open files (``/proc/self/fd``, else ``/dev/fd``); None where neither can be listed."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d)) - 1  # less the descriptor that lists the directory
        except OSError:
            continue
    return None


class _FdCount:
    """The open-file count, read at most every ``FD_RECOUNT_S``; in between, moved by the change in client
    connections since the last reading (each holds one)."""

    def __init__(self) -> None:
        self.at = -FD_RECOUNT_S
        self.files = 0
        self.connections = 0

    def now(self, connections: int) -> int:
        t = time.monotonic()
        if t - self.at >= FD_RECOUNT_S:
            counted = open_fds()
            # no listing: every connection an fd and an upstream socket, as the old warning assumed
            self.files = counted if counted is not None else 2 * connections
            self.at, self.connections = t, connections
        return self.files + connections - self.connections


_fd_count = _FdCount()


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
        #: since when no request is in progress on this connection (None: one is); idle ones may be shed
        self.idle_since: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        self._arm_head_timer()
        self._keep_fd_headroom()

    def _keep_fd_headroom(self) -> None:
        """Close the oldest idle connections while the open files are above the budget (module docstring)."""
        n = len(self.connections)
        budget, headroom = fd_budget()
        if n < budget // 2:
            return
        conns: list[GuardedHttpToolsProtocol] = [c for c in self.connections if isinstance(c, GuardedHttpToolsProtocol)]
        closing = sum(1 for c in conns if c.transport.is_closing())  # their fds are freed on the next loop turn
        excess = _fd_count.now(n) - closing - budget
        if excess <= 0:
            return
        idle = [c for c in conns if c is not self and c.idle_since is not None and not c.transport.is_closing()]
        # a few more than the excess, so that the next connections do not each close one
        shed = heapq.nsmallest(excess + max(1, headroom // 8), idle, key=lambda c: c.idle_since or 0.0)
        for c in shed:
            c.transport.close()
        global _warned_at
        now = time.monotonic()
        if now - _warned_at > 10 or len(shed) < excess:
            _warned_at = now
            log.warning(
                "%d open files, limit %d (headroom %d kept free): closed %d idle client connection(s), oldest first%s",
                budget + excess + closing,
                budget + headroom,
                headroom,
                len(shed),
                "" if len(shed) >= excess else f"; {excess - len(shed)} over with no idle connection left to close",
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
        self.idle_since = None  # a request has begun (or goes on)
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
        elif not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.idle_since = time.monotonic()  # kept alive, waiting for its next request (none pipelined)

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
