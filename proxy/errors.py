"""The error tree and the OpenAI-style error envelope.

    ProxyError                 every error the proxy itself reports to a client
    ├── BadRequest            400  malformed JSON, wrong types
    ├── Unauthorized          401  missing/wrong client bearer key
    ├── NotFound              404  unknown model (and no default route), unknown path
    ├── RequestTimeout        408  body not received within the body deadline
    ├── Conflict              409  a rollout command its state refuses (both in ``proxy.server.switch.rolloutstate``)
    ├── PayloadTooLarge       413  body over max_body_bytes
    ├── StateUnavailable      503  the rollout's state file unwritable, or replaced by another proxy's
    ├── SwapUnavailable       503  no engine of a swapping route can take the request (``Retry-After``;
    │   │                          ``proxy.server.switch.swapqueue``)
    │   ├── SwapQueueFull          the hold queue is full, or the request waited its longest
    │   └── SwapFailed             the baseline did not start again after a swap back; an admin retries
    └── UpstreamError               the engine could not be used
        ├── UpstreamConnectError   502  connection refused / reset before the response
        ├── UpstreamTimeout        504  connect/read/pool timeout
        └── UpstreamBroken         502  stream broke off or was malformed after it started

The engines' connections fail in the relay's own HTTP/1.1 client (``proxy.server.request.h1``) with its own tree, as
httpx's ``_exceptions.py`` draws its:

    TransportError             a connection to an engine failed (raised in ``h1`` and ``h1conn``)
    ├── EngineUnreachable      the connection could not be made (refused, no route); ``os_error`` says why
    ├── EngineDisconnected     the engine closed the connection before the response's head
    └── EngineProtocolError    the response broke off mid-body, or was not HTTP/1.1
    TimeoutError               (the built-in) connect, read or pool time ran out

Those and httpx's (probes and injected transports) are translated to the first tree at one seam
(``from_transport_error``; ``TRANSPORT_ERRORS`` is what it accepts). Every body the proxy makes says so:
``{"error": {"message", "type", "param", "code", "enginemeter": true}}`` — clients and dashboards can always tell
a proxy error from an engine error, which passes through untouched (``enginemeter`` absent).
"""

from __future__ import annotations

import json
import os
import socket

import httpx

from proxy import engines
from proxy.redact import redact_url as redact_url  # where the proxy's callers import it from
from proxy.types import EngineKind, Outcome


class TransportError(Exception):
    """A connection to an engine failed in the relay's HTTP/1.1 client; ``from_transport_error`` maps it."""


class EngineUnreachable(TransportError):
    """The connection could not be made (refused, no route): ``connect_error``. ``os_error`` is the cause."""

    def __init__(self, host: str, port: int, os_error: OSError) -> None:
        super().__init__(host, port, os_error)
        self.host, self.port, self.os_error = host, port, os_error

    def __str__(self) -> str:
        return f"Cannot connect to host {self.host}:{self.port} [{self.os_error.strerror or self.os_error}]"


class EngineDisconnected(TransportError):
    """The engine closed the connection before the response's head (a stale kept-alive connection, a crash)."""

    def __str__(self) -> str:
        return "Server disconnected without sending a response"


class EngineProtocolError(TransportError):
    """The response broke off mid-body, or was not HTTP/1.1; the message says which (no addresses in it)."""


class ProxyError(Exception):
    status = 500
    type = "enginemeter_error"
    outcome: Outcome = "rejected"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.type, self.status, param=self.param)

    def to_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"


class NotFound(ProxyError):
    status = 404
    type = "not_found_error"


class RequestTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"


class UpstreamError(ProxyError):
    status = 502
    type = "upstream_error"
    outcome: Outcome = "upstream_broken"


class UpstreamConnectError(UpstreamError):
    outcome = "connect_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    type = "upstream_timeout"
    outcome = "timeout"


class UpstreamBroken(UpstreamError):
    pass


def error_body(message: str, type_: str, code: int, *, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, "enginemeter": True}}


#: every exception an upstream call can raise that ``from_transport_error`` maps (TimeoutError: the H1 client's)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, TransportError, TimeoutError)


def from_transport_error(exc: BaseException, engine: str) -> UpstreamError:
    """The single seam where transport errors become ours. The message names the engine by its configured name
    and says what failed, never where the engine is: the text of a connect error holds the engine's host and
    port, which a client has no business learning (``_reason``)."""
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return UpstreamTimeout(f"engine {engine!r} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError | EngineUnreachable):
        return UpstreamConnectError(f"engine {engine!r} is unreachable: {_reason(exc)}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | EngineDisconnected | EngineProtocolError):
        return UpstreamBroken(f"engine {engine!r} closed the connection: {_reason(exc)}")
    return UpstreamBroken(f"engine {engine!r} transport error: {_reason(exc)}")


def _reason(exc: BaseException) -> str:
    """What went wrong, without addresses: an OS error's errno text (``Connection refused``) from the exception or its
    causes, the HTTP client's words about a broken exchange, else the exception's type (never ``str()`` of a
    connect or TLS error: those hold host names)."""
    if isinstance(exc, EngineDisconnected):
        return str(exc)
    if isinstance(exc, EngineProtocolError | httpx.RemoteProtocolError) and str(exc):
        return str(exc)  # h1.py's or httpcore's words about the HTTP exchange: no addresses in them
    seen: BaseException | None = exc
    for _ in range(5):  # httpx -> httpcore -> the OSError
        if seen is None:
            break
        os_error = seen.os_error if isinstance(seen, EngineUnreachable) else None
        for e in (os_error, seen):
            if isinstance(e, socket.gaierror) and e.strerror:
                return str(e.strerror)  # "Name or service not known": the resolver's words, no name in them
            if isinstance(e, OSError) and isinstance(e.errno, int) and e.errno > 0:
                return os.strerror(e.errno)  # not e.strerror: asyncio's reads "Connect call failed ('10.0.0.5', 8081)"
        seen = seen.__cause__ or seen.__context__
    return type(exc).__name__


def normalize_engine_error(body: bytes, status: int, kind: EngineKind | None = None) -> bytes:
    """Engine error bodies pass through, except SGLang's flat shape, which is nested the OpenAI way (the
    engine dialect's ``error_doc``): ``{"object":"error","message":..}`` -> ``{"error":{"message":..}}``.
    Anything that is not JSON is wrapped."""
    return engines.normalize_error(body, status, kind)
