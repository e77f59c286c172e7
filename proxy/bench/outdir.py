"""A run's output directory: one that already holds a run is never written over unasked.

``bench`` and ``tune`` write ``results.jsonl`` as they go and the report beside it at the end; a second run into
the same ``--out`` used to replace the first one's report, verdict and charts and leave its ``results.jsonl`` beside
another run's report. So a directory holding a run is refused before anything is sent (``refusal``), naming the way
out: ``--force``, or a fresh name (``fresh``). The advice the tool prints (the rerun with more repeats, tune's bench
command) names a new directory too (``next_name``: pure, for ``verdict``; ``fresh``: the first name not taken).
What a run left there is read back by ``results_file`` (the file a path names: the results or the directory) and
``read_jsonl`` (gzipped or not), for the report, the verdict and the quality readout alike.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

#: the files that make a directory a run's (a stopped run's lone verdict.json is not: rerunning it is the fix)
RUN_FILES = ("results.jsonl", "results.jsonl.gz", "report.md", "report.html", "tune.json")

_NUMBERED = re.compile(r"^(.*?)-(\d+)$")


def held(out: Path) -> list[str]:
    """The run files ``out`` holds (none: it is free to write into)."""
    return [name for name in RUN_FILES if (out / name).exists()]


def next_name(name: str) -> str:
    """The name after ``name``: ``bench-out`` -> ``bench-out-2``, ``bench-out-2`` -> ``bench-out-3``."""
    base = name.rstrip("/") or "out"
    m = _NUMBERED.match(base)
    return f"{m.group(1)}-{int(m.group(2)) + 1}" if m else f"{base}-2"


def fresh(out: Path) -> Path:
    """The first of ``out``'s next names that does not exist yet."""
    name = str(out)
    while True:
        name = next_name(name)
        if not Path(name).exists():
            return Path(name)


def refusal(out: Path, *, force: bool, files: tuple[str, ...] = RUN_FILES, keep: tuple[Path, ...] = ()) -> str | None:
    """Why writing into ``out`` is refused (one line, with the way out), or None. ``files``: the files that count
    (``report`` counts only results: rebuilding a report where one was is what it is for); ``keep``: the command's
    own input (``report --results DIR --out DIR`` rewrites the report of the run it reads)."""
    if force:
        return None
    own = {p.resolve() for p in keep}
    found = [f for f in held(out) if f in files and (out / f).resolve() not in own]
    if not found:
        return None
    return (
        f"{out} already holds a run ({', '.join(found)}); nothing was written — use a fresh directory "
        f"(--out {fresh(out)}) or --force to write over it"
    )


def results_file(path: Path) -> Path:
    """The results file a path names: the file itself (``.gz`` too), or a bench ``--out`` directory's
    ``results.jsonl`` (else ``results.jsonl.gz``, as ``scripts/gpu/collect.sh`` keeps it)."""
    if not path.is_dir():
        return path
    for name in ("results.jsonl", "results.jsonl.gz"):
        if (path / name).is_file():
            return path / name
    raise ValueError(f"{path}: no results.jsonl (or results.jsonl.gz) in this directory — not a bench --out")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, gzipped or not; a line cut by Ctrl-C is skipped."""
    recs: list[dict[str, Any]] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by Ctrl-C
            if isinstance(obj, dict):
                recs.append(obj)
    return recs
