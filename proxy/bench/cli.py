"""``enginemeter bench`` and ``enginemeter report``: registered on the main CLI by ``add_commands``."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path
from typing import Any

QUICK = {
    "concurrency": "1,2",
    "output_lengths": "16",
    "prompt_lengths": "short,medium",
    "repeats": 3,
    "warmup": 1,
    "cache": "cold",
    "max_tokens": 16,
    "waves": 2,
}
DEFAULTS = {
    "concurrency": "1,2,4,8",
    "output_lengths": "32,128",
    "prompt_lengths": "short,medium,long,4k,16k,32k",  # the token-sized ones where the context holds them
    "repeats": 3,
    "warmup": 2,
    "cache": "both",
    "max_tokens": 128,
    "waves": 2,
}


def _ints(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _floats(s: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {s!r}")
    return vals


def _fail_on(s: str) -> frozenset[str]:
    vals = frozenset(x.strip() for x in s.split(",") if x.strip())
    if not vals or not vals <= {"stay", "partial", "inconclusive"}:
        raise argparse.ArgumentTypeError(f"--fail-on takes stay, partial, inconclusive (comma-separated), got {s!r}")
    if "inconclusive" in vals:  # a partial answer is inconclusive about what it did not measure
        vals |= {"partial"}
    return vals


def _pct(s: str) -> float:
    try:
        v = float(s.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage (e.g. 5 or 5%), got {s!r}") from None
    if not 0 <= v < 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in [0, 100), got {s!r}")
    return v / 100


MIN_EFFECT_HELP = (
    "practical significance: a difference smaller than PCT %% is never a win or a loss, and a tie means "
    "'within ±PCT %%' (default 5; a noise floor wider than this is used instead for wins and blocks ties)"
)


#: exit status when a verdict matches --fail-on (2 is a usage or preflight error, 130 an interrupt)
EXIT_VERDICT = 3


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"enginemeter: {what} must be NAME=VALUE, got {item!r}")
        out[name] = value
    return out


_SIZE = re.compile(r"(?i)^\s*([0-9.]+)\s*([kmgt]i?b?)?\s*$")


def _bytes(s: str | None) -> int | None:
    if s is None:
        return None
    m = _SIZE.match(s)
    if not m:
        raise SystemExit(f"enginemeter: cannot read size {s!r} (e.g. 80GiB, 24G, 1073741824)")
    mult = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}.get((m.group(2) or " ")[0].lower(), 1)
    return int(float(m.group(1)) * mult)


def add_commands(sub: Any) -> None:
    b = sub.add_parser("bench", help="offline A/B bench of two or more engines, ending in a verdict")
    b.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="an engine (repeat; at least two). With --through, URL may be empty (NAME=)",
    )
    b.add_argument("--through", metavar="PROXY_URL", help="send via the enginemeter proxy, pinning each engine")
    b.add_argument(
        "--metrics-url", help="Prometheus text endpoint for GPU memory (default: PROXY_URL/metrics with --through)"
    )
    b.add_argument("--suite", default="builtin", help="builtin | FILE.jsonl | sharegpt.json")
    b.add_argument("--concurrency", type=_ints, help=f"sweep (default {DEFAULTS['concurrency']})")
    b.add_argument("--output-lengths", type=_ints, help=f"max_tokens sweep (default {DEFAULTS['output_lengths']})")
    b.add_argument("--prompt-lengths", help=f"sweep (default {DEFAULTS['prompt_lengths']})")
    b.add_argument("--repeats", type=int, help="repeats per cell (default 3; fewer makes the verdict inconclusive)")
    b.add_argument("--warmup", type=int, help="warm-up requests per engine, discarded (default 2)")
    b.add_argument("--cache", choices=("cold", "warm", "both"), help="prompt-cache phases (default both)")
    b.add_argument(
        "--no-prompt-cache", action="store_true", help="cold phase: also send cache_prompt:false to llama.cpp"
    )
    b.add_argument("--waves", type=int, help="requests per cell repeat = concurrency × waves (default 2)")
    b.add_argument("--requests", type=int, help="requests per cell repeat (instead of concurrency × waves)")
    b.add_argument(
        "--duration", type=float, metavar="S", help="send for S seconds per cell repeat (instead of a count)"
    )
    b.add_argument(
        "--request-rate",
        type=_floats,
        metavar="R[,R...]",
        help="open-loop arrivals at R requests/s (a sweep replacing the concurrency sweep; at most max(--concurrency) "
        "in flight)",
    )
    b.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson, <1 burstier)"
    )
    b.add_argument("--goodput", metavar="ttft:MS,tpot:MS,e2el:MS", help="SLOs for goodput (requests meeting all)")
    b.add_argument(
        "--aa",
        choices=("auto", "off"),
        default="auto",
        help="A/A noise floor: a second pass of the baseline in every cell repeat (auto; an engine listed twice "
        "with the same URL is used instead) or none (off: the run-to-run variation stands in)",
    )
    b.add_argument("--min-effect", type=_pct, metavar="PCT", help=MIN_EFFECT_HELP)
    b.add_argument(
        "--fail-on",
        type=_fail_on,
        metavar="stay,partial,inconclusive",
        help=f"exit {EXIT_VERDICT} when a verdict is one of these (inconclusive includes partial)",
    )
    b.add_argument(
        "--out", default="bench-out", help="output directory (results.jsonl, report.md/.html, SVG charts, verdict.json)"
    )
    b.add_argument("--model", help="model name to send (default: each engine's /v1/models; required with --through)")
    b.add_argument("--seed", type=int, default=1234)
    b.add_argument("--max-tokens", type=int, help="base max_tokens (default 128)")
    b.add_argument("--no-ignore-eos", action="store_true", help="let engines stop at EOS (output lengths may differ)")
    b.add_argument("--baseline", help="the incumbent engine (default: the first --engine)")
    b.add_argument("--quantization", action="append", metavar="NAME=QUANT", help="declare an engine's quantization")
    b.add_argument("--memory-budget", help="GPU memory the candidate must fit in (e.g. 80GiB)")
    b.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    b.add_argument(
        "--quick", action="store_true", help="CI-sized preset: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_bench)

    r = sub.add_parser("report", help="build the report from bench results or the proxy's comparison log")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--log", nargs="+", metavar="PATH", help="the proxy's comparison log(s): paths or globs (rotated x.jsonl.1 ...)"
    )
    src.add_argument("--results", help="a bench results.jsonl")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--baseline", help="the incumbent engine (default: the log's primary / the bench's baseline)")
    r.add_argument("--quantization", action="append", metavar="NAME=QUANT", help="declare an engine's quantization")
    r.add_argument("--blocks", type=int, default=5, help="log: consecutive blocks standing in for repeats")
    r.add_argument("--proxy", metavar="URL", help="log: read engine info (quantization, context, slots), GPU memory "
                   "and GPU sharing from this running proxy's /health and /metrics")  # fmt: skip
    r.add_argument("--memory-budget", help="log: GPU memory the candidate must fit in (e.g. 80GiB)")
    r.add_argument("--min-effect", type=_pct, metavar="PCT", help=MIN_EFFECT_HELP + "; default: the run's own")
    r.add_argument("--run", metavar="ID|all", help="log: the proxy run to report (an id or its prefix, as the "
                   "serve banner prints it; all: every run in the log); default: the latest run")  # fmt: skip
    r.add_argument("--since", metavar="TIME", help="log: pairs started at or after TIME (Unix s, ISO 8601, or "
                   "30m/2h/1d ago)")  # fmt: skip
    r.add_argument("--until", metavar="TIME", help="log: pairs started at or before TIME")
    r.add_argument("--primary", metavar="NAME", help="log: only pairs mirrored from this primary engine")
    r.add_argument("--shadow", metavar="NAME", help="log: only pairs mirrored to this shadow engine")
    r.add_argument("--max-error-rate", type=_pct, metavar="PCT", default=0.02, help="log: engine-side failures up "
                   "to this share of the pairs are left out (and stated); above it the data gate stops (default 2)")  # fmt: skip
    r.add_argument(
        "--fail-on",
        type=_fail_on,
        metavar="stay,partial,inconclusive",
        help=f"exit {EXIT_VERDICT} on these verdicts (inconclusive includes partial)",
    )
    r.set_defaults(func=_report)

    from proxy.bench.diagnose import add_command as add_diagnose

    add_diagnose(sub)


def _bench(args: argparse.Namespace) -> int:
    import logging

    from proxy.bench.config import BenchConfig, Target
    from proxy.bench.model import MIN_EFFECT
    from proxy.bench.report import load_bench, write_report
    from proxy.bench.runner import PreflightError, run_bench
    from proxy.bench.workload import parse_goodput

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress bar
    preset: dict[str, Any] = QUICK if args.quick else DEFAULTS
    engines = _pairs(args.engine, "--engine")
    if len(engines) < 2:
        print("enginemeter bench: give at least two --engine NAME=URL", file=sys.stderr)
        return 2
    if args.through and not args.model:
        print("enginemeter bench: --through needs --model (the proxy's model alias)", file=sys.stderr)
        return 2
    for name, url in engines.items():
        if not url and not args.through:
            print(f"enginemeter bench: engine {name} has no URL (NAME=URL)", file=sys.stderr)
            return 2
    quant = _pairs(args.quantization, "--quantization")
    targets = [
        Target(
            name=n,
            url=u.rstrip("/") or None,
            quantization=quant.get(n),
            quantization_source="declared" if n in quant else None,
        )
        for n, u in engines.items()
    ]
    if args.baseline and args.baseline not in engines:
        print(f"enginemeter bench: --baseline {args.baseline} is not an --engine", file=sys.stderr)
        return 2
    try:
        goodput = parse_goodput(args.goodput)
    except ValueError as exc:
        print(f"enginemeter bench: {exc}", file=sys.stderr)
        return 2
    max_tokens = args.max_tokens or preset["max_tokens"]
    outputs = args.output_lengths or _ints(preset["output_lengths"])
    if max_tokens not in outputs:
        outputs = tuple(sorted({*outputs, max_tokens}))
    cfg = BenchConfig(
        engines=targets,
        through=args.through.rstrip("/") if args.through else None,
        suite=args.suite,
        concurrency=args.concurrency or _ints(preset["concurrency"]),
        output_lengths=outputs,
        prompt_lengths=tuple(
            x.strip() for x in (args.prompt_lengths or preset["prompt_lengths"]).split(",") if x.strip()
        ),
        repeats=args.repeats if args.repeats is not None else preset["repeats"],
        warmup=args.warmup if args.warmup is not None else preset["warmup"],
        cache=args.cache or preset["cache"],
        out=Path(args.out),
        model=args.model,
        seed=args.seed,
        max_tokens=max_tokens,
        waves=args.waves or preset["waves"],
        requests=args.requests,
        duration_s=args.duration,
        request_rates=args.request_rate or (),
        burstiness=args.burstiness,
        goodput=goodput,
        aa=args.aa,
        baseline=args.baseline or targets[0].name,
        metrics_url=args.metrics_url or (f"{args.through.rstrip('/')}/metrics" if args.through else None),
        no_prompt_cache=args.no_prompt_cache,
        ignore_eos=not args.no_ignore_eos,
        timeout_s=args.timeout,
        memory_budget_bytes=_bytes(args.memory_budget),
        quick=args.quick,
        progress=not args.no_progress,
        min_effect=args.min_effect if args.min_effect is not None else MIN_EFFECT,
        argv=list(getattr(args, "argv", None) or ["enginemeter", *sys.argv[1:]]),
    )
    t0 = time.monotonic()
    interrupted = False
    try:
        asyncio.run(run_bench(cfg))
    except KeyboardInterrupt:
        interrupted = True
        print("\nenginemeter bench: interrupted — building the report from what finished", file=sys.stderr)
    except PreflightError as exc:
        print(f"enginemeter bench: preflight failed: {exc}", file=sys.stderr)
        _preflight_verdict(cfg.out, exc)
        return 2
    except (ValueError, OSError) as exc:
        print(f"enginemeter bench: {exc}", file=sys.stderr)
        return 2
    results = cfg.out / "results.jsonl"
    if not results.exists():
        return 130 if interrupted else 1
    data = load_bench(results, baseline=cfg.baseline)
    out = write_report(data, cfg.out)
    _print_summary(out, time.monotonic() - t0)
    if interrupted:
        return 130
    return _verdict_status(out, args.fail_on)


def _preflight_verdict(out: Path, exc: Any) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    doc = {"version": 1, "decision": "inconclusive", "stopped_at": {"gate": "preflight", "check": "reachable"},
           "engine": exc.engine, "url": exc.url, "cause": exc.cause, "verdicts": []}  # fmt: skip
    (out / "verdict.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def _verdict_status(out: dict[str, Any], fail_on: frozenset[str] | None) -> int:
    hit = [v for v in out["verdicts"] if fail_on and v.decision in fail_on]
    if hit:
        print(f"enginemeter: --fail-on {','.join(sorted(fail_on or ()))}: " + "; ".join(
            f"{v.candidate} {v.decision}" for v in hit), file=sys.stderr)  # fmt: skip
        return EXIT_VERDICT
    return 0


def _report(args: argparse.Namespace) -> int:
    from proxy.bench.report import load_bench, write_report

    quant = _pairs(args.quantization, "--quantization")
    if args.log:
        return _report_log(args, quant)
    try:
        data = load_bench(Path(args.results), baseline=args.baseline, quantization=quant,
                          min_effect=args.min_effect)  # fmt: skip
    except (ValueError, OSError, KeyError) as exc:
        print(f"enginemeter report: {exc}", file=sys.stderr)
        return 2
    out = write_report(data, Path(args.out))
    _print_summary(out, None)
    return _verdict_status(out, args.fail_on)


def _report_log(args: argparse.Namespace, quant: dict[str, str]) -> int:
    from proxy.bench.livelog import parse_time
    from proxy.bench.livereport import write_live_report
    from proxy.bench.logreport import expand, load_live, proxy_info
    from proxy.bench.model import MIN_EFFECT

    try:
        info = proxy_info(args.proxy) if args.proxy else None
        if info is not None and info.error:
            print(f"enginemeter report: the proxy at {args.proxy} did not answer ({info.error}); reporting from "
                  "the log alone (no GPU memory)", file=sys.stderr)  # fmt: skip
        lives = load_live(
            expand(args.log), run=args.run, since=parse_time(args.since) if args.since else None,
            until=parse_time(args.until) if args.until else None, primary=args.primary or args.baseline,
            shadow=args.shadow, quantization=quant, blocks=args.blocks, proxy=info,
            memory_budget_bytes=_bytes(args.memory_budget),
            min_effect=MIN_EFFECT if args.min_effect is None else args.min_effect, max_error_rate=args.max_error_rate,
        )  # fmt: skip
    except (ValueError, OSError, KeyError) as exc:
        print(f"enginemeter report: {exc}", file=sys.stderr)
        return 2
    status = 0
    for live in lives:
        # one report per primary: its own directory when the log mirrored from several
        out = write_live_report(live, Path(args.out) if len(lives) == 1 else Path(args.out) / live.primary)
        for line in live.selection.notes:
            print(f"note: {line}")
        for shadow, v in out["live"].items():
            for line in v.lines():
                print(f"live {shadow} vs {live.primary}: {line}")
        _print_summary(out, None)
        status = max(status, _verdict_status(out, args.fail_on))
    return status


def _print_summary(out: dict[str, Any], took_s: float | None) -> None:
    for v in out["verdicts"]:
        print(f"verdict {v.candidate} vs {v.baseline}: {v.decision.upper()} — {v.summary}")
        if v.next_step:
            print(f"  next: {v.next_step}")
    print(f"report: {out['report_md']}, {out['report_html']} and {out['verdict_json']}")
    if took_s is not None:
        print(f"bench took {took_s:.0f} s")
