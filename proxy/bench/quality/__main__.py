"""``python -m proxy.bench.quality RESULTS.jsonl [--baseline NAME] [--json]``: a run's quality figures, printed.

``python -m proxy.bench.quality live LOG [LOG...] --baseline A=URL --candidate B=URL [--size 32x64] [--out FILE]``:
token agreement on the prompts a comparison log recorded (``mirror.record_text``), measured on the two engines
now (:mod:`proxy.bench.quality.liveprompts`); the records go to ``--out`` (default ``live-agreement.jsonl``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.bench.outdir import read_jsonl, results_file
from proxy.bench.quality.agreerun import DEFAULT_PROMPTS, DEFAULT_TOKENS, parse_size
from proxy.bench.quality.liveprompts import logged_prompts, measure_live
from proxy.bench.quality.readout import accuracies, agreements, quality_notes


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["live"]:
        return _live(args[1:])
    p = argparse.ArgumentParser(prog="python -m proxy.bench.quality", description=__doc__)
    p.add_argument("results", help="a bench run's results.jsonl (.gz too), or its --out directory")
    p.add_argument("--baseline", help="default: the run's baseline")
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    ns = p.parse_args(args)
    records = read_jsonl(results_file(Path(ns.results)))
    base = ns.baseline or next((r.get("baseline") for r in records if r.get("type") == "run"), None)
    if not base:
        print("no baseline: pass --baseline", file=sys.stderr)
        return 2
    _print(records, base, as_json=ns.json)
    return 0


def _print(records: Sequence[dict[str, Any]], base: str, *, as_json: bool) -> None:
    agree, acc = agreements(records, base), accuracies(records, base)
    if as_json:
        doc = {
            "baseline": base,
            "agreement": {k: v.as_dict() for k, v in agree.items()},
            "accuracy": {k: v.as_dict() for k, v in acc.items()},
        }
        print(json.dumps(doc, indent=1))
        return
    for line in [*(a.text() for a in agree.values()), *(a.text() for a in acc.values()), *quality_notes(records)]:
        print(line)


def _side(s: str) -> tuple[str, str]:
    name, sep, url = s.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, not {s!r}")
    return name, url.rstrip("/")


def _live(args: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.quality live")
    p.add_argument("logs", nargs="+", type=Path, help="the proxy's comparison log (and its rotated files)")
    p.add_argument("--baseline", type=_side, required=True, metavar="NAME=URL")
    p.add_argument("--candidate", type=_side, required=True, metavar="NAME=URL")
    p.add_argument("--size", default=f"{DEFAULT_PROMPTS}x{DEFAULT_TOKENS}", metavar="PROMPTSxTOKENS")
    p.add_argument("--out", type=Path, default=Path("live-agreement.jsonl"))
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(args)
    n, tokens = parse_size(ns.size)
    prompts = logged_prompts(ns.logs)
    if not prompts:
        print(
            "no recorded prompts in the log: set mirror.record_text to true (it logs users' prompts)", file=sys.stderr
        )
        return 2
    records: list[dict[str, Any]] = []
    asyncio.run(measure_live(prompts, [ns.baseline, ns.candidate], tokens, n, records.append))
    ns.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    _print(records, ns.baseline[0], as_json=ns.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
