"""OpenTelemetry traces (the ``otel`` extra: ``pip install 'enginemeter[otel]'``); off unless ``tracing.enabled``.

Per client request on an API path (``/v1/*``, ``/tokenize``, ``/detokenize``):

- one **server span** ``<METHOD> <path>`` (kind SERVER), made by ``RequestContextMiddleware``; it continues the
  client's ``traceparent`` (its trace id, its parent, its ``tracestate``), else starts a trace;
- one **client span** per attempt (kind CLIENT), child of the server span: the primary, each fallback, each
  shadow copy (which may end after the server span), and a pass-through call. Its name is
  ``<gen_ai.operation.name> <model sent upstream>``; its context is what goes upstream as ``traceparent``, so an
  engine's own spans (vLLM ``--otlp-traces-endpoint``, SGLang) hang below the attempt that caused them.

Attempt span attributes (OpenTelemetry GenAI conventions, docs/requests.md#traces): ``gen_ai.operation.name``
(``chat``, ``text_completion``, ``embeddings``, or the pass-through endpoint), ``gen_ai.provider.name`` and the
older ``gen_ai.system`` (``llama.cpp``, ``sglang``, ``vllm``, ``openai``), ``gen_ai.request.model`` (the name
sent upstream), ``gen_ai.response.model``, ``gen_ai.request.max_tokens`` / ``temperature`` / ``top_p``,
``gen_ai.usage.input_tokens`` / ``output_tokens``, ``gen_ai.response.finish_reasons``, ``server.address`` /
``server.port`` (the engine), ``http.response.status_code``, ``error.type`` (the outcome, when not ``ok``), and
the proxy's own ``enginemeter.*`` (engine, role, outcome, request_id, model alias, ttft_s, upstream_ttft_s,
tpot_s, decode_tps, e2e_s). Events: ``gen_ai.first_token`` and ``gen_ai.last_token`` at the proxy's token
timestamps (``proxy.timing``), so a trace viewer shows prefill and decode on the attempt's bar.

Sampling: ``ParentBased(TraceIdRatioBased(tracing.sample_ratio))``: a client's sampled/unsampled decision wins,
a new trace is kept with that probability. Export: OTLP over HTTP/protobuf to ``tracing.endpoint`` from a
``BatchSpanProcessor`` thread (tests pass an in-memory exporter). Spans are made at request and attempt
boundaries only: no per-chunk work; with tracing off this module is not even imported.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy import __version__
from proxy.config.settings import TracingSettings
from proxy.server.record.context import RequestContext, current
from proxy.server.record.result import Result
from proxy.server.request.relay import Attempt
from proxy.server.request.upstream import Engine
from proxy.timing import StreamTimer
from proxy.types import EngineKind

PROVIDERS: dict[EngineKind, str] = {"llamacpp": "llama.cpp", "sglang": "sglang", "vllm": "vllm", "openai": "openai"}
OPERATIONS = {"chat": "chat", "completions": "text_completion"}
#: request body key -> gen_ai.request.<attribute>
_REQUEST_PARAMS = (
    ("max_tokens", "max_tokens"),
    ("max_completion_tokens", "max_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
)


def traced_path(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class Tracing:
    """The tracer, its provider and the hooks that make the spans."""

    def __init__(self, settings: TracingSettings, *, exporter: SpanExporter | None = None) -> None:
        self.settings = settings
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name, "service.version": __version__}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.exporter: SpanExporter = OTLPSpanExporter(endpoint=settings.endpoint)
            self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        else:
            self.exporter = exporter
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("enginemeter", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        """Export what is left and stop (blocking; at app shutdown)."""
        self.provider.shutdown()

    # ---------------------------------------------------------------------------------- server span

    @staticmethod
    def traces(path: str) -> bool:
        return traced_path(path)

    async def serve(self, scope: Scope, receive: Receive, send: Send, app: ASGIApp, ctx: RequestContext) -> None:
        """Run ``app`` for one request inside its server span."""
        method, path = scope["method"], scope["path"]
        parent = self.propagator.extract(ctx.trace_headers)
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )
        ctx.span = span
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_status if span.is_recording() else send)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if status:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            span.end()

    def _parent(self) -> Context:
        ctx = current()
        if ctx is None:
            return Context()
        if ctx.span is not None:
            return trace.set_span_in_context(ctx.span)
        return self.propagator.extract(ctx.trace_headers)

    def _headers(self, span: Span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    # ---------------------------------------------------------------------------------- attempt spans

    def _start(self, engine: Engine, operation: str, model: str | None, attrs: dict[str, Any]) -> Span:
        url = urlsplit(engine.settings.url)
        provider = PROVIDERS[engine.effective_kind]
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "gen_ai.system": provider,
            "server.address": url.hostname or "",
            "enginemeter.engine": engine.name,
            **attrs,
        }
        if url.port is not None:
            attributes["server.port"] = url.port
        if model is not None:
            attributes["gen_ai.request.model"] = model
        return self.tracer.start_span(
            f"{operation} {model}" if model else operation,
            context=self._parent(),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )

    def on_attempt(self, attempt: Attempt) -> None:
        """``Attempts.on_new`` hook: a span for the attempt, its ``traceparent`` upstream, ended by its Result."""
        body = attempt.norm.body
        model = body.get("model") if isinstance(body.get("model"), str) else None
        attrs: dict[str, Any] = {"enginemeter.role": attempt.role, "enginemeter.request_id": attempt.request_id}
        for key, attr in _REQUEST_PARAMS:
            v = body.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool):
                attrs[f"gen_ai.request.{attr}"] = v
        span = self._start(attempt.engine, OPERATIONS[attempt.endpoint], model, attrs)
        attempt.extra_headers.update(self._headers(span))
        record = attempt.on_result
        timer = attempt.timer

        def on_result(result: Result) -> None:
            try:
                self.end_attempt(span, result, timer, response_model=model)
            finally:
                record(result)

        attempt.on_result = on_result

    def start_passthrough(self, engine: Engine, endpoint: str, model: str | None) -> tuple[Span, dict[str, str]]:
        """A pass-through call's span and the headers that carry it upstream."""
        span = self._start(engine, endpoint, model, {"enginemeter.role": "primary"})
        return span, self._headers(span)

    def end_attempt(self, span: Span, r: Result, timer: StreamTimer, *, response_model: str | None = None) -> None:
        """Close an attempt's span with what its Result says."""
        if not span.is_recording():
            span.end()
            return
        to_wall = time.time_ns() - time.perf_counter_ns()
        t = r.timing
        attrs: dict[str, Any] = {
            "enginemeter.outcome": r.outcome,
            "enginemeter.request_id": r.request_id,
            "enginemeter.model": r.model,
        }
        if r.status:
            attrs["http.response.status_code"] = r.status
        if response_model is not None and r.outcome == "ok":
            attrs["gen_ai.response.model"] = response_model
        if r.usage is not None:
            if r.usage.prompt_tokens is not None:
                attrs["gen_ai.usage.input_tokens"] = r.usage.prompt_tokens
            if r.usage.completion_tokens is not None:
                attrs["gen_ai.usage.output_tokens"] = r.usage.completion_tokens
            if r.usage.cached_tokens is not None:
                attrs["enginemeter.cached_tokens"] = r.usage.cached_tokens
        if r.finish_reason is not None:
            attrs["gen_ai.response.finish_reasons"] = (r.finish_reason,)
        for name in ("ttft_s", "upstream_ttft_s", "tpot_s", "decode_tps", "e2e_s"):
            v = getattr(t, name)
            if v is not None:
                attrs[f"enginemeter.{name}"] = v
        span.set_attributes(attrs)
        if timer.t_first_token_ns:
            span.add_event("gen_ai.first_token", timestamp=timer.t_first_token_ns + to_wall)
        if timer.t_last_token_ns:
            span.add_event(
                "gen_ai.last_token", {"enginemeter.token_events": r.n_token_events}, timer.t_last_token_ns + to_wall
            )
        if r.outcome != "ok":
            span.set_attribute("error.type", r.outcome)
            span.set_status(Status(StatusCode.ERROR, r.error or r.outcome))
        span.end(end_time=(timer.t_done_ns + to_wall) if timer.t_done_ns else None)
