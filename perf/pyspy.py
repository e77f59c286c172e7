"""Profile the proxy under the overhead bench's load: where its CPU goes, per layer.

    .venv/bin/python perf/pyspy.py --out /tmp/prof [--streams 32 --tokens 64 --cadence-ms 10] [-- overhead args]

Runs ``perf/overhead.py`` (fake engine, no nginx) and, once the proxy process is up and serving, samples it with
py-spy (``--rate``, ``--seconds``, ``--nonblocking`` so the proxy is never paused). Writes the collapsed stacks
(``stacks.txt``) and prints a table: each busy sample counted once, under the first layer of ``LAYERS`` that
any of its frames belongs to (searched from the innermost frame outwards), then the top self-time functions.
py-spy is a dev tool: ``pip install py-spy``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from perf.procs import descendants  # noqa: E402

#: (layer, predicate on one frame "function (file:line)"), first match from the innermost frame wins
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the upstream client (h1.py)", ("proxy/server/request/h1.py",)),
    ("the write to the client (output.py: one transport write a read)", ("proxy/server/request/output.py",)),
    ("uvicorn: send (the write per chunk, head, terminator)", ("send (uvicorn/",)),
    ("uvicorn: HTTP parsing and protocol", ("uvicorn/",)),
    ("anyio (task groups, cancel scopes, threads)", ("anyio/",)),
    ("starlette (routing, Request, responses)", ("starlette/",)),
    ("prometheus_client (observe)", ("prometheus_client/",)),
    (
        "the relay's per-chunk loop (relay.py, rewrite.py, sse.py, stream.py)",
        ("proxy/server/request/relay.py", "proxy/server/request/rewrite.py", "proxy/sse.py", "proxy/stream.py"),
    ),
    ("per request: app, attempt, normalize, routing, metrics, result", ("proxy/",)),
    ("asyncio (tasks, futures, run_once)", ("asyncio/",)),
]


LOOP = "the event loop itself (uvloop's C code: epoll, socket reads, callbacks)"


def classify(frames: list[str]) -> str:
    """The layer of the innermost frame that belongs to one; frames from ``Runner.run`` outwards are the
    process's start-up (main -> uvicorn.run -> asyncio.run), so a sample whose Python stack ends there is
    the event loop's own C code."""
    for f in reversed(frames):
        if f.startswith("Runner.run (") or f.startswith("run_until_complete"):
            return LOOP
        for layer, needles in LAYERS:
            if any(n in f for n in needles):
                return layer
    return LOOP


def summarize(stacks: Path, top: int = 25) -> str:
    layers: collections.Counter[str] = collections.Counter()
    selfs: collections.Counter[str] = collections.Counter()
    total = 0
    for line in stacks.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        count = int(n)
        total += count
        layers[classify(frames)] += count
        selfs[frames[-1]] += count
    out = [f"busy samples: {total}", "", "| where | share of busy samples |", "|---|---|"]
    out += [f"| {k} | {v / total:.1%} |" for k, v in layers.most_common()]
    out += ["", f"top {top} innermost frames:"]
    out += [f"{v / total:6.1%}  {k}" for k, v in selfs.most_common(top)]
    return "\n".join(out)


def _proxy_of(bench_pid: int) -> int | None:
    """The proxy process this bench started (never another one on a shared machine): its child whose command
    line is ``proxy.cli serve``."""
    for pid in descendants(bench_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"proxy.cli" in argv and b"serve" in argv:
            return pid
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--summarize", action="store_true", help="only rewrite OUT/summary.txt from OUT/stacks.txt")
    ap.add_argument("--streams", default="32")
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--cadence-ms", default="10")
    ap.add_argument("--rounds", default="8")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--blocking", action="store_true", help="pause the proxy for each sample (exact stacks)")
    ap.add_argument("rest", nargs="*", help="more perf/overhead.py arguments (after --)")
    a = ap.parse_args()
    if a.summarize:
        report = summarize(a.out / "stacks.txt")
        (a.out / "summary.txt").write_text(report + "\n")
        print(report)
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    a.out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "perf/overhead.py"), "--streams", a.streams, "--tokens", a.tokens]
    cmd += ["--cadence-ms", a.cadence_ms, "--rounds", a.rounds, "--nginx", "off", *a.rest]
    log = (a.out / "bench.txt").open("w")
    bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    pid = None
    deadline = time.monotonic() + 60
    while pid is None and time.monotonic() < deadline and bench.poll() is None:
        pid = _proxy_of(bench.pid)
        time.sleep(0.2)
    if pid is None:
        sys.exit("the proxy did not start (see bench.txt)")
    time.sleep(4)  # the warm-up round
    stacks = a.out / "stacks.txt"
    subprocess.run(
        [
            spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(a.rate),
            "--duration",
            str(a.seconds),
            *([] if a.blocking else ["--nonblocking"]),
            "--format",
            "raw",
            "--output",
            str(stacks),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bench.wait()
    log.close()
    report = summarize(stacks)
    (a.out / "summary.txt").write_text(report + "\n")
    print(f"proxy pid {pid}; {' '.join(cmd)}\n{report}")
    if os.environ.get("PROFILE_SHOW_BENCH"):
        print((a.out / "bench.txt").read_text())


if __name__ == "__main__":
    main()
