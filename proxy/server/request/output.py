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
  through uvicorn's ``send``, so keep-alive, the access log and the cycle's state stay uvicorn's; the head is
  held and written with the first chunk (``start``).
- ``SendOutput``: any other ASGI server (h11, tests that run the app elsewhere): the chunks queue and the relay
  sends them with ``await send(...)``, one ASGI message each, as any ASGI app does.
- ``BufferOutput``: an HTTP/1.0 client (no chunked encoding): the whole stream, sent once it has ended.
- ``DiscardOutput``: a shadow copy; its bytes go nowhere.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from starlette.types import Message, Send


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
    """Writes chunks straight to the client's transport (uvicorn's httptools cycle; see ``socket_output``).

    ``head``: the response's head as uvicorn's ``send`` formatted it, not yet written (``start``): it goes out
    with the first chunk, in one write."""

    __slots__ = ("_cycle", "_flow", "_head", "_transport")

    def __init__(self, cycle: Any, head: bytes = b"") -> None:
        self._cycle = cycle
        self._transport: asyncio.Transport = cycle.transport
        self._flow = cycle.flow
        self._head = head

    def write(self, data: bytes) -> bool:
        if self._cycle.disconnected:
            return False  # uvicorn's send drops writes to a closed client the same way; the watcher cancels us
        if self._head:
            head, self._head = self._head, b""
            self._transport.write(b"%b%x\r\n%b\r\n" % (head, len(data), data))
        else:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return bool(self._flow.write_paused)

    async def flush(self) -> None:
        if self._head:  # nothing was written yet: the head goes now
            head, self._head = self._head, b""
            if not self._cycle.disconnected:
                self._transport.write(head)
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()


class _Held:
    """Stands in for the client's transport while uvicorn's ``send`` writes the response's head (``start``)."""

    __slots__ = ("data", "transport")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())


async def start(send: Send, message: Message) -> Output:
    """Send the response's head (``message``, its ``http.response.start``) and give where its body goes.

    Behind uvicorn's own httptools ``send`` (``socket_output``): uvicorn's ``send`` formats the head as always
    (default headers, keep-alive, chunked encoding, the cycle's state) into a stand-in for the transport, and
    the head goes out with the first chunk in one write: one syscall a stream fewer, and the client reads its
    head and first event at once (one wake-up fewer before its first token). Anywhere else: ``send`` it, and
    ``SendOutput``."""
    cycle = _httptools_cycle(send)
    if cycle is None:
        await send(message)
        return SendOutput(send)
    real = cycle.transport
    held = _Held(real)
    cycle.transport = held
    try:
        await send(message)  # writes the head and nothing else; it awaits only when the client's buffer is full
    finally:
        cycle.transport = real
    out = socket_output(send)
    if out is None:  # not a chunked response after all (or the client left): the head goes now, as it came
        if held.data and not real.is_closing():
            real.write(held.data)
        return SendOutput(send)
    out._head = held.data
    return out


def _httptools_cycle(send: Send) -> Any:
    """uvicorn's httptools ``RequestResponseCycle`` when ``send`` is its own ``send``, else None."""
    cycle = getattr(send, "__self__", None)
    if cycle is None:
        return None
    cls = type(cycle)
    return cycle if f"{cls.__module__}.{cls.__qualname__}" == _HTTPTOOLS_CYCLE else None


def socket_output(send: Send) -> SocketOutput | None:
    """A ``SocketOutput`` when ``send`` is uvicorn's httptools cycle's own ``send`` (nothing wraps it), the
    response has started with chunked encoding and the client is still there; else None (use ``SendOutput``).

    This reads uvicorn's ``RequestResponseCycle`` (``transport``, ``flow``, ``disconnected``,
    ``chunked_encoding``, ``response_started``): internals, checked by class and attribute, and covered by
    ``tests/server/request/test_output.py`` against the uvicorn that is installed. Anything unexpected: None.
    """
    cycle = _httptools_cycle(send)
    if cycle is None:
        return None
    try:
        ok = cycle.response_started and cycle.chunked_encoding is True and not cycle.response_complete
        ok = ok and not cycle.disconnected and hasattr(cycle.flow, "write_paused") and hasattr(cycle.flow, "drain")
        ok = ok and cycle.scope.get("method") != "HEAD"
    except AttributeError:
        return None
    return SocketOutput(cycle) if ok else None
