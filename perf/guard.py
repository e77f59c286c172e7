#!/usr/bin/env python3
"""Refresh perf/guard.json, the figures tests/system/test_perf_guard.py holds the proxy to: runs perf/overhead.py with the
guard's own argv on this machine and writes the proxy row's figures, the date and the load average before the run.
Run it on a quiet machine (the load is recorded beside the figures):

    .venv/bin/python perf/guard.py            # writes perf/guard.json
    .venv/bin/python perf/guard.py --dry-run  # prints what it would write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUARD = ROOT / "perf" / "guard.json"
KEYS = ("cpu_s_per_1k_chunks", "added_ttft_p50_ms", "added_gap_p99_ms", "throughput_ratio", "delivered")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    guard = json.loads(GUARD.read_text())
    load = [f"{x:.2f}" for x in os.getloadavg()]
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "g.json"
        cmd = [sys.executable, str(ROOT / "perf" / "overhead.py"), *guard["argv"], "--json", str(out)]
        subprocess.run(cmd, cwd=ROOT, check=True)
        rows = {r["target"]: r for r in json.loads(out.read_text())["blocks"][guard["streams"]]}
    proxy = rows["proxy"]
    guard.update(date=date, load=load, proxy={k: round(float(proxy[k]), 4) for k in KEYS})
    text = json.dumps(guard, indent=1) + "\n"
    if args.dry_run:
        print(text, end="")
    else:
        GUARD.write_text(text)
        print(f"wrote {GUARD}: {guard['proxy']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
