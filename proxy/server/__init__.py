"""Composition root: every stage of the proxy server built in one place, each a typed field of the ``Gateway``.

``enginemeter serve`` and the tests use ``build_app``. ``proxy.server.app.create_app`` is the bare gateway
(relay, routing, metrics) without the mirror and the collectors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from proxy.server.app import Gateway, asgi_app, make_engines
from proxy.server.attempt import Attempts
from proxy.server.enginestate import EngineStatePoller
from proxy.server.gpu import GpuMonitor, Opener
from proxy.server.metrics import Metrics
from proxy.server.mirror import Mirror
from proxy.server.nvml import PynvmlReader
from proxy.server.routing import Router
from proxy.server.workers import snapshot_health
from proxy.settings import Settings

if TYPE_CHECKING:
    from proxy.server.workers import WorkerRole


def build_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    nvml: Opener | None = None,
    on_shutdown: Sequence[Callable[[], None]] = (),
    worker: WorkerRole | None = None,
) -> Starlette:
    """The proxy for ``settings``: relay, routing, mirror + comparison, GPU and engine-state collectors.

    ``registry``: where every metric goes (default a fresh one); ``nvml``: opens the NVML reader (tests replay
    recorded readings); ``on_shutdown``: called once the app has shut down; ``worker``: one of several
    processes (``proxy.server.workers``): the metrics go to the shared multiprocess files, a scrape merges them,
    and only worker 0 runs the GPU and engine-state collectors.
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
    mirror = Mirror(settings, engines, attempts, metrics)
    attempts.observers.append(mirror.on_result)
    c = settings.collectors
    gpu: GpuMonitor | None = None
    engine_state: EngineStatePoller | None = None
    if worker is None or worker.index == 0:
        gpu = GpuMonitor(settings.engines, interval=c.gpu_interval, enabled=c.gpu, opener=nvml or PynvmlReader)
        registry.register(gpu)
        engine_state = EngineStatePoller(settings, engines, interval=c.engine_interval)
        registry.register(engine_state)
        if worker is not None:
            worker.collectors += [gpu, engine_state]
    gw = Gateway(
        settings=settings,
        registry=registry,
        metrics=metrics,
        router=Router(settings),
        engines=engines,
        attempts=attempts,
        mirror=mirror,
        gpu=gpu,
        engine_state=engine_state,
        on_shutdown=on_shutdown,
        health_sections=(
            functools.partial(snapshot_health, worker.directory) if worker is not None and worker.index else None
        ),
    )
    return asgi_app(gw)
