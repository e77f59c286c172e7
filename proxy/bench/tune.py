"""``enginemeter tune``: one llama-server flag swept, each setting launched alone, measured with the bench's
workload and statistics, then the rule applied — keep tuning llama.cpp, or compare engines next.

The sweep is one flag with a list of values, everything else fixed: ``--launch 'llama-server -m M -ngl 99 -np
{1,2,4,8}'`` (one ``{a,b,...}`` list in the command) or ``--launch 'llama-server -m M -ngl 99' --vary
-np=1,2,4,8`` (the flag's value replaced, or the flag added). Each setting is a launched engine of a time-shared
bench (``proxy.bench.timeshare``): launched alone, the same requests as every other setting (single request:
decode and TTFT; a concurrency sweep up to the largest slot count when the flag is ``-np``; GPU memory peak),
stopped; the first setting is the baseline and is launched again last (the A/A pass: the noise floor). Each
other setting is judged against the first by the bench's own verdict (``proxy.bench.verdict``); the context per
slot a swept ``-np`` or ``-c`` changes is part of what is compared, not a parity failure. ``proxy.bench.tunereport``
turns the verdicts into the table, the best setting per regime and the rule.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.bench.options import UsageError, add_workload, build_config, fail_on_of

#: the flags that set llama.cpp's slots (the concurrency sweep then goes up to the largest value)
SLOT_FLAGS = ("-np", "--parallel")
_BRACES = re.compile(r"\{([^{}]*,[^{}]*)\}")

DESCRIPTION = """\
Sweep one llama-server flag: each value launched alone, measured with the same workload (single-request decode
and TTFT, a concurrency sweep up to the slots, GPU memory peak), stopped; the first value is the baseline and is
launched again at the end for the noise floor. Ends in a table, the best setting per regime and the rule:
"tuning helps: keep llama.cpp with -np 4 (...)" or "tuning is flat and memory is not full: compare engines next"
with the bench command to run."""

EPILOG = """\
examples:
  enginemeter tune --launch 'llama-server -m /m/q4.gguf -ngl 99 -c 16384 -np {1,2,4,8} --port {port}'
  enginemeter tune --launch 'llama-server -m /m/q4.gguf -ngl 99 -np 1 --port {port}' --vary -b=256,512,2048
  enginemeter tune --launch '...' --vary -np=1,2,4 --quick --concurrency 1,4 --out tune-out"""


@dataclass(frozen=True)
class Variant:
    name: str
    value: str
    command: str


def _replace_flag(command: str, flag: str, value: str) -> str:
    pat = re.compile(rf"(?<!\S){re.escape(flag)}(\s+|=)(\S+)")
    if pat.search(command):
        return pat.sub(lambda m: f"{flag}{m.group(1)}{shlex.quote(value)}", command, count=1)
    return f"{command} {flag} {shlex.quote(value)}"


def variants(command: str, vary: str | None, name: str | None = None) -> tuple[str, list[Variant]]:
    """(the flag, one variant per value) from ``{a,b}`` in the command or ``--vary FLAG=A,B``."""
    lists = [m for m in _BRACES.finditer(command) if m.group(0) != "{port}"]
    if vary and lists:
        raise UsageError("give the values either in the command ({1,2,4}) or with --vary, not both")
    if vary:
        flag, sep, vals = vary.partition("=")
        if not sep or not flag.startswith("-") or not vals:
            raise UsageError(f"--vary takes FLAG=V1,V2,... (e.g. -np=1,2,4), got {vary!r}")
        values = [v.strip() for v in vals.split(",") if v.strip()]
        commands = [_replace_flag(command, flag, v) for v in values]
    else:
        if len(lists) != 1:
            raise UsageError("tune sweeps one flag: put exactly one {a,b,...} list in the command (-np {1,2,4}), or "
                             "use --vary FLAG=A,B" if not lists else "tune sweeps one flag: the command has "
                             f"{len(lists)} {{...}} lists")  # fmt: skip
        m = lists[0]
        before = command[: m.start()]
        flag = before.rstrip().rstrip("=").split()[-1] if before.strip() else ""
        if not flag.startswith("-"):
            raise UsageError(f"cannot tell which flag {m.group(0)} belongs to: write it as FLAG {m.group(0)}")
        values = [v.strip() for v in m.group(1).split(",") if v.strip()]
        commands = [command[: m.start()] + v + command[m.end() :] for v in values]
    if len(values) < 2 or len(set(values)) != len(values):
        raise UsageError(f"tune needs at least two different values of {flag}, got {', '.join(values) or 'none'}")
    stem = re.sub(r"[^A-Za-z0-9]+", "", flag.lstrip("-")) or "v"
    names = [f"{name}-{stem}{re.sub(r'[^A-Za-z0-9_.-]+', '_', v)}" if name else
             f"{stem}{re.sub(r'[^A-Za-z0-9_.-]+', '_', v)}" for v in values]  # fmt: skip
    return flag, [Variant(n, v, c) for n, v, c in zip(names, values, commands, strict=True)]


def _slot_sweep(values: list[str]) -> tuple[int, ...] | None:
    """1, 2, 4, ... up to the largest slot count (each value included)."""
    try:
        top = max(int(v) for v in values)
    except ValueError:
        return None
    levels = {1, *(int(v) for v in values)}
    c = 1
    while c < top:
        levels.add(c)
        c *= 2
    return tuple(sorted(x for x in levels if x <= top))


def add_command(sub: Any) -> None:
    t = sub.add_parser("tune", help="sweep one llama-server flag, each value launched alone: keep tuning or compare "
                       "engines", description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    t.add_argument("--launch", required=True, metavar="'COMMAND'", help="the llama-server command (verbatim; "
                   "{port}: a free port), with one {a,b,...} list or with --vary")  # fmt: skip
    t.add_argument("--vary", metavar="FLAG=V1,V2,...", help="the flag to sweep and its values (-np=1,2,4,8)")
    t.add_argument("--name", help="prefix of the settings' names (default: the flag and value, e.g. np4)")
    t.add_argument("--config", metavar="FILE", help="bench settings in YAML (workload keys; flags win)")
    add_workload(t)
    t.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    import logging

    from proxy.bench.benchfile import read_bench_file
    from proxy.bench.cli import verdict_status
    from proxy.bench.config import Target
    from proxy.bench.report import load_bench, write_report
    from proxy.bench.runner import PreflightError, run_bench
    from proxy.bench.tunereport import summarize
    from proxy.launch import parse_launch
    from proxy.process import LaunchError
    from proxy.settings import SettingsError

    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        file = read_bench_file(args.config) if args.config else None
        if file is not None and file.engines:
            raise UsageError(f"{args.config}: tune takes its engine from --launch; engines: in the file are bench's")
        flag, vs = variants(args.launch, args.vary, args.name)
        for v in vs:
            parse_launch(v.name, v.command)
        targets = [Target(name=v.name, url=None, launch=v.command) for v in vs]
        sweep = _slot_sweep([v.value for v in vs]) if flag in SLOT_FLAGS else None
        over: dict[str, Any] = {"prompt_lengths": "medium", "cache": "cold"}
        if sweep and args.concurrency is None:
            over["concurrency"] = ",".join(map(str, sweep))
        cfg = build_config(args, file, targets, preset_over=over)
        if args.output_lengths is None:
            cfg.output_lengths = (cfg.max_tokens,)
        cfg.expected_differences = ("context",)
        cfg.tune = {"flag": flag, "values": [v.value for v in vs], "names": [v.name for v in vs],
                    "command": args.launch, "vary": args.vary}  # fmt: skip
        if cfg.out == Path("bench-out") and (args.out is None and (file is None or file.out is None)):
            cfg.out = Path("tune-out")
    except (UsageError, SettingsError, ValueError) as exc:
        print(f"enginemeter tune: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    interrupted = False
    try:
        asyncio.run(run_bench(cfg))
    except KeyboardInterrupt:
        interrupted = True
        print("\nenginemeter tune: interrupted — building the report from what finished", file=sys.stderr)
    except (PreflightError, LaunchError) as exc:
        print(f"enginemeter tune: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"enginemeter tune: {exc}", file=sys.stderr)
        return 2
    results = cfg.out / "results.jsonl"
    if not results.exists():
        return 130 if interrupted else 1
    data = load_bench(results)
    summary = summarize(data, cfg.out)
    out = write_report(data, cfg.out, lead=summary.blocks, extra={"tune": summary.to_json()})
    (cfg.out / "tune.json").write_text(summary.json_text(), encoding="utf-8")
    print(summary.table_text())
    for line in summary.lines:
        print(line)
    print(
        f"each setting against {flag} {vs[0].value} (the verdicts, their intervals and the noise floor): "
        f"{out['report_md']}, {out['report_html']}; tune.json and verdict.json beside them"
    )
    print(f"tune took {time.monotonic() - t0:.0f} s")
    return 130 if interrupted else verdict_status(out, fail_on_of(args, file))
