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
    "waves": 1,
}
DEFAULTS = {
    "concurrency": "1,2,4,8",
    "output_lengths": "32,128",
    "prompt_lengths": "short,medium,long",
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
    b.add_argument("--out", default="bench-out", help="output directory (results.jsonl, report.md/.html, PNGs)")
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
    src.add_argument("--log", help="the proxy's comparison log (JSONL, one primary/shadow pair per line)")
    src.add_argument("--results", help="a bench results.jsonl")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--baseline", help="the incumbent engine (default: the log's primary / the bench's baseline)")
    r.add_argument("--quantization", action="append", metavar="NAME=QUANT", help="declare an engine's quantization")
    r.add_argument("--blocks", type=int, default=5, help="log: consecutive blocks standing in for repeats")
    r.set_defaults(func=_report)


def _bench(args: argparse.Namespace) -> int:
    import logging

    from proxy.bench.report import load_bench, write_report
    from proxy.bench.runner import BenchConfig, Target, run_bench

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
        baseline=args.baseline or targets[0].name,
        metrics_url=args.metrics_url or (f"{args.through.rstrip('/')}/metrics" if args.through else None),
        no_prompt_cache=args.no_prompt_cache,
        ignore_eos=not args.no_ignore_eos,
        timeout_s=args.timeout,
        memory_budget_bytes=_bytes(args.memory_budget),
        quick=args.quick,
        progress=not args.no_progress,
    )
    t0 = time.monotonic()
    interrupted = False
    try:
        asyncio.run(run_bench(cfg))
    except KeyboardInterrupt:
        interrupted = True
        print("\nenginemeter bench: interrupted — building the report from what finished", file=sys.stderr)
    except (ValueError, OSError) as exc:
        print(f"enginemeter bench: {exc}", file=sys.stderr)
        return 2
    results = cfg.out / "results.jsonl"
    if not results.exists():
        return 130 if interrupted else 1
    data = load_bench(results, baseline=cfg.baseline)
    out = write_report(data, cfg.out)
    _print_summary(out, time.monotonic() - t0)
    return 130 if interrupted else 0


def _report(args: argparse.Namespace) -> int:
    from proxy.bench.logreport import load_log
    from proxy.bench.report import load_bench, write_report

    quant = _pairs(args.quantization, "--quantization")
    try:
        if args.log:
            data = load_log(Path(args.log), baseline=args.baseline, quantization=quant, blocks=args.blocks)
        else:
            data = load_bench(Path(args.results), baseline=args.baseline, quantization=quant)
    except (ValueError, OSError, KeyError) as exc:
        print(f"enginemeter report: {exc}", file=sys.stderr)
        return 2
    out = write_report(data, Path(args.out))
    _print_summary(out, None)
    return 0


def _print_summary(out: dict[str, Any], took_s: float | None) -> None:
    for v in out["verdicts"]:
        print(f"verdict {v.candidate} vs {v.baseline}: {v.decision.upper()} — {v.summary}")
    print(f"report: {out['report_md']} and {out['report_html']}")
    if took_s is not None:
        print(f"bench took {took_s:.0f} s")
