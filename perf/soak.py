#!/usr/bin/env python
"""Soak benchmark (not a CI test): many streams for a long time with faults injected; does the proxy stay flat?

    .venv/bin/python perf/soak.py [--streams 256] [--duration 600] [--restart-every 60] [--hangup 0.1]
                                  [--tokens 32] [--cadence-ms 100] [--out soak.json]

Every party is its own process, on 127.0.0.1:

- the primary engine: ``python -m fakes.fault_engine`` (a llama.cpp look-alike); **restarted** (SIGKILL, then a
  fresh process on the same port 1 s later) every ``--restart-every`` s: streams in flight break off
  (``upstream_broken``), requests in the gap are refused (``connect_error``);
- a **dead shadow**: every request is mirrored (sample rate 1) to a closed port (the shadow's ``connect_error``);
- the proxy, ``perf/soak.py serve`` = ``build_app`` under uvicorn with the production connection limits
  (``proxy.server.workers.guard.server_options``) plus one extra gauge, ``soak_event_loop_lag_seconds{stat}``: the
  lateness of a 100 ms timer on the proxy's event loop over the last 10 s (median and max);
- the load (this process): ``--streams`` concurrent clients, each sending stream requests back to back over
  keep-alive connections; a fraction ``--hangup`` of them **hang up** after a random number of chunks.

Reported at start (after a 20 s warm-up) and at the end (after the load stopped and drained): the proxy's RSS and
open file descriptors (``/proc/<pid>``), the event-loop lag, every ``enginemeter_requests_total`` counter, the
in-flight gauge, and the client's own tally. "Accounted for": the proxy counted exactly as many primary requests
as the clients sent, and nothing is left in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from proxy.procs.process import free_port

ROOT = Path(__file__).resolve().parent.parent
ALIAS = "soak-model"


# ------------------------------------------------------------------------------------------ the proxy side


def serve(port: int, primary: str, shadow: str) -> None:
    """The proxy under test, plus an event-loop lag probe exported as a gauge."""
    import uvicorn
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    from proxy.config.settings import (
        CollectorSettings,
        EngineSettings,
        MirrorSettings,
        RouteSettings,
        Settings,
        Timeouts,
    )
    from proxy.server.compose import build_app
    from proxy.server.workers.guard import server_options

    lags: collections.deque[tuple[float, float]] = collections.deque(maxlen=1000)

    class LagCollector:
        def collect(self) -> Iterator[GaugeMetricFamily]:
            now = time.monotonic()
            recent = sorted(lag for t, lag in list(lags) if now - t < 10)
            g = GaugeMetricFamily("soak_event_loop_lag_seconds", "100 ms timer lateness, last 10 s", labels=["stat"])
            if recent:
                g.add_metric(["max"], recent[-1])
                g.add_metric(["p50"], recent[len(recent) // 2])
            yield g

    registry = CollectorRegistry()
    registry.register(LagCollector())  # type: ignore[arg-type]
    timeouts = Timeouts(connect=2, read=30)
    settings = Settings(
        engines=(
            EngineSettings(name="primary", url=primary, kind="llamacpp", timeouts=timeouts),
            EngineSettings(name="shadow", url=shadow, kind="llamacpp", timeouts=timeouts),
        ),
        routes=(RouteSettings(models=("*",), primary="primary", shadows=("shadow",), sample_rate=1.0),),
        mirror=MirrorSettings(max_in_flight=64),
        collectors=CollectorSettings(gpu=False),
    )
    app = build_app(settings, registry=registry)

    async def probe_lag() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.1)
            lags.append((time.monotonic(), max(0.0, loop.time() - t - 0.1)))

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            self._lag_task = asyncio.ensure_future(probe_lag())

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, **server_options())
    Server(config).run()


# ------------------------------------------------------------------------------------------- the processes


class Proc:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.argv, self.port, self.log = argv, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_path: str = "/health") -> Proc:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv} exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(f"GET {ready_path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(12).startswith(b"HTTP/1.1"):
                    return self
            time.sleep(0.05)  # start-up poll
        raise RuntimeError(f"{self.argv} not ready in 30 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def proc_stats(pid: int) -> dict[str, Any]:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return {"rss_mib": round(rss_kib / 1024, 1), "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


# ------------------------------------------------------------------------------------------------ the load


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.outcomes: collections.Counter[str] = collections.Counter()


async def scrape(session: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await session.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("enginemeter_requests_total{", "enginemeter_in_flight_requests{", "soak_")):
            name, _, value = line.rpartition(" ")
            if float(value):
                out[name] = float(value)
    return out


def summarize(metrics: dict[str, float]) -> dict[str, Any]:
    """requests_total by role and outcome (engine and model dropped), in flight, lag."""
    import re

    requests: dict[str, float] = collections.defaultdict(float)
    in_flight = 0.0
    lag: dict[str, float] = {}
    for name, v in metrics.items():
        labels = dict(re.findall(r'(\w+)="([^"]*)"', name))
        if name.startswith("enginemeter_requests_total"):
            requests[f"{labels['role']}/{labels['outcome']}"] += v
        elif name.startswith("enginemeter_in_flight_requests"):
            in_flight += v
        elif name.startswith("soak_event_loop_lag_seconds"):
            lag[labels["stat"] + "_ms"] = round(v * 1e3, 1)
    return {"requests_total": dict(sorted(requests.items())), "in_flight": in_flight, "event_loop_lag": lag}


async def client(
    session: httpx.AsyncClient, url: str, tally: Tally, stop: asyncio.Event, hangup: float, rng: random.Random
) -> None:
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "soak"}], "stream": True}
    while not stop.is_set():
        hang_after = rng.randint(1, 20) if rng.random() < hangup else None
        tally.sent += 1
        try:
            async with session.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.outcomes[f"http_{r.status_code}"] += 1
                    await asyncio.sleep(0.2)  # back off while the engine restarts (client pacing)
                    continue
                chunks, last = 0, b""
                async for chunk in r.aiter_raw():
                    chunks += 1
                    last = (last + chunk)[-400:]
                    if hang_after is not None and chunks >= hang_after:
                        break  # hang up mid-stream: leaving the block closes the response's connection
                if hang_after is not None and chunks >= hang_after:
                    tally.outcomes["hung_up"] += 1
                elif b'"error"' in last:
                    tally.outcomes["in_band_error"] += 1
                elif last.endswith(b"data: [DONE]\n\n"):
                    tally.outcomes["ok"] += 1
                else:
                    tally.outcomes["cut_without_error"] += 1
        except (httpx.HTTPError, TimeoutError) as exc:
            tally.outcomes[f"client_error:{type(exc).__name__}"] += 1


async def drive(args: argparse.Namespace, proxy_url: str, proxy_pid: int, engine: Proc) -> dict[str, Any]:
    rng = random.Random(16)
    tally = Tally()
    stop = asyncio.Event()
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "samples": []}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=120, trust_env=False) as session:
        tasks = [
            asyncio.ensure_future(client(session, proxy_url, tally, stop, args.hangup, random.Random(rng.random())))
            for _ in range(args.streams)
        ]
        t0 = time.monotonic()
        await asyncio.sleep(args.warmup)  # warm-up: connections open, pools filled
        report["start"] = {
            "t_s": round(time.monotonic() - t0),
            **proc_stats(proxy_pid),
            **summarize(await scrape(session, proxy_url)),
        }
        print("start", json.dumps(report["start"]), flush=True)
        sent_at_start = tally.sent
        next_restart = time.monotonic() + args.restart_every
        restarts = 0
        end = t0 + args.duration
        while time.monotonic() < end:
            await asyncio.sleep(min(10.0, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_restart and time.monotonic() < end - 5:
                engine.kill()
                await asyncio.sleep(1.0)  # the engine is down for 1 s
                await asyncio.to_thread(engine.start)
                restarts += 1
                next_restart = time.monotonic() + args.restart_every
            sample = {
                "t_s": round(time.monotonic() - t0),
                **proc_stats(proxy_pid),
                **summarize(await scrape(session, proxy_url))["event_loop_lag"],
                "sent": tally.sent,
            }
            report["samples"].append(sample)
            print("sample", json.dumps(sample), flush=True)
        stop.set()
        await asyncio.gather(*tasks)
        # the mirror's copies to the dead shadow end at once; give the last Results a moment to land
        await asyncio.sleep(2.0)
        final = summarize(await scrape(session, proxy_url))
        report["end"] = {"t_s": round(time.monotonic() - t0), **proc_stats(proxy_pid), **final}
    primary_counted = sum(v for k, v in report["end"]["requests_total"].items() if k.startswith("primary/"))
    report["client"] = {
        "sent": tally.sent,
        "sent_after_warmup": tally.sent - sent_at_start,
        "outcomes": dict(tally.outcomes),
    }
    report["engine_restarts"] = restarts
    # what each client outcome should be counted as (the client's tally against the proxy's counters)
    end = report["end"]["requests_total"]
    o = tally.outcomes
    report["client_vs_proxy"] = {
        "ok": [o["ok"], end.get("primary/ok", 0)],
        "hung_up / client_disconnect": [o["hung_up"], end.get("primary/client_disconnect", 0)],
        "in_band_error / upstream_broken+timeout": [
            o["in_band_error"],
            end.get("primary/upstream_broken", 0) + end.get("primary/timeout", 0),
        ],
        "http_502 / connect_error": [o["http_502"], end.get("primary/connect_error", 0)],
    }
    report["accounted_for"] = primary_counted == tally.sent and report["end"]["in_flight"] == 0
    report["flat"] = {
        "rss_mib": [report["start"]["rss_mib"], report["end"]["rss_mib"]],
        "open_fds": [report["start"]["open_fds"], report["end"]["open_fds"]],
        "lag_p50_ms_median_of_samples": statistics.median([s.get("p50_ms", 0.0) for s in report["samples"]] or [0]),
        "lag_max_ms_max_of_samples": max([s.get("max_ms", 0.0) for s in report["samples"]] or [0]),
    }
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="(internal) the proxy under test")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--primary", required=True)
    s.add_argument("--shadow", required=True)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load, warm-up included")
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--restart-every", type=float, default=60.0)
    p.add_argument("--hangup", type=float, default=0.1, help="fraction of requests the client hangs up")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cadence-ms", type=float, default=100.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.cmd == "serve":
        serve(args.port, args.primary, args.shadow)
        return
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    e_port, p_port, dead_port = free_port(), free_port(), free_port()
    engine = Proc(
        [sys.executable, "-m", "fakes.fault_engine", "--port", str(e_port), "--tokens", str(args.tokens),
         "--cadence-ms", str(args.cadence_ms), "--ttft-ms", "50", "--slots", "512"],
        e_port, work / "engine.log",
    )  # fmt: skip
    proxy = Proc(
        [sys.executable, str(Path(__file__).resolve()), "serve", "--port", str(p_port),
         "--primary", f"http://127.0.0.1:{e_port}", "--shadow", f"http://127.0.0.1:{dead_port}"],
        p_port, work / "proxy.log",
    )  # fmt: skip
    engine.start()
    proxy.start()
    try:
        assert proxy.proc is not None
        report = asyncio.run(drive(args, f"http://127.0.0.1:{p_port}", proxy.proc.pid, engine))
    finally:
        proxy.stop()
        engine.stop()
    report["proxy_log_tail"] = proxy.log.read_text(errors="replace")[-3000:]
    out = json.dumps(report, indent=1)
    print(out)
    if args.out:
        args.out.write_text(out + "\n")


if __name__ == "__main__":
    main()
