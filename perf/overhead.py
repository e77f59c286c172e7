#!/usr/bin/env python
"""Proxy overhead benchmark: what enginemeter adds to TTFT and to inter-chunk gaps, against nginx.

    .venv/bin/python perf/overhead.py [--streams 256,32] [--tokens 64] [--cadence-ms 20] [--ttft-ms 50]
                                       [--rounds 8] [--mirror off|fast|slow|dead|all] [--nginx auto|off]

Every party is its own process, all on 127.0.0.1:

- a fake engine with a fixed chunk cadence (``fakes.fault_engine``, a pure-asyncio llama.cpp look-alike);
- the proxy (``python -m proxy.cli serve --primary URL``), plus one more proxy per mirror mode
  (``--shadow URL``: "fast" = a second fake engine with the same cadence, "slow" = one 10x slower,
  "dead" = a closed port);
- nginx from Debian (``proxy_buffering off``, HTTP/1.1 keep-alive upstream) when installed;
- a load generator (``perf/loadgen.py``, started as ``--role loadgen``): asyncio + raw sockets, HTTP/1.1 keep-alive, timing on the
  client side with ``perf_counter_ns`` at the read that completed each SSE event.

Rounds are interleaved (direct, proxy, nginx, mirror..., then the next round starts one target later), so
drift and the noise of a shared machine hit every target alike. Each round starts N streams at once (a
batched engine emits a chunk for every slot at the same step, so bursts are the realistic case) on warm
keep-alive connections, and waits for all of them to finish.

"Added" figures are the target's percentile minus the direct percentile over all rounds pooled; the spread
is the range of the same difference taken round by round (round r of the target vs round r of direct).
CPU is the target's utime+stime (``/proc/<pid>/stat``, nginx: master + workers) accumulated over its own
rounds, per 1,000 chunks the client received through it.

The parts: ``perf/loadgen.py`` (the load generator), ``perf/procs.py`` (the processes), ``perf/rounds.py`` (the
rounds and their figures), ``perf/tables.py`` (what is printed); this file parses the options and runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perf.loadgen import serve_rounds
from perf.procs import ROOT, Procs, children, descendants
from perf.rounds import MS, Driver, Target, pct, pooled, rotations, summarize
from perf.tables import account_delta, own_account, print_table, shadow_seen
from proxy.procs.process import free_port


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--streams", default="256", help="concurrent streams; a comma list runs each (e.g. 256,32)")
    ap.add_argument("--tokens", type=int, default=64, help="token chunks per stream")
    ap.add_argument("--cadence-ms", type=float, default=20.0, help="fake engine's gap between chunks")
    ap.add_argument("--ttft-ms", type=float, default=50.0, help="fake engine's time to first token")
    ap.add_argument(
        "--engine",
        choices=["fake", "llama"],
        default="fake",
        help="fake: fakes.fault_engine (fixed cadence); llama: a real llama-server ($LLAMA_SERVER_BIN) on the"
        " generated tiny model (proxy.embedded.make_model); --cadence-ms/--ttft-ms then only size the rounds",
    )
    ap.add_argument("--llama-threads", type=int, default=1, help="llama-server -t")
    ap.add_argument("--llama-slots", type=int, default=0, help="llama-server -np (default: the largest --streams)")
    ap.add_argument("--rounds", type=int, default=8, help="measured rounds per target (plus one warm-up)")
    ap.add_argument(
        "--ramp-ms", type=float, default=0.0, help="spread stream starts over this many ms (0: all at once)"
    )
    ap.add_argument(
        "--arrival",
        choices=["steady", "burst"],
        default="steady",
        help="steady: N streams always in flight, starts spread evenly; burst: N streams start at once",
    )
    ap.add_argument("--duration-s", type=float, default=0.0, help="steady round length (default: 2 stream lengths)")
    ap.add_argument("--mirror", default="off", help="off | fast | slow | dead | all | a comma list")
    ap.add_argument("--nginx", choices=["auto", "off"], default="auto")
    ap.add_argument("--nginx-bin", help="the nginx binary (default: nginx on PATH, /usr/sbin/nginx)")
    ap.add_argument("--nginx-workers", type=int, default=1, help="1 = one event loop, like the proxy")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also targets floor and floor+parse (perf/floor_relay.py: a bare uvloop TCP splice, and the same with"
        " a stamp and a JSON parse per SSE data line): what any Python process in the path costs, with as many"
        " processes as the largest --proxy-workers",
    )
    ap.add_argument("--proxy-env", action="append", default=[], help="KEY=VALUE for the proxy processes")
    ap.add_argument(
        "--baseline-tree",
        help="another checkout of the repo (e.g. `git archive <commit> | tar -x -C DIR`): its proxy runs as"
        " target `proxy@base`, interleaved with the others, for a before/after in the same rounds; it runs as the"
        " first --engine-kind",
    )
    ap.add_argument(
        "--baseline-name",
        default="proxy@base",
        help="the baseline tree's target name (e.g. a ceiling: a tree patched by perf/ceilings/)",
    )
    ap.add_argument(
        "--render", metavar="JSON", help="print the tables of a run saved with --json again (its own options) and exit"
    )
    ap.add_argument("--baseline-workers", type=int, default=None, help="serve --workers for the baseline tree")
    ap.add_argument(
        "--proxy-workers",
        default="1",
        help="serve --workers for the proxy; a comma list runs one proxy target per count (proxy-wN)",
    )
    ap.add_argument("--max-connections", type=int, default=0, help="the proxy's pool per engine (0: the default)")
    ap.add_argument(
        "--engine-kind",
        default="auto",
        help="the engine's kind in the proxy's config (auto: probed; the fake engine looks like llama.cpp, so the"
        " proxy opens a connection per stream). A comma list runs one proxy target per kind (proxy-KIND): openai"
        " keeps its upstream connections alive, as for SGLang and vLLM, and as the bench's nginx does",
    )
    ap.add_argument("--engine-procs", type=int, default=1, help="fake engine processes on one port")
    ap.add_argument("--loadgen-procs", type=int, default=1, help="load generator processes (streams split)")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--role", default="main", help=argparse.SUPPRESS)
    return ap


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    if args.role == "loadgen":
        asyncio.run(serve_rounds())
        return 0
    if args.render:
        return render(Path(args.render), ap)

    counts = [int(x) for x in str(args.streams).split(",") if x]
    modes = ["fast", "slow", "dead"] if args.mirror == "all" else [m for m in args.mirror.split(",") if m != "off"]
    if modes and not (ROOT / "proxy" / "server" / "mirror" / "shadows.py").exists():
        print("proxy/server/mirror/shadows.py is not there: mirror modes skipped", file=sys.stderr)
        modes = []
    env = dict(kv.split("=", 1) for kv in args.proxy_env)
    nginx_bin = (
        args.nginx_bin or shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    )
    if args.nginx == "auto" and nginx_bin is None:
        print("nginx is not installed (apt-get install -y nginx-light): no nginx baseline", file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix="enginemeter-bench-"))
    procs = Procs(tmp, args.verbose)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "blocks": {},
    }
    print(f"(process logs in {tmp}; removed after a clean run)", file=sys.stderr)
    slots = max(64, 2 * max(counts))  # per fake engine process: more than the streams it may get
    try:
        if args.engine == "llama":
            binary = os.environ.get("LLAMA_SERVER_BIN") or str(
                Path.home() / ".cache/enginemeter/llama-server-11434.0.0-cpu/bin/llama-server"
            )
            from proxy.embedded import make_model

            model = str(make_model())
            slots = args.llama_slots or max(counts)
            e_port, _ = procs.llama("engine", binary, model, args.llama_threads, slots)
        else:
            e_port, _ = procs.engine("engine", args.tokens, args.cadence_ms, args.ttft_ms, args.engine_procs, slots)
        targets = start_targets(args, procs, e_port, slots, env, modes, nginx_bin)
        loadgens = []
        for i in range(args.loadgen_procs):
            lg = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--role", "loadgen"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.procs.append((f"loadgen-{i}", lg))  # type: ignore[arg-type]
            loadgens.append(lg)
        driver = Driver(args, loadgens)
        for streams in counts:
            measure_block(args, driver, targets, streams, results)
        for lg in loadgens:
            assert lg.stdin is not None
            lg.stdin.close()
    finally:
        procs.stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=list))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def start_targets(
    args: argparse.Namespace,
    procs: Procs,
    e_port: int,
    slots: int,
    env: dict[str, str],
    modes: list[str],
    nginx_bin: str | None,
) -> list[Target]:
    """Every target of the run, started: direct, one proxy per worker count and engine kind, the baseline tree,
    nginx, the floors and one proxy per mirror mode (with its shadow)."""
    targets = [Target("direct", e_port, [])]
    worker_counts = [int(w) for w in str(args.proxy_workers).split(",") if w] or [1]
    kinds = [k for k in str(args.engine_kind).split(",") if k] or ["auto"]
    for w in worker_counts:
        for kind in kinds:
            name = "proxy" if len(worker_counts) == 1 else f"proxy-w{w}"
            name += "" if kind == kinds[0] else f"-{kind}"
            p_port, p_proc = procs.proxy(
                name,
                e_port,
                None,
                env,
                workers=w,
                max_connections=args.max_connections,
                kind=None if kind == "auto" else kind,
            )
            targets.append(Target(name, p_port, [p_proc.pid, *descendants(p_proc.pid)]))
    if args.baseline_tree:
        # as the first proxy target: the same engine kind (a connection per stream or kept alive)
        b_kind = None if kinds[0] == "auto" else kinds[0]
        b_port, b_proc = procs.proxy(
            "proxy-base",
            e_port,
            None,
            env,
            Path(args.baseline_tree).resolve(),
            workers=args.baseline_workers,
            max_connections=args.max_connections,
            kind=b_kind,
        )
        targets.append(Target(args.baseline_name, b_port, [b_proc.pid, *descendants(b_proc.pid)]))
    if args.nginx == "auto" and nginx_bin is not None:
        n_port, n_proc = procs.nginx(nginx_bin, e_port, args.nginx_workers)
        targets.append(Target("nginx", n_port, [n_proc.pid, *children(n_proc.pid)]))
    if args.floor:
        for name, parse in (("floor", False), ("floor+parse", True)):
            f_port, f_proc = procs.floor(name, e_port, parse, max(worker_counts))
            targets.append(Target(name, f_port, [f_proc.pid, *children(f_proc.pid)]))
    for mode in modes:
        if mode == "fast":
            s_port, _ = procs.engine("shadow-fast", args.tokens, args.cadence_ms, args.ttft_ms, slots=slots)
        elif mode == "slow":
            s_port, _ = procs.engine("shadow-slow", args.tokens, args.cadence_ms * 10, args.ttft_ms * 10, slots=slots)
        elif mode == "dead":
            s_port = free_port()  # nobody listens: connection refused
        else:
            raise SystemExit(f"unknown mirror mode {mode!r}")
        m_port, m_proc = procs.proxy(f"proxy-mirror-{mode}", e_port, s_port, env)
        targets.append(Target(f"proxy+mirror-{mode}", m_port, [m_proc.pid], shadow=mode))

    return targets


def measure_block(
    args: argparse.Namespace, driver: Driver, targets: list[Target], streams: int, results: dict[str, Any]
) -> None:
    """One block of rounds at ``streams`` streams: warm-up, interleaved rounds, the table; kept in ``results``."""
    load_before = os.getloadavg()
    for t in targets:
        t.rounds, t.cpu_s, t.cpu_sys_s = [], 0.0, 0.0
        warm = driver.run_round(t, streams)  # opens the keep-alive pools on every hop
        if warm["errors"]:
            print(f"  warm-up {t.name}: {warm['errors']} errors, first: {warm['first_error']}", file=sys.stderr)
        if t.shadow is not None:
            seen = shadow_seen(t.port)
            if t.shadow != "dead" and seen == 0:
                print(
                    f"  {t.name}: the proxy counted no shadow requests: is mirroring installed?",
                    file=sys.stderr,
                )
    for t in targets:
        t.cpu_s = t.cpu_sys_s = 0.0
    accounts = {t.name: own_account(t.port) for t in targets if t.name.startswith("proxy")}
    order = rotations([t.name for t in targets])
    by = {t.name: t for t in targets}
    for r in range(args.rounds):
        for name in next(order):
            res = driver.run_round(by[name], streams)
            by[name].rounds.append(res)
        if args.verbose:
            print(f"  {streams} streams: round {r + 1}/{args.rounds} done", file=sys.stderr)
    direct = targets[0]
    # the engine's pace: the fake engine's cadence; a real engine's own median gap, measured direct
    pace_ns = args.cadence_ms * MS if args.engine == "fake" else pct(pooled(direct, "gaps_ns"), 50)
    rows = [summarize(t, direct, pace_ns) for t in targets]
    for row in rows:
        if row["target"] in accounts:  # what the proxy says of itself over the same rounds
            row["own"] = account_delta(accounts[row["target"]], own_account(by[row["target"]].port))
    load = [os.getloadavg(), load_before]
    print_table(streams, rows, args, load)
    results["blocks"][str(streams)] = rows
    results.setdefault("load", {})[str(streams)] = {"before": load_before, "after": load[0]}
    if args.json:  # after every block: a run cut short keeps what it measured
        Path(args.json).write_text(json.dumps(results, indent=1, default=list))
    sys.stdout.flush()


def render(path: Path, ap: argparse.ArgumentParser) -> int:
    """The tables of a run saved with ``--json``, printed as the run printed them (with the run's own options)."""
    results = json.loads(path.read_text())
    args = ap.parse_args(results["argv"][1:])
    print(f"# {path.name}: {results['date']}, {results['cpus']} CPUs, Python {results['python']}")
    print(f"# {' '.join(results['argv'])}")
    for streams, rows in results["blocks"].items():
        load = results.get("load", {}).get(streams)
        before = tuple(load["before"]) if load else (0.0, 0.0, 0.0)
        after = tuple(load["after"]) if load else (0.0, 0.0, 0.0)
        print_table(int(streams), rows, args, [after, before])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
