"""One worker among ``serve --workers N``'s: what it shares with the others through the multiprocess directory.

Worker 0 alone runs the GPU and engine-state collectors and writes what they export to ``collectors.prom`` every
``SNAPSHOT_INTERVAL_S`` (and its ``/health`` sections to ``collectors-health.json``); the other workers' scrapes
and ``/health`` include them (``SnapshotCollector``, ``snapshot_health``: absent when older than
``SNAPSHOT_STALE_S``). A mirror setting changed on one worker is published to ``mirror.json`` and applied by the
others within ``SYNC_INTERVAL_S``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.server.record.metricfiles import SafeMultiProcessCollector, install

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from proxy.server.mirror.shadows import Mirror

log = logging.getLogger("enginemeter.workers")

SNAPSHOT_INTERVAL_S = 1.0
SNAPSHOT_STALE_S = 10.0
SYNC_INTERVAL_S = 0.5
SNAPSHOT_FILE = "collectors.prom"
HEALTH_FILE = "collectors-health.json"
MIRROR_FILE = "mirror.json"


@dataclass
class WorkerRole:
    """What ``build_app`` needs to know of the worker it runs in."""

    index: int
    directory: Path
    #: worker 0's collectors (GPU, engine state), set by ``build_app``; written to the snapshot files
    collectors: list[Any] = field(default_factory=list)

    def registry(self) -> CollectorRegistry:
        """The registry a scrape reads: every worker's files merged, plus the collectors (worker 0 adds its own
        live ones; the others read worker 0's snapshot)."""
        install()  # this worker's metric files written through pwrite: a cut file costs figures, not a SIGBUS
        registry = CollectorRegistry()
        SafeMultiProcessCollector(registry, path=str(self.directory))  # type: ignore[no-untyped-call]
        if self.index != 0:
            registry.register(SnapshotCollector(self.directory / SNAPSHOT_FILE))
        return registry

    def wrap(self, app: ASGIApp, mirror: Mirror | None, on_started: Callable[[], None] | None = None) -> ASGIApp:
        """``app`` with this worker's background jobs started and stopped by the ASGI lifespan; ``on_started``
        is called once the app's startup is complete."""
        role = self

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "lifespan":
                await app(scope, receive, send)
                return
            jobs: list[asyncio.Task[None]] = []
            stop = threading.Event()
            threads: list[threading.Thread] = []

            async def send_(message: Any) -> None:
                if message["type"] == "lifespan.startup.complete":
                    if role.index == 0 and role.collectors:
                        t = threading.Thread(target=role._write_snapshots, args=(stop,), daemon=True)
                        t.start()
                        threads.append(t)
                    if mirror is not None:
                        jobs.append(asyncio.ensure_future(sync_mirror(mirror, role.directory / MIRROR_FILE)))
                    if on_started is not None:
                        on_started()
                elif message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                    stop.set()
                    for job in jobs:
                        job.cancel()
                    await asyncio.gather(*jobs, return_exceptions=True)
                await send(message)

            await app(scope, receive, send_)

        return wrapped

    def _write_snapshots(self, stop: threading.Event) -> None:
        registry = CollectorRegistry()
        for c in self.collectors:
            registry.register(c)
        path = self.directory / SNAPSHOT_FILE
        while True:
            try:
                atomic_write(path, generate_latest(registry))
                sections: dict[str, Any] = {}
                for c in self.collectors:
                    sections.update(c.health())
                atomic_write(self.directory / HEALTH_FILE, json.dumps(sections, default=str).encode())
            except Exception:  # a collector bug must not end the snapshots; say so and go on
                log.exception("writing the collectors' snapshot failed")
            if stop.wait(SNAPSHOT_INTERVAL_S):  # the interval between snapshots, not a synchronisation
                return


def snapshot_health(directory: Path) -> dict[str, Any]:
    """Worker 0's collectors' /health sections, as its last snapshot says ({} when missing or stale)."""
    path = directory / HEALTH_FILE
    try:
        if time.time() - path.stat().st_mtime > SNAPSHOT_STALE_S:
            return {}
        # NaN/Infinity refused: /health must stay JSON (a garbled file costs its sections, not a 500)
        doc = json.loads(path.read_bytes(), parse_constant=_no_constant)
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class SnapshotCollector:
    """Worker 0's collectors, as its last snapshot says (nothing when the file is missing or stale)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[Any]:
        try:
            st = self.path.stat()
            if time.time() - st.st_mtime > SNAPSHOT_STALE_S:
                return
            text = self.path.read_text()
        except OSError:
            return
        yield from text_string_to_metric_families(text)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _mirror_state(mirror: Mirror) -> dict[str, Any]:
    return {"enabled": mirror.enabled, "rates": list(mirror.rates)}


async def sync_mirror(mirror: Mirror, path: Path) -> None:
    """Keep this worker's mirror settings and ``path`` in step: a change made here (admin) is published, a
    change published by another worker is applied. The later one wins."""
    applied = _mirror_state(mirror)
    seen = _mtime(path)
    while True:
        await asyncio.sleep(SYNC_INTERVAL_S)  # the polling period, not a synchronisation
        mtime = _mtime(path)
        if mtime != seen:
            seen = mtime
            try:
                doc = _read_json(path)  # a few hundred bytes on a local disk
                mirror.set(enabled=bool(doc["enabled"]))
                for i, rate in enumerate(doc["rates"][: len(mirror.rates)]):
                    mirror.set(sample_rate=float(rate), route=i)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring %s: %s", path, exc)
            applied = _mirror_state(mirror)
        elif _mirror_state(mirror) != applied:
            applied = _mirror_state(mirror)
            atomic_write(path, json.dumps(applied).encode())
            seen = _mtime(path)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0
