"""One upstream HTTP/1.1 connection of the relay's client (``proxy.server.request.h1``): an asyncio protocol whose
httptools (llhttp) parser calls back into it.

- The parser's callbacks fill ``chunks`` (``async for`` reads through ``_H1Response``), or hand each body read to
  ``sink`` while the relay pumps (``_H1Response.pump``): then a stream's chunk goes from the engine's socket to
  the client's inside this protocol's ``data_received``, without a task switch (``proxy.server.request.output``).
- The reader waits on one future (``wait``); the read timeout counts the engine's silence since the last read
  (``last_rx``), so a stream arms one timer per ``timeouts.read``, not one per read (``wait_read``).
- Backpressure: reading pauses while more than ``HIGH_WATER`` bytes wait for the relay, or while the relay
  flushes to a slow client (``pause``/``resume``; time paused is no engine silence).
- Failures are the client's own (``proxy.errors``' transport tree, which ``from_transport_error`` maps): a refused
  connection ``EngineUnreachable`` (``connect_error``), a close before the head ``EngineDisconnected``, a cut body
  or a malformed response ``EngineProtocolError``.
- A lost connection lets go of its parser (the parser holds the protocol: a reference cycle otherwise, which
  only the garbage collector would free).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

import httptools

from proxy.errors import EngineDisconnected, EngineProtocolError

#: stop reading from the engine while this much is buffered and not yet taken by the relay
HIGH_WATER = 1 << 20


class _NoCallbacks:
    """The protocol of ``_DEAD_PARSER``: none of the parser's callbacks."""


#: what a lost connection's ``parser`` becomes (``Conn.connection_lost``)
_DEAD_PARSER = httptools.HttpResponseParser(_NoCallbacks())


class Conn(asyncio.Protocol):
    """One connection: the parser's callbacks fill ``chunks``; the reader waits on ``_waiter``."""

    __slots__ = (
        "_paused",
        "_waiter",
        "buffered",
        "chunks",
        "done",
        "error",
        "flush_wanted",
        "framed",
        "headers_done",
        "idle_since",
        "keep_alive",
        "last_rx",
        "on_idle_close",
        "parser",
        "sink",
        "status",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.status = 0
        self.headers_done = False
        self.keep_alive = False
        self.framed = False
        self.done = False
        self.error: BaseException | None = None
        self.idle_since = 0.0
        #: set while the connection waits in the pool: the engine closing it then teaches the pool (H1Streams)
        self.on_idle_close: Callable[[], None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        #: set while ``pump`` runs: takes each body read in the parser's callback; True asks for a flush
        self.sink: Callable[[bytes], bool] | None = None
        self.flush_wanted = False
        #: ``time.monotonic()`` of the last read (the read timeout counts silence, not one timer per read)
        self.last_rx = 0.0

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineProtocolError(f"malformed response from the engine: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        # the parser holds this protocol (its callbacks): a reference cycle that only the garbage collector would
        # free, with the socket's buffers in it; nothing parses on a lost connection
        self.parser = _DEAD_PARSER
        if self.on_idle_close is not None:
            self.on_idle_close()
        if self.headers_done and not self.done and not self.framed and exc is None:
            self.done = True  # no content-length, not chunked: the body ends where the connection does
            self._wake()
        if not self.done:
            if not self.headers_done:
                self._fail(EngineDisconnected())
            else:
                self._fail(EngineProtocolError(f"the engine closed the connection mid-body ({exc or 'EOF'})"))

    # ---- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # read here: llhttp forgets it at the message's end
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        sink = self.sink
        if sink is not None:
            try:
                if sink(body):
                    self.flush_wanted = True
                    self._wake()
            except Exception as exc:  # the relay refused what the engine sent (malformed, oversized event)
                self.sink = None
                self.pause()
                self._fail(exc)
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER:
            self.pause()
        self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self._wake()

    # ---- reader side
    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until the parser says something (headers, body, end) or the connection fails; TimeoutError after
        ``timeout`` seconds of silence."""
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, timed_out, w) if timeout else None
        try:
            await w
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def pause(self) -> None:
        if self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
            # the read timeout is the engine's silence: time spent paused for a slow client is not
            self.last_rx = time.monotonic()

    async def wait_read(self, timeout: float | None) -> None:
        """As ``wait``, but the timeout counts silence since the last read (``last_rx``): a stream whose reads go
        to a sink arms one timer per ``timeout`` seconds, not one per read."""
        if not timeout:
            await self.wait(None)
            return
        while True:
            left = timeout - (time.monotonic() - self.last_rx)
            if left <= 0:
                raise TimeoutError("no data from the engine within the read timeout")
            try:
                await self.wait(left)
                return
            except TimeoutError:
                continue  # something arrived meanwhile (the sink took it): wait out the rest of the new silence

    def take(self) -> bytes:
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        self.resume()
        return data

    def reusable(self) -> bool:
        t = self.transport
        return self.done and self.error is None and t is not None and not t.is_closing() and self.keep_alive

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.chunks, self.buffered, self.status = [], 0, 0
        self.headers_done = self.done = self.keep_alive = self.framed = self.flush_wanted = False
        self.error = None
        self.sink = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def timed_out(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(TimeoutError("no data from the engine within the read timeout"))
