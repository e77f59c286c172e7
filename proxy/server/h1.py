"""The relay's upstream client: HTTP/1.1 over plain asyncio connections, httptools (llhttp) parsing the response.

Why not aiohttp (which the relay used before): per request, aiohttp builds a ``ClientRequest``, CIMultiDict
headers, trace hooks, a timer context and a ``ClientResponse``, and reads each chunk through ``StreamReader`` and
``iter_any``; measured against llama-server (a new connection per stream: it closes after every streamed
response) it cost 0.6-1.2 ms of CPU and ~1 ms of TTFT per request over a plain asyncio connection
(docs/performance.md). Here a request is one ``transport.write`` of a prebuilt head and the body, the parser
calls back into the connection's protocol, and a body read hands over whatever arrived since the last read.

Two ways to read a body: ``async for chunk in response`` (each read wakes the reader's task), or ``pump(sink,
output)``, the relay's: the parser hands every read to ``sink`` inside the connection's own ``data_received``,
so a stream's chunk goes from the engine's socket to the client's without a task switch (``proxy.server.output``).

It is a ``StreamClient`` (``proxy.server.upstream``) and raises what the relay already maps
(``proxy.errors.from_transport_error``): aiohttp's exception classes, so a refused connection is still a
``connect_error``, a connection the engine closed before answering a ``ServerDisconnectedError``, a timeout still
a ``TimeoutError``.

Pool: at most ``max_connections`` requests in flight per engine (a semaphore; waiting for one counts against
``timeouts.pool``), idle connections kept LIFO for ``KEEPALIVE_EXPIRY_S`` and only when the engine's response
allowed keep-alive. Timeouts: ``connect`` per new socket, ``read`` between two reads (as httpx and aiohttp).
A response closed before its end closes its connection, so the engine frees the slot at once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, cast
from urllib.parse import unquote, urlsplit

import aiohttp
import httptools

from proxy.settings import EngineSettings

if TYPE_CHECKING:
    from proxy.server.output import Output

log = logging.getLogger("enginemeter.upstream")

#: as ``upstream.KEEPALIVE_EXPIRY_S`` (not imported: upstream imports this module)
KEEPALIVE_EXPIRY_S = 4.0
#: stop reading from the engine while this much is buffered and not yet taken by the relay
HIGH_WATER = 1 << 20


class EngineUnreachable(aiohttp.ClientConnectorError):
    """The connection could not be made (refused, no route): ``connect_error``."""

    def __init__(self, host: str, port: int, os_error: OSError) -> None:
        OSError.__init__(self, os_error.errno, os_error.strerror)
        self._host, self._port, self._os_error = host, port, os_error

    def __str__(self) -> str:
        return f"Cannot connect to host {self._host}:{self._port} [{self._os_error.strerror or self._os_error}]"


class _Conn(asyncio.Protocol):
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
            self._fail(aiohttp.ClientPayloadError(f"malformed response from the engine: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.on_idle_close is not None:
            self.on_idle_close()
        if self.headers_done and not self.done and not self.framed and exc is None:
            self.done = True  # no content-length, not chunked: the body ends where the connection does
            self._wake()
        if not self.done:
            if not self.headers_done:
                self._fail(aiohttp.ServerDisconnectedError())
            else:
                self._fail(aiohttp.ClientPayloadError(f"the engine closed the connection mid-body ({exc or 'EOF'})"))

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
        timer = loop.call_later(timeout, _timeout, w) if timeout else None
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


def authorization(e: EngineSettings) -> str | None:
    """The ``Authorization`` header of every request to engine ``e``, on every route (generation, shadow copies,
    pass-through, probes, polls): ``Bearer <api_key>``; else Basic auth from the URL's ``user:password@`` (a
    reverse proxy in front of the engine); else none. One header holds one credential: ``api_key`` wins."""
    if e.api_key:
        return f"Bearer {e.api_key}"
    u = urlsplit(e.url)
    if u.username is None and u.password is None:
        return None
    userpass = f"{unquote(u.username or '')}:{unquote(u.password or '')}".encode()
    return "Basic " + base64.b64encode(userpass).decode("ascii")


def _peer_closed(t: asyncio.Transport) -> bool:
    """Whether the engine has closed this idle connection, even if the loop has not seen its FIN yet (a peek at the
    socket: three syscalls a reuse). llama-server closes after every streamed response though its headers say
    keep-alive, and the relay never retries a request on the same engine: a stale reuse would fail the request."""
    sock = t.get_extra_info("socket")
    if sock is None:
        return False
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as peek:
            return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # nothing to read: open
    except OSError:
        return True


def _timeout(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(TimeoutError("no data from the engine within the read timeout"))


class H1Streams:
    """Generation requests to one engine (a ``StreamClient``)."""

    def __init__(self, e: EngineSettings, max_connections: int, *, keep_alive: bool = True) -> None:
        u = urlsplit(e.url)
        self._https = u.scheme == "https"
        self._host = u.hostname or "127.0.0.1"
        self._port = u.port or (443 if self._https else 80)
        self._prefix = u.path.rstrip("/")
        host_header = u.netloc.rsplit("@", 1)[-1]
        credentials = authorization(e)
        auth = f"authorization: {credentials}\r\n" if credentials else ""
        self._head_tail = f" HTTP/1.1\r\nhost: {host_header}\r\n{auth}".encode("latin-1")
        t = e.timeouts
        self._connect_s, self._pool_s, self._read_s = t.connect, t.pool, t.read
        self._limit = max_connections
        self._sem: asyncio.Semaphore | None = None
        self._idle: list[_Conn] = []
        self._heads: dict[str, bytes] = {}
        #: the engine closed a pooled connection by itself (llama-server does after every streamed response,
        #: though its headers say keep-alive): from then on no connection is pooled, since reusing one would race
        #: the engine's FIN and the relay never retries a request on the same engine
        self._closes = not keep_alive
        self._host_port = f"{self._host}:{self._port}"

    async def _acquire(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._limit)
        if self._sem.locked():
            async with asyncio.timeout(self._pool_s + self._connect_s):
                await self._sem.acquire()
        else:
            await self._sem.acquire()

    def _release(self) -> None:
        assert self._sem is not None
        self._sem.release()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_s):
                _, conn = await loop.create_connection(
                    _Conn,
                    self._host,
                    self._port,
                    ssl=ssl.create_default_context() if self._https else None,
                )
        except TimeoutError:
            raise
        except OSError as exc:
            raise EngineUnreachable(self._host, self._port, exc) from exc
        return conn

    def _learn_closes(self) -> None:
        if not self._closes:
            log.info("engine %s closes idle connections after a response: not keeping them", self._host_port)
        self._closes = True

    def _pop_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            conn.on_idle_close = None
            t = conn.transport
            fresh = t is not None and not t.is_closing() and now - conn.idle_since < KEEPALIVE_EXPIRY_S
            if fresh and t is not None and not _peer_closed(t):
                return conn
            conn.close()
        return None

    def _put_idle(self, conn: _Conn) -> None:
        conn.reset()
        conn.on_idle_close = self._learn_closes
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def post(
        self, path: str, content: bytes, headers: dict[str, str], after_write: Callable[[], None] | None = None
    ) -> _H1Response:
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = b"POST " + (self._prefix + path).encode() + self._head_tail
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = b"".join((head, extra.encode("latin-1"), b"content-length: %d\r\n\r\n" % len(content), content))
        await self._acquire()
        conn: _Conn | None = None
        try:
            conn = self._pop_idle()
            if conn is None:
                conn = await self._connect()
            assert conn.transport is not None
            conn.transport.write(request)
            if after_write is not None:
                after_write()  # the caller's bookkeeping, while the engine reads the request
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._read_s)
        except BaseException:
            # failed, timed out or cancelled (the client left) before the headers: close, so the engine stops
            if conn is not None:
                conn.close()
            self._release()
            raise
        return _H1Response(self, conn)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.on_idle_close = None
            conn.close()


class _H1Response:
    """One response (``UpstreamResponse``): the status, then the body as it arrives."""

    __slots__ = ("_closed", "_conn", "_pool", "status_code")

    def __init__(self, pool: H1Streams, conn: _Conn) -> None:
        self._pool = pool
        self._conn = conn
        self._closed = False
        self.status_code = conn.status

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.done:
                raise StopAsyncIteration
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._pool._read_s)

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def pump(self, sink: Callable[[bytes], bool], output: Output) -> None:
        """Hand the rest of the body to ``sink``, read by read, from the connection's callback; ``output.flush()``
        whenever ``sink`` asks (True), with the engine's socket paused meanwhile (backpressure). Returns at the
        body's end; raises the transport's error, ``TimeoutError`` after ``timeouts.read`` of silence, or what
        ``sink`` raised."""
        conn = self._conn
        conn.sink = sink  # from here every read goes to the sink; what arrived before is taken below, first
        try:
            while True:
                if conn.error is not None:
                    raise conn.error
                if conn.chunks and sink(conn.take()):
                    conn.flush_wanted = True
                if conn.flush_wanted:
                    conn.flush_wanted = False
                    conn.pause()
                    try:
                        await output.flush()
                    finally:
                        conn.resume()
                    continue
                if conn.done:
                    return
                await conn.wait_read(self._pool._read_s)
        finally:
            conn.sink = None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        try:
            if conn.reusable() and not conn.chunks and not self._pool._closes:
                # an engine that closes after its response (llama-server after a stream) sends its FIN with the
                # last chunk: one loop turn lets it land before the connection is pooled, and teaches the pool
                await asyncio.sleep(0)
            if conn.reusable() and not conn.chunks and not self._pool._closes:
                self._pool._put_idle(conn)
            else:
                conn.close()  # cut off mid-body (client gone, error) or not kept alive: the engine frees its slot
        except BaseException:
            conn.close()  # cancelled in the turn above: never pooled, never a leaked slot
            raise
        finally:
            self._pool._release()
