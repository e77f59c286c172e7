"""Cut the components into carries that each fit one device call beside the repo.

    python3 scripts/gpu/pack_carries.py [--out DIR] CAP_MIB NAME=FILE [NAME=FILE ...]

Components are laid end to end in the order given and cut so that each carry directory DIR/c1, DIR/c2, ...
(default .carry/) holds at most CAP_MIB MiB: files NAME.partNN plus NAME.manifest (the part names, in order,
one a line) beside the component's first part. scripts/gpu/device.sh stage copies them to /tmp/w/parts on the
GPU machine and unpacks a component (cat parts | tar -x[J]) once all its parts have arrived.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    args = sys.argv[1:]
    base = ROOT / ".carry"
    if args[:1] == ["--out"]:
        base, args = Path(args[1]).resolve(), args[2:]
    cap = int(float(args[0]) * 2**20)
    comps = [a.split("=", 1) for a in args[1:]]
    for old in base.glob("c[0-9]*"):
        shutil.rmtree(old)
    carry = 1
    used = 0
    chunk = 1 << 20
    for name, fname in comps:
        src = Path(fname)
        size = src.stat().st_size
        parts: list[str] = []
        first_dir = None
        with open(src, "rb") as fh:
            done = 0
            while done < size:
                if cap - used < 1 << 20:  # less than 1 MiB left: next carry
                    carry += 1
                    used = 0
                d = base / f"c{carry}"
                d.mkdir(parents=True, exist_ok=True)
                first_dir = first_dir or d
                take = min(cap - used, size - done)
                pname = f"{name}.{src.name.split('.', 1)[1] if '.' in src.name else 'bin'}.part{len(parts):02d}"
                with open(d / pname, "wb") as out:
                    left = take
                    while left:
                        buf = fh.read(min(chunk, left))
                        out.write(buf)
                        left -= len(buf)
                parts.append(pname)
                done += take
                used += take
        assert first_dir is not None
        (first_dir / f"{name}.manifest").write_text("\n".join(parts) + "\n")
        used += 4096
    for d in sorted(base.glob("c[0-9]*"), key=lambda p: int(p.name[1:])):
        total = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {total / 2**20:.1f} MiB  {' '.join(sorted(f.name for f in d.iterdir()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
