"""The ASGI app: routes and lifespan. A generation request reads top to bottom like its life:

receive -> authenticate -> read body (bounded in size and time) -> parse (orjson; large bodies in a thread)
        -> route -> [mirror copy] -> normalize -> open upstream (fallback while nothing was sent)
        -> relay stream / body -> one Result each

From the end of the body on, a watcher waits on ``receive()``: a client that hangs up in any phase cancels the
attempt, which closes the upstream connection (``Gateway.respond``). The generation routes are raw ASGI apps for
that reason: they own ``receive`` for the whole request. They are also served before Starlette's middleware and
router (``ProxyApp``): ``send`` reaches them as the server's own, so the relay can write chunks straight to the
client's socket (``proxy.server.output``).

The stages are the ``Gateway``'s typed fields; ``proxy.server.build_app`` (the composition root) builds them.
None of them imports this module: each gets the narrow things it needs (engines, metrics, ``Attempts``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy import __version__
from proxy.errors import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    Unauthorized,
    UpstreamError,
    redact_url,
)
from proxy.server.admin import admin_routes
from proxy.server.attempt import Attempts, Failed, Streaming, run_attempt
from proxy.server.diagnosis import LiveDiagnosis
from proxy.server.enginestate import EngineStatePoller
from proxy.server.gpu import GpuMonitor
from proxy.server.guard import raise_fd_limit
from proxy.server.metrics import Metrics, configured_pairs
from proxy.server.mirror import Mirror
from proxy.server.paths import route_path, upstream_path
from proxy.server.relay import RelayResponse, error_response
from proxy.server.result import new_request_id
from proxy.server.routing import Decision, Router
from proxy.server.upstream import Engine, make_client, probe_all
from proxy.settings import Settings
from proxy.timing import StreamTimer
from proxy.types import Endpoint, Outcome

log = logging.getLogger("enginemeter")

#: a request body must arrive within this long once its headers are in (a slow-body client is cut off: 408)
BODY_TIMEOUT_S = 30.0
#: bodies this large are parsed in a worker thread (a 3.4 MB body takes the event loop ~10 ms otherwise)
PARSE_IN_THREAD_BYTES = 256 * 1024
#: orjson serializes at most this many levels of nesting
MAX_DEPTH = 254
#: the longest client x-request-id echoed and sent on
MAX_CLIENT_ID = 200


class ClientGone(Exception):
    """The client hung up before its request body was whole."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or ``BadRequest``. orjson refuses what an engine must never see and
    Python's json would let through or choke on: NaN/Infinity, lone surrogates (``\\ud800``), nesting past
    1,024 levels (a RecursionError, i.e. a plain-text 500, in ``json``); what parses must also serialize again
    (the body goes on to the engine), which bounds nesting at orjson's 254 levels."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    # nesting deeper than orjson writes needs that many brackets: count them (C speed) before serializing
    if raw.count(b"[") + raw.count(b"{") >= MAX_DEPTH:
        try:
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise BadRequest("request body is nested too deeply") from None
    return body


def make_engines(settings: Settings) -> dict[str, Engine]:
    return {e.name: Engine(settings=e, client=make_client(e)) for e in settings.engines}


@dataclass
class Gateway:
    """Everything a request needs, each collaborator a typed field; built once per app (``build_app``)."""

    settings: Settings
    registry: CollectorRegistry
    metrics: Metrics
    router: Router
    engines: dict[str, Engine]
    attempts: Attempts
    #: the mirroring stage; None: no shadow copies, /admin/mirror answers 404
    mirror: Mirror | None = None
    gpu: GpuMonitor | None = None
    engine_state: EngineStatePoller | None = None
    #: the live diagnosis of local llama.cpp engines (``proxy.server.diagnosis``)
    diagnosis: LiveDiagnosis | None = None
    #: /health sections of collectors that run in another process (``serve --workers``: worker 0's snapshot)
    health_sections: Callable[[], dict[str, Any]] | None = None
    #: called once the app has shut down (``enginemeter serve`` stops its embedded engines here)
    on_shutdown: Sequence[Callable[[], None]] = ()
    body_timeout_s: float = BODY_TIMEOUT_S
    parse_in_thread_bytes: int = PARSE_IN_THREAD_BYTES

    # ----------------------------------------------------------------------------- the request

    def authenticate(self, request: Request) -> None:
        keys = self.settings.api_keys
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        # an empty key in the config never matches (``api_keys: [""]`` is no way to switch auth off);
        # the comparison is constant-time per key
        ok = scheme.lower() == "bearer" and bool(token)
        ok = ok and any(k and hmac.compare_digest(token.encode(), str(k).encode()) for k in keys)
        if not ok:
            raise Unauthorized("missing or invalid API key")

    async def read_body(self, request: Request, receive: Receive) -> bytes:
        """The request body, bounded in size (``max_body_bytes``, 413) and time (``body_timeout_s``, 408).
        Raises ``ClientGone`` if the client hangs up first."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):  # anyio's fail_after: ~3 % of a request's CPU (py-spy)
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone()
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                    if chunk:
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise RequestTimeout(f"request body not received within {self.body_timeout_s:g} s") from None
        return b"".join(chunks)

    async def parse(self, raw: bytes) -> dict[str, Any]:
        """The body as a JSON object (``parse_body``); in a worker thread when it is large, so that parsing a
        multi-megabyte prompt never delays other streams' chunks (their gaps are what the proxy measures)."""
        if len(raw) >= self.parse_in_thread_bytes:
            return await anyio.to_thread.run_sync(parse_body, raw)
        return parse_body(raw)

    @staticmethod
    def validate(body: dict[str, Any], endpoint: Endpoint) -> None:
        if "model" in body and not isinstance(body["model"], str):
            raise BadRequest("`model` must be a string", param="model")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise BadRequest("`stream` must be a boolean", param="stream")
        if endpoint == "chat":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("`messages` must be a non-empty array", param="messages")
        elif "prompt" not in body:
            raise BadRequest("`prompt` is required", param="prompt")
        for key in ("max_tokens", "max_completion_tokens", "n"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise BadRequest(f"`{key}` must be a non-negative integer", param=key)
        for key in ("temperature", "top_p", "min_p", "top_k"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
                raise BadRequest(f"`{key}` must be a number", param=key)

    async def generate(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """One generation request, start to end (a raw ASGI handler: it owns ``receive``)."""
        timer = StreamTimer()
        request = Request(scope)
        # the proxy's own id pairs primary and shadow; a client's x-request-id is echoed and sent on to the
        # engine, never trusted to be unique
        request_id = new_request_id()
        client_id = request.headers.get("x-request-id")
        client_id = client_id[:MAX_CLIENT_ID] if client_id else None
        echo = {"x-request-id": client_id} if client_id else {}
        body: dict[str, Any] | None = None
        try:
            self.authenticate(request)
            raw = await self.read_body(request, receive)
            body = await self.parse(raw)
            self.validate(body, endpoint)
            user = body.get("user")
            decision = self.router.decide(body.get("model"), request.headers, user if isinstance(user, str) else None)
        except ClientGone:
            self.rejected(endpoint, body, "client_disconnect")
            return
        except ProxyError as exc:
            self.rejected(endpoint, body, "rejected")
            await error_response(exc, request_id, headers=echo)(scope, receive, send)
            return
        mirrored = False
        if self.mirror is not None and decision.shadows:
            mirrored = self.mirror.submit(decision, body, endpoint, request_id, client_id)
        await self.respond(scope, receive, send, request_id, client_id, endpoint, decision, body, timer, mirrored)

    async def respond(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        request_id: str,
        client_id: str | None,
        endpoint: Endpoint,
        decision: Decision,
        body: dict[str, Any],
        timer: StreamTimer,
        mirrored: bool,
    ) -> None:
        """Serve the primary while a watcher waits on ``receive()``: the client hanging up in any phase (queued,
        prefill, streaming, a non-stream wait) cancels the attempt at once, which closes the upstream connection
        so the engine stops working for nobody (counted ``client_disconnect``)."""
        watch = Watch(receive)
        response: Response | RelayResponse | None = None
        try:
            response = await self.serve(
                request_id, endpoint, decision, body, timer, collect_text=mirrored, client_id=client_id
            )
            if isinstance(response, RelayResponse):
                response.on_end = watch.disarm
            else:
                watch.disarm()  # a whole body: one write, nothing left to cancel
            await response(scope, receive, send)
        except asyncio.CancelledError:
            if watch.fired:  # the client hung up: the attempt has ended with its Result; nothing to answer
                watch.task.uncancel()
                return
            raise
        except Exception:
            log.exception("request %s failed inside the proxy", request_id)
            watch.disarm()
            if response is None:
                err = ProxyError("internal error in the proxy (logged)")
                await error_response(err, request_id)(scope, receive, send)
        finally:
            watch.stop()

    async def serve(
        self,
        request_id: str,
        endpoint: Endpoint,
        decision: Decision,
        body: dict[str, Any],
        timer: StreamTimer,
        collect_text: bool = False,
        client_id: str | None = None,
    ) -> Response | RelayResponse:
        """The primary: the first engine whose attempt is not a ``Failed`` (nor a 5xx with engines left) answers."""
        last_exc: UpstreamError | None = None
        echo = {"x-request-id": client_id} if client_id else {}
        for i, name in enumerate(decision.engines):
            if i > 0:
                timer = StreamTimer(timer.t_received_ns)
            attempt = self.attempts.new(
                request_id=request_id,
                endpoint=endpoint,
                engine=self.engines[name],
                role="primary",
                body=body,
                timer=timer,
                collect_text=collect_text,
                client_request_id=client_id,
            )
            try:
                out = await run_attempt(attempt)
            except BaseException as exc:
                # cancelled (the client hung up) or a bug: close the upstream (the engine frees its slot) and
                # end the attempt with its one Result
                cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
                with anyio.CancelScope(shield=True):
                    if cancelled:
                        await attempt.close("client_disconnect")
                    else:
                        await attempt.close("upstream_broken", f"proxy error: {exc!r}")
                raise
            headers = {"x-enginemeter-engine": name, "x-enginemeter-request-id": request_id, **echo}
            if isinstance(out, Streaming):
                return RelayResponse(attempt, headers)
            if isinstance(out, Failed):
                last_exc = out.error
                continue
            if out.engine_error and out.status >= 500 and i + 1 < len(decision.engines):
                continue
            return Response(out.body, status_code=out.status, headers=headers, media_type="application/json")
        assert last_exc is not None
        return error_response(last_exc, request_id, engine=decision.engines[-1], headers=echo)

    def rejected(self, endpoint: Endpoint, body: dict[str, Any] | None, outcome: Outcome) -> None:
        """A request that never reached an engine still ends in exactly one outcome (engine="none")."""
        stream = "true" if body is not None and body.get("stream") is True else "false"
        model = body.get("model") if body is not None else None
        label = self.attempts.model_label(model if isinstance(model, str) else None)
        self.metrics.requests.labels("none", label, "primary", stream, endpoint, outcome).inc()


class Watch:
    """Waits on ``receive()`` in a task of its own; a disconnect while armed cancels the request's task.

    uvicorn answers ``receive()`` with ``http.disconnect`` once the response is complete too, so the response
    disarms it before its last message. One plain asyncio task a request (an anyio task group cost ~16 % of the
    proxy's CPU at 32 streams: docs/performance.md)."""

    __slots__ = ("_waiter", "armed", "fired", "task")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.armed = True
        self.fired = False
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
        self.armed = False
        self._waiter.cancel()


class ProxyApp(Starlette):
    """Starlette, with the generation routes (``fast``: exact path -> raw ASGI app, POST only) served before its
    middleware stack and router. Everything else, and those paths with another method, goes through Starlette as
    usual (the same routes are registered there too)."""

    fast: dict[str, ASGIApp]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # one normalised path for routing and forwarding; the proxy's own routes only at their canonical path
            path, why = route_path(scope["path"])
            if path is None:
                err = NotFound(f"Not Found: {scope['method']} {scope['path']} ({why})")
                await error_response(err, "")(scope, receive, send)
                return
            if path != scope["path"]:
                scope = {**scope, "path": path, "raw_path": upstream_path(path).encode()}
        if scope["type"] == "http" and scope["method"] == "POST":
            app = self.fast.get(scope["path"])
            if app is not None:
                scope["app"] = self
                await app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, *, registry: CollectorRegistry | None = None) -> Starlette:
    """The bare gateway: relay, routing, metrics; no mirror, no collectors (``proxy.server.build_app`` has all)."""
    registry = registry if registry is not None else CollectorRegistry()
    metrics = Metrics(registry, settings.metrics)
    engines = make_engines(settings)
    attempts = Attempts(settings, engines, metrics)
    return asgi_app(Gateway(settings, registry, metrics, Router(settings), engines, attempts))


def asgi_app(gw: Gateway) -> ProxyApp:
    """Routes and lifespan around ``gw``."""

    async def chat(scope: Scope, receive: Receive, send: Send) -> None:
        await gw.generate(scope, receive, send, "chat")

    async def completions(scope: Scope, receive: Receive, send: Send) -> None:
        await gw.generate(scope, receive, send, "completions")

    async def models(request: Request) -> Response:
        try:
            gw.authenticate(request)
        except ProxyError as exc:
            return error_response(exc, "")
        names = list(gw.attempts.aliases) or sorted({e.model for e in gw.engines.values() if e.model})
        now = int(time.time())
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": n, "object": "model", "created": now, "owned_by": "enginemeter"} for n in names],
            }
        )

    async def health(request: Request) -> Response:
        checks = await asyncio.gather(*(e.check() for e in gw.engines.values()))
        status: dict[str, Any] = {
            "status": "ok" if all(c["up"] for c in checks) else "degraded",
            "version": __version__,
            "engines": checks,
        }
        if gw.mirror is not None:
            status["mirror"] = gw.mirror.state()
        if gw.gpu is not None:
            status.update(gw.gpu.health())
        if gw.engine_state is not None:
            status.update(gw.engine_state.health())
        if gw.diagnosis is not None:
            status.update(gw.diagnosis.health())
        if gw.health_sections is not None:
            status.update(gw.health_sections())
        return JSONResponse(status)

    async def metrics(request: Request) -> Response:
        # exposition is CPU work: run it off the event loop so a scrape never stalls a stream
        data = await anyio.to_thread.run_sync(generate_latest, gw.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            soft, _ = raise_fd_limit()
            log.info("open-file limit: %d", soft)
            await probe_all(list(gw.engines.values()))
            gw.metrics.prime(
                gw.engines,
                [*gw.attempts.aliases, *(e.model for e in gw.engines.values() if e.model)],
                configured_pairs(gw.settings.routes),
            )
            for e in gw.engines.values():
                log.info(
                    "engine %s: %s kind=%s model=%s up=%s", e.name, redact_url(e.settings.url), e.kind, e.model, e.up
                )
            async with AsyncExitStack() as stages:
                # entered in this order, left in the reverse: the mirror's copies end before the collectors stop
                if gw.mirror is not None:
                    await stages.enter_async_context(gw.mirror.lifespan())
                if gw.gpu is not None:
                    await stages.enter_async_context(gw.gpu.running())
                if gw.engine_state is not None:
                    await stages.enter_async_context(gw.engine_state.running())
                if gw.diagnosis is not None:
                    await stages.enter_async_context(gw.diagnosis.running())
                yield
            await asyncio.gather(*(e.aclose() for e in gw.engines.values()), return_exceptions=True)
        finally:
            for stop in gw.on_shutdown:
                stop()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err = ProxyError(f"{exc.detail}: {request.method} {request.url.path}")
        err.status = exc.status_code
        err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(err, "")

    app = ProxyApp(
        routes=[
            # raw ASGI endpoints (not request/response functions): they own ``receive`` for the request's life
            Route("/v1/chat/completions", _Asgi(chat), methods=["POST"]),
            Route("/v1/completions", _Asgi(completions), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *admin_routes(gw.settings.admin_key, gw.mirror),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.gateway = gw
    # a path outside the routes is the proxy's 404, never a redirect to another spelling (/tokenize/ -> /tokenize)
    app.router.redirect_slashes = False
    app.fast = {"/v1/chat/completions": chat, "/v1/completions": completions}
    return app


class _Asgi:
    """Wraps an ASGI function so Starlette's ``Route`` treats it as an app, not a request/response handler."""

    def __init__(self, fn: Callable[[Scope, Receive, Send], Any]) -> None:
        self.fn = fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.fn(scope, receive, send)
