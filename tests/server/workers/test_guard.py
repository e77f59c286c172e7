"""The connection guard's headroom below the open-file limit, and what an oversized body really gets
(proxy/server/workers/guard.py, ``Gateway.read_body``): a real ``serve`` process under a real limit, raw sockets."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from proxy.server.workers.guard import HEADER_TIMEOUT_S, KEEPALIVE_TIMEOUT_S, MIN_FD_HEADROOM, fd_budget
from tests.helpers import ProcessServer, wait_until

BODY = {"model": "m", "stream": False, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@contextmanager
def engine_and_proxy(
    *extra: str, wrapper: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[ProcessServer]:
    with ExitStack() as stack:
        engine = stack.enter_context(ProcessServer("fakes.fault_engine", "--tokens", "4", ready_path="/health"))
        proxy = ProcessServer(
            "proxy.cli", "serve", "--primary", engine.url, "--listen", "127.0.0.1:{port}", *extra,
            ready_path="/health", wrapper=wrapper, env=env, startup_timeout=60,
        )  # fmt: skip
        yield stack.enter_context(proxy)


def test_the_budget_keeps_an_eighth_of_the_limit_free() -> None:
    assert fd_budget(1024) == (896, 128)
    assert fd_budget(256) == (256 - MIN_FD_HEADROOM, MIN_FD_HEADROOM)
    assert fd_budget(65536) == (65536 - 8192, 8192)


@pytest.mark.parametrize("limit", ["1024:1024", "1024:4096"], ids=["hard", "soft-only"])
def test_idle_connections_near_the_fd_limit_leave_a_real_request_served(limit: str) -> None:
    """Issue 35: 1,100 idle connections against a proxy under ``ulimit -n 1024`` (soft = hard) and the next real
    request got a connection reset. The guard closes the oldest idle ones, keeping 128 files free."""
    soft = int(limit.split(":")[1])  # the soft limit is raised to the hard one at start
    with engine_and_proxy("--workers", "1", wrapper=("prlimit", f"--nofile={limit}")) as proxy:
        budget, headroom = fd_budget(soft)
        assert f"open-file limit: {soft}, headroom {headroom}: idle client connections are closed" in proxy.output()
        idle: list[socket.socket] = []
        try:
            t0 = time.monotonic()
            for _ in range(1100):
                idle.append(socket.create_connection(("127.0.0.1", proxy.port)))
            r = httpx.post(f"{proxy.url}/v1/chat/completions", json=BODY, timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text
            # served well before the header deadline would have closed the idle connections anyway
            assert took < HEADER_TIMEOUT_S - 2, took
            if soft > 1100 + headroom:
                return  # room for all of them: nothing to close
            # the oldest were closed by the proxy, the newest kept: idle ones are shed oldest first
            for s in idle:
                s.setblocking(False)

            def closed(s: socket.socket) -> bool:
                try:
                    return s.recv(1) == b""
                except BlockingIOError:
                    return False
                except OSError:
                    return True

            gone = [closed(s) for s in idle]
            assert 1100 - budget <= sum(gone) <= 1100 - budget + headroom, sum(gone)
            assert gone[0] and not gone[-1]
            assert "closed" in proxy.output() and "idle client connection(s), oldest first" in proxy.output()
        finally:
            for s in idle:
                s.close()


# --------------------------------------------------------------------------------------------- oversized bodies


def _whole(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return bool(sep) and m is not None and len(body) >= int(m.group(1))


def _send_slowly(s: socket.socket, seconds: float, chunk: bytes) -> tuple[bytes, float | None]:
    """Send ``chunk`` every 50 ms for ``seconds``, reading what comes back: (what came, ``time.monotonic()`` when
    the proxy closed the connection (EOF or reset; None: still open)). Returns once a whole answer came."""
    got, t0 = b"", time.monotonic()
    s.settimeout(0.05)
    while time.monotonic() - t0 < seconds and not _whole(got):
        try:
            s.sendall(chunk)
        except OSError:
            return got, time.monotonic()
        try:
            data = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return got, time.monotonic()
        if not data:
            return got, time.monotonic()
        got += data
    return got, None


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversized_body_is_answered_at_once_then_drained_for_the_keep_alive_timeout(framing: str) -> None:
    """docs/reliability.md: a 413 as soon as the limit is known to be passed (the declared content-length, before
    any of the body is read; a chunked body once the bytes read pass it); what the client still sends is read
    and dropped for at most the keep-alive timeout, then the connection is closed under a client still sending."""
    with engine_and_proxy("--workers", "1", env={"ENGINEMETER_MAX_BODY_BYTES": "1000"}) as proxy:
        s = socket.create_connection(("127.0.0.1", proxy.port))
        with s:
            head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            head += "content-length: 50000000\r\n" if framing == "content-length" else "transfer-encoding: chunked\r\n"
            s.sendall((head + "\r\n").encode())
            piece = b"a" * 4096
            chunk = piece if framing == "content-length" else b"%x\r\n%s\r\n" % (len(piece), piece)
            if framing == "content-length":  # the answer comes before a byte of the body is sent
                s.settimeout(5)
                got = b""
                while not _whole(got):
                    got += s.recv(65536)
            else:
                got, closed_at = _send_slowly(s, 5.0, chunk)
                assert closed_at is None
            answered = time.monotonic()
            assert got.startswith(b"HTTP/1.1 413 "), got[:100]
            assert b'"enginemeter":true' in got.replace(b" ", b"")
            assert not re.search(rb"(?im)^connection:\s*close", got.partition(b"\r\n\r\n")[0])
            # the client goes on sending: read and dropped until the keep-alive timeout, then closed
            more, closed_at = _send_slowly(s, KEEPALIVE_TIMEOUT_S + 5, chunk)
            assert more == b"" and closed_at is not None
            assert KEEPALIVE_TIMEOUT_S - 0.5 <= closed_at - answered <= KEEPALIVE_TIMEOUT_S + 2, closed_at - answered
        # the proxy counted it once, as rejected
        wait_until(lambda: 'outcome="rejected"' in httpx.get(f"{proxy.url}/metrics").text, timeout=10)


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout() -> None:
    """docs/reliability.md: a kept-alive connection with no next request is closed after 5 s."""
    with engine_and_proxy("--workers", "1") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            s.settimeout(KEEPALIVE_TIMEOUT_S + 5)
            got = b""
            while not _whole(got):
                got += s.recv(65536)
            answered = time.monotonic()
            assert got.startswith(b"HTTP/1.1 200 ")
            assert s.recv(65536) == b""  # blocks until the proxy closes it
            assert KEEPALIVE_TIMEOUT_S - 0.5 <= time.monotonic() - answered <= KEEPALIVE_TIMEOUT_S + 2
