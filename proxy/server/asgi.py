"""The gateway's ASGI surface: its routes, the generation routes served before Starlette (``ProxyApp``), and the
lifespan that starts and stops every stage. The request's own life is ``proxy.server.app.Gateway``'s.

``ProxyApp`` is the outermost app: each HTTP request first leaves the event loop's queue there
(``LoopWatch.started``: ``enginemeter_requests_queued``, the handler's start stamped for ``Server-Timing``), then
the generation routes (exact path, POST) go straight to their raw ASGI handlers, so that ``send`` reaches them as
the server's own and the relay can write chunks to the client's socket (``proxy.server.request.output``); everything else
goes through Starlette (its middleware, ``ServerTimingMiddleware``, the router).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy import __version__
from proxy.errors import NotFound, ProxyError, redact_url
from proxy.server.access import check_metrics, health_detail
from proxy.server.admin import admin_routes
from proxy.server.app import Gateway
from proxy.server.record.loopwatch import LoopWatch
from proxy.server.record.metrics import configured_pairs
from proxy.server.request.paths import route_path, upstream_path
from proxy.server.request.responses import ServerTimingMiddleware, error_response, scope_timer
from proxy.server.request.upstream import probe_all
from proxy.server.workers.guard import fd_budget, raise_fd_limit

log = logging.getLogger("enginemeter")


class ProxyApp(Starlette):
    """Starlette, with the generation routes (``fast``: exact path -> raw ASGI app, POST only) served before its
    middleware stack and router. Everything else, and those paths with another method, goes through Starlette as
    usual (the same routes are registered there too)."""

    fast: dict[str, ASGIApp]
    loop_watch: LoopWatch | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.loop_watch is not None:
                self.loop_watch.started(scope)
            # one normalised path for routing and forwarding; the proxy's own routes only at their canonical path
            path, why = route_path(scope["path"])
            if path is None:
                err = NotFound(f"Not Found: {scope['method']} {scope['path']} ({why})")
                await error_response(err, "", timer=scope_timer(scope))(scope, receive, send)
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


def asgi_app(gw: Gateway) -> ProxyApp:
    """Routes and lifespan around ``gw``."""
    own = Endpoints(gw)
    app = ProxyApp(
        routes=[
            # raw ASGI endpoints (not request/response functions): they own ``receive`` for the request's life
            Route("/v1/chat/completions", _Asgi(own.chat), methods=["POST"]),
            Route("/v1/completions", _Asgi(own.completions), methods=["POST"]),
            Route("/v1/models", own.models, methods=["GET"]),
            Route("/health", own.health, methods=["GET"]),
            Route("/metrics", own.metrics, methods=["GET"]),
            *admin_routes(gw.settings.admin_key, gw.mirror, gw.rollouts, gw.swaps),
        ],
        lifespan=lambda app: lifespan(gw),
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(ServerTimingMiddleware)],
    )
    app.state.gateway = gw
    app.loop_watch = gw.loop_watch
    # a path outside the routes is the proxy's 404, never a redirect to another spelling (/tokenize/ -> /tokenize)
    app.router.redirect_slashes = False
    app.fast = {"/v1/chat/completions": own.chat, "/v1/completions": own.completions}
    return app


class Endpoints:
    """The proxy's own routes on ``gw``: the two generation routes (raw ASGI), the model list, /health, /metrics."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gw.generate(scope, receive, send, "chat")

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gw.generate(scope, receive, send, "completions")

    async def models(self, request: Request) -> Response:
        gw = self.gw
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

    async def health(self, request: Request) -> Response:
        gw = self.gw
        checks = await asyncio.gather(*(e.check() for e in gw.engines.values()))
        standby = gw.swaps.standby() if gw.swaps is not None else set()
        for c in checks:
            if c["name"] in standby:
                c["standby"] = True
        status: dict[str, Any] = {
            # an engine a swap keeps stopped (the one not serving, or both mid-swap) is standby, not down
            "status": "ok" if all(c["up"] or c["name"] in standby for c in checks) else "degraded",
            "version": __version__,
        }
        if not health_detail(gw.settings, request):
            return JSONResponse(status)  # liveness only: the detail lays out the host (proxy.server.access)
        status["engines"] = checks
        if gw.mirror is not None:
            status["mirror"] = gw.mirror.state()
        if gw.rollouts is not None:
            status["rollout"] = gw.rollouts.state()
        if gw.swaps is not None:
            status["swap"] = gw.swaps.state()
        if gw.traffic is not None:
            status.update(gw.traffic.health())
        if gw.gpu is not None:
            status.update(gw.gpu.health())
        if gw.engine_state is not None:
            status.update(gw.engine_state.health())
        if gw.diagnosis is not None:
            status.update(gw.diagnosis.health())
        if gw.health_sections is not None:
            status.update(gw.health_sections())
        return JSONResponse(status)

    async def metrics(self, request: Request) -> Response:
        try:
            check_metrics(self.gw.settings, request)
        except ProxyError as exc:
            return error_response(exc, "")
        # exposition is CPU work: run it off the event loop so a scrape never stalls a stream
        data = await anyio.to_thread.run_sync(generate_latest, self.gw.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


@asynccontextmanager
async def lifespan(gw: Gateway) -> AsyncIterator[None]:
    """The app's life: the engines probed and the metrics primed, then every stage running until shutdown;
    ``gw.on_shutdown`` runs at the end whatever happened."""
    try:
        await start(gw)
        async with AsyncExitStack() as stages:
            await run_stages(gw, stages)
            yield
        await asyncio.gather(*(e.aclose() for e in gw.engines.values()), return_exceptions=True)
    finally:
        for stop in gw.on_shutdown:
            stop()


async def start(gw: Gateway) -> None:
    """Before the stages: the open-file limit raised, every engine probed, the zero series created."""
    soft, _ = raise_fd_limit()
    budget, headroom = fd_budget(soft)
    log.info(
        "open-file limit: %d, headroom %d: idle client connections are closed, oldest first, above %d open files",
        soft,
        headroom,
        budget,
    )
    await probe_all(list(gw.engines.values()))
    gw.metrics.prime(
        gw.engines,
        [*gw.attempts.aliases, *(e.model for e in gw.engines.values() if e.model)],
        configured_pairs(gw.settings.routes),
    )
    for e in gw.engines.values():
        log.info("engine %s: %s kind=%s model=%s up=%s", e.name, redact_url(e.settings.url), e.kind, e.model, e.up)


async def run_stages(gw: Gateway, stages: AsyncExitStack) -> None:
    """Every stage ``gw`` has, entered on ``stages`` in this order and left in the reverse: the mirror's copies
    end before the collectors stop."""
    if gw.loop_watch is not None:
        await stages.enter_async_context(gw.loop_watch.running())
    if gw.mirror is not None:
        await stages.enter_async_context(gw.mirror.lifespan())
    if gw.rollouts is not None:  # before the first request: it routes by the rollout's state
        await stages.enter_async_context(gw.rollouts.running())
    if gw.swaps is not None:  # before the first request: it routes by the swap's phase
        await stages.enter_async_context(gw.swaps.running())
    if gw.gpu is not None:
        await stages.enter_async_context(gw.gpu.running())
    if gw.engine_state is not None:
        await stages.enter_async_context(gw.engine_state.running())
    if gw.diagnosis is not None:
        await stages.enter_async_context(gw.diagnosis.running())


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = ProxyError(f"{exc.detail}: {request.method} {request.url.path}")
    err.status = exc.status_code
    err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(err, "")


class _Asgi:
    """Wraps an ASGI function so Starlette's ``Route`` treats it as an app, not a request/response handler."""

    def __init__(self, fn: Callable[[Scope, Receive, Send], Any]) -> None:
        self.fn = fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.fn(scope, receive, send)
