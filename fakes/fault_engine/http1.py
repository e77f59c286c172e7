"""Just enough HTTP/1.1: request parsing (keep-alive, chunked bodies) and response framing, on one asyncio
connection whose read buffer the disconnect watcher shares."""

from __future__ import annotations

import asyncio
import http
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from fakes.fault_engine.config import MAX_BODY_BYTES, MAX_HEAD_BYTES
from fakes.fault_engine.shapes import _dumps


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes
    keep_alive: bool


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_reason(status)}", "Server: llama.cpp", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _json_response(status: int, obj: Any, *, keep_alive: bool = True) -> bytes:
    body = _dumps(obj)
    headers = [
        ("Content-Type", "application/json; charset=utf-8"),
        ("Content-Length", str(len(body))),
        ("Keep-Alive", "timeout=5, max=100") if keep_alive else ("Connection", "close"),
    ]
    return _head(status, headers) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_SSE_HEAD: Final = _head(
    200,
    [
        ("X-Accel-Buffering", "no"),
        ("Content-Type", "text/event-stream"),
        ("Transfer-Encoding", "chunked"),
        ("Keep-Alive", "timeout=5, max=100"),
    ],
)
_LAST_CHUNK: Final = b"0\r\n\r\n"


class _Conn:
    """One client connection: a read buffer shared by the request parser and the disconnect watcher."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.eof = False

    async def fill(self) -> bool:
        if self.eof:
            return False
        try:
            data = await self.reader.read(65536)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def wait_gone(self) -> None:
        """Return once the client has closed its side (pipelined bytes stay in ``buf``)."""
        while await self.fill():
            pass

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _read_line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD_BYTES:
                raise _BadRequest(400, "line too long")
            if not await self.fill():
                raise _BadRequest(400, "truncated request")
        line = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return line

    async def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise _BadRequest(400, "truncated body")
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            try:
                size = int(bytes((await self._read_line()).split(b";")[0]).strip(), 16)
            except ValueError:
                raise _BadRequest(400, "bad chunk size") from None
            if size == 0:
                while await self._read_line():  # trailers
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise _BadRequest(413, "body too large")
            body += await self._read_exact(size)
            if await self._read_exact(2) != b"\r\n":
                raise _BadRequest(400, "bad chunk")

    async def read_request(self) -> _Request | None:
        """The next request, or ``None`` when the client closed between requests."""
        while True:
            while self.buf[:2] == b"\r\n":  # stray CRLFs between requests are allowed
                del self.buf[:2]
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buf) > MAX_HEAD_BYTES:
                raise _BadRequest(431, "request header too large")
            if not await self.fill():
                if self.buf.strip():
                    raise _BadRequest(400, "truncated request")
                return None
        head = bytes(self.buf[:end]).decode("latin-1")
        del self.buf[: end + 4]
        request_line, *header_lines = head.split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "bad request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                raise _BadRequest(400, "bad header line")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked()
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest(400, "bad content-length") from None
            if length < 0 or length > MAX_BODY_BYTES:
                raise _BadRequest(413, "body too large")
            body = await self._read_exact(length)
        connection = headers.get("connection", "").lower()
        keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
        url = urlsplit(target)
        return _Request(method.upper(), url.path or "/", parse_qs(url.query), headers, body, keep_alive)


async def _forever() -> None:
    await asyncio.Event().wait()
