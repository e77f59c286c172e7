"""OpenTelemetry traces (proxy/server/observe/tracing.py) through the real proxy, exported to the SDK's in-memory
exporter: a server span per request continuing the client's traceparent, a child span per attempt (primary,
shadow, pass-through) with gen_ai.* attributes and token events, the attempt's context sent upstream,
sampling by ratio with the client's decision winning."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

from fakes.fault_engine import FaultEngineConfig, Knobs, run_in_thread
from proxy.config.settings import EngineSettings, RouteSettings, Settings, Timeouts, TracingSettings
from proxy.server.compose import build_app
from tests.helpers import run_uvicorn_app, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def fault_engines() -> Iterator[tuple[str, str]]:
    with ExitStack() as stack:
        knobs = Knobs(tokens=5, cadence_ms=2)
        yield (
            stack.enter_context(run_in_thread(FaultEngineConfig(knobs=knobs))),
            stack.enter_context(run_in_thread(FaultEngineConfig(knobs=knobs))),
        )


def serve(stack: ExitStack, primary: str, shadow: str, ratio: float) -> tuple[httpx.Client, InMemorySpanExporter]:
    t = Timeouts(connect=2, read=20)
    settings = Settings(
        engines=(
            EngineSettings(name="p", url=primary, kind="llamacpp", model="fault-engine", timeouts=t),
            EngineSettings(name="s", url=shadow, kind="sglang", model="fault-engine", timeouts=t),
        ),
        routes=(RouteSettings(primary="p", shadows=("s",)),),
        tracing=TracingSettings(enabled=True, sample_ratio=ratio),
    )
    exporter = InMemorySpanExporter()
    app = build_app(settings, registry=CollectorRegistry(), span_exporter=exporter)
    url = stack.enter_context(run_uvicorn_app(app))
    return stack.enter_context(httpx.Client(base_url=url, timeout=30)), exporter


def upstream_headers(url: str) -> list[dict[str, str]]:
    return [q["headers"] for q in httpx.get(f"{url}/_fake/requests?full=1", timeout=5).json()]


def finished(exporter: InMemorySpanExporter, n: int) -> tuple[ReadableSpan, ...]:
    """The finished spans, once there are at least ``n``."""

    def spans() -> tuple[ReadableSpan, ...]:
        got = exporter.get_finished_spans()
        return got if len(got) >= n else ()

    return wait_until(spans)


def test_spans_for_a_mirrored_stream_and_a_passthrough(fault_engines: tuple[str, str]) -> None:
    primary, shadow = fault_engines
    with ExitStack() as stack:
        client, exporter = serve(stack, primary, shadow, ratio=1.0)
        body: dict[str, Any] = {"model": "m", "messages": MSGS, "max_tokens": 5, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}) as r:
            assert r.status_code == 200
            r.read()
        # server span + primary + shadow
        spans = finished(exporter, 3)
        (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
        assert server.name == "POST /v1/chat/completions"
        assert server.context is not None and server.parent is not None
        assert f"{server.context.trace_id:032x}" == TRACE_ID  # the client's trace continues
        assert f"{server.parent.span_id:016x}" == PARENT_ID
        assert server.attributes is not None and server.attributes["http.response.status_code"] == 200
        attempts = [s for s in spans if s.kind == SpanKind.CLIENT]
        assert len(attempts) == 2
        roles = {}
        for span in attempts:
            a = span.attributes
            assert a is not None and span.parent is not None
            assert span.parent.span_id == server.context.span_id
            roles[a["enginemeter.role"]] = span
            assert span.name == "chat fault-engine"
            assert a["gen_ai.operation.name"] == "chat"
            assert a["gen_ai.request.model"] == "fault-engine" and a["gen_ai.response.model"] == "fault-engine"
            assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0  # type: ignore[operator]
            assert a["gen_ai.response.finish_reasons"] == ("length",)
            assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0
            assert a["enginemeter.outcome"] == "ok" and a["enginemeter.ttft_s"] > 0  # type: ignore[operator]
            first, last = [e for e in span.events if e.name in ("gen_ai.first_token", "gen_ai.last_token")]
            assert span.start_time is not None and span.end_time is not None
            assert span.start_time <= first.timestamp <= last.timestamp <= span.end_time
        assert roles["primary"].attributes["gen_ai.provider.name"] == "llama.cpp"  # type: ignore[index]
        assert roles["shadow"].attributes["gen_ai.provider.name"] == "sglang"  # type: ignore[index]
        # each engine got its own attempt's context as traceparent, in the client's trace
        for url, role in ((primary, "primary"), (shadow, "shadow")):
            ctx = roles[role].context
            assert ctx is not None
            assert upstream_headers(url)[-1]["traceparent"] == f"00-{TRACE_ID}-{ctx.span_id:016x}-01"
        exporter.clear()
        r2 = client.post("/tokenize", json={"content": "a b c"})
        assert r2.status_code == 200
        spans = finished(exporter, 2)
        (call,) = [s for s in spans if s.kind == SpanKind.CLIENT]
        assert call.name == "tokenize" and call.attributes is not None
        assert call.attributes["enginemeter.outcome"] == "ok"
        assert call.context is not None
        assert upstream_headers(primary)[-1]["traceparent"].split("-")[2] == f"{call.context.span_id:016x}"


def test_sampling_ratio_zero_keeps_only_sampled_parents(fault_engines: tuple[str, str]) -> None:
    primary, shadow = fault_engines
    with ExitStack() as stack:
        client, exporter = serve(stack, primary, shadow, ratio=0.0)
        assert client.post("/tokenize", json={"content": "a"}).status_code == 200
        # unsampled: nothing exported, the context still goes upstream (its sampled flag clear)
        flags = upstream_headers(primary)[-1]["traceparent"].split("-")[3]
        assert int(flags, 16) & 1 == 0
        assert not exporter.get_finished_spans()
        assert client.post("/tokenize", json={"content": "a"}, headers={"traceparent": TRACEPARENT}).status_code == 200
        spans = finished(exporter, 2)
        assert len(spans) == 2  # the client sampled this one: its decision wins
        assert {f"{s.context.trace_id:032x}" for s in spans if s.context is not None} == {TRACE_ID}


def test_default_exporter_is_otlp_http() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from proxy.server.observe.tracing import Tracing

    tracing = Tracing(TracingSettings(enabled=True, endpoint="http://127.0.0.1:4318/v1/traces", sample_ratio=0.5))
    assert isinstance(tracing.exporter, OTLPSpanExporter)
    assert (
        tracing.provider.sampler.get_description()
        == "ParentBased{root:TraceIdRatioBased{0.5},remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler,localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"
    )
    tracing.shutdown()  # nothing queued: returns without reaching the collector
