"""``enginemeter serve --workers N``: N processes, each its own event loop, behind one port.

The supervisor (the ``serve`` process) reserves the port, sets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory
unless the environment names one), starts N workers with multiprocessing's ``spawn`` (fresh interpreters, so
the variable is set before any of them imports prometheus_client), restarts a worker that dies, forwards
SIGTERM/SIGINT (a worker still running ``KILL_MARGIN_S`` after the shutdown timeout is killed: none outlives a
stopped ``serve``), and removes the directory it made when the last worker is gone.

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
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import mark_process_dead

from proxy.config.settings import Settings
from proxy.server.observe.inflight import TRAFFIC_FILE, TrafficProfile
from proxy.server.record.families import HELP, PREFIX
from proxy.server.record.metricfiles import PwriteDict
from proxy.server.workers.lifetimes import claim_directory, make_directory, remove_stale_directories
from proxy.server.workers.worker import READY, AppFactory, WorkerSpec, reuseport_socket, worker_main

log = logging.getLogger("enginemeter.workers")

#: a worker that dies this soon after its start, this many times in a row, stops the whole server
CRASH_WINDOW_S = 5.0
MAX_QUICK_CRASHES = 3
#: after SIGTERM/SIGINT a worker has the shutdown timeout and this much more to exit; then it is killed
KILL_MARGIN_S = 2.0
#: how often the supervision loop wakes while nothing happens (a signal must not wait for a worker's exit)
SUPERVISE_TICK_S = 0.5


def default_workers() -> int:
    """Half the CPUs this process may run on (the engines, and the clients on a test box, need the rest), 1 to 8.

    One worker relays ~8,000 chunks/s on one core (docs/performance.md, the 16-core run); 8 cover a 16-core host."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def lost_in_flight(directory: Path, pid: int) -> dict[tuple[str, str], int]:
    """What a dead worker's ``enginemeter_in_flight_requests`` said at its death, by (engine, role): read from its
    multiprocess file before ``mark_process_dead`` removes it."""
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
        self._file = PwriteDict(str(directory / f"counter_{os.getpid()}.db"))
        self._totals: dict[str, float] = {}

    def add(self, metric: str, help_text: str, labels: dict[str, str], n: float) -> None:
        key = mmap_key(metric, f"{metric}_total", list(labels), list(labels.values()), help_text)
        self._totals[key] = self._totals.get(key, 0.0) + n
        self._file.write_value(key, self._totals[key], time.time())

    def worker_died(self, lost: dict[tuple[str, str], int]) -> None:
        for (engine, role), n in lost.items():
            self.add(
                f"{PREFIX}_worker_lost_requests", HELP["worker_lost_requests"], {"engine": engine, "role": role}, n
            )
        self.add(f"{PREFIX}_worker_restarts", HELP["worker_restarts"], {}, 1)

    def close(self) -> None:
        self._file.close()


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

    ``app_factory`` builds each worker's app (``proxy.server.compose.build_app``); ``announce`` gets the port once
    every worker has started (``settings.port`` 0 picks one); ``on_shutdown`` runs at the end; ``on_traffic``
    then gets the whole proxy's traffic profile, if every worker had started."""
    remove_stale_directories()
    claimed = metrics_directory(shutdown_timeout_s)
    if claimed is None:
        for stop in on_shutdown:
            stop()
        return 1
    directory, lock, made_dir = claimed
    # bound, never listening: holds the port (port 0 picks one) without taking connections
    reserve = reuseport_socket(settings.host, settings.port, listen=False)
    port = int(reserve.getsockname()[1])
    sup = Supervisor(
        WorkerSpec(settings, 0, settings.host, port, directory, log_level, shutdown_timeout_s, app_factory, os.getpid())
    )
    served = False
    previous = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(n):
            sup.start(i)
        up = [sup.wait_ready(i) for i in range(n)]
        if all(up) and not sup.stopping.is_set():
            served = True
            log.info("%d workers on %s:%d (metrics merged in %s)", n, settings.host, port, directory)
            if announce is not None:
                announce(port)
        sup.supervise()
    finally:
        sup.stop_workers()
        for s, h in previous.items():
            signal.signal(s, h)
        sup.close_pipes()
        reserve.close()
        for stop in on_shutdown:
            stop()
        sup.forget_stopped()
        if served and on_traffic is not None:
            on_traffic(sup.traffic)  # serve's last words, from the shared file, before the directory goes
        sup.traffic.close()
        sup.counts.close()
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
        os.close(lock)
    return sup.status


def metrics_directory(wait_s: float) -> tuple[str, int, str | None] | None:
    """The multiprocess directory, its owner lock and the directory to remove at the end (None: the environment
    named it): ``PROMETHEUS_MULTIPROC_DIR`` claimed (waiting up to ``wait_s`` + 5 s for an earlier run's
    processes; None when they stay), else a fresh one, set in the environment for the workers."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        try:
            return directory, claim_directory(directory, wait_s + 5), None
        except RuntimeError as exc:
            log.error("%s", exc)
            return None
    directory, lock = make_directory()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    return directory, lock, directory


class Supervisor:
    """The workers of one ``serve_workers`` run: each started from ``spec`` (its index set), waited for, watched,
    restarted when it dies, and stopped."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.ctx = multiprocessing.get_context("spawn")
        self.stopping = threading.Event()
        #: when the workers told to stop are killed (monotonic; None until told)
        self.kill_at: float | None = None
        self.procs: dict[int, BaseProcess] = {}
        self.started: dict[int, float] = {}
        #: each worker's start-up pipe (the reading end): the worker writes READY once it serves. Not a
        #: multiprocessing Event: its set() waits for every waiter to wake, so a supervisor killed while waiting
        #: left a starting worker blocked for ever, its event loop with it (a parent-death signal could not end it)
        self.readies: dict[int, multiprocessing.connection.Connection] = {}
        directory = Path(spec.directory)
        self.counts = SupervisorCounts(directory)
        # the whole proxy's requests in flight (proxy.server.observe.inflight): an earlier run's file is not this
        # run's count (claim_directory wipes *.db only); laid out afresh before any worker opens it
        (directory / TRAFFIC_FILE).unlink(missing_ok=True)
        self.traffic = TrafficProfile(
            shared=directory / TRAFFIC_FILE,
            # the supervisor's own ticks (at a worker's death, at the end) go to its counter file, so the merged
            # enginemeter_traffic_seconds_total stays the sum of every tick
            record=lambda level, dt: self.counts.add(
                f"{PREFIX}_traffic_seconds", HELP["traffic_seconds"], {"level": level}, dt
            ),
        )
        #: quick deaths in a row (``CRASH_WINDOW_S``)
        self.crashes = 0
        self.status = 0

    def start(self, i: int) -> None:
        spec = dataclasses.replace(self.spec, index=i)
        reader, writer = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=worker_main, args=(spec, writer), name=f"enginemeter-worker-{i}", daemon=False)
        p.start()
        writer.close()  # the child has its own copy: the pipe ends (EOF) when the child does
        if i in self.readies:
            self.readies[i].close()
        self.readies[i] = reader
        self.procs[i], self.started[i] = p, time.monotonic()

    def wait_ready(self, i: int) -> bool:
        """Until worker ``i`` serves (True), exits or the supervisor is told to stop (False)."""
        while self.procs[i].exitcode is None and not self.stopping.is_set():
            if self.readies[i].poll(0.1):
                try:
                    return self.readies[i].recv_bytes() == READY
                except (EOFError, OSError):
                    return False
        return False

    def on_signal(self, signum: int, frame: object) -> None:
        self.stopping.set()
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.spec.shutdown_timeout_s + KILL_MARGIN_S
        for p in self.procs.values():
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def supervise(self) -> None:
        """Until every worker has exited: each one that dies is counted and restarted (module docstring). Told to
        stop, the workers have the shutdown timeout (and ``KILL_MARGIN_S``) to exit; then they are killed."""
        while self.procs:
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                self.kill_left("did not finish within the shutdown timeout")
            multiprocessing.connection.wait([p.sentinel for p in self.procs.values()], SUPERVISE_TICK_S)
            for i, p in list(self.procs.items()):
                if p.exitcode is not None:
                    del self.procs[i]
                    self.exited(i, p)

    def exited(self, i: int, p: BaseProcess) -> None:
        directory = self.spec.directory
        lost: dict[tuple[str, str], int] = {}
        if p.pid is not None:
            lost = lost_in_flight(Path(directory), p.pid)
            mark_process_dead(p.pid, directory)  # type: ignore[no-untyped-call]
        # its requests in flight leave the whole proxy's count now (they were cut with it; 0 after a graceful
        # exit). The count is exact; when each would have ended cannot be known: they drop out the moment the
        # supervisor sees the death, and requests it had not yet started serving (still sending their body) were
        # never counted
        self.traffic.forget(i)
        if self.stopping.is_set():
            return
        self.counts.worker_died(lost)
        quick = time.monotonic() - self.started[i] < CRASH_WINDOW_S
        self.crashes = self.crashes + 1 if quick else 0
        what = ", ".join(f"{e}/{r}: {k}" for (e, r), k in sorted(lost.items())) or "none"
        if self.crashes >= MAX_QUICK_CRASHES:
            log.error("worker %d exited with %s %d times at start: stopping", i, p.exitcode, self.crashes)
            self.status = 1
            self.on_signal(signal.SIGTERM, None)
            return
        log.error(
            "worker %d (pid %s) exited with %s; requests in flight lost (engine/role): %s; restarting it",
            i,
            p.pid,
            p.exitcode,
            what,
        )
        self.start(i)

    def stop_workers(self) -> None:
        self.stopping.set()
        for p in self.procs.values():
            p.terminate()
        deadline = time.monotonic() + self.spec.shutdown_timeout_s + KILL_MARGIN_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill_left("did not stop within the shutdown timeout")

    def kill_left(self, why: str) -> None:
        """SIGKILL every worker still running (and wait for it): a worker never outlives a stopped ``serve``."""
        for i, p in self.procs.items():
            if p.exitcode is None and p.pid is not None:
                log.warning("worker %d (pid %d) %s: killing it", i, p.pid, why)
                p.kill()
                p.join(5)

    def close_pipes(self) -> None:
        for r in self.readies.values():
            r.close()

    def forget_stopped(self) -> None:
        """Take the workers stopped at the end off the traffic count (all of them, unless an error ended the
        supervision early and one did not stop)."""
        for i, p in self.procs.items():
            if p.exitcode is not None:
                self.traffic.forget(i)
