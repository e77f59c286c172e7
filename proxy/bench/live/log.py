"""The proxy's comparison log read as what it is: proxy runs, each holding pairs that were mirrored, each pair
ended for a cause. Pure but for reading the files.

- **Files**: paths or globs; a path (or a glob's hit) brings every rotated file of its log with it
  (``x.jsonl.2``, ``x.jsonl.1``, ``x.jsonl``: the proxy's own rotation, ``proxy.jsonlog``), read oldest
  first, all opened at one moment (no rotation in between). ``select`` says how many files and pairs were read and
  warns when the selected run's records reach into files that were not read: rotated away (a file that starts
  with the run's ``continued`` header, or a run whose start is in no file read), missing from the numbering,
  unreadable, or left out by naming one rotated file alone.
- **Runs**: a proxy run writes a ``run`` record when it starts, its id on every ``pair`` record, ``engine``
  records (what the engine-state poller learned) and an ``end`` record per worker. Pair records written before
  runs were recorded (no ``run``) form one *unlabelled* run. ``select`` takes the **latest run** unless told
  ``run=ID`` (a prefix will do) or ``run="all"``, and says what it left out — old runs never mix in silently.
- **Pairs as mirrored**: records are grouped by their (primary, shadow) — each shadow is compared only with the
  primary it was mirrored from; ``primary``/``shadow`` keep only those engines; ``since``/``until`` bound the
  pair's start time (``t_start``, else the record time).
- **Causes** (``cause``): a pair ends ``ok`` (both sides answered), or is lost for a reason that is not an
  engine's speed: the client hung up (``client``), the proxy shut down during the copy (``shutdown``), an engine
  could not be reached (``unreachable``), both engines refused the request with a 4xx (``refused``: the request's
  fault, e.g. a prompt longer than the context); everything else is an engine-side failure of the side(s) that
  failed (``engine``: ``engine_error``, ``timeout``, ``upstream_broken``).
"""

from __future__ import annotations

import datetime as dt
import glob as globmod
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from proxy.jsonlog import open_together, rotated_family
from proxy.notation import count

Cause = Literal["ok", "client", "shutdown", "unreachable", "refused", "engine"]
CAUSE_TEXT: Mapping[str, str] = {
    "ok": "compared (both sides answered)",
    "client": "client hung up (the primary's client left before the end)",
    "shutdown": "proxy shut down during the shadow copy",
    "unreachable": "engine unreachable (connection refused: down or restarting)",
    "refused": "refused by both engines (4xx: the request's own fault)",
    "engine": "engine-side failure (error answer, timeout, broken stream)",
}


def expand(paths: Sequence[str]) -> list[Path]:
    """Paths and globs -> files, each rotated family oldest first (``x.jsonl.2``, ``x.jsonl.1``, ``x.jsonl``)."""
    out: list[Path] = []
    for p in paths:
        hits = sorted(globmod.glob(p)) if any(ch in p for ch in "*?[") else [p]
        if not hits:
            raise ValueError(f"{p}: no such file")
        for h in hits:
            for f in rotated_family(h) or [h]:  # the log's rotated files with it; a missing one fails on reading
                if Path(f) not in out:
                    out.append(Path(f))

    def rank(q: Path) -> tuple[str, int]:
        stem, _, n = q.name.rpartition(".")
        return (str(q.parent / stem), -int(n)) if n.isdigit() else (str(q), 0)

    return sorted(out, key=rank)


@dataclass
class Run:
    id: str | None  # None: pair records written before runs were recorded
    started: float | None = None
    listen: str | None = None
    pairs: list[tuple[str, str]] = field(default_factory=list)  # what its routes mirror
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind, model as probed at start
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)  # engine -> latest engine record
    ends: list[dict[str, Any]] = field(default_factory=list)  # one per worker that stopped
    records: list[dict[str, Any]] = field(default_factory=list)  # its pair records, by time
    #: the file where its records start in what was read, and whether that file holds its start (its first ``run``
    #: record) or only a ``continued`` header (earlier files of the run are gone)
    first_file: Path | None = None
    began: bool = False

    @property
    def first(self) -> float | None:
        if self.started is not None:
            return self.started
        return start_of(self.records[0]) if self.records else None

    def label(self) -> str:
        when = _utc(self.first) if self.first is not None else "?"
        return f"{self.id or 'unlabelled (records of a proxy before run ids)'} (from {when}, {len(self.records)} pairs)"


@dataclass
class Log:
    files: list[Path]
    runs: list[Run]  # oldest first
    pairs_read: int = 0
    #: files that were given but could not be read, and gaps in a rotated family: one sentence each
    unread: list[str] = field(default_factory=list)


def start_of(rec: Mapping[str, Any]) -> float:
    """A pair's start: ``t_start`` where the proxy wrote it, else its compare time less the longer side."""
    t = rec.get("t_start")
    if isinstance(t, int | float):
        return float(t)
    end = float(rec.get("ts") or 0)
    durs = [float(rec[s].get("e2e_s") or 0) for s in ("primary", "shadow") if isinstance(rec.get(s), dict)]
    return end - max(durs, default=0.0)


def _is_pair(r: Mapping[str, Any]) -> bool:
    return r.get("type", "pair") == "pair" and isinstance(r.get("primary"), dict) and isinstance(r.get("shadow"), dict)


def _lines(f: Any) -> list[dict[str, Any]]:
    """``read_jsonl`` of an open binary file."""
    recs: list[dict[str, Any]] = []
    for line in f:
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a blank line, or one cut by Ctrl-C
        if isinstance(obj, dict):
            recs.append(obj)
    return recs


def _family_gaps(files: Sequence[Path]) -> list[str]:
    """Rotated files missing from a family that was read (``x.3`` and ``x.1`` but no ``x.2``), and rotated files
    named alone whose log's other files were not given."""
    out = []
    for f in files:
        stem, _, n = f.name.rpartition(".")
        if n.isdigit() and stem:
            base = f.with_name(stem)
            left = [x for x in map(Path, rotated_family(str(base))) if x not in files]
            if left and base not in files:
                out.append(
                    f"{f} is one rotated file of {base}: {', '.join(map(str, left))} not read (give --log "
                    f"{base} for all of them)"
                )
    for f in files:
        numbers = sorted(
            int(x.name.rpartition(".")[2])
            for x in files
            if x.parent == f.parent and x.name.rpartition(".")[0] == f.name and x.name.rpartition(".")[2].isdigit()
        )
        missing = [n for n in range(1, numbers[-1]) if n not in numbers] if numbers else []
        if missing:
            out.append(f"{f}: rotated file(s) {', '.join(f'{f}.{n}' for n in missing)} missing between those read")
    return out


def read_log(files: Sequence[Path]) -> Log:
    runs: dict[str | None, Run] = {}
    unread = _family_gaps(files)
    read: list[Path] = []
    pairs_read = 0
    with open_together([str(f) for f in files]) as opened:
        contents = [(Path(name), h if isinstance(h, OSError) else _lines(h)) for name, h in opened]
    errors = [h for _, h in contents if isinstance(h, OSError)]
    if len(errors) == len(contents) and errors:
        raise errors[0]  # nothing could be read: the error itself, as before
    for f, recs in contents:
        if isinstance(recs, OSError):
            unread.append(f"could not read {f}: {recs.strerror or recs}")
            continue
        read.append(f)
        for r in recs:
            rid = r.get("run") if isinstance(r.get("run"), str) else None
            run = runs.setdefault(rid, Run(rid))
            kind = r.get("type", "pair")
            if run.first_file is None and kind in ("run", "pair"):
                run.first_file = f
            if kind == "run" and rid is not None:
                run.began = run.began or (run.first_file == f and not r.get("continued"))
                ts = r.get("ts")
                if isinstance(ts, int | float) and (run.started is None or ts < run.started):
                    run.started = float(ts)
                run.listen = run.listen or r.get("listen")
                run.pairs += [(str(a), str(b)) for a, b in r.get("pairs") or () if (a, b) not in run.pairs]
                run.engines.update(r.get("engines") or {})
            elif kind == "engine" and isinstance(r.get("engine"), str):
                run.facts[r["engine"]] = r
            elif kind == "end":
                run.ends.append(r)
            elif _is_pair(r):
                run.records.append(r)
                pairs_read += 1
    out = [x for x in runs.values() if x.records or x.id is not None]
    for x in out:
        x.records.sort(key=lambda y: float(y.get("ts") or 0))
    out.sort(key=lambda x: (x.first is None, x.first or 0.0))
    if not any(x.records for x in out):
        raise ValueError(f"{', '.join(map(str, files))}: no comparison records (pairs the proxy mirrored)")
    return Log(read, out, pairs_read, unread)


def coverage(log: Log, runs: Sequence[Run]) -> tuple[str, list[str]]:
    """What was read (one sentence), and a warning for each way the ``runs``' records reach into files that were
    not read (module docstring)."""
    names = ", ".join(map(str, log.files)) if len(log.files) <= 6 else f"{log.files[0]} … {log.files[-1]}"
    read = f"{count(len(log.files), 'file')} read, oldest first ({names}): {count(log.pairs_read, 'pair')}"
    warnings = list(log.unread)
    for run in runs:
        if run.id is None or run.began:
            continue
        compared = sum(int(e.get("compared") or 0) for e in run.ends)
        held = f"; its workers compared {compared} pairs, the files read hold {len(run.records)}" if compared else ""
        warnings.append(
            f"run {run.id} began before the oldest file read ({run.first_file}): the files with its first "
            f"pairs were rotated away (mirror.log_backups, log_max_bytes) or not given{held}"
        )
    return read, warnings


_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")


def parse_time(s: str, now: float | None = None) -> float:
    """``--since``/``--until``: Unix seconds, an ISO 8601 time (local time unless it says its zone), or a
    duration ago (``90s``, ``30m``, ``2h``, ``1d``)."""
    now = time.time() if now is None else now
    m = _AGO.match(s)
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return float(s)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(s.strip())
    except ValueError:
        raise ValueError(
            f"cannot read time {s!r}: give Unix seconds, ISO 8601 (2026-12-03T10:15) or 30m/2h/1d ago"
        ) from None
    return t.timestamp()  # a naive time is local, as a person typing it means


def _utc(t: float) -> str:
    return f"{dt.datetime.fromtimestamp(t, dt.UTC):%Y-%m-%d %H:%M:%S} UTC"


@dataclass
class Selection:
    runs: list[Run]
    #: (primary, shadow) -> its pair records, by compare time
    pairs: dict[tuple[str, str], list[dict[str, Any]]]
    #: what was read, what was left out, and why (one sentence each)
    notes: list[str]
    #: records of the selected runs that may be in files not read (``coverage``)
    warnings: list[str] = field(default_factory=list)
    #: how many files and pairs were read (``coverage``)
    read: str = ""

    @property
    def records(self) -> list[dict[str, Any]]:
        return sorted((r for rs in self.pairs.values() for r in rs), key=lambda x: float(x.get("ts") or 0))

    def facts(self, engine: str) -> dict[str, Any]:
        for run in reversed(self.runs):
            if engine in run.facts:
                return run.facts[engine]
        return {}

    def kind(self, engine: str) -> str | None:
        for r in self.records:
            for side in (r["primary"], r["shadow"]):
                if side.get("engine") == engine and side.get("kind"):
                    return str(side["kind"])
        return None


def select(
    log: Log,
    *,
    run: str | None = None,
    since: float | None = None,
    until: float | None = None,
    primary: str | None = None,
    shadow: str | None = None,
) -> Selection:
    notes: list[str] = []
    with_pairs = [r for r in log.runs if r.records]
    if run == "all":
        runs = with_pairs
        if len(runs) > 1:
            notes.append(f"--run all: {len(runs)} proxy runs read together: " + "; ".join(r.label() for r in runs))
    elif run:
        runs = [r for r in log.runs if r.id is not None and r.id.startswith(run)]
        if not runs:
            known = ", ".join(r.id or "unlabelled" for r in log.runs) or "none"
            raise ValueError(f"no proxy run {run!r} in the log (runs: {known})")
        if len(runs) > 1:
            raise ValueError(f"--run {run!r} matches {len(runs)} runs: {', '.join(str(r.id) for r in runs)}")
    else:
        labelled = [r for r in with_pairs if r.id is not None]
        runs = [labelled[-1]] if labelled else with_pairs[-1:]
        others = [r for r in with_pairs if r not in runs]
        if others:
            notes.append(
                f"the latest proxy run only: {runs[0].label()}; left out {len(others)} other run(s) in "
                f"the log: {'; '.join(r.label() for r in others)} — --run ID for one, --run all for every one"
            )
    recs = [x for r in runs for x in r.records]
    n0 = len(recs)
    if since is not None:
        recs = [x for x in recs if start_of(x) >= since]
    if until is not None:
        recs = [x for x in recs if start_of(x) <= until]
    if n0 != len(recs):
        bounds = ", ".join(
            b
            for b in (
                (f"since {_utc(since)}" if since is not None else ""),
                (f"until {_utc(until)}" if until is not None else ""),
            )
            if b
        )
        notes.append(f"{n0 - len(recs)} of {n0} pairs outside the time window left out ({bounds})")
    pairs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for x in recs:
        key = (str(x["primary"].get("engine")), str(x["shadow"].get("engine")))
        pairs.setdefault(key, []).append(x)
    everything = sorted(pairs)
    if primary is not None:
        pairs = {k: v for k, v in pairs.items() if k[0] == primary}
    if shadow is not None:
        pairs = {k: v for k, v in pairs.items() if k[1] == shadow}
    if not pairs:
        mirrored = ", ".join(f"{a} → {b}" for a, b in everything) or "none"
        raise ValueError(f"no mirrored pairs left to compare (pairs in the selected run(s): {mirrored})")
    if len(pairs) < len(everything):
        notes.append(
            "pairs left out by --primary/--shadow: "
            + ", ".join(
                f"{a} → {b} ({len([x for x in recs if (x['primary'].get('engine'), x['shadow'].get('engine')) == (a, b)])})"
                for a, b in everything
                if (a, b) not in pairs
            )
        )
    for v in pairs.values():
        v.sort(key=lambda x: float(x.get("ts") or 0))
    read, warnings = coverage(log, runs)
    return Selection(runs, pairs, notes, warnings, read)


# ---- causes ------------------------------------------------------------------------------------------


def cause(rec: Mapping[str, Any]) -> tuple[Cause, tuple[str, ...]]:
    """Why a pair ended as it did, and the engines to blame (only for ``engine`` and ``unreachable``)."""
    p, s = rec["primary"], rec["shadow"]
    po, so = p.get("outcome"), s.get("outcome")
    if po == "ok" and so == "ok":
        return "ok", ()
    if po == "client_disconnect":
        return "client", ()
    if so == "client_disconnect":
        return "shutdown", ()
    down = tuple(str(x.get("engine")) for x in (p, s) if x.get("outcome") == "connect_error")
    if down:
        return "unreachable", down
    if all(x.get("outcome") == "engine_error" and 400 <= int(x.get("status") or 0) < 500 for x in (p, s)):
        return "refused", ()
    return "engine", tuple(str(x.get("engine")) for x in (p, s) if x.get("outcome") != "ok")


@dataclass(frozen=True, slots=True)
class Outcomes:
    """One engine pair's pairs by cause; engine-side failures per engine and outcome."""

    total: int
    by_cause: Mapping[str, int]
    failures: Mapping[str, Mapping[str, int]]  # engine -> outcome -> count
    unreachable: Mapping[str, int]  # engine -> pairs lost to it being down

    def failure_rate(self, engine: str) -> float:
        """Engine-side failures of ``engine`` per pair the engines could have answered (client hang-ups,
        shutdowns, unreachable engines and requests both refused are not in the denominator)."""
        judged = self.by_cause.get("ok", 0) + self.by_cause.get("engine", 0)
        return sum(self.failures.get(engine, {}).values()) / judged if judged else 0.0


def outcomes(recs: Sequence[Mapping[str, Any]]) -> Outcomes:
    by: dict[str, int] = {}
    fail: dict[str, dict[str, int]] = {}
    down: dict[str, int] = {}
    for r in recs:
        c, who = cause(r)
        by[c] = by.get(c, 0) + 1
        if c == "engine":
            for side in (r["primary"], r["shadow"]):
                if side.get("outcome") != "ok":
                    e = fail.setdefault(str(side.get("engine")), {})
                    e[str(side.get("outcome"))] = e.get(str(side.get("outcome")), 0) + 1
        elif c == "unreachable":
            for name in who:
                down[name] = down.get(name, 0) + 1
    return Outcomes(len(recs), by, fail, down)
