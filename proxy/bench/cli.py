"""``enginemeter bench``, ``report``, ``tune`` and ``diagnose``: registered on the main CLI by ``add_commands``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from proxy.bench.options import (
    EXIT_VERDICT,
    MAX_ERROR_RATE_HELP,
    MIN_EFFECT_HELP,
    Targets,
    UsageError,
    add_workload,
    build_config,
    fail_on,
    fail_on_of,
    pairs,
    pct,
    size_bytes,
)

ACCEPT_HELP = (
    "a quantization difference between the engines is declared, not a mistake: the parity gate passes with a "
    "caveat and the verdict is computed and marked *discounted* (it includes the precision difference; a "
    "same-weights comparison is the clean test)"
)


def add_commands(sub: Any) -> None:
    b = sub.add_parser("bench", help="offline A/B bench of engines (resident or launched one at a time), a verdict")
    b.add_argument("--engine", action=Targets, const="url", dest="targets", metavar="NAME=URL",
                   help="a running engine (repeat; with --through, URL may be empty: NAME=)")  # fmt: skip
    b.add_argument("--launch", action=Targets, const="launch", dest="targets", metavar="NAME='COMMAND'",
                   help="an engine enginemeter starts from COMMAND (verbatim; {port}: a free port), measures alone "
                   "and stops; repeatable, mixable with --engine. Launched engines run one at a time: baseline, "
                   "candidates, the baseline launched again (A/A)")  # fmt: skip
    b.add_argument("--config", metavar="FILE", help="bench settings in YAML (keys = these flags; flags win)")
    b.add_argument("--through", metavar="PROXY_URL", help="send via the enginemeter proxy, pinning each engine")
    b.add_argument("--metrics-url", help="Prometheus text endpoint for GPU memory (default: PROXY_URL/metrics)")
    b.add_argument("--baseline", help="the incumbent engine (default: the first engine)")
    b.add_argument("--quantization", action="append", metavar="NAME=QUANT", help="declare an engine's quantization")
    b.add_argument("--accept-quantization-difference", action="store_true", default=None, help=ACCEPT_HELP)
    add_workload(b)
    b.set_defaults(func=_bench)

    r = sub.add_parser("report", help="build the report from bench results or the proxy's comparison log")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--log", nargs="+", metavar="PATH", help="the proxy's comparison log(s): paths or globs (+ rotated x.jsonl.N)"
    )
    src.add_argument("--results", nargs="+", metavar="RESULTS", help="a bench results.jsonl; several: separate runs "
                     "joined when comparable (same suite, sampling, max tokens, GPU), else refused naming the "
                     "difference; an engine name in two files is the same engine measured again (its A/A pass)")  # fmt: skip
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--baseline", help="the incumbent engine (default: the log's primary / the bench's baseline)")
    r.add_argument("--quantization", action="append", metavar="NAME=QUANT", help="declare an engine's quantization")
    r.add_argument("--accept-quantization-difference", action="store_true", help=ACCEPT_HELP)
    r.add_argument("--blocks", type=int, default=5, help="log: consecutive blocks standing in for repeats")
    r.add_argument("--proxy", metavar="URL", help="log: read engine info (quantization, context, slots), GPU memory "
                   "and GPU sharing from this running proxy's /health and /metrics (a proxy with api_keys: its "
                   "key in ENGINEMETER_PROXY_KEY)")  # fmt: skip
    r.add_argument("--memory-budget", help="log: GPU memory the candidate must fit in (e.g. 80GiB)")
    r.add_argument("--min-effect", type=pct, metavar="PCT", help=MIN_EFFECT_HELP + "; default: the run's own")
    r.add_argument("--run", metavar="ID|all", help="log: the proxy run to report (an id or its prefix, as the "
                   "serve banner prints it; all: every run in the log); default: the latest run")  # fmt: skip
    r.add_argument("--since", metavar="TIME", help="log: pairs started at or after TIME (Unix s, ISO 8601, or "
                   "30m/2h/1d ago)")  # fmt: skip
    r.add_argument("--until", metavar="TIME", help="log: pairs started at or before TIME")
    r.add_argument("--primary", metavar="NAME", help="log: only pairs mirrored from this primary engine")
    r.add_argument("--shadow", metavar="NAME", help="log: only pairs mirrored to this shadow engine")
    r.add_argument("--max-error-rate", type=pct, metavar="PCT", help=MAX_ERROR_RATE_HELP + "; default: the run's "
                   "own (a log: 2)")  # fmt: skip
    r.add_argument("--fail-on", type=fail_on, metavar="stay,partial,inconclusive",
                   help=f"exit {EXIT_VERDICT} on these verdicts (inconclusive includes partial)")  # fmt: skip
    r.set_defaults(func=_report)

    from proxy.bench.diagnose import add_command as add_diagnose
    from proxy.bench.tune import add_command as add_tune

    add_diagnose(sub)
    add_tune(sub)


def targets_of(args: argparse.Namespace, file: Any) -> list[Any]:
    """The engines, the file's first, then ``--engine``/``--launch`` in the order given; checked."""
    from proxy.bench.config import Target
    from proxy.launch import parse_launch

    given: list[tuple[str, str, str, str | None]] = []  # (kind, name, value, declared quantization)
    for e in file.engines if file is not None else ():
        given.append(("launch" if e.launch else "url", e.name, e.launch or e.url or "", e.quantization))
    for kind, item in getattr(args, "targets", None) or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            flag = "--launch NAME='COMMAND'" if kind == "launch" else "--engine NAME=URL"
            raise UsageError(f"{flag}: got {item!r}")
        given.append((kind, name.strip(), value.strip(), None))
    quant = pairs(getattr(args, "quantization", None), "--quantization")
    seen: set[str] = set()
    out = []
    for kind, name, value, q in given:
        if name in seen:
            raise UsageError(f"engine {name} is given twice")
        seen.add(name)
        if kind == "launch":
            try:
                parse_launch(name, value)  # the command is read now: a mistake stops the bench before any launch
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        q = quant.get(name) or q
        out.append(Target(name=name, url=(value.rstrip("/") or None) if kind == "url" else None,
                          launch=value if kind == "launch" else None, quantization=q,
                          quantization_source="declared" if q else None))  # fmt: skip
    unknown = sorted(set(quant) - seen)
    if unknown:
        raise UsageError(f"--quantization {unknown[0]}=...: no engine named {unknown[0]}")
    return out


def _bench(args: argparse.Namespace) -> int:
    import logging

    from proxy.bench.benchfile import read_bench_file
    from proxy.bench.report import load_bench, write_report
    from proxy.bench.runner import PreflightError, run_bench
    from proxy.process import LaunchError
    from proxy.settings import SettingsError

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress bar
    try:
        file = read_bench_file(args.config) if args.config else None
        targets = targets_of(args, file)
        cfg = build_config(args, file, targets)
        _check(cfg)
    except (UsageError, SettingsError) as exc:
        print(f"enginemeter bench: {exc}", file=sys.stderr)
        return 2
    fail = fail_on_of(args, file)
    t0 = time.monotonic()
    interrupted = False
    try:
        asyncio.run(run_bench(cfg))
    except KeyboardInterrupt:
        interrupted = True
        print("\nenginemeter bench: interrupted — building the report from what finished", file=sys.stderr)
    except PreflightError as exc:
        print(f"enginemeter bench: preflight failed: {exc}", file=sys.stderr)
        _stopped_verdict(cfg.out, "preflight", "reachable", engine=exc.engine, url=exc.url, cause=exc.cause)
        return 2
    except LaunchError as exc:
        print(f"enginemeter bench: launch failed: {exc}", file=sys.stderr)
        head = str(exc).split("\n", 1)[0]
        _stopped_verdict(cfg.out, "launch", "memory" if "did not come back" in head else "ready", cause=head,
                         log_tail=exc.log_tail or None)  # fmt: skip
        if (cfg.out / "results.jsonl").exists():
            print(f"enginemeter bench: what finished is in {cfg.out / 'results.jsonl'} (enginemeter report --results "
                  "builds a report from it)", file=sys.stderr)  # fmt: skip
        return 2
    except (ValueError, OSError) as exc:
        print(f"enginemeter bench: {exc}", file=sys.stderr)
        return 2
    results = cfg.out / "results.jsonl"
    if not results.exists():
        return 130 if interrupted else 1
    data = load_bench(results, baseline=cfg.baseline)
    out = write_report(data, cfg.out)
    print_summary(out, time.monotonic() - t0)
    if interrupted:
        return 130
    return verdict_status(out, fail)


def _check(cfg: Any) -> None:
    if not cfg.engines:
        raise UsageError("give at least one engine: --engine NAME=URL or --launch NAME='COMMAND' (one engine is a "
                         "measurement to join with another run: report --results A B)")  # fmt: skip
    if cfg.through and not cfg.model:
        raise UsageError("--through needs --model (the proxy's model alias)")
    if cfg.through and cfg.time_shared:
        raise UsageError("--through and --launch do not mix: the proxy's engines are its own")
    for t in cfg.engines:
        if not t.url and not t.launch and not cfg.through:
            raise UsageError(f"engine {t.name} has no URL (NAME=URL)")
    if cfg.baseline not in {t.name for t in cfg.engines}:
        raise UsageError(f"--baseline {cfg.baseline} is not an engine")


def _stopped_verdict(out: Path, gate: str, check: str, **facts: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"version": 1, "decision": "inconclusive", "stopped_at": {"gate": gate, "check": check}, **facts,
           "verdicts": []}  # fmt: skip
    (out / "verdict.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def verdict_status(out: dict[str, Any], fail_on: frozenset[str] | None) -> int:
    hit = [v for v in out["verdicts"] if fail_on and v.decision in fail_on]
    if hit:
        print(f"enginemeter: --fail-on {','.join(sorted(fail_on or ()))}: " + "; ".join(
            f"{v.candidate} {v.decision}" for v in hit), file=sys.stderr)  # fmt: skip
        return EXIT_VERDICT
    return 0


def _report(args: argparse.Namespace) -> int:
    from proxy.bench.merge import load_runs
    from proxy.bench.report import write_report

    try:
        quant = pairs(args.quantization, "--quantization")
        if args.log:
            return _report_log(args, quant)
        data = load_runs([Path(p) for p in args.results], baseline=args.baseline, quantization=quant,
                         min_effect=args.min_effect, max_error_rate=args.max_error_rate,
                         accept_quantization_difference=args.accept_quantization_difference)  # fmt: skip
    except (ValueError, OSError, KeyError) as exc:
        print(f"enginemeter report: {exc}", file=sys.stderr)
        return 2
    lead, extra = [], {}
    if len(data.runs) == 1 and (data.runs[0].get("config") or {}).get("tune"):  # a tune run: its table first
        from proxy.bench.tunereport import summarize

        summary = summarize(data, Path(args.out))
        lead, extra = summary.blocks, {"tune": summary.to_json()}
        for line in [summary.table_text(), *summary.lines]:
            print(line)
    out = write_report(data, Path(args.out), lead=lead, extra=extra)
    print_summary(out, None)
    return verdict_status(out, args.fail_on)


def _report_log(args: argparse.Namespace, quant: dict[str, str]) -> int:
    from proxy.bench.livelog import parse_time
    from proxy.bench.livereport import write_live_report
    from proxy.bench.logreport import expand, load_live, proxy_info
    from proxy.bench.model import MAX_ERROR_RATE, MIN_EFFECT

    try:
        info = proxy_info(args.proxy) if args.proxy else None
        if info is not None and info.error:
            print(f"enginemeter report: the proxy at {args.proxy} did not answer ({info.error}); reporting from "
                  "the log alone (no GPU memory)", file=sys.stderr)  # fmt: skip
        lives = load_live(
            expand(args.log), run=args.run, since=parse_time(args.since) if args.since else None,
            until=parse_time(args.until) if args.until else None, primary=args.primary or args.baseline,
            shadow=args.shadow, quantization=quant, blocks=args.blocks, proxy=info,
            memory_budget_bytes=size_bytes(args.memory_budget),
            min_effect=MIN_EFFECT if args.min_effect is None else args.min_effect, max_error_rate=MAX_ERROR_RATE if args.max_error_rate is None else args.max_error_rate,
        )  # fmt: skip
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
        print_summary(out, None)
        status = max(status, verdict_status(out, args.fail_on))
    return status


def print_summary(out: dict[str, Any], took_s: float | None) -> None:
    for v in out["verdicts"]:
        tag = " (discounted)" if v.discounted else ""
        print(f"verdict {v.candidate} vs {v.baseline}: {v.decision.upper()}{tag} — {v.summary}")
        if v.discounted:
            print(f"  discounted: {v.discounted}")
        if v.next_step:
            print(f"  next: {v.next_step}")
    for line in out.get("arms_lines", ()):
        print(line)
    if not out["verdicts"]:
        print("one engine measured: nothing to compare here (join runs with: enginemeter report --results A B)")
    print(f"report: {out['report_md']}, {out['report_html']} and {out['verdict_json']}")
    if took_s is not None:
        print(f"bench took {took_s:.0f} s")
