"""Where a relayed stream's bytes go, one ``Output`` per stream.

The relay (``Attempt.relay``) hands every upstream read to ``Attempt._on_chunk`` from the upstream connection's
own ``data_received`` callback (``h1._H1Response.pump``): it timestamps the read, frames and checks the events
and calls ``Output.write`` with the bytes for the client, all before control goes back to the event loop. No
task wakes up per chunk unless ``write`` asks for it (returns True), and then the relay awaits ``flush()``.

- ``SocketOutput``: the client's own socket, when the server is uvicorn's httptools protocol (``enginemeter
  serve``'s). ``write`` frames the chunk (HTTP/1.1 chunked encoding) and writes it to the transport: one
  ``write`` a read, as uvicorn's ``send`` does, without the ASGI message, the send wrappers and the task switch
  in between. It asks for a flush only when the client's socket buffer is full (uvicorn's flow control); the
  relay then stops reading the engine until the client has caught up. The response's head and its end still go
  through uvicorn's ``send``, so keep-alive, the access log and the cycle's state stay uvicorn's.
- ``SendOutput``: any other ASGI server (h11, tests that run the app elsewhere): the chunks queue and the relay
  sends them with ``await send(...)``, one ASGI message each, as any ASGI app does.
- ``BufferOutput``: an HTTP/1.0 client (no chunked encoding): the whole stream, sent once it has ended.
- ``DiscardOutput``: a shadow copy; its bytes go nowhere.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from starlette.types import Send


class Output(Protocol):
    def write(self, data: bytes) -> bool:
        """Take ``data`` (one upstream read's worth, never empty); True: the relay must ``flush()`` before it
        reads on. Called from the upstream connection's callback: must not block, must not raise."""
        ...

    async def flush(self) -> None: ...


class DiscardOutput:
    def write(self, data: bytes) -> bool:
        return False

    async def flush(self) -> None:
        return None


#: the one ``DiscardOutput`` (it has no state)
DISCARD = DiscardOutput()


class BufferOutput:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> bool:
        self.chunks.append(data)
        return False

    async def flush(self) -> None:
        return None


class SendOutput:
    """Chunks queue in the callback and go out as ASGI messages when the relay flushes."""

    __slots__ = ("_queue", "_send")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._queue: list[bytes] = []

    def write(self, data: bytes) -> bool:
        self._queue.append(data)
        return True

    async def flush(self) -> None:
        while self._queue:
            queue, self._queue = self._queue, []
            for data in queue:
                await self._send({"type": "http.response.body", "body": data, "more_body": True})


#: uvicorn's httptools request/response cycle, as ``socket_output`` finds it behind ``send``
_HTTPTOOLS_CYCLE = "uvicorn.protocols.http.httptools_impl.RequestResponseCycle"


class SocketOutput:
    """Writes chunks straight to the client's transport (uvicorn's httptools cycle; see ``socket_output``)."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport: asyncio.Transport = cycle.transport
        self._flow = cycle.flow

    def write(self, data: bytes) -> bool:
        if self._cycle.disconnected:
            return False  # uvicorn's send drops writes to a closed client the same way; the watcher cancels us
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return bool(self._flow.write_paused)

    async def flush(self) -> None:
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()


def socket_output(send: Send) -> SocketOutput | None:
    """A ``SocketOutput`` when ``send`` is uvicorn's httptools cycle's own ``send`` (nothing wraps it), the
    response has started with chunked encoding and the client is still there; else None (use ``SendOutput``).

    This reads uvicorn's ``RequestResponseCycle`` (``transport``, ``flow``, ``disconnected``,
    ``chunked_encoding``, ``response_started``): internals, checked by class and attribute, and covered by
    ``tests/test_output.py`` against the uvicorn that is installed. Anything unexpected: None.
    """
    cycle = getattr(send, "__self__", None)
    if cycle is None:
        return None
    cls = type(cycle)
    if f"{cls.__module__}.{cls.__qualname__}" != _HTTPTOOLS_CYCLE:
        return None
    try:
        ok = cycle.response_started and cycle.chunked_encoding is True and not cycle.response_complete
        ok = ok and not cycle.disconnected and hasattr(cycle.flow, "write_paused") and hasattr(cycle.flow, "drain")
        ok = ok and cycle.scope.get("method") != "HEAD"
    except AttributeError:
        return None
    return SocketOutput(cycle) if ok else None
