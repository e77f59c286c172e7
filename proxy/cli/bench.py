"""``enginemeter bench``: engines measured on the same requests (resident, or launched one at a time on the GPU),
then the verdict through the gates and the report (``proxy.bench``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from proxy.bench.outdir import refusal
from proxy.bench.report.document import write_report
from proxy.bench.run.benchconfig import Target
from proxy.bench.run.benchfile import read_bench_file
from proxy.bench.run.options import Targets, UsageError, add_workload, build_config, fail_on_of, pairs
from proxy.bench.run.prepare import PreflightError
from proxy.bench.verdict.data import load_bench
from proxy.cli.reporting import (
    ACCEPT_HELP,
    add_traffic,
    print_summary,
    random_declared,
    run_to_report,
    traffic_of,
    with_random,
    with_traffic,
)
from proxy.config.settings import SettingsError
from proxy.procs.launch import parse_launch
from proxy.redact import write_private


def add_command(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "--engine",
        action=Targets,
        const="url",
        dest="targets",
        metavar="NAME=URL",
        help="a running engine (repeat; with --through, URL may be empty: NAME=)",
    )
    b.add_argument(
        "--launch",
        action=Targets,
        const="launch",
        dest="targets",
        metavar="NAME='COMMAND'",
        help="an engine enginemeter starts from COMMAND (verbatim; {port}: a free port), measures alone and stops; "
        "repeatable, mixable with --engine. Launched engines run one at a time: baseline, candidates, the baseline "
        "launched again (A/A)",
    )
    b.add_argument("--config", metavar="FILE", help="bench settings in YAML (keys = these flags; flags win)")
    b.add_argument("--through", metavar="PROXY_URL", help="send via the enginemeter proxy, pinning each engine")
    b.add_argument("--metrics-url", help="Prometheus text endpoint for GPU memory (default: PROXY_URL/metrics)")
    b.add_argument("--baseline", help="the incumbent engine (default: the first engine)")
    b.add_argument("--quantization", action="append", metavar="NAME=QUANT", help="declare an engine's quantization")
    b.add_argument("--accept-quantization-difference", action="store_true", default=None, help=ACCEPT_HELP)
    add_workload(b)
    add_traffic(b)
    b.set_defaults(func=_bench)


def targets_of(args: argparse.Namespace, file: Any) -> list[Any]:
    """The engines, the file's first, then ``--engine``/``--launch`` in the order given; checked."""
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
        url = (value.rstrip("/") or None) if kind == "url" else None
        launch = value if kind == "launch" else None
        out.append(
            Target(name=name, url=url, launch=launch, quantization=q, quantization_source="declared" if q else None)
        )
    unknown = sorted(set(quant) - seen)
    if unknown:
        raise UsageError(f"--quantization {unknown[0]}=...: no engine named {unknown[0]}")
    return out


def _bench(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress bar
    try:
        file = read_bench_file(args.config) if args.config else None
        targets = targets_of(args, file)
        cfg = build_config(args, file, targets)
        _check(cfg)
        if why := refusal(cfg.out, force=args.force):
            raise UsageError(why)
        traffic = traffic_of(args)  # read now: a mistake in it must not wait for the end of the run
        declared = random_declared(args)
    except (UsageError, SettingsError, ValueError) as exc:
        print(f"enginemeter bench: {exc}", file=sys.stderr)
        return 2

    def failed(exc: Exception) -> int:
        if isinstance(exc, PreflightError):
            print(f"enginemeter bench: preflight failed: {exc}", file=sys.stderr)
            _stopped_verdict(cfg.out, "preflight", "reachable", engine=exc.engine, url=exc.url, cause=exc.cause)
            return 2
        print(f"enginemeter bench: launch failed: {exc}", file=sys.stderr)
        head = str(exc).split("\n", 1)[0]
        check = "memory" if "did not come back" in head else "ready"
        _stopped_verdict(cfg.out, "launch", check, cause=head, log_tail=getattr(exc, "log_tail", None) or None)
        if (cfg.out / "results.jsonl").exists():
            print(
                f"enginemeter bench: what finished is in {cfg.out / 'results.jsonl'} (enginemeter report --results "
                "builds a report from it)",
                file=sys.stderr,
            )
        return 2

    def report(results: Path) -> dict[str, Any]:
        out = write_report(
            with_random(with_traffic(load_bench(results, baseline=cfg.baseline), traffic), declared), cfg.out
        )
        print_summary(out)
        return out

    return run_to_report("bench", cfg, report, fail_on_of(args, file), failed)


def _check(cfg: Any) -> None:
    if not cfg.engines:
        raise UsageError(
            "give at least one engine: --engine NAME=URL or --launch NAME='COMMAND' (one engine is a measurement to "
            "join with another run: report --results A B)"
        )
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
    stopped_at = {"gate": gate, "check": check}
    doc = {"version": 1, "decision": "inconclusive", "stopped_at": stopped_at, **facts, "verdicts": []}
    write_private(out / "verdict.json", json.dumps(doc, indent=2) + "\n")
