"""The overhead bench's processes: the fake engine, llama-server, the proxies, nginx and the floor, each its own
process on 127.0.0.1 (``Procs``), and what the bench reads of them: CPU time, RSS, descendants."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from proxy.procs.process import free_port

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def wait_http(port: int, path: str, proc: subprocess.Popen[bytes] | None, deadline_s: float = 30.0) -> None:
    """Poll GET path until it answers 200 (deadline), failing early if the process died."""
    end = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before serving {path} on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                data = s.recv(4096)
                if data.startswith(b"HTTP/1.1 200") or data.startswith(b"HTTP/1.0 200"):
                    return
                last = data[:80].decode(errors="replace")
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise RuntimeError(f"port {port} did not answer {path} within {deadline_s}s ({last})")


def cpu_s(pids: list[int]) -> float:
    return sum(cpu_split(pids))


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pids`` so far (``/proc/<pid>/stat`` utime, stime)."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11])
            system += int(fields[12])
    return user / CLK_TCK, system / CLK_TCK


def rss_mib(pids: list[int]) -> tuple[float, float]:
    """(current RSS, peak RSS) summed over pids, MiB."""
    cur = peak = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    cur += int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    peak += int(line.split()[1])
    return cur / 1024, peak / 1024


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (``serve --workers N``: the workers and multiprocessing's helper)."""
    out = children(pid)
    for c in list(out):
        out += descendants(c)
    return out


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


NGINX_CONF = """\
worker_processes {workers};
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 100000;
    upstream engine {{
        server 127.0.0.1:{upstream};
        keepalive 1024;
        keepalive_requests 100000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            # llama-server closes its connection after every stream: retry a POST on a kept-alive connection the
            # engine closed, as enginemeter does (else nginx answers 502)
            proxy_next_upstream error timeout non_idempotent;
        }}
    }}
}}
"""


class Procs:
    """Every process the benchmark starts; all stopped (by pid) on exit."""

    def __init__(self, tmp: Path, verbose: bool) -> None:
        self.tmp = tmp
        self.verbose = verbose
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        p = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.procs.append((name, p))
        if self.verbose:
            print(f"  started {name} (pid {p.pid}): {' '.join(argv)}", file=sys.stderr)
        return p

    def engine(
        self, name: str, tokens: int, cadence_ms: float, ttft_ms: float, procs: int = 1, slots: int = 1024
    ) -> tuple[int, subprocess.Popen[bytes]]:
        """The fake engine; ``procs`` > 1: that many processes on one port (SO_REUSEPORT), for loads one
        asyncio process cannot serve."""
        port = free_port()
        argv = [sys.executable, "-m", "fakes.fault_engine", "--port", str(port), "--tokens", str(tokens)]
        # slots enough never to queue a stream, and no more: the proxy polls the engine's /slots every 10 s, and
        # 100,000 of them (as before) made a 6.8 MB answer that held its event loop for tens of ms each poll
        argv += ["--cadence-ms", str(cadence_ms), "--ttft-ms", str(ttft_ms), "--slots", str(slots)]
        if procs > 1:
            argv.append("--reuse-port")
        first = p = self.start(name, argv)
        wait_http(port, "/health", p)
        for i in range(1, procs):
            p = self.start(f"{name}-{i}", argv)
        return port, first

    def llama(
        self, name: str, binary: str, model: str, threads: int, slots: int
    ) -> tuple[int, subprocess.Popen[bytes]]:
        """A real llama-server (``--engine llama``): ``-t threads``, ``-np slots``, 256 context tokens a slot."""
        port = free_port()
        argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
        argv += ["-np", str(slots), "-c", str(256 * slots), "--no-webui", "--threads-http", str(slots + 32)]
        p = self.start(name, argv)
        wait_http(port, "/health", p, deadline_s=120.0)
        return port, p

    def proxy(
        self,
        name: str,
        primary: int,
        shadow: int | None,
        env: dict[str, str],
        cwd: Path = ROOT,
        workers: int | None = None,
        max_connections: int = 0,
        kind: str | None = None,
    ) -> tuple[int, subprocess.Popen[bytes]]:
        port = free_port()
        argv = [sys.executable, "-m", "proxy.cli", "serve"]
        if max_connections or kind:
            # the quick form's pool (512 connections an engine) would queue thousands of streams; a kind other
            # than the probed one (the fake engine answers /props: llama.cpp, a fresh connection per stream)
            conf = self.tmp / f"{name}.yaml"
            extra = (f", max_connections: {max_connections}" if max_connections else "") + (
                f", kind: {kind}" if kind else ""
            )
            conf.write_text(
                f"engines:\n  - {{name: primary, url: 'http://127.0.0.1:{primary}'{extra}}}\n"
                "routes:\n  - {models: ['*'], primary: primary}\n"
            )
            argv += ["--config", str(conf)]
        else:
            argv += ["--primary", f"http://127.0.0.1:{primary}"]
        argv += ["--listen", f"127.0.0.1:{port}", "--log-level", "warning"]
        if workers is not None:
            argv += ["--workers", str(workers)]
        if shadow is not None:
            argv += ["--shadow", f"http://127.0.0.1:{shadow}"]
        p = self.start(name, argv, env, cwd)
        wait_http(port, "/health", p)
        return port, p

    def nginx(self, binary: str, upstream: int, workers: int) -> tuple[int, subprocess.Popen[bytes]]:
        port = free_port()
        d = self.tmp / "nginx"
        d.mkdir(exist_ok=True)
        conf = d / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=d, upstream=upstream, port=port, workers=workers))
        # a binary carried with its libraries (perf/README.md: the scale run) finds them beside itself
        env = {"LD_LIBRARY_PATH": str(Path(binary).parent)} if (Path(binary).parent / "libssl.so.3").exists() else None
        p = self.start("nginx", [binary, "-p", str(d), "-c", str(conf), "-e", str(d / "error.log")], env)
        wait_http(port, "/health", p)
        return port, p

    def floor(self, name: str, upstream: int, parse: bool, procs: int) -> tuple[int, subprocess.Popen[bytes]]:
        """``perf/floor_relay.py``: a uvloop TCP splice (``parse``: plus a stamp and an ``orjson.loads`` per SSE
        data line), the floor of any Python process in the path."""
        port = free_port()
        argv = [sys.executable, str(ROOT / "perf" / "floor_relay.py"), "--listen-port", str(port)]
        argv += ["--upstream-port", str(upstream), "--procs", str(procs)] + (["--parse"] if parse else [])
        p = self.start(name, argv)
        wait_http(port, "/health", p)
        return port, p

    def stop_all(self) -> None:
        for name, p in reversed(self.procs):
            if p.poll() is None:  # nginx stops gracefully on QUIT (TERM is its fast shutdown)
                p.send_signal(signal.SIGQUIT if name == "nginx" else signal.SIGTERM)
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"  {name} (pid {p.pid}) did not stop; killing it", file=sys.stderr)
                p.kill()
                p.wait()
