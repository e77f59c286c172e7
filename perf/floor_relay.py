"""The floor of one Python process in a stream's path: a uvloop TCP relay that does nothing else.

``perf/overhead.py --floor`` runs it as target ``floor`` (and ``floor+parse``) beside the proxy and nginx, in the
same interleaved rounds, so a figure of the proxy can be read against what any asyncio/uvloop process on the same
cores pays before it does a thing of its own:

- ``floor``: every client connection gets one upstream connection; bytes go both ways as they are read (one
  ``transport.write`` per read, flow control by pause/resume reading). No HTTP parsing, no timing, no metrics.
- ``floor+parse`` (``--parse``): the same, plus the least the measuring proxy must do per upstream read: one
  ``perf_counter_ns``, find the SSE events in it and ``orjson.loads`` each ``data:`` line (to tell token events).

Not a proxy anyone should run: it ignores HTTP (a connection is spliced whole), so it only stands in for the
path a chunk takes.

    python perf/floor_relay.py --listen-port P --upstream-port U [--parse] [--procs N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import time

import orjson

try:
    import uvloop
except ImportError:  # pragma: no cover - the proxy runs on uvloop; so does its floor
    uvloop = None


class _Side(asyncio.Protocol):
    """One end of a spliced pair: what it reads goes to ``peer``'s transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
            return
        peer.transport.write(data)

    def pause_writing(self) -> None:  # our transport's buffer is full: stop reading the peer
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Upstream(_Side):
    """The engine's end, with ``parse``: stamp each read and parse its SSE events' data lines."""

    parse = False
    last_stamp = 0  # written every read, as a measuring proxy stamps it

    def data_received(self, data: bytes) -> None:
        if self.parse:
            _Upstream.last_stamp = time.perf_counter_ns()
            start = data.find(b"data: ")
            while start >= 0:
                end = data.find(b"\n", start)
                line = data[start + 6 : end if end >= 0 else len(data)]
                if line[:1] == b"{":
                    orjson.loads(line)
                start = data.find(b"data: ", end) if end >= 0 else -1
        super().data_received(data)


class _Client(_Side):
    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(_Upstream, "127.0.0.1", self.upstream_port)
        except OSError:
            assert self.transport is not None
            self.transport.close()
            return
        up.peer, self.peer = self, up
        for data in self.pending:
            up.transport.write(data)  # type: ignore[union-attr]
        self.pending = []


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    return sock


async def _serve(sock: socket.socket, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream_port), sock=sock, backlog=4096)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen-port", type=int, required=True)
    ap.add_argument("--upstream-port", type=int, required=True)
    ap.add_argument("--parse", action="store_true", help="stamp each upstream read and parse its SSE data lines")
    ap.add_argument("--procs", type=int, default=1, help="processes on the one port (SO_REUSEPORT)")
    args = ap.parse_args()
    _Upstream.parse = args.parse
    # every process's socket is bound and listening before any serves: the first answer means all are there
    socks = [_listen(args.listen_port) for _ in range(args.procs)]
    mine, children = socks[0], []
    for sock in socks[1:]:
        pid = os.fork()
        if pid == 0:
            mine, children = sock, []
            break
        children.append(pid)
    for sock in socks:
        if sock is not mine:
            sock.close()
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        run(_serve(mine, args.upstream_port))
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        for pid in children:
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
