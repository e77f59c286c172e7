"""``enginemeter tune``: one llama-server flag swept, each setting launched alone, measured with the bench's
workload and statistics, then the rule applied — keep tuning llama.cpp, or compare engines next.

The sweep is one flag with a list of values, everything else fixed: ``--launch 'llama-server -m M -ngl 99 -np
{1,2,4,8}'`` (one ``{a,b,...}`` list in the command) or ``--launch 'llama-server -m M -ngl 99' --vary
-np=1,2,4,8`` (the flag's value replaced, or the flag added). Each setting is a launched engine of a time-shared
bench (``proxy.bench.run.timeshare``): launched alone, the same requests as every other setting (single request:
decode and TTFT; a concurrency sweep up to the largest slot count when the flag is ``-np``; GPU memory peak),
stopped; the first setting is the baseline and is launched again last (the A/A pass: the noise floor). Each
other setting is judged against the first by the bench's own verdict (``proxy.bench.verdict.decide``); the context per
slot a swept ``-np`` or ``-c`` changes is part of what is compared, not a parity failure. ``proxy.bench.report.tuning``
turns the verdicts into the table, the best setting per regime and the rule.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from proxy.bench.outdir import refusal
from proxy.bench.report.document import write_report
from proxy.bench.report.tuning import summarize
from proxy.bench.run.benchconfig import Target
from proxy.bench.run.benchfile import read_bench_file
from proxy.bench.run.options import UsageError, add_workload, build_config, fail_on_of
from proxy.bench.run.sweep import SLOT_FLAGS, slot_sweep, variants
from proxy.bench.verdict.data import load_bench
from proxy.cli.reporting import run_to_report
from proxy.cli.screen import wrapped
from proxy.config.settings import SettingsError
from proxy.procs.launch import parse_launch
from proxy.redact import write_private

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


def add_command(t: argparse.ArgumentParser) -> None:
    t.description, t.epilog = DESCRIPTION, EPILOG
    t.formatter_class = argparse.RawDescriptionHelpFormatter
    t.add_argument(
        "--launch",
        required=True,
        metavar="'COMMAND'",
        help="the llama-server command (verbatim; {port}: a free port), with one {a,b,...} list or with --vary",
    )
    t.add_argument("--vary", metavar="FLAG=V1,V2,...", help="the flag to sweep and its values (-np=1,2,4,8)")
    t.add_argument("--name", help="prefix of the settings' names (default: the flag and value, e.g. np4)")
    t.add_argument("--config", metavar="FILE", help="bench settings in YAML (workload keys; flags win)")
    add_workload(t)
    t.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        file = read_bench_file(args.config) if args.config else None
        if file is not None and file.engines:
            raise UsageError(f"{args.config}: tune takes its engine from --launch; engines: in the file are bench's")
        flag, vs = variants(args.launch, args.vary, args.name)
        for v in vs:
            parse_launch(v.name, v.command)
        targets = [Target(name=v.name, url=None, launch=v.command) for v in vs]
        sweep = slot_sweep([v.value for v in vs]) if flag in SLOT_FLAGS else None
        over: dict[str, Any] = {"prompt_lengths": "medium", "cache": "cold"}
        if sweep and args.concurrency is None:
            over["concurrency"] = ",".join(map(str, sweep))
        cfg = build_config(args, file, targets, preset_over=over)
        if args.output_lengths is None:
            cfg.output_lengths = (cfg.max_tokens,)
        cfg.expected_differences = ("context",)
        values, names = [v.value for v in vs], [v.name for v in vs]
        cfg.tune = {"flag": flag, "values": values, "names": names, "command": args.launch, "vary": args.vary}
        if cfg.out == Path("bench-out") and (args.out is None and (file is None or file.out is None)):
            cfg.out = Path("tune-out")
        if why := refusal(cfg.out, force=args.force):
            raise UsageError(why)
    except (UsageError, SettingsError, ValueError) as exc:
        print(f"enginemeter tune: {exc}", file=sys.stderr)
        return 2

    def report(results: Path) -> dict[str, Any]:
        data = load_bench(results)
        summary = summarize(data, cfg.out)
        out = write_report(data, cfg.out, lead=summary.blocks, extra={"tune": summary.to_json()})
        write_private(cfg.out / "tune.json", summary.json_text())
        print(summary.table_text())
        for line in summary.lines:
            print("\n".join(wrapped(line)))
        print(
            f"each setting against {flag} {vs[0].value} (the verdicts, their intervals and the noise floor): "
            f"{out['report_md']}, {out['report_html']}; tune.json and verdict.json beside them"
        )
        return out

    return run_to_report("tune", cfg, report, fail_on_of(args, file))
