"""``enginemeter report``: the report again — from bench results (one run, or several joined when comparable) or
from the proxy's comparison log (mirrored live traffic, the anytime-valid verdict per regime)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from proxy.bench.live.livedata import expand, load_live, proxy_info
from proxy.bench.live.log import parse_time
from proxy.bench.outdir import refusal
from proxy.bench.report.document import write_report
from proxy.bench.report.livereport import write_live_report
from proxy.bench.report.tuning import summarize
from proxy.bench.run.options import (
    EXIT_VERDICT,
    MAX_ERROR_RATE_HELP,
    MIN_EFFECT_HELP,
    fail_on,
    pairs,
    percent_arg,
    size_arg,
)
from proxy.bench.verdict.inputs import MAX_ERROR_RATE, MIN_EFFECT
from proxy.bench.verdict.merge import load_runs
from proxy.cli.reporting import (
    ACCEPT_HELP,
    add_traffic,
    print_files,
    print_summary,
    random_declared,
    traffic_of,
    verdict_status,
    with_random,
    with_traffic,
)
from proxy.cli.screen import wrapped

RESULTS = ("results.jsonl", "results.jsonl.gz")


def add_command(r: argparse.ArgumentParser) -> None:
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--log", nargs="+", metavar="PATH", help="the proxy's comparison log(s): paths or globs (+ rotated x.jsonl.N)"
    )
    src.add_argument(
        "--results",
        nargs="+",
        metavar="RESULTS",
        help="a bench results.jsonl (or .gz, or the bench's --out directory); several: separate runs joined when "
        "comparable (same suite, sampling, max tokens, GPU), else refused naming the difference; an engine name in "
        "two files is the same engine measured again (its A/A pass)",
    )
    r.add_argument("--out", required=True, help="output directory (one holding another run's results.jsonl is refused)")
    r.add_argument("--force", action="store_true", help="write into an --out that holds another run's results")
    r.add_argument("--baseline", help="the incumbent engine (default: the log's primary / the bench's baseline)")
    r.add_argument("--quantization", action="append", metavar="NAME=QUANT", help="declare an engine's quantization")
    r.add_argument("--accept-quantization-difference", action="store_true", help=ACCEPT_HELP)
    r.add_argument("--blocks", type=int, default=5, help="log: consecutive blocks standing in for repeats")
    r.add_argument(
        "--proxy",
        metavar="URL",
        help="log: read engine info (quantization, context, slots), GPU memory and GPU sharing from this running "
        "proxy's /health and /metrics (a proxy with api_keys: its key in ENGINEMETER_PROXY_KEY)",
    )
    r.add_argument("--memory-budget", help="log: GPU memory the candidate must fit in (e.g. 80GiB)")
    r.add_argument("--min-effect", type=percent_arg, metavar="PCT", help=MIN_EFFECT_HELP + "; default: the run's own")
    r.add_argument(
        "--run",
        metavar="ID|all",
        help="log: the proxy run to report (an id or its prefix, as the serve banner prints it; all: every run in "
        "the log); default: the latest run",
    )
    r.add_argument(
        "--since", metavar="TIME", help="log: pairs started at or after TIME (Unix s, ISO 8601, or 30m/2h/1d ago)"
    )
    r.add_argument("--until", metavar="TIME", help="log: pairs started at or before TIME")
    r.add_argument("--primary", metavar="NAME", help="log: only pairs mirrored from this primary engine")
    r.add_argument("--shadow", metavar="NAME", help="log: only pairs mirrored to this shadow engine")
    r.add_argument(
        "--max-error-rate",
        type=percent_arg,
        metavar="PCT",
        help=MAX_ERROR_RATE_HELP + "; default: the run's own (a log: 2)",
    )
    r.add_argument(
        "--fail-on",
        type=fail_on,
        metavar="stay,partial,inconclusive",
        help=f"exit {EXIT_VERDICT} on these verdicts (inconclusive includes partial)",
    )
    add_traffic(r)
    r.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    try:
        quant = pairs(args.quantization, "--quantization")
        inputs = [Path(p) for p in args.results or ()]
        keep = tuple(q for p in inputs for q in ([p / n for n in RESULTS] if p.is_dir() else [p]))
        if why := refusal(Path(args.out), force=args.force, files=RESULTS, keep=keep):
            raise ValueError(why)
        if args.log:
            return _report_log(args, quant)
        data = load_runs(
            [Path(p) for p in args.results],
            baseline=args.baseline,
            quantization=quant,
            min_effect=args.min_effect,
            max_error_rate=args.max_error_rate,
            accept_quantization_difference=args.accept_quantization_difference,
        )
        data = with_random(with_traffic(data, traffic_of(args)), random_declared(args))
    except (ValueError, OSError, KeyError) as exc:
        print(f"enginemeter report: {exc}", file=sys.stderr)
        return 2
    lead, extra = [], {}
    if len(data.runs) == 1 and (data.runs[0].get("config") or {}).get("tune"):  # a tune run: its table first
        summary = summarize(data, Path(args.out))
        lead, extra = summary.blocks, {"tune": summary.to_json()}
        print(summary.table_text())
        for line in summary.lines:
            print("\n".join(wrapped(line)))
    out = write_report(data, Path(args.out), lead=lead, extra=extra)
    if lead:  # a tune run: its table and rule are the answer, as tune's own terminal prints them
        print_files(out)
    else:
        print_summary(out)
    return verdict_status(out, args.fail_on)


def _report_log(args: argparse.Namespace, quant: dict[str, str]) -> int:
    try:
        info = proxy_info(args.proxy) if args.proxy else None
        if info is not None and info.error:
            print(
                f"enginemeter report: the proxy at {args.proxy} did not answer ({info.error}); reporting from "
                "the log alone (no GPU memory)",
                file=sys.stderr,
            )
        lives = load_live(
            expand(args.log),
            run=args.run,
            since=parse_time(args.since) if args.since else None,
            until=parse_time(args.until) if args.until else None,
            primary=args.primary or args.baseline,
            shadow=args.shadow,
            quantization=quant,
            blocks=args.blocks,
            proxy=info,
            memory_budget_bytes=size_arg(args.memory_budget),
            min_effect=MIN_EFFECT if args.min_effect is None else args.min_effect,
            max_error_rate=MAX_ERROR_RATE if args.max_error_rate is None else args.max_error_rate,
        )
        declared = random_declared(args)
        for live in lives:
            with_random(live.data, declared)
    except (ValueError, OSError, KeyError) as exc:
        print(f"enginemeter report: {exc}", file=sys.stderr)
        return 2
    status = 0
    for live in lives:
        # one report per primary: its own directory when the log mirrored from several
        out = write_live_report(live, Path(args.out) if len(lives) == 1 else Path(args.out) / live.primary)
        for line in [f"comparison log: {live.selection.read}", *live.selection.notes]:
            print(f"note: {line}")
        for line in live.selection.warnings:
            print(f"warning: {line}", file=sys.stderr)
        for shadow, v in out["live"].items():
            for line in v.lines():
                print(f"live {shadow} vs {live.primary}: {line}")
        print_summary(out)
        status = max(status, verdict_status(out, args.fail_on))
    return status
