"""``serve --workers N`` (proxy/server/workers/supervisor.py): real processes on a real port, metrics merged over workers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.server.workers.guard import HEADER_TIMEOUT_S, MAX_HEAD_BYTES
from proxy.server.workers.supervisor import default_workers
from tests.helpers import ProcessServer, wait_until

BODY = {"model": "m", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def _requests_per_worker(directory: Path) -> dict[str, float]:
    """ok-requests counted by each worker's own file (counter_<pid>.db), read without the merge."""
    out: dict[str, float] = {}
    for f in directory.glob("counter_*.db"):
        total = 0.0
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(f)):  # type: ignore[no-untyped-call]
            name, _, labels, _ = json.loads(key)
            if name == "enginemeter_requests" and labels.get("outcome") == "ok":
                total += value
        out[f.stem] = total
    return out


def _engine(tokens: int = 4, cadence_ms: float = 1) -> ProcessServer:
    args = ("--tokens", str(tokens), "--cadence-ms", str(cadence_ms), "--ttft-ms", "1")
    return ProcessServer("fakes.fault_engine", *args, ready_path="/health")


def _proxy(engine_url: str, directory: Path, workers: int, *extra: str, admin_key: str = "") -> ProcessServer:
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "ENGINEMETER_ADMIN_KEY": admin_key}
    return ProcessServer(
        "proxy.cli", "serve", "--primary", engine_url, "--listen", "127.0.0.1:{port}", "--workers", str(workers),
        "--log-level", "warning", *extra, ready_path="/health", env=env, startup_timeout=60,
    )  # fmt: skip


def test_one_scrape_counts_every_request_over_the_workers(tmp_path: Path) -> None:
    n = 40
    directory = tmp_path / "metrics"
    with _engine() as engine, _proxy(engine.url, directory, 2) as proxy:
        for _ in range(n):
            # a new connection each time: SO_REUSEPORT spreads connections (by address hash), not requests
            with httpx.Client(base_url=proxy.url, headers={"connection": "close"}) as client:
                r = client.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        # the workers' own files: both served, and together they served every request
        per_worker = _requests_per_worker(directory)
        assert per_worker.pop(f"counter_{proxy.pid}") == 0  # the supervisor's (worker deaths), none here
        assert len(per_worker) == 2, per_worker
        assert all(v > 0 for v in per_worker.values()), per_worker
        assert sum(per_worker.values()) == n
        # one scrape, whichever worker answers, has the exact count; nothing is left in flight
        text = httpx.get(f"{proxy.url}/metrics", headers={"connection": "close"}).text
        ok = [v for labels, v in _samples(text, "enginemeter_requests_total") if labels["outcome"] == "ok"]
        assert sum(ok) == n
        assert sum(v for _, v in _samples(text, "enginemeter_in_flight_requests")) == 0
        assert [v for _, v in _samples(text, "enginemeter_build_info")] == [1.0]


def test_collectors_run_in_one_worker_and_every_scrape_and_health_show_them(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    with _engine() as engine, _proxy(engine.url, directory, 2) as proxy:

        def scrape() -> str:
            return httpx.get(f"{proxy.url}/metrics", headers={"connection": "close"}).text

        # worker 0 polls the engine, then snapshots what its collector exports (once a second)
        wait_until(
            lambda: (
                "enginemeter_engine_up" in (directory / "collectors.prom").read_text()
                if (directory / "collectors.prom").exists()
                else False
            ),
            timeout=30,
            message="worker 0's snapshot",
        )
        for _ in range(12):  # fresh connections: both workers answer some of these
            up = _samples(scrape(), "enginemeter_engine_up")
            assert [v for _, v in up] == [1.0]  # one engine, exported once
            health = httpx.get(f"{proxy.url}/health", headers={"connection": "close"}).json()
            assert len(health["engine_state"]["engines"]) == 1 and "gpu" in health


def test_a_mirror_change_on_one_worker_reaches_every_worker(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    with _engine() as engine, _engine() as shadow:
        with _proxy(engine.url, directory, 2, "--shadow", shadow.url, admin_key="k") as proxy:
            auth = {"authorization": "Bearer k", "connection": "close"}
            r = httpx.post(f"{proxy.url}/admin/mirror", json={"sample_rate": 0.25}, headers=auth)
            assert r.status_code == 200 and r.json()["routes"][0]["sample_rate"] == 0.25

            def everywhere() -> bool:
                rates = {
                    httpx.get(f"{proxy.url}/admin/mirror", headers=auth).json()["routes"][0]["sample_rate"]
                    for _ in range(8)
                }
                return rates == {0.25}

            wait_until(everywhere, timeout=10, message="the new rate on every worker")


def test_default_workers_is_within_one_and_eight() -> None:
    assert 1 <= default_workers() <= 8


# ------------------------------------------------------------------------------ a worker's death, its limits


def worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes (multiprocessing's spawn children; not its resource tracker)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == supervisor and b"spawn_main" in cmdline:
            pids.append(int(d.name))
    return sorted(pids)


def in_flight_of(directory: Path, pid: int) -> float:
    """What worker ``pid``'s own in-flight gauge file says (its requests in progress)."""
    path = directory / f"gauge_livesum_{pid}.db"
    if not path.exists():
        return 0.0
    values = MmapedDict.read_all_values_from_file(str(path))  # type: ignore[no-untyped-call]
    return sum(float(v) for key, v, *_ in values if json.loads(key)[1] == "enginemeter_in_flight_requests")


def scrape_sum(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"connection": "close"}, timeout=10).text
    return sum(v for got, v in _samples(text, name) if all(got.get(k) == x for k, x in labels.items()))


def stream_outcome(url: str) -> str:
    """One stream on a connection of its own: "done" ([DONE] arrived) or "cut"."""
    body = {**BODY, "max_tokens": 400}
    try:
        with httpx.Client(base_url=url, headers={"connection": "close"}, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                data = b"".join(r.iter_raw())
    except httpx.HTTPError:
        return "cut"
    return "done" if data.rstrip().endswith(b"data: [DONE]") else "cut"


def test_a_killed_worker_is_restarted_and_its_requests_in_flight_are_counted(tmp_path: Path) -> None:
    """Issue 20: every restart died (FileNotFoundError) and the supervisor exited; the killed worker's requests
    were never counted. Here: SIGKILL the worker holding the most streams, mid-stream."""
    n = 10
    directory = tmp_path / "metrics"
    with _engine(tokens=400, cadence_ms=20) as engine, _proxy(engine.url, directory, 2) as proxy:
        before = worker_pids(proxy.pid)
        assert len(before) == 2, before
        with ThreadPoolExecutor(n) as pool:
            streams = [pool.submit(stream_outcome, proxy.url) for _ in range(n)]
            wait_until(lambda: sum(in_flight_of(directory, p) for p in before) == n, timeout=20, message="n streams")
            victim = max(before, key=lambda p: in_flight_of(directory, p))
            lost = in_flight_of(directory, victim)
            assert lost >= 1
            os.kill(victim, signal.SIGKILL)

            def replaced() -> bool:
                pids = worker_pids(proxy.pid)
                return len(pids) == 2 and victim not in pids

            # a new worker takes its place, and the proxy serves on: fresh connections land on both workers
            wait_until(replaced, timeout=30, message="a new worker in the killed one's place")
            for _ in range(12):
                r = httpx.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers={"connection": "close"})
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            outcomes = [f.result(timeout=60) for f in streams]
        assert proxy.process.is_running(), proxy.output()[-3000:]
        assert outcomes.count("cut") == lost and outcomes.count("done") == n - lost, outcomes
        wait_until(lambda: scrape_sum(proxy.url, "enginemeter_worker_lost_requests_total", engine="llamacpp", role="primary") == lost)  # fmt: skip
        assert scrape_sum(proxy.url, "enginemeter_worker_restarts_total") == 1
        # every request ended in exactly one count: an outcome, or lost with its worker
        counted = scrape_sum(proxy.url, "enginemeter_requests_total") + lost
        assert counted == n + 12, (counted, n + 12)
        assert scrape_sum(proxy.url, "enginemeter_in_flight_requests") == 0
        assert "restarting it" in proxy.output() and "FileNotFoundError" not in proxy.output()


def _closed_by_server(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_every_worker_applies_the_connection_limits(tmp_path: Path) -> None:
    """Issue 20: under --workers, silent connections stayed open, a head over 64 KiB got 200 (1 MiB did), a
    slowloris head was open after 30 s. 16 connections of each kind: with SO_REUSEPORT spreading them, both workers get some."""
    with _engine() as engine, _proxy(engine.url, tmp_path / "metrics", 2) as proxy:
        host, port = "127.0.0.1", proxy.port
        t0 = time.monotonic()
        silent = [socket.create_connection((host, port)) for _ in range(16)]
        cut: list[float] = []

        def slowloris() -> None:
            with socket.create_connection((host, port)) as s:
                try:
                    for b in b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 1000:
                        s.sendall(bytes([b]))
                        time.sleep(0.5)  # the client's pace (slowloris), not synchronisation
                except OSError:
                    cut.append(time.monotonic() - t0)

        slow = [threading.Thread(target=slowloris) for _ in range(4)]
        for t in slow:
            t.start()
        for _ in range(16):  # a head just over the limit, so that the server has read it all when it answers
            with socket.create_connection((host, port)) as s:
                s.settimeout(20)
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (MAX_HEAD_BYTES + 1024) + b"\r\n\r\n")
                data = _closed_by_server(s)
                assert data.startswith(b"HTTP/1.1 431"), data[:200]
        for s in silent:
            s.settimeout(HEADER_TIMEOUT_S + 15)
            assert _closed_by_server(s) == b""
            s.close()
        closed_after = time.monotonic() - t0
        for t in slow:
            t.join(timeout=HEADER_TIMEOUT_S + 15)
        assert len(cut) == 4 and max(cut) < HEADER_TIMEOUT_S + 8, cut
        assert closed_after < HEADER_TIMEOUT_S + 8, closed_after


# ------------------------------------------------------------------------------ the supervisor's death


def children(parent: int, marker: bytes) -> list[int]:
    """Processes whose parent is ``parent`` and whose command line holds ``marker``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == parent and marker in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def alive(pid: int) -> bool:
    """Running (a zombie, waiting for a new parent to reap it, holds no socket and counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def listening(port: int) -> bool:
    """Whether any socket listens on 127.0.0.1:``port`` (/proc/net/tcp: state 0A)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            return True
    return False


def _serve(engine_url: str, tmp_path: Path, port: int | None = None, workers: int = 2) -> ProcessServer:
    """``serve --workers N`` with its multiprocess directory made by itself, in ``tmp_path`` (TMPDIR)."""
    return ProcessServer(
        "proxy.cli", "serve", "--primary", engine_url, "--listen", "127.0.0.1:{port}", "--workers", str(workers),
        "--log-level", "info", port=port, ready_path="/health", env={"TMPDIR": str(tmp_path)}, startup_timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("next_workers", [2, 1])
def test_a_killed_supervisor_leaves_no_worker_and_its_port_and_directory_to_the_next_serve(
    tmp_path: Path, next_workers: int
) -> None:
    """Issue 35: after ``kill -9`` of the supervisor both workers (and the resource tracker) lived on under PID 1,
    listening with the old configuration; a new ``serve`` on the port failed "address already in use", and
    /tmp/enginemeter-metrics-* stayed behind. The next ``serve``, one process or several, removes it."""
    with _engine() as engine:
        old = _serve(engine.url, tmp_path).start()
        try:
            workers = worker_pids(old.pid)
            family = children(old.pid, b"")  # its workers and multiprocessing's helpers (a resource tracker)
            assert len(workers) == 2 and set(workers) <= set(family), (workers, family)
            (left,) = tmp_path.glob("enginemeter-metrics-*")
            os.kill(old.pid, signal.SIGKILL)
            t0 = time.monotonic()
            wait_until(lambda: not any(alive(p) for p in family), timeout=3, message="no process of it left")
            assert not listening(old.port)
            gone_after = time.monotonic() - t0
            assert left.exists()  # its supervisor could not remove it
            with _serve(engine.url, tmp_path, port=old.port, workers=next_workers) as new:  # the same port
                r = httpx.post(f"{new.url}/v1/chat/completions", json=BODY, headers={"connection": "close"})
                assert r.status_code == 200
                # the next start removed the left-over directory: nothing of the old run holds it
                assert not left.exists()
                assert len(list(tmp_path.glob("enginemeter-metrics-*"))) == (1 if next_workers > 1 else 0)
                assert f"removed {left}: left by a run whose processes are all gone" in new.output()
        finally:
            old.stop()
    assert gone_after < 3
    assert "the supervisor (pid" in old.output() or "Shutting down" in old.output()


def test_a_worker_whose_supervisor_dies_stops_listening_at_once_and_finishes_its_stream(tmp_path: Path) -> None:
    """The port is free for the next ``serve`` within a second or two; a stream in progress is not cut off: the
    orphaned worker drains it (its graceful shutdown), then exits."""
    with _engine(tokens=300, cadence_ms=20) as engine:  # a 6 s stream
        old = _serve(engine.url, tmp_path).start()
        try:
            workers = worker_pids(old.pid)
            with ThreadPoolExecutor(1) as pool:
                stream = pool.submit(stream_outcome, old.url)
                directory = next(tmp_path.glob("enginemeter-metrics-*"))
                wait_until(lambda: sum(in_flight_of(directory, p) for p in workers) == 1, timeout=20)
                os.kill(old.pid, signal.SIGKILL)
                t0 = time.monotonic()
                wait_until(lambda: not listening(old.port), timeout=3, message="nothing listening on the port")
                freed_after = time.monotonic() - t0
                with _serve(engine.url, tmp_path, port=old.port) as new:
                    r = httpx.post(f"{new.url}/v1/chat/completions", json=BODY, headers={"connection": "close"})
                    assert r.status_code == 200
                    assert stream.result(timeout=30) == "done"
                    wait_until(lambda: not any(alive(p) for p in workers), timeout=10, message="the old workers gone")
        finally:
            old.stop()
    assert freed_after < 2


def test_a_second_run_never_wipes_a_metrics_directory_in_use(tmp_path: Path) -> None:
    """``PROMETHEUS_MULTIPROC_DIR`` is wiped at start; a second ``serve`` on it while the first runs waits for
    it (a killed supervisor's workers finishing), then exits 1: it would have wiped the first one's figures."""
    directory = tmp_path / "metrics"
    with _engine() as engine, _proxy(engine.url, directory, 2) as first:
        r = httpx.post(f"{first.url}/v1/chat/completions", json=BODY, headers={"connection": "close"})
        assert r.status_code == 200
        t0 = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "serve", "--primary", engine.url, "--listen", "127.0.0.1:0",
             "--workers", "2", "--shutdown-timeout", "1"],
            env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert second.returncode == 1, second.stderr[-2000:]
        assert "is in use by another enginemeter run" in second.stderr and "waiting up to 6 s" in second.stderr
        assert 5 < time.monotonic() - t0 < 30
        assert scrape_sum(first.url, "enginemeter_requests_total", outcome="ok") == 1  # its figures intact
