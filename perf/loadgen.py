"""The overhead bench's load generator (``perf/overhead.py``, one or more processes): asyncio + raw sockets,
HTTP/1.1 keep-alive, timing on the client side with ``perf_counter_ns`` at the read that completed each SSE event.
It reads one round's command per line on stdin and answers one JSON line per round on stdout."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.stream import has_token, loads

MS = 1_000_000


class ChunkedDecoder:
    """Incremental HTTP/1.1 chunked transfer decoding: raw bytes in, payload bytes out."""

    def __init__(self) -> None:
        self.buf = b""
        self.remaining = 0
        self.need_crlf = False
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out: list[bytes] = []
        while not self.done:
            if self.remaining:
                take = self.buf[: self.remaining]
                out.append(take)
                self.remaining -= len(take)
                self.buf = self.buf[len(take) :]
                if self.remaining:
                    break
                self.need_crlf = True
            if self.need_crlf:
                if len(self.buf) < 2:
                    break
                self.buf = self.buf[2:]
                self.need_crlf = False
            i = self.buf.find(b"\r\n")
            if i < 0:
                break
            size = int(self.buf[:i].split(b";")[0], 16)
            self.buf = self.buf[i + 2 :]
            if size == 0:
                self.done = True  # trailers (none expected) and the final CRLF are left unread
            self.remaining = size
        return b"".join(out)


class Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


@dataclass
class StreamResult:
    ttft_ns: int = 0
    gaps_ns: list[int] = field(default_factory=list)
    tokens: int = 0
    t_start_ns: int = 0
    t_end_ns: int = 0
    error: str | None = None
    #: the stream ended with ``data: [DONE]``
    done: bool = False


class LoadGen:
    def __init__(self) -> None:
        self.pools: dict[tuple[str, int], list[Conn]] = {}

    async def _conn(self, host: str, port: int, fresh: bool = False) -> tuple[Conn, bool]:
        pool = self.pools.setdefault((host, port), [])
        while pool and not fresh:
            conn = pool.pop()
            if not conn.reader.at_eof():
                return conn, True
            conn.close()  # the server closed it after its last response (llama-server does after every stream)
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        return Conn(reader, writer), False

    async def stream(self, host: str, port: int, request: bytes, delay_s: float) -> StreamResult:
        if delay_s:
            await asyncio.sleep(delay_s)  # load shaping (spread starts), not synchronisation
        res = StreamResult()
        conn, reused = await self._conn(host, port)
        reusable = False
        try:
            res.t_start_ns = t0 = time.perf_counter_ns()
            conn.writer.write(request)
            reader = conn.reader
            buf = b""
            while b"\r\n\r\n" not in buf:
                try:
                    data = await reader.read(65536)
                except ConnectionResetError:
                    if not (reused and not buf.strip()):
                        raise
                    data = b""  # the same race as below, seen as a reset
                if not data and reused and not buf.strip():
                    # the server closed this idle keep-alive connection (uvicorn: after 5 s): retry once on a
                    # fresh one, as every HTTP client does; the connect counts in this stream's TTFT
                    conn.close()
                    conn, reused = await self._conn(host, port, fresh=True)
                    conn.writer.write(request)
                    reader = conn.reader
                    buf = b""  # a stray CRLF after the last response's final chunk
                    continue
                if not data:
                    raise ConnectionError("closed before response headers")
                buf += data
            head, _, rest = buf.lstrip(b"\r\n").partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status = int(lines[0].split(b" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip().lower()
            chunked = headers.get(b"transfer-encoding") == b"chunked"
            length = int(headers[b"content-length"]) if b"content-length" in headers else -1
            keep = headers.get(b"connection") != b"close"
            dec = ChunkedDecoder() if chunked else None
            received = 0
            sse = b""
            last = 0
            payload_bytes = rest
            t = time.perf_counter_ns()
            body: list[bytes] = []
            while True:
                payload = dec.feed(payload_bytes) if dec is not None else payload_bytes
                received += len(payload_bytes)
                if payload:
                    if status != 200:
                        body.append(payload)
                    else:
                        sse += payload
                        while True:
                            end = sse.find(b"\n\n")
                            if end < 0:
                                break
                            ev = sse[:end]
                            sse = sse[end + 2 :]
                            if ev == b"data: [DONE]":
                                res.done = True
                                continue
                            if not ev.startswith(b"data: "):
                                continue
                            if has_token(loads(ev[6:]).get("choices") or []):
                                if last:
                                    res.gaps_ns.append(t - last)
                                else:
                                    res.ttft_ns = t - t0
                                last = t
                                res.tokens += 1
                if dec is not None and dec.done:
                    break
                if dec is None and length >= 0 and received >= length:
                    break
                payload_bytes = await reader.read(65536)
                t = time.perf_counter_ns()
                if not payload_bytes:
                    keep = False
                    if dec is not None or length >= 0:
                        raise ConnectionError("closed mid-body")
                    break
            res.t_end_ns = time.perf_counter_ns()
            if status != 200:
                res.error = f"HTTP {status}: {b''.join(body)[:200]!r}"
            elif not res.tokens:
                res.error = "no token events"
            reusable = keep
        except (OSError, ValueError, IndexError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            res.t_end_ns = time.perf_counter_ns()
        finally:
            if reusable:
                self.pools[(host, port)].append(conn)
            else:
                conn.close()
        return res

    async def round(self, cmd: dict[str, Any]) -> dict[str, Any]:
        host, port, n = cmd["host"], int(cmd["port"]), int(cmd["streams"])
        body = json.dumps(cmd["body"]).encode()
        request = (
            f"POST {cmd['path']} HTTP/1.1\r\nHost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        if cmd.get("arrival") == "steady":
            # closed loop: N workers, phases spread evenly over one stream's length, each starting its next
            # request as soon as the last one ends, for `duration_s`: about N streams in flight all along
            period_s, duration_s = float(cmd["period_s"]), float(cmd["duration_s"])
            t_stop = time.perf_counter() + duration_s

            async def worker(i: int) -> list[StreamResult]:
                out = [await self.stream(host, port, request, period_s * i / n)]
                while time.perf_counter() < t_stop:
                    out.append(await self.stream(host, port, request, 0.0))
                return out

            results = [r for rs in await asyncio.gather(*(worker(i) for i in range(n))) for r in rs]
        else:
            # burst: all N at once (or spread over --ramp-ms); a batched engine's slots all start together
            ramp_s = float(cmd.get("ramp_ms", 0)) / 1000
            results = await asyncio.gather(
                *(self.stream(host, port, request, ramp_s * i / n if ramp_s else 0.0) for i in range(n))
            )
        ok = [r for r in results if r.error is None]
        errors = [r.error for r in results if r.error is not None]
        t0 = min(r.t_start_ns for r in results if r.t_start_ns) if any(r.t_start_ns for r in results) else 0
        t1 = max(r.t_end_ns for r in results)
        expect = int(cmd.get("expect_tokens", 0))

        def delivered(r: StreamResult) -> bool:
            return r.error is None and r.done and (not expect or r.tokens == expect)

        return {
            "ttft_ns": [r.ttft_ns for r in ok],
            "gaps_ns": [g for r in ok for g in r.gaps_ns],
            # per stream started: [longest gap, 1 if it was fully delivered] (the board's stall and delivery terms)
            "streams": [[max(r.gaps_ns, default=0), int(delivered(r))] for r in results],
            "tokens": sum(r.tokens for r in ok),
            "wall_ns": t1 - t0,
            "t0_ns": t0,
            "t1_ns": t1,
            "errors": len(errors),
            "first_error": errors[0] if errors else None,
        }


async def serve_rounds() -> None:
    """One round per command line on stdin, its JSON answer on stdout, until stdin closes."""
    gen = LoadGen()
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        cmd = json.loads(line)
        out = await gen.round(cmd)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(serve_rounds())
