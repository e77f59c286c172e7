"""What the commands that end in a verdict share (``bench``, ``tune``, ``report``): the bench and tune commands'
one skeleton (run -> interrupt -> report -> exit status), ``--traffic`` and ``--weights``, the summary printed
and the exit status ``--fail-on`` asks for."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.bench.live.trafficsource import traffic_from
from proxy.bench.run.benchconfig import BenchConfig
from proxy.bench.run.options import EXIT_VERDICT
from proxy.bench.run.prepare import PreflightError
from proxy.bench.run.runner import run_bench
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.inputs import Traffic
from proxy.cli.screen import first_screen
from proxy.procs.process import LaunchError

ACCEPT_HELP = (
    "a quantization difference between the engines is declared, not a mistake: the parity gate passes with a "
    "caveat and the verdict is computed and marked *discounted* (it includes the precision difference; a "
    "same-weights comparison is the clean test)"
)


def run_to_report(
    command: str,
    cfg: BenchConfig,
    report: Callable[[Path], dict[str, Any]],
    fail_on: frozenset[str] | None,
    failed: Callable[[Exception], int] | None = None,
) -> int:
    """Run ``cfg``'s bench, then ``report`` of whatever it wrote (the results file), then the exit status: 0, ``EXIT_VERDICT``
    (a verdict ``--fail-on`` names), 130 (interrupted: the report is of what finished), 2 (the run could not go on:
    ``failed`` says what to print and leave behind), 1 (nothing was measured)."""
    t0 = time.monotonic()
    interrupted = False
    try:
        asyncio.run(run_bench(cfg))
    except KeyboardInterrupt:
        interrupted = True
        print(f"\nenginemeter {command}: interrupted — building the report from what finished", file=sys.stderr)
    except (PreflightError, LaunchError) as exc:
        if failed is not None:
            return failed(exc)
        print(f"enginemeter {command}: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"enginemeter {command}: {exc}", file=sys.stderr)
        return 2
    results = cfg.out / "results.jsonl"
    if not results.exists():
        return 130 if interrupted else 1
    out = report(results)
    print(f"{command} took {time.monotonic() - t0:.0f} s")
    if interrupted:
        return 130
    return verdict_status(out, fail_on)


TRAFFIC_HELP = (
    "decide for this traffic: shares of busy time at each concurrency (c1=30,c16=70; prompt-length "
    "shares may follow: short=90,16k=10), or the proxy's own record of it: its comparison or request log "
    "(a path), its /metrics URL, or a Prometheus server's URL (the last --traffic-window)"
)


def add_traffic(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traffic", metavar="SPEC|PATH|URL", help=TRAFFIC_HELP)
    p.add_argument(
        "--traffic-window",
        default="7d",
        metavar="DURATION",
        help="with --traffic PROMETHEUS_URL: the window to take the profile over (default %(default)s)",
    )
    p.add_argument(
        "--weights",
        action="append",
        metavar="random|NAME=random",
        help="declare random weights (every engine, or one): greedy agreement then says it cannot be "
        "judged; found by itself for --load-format dummy and models enginemeter generated",
    )


def random_declared(args: argparse.Namespace) -> dict[str, str] | None:
    """``--weights``: engine -> why ("*" for every engine); None: nothing declared. A ``ValueError`` names a
    mistake."""
    given = getattr(args, "weights", None)
    if not given:
        return None
    out: dict[str, str] = {}
    for w in given:
        name, sep, what = w.rpartition("=")
        if what != "random":
            raise ValueError(f"--weights {w!r}: expected random or NAME=random")
        out[name if sep else "*"] = "declared: --weights " + w
    return out


def with_random(data: Data, declared: dict[str, str] | None) -> Data:
    if declared:
        names = [e.name for e in data.results.engines]
        every = declared.get("*")
        add = {n: every or declared[n] for n in names if every or n in declared}
        unknown = sorted(set(declared) - {"*", *names})
        if unknown:
            raise ValueError(f"--weights {unknown[0]}=random: no engine named {unknown[0]}")
        data.results = dataclasses.replace(data.results, random_weights={**data.results.random_weights, **add})
    return data


def traffic_of(args: argparse.Namespace) -> Traffic | None:
    """``--traffic``'s profile (a ``ValueError`` names a bad spec); None without one."""
    spec = getattr(args, "traffic", None)
    if not spec:
        return None
    return traffic_from(spec, window=getattr(args, "traffic_window", "7d"))


def with_traffic(data: Data, traffic: Traffic | None) -> Data:
    """``data`` to be decided for ``traffic`` (unchanged without one)."""
    if traffic is not None:
        data.results = dataclasses.replace(data.results, traffic=traffic)
    return data


def verdict_status(out: dict[str, Any], fail_on: frozenset[str] | None) -> int:
    hit = [v for v in out["verdicts"] if fail_on and v.decision in fail_on]
    if hit:
        named = "; ".join(f"{v.candidate} {v.decision}" for v in hit)
        print(f"enginemeter: --fail-on {','.join(sorted(fail_on or ()))}: {named}", file=sys.stderr)
        return EXIT_VERDICT
    return 0


def print_summary(out: dict[str, Any]) -> None:
    """The first screen (``proxy.cli.screen``): the table, the answer once, the caveats, the files."""
    for line in first_screen(out):
        print(line)


def print_files(out: dict[str, Any]) -> None:
    """Only the files written (the answer was printed before them)."""
    for line in first_screen({**out, "verdicts": [], "headline": None})[1:]:
        print(line)
