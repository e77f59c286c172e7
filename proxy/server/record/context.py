"""What the proxy carries along one client request, whatever stage it is in: a ``RequestContext`` in a
``ContextVar``, set by ``RequestContextMiddleware`` around every HTTP request.

Tasks started while serving the request (the relay's disconnect watcher, the mirror's shadow copies) copy the
context when they are made, so a shadow attempt sees its request's context too, even after the client left.

- ``trace_headers``: the client's W3C ``traceparent`` / ``tracestate``, as received. Every attempt (primary,
  fallback, shadow, pass-through) sends them upstream, so the engines' own traces (vLLM, SGLang) join the
  client's; with tracing on (``proxy.server.observe.tracing``) the proxy's attempt span replaces ``traceparent``.
- ``span``: the request's server span when tracing is on, else None.
- ``prompt``: the client's messages / prompt, kept only while the request log records text.
- ``rollout``: the rollout state that routed the request (``proxy.server.switch.rolloutstate.Ticket``), for the rollout's
  own count of the candidate's attempts and the request log.
- ``swap``: on a swap route, the phase the request arrived in, how long it was held and where it went
  (``proxy.server.switch.swapqueue.Mark``), for the swap's watch and the request log.

Cost per request: one scan of the request headers; nothing per chunk.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

#: request headers every upstream request carries on (W3C Trace Context)
TRACE_HEADERS = (b"traceparent", b"tracestate")


class ServerSpans(Protocol):
    """What the middleware needs of the tracer (``proxy.server.observe.tracing.Tracing``, an optional extra)."""

    def traces(self, path: str) -> bool: ...

    async def serve(self, scope: Scope, receive: Receive, send: Send, app: ASGIApp, ctx: RequestContext) -> None: ...


class WithHeaders(Protocol):
    """An attempt, as far as the trace headers go (``proxy.server.request.relay.Attempt``)."""

    extra_headers: dict[str, str]


@dataclass(slots=True)
class RequestContext:
    trace_headers: dict[str, str] = field(default_factory=dict)
    span: Any = None
    prompt: Any = None
    rollout: Any = None
    swap: Any = None


_current: ContextVar[RequestContext | None] = ContextVar("enginemeter_request", default=None)


def current() -> RequestContext | None:
    """The context of the request being served (None outside a request: start-up, tests calling stages)."""
    return _current.get()


def forward_trace_headers(attempt: WithHeaders) -> None:
    """``Attempts.on_new`` hook: the client's trace headers go upstream with the attempt."""
    ctx = _current.get()
    if ctx is not None and ctx.trace_headers:
        attempt.extra_headers.update(ctx.trace_headers)


class RequestContextMiddleware:
    """Pure ASGI: sets the request's context, and with ``tracing`` its server span, around the app."""

    def __init__(self, app: ASGIApp, tracing: ServerSpans | None = None) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = RequestContext({k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in TRACE_HEADERS})
        token = _current.set(ctx)
        try:
            if self.tracing is not None and self.tracing.traces(scope["path"]):
                await self.tracing.serve(scope, receive, send, self.app, ctx)
            else:
                await self.app(scope, receive, send)
        finally:
            _current.reset(token)
