"""Shared test helpers: free ports, polling with a deadline, a real uvicorn server in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from starlette.types import ASGIApp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05) -> None:
    """Poll ``predicate`` until it is truthy; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            if predicate():
                return
        except Exception as exc:  # the thing polled may not be up yet
            last_exc = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s (last error: {last_exc!r})")
        time.sleep(interval)


@contextlib.contextmanager
def run_uvicorn_app(app: ASGIApp, *, port: int | None = None) -> Iterator[str]:
    """Serve ``app`` with a real uvicorn server on 127.0.0.1 in a thread; yield its base URL.

    Real sockets, real chunk timing (in-process ASGI transports buffer whole responses).
    """
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout=30, interval=0.01)
        if not server.started:
            raise RuntimeError("uvicorn did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
