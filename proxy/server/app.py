"""The ASGI app: routes and lifespan. A generation request reads top to bottom like its life:

receive -> authenticate -> read body (bounded) -> parse -> route -> [mirror copy] -> normalize
        -> open upstream (fallback while nothing was sent) -> relay stream / body -> one Result each
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import anyio.to_thread
import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy import __version__
from proxy.errors import BadRequest, PayloadTooLarge, ProxyError, Unauthorized, UpstreamError
from proxy.normalize import Endpoint, normalize_request, param_label
from proxy.server.metrics import Metrics, configured_pairs, observe
from proxy.server.relay import Attempt, RelayResponse
from proxy.server.result import Result
from proxy.server.routing import Decision, Router
from proxy.server.upstream import Engine, make_client, make_streams, probe_all
from proxy.settings import Settings
from proxy.timing import StreamTimer

log = logging.getLogger("enginemeter")

ResultHook = Callable[[Result], None]


class Gateway:
    """Everything a request needs, built once per app: engines, router, metrics, hooks."""

    def __init__(
        self,
        settings: Settings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry, settings.metrics)
        self.router = Router(settings)
        self.engines: dict[str, Engine] = {}
        for e in settings.engines:
            client = make_client(e, transport=transport)
            streams = make_streams(e, client, transport=transport)
            self.engines[e.name] = Engine(settings=e, client=client, stream_client=streams)
        self.aliases = {m.alias: m for m in settings.models}
        #: called with every Result (metrics first); the mirror/comparison and tests hook in here
        self.result_hooks: list[ResultHook] = []
        #: mirroring stage (proxy.server.mirror); ``submit(gw, decision, body, endpoint, request_id) -> bool``
        #: returns whether a shadow copy was sent (then the primary collects its output text to compare)
        self.mirror: Any = None
        self.background: set[asyncio.Task[Any]] = set()
        #: extra sections for /health (GPU collectors, mirror state), each returns a dict merged in
        self.health_extras: list[Callable[[], dict[str, Any]]] = []
        #: extra routes contributed by extensions (admin endpoints)
        self.extra_routes: list[Route] = []
        #: async context managers held open for the app's lifetime, entered after engine probing
        #: (background collectors start on enter and stop on exit)
        self.lifespan_hooks: list[Callable[[], AbstractAsyncContextManager[Any]]] = []

    # ---------------------------------------------------------------------------------- helpers

    def model_label(self, model: str | None) -> str:
        """Bounded metric label: a configured alias or an engine's served name, else ``other``."""
        if model is None:
            return "other"
        if model in self.aliases:
            return model
        if any(e.model == model for e in self.engines.values()):
            return model
        return "other"

    def served_model(self, alias: str | None, engine: Engine) -> str | None:
        a = self.aliases.get(alias or "")
        if a is not None and engine.name in a.engines:
            return a.engines[engine.name]
        return engine.model or alias

    def record(self, result: Result) -> None:
        """Every attempt's one Result: the attempt leaves the in-flight gauge, metrics, then hooks."""
        self.metrics.in_flight.labels(result.engine, result.role).dec()
        observe(self.metrics, result)
        for hook in self.result_hooks:
            try:
                hook(result)
            except Exception:
                log.exception("result hook failed")

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """A background task we keep a reference to (a bare create_task can be garbage-collected)."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def new_attempt(
        self,
        *,
        request_id: str,
        endpoint: Endpoint,
        engine: Engine,
        role: str,
        body: dict[str, Any],
        timer: StreamTimer,
        collect_text: bool = False,
    ) -> Attempt:
        client_model = body.get("model") if isinstance(body.get("model"), str) else None
        norm = normalize_request(
            body,
            endpoint=endpoint,
            kind=engine.effective_kind,
            served_model=self.served_model(client_model, engine),
            defaults=self.settings.sampling_defaults,
        )
        for ch in norm.changes:
            self.metrics.params.labels(engine.name, param_label(ch.param), ch.action).inc()
        attempt = Attempt(
            request_id=request_id,
            endpoint=endpoint,
            engine=engine,
            role=role,
            model_label=self.model_label(client_model),
            client_model=client_model,
            norm=norm,
            timer=timer,
            on_result=self.record,
            collect_text=collect_text,
        )
        # in flight from here until its one Result (Gateway.record), whichever path ends it
        self.metrics.in_flight.labels(engine.name, role).inc()
        return attempt

    # ----------------------------------------------------------------------------- the request

    def authenticate(self, request: Request) -> None:
        if not self.settings.api_keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or token not in self.settings.api_keys:
            raise Unauthorized("missing or invalid API key")

    async def read_json(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

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

    async def generate(self, request: Request, endpoint: Endpoint) -> Response:
        timer = StreamTimer()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        body: dict[str, Any] | None = None
        try:
            self.authenticate(request)
            body = await self.read_json(request)
            self.validate(body, endpoint)
            user = body.get("user")
            decision = self.router.decide(body.get("model"), request.headers, user if isinstance(user, str) else None)
        except ClientDisconnect:
            self.rejected(endpoint, body, "client_disconnect")
            return Response(status_code=499)
        except ProxyError as exc:
            self.rejected(endpoint, body, "rejected")
            return self.error_response(exc, request_id)
        mirrored = False
        if self.mirror is not None and decision.shadows:
            mirrored = bool(self.mirror.submit(self, decision, body, endpoint, request_id))
        return await self.serve(request_id, endpoint, decision, body, timer, collect_text=mirrored)

    async def serve(
        self,
        request_id: str,
        endpoint: Endpoint,
        decision: Decision,
        body: dict[str, Any],
        timer: StreamTimer,
        collect_text: bool = False,
    ) -> Response:
        last_exc: ProxyError | None = None
        for i, name in enumerate(decision.engines):
            engine = self.engines[name]
            if i > 0:
                timer = StreamTimer(timer.t_received_ns)
            attempt = self.new_attempt(
                request_id=request_id,
                endpoint=endpoint,
                engine=engine,
                role="primary",
                body=body,
                timer=timer,
                collect_text=collect_text,
            )
            more = i + 1 < len(decision.engines)
            try:
                try:
                    await attempt.open()
                except UpstreamError as exc:
                    attempt.finish(exc.outcome, exc.message)
                    last_exc = exc
                    continue
                headers = {"x-enginemeter-engine": name, "x-enginemeter-request-id": request_id}
                if attempt.failed_status:
                    err = await attempt.error_response_body()
                    attempt.finish()
                    if more and attempt.status >= 500:
                        continue
                    return Response(err, status_code=attempt.status, headers=headers, media_type="application/json")
                if attempt.norm.stream:
                    return RelayResponse(attempt, headers)  # type: ignore[return-value]
                try:
                    data = await attempt.read_body()
                except UpstreamError as exc:
                    attempt.finish(exc.outcome, exc.message)
                    last_exc = exc
                    continue
                attempt.finish()
                return Response(data, status_code=attempt.status, headers=headers, media_type="application/json")
            except BaseException:
                attempt.finish("client_disconnect")
                raise
        assert last_exc is not None
        return self.error_response(last_exc, request_id, engine=decision.engines[-1])

    def rejected(self, endpoint: Endpoint, body: dict[str, Any] | None, outcome: str) -> None:
        """A request that never reached an engine still ends in exactly one outcome (engine="none")."""
        stream = "true" if body is not None and body.get("stream") is True else "false"
        model = body.get("model") if body is not None else None
        label = self.model_label(model if isinstance(model, str) else None)
        self.metrics.requests.labels("none", label, "primary", stream, endpoint, outcome).inc()

    @staticmethod
    def error_response(exc: ProxyError, request_id: str, engine: str | None = None) -> Response:
        headers = {"x-enginemeter-request-id": request_id}
        if engine:
            headers["x-enginemeter-engine"] = engine
        return Response(exc.to_bytes(), status_code=exc.status, headers=headers, media_type="application/json")


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    registry: CollectorRegistry | None = None,
    extensions: list[Callable[[Gateway], Any]] | None = None,
) -> Starlette:
    gw = Gateway(settings, transport=transport, registry=registry)

    async def chat(request: Request) -> Response:
        return await gw.generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await gw.generate(request, "completions")

    async def models(request: Request) -> Response:
        try:
            gw.authenticate(request)
        except ProxyError as exc:
            return gw.error_response(exc, "")
        names = list(gw.aliases) or sorted({e.model for e in gw.engines.values() if e.model})
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
        for provider in gw.health_extras:
            status.update(provider())
        return JSONResponse(status)

    async def metrics(request: Request) -> Response:
        # exposition is CPU work: run it off the event loop so a scrape never stalls a stream
        data = await anyio.to_thread.run_sync(generate_latest, gw.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        await probe_all(list(gw.engines.values()))
        gw.metrics.prime(
            gw.engines,
            [*gw.aliases, *(e.model for e in gw.engines.values() if e.model)],
            configured_pairs(gw.settings.routes),
        )
        for e in gw.engines.values():
            log.info("engine %s: %s kind=%s model=%s up=%s", e.name, e.settings.url, e.kind, e.model, e.up)
        async with AsyncExitStack() as hooks:
            for hook in gw.lifespan_hooks:
                await hooks.enter_async_context(hook())
            yield
        for t in list(gw.background):
            t.cancel()
        await asyncio.gather(*(e.aclose() for e in gw.engines.values()), return_exceptions=True)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    for ext in extensions or []:
        ext(gw)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        err = ProxyError(f"{exc.detail}: {request.method} {request.url.path}")
        err.status = exc.status_code
        err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return gw.error_response(err, "")

    app = Starlette(
        routes=[*routes, *gw.extra_routes],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.gateway = gw
    return app
