"""The client hanging up: from the end of a request's body on, a watcher waits on ``receive()``, and a client that
leaves in any phase (queued, prefill, streaming, a non-stream wait) cancels the request's task at once, which
closes the upstream connection so the engine stops working for nobody (counted ``client_disconnect``).

``guarded`` is that watcher around the serving of one request, for the generation routes
(``proxy.server.app.Gateway.respond``) and the pass-through ones (``proxy.server.passthrough``) alike: a hang-up
ends the request quietly (its attempt has ended with its Result: nothing to answer); a bug inside the proxy is
logged and answered with a 500 unless the response has begun. ``ClientGone`` is the hang-up before the body is
whole (``Gateway.read_body``), when nothing has reached an engine yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from starlette.types import Receive, Scope, Send

from proxy.errors import ProxyError
from proxy.server.request.responses import error_response
from proxy.timing import StreamTimer


class ClientGone(Exception):
    """The client hung up before its request body was whole."""


class Watch:
    """Waits on ``receive()`` in a task of its own; a disconnect while armed cancels the request's task.

    uvicorn answers ``receive()`` with ``http.disconnect`` once the response is complete too, so the response
    disarms it before its last message. One plain asyncio task a request (an anyio task group cost ~16 % of the
    proxy's CPU at 32 streams: docs/performance.md)."""

    __slots__ = ("_waiter", "answered", "armed", "fired", "task")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.armed = True
        self.fired = False
        #: the response was sent in full (``stop``)
        self.answered = False
        self._waiter = asyncio.get_running_loop().create_task(self._wait(receive))

    async def _wait(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.armed:
            self.armed = False
            self.fired = True
            self.task.cancel()

    def disarm(self) -> None:
        self.armed = False

    def stop(self) -> None:
        """Disarm; end the waiter unless the response was ``answered`` in full: then the server's ``receive()``
        answers ``http.disconnect`` (ASGI: once the response is sent) and the waiter ends by itself. Cancelling it
        instead left a CancelledError, its traceback and the request's frames in a reference cycle every request
        (~40 objects, freed only by the garbage collector: docs/performance.md)."""
        self.armed = False
        if not self.answered:
            self._waiter.cancel()


@asynccontextmanager
async def guarded(
    scope: Scope,
    receive: Receive,
    send: Send,
    request_id: str,
    *,
    begun: Callable[[], bool],
    log: logging.Logger,
    what: str,
    timer: StreamTimer | None = None,
) -> AsyncIterator[Watch]:
    """Serve one request inside it with the ``Watch`` it yields armed (module docstring). The body disarms the
    watch before the response's last message and sets ``answered`` once the response is sent in full.

    A hang-up (the watch fired) ends the block quietly; another cancellation goes on. A bug is logged (``what``
    names the request: "request", "pass-through request") and answered with the proxy's 500 (with ``timer``'s
    ``Server-Timing``) unless ``begun()`` says the response has begun."""
    watch = Watch(receive)
    try:
        yield watch
    except asyncio.CancelledError:
        if watch.fired:  # the client hung up: the attempt has ended with its Result; nothing to answer
            watch.task.uncancel()
            return
        raise
    except Exception:
        log.exception("%s %s failed inside the proxy", what, request_id)
        watch.disarm()
        if not begun():
            err = ProxyError("internal error in the proxy (logged)")
            await error_response(err, request_id, timer=timer)(scope, receive, send)
    finally:
        watch.stop()
