"""The relay's upstream client: HTTP/1.1 over plain asyncio connections, httptools (llhttp) parsing the response.

Why not aiohttp (which the relay used before): per request, aiohttp builds a ``ClientRequest``, CIMultiDict
headers, trace hooks, a timer context and a ``ClientResponse``, and reads each chunk through ``StreamReader`` and
``iter_any``; measured against llama-server (a new connection per stream: it closes after every streamed
response) it cost 0.6-1.2 ms of CPU and ~1 ms of TTFT per request over a plain asyncio connection
(docs/performance.md). Here a request is one ``transport.write`` of a prebuilt head and the body, the parser
calls back into the connection's protocol, and a body read hands over whatever arrived since the last read.

Two ways to read a body: ``async for chunk in response`` (each read wakes the reader's task), or ``pump(sink,
output)``, the relay's: the parser hands every read to ``sink`` inside the connection's own ``data_received``,
so a stream's chunk goes from the engine's socket to the client's without a task switch (``proxy.server.request.output``).

It is a ``StreamClient`` (``proxy.server.request.upstream``) and raises what the relay already maps
(``proxy.errors.from_transport_error``): its own transport errors (``proxy.errors``), so a refused connection is a
``connect_error`` (``EngineUnreachable``), a connection the engine closed before answering ``EngineDisconnected``,
a timeout a ``TimeoutError``.

Pool: at most ``max_connections`` requests in flight per engine (a semaphore; waiting for one counts against
``timeouts.pool``), idle connections kept LIFO for ``KEEPALIVE_EXPIRY_S`` and only when the engine's response
allowed keep-alive. Timeouts: ``connect`` per new socket, ``read`` between two reads (as httpx and aiohttp).
A response closed before its end closes its connection, so the engine frees the slot at once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import select
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from proxy.config.settings import EngineSettings
from proxy.errors import EngineUnreachable
from proxy.server.request.h1conn import Conn

if TYPE_CHECKING:
    from proxy.server.request.output import Output

log = logging.getLogger("enginemeter.upstream")

#: as ``upstream.KEEPALIVE_EXPIRY_S`` (not imported: upstream imports this module)
KEEPALIVE_EXPIRY_S = 4.0


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


#: an idle connection with any of these has been closed by the engine (or sent bytes nobody asked for)
_STALE = select.POLLIN | select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _peer_closed(t: asyncio.Transport) -> bool:
    """Whether the engine has closed this idle connection, even if the loop has not seen its FIN yet: one
    ``poll`` of its socket, no wait (it was a peek through a duplicated socket: six syscalls a reuse). Readable at
    all counts as closed: an idle HTTP/1.1 connection has nothing to say but its end. llama-server closes after
    every streamed response though its headers say keep-alive, and the relay never retries a request on the same
    engine: a stale reuse would fail the request."""
    sock = t.get_extra_info("socket")
    if sock is None:
        return False
    try:
        p = select.poll()
        p.register(sock.fileno(), _STALE)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True


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
        self._idle: list[Conn] = []
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

    async def _connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_s):
                _, conn = await loop.create_connection(
                    Conn,
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

    def _pop_idle(self) -> Conn | None:
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

    def _put_idle(self, conn: Conn) -> None:
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
        conn: Conn | None = None
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

    def __init__(self, pool: H1Streams, conn: Conn) -> None:
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
