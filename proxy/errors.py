"""The error tree and the OpenAI-style error envelope.

    ProxyError                 every error the proxy itself reports to a client
    ├── BadRequest            400  malformed JSON, wrong types
    ├── Unauthorized          401  missing/wrong client bearer key
    ├── NotFound              404  unknown model (and no default route), unknown path
    ├── RequestTimeout        408  body not received within the body deadline
    ├── PayloadTooLarge       413  body over max_body_bytes
    └── UpstreamError               the engine could not be used
        ├── UpstreamConnectError   502  connection refused / reset before the response
        ├── UpstreamTimeout        504  connect/read/pool timeout
        └── UpstreamBroken         502  stream broke off or was malformed after it started

Transport exceptions (httpx for probes and injected transports, aiohttp for the relay's streams) are translated
to this tree at one seam (``from_transport_error``; ``TRANSPORT_ERRORS`` is what it accepts). Every body the
proxy makes says so:
``{"error": {"message", "type", "param", "code", "enginemeter": true}}`` — clients and dashboards can always tell
a proxy error from an engine error, which passes through untouched (``enginemeter`` absent).
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx

from proxy import engines
from proxy.types import EngineKind, Outcome


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


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (``http://user:***@host``): engine URLs appear in
    ``/health``, the start banner and logs, none of which may show a secret."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None and "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, sep, _ = userinfo.partition(":")
    netloc = f"{user}:***@{hostport}" if sep else f"{user}@{hostport}"
    return urlunsplit(parts._replace(netloc=netloc))


def error_body(message: str, type_: str, code: int, *, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, "enginemeter": True}}


#: every exception an upstream call can raise that ``from_transport_error`` maps (TimeoutError: aiohttp's timeouts)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, aiohttp.ClientError, TimeoutError)


def from_transport_error(exc: BaseException, engine: str) -> UpstreamError:
    """The single seam where transport errors become ours."""
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return UpstreamTimeout(f"engine {engine!r} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError | aiohttp.ClientConnectorError):
        return UpstreamConnectError(f"engine {engine!r} is unreachable: {exc}")
    if isinstance(
        exc,
        httpx.RemoteProtocolError
        | httpx.ReadError
        | aiohttp.ServerDisconnectedError
        | aiohttp.ClientPayloadError
        | aiohttp.ClientOSError,
    ):
        return UpstreamBroken(f"engine {engine!r} closed the connection: {exc}")
    return UpstreamBroken(f"engine {engine!r} transport error: {type(exc).__name__}: {exc}")


def normalize_engine_error(body: bytes, status: int, kind: EngineKind | None = None) -> bytes:
    """Engine error bodies pass through, except SGLang's flat shape, which is nested the OpenAI way (the
    engine dialect's ``error_doc``): ``{"object":"error","message":..}`` -> ``{"error":{"message":..}}``.
    Anything that is not JSON is wrapped."""
    return engines.normalize_error(body, status, kind)
