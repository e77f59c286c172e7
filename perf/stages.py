"""Where a request's time to first byte goes inside the proxy, stage by stage: one stream at a time.

A copy of the tree (``git archive HEAD``, or ``--tree DIR``) gets ``perf/stages/stamps.patch`` applied: a
``perf_counter_ns`` stamp at each stage of a generation request (head parsed, handler, body read, routed, attempt
made, the upstream write, the first upstream read, the task's wake-up, the first write to the client), kept in a
list and dumped on SIGUSR2. The load is one client sending requests one after another (10 ms apart) on a kept-alive
connection: straight to the fake engine, then through the patched proxy; the client stamps its send and its first
``data:`` read with the same clock (CLOCK_MONOTONIC), so every step from the client's send to its first event has a
median. Run on a quiet machine; the figures are those of an idle one (each stage runs on cold caches).

    .venv/bin/python perf/stages.py [--kind openai|auto] [--requests 200] [--ttft-ms 20] [--tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perf.procs import wait_http  # noqa: E402
from proxy.procs.process import free_port  # noqa: E402

STAGES = [
    "received",  # the server parsed the request's head (loopwatch.accepted)
    "handler",  # the app's handler runs (loopwatch.started)
    "gen_start",  # Gateway.generate, after the request object and its id
    "body_read",
    "decided",  # parsed, validated, routed
    "watch",  # the hang-up watcher is made
    "attempt_new",  # the attempt is made (normalized body)
    "pre_sent",  # Attempt.open: the body serialized, headers made
    "pre_write",  # H1Streams.post: a connection in hand, the request's bytes built
    "written",  # transport.write returned
    "first_read",  # the read that held the first event (stamped in the callback)
    "task_woke",  # Attempt.open resumed with it
    "pre_first_write",  # SocketOutput: the head and the first event go to the client
]

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"stream":true,"max_tokens":4}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
    % (
        len(BODY),
        BODY,
    )
)


async def _requests(port: int, n: int) -> list[tuple[int, int]]:
    """``n`` requests one after another: (client send, client's first ``data:`` read) each."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        w.write(REQUEST)
        buf, t1 = b"", 0
        while True:
            d = await asyncio.wait_for(r.read(65536), 10)
            if not d:  # the engine's keep-alive limit: again on a fresh connection
                r, w = await asyncio.open_connection("127.0.0.1", port)
                t0, buf, t1 = time.perf_counter_ns(), b"", 0
                w.write(REQUEST)
                continue
            if not t1 and b"data: " in buf + d:
                t1 = time.perf_counter_ns()
            buf += d
            if b"\r\n\r\n" in buf and buf.split(b"\r\n\r\n", 1)[1].endswith(b"\r\n0\r\n\r\n"):
                break
        out.append((t0, t1))
        await asyncio.sleep(0.01)
    w.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="openai", help="the engine's kind in the proxy's config (auto: probed)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--tree", help="the tree to patch (default: git archive HEAD)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="enginemeter-stages-"))
    tree = tmp / "tree"
    tree.mkdir()
    if args.tree:
        subprocess.run(["cp", "-a", f"{args.tree}/.", str(tree)], check=True)
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    subprocess.run(["git", "apply", str(ROOT / "perf/stages/stamps.patch")], cwd=tree, check=True)
    py = sys.executable
    stamps = tmp / "stamps"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ep = free_port()
        argv = [py, "-m", "fakes.fault_engine", "--port", str(ep), "--tokens", "4", "--cadence-ms", "5"]
        eng = subprocess.Popen([*argv, "--ttft-ms", str(args.ttft_ms)], cwd=tree, stdout=subprocess.DEVNULL)
        procs.append(eng)
        wait_http(ep, "/health", eng)
        pp = free_port()
        conf = tmp / "proxy.yaml"
        kind = "" if args.kind == "auto" else f", kind: {args.kind}"
        conf.write_text(
            f"engines:\n  - {{name: primary, url: 'http://127.0.0.1:{ep}'{kind}}}\nroutes:\n  - {{models: ['*'], primary: primary}}\n"
        )
        px = subprocess.Popen(
            [
                py,
                "-m",
                "proxy.cli",
                "serve",
                "--config",
                str(conf),
                "--listen",
                f"127.0.0.1:{pp}",
                "--log-level",
                "warning",
            ],
            cwd=tree,
            env={**os.environ, "ENGINEMETER_STAGES": str(stamps)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(px)
        wait_http(pp, "/health", px)
        direct = asyncio.run(_requests(ep, args.requests))[10:]
        proxied = asyncio.run(_requests(pp, args.requests))
        px.send_signal(signal.SIGUSR2)
        path = Path(f"{stamps}.{px.pid}")  # the patch renames it into place once written whole
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        reqs: list[dict[str, int]] = []
        for key, t in json.loads(path.read_text()):
            if key == "received":
                reqs.append({})
            if reqs and key not in reqs[-1]:
                reqs[-1][key] = t
        reqs = [r for r in reqs if "gen_start" in r and "pre_first_write" in r]  # generation requests only
        n = min(len(reqs), len(proxied)) - 10  # the first ten warm up
        reqs, proxied = reqs[-n:], proxied[-n:]
        d50 = statistics.median((t1 - t0) / 1e6 for t0, t1 in direct)
        p50 = statistics.median((t1 - t0) / 1e6 for t0, t1 in proxied)
        print(f"kind {args.kind}, {n} requests one at a time, engine TTFT {args.ttft_ms:g} ms, {os.cpu_count()} CPUs")
        print(f"direct TTFT p50 {d50:.3f} ms; through the proxy {p50:.3f} ms: added {p50 - d50:+.3f} ms")
        print("| step | median ms |\n|---|---|")
        rows = [
            [("client_send", t0), *((k, r[k]) for k in STAGES), ("client_first", t1)]
            for (t0, t1), r in zip(proxied, reqs, strict=True)
        ]
        for i in range(1, len(rows[0])):
            vals = [(row[i][1] - row[i - 1][1]) / 1e6 for row in rows]
            print(f"| {rows[0][i - 1][0]} -> {rows[0][i][0]} | {statistics.median(vals):.3f} |")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
