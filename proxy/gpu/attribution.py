"""Attribution of GPU processes to engines through ``/proc`` (no psutil: the three reads below are all we need).

The engine's root pids come from its config ``pid``, else its ``pid_file`` (re-read every sample), else, when
the engine's URL host is this machine, the processes holding a listening socket on its port
(``/proc/net/tcp{,6}`` -> socket inode -> ``/proc/*/fd``). A GPU process belongs to the engine whose root is
its nearest ancestor (itself included, ``/proc/<pid>/stat`` ppid chain), so SGLang/vLLM worker children count.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from proxy.config.settings import EngineSettings

PROC = Path("/proc")
#: how often a port-based attribution is looked up again even when its pids are still alive
REFRESH_S = 30.0


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """Socket inodes of TCP sockets in LISTEN state on ``port`` (any address, IPv4 and IPv6)."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(f) < 10 or f[3] != "0A":
                continue
            if int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(f[9]))
    inodes.discard(0)
    return inodes


def pids_holding(inodes: set[int], proc: Path = PROC) -> set[int]:
    """Pids with an open fd on one of the socket ``inodes`` (processes we may not inspect are skipped)."""
    if not inodes:
        return set()
    wanted = {f"socket:[{i}]" for i in inodes}
    found: set[int] = set()
    with os.scandir(proc) as procs:
        for entry in procs:
            if entry.name.isdigit() and _holds(entry.path, wanted):
                found.add(int(entry.name))
    return found


def _holds(pid_dir: str, wanted: set[str]) -> bool:
    try:
        with os.scandir(f"{pid_dir}/fd") as fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) in wanted:
                        return True
                except OSError:
                    continue
    except OSError:
        pass
    return False


def parent_pid(pid: int, proc: Path = PROC) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..." and comm may contain spaces and parentheses
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def alive(pid: int, proc: Path = PROC) -> bool:
    return (proc / str(pid)).exists()


def read_pid_file(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine: loopback, unspecified, or an address we can bind to."""
    if host in ("localhost", "", socket.gethostname()):
        return True
    try:
        addrs = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for a in addrs:
        ip = ipaddress.ip_address(a.split("%", 1)[0])
        if ip.is_loopback or ip.is_unspecified:
            return True
        fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.bind((a, 0))  # only an address of one of our interfaces can be bound
            return True
        except OSError:
            continue
    return False


@dataclass
class _Roots:
    pids: frozenset[int] = frozenset()
    source: str = "none"  # pid | pid_file | port | none
    note: str | None = None
    looked_up: float = 0.0


class Attributor:
    """Maps GPU process pids to engine names. Used from the sampler thread only."""

    def __init__(self, engines: Sequence[EngineSettings], proc: Path = PROC, refresh_s: float = REFRESH_S) -> None:
        self.engines = list(engines)
        self.proc = proc
        self.refresh_s = refresh_s
        self.roots: dict[str, _Roots] = {e.name: _Roots() for e in self.engines}
        self._local: dict[str, bool] = {}
        #: root pid -> the engines it is the root of (several: names that are one server), made by ``refresh``
        self._by_pid: dict[int, tuple[str, ...]] = {}

    def _lookup(self, e: EngineSettings, now: float, scanned: dict[int, frozenset[int]]) -> _Roots:
        if e.pid is not None:
            return _Roots(frozenset({e.pid}), "pid", None if alive(e.pid, self.proc) else "pid not running", now)
        if e.pid_file:
            pid = read_pid_file(e.pid_file)
            if pid is None:
                return _Roots(frozenset(), "pid_file", f"cannot read a pid from {e.pid_file}", now)
            return _Roots(frozenset({pid}), "pid_file", None if alive(pid, self.proc) else "pid not running", now)
        parts = urlsplit(e.url)
        host = parts.hostname or ""
        if e.name not in self._local:
            self._local[e.name] = is_local_host(host)
        if not self._local[e.name]:
            return _Roots(frozenset(), "none", f"{host} is not this host; set pid or pid_file", now)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        pids = scanned.get(port)
        if pids is None:  # one /proc scan per port and refresh, however many engine names share it
            pids = scanned[port] = frozenset(pids_holding(listening_inodes(port, self.proc), self.proc))
        return _Roots(pids, "port", None if pids else f"no local process listens on port {port}", now)

    def refresh(self, now: float | None = None) -> dict[str, _Roots]:
        now = time.monotonic() if now is None else now
        scanned: dict[int, frozenset[int]] = {}
        for e in self.engines:
            r = self.roots[e.name]
            stale = now - r.looked_up >= self.refresh_s or not r.pids or not all(alive(p, self.proc) for p in r.pids)
            if e.pid_file or stale:
                self.roots[e.name] = self._lookup(e, now, scanned)
        by_pid: dict[int, list[str]] = {}
        for name, r in self.roots.items():
            for p in r.pids:
                by_pid.setdefault(p, []).append(name)
        self._by_pid = {p: tuple(names) for p, names in by_pid.items()}
        return self.roots

    def owners(self, pid: int, max_depth: int = 64) -> tuple[str, ...]:
        """The engines whose root pid is ``pid`` or its nearest ancestor, as of the last ``refresh``: several when
        several names are one server (an A/A twin: two names, one URL), each of which then shows that server's
        memory; () when none."""
        by_pid = self._by_pid
        cur: int | None = pid
        for _ in range(max_depth):
            if cur is None or cur <= 0:
                return ()
            if cur in by_pid:
                return by_pid[cur]
            if cur == 1:
                return ()
            cur = parent_pid(cur, self.proc)
        return ()
