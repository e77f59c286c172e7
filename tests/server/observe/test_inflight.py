"""The traffic profile (proxy/server/observe/inflight.py) counts the whole proxy's requests in flight, under ``serve --workers
N`` too: the workers share the count, so a client holding 12 streams through 3 workers is recorded at 9-16, not at
each worker's share of them (the bug found on a GPU run: 64 in flight through 8 workers recorded as "9-16")."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.levels import LEVELS, representative
from proxy.server.observe.inflight import MAP_BYTES, SLOTS, TRAFFIC_FILE, TrafficProfile
from tests.helpers import ProcessServer, wait_until

# ------------------------------------------------------------------------------ two workers on one file


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _counter() -> Counter:
    return Counter("enginemeter_traffic_seconds", "h", ("level",), registry=CollectorRegistry())


def _counted(c: Counter) -> dict[str, float]:
    return {name: c.labels(name)._value.get() for name, _, _ in LEVELS}


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Clock, TrafficProfile, TrafficProfile, Counter, Counter]]:
    clock = Clock()
    ca, cb = _counter(), _counter()
    a = TrafficProfile(ca, clock, shared=tmp_path / TRAFFIC_FILE, slot=0)
    b = TrafficProfile(cb, clock, shared=tmp_path / TRAFFIC_FILE, slot=1)
    yield clock, a, b, ca, cb
    a.close()
    b.close()


def test_two_workers_on_one_file_count_the_sum_of_their_requests(
    two: tuple[Clock, TrafficProfile, TrafficProfile, Counter, Counter],
) -> None:
    clock, a, b, ca, cb = two
    for t, p in ((101, a), (103, b), (104, a), (108, b)):  # in flight: 1 (a), 2 (b), 3 (a), 4 (b)
        clock.t = t
        p.enter()
    clock.t = 110
    ha, hb = a.health()["traffic"], b.health()["traffic"]
    # the level is both workers' requests together: 4 in flight, 6 s at 3-4 (each alone never had more than 2)
    expected = {"0": 1.0, "1": 2.0, "2": 1.0, "3-4": 6.0}
    assert ha["in_flight"] == hb["in_flight"] == 4
    assert ha["observed_s"] == 10.0 and ha["busy_s"] == 9.0 and ha["idle"] == 0.1 and ha["per"] == "proxy"
    assert ha["busy_shares"] == {k: round(v / 9, 4) for k, v in expected.items() if k != "0"}
    assert hb == ha  # every worker answers the same
    # each process counted the ticks it made: their counters add up to the whole proxy's seconds at each level
    total = {k: _counted(ca)[k] + _counted(cb)[k] for k, _, _ in LEVELS}
    assert total == {k: expected.get(k, 0.0) for k, _, _ in LEVELS}
    assert _counted(ca)["1"] == 0 and _counted(cb)["1"] == 2.0  # b ended the second at level 1
    for t, p in ((111, a), (112, b), (113, a), (115, b)):
        clock.t = t
        p.leave()
    clock.t = 120
    h = a.health()["traffic"]
    # 4 then 3 in flight (1 s each at 3-4), 2 (1 s), 1 (2 s), then idle
    assert h["in_flight"] == 0 and h["observed_s"] == 20.0 and h["busy_s"] == 14.0
    assert h["busy_shares"] == {"1": round(4 / 14, 4), "2": round(2 / 14, 4), "3-4": round(8 / 14, 4)}


def test_a_dead_workers_requests_leave_the_count(
    two: tuple[Clock, TrafficProfile, TrafficProfile, Counter, Counter], tmp_path: Path
) -> None:
    """The supervisor's view of the file (no counter: its ticks go to ``record``) takes a dead worker's own count
    off the total, after counting the time up to then."""
    clock, a, b, _, _ = two
    recorded: list[tuple[str, float]] = []
    supervisor = TrafficProfile(clock=clock, shared=tmp_path / TRAFFIC_FILE, record=lambda *x: recorded.append(x))
    a.enter()
    a.enter()
    b.enter()
    clock.t = 105
    assert supervisor.forget(0) == 2  # worker 0 died with its 2 requests
    assert recorded == [("3-4", 5.0)]
    assert a.health()["traffic"]["in_flight"] == 1
    assert supervisor.forget(0) == 0  # counted once
    clock.t = 107
    b.leave()
    clock.t = 108
    h = supervisor.health()["traffic"]
    assert h["in_flight"] == 0 and h["busy_shares"] == {"1": round(2 / 7, 4), "3-4": round(5 / 7, 4)}
    # a worker restarted in the dead one's place joins the count as it is: no reset
    again = TrafficProfile(_counter(), clock, shared=tmp_path / TRAFFIC_FILE, slot=0)
    assert again.health()["traffic"]["observed_s"] == 8.0
    again.close()
    supervisor.close()


def test_the_first_opener_lays_the_file_out_and_a_foreign_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / TRAFFIC_FILE
    path.write_bytes(b"not ours")
    clock = Clock(50.0)
    p = TrafficProfile(clock=clock, shared=path, slot=SLOTS + 3)  # a slot beyond the file's: the total only
    assert path.stat().st_size == MAP_BYTES
    clock.t = 52
    p.enter()
    clock.t = 53
    h = p.health()["traffic"]
    assert h["in_flight"] == 1 and h["observed_s"] == 3.0 and h["busy_shares"] == {"1": 1.0}
    p.close()


def test_one_process_keeps_its_own_count() -> None:
    clock = Clock()
    c = _counter()
    p = TrafficProfile(c, clock)
    clock.t = 102
    p.enter()
    clock.t = 103
    h = p.health()["traffic"]
    assert h["per"] == "process" and h["in_flight"] == 1 and h["busy_shares"] == {"1": 1.0}
    assert _counted(c)["0"] == 2.0 and _counted(c)["1"] == 1.0


# ------------------------------------------------------------------------------ serve --workers, real processes

#: streams held open through the proxy, spread over the workers: level 9-16
K = 12
WORKERS = 3
BODY = {"model": "m", "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
TRAFFIC_LINE = re.compile(r"to weigh a bench's answer by it: --traffic (\S+)")  # scripts/gpu/live.py's


def _engine() -> ProcessServer:
    # one token, then nothing until the client leaves: a stream held open as long as the test holds its socket
    args = ("--tokens", "64", "--cadence-ms", "1", "--ttft-ms", "1", "--fault", "stall_after=1")
    return ProcessServer("fakes.fault_engine", *args, ready_path="/health")


def _proxy(engine_url: str, directory: Path) -> ProcessServer:
    return ProcessServer(
        "proxy.cli", "serve", "--primary", engine_url, "--listen", "127.0.0.1:{port}", "--workers", str(WORKERS),
        "--log-level", "info", ready_path="/health", env={"PROMETHEUS_MULTIPROC_DIR": str(directory)},
        startup_timeout=60,
    )  # fmt: skip


def _open_stream(port: int) -> socket.socket:
    """A streaming request on a connection of its own (SO_REUSEPORT spreads connections over the workers)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps(BODY).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"  # fmt: skip
    s.sendall(head.encode() + body)
    return s


def _get(url: str, path: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", headers={"connection": "close"}, timeout=10)


def _traffic(url: str) -> dict[str, Any]:
    doc = _get(url, "/health").json()["traffic"]
    assert isinstance(doc, dict)
    return doc


def _scrape(url: str, name: str, label: str | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(_get(url, "/metrics").text):
        for s in f.samples:
            if s.name == name:
                key = s.labels.get(label, "") if label else ""
                out[key] = out.get(key, 0.0) + s.value
    return out


def _in_flight_per_worker(directory: Path) -> dict[int, float]:
    """Each worker's own ``enginemeter_in_flight_requests`` file (its attempts in progress), without the merge."""
    out = {}
    for f in directory.glob("gauge_livesum_*.db"):
        values = MmapedDict.read_all_values_from_file(str(f))  # type: ignore[no-untyped-call]
        n = sum(float(v) for key, v, *_ in values if json.loads(key)[1] == "enginemeter_in_flight_requests")
        out[int(f.stem.rsplit("_", 1)[1])] = n
    return out


def _listeners(supervisor: int, port: int) -> int:
    """How many of the supervisor's child processes listen on ``port`` (its live workers, once they serve)."""
    inodes = {line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port}  # fmt: skip
    n = 0
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != supervisor:
                continue
            fds = {os.readlink(f) for f in (d / "fd").iterdir()}
        except (OSError, IndexError, ValueError):
            continue
        n += any(f"socket:[{i}]" in fds for i in inodes)
    return n


def _hold(stack: ExitStack, port: int, k: int) -> list[socket.socket]:
    return [stack.enter_context(_open_stream(port)) for _ in range(k)]


def _release(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()  # the client leaves: the proxy cancels its attempt, the request leaves the count


def _wait_in_flight(url: str, n: int, what: str, timeout: float = 30) -> None:
    wait_until(lambda: _traffic(url)["in_flight"] == n, timeout=timeout, message=what)


def test_serve_workers_records_the_whole_proxys_requests_in_flight(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    with ExitStack() as stack:
        engine = stack.enter_context(_engine())
        t_launch = time.monotonic()
        proxy = stack.enter_context(_proxy(engine.url, directory))
        t_ready = time.monotonic()
        # every worker listening before the streams are opened, so that they spread over all of them
        wait_until(lambda: _listeners(proxy.pid, proxy.port) == WORKERS, timeout=30, message="every worker")
        t_start = time.monotonic()
        with ExitStack() as streams:
            socks = _hold(streams, proxy.port, K)

            def all_in_flight() -> bool:
                return _scrape(proxy.url, "enginemeter_in_flight_requests").get("", 0) == K

            wait_until(all_in_flight, timeout=30, message=f"{K} streams in flight over the workers")
            t_all = time.monotonic()
            per_worker = _in_flight_per_worker(directory)
            # the streams are spread: no worker alone holds all K (a worker counting its own would never see K, nor
            # their time together)
            assert sum(per_worker.values()) == K and max(per_worker.values()) < K, per_worker
            assert _traffic(proxy.url)["in_flight"] == K  # whichever worker answers: the whole proxy's count
            time.sleep(1.0)  # the traffic's shape: a second with K in flight, not a synchronisation
            t_release = time.monotonic()
            _release(socks)
        _wait_in_flight(proxy.url, 0, "every stream ended")
        t_idle = time.monotonic()
        t_h0 = time.monotonic()
        health = _traffic(proxy.url)
        seconds = _scrape(proxy.url, "enginemeter_traffic_seconds_total", "level")
        t_h1 = time.monotonic()
        assert health["per"] == "proxy" and health["in_flight"] == 0
        shares = health["busy_shares"]
        assert max(shares, key=lambda level: shares[level]) == "9-16", shares  # where the test held its K streams
        # time.monotonic() is one clock for every process: the proxy's time at 9-16 holds the test's second at K
        assert seconds["9-16"] >= t_release - t_all - 1e-3, seconds
        # the merged counter is the proxy's own seconds, not the workers' summed (N times as many): busy only while
        # the test held streams...
        busy = sum(v for level, v in seconds.items() if level != "0")
        assert t_release - t_all <= busy <= t_idle - t_start + 1e-3, (busy, t_idle - t_start)
        # ...and in all no more than the proxy has been up (its last tick: the /health just made)
        total = sum(seconds.values())
        assert t_h0 - t_ready <= total <= t_h1 - t_launch, (total, t_h0 - t_ready, t_h1 - t_launch)
        assert abs(health["observed_s"] - total) <= 0.06, (health, total)
        proxy.stop()
        out = proxy.output()
    # serve's last words, from the supervisor: the whole proxy's profile, as scripts/gpu/live.py reads it
    lines = [line for line in out.splitlines() if line.strip()]
    assert "traffic served:" in lines[-1], out[-3000:]
    (spec,) = TRAFFIC_LINE.findall(out)
    top = max(float(c) for c in re.findall(r"c([\d.]+)=\d+", spec))
    assert top == representative("9-16") == 12, spec


def test_a_dead_workers_requests_in_flight_leave_the_proxys_count(tmp_path: Path) -> None:
    """A worker SIGKILLed with streams in flight: the supervisor takes exactly its requests off the whole proxy's
    count (else they would be counted in flight for ever), and the worker started in its place keeps the count."""
    directory = tmp_path / "metrics"
    with ExitStack() as stack:
        engine = stack.enter_context(_engine())
        proxy = stack.enter_context(_proxy(engine.url, directory))
        wait_until(lambda: _listeners(proxy.pid, proxy.port) == WORKERS, timeout=30, message="every worker")
        with ExitStack() as streams:
            socks = _hold(streams, proxy.port, K)
            _wait_in_flight(proxy.url, K, f"{K} streams in flight")
            wait_until(lambda: sum(_in_flight_per_worker(directory).values()) == K, timeout=30)
            per_worker = _in_flight_per_worker(directory)
            victim = max(per_worker, key=lambda pid: per_worker[pid])
            lost = round(per_worker[victim])
            assert 1 <= lost < K, per_worker
            os.kill(victim, signal.SIGKILL)
            _wait_in_flight(proxy.url, K - lost, "the dead worker's requests off the count")
            wait_until(lambda: _listeners(proxy.pid, proxy.port) == WORKERS, timeout=30, message="a new worker")
            # fresh connections, some to the new worker (it opened the shared file as it was): the survivors' count
            for _ in range(4 * WORKERS):
                assert _traffic(proxy.url)["in_flight"] == K - lost
            _release(socks)
        _wait_in_flight(proxy.url, 0, "every stream ended")
