"""Repack a wheel without some of its files, RECORD rewritten (issue 11: SGLang/vLLM through 64 MiB carries).

    python3 scripts/gpu/slim_wheel.py IN.whl OUT_DIR PATTERN [PATTERN ...]

PATTERN is an fnmatch pattern on the path inside the wheel (``*`` crosses ``/``). The dist-info is kept (so the
engines' own version checks still pass); RECORD lists exactly the files left, with fresh sha256 and sizes.
Prints what was dropped and the sizes before and after.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import sys
import zipfile
from pathlib import Path


def slim(src: Path, out_dir: Path, patterns: list[str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    tmp = dst.with_suffix(".tmp")
    dropped = 0
    records: list[str] = []
    record_name = None
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                dropped += info.file_size
                print(f"  drop {name} ({info.file_size / 1e6:.1f} MB)", file=sys.stderr)
                continue
            data = zin.read(name)
            zi = zipfile.ZipInfo(name, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            if not name.endswith("/"):
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                records.append(f"{name},sha256={digest},{len(data)}")
        if record_name is None:
            raise SystemExit(f"{src}: no RECORD")
        records.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(records) + "\n")
    tmp.replace(dst)
    print(
        f"{src.name}: {src.stat().st_size / 1e6:.1f} MB -> {dst.stat().st_size / 1e6:.1f} MB "
        f"({dropped / 1e6:.0f} MB uncompressed dropped)",
        file=sys.stderr,
    )
    return dst


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    slim(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
