"""``enginemeter serve --workers N``: N processes, each its own event loop, behind one port.

The supervisor (the ``serve`` process) reserves the port, sets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory
unless the environment names one), starts N workers with multiprocessing's ``spawn`` (fresh interpreters, so
the variable is set before any of them imports prometheus_client), restarts a worker that dies, forwards
SIGTERM/SIGINT, and removes the directory it made when the last worker is gone.

A worker that dies (SIGKILL, the OOM killer, a crash) is restarted in its place; the others serve on meanwhile.
Its requests in progress are lost with it (their clients see the connection reset), and the supervisor counts
them before the dead worker's gauges are dropped: ``enginemeter_worker_lost_requests_total{engine, role}`` gets
what the dead worker's ``enginemeter_in_flight_requests`` file said (``lost_in_flight``), and
``enginemeter_worker_restarts_total`` one. That file is a shared memory map the worker updated at every
attempt's start and end, so it is exact at the moment of death, whatever killed the process; what it cannot
know is the model, stream and endpoint of each lost attempt (the gauge has no such labels) and requests the
worker had not yet handed to an engine (still sending their body, or refused): those leave no count. Counts the
worker had already made (its ``counter_<pid>.db``) stay in the merged totals. A worker that dies within
``CRASH_WINDOW_S`` of its start ``MAX_QUICK_CRASHES`` times in a row stops the whole server (exit 1).

Each worker:

- runs the same uvicorn configuration as a single-process ``serve`` (``guard.server_config``: header deadline,
  head size limit, keep-alive and graceful-shutdown timeouts);

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
- appends to the one comparison log: ``ComparisonLog`` holds an ``flock`` while it rotates and writes a line;
- counts the whole proxy's generation requests in flight, not its own, for the traffic profile: the workers share
  the number and the seconds at each level through ``traffic.shm`` in the directory (``proxy.server.observe.inflight``).
  The supervisor lays the file out before it starts a worker, takes a dead worker's requests off the number (the
  worker's own count in the file, exact at its death) and, at the end, logs the whole proxy's profile as a
  single-process ``serve`` does (``on_traffic``: ``serve``'s "traffic served: ...; ... --traffic SPEC" line)
  before the directory is removed.

No worker outlives its supervisor, and the directory is removed once nobody uses it: ``proxy.server.workers.lifetimes``.
What a worker shares with the others (worker 0's collectors, mirror settings): ``proxy.server.workers.role``.

With ``--workers 1`` none of this runs: the proxy is one process as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from proxy.server.observe.inflight import TrafficProfile
    from proxy.settings import Settings

from proxy.server.workers.lifetimes import (
    claim_directory,
    die_with_parent,
    hold_directory,
    make_directory,
    remove_stale_directories,
    watch_parent,
)
from proxy.server.workers.role import WorkerRole

log = logging.getLogger("enginemeter.workers")

#: a worker that dies this soon after its start, this many times in a row, stops the whole server
CRASH_WINDOW_S = 5.0
MAX_QUICK_CRASHES = 3
#: what a worker writes to its start-up pipe once it serves
READY = b"ready"


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


#: builds a worker's app (``proxy.server.compose.build_app``): given, not imported, so this module stays below the
#: composition root that imports it; a module-level function, so it reaches a spawned worker by reference
AppFactory = Callable[..., "Starlette"]


@dataclass(frozen=True)
class WorkerSpec:
    settings: Settings
    index: int
    host: str
    port: int
    directory: str
    log_level: str
    shutdown_timeout_s: float = 30.0
    app_factory: AppFactory | None = None
    #: the supervisor's pid: a worker whose parent is no longer this one stops (module docstring)
    supervisor_pid: int = 0


def worker_main(spec: WorkerSpec, ready: multiprocessing.connection.Connection) -> None:
    """A worker's process (spawned): its socket, its app, uvicorn on it until SIGTERM/SIGINT or its supervisor's
    death."""
    # first of all: from here on the supervisor's death reaches this process; if it died before, stop now
    die_with_parent(signal.SIGTERM)
    if spec.supervisor_pid and os.getppid() != spec.supervisor_pid:
        return
    if spec.app_factory is None:
        raise RuntimeError("a worker needs the app factory (serve_workers' app_factory)")
    from proxy.server.workers.guard import Server, server_config

    logging.basicConfig(
        level=getattr(logging, spec.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec.index}]: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    hold_directory(spec.directory)  # for this process's life: the directory is in use
    sock = reuseport_socket(spec.host, spec.port)
    role = WorkerRole(spec.index, Path(spec.directory))
    app = spec.app_factory(spec.settings, worker=role)

    def started() -> None:
        with contextlib.suppress(OSError):  # the supervisor is gone: its watch stops this worker
            ready.send_bytes(READY)
        ready.close()

    wrapped = role.wrap(app, app.state.gateway.mirror, on_started=started)
    # the single-process serve's configuration: connection limits, shutdown timeout (proxy/server/workers/guard.py)
    config = server_config(
        wrapped,
        log_level=spec.log_level,
        shutdown_timeout_s=spec.shutdown_timeout_s,
        loop_watch=app.state.gateway.loop_watch,
    )
    server = Server(config)
    if spec.supervisor_pid:
        # uvicorn's own shutdown, as on SIGTERM: stop listening, finish what is in progress, exit
        watch_parent(spec.supervisor_pid, lambda: setattr(server, "should_exit", True))
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])


# ================================================================================================ supervisor


def lost_in_flight(directory: Path, pid: int) -> dict[tuple[str, str], int]:
    """What a dead worker's ``enginemeter_in_flight_requests`` said at its death, by (engine, role): read from its
    multiprocess file before ``mark_process_dead`` removes it."""
    from prometheus_client.mmap_dict import MmapedDict

    path = directory / f"gauge_livesum_{pid}.db"
    lost: dict[tuple[str, str], int] = {}
    try:
        values = MmapedDict.read_all_values_from_file(str(path))  # type: ignore[no-untyped-call]
    except (OSError, ValueError):
        return lost
    for key, value, *_ in values:
        try:
            _, name, labels, _ = json.loads(key)
        except ValueError:
            continue
        if name == "enginemeter_in_flight_requests" and value >= 1:
            lost[(str(labels.get("engine")), str(labels.get("role")))] = round(value)
    return lost


class SupervisorCounts:
    """The supervisor's own counters, written to its file in the multiprocess directory so that every worker's
    scrape merges them (this process imported prometheus_client before the directory was set, so its metric
    objects cannot write there: the file is written directly, with the keys prometheus-client uses)."""

    def __init__(self, directory: Path) -> None:
        from prometheus_client.mmap_dict import MmapedDict

        self._file = MmapedDict(str(directory / f"counter_{os.getpid()}.db"))  # type: ignore[no-untyped-call]
        self._totals: dict[str, float] = {}

    def add(self, metric: str, help_text: str, labels: dict[str, str], n: float) -> None:
        from prometheus_client.mmap_dict import mmap_key

        key = mmap_key(metric, f"{metric}_total", list(labels), list(labels.values()), help_text)
        self._totals[key] = self._totals.get(key, 0.0) + n
        self._file.write_value(key, self._totals[key], time.time())  # type: ignore[no-untyped-call]

    def worker_died(self, lost: dict[tuple[str, str], int]) -> None:
        from proxy.server.record.metrics import PREFIX, WORKER_LOST_HELP, WORKER_RESTARTS_HELP

        for (engine, role), n in lost.items():
            self.add(f"{PREFIX}_worker_lost_requests", WORKER_LOST_HELP, {"engine": engine, "role": role}, n)
        self.add(f"{PREFIX}_worker_restarts", WORKER_RESTARTS_HELP, {}, 1)

    def close(self) -> None:
        self._file.close()  # type: ignore[no-untyped-call]


def serve_workers(
    settings: Settings,
    n: int,
    *,
    app_factory: AppFactory,
    log_level: str = "info",
    shutdown_timeout_s: float = 30.0,
    on_shutdown: Sequence[Callable[[], None]] = (),
    announce: Callable[[int], None] | None = None,
    on_traffic: Callable[[TrafficProfile], None] | None = None,
) -> int:
    """Run ``n`` workers on ``settings.host:settings.port`` until SIGTERM/SIGINT; returns the exit status.

    ``app_factory`` builds each worker's app (``proxy.server.compose.build_app``); ``announce`` gets the port once every
    worker has started (``settings.port`` 0 picks one); ``on_shutdown`` runs
    at the end; ``on_traffic`` then gets the whole proxy's traffic profile, if every worker had started."""
    from prometheus_client.multiprocess import mark_process_dead

    from proxy.server.observe.inflight import TRAFFIC_FILE, TrafficProfile
    from proxy.server.record.metrics import PREFIX, TRAFFIC_HELP

    made_dir = None
    remove_stale_directories()
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        try:
            lock = claim_directory(directory, shutdown_timeout_s + 5)
        except RuntimeError as exc:
            log.error("%s", exc)
            for stop in on_shutdown:
                stop()
            return 1
    else:
        directory, lock = make_directory()
        made_dir = directory
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    # bound, never listening: holds the port (port 0 picks one) without taking connections
    reserve = reuseport_socket(settings.host, settings.port, listen=False)
    port = int(reserve.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    stopping = threading.Event()
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    started: dict[int, float] = {}
    #: each worker's start-up pipe (the reading end): the worker writes READY once it serves. Not a
    #: multiprocessing Event: its set() waits for every waiter to wake, so a supervisor killed while waiting left
    #: a starting worker blocked for ever, its event loop with it (a parent-death signal could not end it)
    readies: dict[int, multiprocessing.connection.Connection] = {}
    counts = SupervisorCounts(Path(directory))
    # the whole proxy's requests in flight (proxy.server.observe.inflight): an earlier run's file is not this run's count
    # (claim_directory wipes *.db only); laid out afresh before any worker opens it
    (Path(directory) / TRAFFIC_FILE).unlink(missing_ok=True)
    traffic = TrafficProfile(
        shared=Path(directory) / TRAFFIC_FILE,
        # the supervisor's own ticks (at a worker's death, at the end) go to its counter file, so the merged
        # enginemeter_traffic_seconds_total stays the sum of every tick
        record=lambda level, dt: counts.add(f"{PREFIX}_traffic_seconds", TRAFFIC_HELP, {"level": level}, dt),
    )
    crashes = 0
    served = False

    def start(i: int) -> None:
        spec = WorkerSpec(settings, i, settings.host, port, directory, log_level, shutdown_timeout_s, app_factory,
                          os.getpid())  # fmt: skip
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker_main, args=(spec, writer), name=f"enginemeter-worker-{i}", daemon=False)
        p.start()
        writer.close()  # the child has its own copy: the pipe ends (EOF) when the child does
        if i in readies:
            readies[i].close()
        readies[i] = reader
        procs[i], started[i] = p, time.monotonic()

    def wait_ready(i: int) -> bool:
        """Until worker ``i`` serves (True), exits or the supervisor is told to stop (False)."""
        while procs[i].exitcode is None and not stopping.is_set():
            if readies[i].poll(0.1):
                try:
                    return readies[i].recv_bytes() == READY
                except (EOFError, OSError):
                    return False
        return False

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()
        for p in procs.values():
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        for i in range(n):
            start(i)
        up = [wait_ready(i) for i in range(n)]
        if all(up) and not stopping.is_set():
            served = True
            log.info("%d workers on %s:%d (metrics merged in %s)", n, settings.host, port, directory)
            if announce is not None:
                announce(port)
        while procs:
            multiprocessing.connection.wait([p.sentinel for p in procs.values()])
            for i, p in list(procs.items()):
                if p.exitcode is None:
                    continue
                del procs[i]
                lost: dict[tuple[str, str], int] = {}
                if p.pid is not None:
                    lost = lost_in_flight(Path(directory), p.pid)
                    mark_process_dead(p.pid, directory)  # type: ignore[no-untyped-call]
                # its requests in flight leave the whole proxy's count now (they were cut with it; 0 after a
                # graceful exit). The count is exact; when each would have ended cannot be known: they drop out
                # the moment the supervisor sees the death, and requests it had not yet started serving (still
                # sending their body) were never counted
                traffic.forget(i)
                if stopping.is_set():
                    continue
                counts.worker_died(lost)
                quick = time.monotonic() - started[i] < CRASH_WINDOW_S
                crashes = crashes + 1 if quick else 0
                what = ", ".join(f"{e}/{r}: {k}" for (e, r), k in sorted(lost.items())) or "none"
                if crashes >= MAX_QUICK_CRASHES:
                    log.error("worker %d exited with %s %d times at start: stopping", i, p.exitcode, crashes)
                    status = 1
                    on_signal(signal.SIGTERM, None)
                    continue
                log.error(
                    "worker %d (pid %s) exited with %s; requests in flight lost (engine/role): %s; restarting it",
                    i, p.pid, p.exitcode, what,
                )  # fmt: skip
                start(i)
    finally:
        stopping.set()
        for p in procs.values():
            p.terminate()
            p.join(10)
        for s, h in previous.items():
            signal.signal(s, h)
        for r in readies.values():
            r.close()
        reserve.close()
        for stop in on_shutdown:
            stop()
        for i, p in procs.items():  # stopped above, or not, when an error ended the supervision early
            if p.exitcode is not None:
                traffic.forget(i)
        if served and on_traffic is not None:
            on_traffic(traffic)  # serve's last words, from the shared file, before the directory goes
        traffic.close()
        counts.close()
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
        os.close(lock)
    return status
