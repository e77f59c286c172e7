"""``enginemeter serve --workers N``: N processes, each its own event loop, behind one port.

The supervisor (the ``serve`` process) reserves the port, sets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory
unless the environment names one), starts N workers with multiprocessing's ``spawn`` (fresh interpreters, so
the variable is set before any of them imports prometheus_client), restarts a worker that dies, forwards
SIGTERM/SIGINT, and removes the directory it made when the last worker is gone.

Each worker:

- binds its own listening socket to the same host:port with ``SO_REUSEPORT``: the kernel spreads incoming
  connections over the workers by their address hash (a kept-alive connection stays with its worker);
- counts in prometheus-client's multiprocess mode: every worker writes its counters, histograms and gauges to
  memory-mapped files in the directory, and a scrape on any worker merges all of them (``MultiProcessCollector``):
  counters and histograms sum, ``enginemeter_in_flight_requests`` sums over live workers (``livesum``),
  ``enginemeter_build_info`` takes the maximum;
- runs the GPU and engine-state collectors only if it is worker 0, which writes what they export to
  ``collectors.prom`` in the directory every ``SNAPSHOT_INTERVAL_S``; the other workers' scrapes include that
  file, and their ``/health`` the sections worker 0 wrote to ``collectors-health.json`` (both absent when older
  than ``SNAPSHOT_STALE_S``: missing, never stale; ages in them are as of the snapshot, up to a second old);
- mirrors its own requests (``mirror.max_in_flight`` and the sample rate hold per worker); a change through
  ``POST /admin/mirror`` lands on one worker, which publishes it to ``mirror.json``; the others apply it within
  ``SYNC_INTERVAL_S``. ``GET /admin/mirror`` counts (sent, in flight) are the answering worker's;
- appends to the one comparison log: ``ComparisonLog`` holds an ``flock`` while it rotates and writes a line.

With ``--workers 1`` none of this runs: the proxy is one process as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from starlette.types import ASGIApp, Receive, Scope, Send

    from proxy.server.mirror import Mirror
    from proxy.settings import Settings

log = logging.getLogger("enginemeter.workers")

SNAPSHOT_INTERVAL_S = 1.0
SNAPSHOT_STALE_S = 10.0
SYNC_INTERVAL_S = 0.5
SNAPSHOT_FILE = "collectors.prom"
HEALTH_FILE = "collectors-health.json"
MIRROR_FILE = "mirror.json"
#: a worker that dies this soon after its start, this many times in a row, stops the whole server
CRASH_WINDOW_S = 5.0
MAX_QUICK_CRASHES = 3


def default_workers() -> int:
    """Half the CPUs this process may run on (the engines, and the clients on a test box, need the rest), 1 to 8.

    One worker relays ~8,000 chunks/s on one core (docs/performance.md, the 16-core run); 8 cover a 16-core host."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def reuseport_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
        sock.setblocking(False)
    return sock


# ================================================================================================ in a worker


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
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.directory))  # type: ignore[no-untyped-call]
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
        from prometheus_client import CollectorRegistry, generate_latest

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
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


class SnapshotCollector:
    """Worker 0's collectors, as its last snapshot says (nothing when the file is missing or stale)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[Any]:
        from prometheus_client.parser import text_string_to_metric_families

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


@dataclass(frozen=True)
class WorkerSpec:
    settings: Settings
    index: int
    host: str
    port: int
    directory: str
    log_level: str


def worker_main(spec: WorkerSpec, ready: Any) -> None:
    """A worker's process (spawned): its socket, its app, uvicorn on it until SIGTERM/SIGINT."""
    import uvicorn

    from proxy.server import build_app

    logging.basicConfig(
        level=getattr(logging, spec.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec.index}]: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sock = reuseport_socket(spec.host, spec.port)
    role = WorkerRole(spec.index, Path(spec.directory))
    app = build_app(spec.settings, worker=role)
    wrapped = role.wrap(app, app.state.gateway.mirror, on_started=ready.set)
    config = uvicorn.Config(wrapped, log_config=None, log_level=spec.log_level, access_log=False)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=[sock])


# ================================================================================================ supervisor


def serve_workers(
    settings: Settings,
    n: int,
    *,
    log_level: str = "info",
    on_shutdown: Sequence[Callable[[], None]] = (),
    announce: Callable[[int], None] | None = None,
) -> int:
    """Run ``n`` workers on ``settings.host:settings.port`` until SIGTERM/SIGINT; returns the exit status.

    ``announce`` gets the port once every worker has started (``settings.port`` 0 picks one); ``on_shutdown`` runs
    at the end."""
    from prometheus_client.multiprocess import mark_process_dead

    made_dir = None
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for f in Path(directory).glob("*.db"):  # the figures of an earlier run would add up with ours
            f.unlink()
    else:
        directory = made_dir = tempfile.mkdtemp(prefix="enginemeter-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    # bound, never listening: holds the port (port 0 picks one) without taking connections
    reserve = reuseport_socket(settings.host, settings.port, listen=False)
    port = int(reserve.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    stopping = threading.Event()
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    started: dict[int, float] = {}
    crashes = 0

    def start(i: int) -> Any:
        spec = WorkerSpec(settings, i, settings.host, port, directory, log_level)
        ready = ctx.Event()
        p = ctx.Process(target=worker_main, args=(spec, ready), name=f"enginemeter-worker-{i}", daemon=False)
        p.start()
        procs[i], started[i] = p, time.monotonic()
        return ready

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()
        for p in procs.values():
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        readies = [start(i) for i in range(n)]
        for i, ready in enumerate(readies):
            while not ready.wait(0.1) and procs[i].exitcode is None and not stopping.is_set():
                pass  # waiting for worker i's startup, or its exit
        if all(r.is_set() for r in readies) and not stopping.is_set():
            log.info("%d workers on %s:%d (metrics merged in %s)", n, settings.host, port, directory)
            if announce is not None:
                announce(port)
        while procs:
            multiprocessing.connection.wait([p.sentinel for p in procs.values()])
            for i, p in list(procs.items()):
                if p.exitcode is None:
                    continue
                del procs[i]
                if p.pid is not None:
                    mark_process_dead(p.pid, directory)  # type: ignore[no-untyped-call]
                if stopping.is_set():
                    continue
                quick = time.monotonic() - started[i] < CRASH_WINDOW_S
                crashes = crashes + 1 if quick else 0
                if crashes >= MAX_QUICK_CRASHES:
                    log.error("worker %d exited with %s %d times at start: stopping", i, p.exitcode, crashes)
                    status = 1
                    on_signal(signal.SIGTERM, None)
                    continue
                log.error("worker %d exited with %s: restarting it", i, p.exitcode)
                start(i)
    finally:
        stopping.set()
        for p in procs.values():
            p.terminate()
            p.join(10)
        for s, h in previous.items():
            signal.signal(s, h)
        reserve.close()
        for stop in on_shutdown:
            stop()
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
    return status
