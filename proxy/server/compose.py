"""The composition root: ``build_app`` builds every stage of the proxy server once, each a typed field of the
``Gateway``. ``enginemeter serve`` (one process or each worker) and the tests use it; nothing else builds an app."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from proxy.config.settings import Settings, SettingsError
from proxy.gpu.monitor import GpuMonitor
from proxy.gpu.nvml import Opener, PynvmlReader
from proxy.server.app import Gateway, make_engines
from proxy.server.asgi import asgi_app
from proxy.server.mirror.compare import new_run_id
from proxy.server.mirror.shadows import Mirror
from proxy.server.observe.enginestate import EngineStatePoller
from proxy.server.observe.inflight import TRAFFIC_FILE, TrafficProfile
from proxy.server.observe.livediagnosis import LiveDiagnosis
from proxy.server.observe.requestlog import RequestLog
from proxy.server.passthrough import Passthrough, passthrough_routes
from proxy.server.record.context import RequestContextMiddleware, forward_trace_headers
from proxy.server.record.loopwatch import LoopWatch
from proxy.server.record.metrics import Metrics
from proxy.server.request.attempts import Attempts
from proxy.server.request.llamatimings import AddTimings
from proxy.server.request.routing import Router
from proxy.server.request.upstream import Engine
from proxy.server.switch.rollouts import Rollouts
from proxy.server.switch.swaps import Swaps
from proxy.server.workers.role import WorkerRole, snapshot_health

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from proxy.server.observe.tracing import Tracing


def build_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    nvml: Opener | None = None,
    on_shutdown: Sequence[Callable[[], None]] = (),
    span_exporter: SpanExporter | None = None,
    worker: WorkerRole | None = None,
) -> Starlette:
    """The proxy for ``settings``: relay, routing, mirror + comparison, pass-through routes, GPU and engine-state
    collectors, and the opt-in request log, traces and timings block.

    ``registry``: where every metric goes (default a fresh one); ``nvml``: opens the NVML reader (tests replay
    recorded readings); ``on_shutdown``: called once the app has shut down; ``span_exporter``: where spans go
    when tracing is on (tests: an in-memory exporter; default OTLP/HTTP to ``tracing.endpoint``); ``worker``: one
    of several processes (``proxy.server.workers.supervisor``): the metrics go to the shared multiprocess files, a scrape
    merges them, and only worker 0 runs the GPU and engine-state collectors.
    """
    registry, metrics = registry_and_metrics(settings, registry, worker)
    engines = make_engines(settings)
    attempts = Attempts(settings, engines, metrics)
    loop_watch = LoopWatch(metrics)
    attempts.stalled_since = loop_watch.stalled_since
    # one run id for every worker of one `serve` (a restart of the proxy is a new run: the rollouts say so)
    rollouts = Rollouts.of(settings, settings.run_id or new_run_id())
    # every route's swap: its phase from the shared state the engines' owner writes (``serve``, the supervisor)
    swaps = Swaps.of(settings, slot=worker.index if worker is not None else 0, metrics=metrics, engines=engines)
    router = Router(settings, rollouts=rollouts, swaps=swaps)
    shutdown = list(on_shutdown)
    tracing, request_log = attempt_hooks(settings, attempts, router, shutdown, span_exporter)
    gpu, engine_state, diagnosis = collectors(settings, engines, registry, nvml, worker)
    mirror = make_mirror(settings, engines, attempts, metrics, gpu, engine_state)
    if rollouts is not None:
        # before the mirror's: a candidate's attempt is counted before the pair it completes is written
        attempts.observers.append(rollouts.on_result)
        mirror.pair_observers.append(rollouts.on_pair)
        registry.register(rollouts)  # reads the shared state file: every worker's scrape says the same
    if swaps is not None:
        attempts.observers.append(swaps.on_result)
        registry.register(swaps)
    attempts.observers.append(mirror.on_result)
    if any(r.shadows or r.rollout is not None for r in settings.routes):
        attempts.on_new.append(mirror.on_attempt)
    gw = Gateway(
        settings=settings,
        registry=registry,
        metrics=metrics,
        router=router,
        engines=engines,
        attempts=attempts,
        mirror=mirror,
        rollouts=rollouts,
        swaps=swaps,
        gpu=gpu,
        engine_state=engine_state,
        diagnosis=diagnosis,
        loop_watch=loop_watch,
        traffic=traffic_profile(metrics, worker),
        on_shutdown=shutdown,
        health_sections=(
            functools.partial(snapshot_health, worker.directory) if worker is not None and worker.index else None
        ),
    )
    return http_app(gw, tracing, request_log)


def registry_and_metrics(
    settings: Settings, registry: CollectorRegistry | None, worker: WorkerRole | None
) -> tuple[CollectorRegistry, Metrics]:
    """The registry a scrape reads, and the metric objects every stage writes: on that registry in one process
    (a fresh one unless given); under ``--workers`` the worker's merge of the multiprocess files."""
    if worker is not None:
        # the values live in the multiprocess files, which the worker's registry merges; this one is never scraped
        return worker.registry(), Metrics(CollectorRegistry(), settings.metrics)
    registry = registry if registry is not None else CollectorRegistry()
    return registry, Metrics(registry, settings.metrics)


def attempt_hooks(
    settings: Settings,
    attempts: Attempts,
    router: Router,
    shutdown: list[Callable[[], None]],
    span_exporter: SpanExporter | None,
) -> tuple[Tracing | None, RequestLog | None]:
    """The hooks every new attempt passes before the mirror's, in order: the client's trace headers, then the
    proxy's own span (it replaces traceparent), the timings block, the request log's text; the tracer and the
    request log (each None when off), their closers put first in ``shutdown``."""
    attempts.on_new.append(forward_trace_headers)
    tracing = None
    if settings.tracing.enabled:
        tracing = make_tracing(settings, span_exporter)
        attempts.on_new.append(tracing.on_attempt)
        shutdown.insert(0, tracing.shutdown)
    add_timings = AddTimings(settings)
    if add_timings.any():
        attempts.on_new.append(add_timings)
    request_log = None
    if settings.request_log.path:
        request_log = RequestLog(settings.request_log, router)
        attempts.observers.append(request_log.on_result)
        if settings.request_log.record_text:
            attempts.on_new.append(request_log.on_attempt)
        shutdown.insert(0, request_log.close)
    return tracing, request_log


def collectors(
    settings: Settings,
    engines: dict[str, Engine],
    registry: CollectorRegistry,
    nvml: Opener | None,
    worker: WorkerRole | None,
) -> tuple[GpuMonitor | None, EngineStatePoller | None, LiveDiagnosis | None]:
    """The GPU, engine-state and diagnosis collectors, registered on ``registry``: in one process, or in worker
    0 alone (which shares what they say with the others: ``proxy.server.workers.role``); None in the others."""
    if worker is not None and worker.index != 0:
        return None, None, None
    c = settings.collectors
    gpu = GpuMonitor(settings.engines, interval=c.gpu_interval, enabled=c.gpu, opener=nvml or PynvmlReader)
    registry.register(gpu)
    engine_state = EngineStatePoller(settings, engines, interval=c.engine_interval)
    registry.register(engine_state)
    diagnosis = LiveDiagnosis(engines, gpu)
    registry.register(diagnosis)
    if worker is not None:
        worker.collectors += [gpu, engine_state, diagnosis]
    return gpu, engine_state, diagnosis


def make_mirror(
    settings: Settings,
    engines: dict[str, Engine],
    attempts: Attempts,
    metrics: Metrics,
    gpu: GpuMonitor | None,
    engine_state: EngineStatePoller | None,
) -> Mirror:
    """The mirroring stage; what it records of the GPUs and the engines' facts comes from the collectors (other
    workers do not sample GPUs: their pairs' records leave ``gpus``/``contended`` unknown)."""
    state = engine_state
    return Mirror(
        settings,
        engines,
        attempts,
        metrics,
        gpus_of=gpu.gpus_of if gpu is not None else None,
        facts_of=(lambda name: state.states.get(name)) if state is not None else None,
    )


def traffic_profile(metrics: Metrics, worker: WorkerRole | None) -> TrafficProfile:
    """Time at each number of requests in flight: this process's, or under ``--workers`` the whole proxy's,
    shared by the workers (``proxy.server.observe.inflight``)."""
    if worker is None:
        return TrafficProfile(metrics.traffic)
    return TrafficProfile(metrics.traffic, shared=worker.directory / TRAFFIC_FILE, slot=worker.index)


def http_app(gw: Gateway, tracing: Tracing | None, request_log: RequestLog | None) -> Starlette:
    """The ASGI app around ``gw``: its own routes, the pass-through routes after them, and every request's
    context (and server span) made before any of them."""
    app = asgi_app(gw)
    app.state.request_log = request_log
    app.state.tracing = tracing
    passthrough = Passthrough(gw, tracing)
    app.router.routes.extend(passthrough_routes(passthrough))
    app.add_middleware(RequestContextMiddleware, tracing=tracing)
    app.fast = {path: RequestContextMiddleware(fn, tracing=tracing) for path, fn in app.fast.items()}
    return app


def make_tracing(settings: Settings, exporter: SpanExporter | None = None) -> Tracing:
    """The tracer for ``settings.tracing``; a clear error when the ``otel`` extra is not installed."""
    try:
        from proxy.server.observe.tracing import Tracing
    except ImportError as exc:
        raise SettingsError(
            f"tracing.enabled needs the OpenTelemetry packages: pip install 'enginemeter[otel]' ({exc})"
        ) from exc
    return Tracing(settings.tracing, exporter=exporter)
