"""The ASGI app: routes and lifespan. A generation request reads top to bottom like its life:

receive -> authenticate -> read body (bounded) -> parse -> route -> [mirror copy] -> normalize
        -> open upstream (fallback while nothing was sent) -> relay stream / body -> one Result each

The stages are the ``Gateway``'s typed fields; ``proxy.server.build_app`` (the composition root) builds them.
None of them imports this module: each gets the narrow things it needs (engines, metrics, ``Attempts``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy import __version__
from proxy.errors import BadRequest, PayloadTooLarge, ProxyError, Unauthorized, UpstreamError
from proxy.server.admin import admin_routes
from proxy.server.attempt import Attempts, Failed, Streaming, run_attempt
from proxy.server.enginestate import EngineStatePoller
from proxy.server.gpu import GpuMonitor
from proxy.server.metrics import Metrics, configured_pairs
from proxy.server.mirror import Mirror
from proxy.server.relay import RelayResponse, error_response
from proxy.server.result import new_request_id
from proxy.server.routing import Decision, Router
from proxy.server.upstream import Engine, make_client, probe_all
from proxy.settings import Settings
from proxy.timing import StreamTimer
from proxy.types import Endpoint, Outcome

log = logging.getLogger("enginemeter")


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
    #: /health sections of collectors that run in another process (``serve --workers``: worker 0's snapshot)
    health_sections: Callable[[], dict[str, Any]] | None = None
    #: called once the app has shut down (``enginemeter serve`` stops its embedded engines here)
    on_shutdown: Sequence[Callable[[], None]] = ()

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
        request_id = request.headers.get("x-request-id") or new_request_id()
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
            return error_response(exc, request_id)
        mirrored = False
        if self.mirror is not None and decision.shadows:
            mirrored = self.mirror.submit(decision, body, endpoint, request_id)
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
        """The primary: the first engine whose attempt is not a ``Failed`` (nor a 5xx with engines left) answers."""
        last_exc: UpstreamError | None = None
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
            )
            try:
                out = await run_attempt(attempt)
            except BaseException:
                attempt.finish("client_disconnect")
                raise
            headers = {"x-enginemeter-engine": name, "x-enginemeter-request-id": request_id}
            if isinstance(out, Streaming):
                return RelayResponse(attempt, headers)  # type: ignore[return-value]
            if isinstance(out, Failed):
                last_exc = out.error
                continue
            if out.engine_error and out.status >= 500 and i + 1 < len(decision.engines):
                continue
            return Response(out.body, status_code=out.status, headers=headers, media_type="application/json")
        assert last_exc is not None
        return error_response(last_exc, request_id, engine=decision.engines[-1])

    def rejected(self, endpoint: Endpoint, body: dict[str, Any] | None, outcome: Outcome) -> None:
        """A request that never reached an engine still ends in exactly one outcome (engine="none")."""
        stream = "true" if body is not None and body.get("stream") is True else "false"
        model = body.get("model") if body is not None else None
        label = self.attempts.model_label(model if isinstance(model, str) else None)
        self.metrics.requests.labels("none", label, "primary", stream, endpoint, outcome).inc()


def create_app(settings: Settings, *, registry: CollectorRegistry | None = None) -> Starlette:
    """The bare gateway: relay, routing, metrics; no mirror, no collectors (``proxy.server.build_app`` has all)."""
    registry = registry if registry is not None else CollectorRegistry()
    metrics = Metrics(registry, settings.metrics)
    engines = make_engines(settings)
    attempts = Attempts(settings, engines, metrics)
    return asgi_app(Gateway(settings, registry, metrics, Router(settings), engines, attempts))


def asgi_app(gw: Gateway) -> Starlette:
    """Routes and lifespan around ``gw``."""

    async def chat(request: Request) -> Response:
        return await gw.generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await gw.generate(request, "completions")

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
            await probe_all(list(gw.engines.values()))
            gw.metrics.prime(
                gw.engines,
                [*gw.attempts.aliases, *(e.model for e in gw.engines.values() if e.model)],
                configured_pairs(gw.settings.routes),
            )
            for e in gw.engines.values():
                log.info("engine %s: %s kind=%s model=%s up=%s", e.name, e.settings.url, e.kind, e.model, e.up)
            async with AsyncExitStack() as stages:
                # entered in this order, left in the reverse: the mirror's copies end before the collectors stop
                if gw.mirror is not None:
                    await stages.enter_async_context(gw.mirror.lifespan())
                if gw.gpu is not None:
                    await stages.enter_async_context(gw.gpu.running())
                if gw.engine_state is not None:
                    await stages.enter_async_context(gw.engine_state.running())
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

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *admin_routes(gw.settings.admin_key, gw.mirror),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.gateway = gw
    return app
