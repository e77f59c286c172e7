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
- appends to the one comparison log: ``ComparisonLog`` holds an ``flock`` while it rotates and writes a line.

No worker outlives its supervisor, however the supervisor ends (SIGKILL, the OOM killer, a crash): each worker
asks Linux for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, ``die_with_parent``) and watches
``getppid()`` besides (``watch_parent``: every ``PARENT_POLL_S``; the only guard off Linux). Either starts the
worker's graceful shutdown: it stops listening at once (the port is free for the next ``serve``), lets the
requests in progress finish within the shutdown timeout and exits. A worker whose supervisor died before it
could ask exits at start.

The multiprocess directory the supervisor makes (``enginemeter-metrics-*`` in the temporary directory) holds
``owner.lock``, locked shared by the supervisor and every worker for their lives (``hold_directory``); a
directory whose lock nobody holds any longer is left over from a run whose processes are all gone, and the next
``serve`` removes it (``remove_stale_directories``). A directory named by ``PROMETHEUS_MULTIPROC_DIR`` is wiped
at start as before, once no other run holds its lock (``claim_directory`` waits for the workers of an earlier
run to finish, at most ``shutdown_timeout_s`` and a margin; then ``serve`` exits 1: two runs writing one
directory would add up each other's figures).

With ``--workers 1`` none of this runs: the proxy is one process as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
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
#: a worker checks this often whether its supervisor is still its parent (besides the parent-death signal)
PARENT_POLL_S = 0.5
#: the multiprocess directories the supervisor makes, and the lock file in each that says someone still uses it
DIR_PREFIX = "enginemeter-metrics-"
LOCK_FILE = "owner.lock"
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


# ================================================================================================ lifetimes

#: prctl(2) option: the signal this process gets when the thread that created it exits
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``); False where
    that is not available. Linux sends it when the *thread* that started this process ends: the supervisor
    starts every worker from its main thread."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent: int, on_gone: Callable[[], None], interval_s: float = PARENT_POLL_S) -> threading.Thread:
    """A daemon thread that calls ``on_gone`` once ``parent`` is no longer this process's parent (it died: the
    process was re-parented to init or a subreaper)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)  # the polling period, not a synchronisation
        log.warning("the supervisor (pid %d) is gone: this worker stops listening and exits", parent)
        on_gone()

    t = threading.Thread(target=watch, name="enginemeter-parent-watch", daemon=True)
    t.start()
    return t


def hold_directory(directory: str | Path) -> int:
    """A shared lock on ``directory``'s ``owner.lock``, held until this process closes the returned fd (or dies):
    while any process holds it, the directory is in use."""
    fd = os.open(Path(directory) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _lock_free(directory: Path) -> int | None:
    """An exclusive lock on ``directory``'s ``owner.lock`` if nobody holds it (the fd, to close), else None."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return None
    return fd


def make_directory() -> tuple[str, int]:
    """A new multiprocess directory, already locked by this process (the fd): made under another name and renamed,
    so that no other ``serve`` ever sees it unlocked and takes it for a left-over."""
    staging = tempfile.mkdtemp(prefix=".enginemeter-new-")
    fd = hold_directory(staging)
    final = os.path.join(os.path.dirname(staging), DIR_PREFIX + os.path.basename(staging).rsplit("-", 1)[-1])
    os.rename(staging, final)
    return final, fd


def remove_stale_directories(parent: str | Path | None = None) -> list[Path]:
    """Remove the multiprocess directories of earlier runs whose supervisor and workers are all gone (a supervisor
    that was killed could not remove its own); the ones removed. A directory without a lock file (an older
    version's) is left alone: nothing tells whether it is still in use."""
    removed = []
    for d in sorted(Path(parent or tempfile.gettempdir()).glob(DIR_PREFIX + "*")):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid() or not (d / LOCK_FILE).exists():
                continue
        except OSError:
            continue
        fd = _lock_free(d)
        if fd is None:
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)
        log.info("removed %s: left by a run whose processes are all gone", d)
        removed.append(d)
    return removed


def claim_directory(directory: str, wait_s: float) -> int:
    """``PROMETHEUS_MULTIPROC_DIR``: wait until no other run holds it (the workers of a killed supervisor finish
    their requests first, at most ``wait_s``), wipe the figures of the earlier run and hold it shared; the fd.
    Raises ``RuntimeError`` if another run still holds it after ``wait_s``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    said = False
    while (fd := _lock_free(path)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"PROMETHEUS_MULTIPROC_DIR {directory} is in use by another enginemeter run (its processes hold "
                f"{LOCK_FILE}): two runs in one directory add up each other's figures; give each its own"
            )
        if not said:
            log.warning("PROMETHEUS_MULTIPROC_DIR %s is in use by another run's processes: waiting up to %.0f s "
                        "for them to exit", directory, wait_s)  # fmt: skip
            said = True
        time.sleep(0.1)  # the polling period of a lock wait, not a synchronisation
    for f in path.glob("*.db"):  # the figures of an earlier run would add up with ours
        f.unlink()
    fcntl.flock(fd, fcntl.LOCK_SH)  # from exclusive to shared: our workers take it shared too
    return fd


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
    shutdown_timeout_s: float = 30.0
    #: the supervisor's pid: a worker whose parent is no longer this one stops (module docstring)
    supervisor_pid: int = 0


def worker_main(spec: WorkerSpec, ready: multiprocessing.connection.Connection) -> None:
    """A worker's process (spawned): its socket, its app, uvicorn on it until SIGTERM/SIGINT or its supervisor's
    death."""
    # first of all: from here on the supervisor's death reaches this process; if it died before, stop now
    die_with_parent(signal.SIGTERM)
    if spec.supervisor_pid and os.getppid() != spec.supervisor_pid:
        return
    from proxy.server import build_app
    from proxy.server.guard import Server, server_config

    logging.basicConfig(
        level=getattr(logging, spec.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec.index}]: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    hold_directory(spec.directory)  # for this process's life: the directory is in use
    sock = reuseport_socket(spec.host, spec.port)
    role = WorkerRole(spec.index, Path(spec.directory))
    app = build_app(spec.settings, worker=role)

    def started() -> None:
        with contextlib.suppress(OSError):  # the supervisor is gone: its watch stops this worker
            ready.send_bytes(READY)
        ready.close()

    wrapped = role.wrap(app, app.state.gateway.mirror, on_started=started)
    # the single-process serve's configuration: connection limits, shutdown timeout (proxy/server/guard.py)
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
        from proxy.server.metrics import PREFIX, WORKER_LOST_HELP, WORKER_RESTARTS_HELP

        for (engine, role), n in lost.items():
            self.add(f"{PREFIX}_worker_lost_requests", WORKER_LOST_HELP, {"engine": engine, "role": role}, n)
        self.add(f"{PREFIX}_worker_restarts", WORKER_RESTARTS_HELP, {}, 1)

    def close(self) -> None:
        self._file.close()  # type: ignore[no-untyped-call]


def serve_workers(
    settings: Settings,
    n: int,
    *,
    log_level: str = "info",
    shutdown_timeout_s: float = 30.0,
    on_shutdown: Sequence[Callable[[], None]] = (),
    announce: Callable[[int], None] | None = None,
) -> int:
    """Run ``n`` workers on ``settings.host:settings.port`` until SIGTERM/SIGINT; returns the exit status.

    ``announce`` gets the port once every worker has started (``settings.port`` 0 picks one); ``on_shutdown`` runs
    at the end."""
    from prometheus_client.multiprocess import mark_process_dead

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
    crashes = 0

    def start(i: int) -> None:
        spec = WorkerSpec(settings, i, settings.host, port, directory, log_level, shutdown_timeout_s, os.getpid())
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
        counts.close()
        for stop in on_shutdown:
            stop()
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
        os.close(lock)
    return status
