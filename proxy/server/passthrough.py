"""Pass-through: every ``/v1/*`` route the proxy does not serve itself, and the engines' ``/tokenize`` and
``/detokenize``, go to one engine as they are.

receive -> authenticate -> read body (bounded in size and time) -> parse a JSON body -> route by ``model``
        -> map alias -> served name -> send upstream -> relay the response as it comes -> one Result

- **The generation path's intake**, not a copy of it: ``Gateway.authenticate``, ``Gateway.read_body`` (413 over
  ``max_body_bytes``, 408 when the body is not whole within ``body_timeout_s``), ``Gateway.parse`` (orjson: NaN,
  lone surrogates, nesting past 254 levels and invalid UTF-8 are the proxy's 400) and its hang-up guard
  (``proxy.server.request.hangup``): from the end of the body on, a client that leaves cancels the request at
  once in any phase (waiting for the engine's headers, its body, a stream), which closes the upstream
  connection; counted ``client_disconnect``. A body is parsed when it is JSON by its content type, or by its first byte (``{`` or
  ``[``) unless the content type says multipart, audio, image or octet-stream (``curl -d`` sends JSON as a
  form, and llama.cpp reads it as JSON whatever the type); other bodies (multipart uploads) pass as bytes.
- **Which path**: the path as ``proxy.server.request.paths`` normalised it for routing (dot segments resolved, no doubly
  encoded dots or slashes), percent-encoded again; never the client's raw string, and never outside the routes
  below (the router's 404 otherwise).
- **Which engine**: the primary of the route the body's ``model`` picks (``Router.route_for``: alias, ``*``,
  ``default_route``); a body without ``model`` (``/tokenize``, multipart uploads, GET) goes to the primary of
  ``default_route``, else of the ``*`` route, else of the first route. No split, pin, fallback or shadow: a
  pass-through request is never mirrored.
- **What changes**: a JSON body's ``model`` alias becomes the engine's served name (as for generation; the body
  is then serialized again, else it passes as the bytes that came); a small (<= 1 MiB) non-stream JSON answer
  gets the alias back (``"model":"<served>"`` replaced once, as bytes). Nothing else: the method, the query
  string and the status pass as they are. Request headers sent upstream: ``content-type``, ``accept``,
  ``x-request-id``, ``traceparent``/``tracestate`` (and the engine's own credentials: ``api_key``, or Basic auth
  from its URL); response headers come back without hop-by-hop ones.
- **Unbuffered**: an SSE or chunked answer (``/v1/responses`` with ``stream``, ``/v1/audio/speech``) is
  forwarded read by read.
- **Counted**: one ``Result`` per request with an ``endpoint`` label from ``proxy.types.PassthroughEndpoint``,
  ``role="primary"``, the outcome, the status and e2e timing (no tokens, no TTFT): in
  ``enginemeter_requests_total``, ``enginemeter_passthrough_duration_seconds``, the request log and traces.
  Refused before an engine is chosen: ``engine="none"``, ``rejected`` (or ``client_disconnect``).
- The proxy's own paths (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``) with another method
  get the proxy's 405, never the engine.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import orjson
from starlette.requests import Request
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from proxy.errors import TRANSPORT_ERRORS, BadRequest, NotFound, ProxyError, from_transport_error
from proxy.server.app import Gateway
from proxy.server.record.context import current
from proxy.server.record.result import Result
from proxy.server.request.hangup import ClientGone, guarded
from proxy.server.request.paths import OWN_PATHS, upstream_path
from proxy.server.request.responses import error_response, scope_timer, server_timing
from proxy.server.request.rewrite import replace_model
from proxy.server.request.upstream import Engine
from proxy.timing import StreamTimer, StreamTiming
from proxy.types import Outcome, PassthroughEndpoint

if TYPE_CHECKING:
    from proxy.server.observe.tracing import Tracing

log = logging.getLogger("enginemeter.passthrough")

#: request headers sent upstream besides x-request-id and the trace headers
FORWARD_REQUEST = (b"content-type", b"accept")
#: never copied from the engine's response: hop-by-hop, and what the proxy's server sets itself
DROP_RESPONSE = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"server",
        b"date",
        b"content-length",
    }
)
#: a non-stream JSON answer up to this size gets the client's model name back; larger ones pass untouched
MAX_REWRITE_BYTES = 1 << 20
_ENDPOINTS: dict[str, PassthroughEndpoint] = {
    "/embeddings": "embeddings",
    "/responses": "responses",
    "/rerank": "rerank",
    "/reranking": "rerank",
    "/score": "rerank",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}


def endpoint_of(path: str) -> PassthroughEndpoint:
    """The bounded ``endpoint`` label of a pass-through path."""
    p = path.removeprefix("/v1")
    if p.startswith("/audio/"):
        return "audio"
    if p.startswith("/responses/"):
        return "responses"
    return _ENDPOINTS.get(p, "other")


#: content types whose bodies are never JSON, whatever their first byte
_NOT_JSON = (b"multipart/", b"audio/", b"image/", b"application/octet-stream")


def is_json(content_type: bytes, content: bytes) -> bool:
    """Whether a pass-through body is parsed (and refused when it is hostile JSON): module docstring."""
    if not content.strip():
        return False
    media = content_type.partition(b";")[0].strip().lower()
    if media == b"application/json" or media.endswith(b"+json"):
        return True
    if media.startswith(_NOT_JSON):
        return False
    return content.lstrip()[:1] in (b"{", b"[")


class Passthrough:
    """The ASGI app behind every pass-through route; the intake (keys, body, parsing, hang-ups) is ``gateway``'s."""

    def __init__(self, gateway: Gateway, tracing: Tracing | None = None) -> None:
        self.gateway = gateway
        self.settings = gateway.settings
        self.router = gateway.router
        self.engines = gateway.engines
        self.attempts = gateway.attempts
        self.tracing = tracing

    def engine_for(self, model: str | None) -> Engine:
        try:
            _, route = self.router.route_for(model)
        except NotFound:
            if model is not None:
                raise
            s = self.settings
            route = s.routes[s.default_route if s.default_route is not None else 0]
        return self.engines[route.primary]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timer = scope_timer(scope)
        request = Request(scope)
        headers = dict(scope["headers"])  # lower-case names; a repeated header keeps its last value
        # the proxy owns request ids (as for generation requests); the client's x-request-id is forwarded and logged
        request_id = uuid.uuid4().hex
        client_id = headers.get(b"x-request-id", b"").decode("latin-1") or None
        path: str = scope["path"]  # normalised by ProxyApp (proxy.server.request.paths)
        method: str = scope["method"]
        if path in OWN_PATHS:
            err = ProxyError(f"Method Not Allowed: {method} {path}")
            err.status, err.type = 405, "invalid_request_error"
            await error_response(err, request_id)(scope, receive, send)
            return
        endpoint = endpoint_of(path)
        gw = self.gateway
        client_model: str | None = None
        try:
            gw.authenticate(request)
            content = await gw.read_body(request, receive)
            client_model, doc = await self._model(headers, content)
            engine = self.engine_for(client_model)
        except ClientGone:
            self.rejected(endpoint, client_model, "client_disconnect")
            return  # the client left while sending its body: nothing reached an engine
        except ProxyError as exc:
            self.rejected(endpoint, client_model, "rejected")
            await error_response(exc, request_id)(scope, receive, send)
            return
        served = self.attempts.served_model(client_model, engine) if client_model is not None else None
        if doc is not None and served is not None and served != client_model:
            doc["model"] = served
            content = orjson.dumps(doc)
        call = _Call(self, engine, endpoint, request_id, client_model, served, timer, client_id)
        # as Gateway.respond: from here a hang-up in any phase cancels this task, which closes the upstream
        guard = guarded(
            scope, receive, send, request_id, begun=lambda: call.started, log=log, what="pass-through request"
        )
        async with guard as watch:
            await call.run(scope, receive, send, method, path, headers, content, watch.disarm)

    def rejected(self, endpoint: PassthroughEndpoint, model: str | None, outcome: Outcome) -> None:
        """A request that never reached an engine still counts once (engine="none"), as a generation one does."""
        label = self.attempts.model_label(model)
        self.attempts.metrics.requests.labels("none", label, "primary", "false", endpoint, outcome).inc()

    async def _model(self, headers: dict[bytes, bytes], content: bytes) -> tuple[str | None, dict[str, Any] | None]:
        """(the body's ``model``, the parsed body) for a JSON body (``Gateway.parse``: hostile JSON is a 400),
        (None, None) for any other; refuses a non-string model."""
        if not is_json(headers.get(b"content-type", b""), content):
            return None, None
        doc = await self.gateway.parse(content)
        if "model" not in doc:
            return None, doc
        model = doc["model"]
        if not isinstance(model, str):
            raise BadRequest("`model` must be a string", param="model")
        return model, doc


class _Call:
    """One pass-through request on one engine, ended by exactly one Result."""

    def __init__(
        self,
        owner: Passthrough,
        engine: Engine,
        endpoint: PassthroughEndpoint,
        request_id: str,
        client_model: str | None,
        served: str | None,
        timer: StreamTimer,
        client_request_id: str | None = None,
    ) -> None:
        self.owner = owner
        self.client_request_id = client_request_id
        self.engine = engine
        self.endpoint = endpoint
        self.request_id = request_id
        self.client_model = client_model
        self.served = served
        self.timer = timer
        self.status = 0
        self.stream = False
        #: the response has begun (its start message is sent): an internal error can no longer be a 500
        self.started = False
        self.outcome: Outcome | None = None
        self.error: str | None = None
        self.span: Any = None

    def upstream_headers(self, headers: dict[bytes, bytes]) -> dict[str, str]:
        out = {k.decode(): headers[k].decode("latin-1") for k in FORWARD_REQUEST if k in headers}
        out["accept-encoding"] = "identity"
        out["x-request-id"] = self.client_request_id or self.request_id
        ctx = current()
        if ctx is not None:
            out.update(ctx.trace_headers)
        tracing = self.owner.tracing
        if tracing is not None:
            self.span, trace = tracing.start_passthrough(self.engine, self.endpoint, self.served)
            out.update(trace)
        return out

    async def run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        method: str,
        path: str,
        headers: dict[bytes, bytes],
        content: bytes,
        on_end: Callable[[], None],
    ) -> None:
        """Send upstream and relay the answer; ``on_end`` is called right before the response's last message
        (the hang-up watcher must not take the server's end-of-response disconnect for a hang-up)."""
        metrics = self.owner.attempts.metrics
        metrics.in_flight.labels(self.engine.name, "primary").inc()  # until the one Result (Attempts.record)
        client = self.engine.client
        query = scope.get("query_string", b"").decode("latin-1")
        url = upstream_path(path) + ("?" + query if query else "")
        response: httpx.Response | None = None
        try:
            request = client.build_request(method, url, content=content, headers=self.upstream_headers(headers))
            self.timer.sent()
            try:
                response = await client.send(request, stream=True)
            except TRANSPORT_ERRORS as exc:
                err = from_transport_error(exc, self.engine.name)
                self.outcome, self.error, self.status = err.outcome, err.message, err.status
                on_end()
                self.started = True
                await error_response(err, self.request_id, engine=self.engine.name)(scope, receive, send)
                return
            self.timer.headers()
            self.status = response.status_code
            await self._relay(response, send, on_end)
        except Exception as exc:
            if self.outcome is None:
                self.outcome, self.error = "upstream_broken", f"{type(exc).__name__}: {exc}"
            raise
        except BaseException:
            if self.outcome is None:
                self.outcome = "client_disconnect"  # cancelled: the client hung up (or the server shut down)
            raise
        finally:
            if response is not None:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            self._finish()

    async def _relay(self, response: httpx.Response, send: Send, on_end: Callable[[], None]) -> None:
        ctype = response.headers.get("content-type", "")
        self.stream = ctype.startswith("text/event-stream")
        out_headers = [(k, v) for k, v in response.headers.raw if k.lower() not in DROP_RESPONSE]
        out_headers += [
            (b"x-enginemeter-engine", self.engine.name.encode()),
            (b"x-enginemeter-request-id", self.request_id.encode()),
            (b"server-timing", server_timing(self.timer).encode()),  # engine: to its response's headers
        ]
        length = response.headers.get("content-length")
        rewrite = (
            self.client_model is not None
            and self.served is not None
            and self.served != self.client_model
            and ctype.startswith("application/json")
            and length is not None
            and length.isdigit()
            and int(length) <= MAX_REWRITE_BYTES
        )
        if rewrite:
            try:
                body = await response.aread()
            except TRANSPORT_ERRORS as exc:
                self._broken(exc)
                return  # nothing was sent: the client's connection closes without an answer
            body = replace_model(body, self.served or "", self.client_model or "")
            out_headers.append((b"content-length", str(len(body)).encode()))
            on_end()
            self.started = True
            await send({"type": "http.response.start", "status": self.status, "headers": out_headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            self._ended()
            return
        if length is not None:
            out_headers.append((b"content-length", length.encode()))
        self.started = True
        await send({"type": "http.response.start", "status": self.status, "headers": out_headers})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except TRANSPORT_ERRORS as exc:
            self._broken(exc)
            return  # the response stays incomplete: the server closes the connection, the client sees a cut
        on_end()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._ended()

    def _broken(self, exc: BaseException) -> None:
        err = from_transport_error(exc, self.engine.name)
        self.outcome = err.outcome  # a read timeout is ``timeout``, a cut ``upstream_broken``
        self.error = f"engine {self.engine.name!r} broke off its answer: {err.message}"

    def _ended(self) -> None:
        if self.outcome is None:
            self.outcome = "ok" if self.status < 400 else "engine_error"

    def _finish(self) -> None:
        self.timer.done()
        owner = self.owner
        result = Result(
            request_id=self.request_id,
            client_request_id=self.client_request_id,
            engine=self.engine.name,
            engine_kind=self.engine.effective_kind,
            role="primary",
            model=owner.attempts.model_label(self.client_model),
            endpoint=self.endpoint,
            stream=self.stream,
            outcome=self.outcome or "upstream_broken",
            status=self.status,
            timing=StreamTiming.derive(self.timer, None, None),
            usage=None,
            engine_timings=None,
            finish_reason=None,
            n_token_events=0,
            greedy=False,
            error=self.error,
        )
        if self.span is not None and owner.tracing is not None:
            owner.tracing.end_attempt(self.span, result, self.timer)
        owner.attempts.record(result)


def passthrough_routes(app: Passthrough) -> Iterable[BaseRoute]:
    """Routes to add after the proxy's own: ``/v1/*`` and the engines' tokenizer paths, any method."""
    return [
        Route("/tokenize", app),
        Route("/detokenize", app),
        Route("/v1/{path:path}", app),
    ]
