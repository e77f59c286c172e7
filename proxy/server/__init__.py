"""Composition root: every stage of the proxy server built in one place, each a typed field of the ``Gateway``.

``enginemeter serve`` and the tests use ``build_app``. ``proxy.server.asgi.create_app`` is the bare gateway
(relay, routing, metrics) without the mirror and the collectors. The stages, in a request's order:

    asgi          the ASGI surface: routes, the generation routes served before Starlette, health, metrics
    paths         request paths normalised once, before routing and forwarding
    context       what one client request carries through every stage (trace headers, its span, its prompt)
    guard         connection limits below the app, and the uvicorn server with graceful shutdown
    loopwatch     the event loop's own health: lag, requests waiting for it, GC pauses
    app           the gateway: one generation request, top to bottom like its life
    routing       request -> the serving engine, fallbacks and shadows; pure
    attempts      one attempt on one engine, primary or shadow alike: made, run, recorded
    relay         the upstream call and the stream relay (the hot path): ``Attempt``
    upstream      per engine: the probing client and the relay's stream client
    h1            the relay's HTTP/1.1 client: a keep-alive pool over plain asyncio connections
    h1conn        one upstream connection: the parser's callbacks, backpressure, the client's own errors
    output        where a relayed stream's bytes go, one ``Output`` per stream
    responses     what the client gets from the proxy itself: the relayed response, errors, Server-Timing
    rewrite       the engine's ``model`` value made the client's name again
    llamatimings  a llama.cpp-shaped ``timings`` block measured by the proxy, for engines without one
    result        the frozen record of one request on one engine
    mirror        shadow copies, bounded and isolated; pairs compared; the live verdict fed
    pairing       the mirror's table matching a primary's and its shadows' results
    compare       primary vs shadow: one ``PairComparison``, its metrics, the comparison log's records
    runlog        a run's own records in the comparison log: run, engine facts, each rotated file's header
    rollout       the guarded switch: a route's share moves to a candidate step by step, rolls back by itself
    rolloutstate  a rollout's state document and its transitions (pure)
    sharedstate   a rollout's state shared by every worker: a two-slot memory map under flock
    requestlog    the opt-in per-request log
    tracing       the opt-in OpenTelemetry traces
    passthrough   every other ``/v1/*`` route and ``/tokenize``, unbuffered, never mirrored
    metrics       the only module that defines Prometheus metric objects (docs/metrics.md)
    enginestate   what each engine says of its configuration and load, polled
    diagnosis     the live diagnosis of every llama.cpp engine on this machine
    admin         the admin endpoints (the admin key)
    access        who may read /health's detail and /metrics (api_keys, health: public, metrics.access)
    tasks         a background loop held for the app's lifetime
    traffic       time at each number of requests in flight: the profile ``--traffic`` weighs a decision by
    workers       ``serve --workers N``: the supervisor and its workers on one port
    workerrole    one worker among several: worker 0's collectors and mirror settings shared through files
    lifetimes     no worker outlives its supervisor; the metrics directory's owner lock
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from proxy.gpu.monitor import GpuMonitor
from proxy.gpu.nvml import Opener, PynvmlReader
from proxy.server.app import Gateway, make_engines
from proxy.server.asgi import asgi_app
from proxy.server.attempts import Attempts
from proxy.server.compare import new_run_id
from proxy.server.context import RequestContextMiddleware, forward_trace_headers
from proxy.server.diagnosis import LiveDiagnosis
from proxy.server.enginestate import EngineStatePoller
from proxy.server.llamatimings import AddTimings
from proxy.server.loopwatch import LoopWatch
from proxy.server.metrics import Metrics
from proxy.server.mirror import Mirror
from proxy.server.passthrough import Passthrough, passthrough_routes
from proxy.server.requestlog import RequestLog
from proxy.server.rollout import Rollouts
from proxy.server.routing import Router
from proxy.server.traffic import TRAFFIC_FILE, TrafficProfile
from proxy.server.workerrole import snapshot_health
from proxy.settings import Settings, SettingsError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from proxy.server.tracing import Tracing
    from proxy.server.workerrole import WorkerRole


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
    of several processes (``proxy.server.workers``): the metrics go to the shared multiprocess files, a scrape
    merges them, and only worker 0 runs the GPU and engine-state collectors.
    """
    if worker is not None:
        registry = worker.registry()
        # the values live in the multiprocess files, which `registry` merges; this one is never scraped
        metrics = Metrics(CollectorRegistry(), settings.metrics)
    else:
        registry = registry if registry is not None else CollectorRegistry()
        metrics = Metrics(registry, settings.metrics)
    engines = make_engines(settings)
    attempts = Attempts(settings, engines, metrics)
    # one run id for every worker of one `serve` (a restart of the proxy is a new run: the rollouts say so)
    rollouts = Rollouts.of(settings, settings.run_id or new_run_id())
    router = Router(settings, rollouts=rollouts)
    shutdown = list(on_shutdown)
    # attempt hooks, in order: the client's trace headers, then the proxy's own span (it replaces traceparent)
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
    c = settings.collectors
    gpu: GpuMonitor | None = None
    engine_state: EngineStatePoller | None = None
    diagnosis: LiveDiagnosis | None = None
    if worker is None or worker.index == 0:
        gpu = GpuMonitor(settings.engines, interval=c.gpu_interval, enabled=c.gpu, opener=nvml or PynvmlReader)
        registry.register(gpu)
        engine_state = EngineStatePoller(settings, engines, interval=c.engine_interval)
        registry.register(engine_state)
        diagnosis = LiveDiagnosis(engines, gpu)
        registry.register(diagnosis)
        if worker is not None:
            worker.collectors += [gpu, engine_state, diagnosis]
    # other workers do not sample GPUs: their pairs' records leave `gpus`/`contended` unknown
    state = engine_state
    mirror = Mirror(settings, engines, attempts, metrics, gpus_of=gpu.gpus_of if gpu is not None else None,
                    facts_of=(lambda name: state.states.get(name)) if state is not None else None)  # fmt: skip
    if rollouts is not None:
        # before the mirror's: a candidate's attempt is counted before the pair it completes is written
        attempts.observers.append(rollouts.on_result)
        mirror.pair_observers.append(rollouts.on_pair)
        registry.register(rollouts)  # reads the shared state file: every worker's scrape says the same
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
        gpu=gpu,
        engine_state=engine_state,
        diagnosis=diagnosis,
        loop_watch=LoopWatch(metrics),
        # under --workers the whole proxy's requests in flight, shared by the workers (proxy.server.traffic)
        traffic=(
            TrafficProfile(metrics.traffic)
            if worker is None
            else TrafficProfile(metrics.traffic, shared=worker.directory / TRAFFIC_FILE, slot=worker.index)
        ),
        on_shutdown=shutdown,
        health_sections=(
            functools.partial(snapshot_health, worker.directory) if worker is not None and worker.index else None
        ),
    )
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
        from proxy.server.tracing import Tracing
    except ImportError as exc:
        raise SettingsError(
            f"tracing.enabled needs the OpenTelemetry packages: pip install 'enginemeter[otel]' ({exc})"
        ) from exc
    return Tracing(settings.tracing, exporter=exporter)
