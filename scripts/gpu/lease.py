"""The device calls of one 27B lease, printed from what is here: the carries (.carry/cN, made by ``VLLM=1
scripts/gpu/fetch-wheels.sh``), the tree that travels with each call, the plan's deadline. Checks the 64 MiB a
call may carry (the tree + one carry) and prints each call's command, carry and timeout, in order.

    python3 scripts/gpu/lease.py [--start-s 90] [--lease-s 1800]
    python3 scripts/gpu/lease.py --orch orchestrate48.sh --deadline 1400 --env 'STEPS="swap agree sg_gguf diag"'
                                 (issue 48's run: scripts/gpu/plan48.sh; carries from SHAPE=3b VLLM=1 fetch-wheels.sh)

``--start-s``: the machine's start as seen (the first call's ``lease.held_s`` less its ``wall_s``); the plan's
deadline moves by what it took beyond 90 s. A later call can still move it: ``DEADLINE_S=N bash
scripts/gpu/device.sh wait`` writes the running plan's new deadline (plan seconds from call 1).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
LIMIT_MIB = 64
STAGE_S = 30  # one stage call: the tree and a carry across, the parts copied and unpacked (2026-12-03: 25-35 s)
#: one wait call: what has finished comes back at its end, so a machine taken back during a wait loses the results
#: since the last call (2026-12-07: 558 s of a plan, nothing returned); 240 s loses at most that, ~10 s a call more
WAIT_S = 240
BASE_DEADLINE_S = 1450  # plan seconds from call 1 when the machine started in 90 s (README: the plan, timed)
PLAN_END_PAD_S = 60  # the last call's packing and transfer after the plan's deadline


def travelling_bytes() -> int:
    """Tracked files and untracked ones git does not ignore: what every call sends besides its carry."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout  # fmt: skip
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def carries() -> list[tuple[str, int, list[str]]]:
    out = []
    for d in sorted((ROOT / ".carry").glob("c[0-9]*"), key=lambda p: int(p.name[1:])):
        files = sorted(f.name for f in d.iterdir() if f.is_file())
        out.append((f".carry/{d.name}", sum((d / f).stat().st_size for f in files), files))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start-s", type=float, default=90, help="the machine's start, seconds (default 90)")
    ap.add_argument("--lease-s", type=float, default=1800, help="device time of the session (default 1800)")
    ap.add_argument("--orch", default="orchestrate.sh", help="the plan device.sh starts (default the 27B plan's)")
    ap.add_argument("--deadline", type=int, default=BASE_DEADLINE_S, help="plan seconds at a 90 s start")
    ap.add_argument("--env", default="", help="more VAR=VALUE words for the first call (the plan's knobs)")
    a = ap.parse_args()
    tree = travelling_bytes()
    cs = carries()
    if not cs:
        print("no .carry/c*: run VLLM=1 scripts/gpu/fetch-wheels.sh first", file=sys.stderr)
        return 2
    bad = [(n, b) for n, b, _ in cs if tree + b > LIMIT_MIB * MIB]
    print(f"tree that travels with every call: {tree / MIB:.1f} MiB; the limit a call: {LIMIT_MIB} MiB")
    for name, b, files in cs:
        print(f"  {name}: {b / MIB:.1f} MiB (+ tree {(tree + b) / MIB:.1f} MiB)  {' '.join(files)}")
    if bad:
        print("OVER THE LIMIT: " + ", ".join(f"{n} ({(tree + b) / MIB:.1f} MiB)" for n, b in bad), file=sys.stderr)
        return 1
    has_vl = any("vl.manifest" in f for _, _, files in cs for f in files)
    if not has_vl:
        print("note: no vLLM component in the carries (VLLM=1 fetch-wheels.sh): the vllm_fp8 arm will be skipped")
    late = max(0.0, a.start_s - 90)
    deadline = int(a.deadline - late)
    n = len(cs)
    stage_end = n * STAGE_S
    left = deadline + PLAN_END_PAD_S - stage_end
    print(f"\nmachine start {a.start_s:.0f} s -> DEADLINE_S={deadline} (plan seconds from call 1; {a.deadline} at"
          f" a 90 s start); device time ~{a.start_s + deadline + PLAN_END_PAD_S:.0f} of {a.lease_s:.0f} s\n")  # fmt: skip
    print("#  | command | carry | timeout_s | device s (est.)")
    t = a.start_s
    for i, (name, _, _) in enumerate(cs, 1):
        first = " ".join(x for x in (f"ORCH={a.orch}" if a.orch != "orchestrate.sh" else "", a.env) if x)
        cmd = (
            f"{first + ' ' if first else ''}DEADLINE_S={deadline} bash scripts/gpu/device.sh stage"
            if i == 1
            else "bash scripts/gpu/device.sh stage"
        )
        t += STAGE_S
        print(f'{i}  | {cmd} | ["{name}"] | 120 | ~{t:.0f}')
    i = n
    while left > 0:
        i += 1
        w = min(WAIT_S, int(left) + 30)
        t += w + 10
        print(f"{i}  | WAIT_S={w} bash scripts/gpu/device.sh wait | - | 600 | ~{t:.0f}")
        left -= w
    print(f"\nthen give_back; here: scripts/gpu/collect.sh <files_at of call {i}>.\n"
          "Every call within 30 s of the last (else the machine goes back and /tmp/w is lost). Each call returns\n"
          "results.tar.gz, logs.tar.gz, timeline.tsv, status.txt (a superset of the last): read timeline.tsv.\n"
          f"A slow start seen after call 1: move the deadline by adding DEADLINE_S=<{a.deadline} - (start - 90)>"
          " to any later call's command; a wait returns early once the plan is done.")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
