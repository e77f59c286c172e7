"""One worker process of ``serve --workers N`` (spawned by ``proxy.server.workers.supervisor``): its own socket on
the shared port (``SO_REUSEPORT``), its app, uvicorn on it until SIGTERM/SIGINT or its supervisor's death.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette

from proxy.config.settings import Settings
from proxy.server.workers.guard import Server, server_config
from proxy.server.workers.lifetimes import die_with_parent, hold_directory, watch_parent
from proxy.server.workers.role import WorkerRole

#: what a worker writes to its start-up pipe once it serves
READY = b"ready"


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
AppFactory = Callable[..., Starlette]


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
    #: the supervisor's pid: a worker whose parent is no longer this one stops (``proxy.server.workers.lifetimes``)
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
