"""The bench wing's command-line options and how they become one ``BenchConfig``: the preset (``--quick`` or the
default), then the bench file (``--config``), then the flags — later wins. ``bench`` and ``tune`` share the
workload options and this one path to a config; a mistake is a ``UsageError`` (exit 2, one line)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.bench.quality.agreerun import DEFAULT_PROMPTS, DEFAULT_TOKENS, parse_size
from proxy.bench.quality.evalset import EvalFileError, load_eval
from proxy.bench.run.benchconfig import BenchConfig, Target
from proxy.bench.run.benchfile import BenchFile, goodput_spec
from proxy.bench.verdict.inputs import MAX_ERROR_RATE, MIN_EFFECT
from proxy.bench.verdict.workload import parse_goodput

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
#: exit status when a verdict matches --fail-on (2 is a usage or preflight error, 130 an interrupt)
EXIT_VERDICT = 3
MIN_EFFECT_HELP = (
    "practical significance: a difference smaller than PCT %% is never a win or a loss, and a tie means "
    "'within ±PCT %%' (default 5; a noise floor wider than this is used instead for wins and blocks ties)"
)

MAX_ERROR_RATE_HELP = (
    "engine-side failures up to PCT %% of an engine's requests are stated and left out of the figures; above it "
    "the verdict is inconclusive (default 2)"
)


class UsageError(ValueError):
    """A mistake in the flags or the bench file: one line, exit 2."""


def ints(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def floats(s: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {s!r}")
    return vals


def fail_on(s: str | Sequence[str]) -> frozenset[str]:
    vals = frozenset(x.strip() for x in (s.split(",") if isinstance(s, str) else s) if x.strip())
    if not vals or not vals <= {"stay", "partial", "inconclusive"}:
        raise argparse.ArgumentTypeError(f"--fail-on takes stay, partial, inconclusive (comma-separated), got {s!r}")
    if "inconclusive" in vals:  # a partial answer is inconclusive about what it did not measure
        vals |= {"partial"}
    return vals


def percent_arg(s: str) -> float:
    try:
        v = float(s.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage (e.g. 5 or 5%), got {s!r}") from None
    if not 0 <= v < 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in [0, 100), got {s!r}")
    return v / 100


def pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"{what} must be NAME=VALUE, got {item!r}")
        out[name] = value
    return out


_SIZE = re.compile(r"(?i)^\s*([0-9.]+)\s*([kmgt]i?b?)?\s*$")


def agreement_arg(s: str) -> str:
    """``--agreement PROMPTSxTOKENS``, checked."""
    try:
        parse_size(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return s


def size_arg(s: str | int | None) -> int | None:
    """A size as a person gives it (``--memory-budget 80GiB``, ``24G``, ``1073741824``; K/M/G/T are binary) ->
    bytes; None and ints pass through."""
    if s is None or isinstance(s, int):
        return s
    m = _SIZE.match(s)
    if not m:
        raise UsageError(f"cannot read size {s!r} (e.g. 80GiB, 24G, 1073741824)")
    mult = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}.get((m.group(2) or " ")[0].lower(), 1)
    return int(float(m.group(1)) * mult)


class Targets(argparse.Action):
    """``--engine`` and ``--launch`` into one list, in the order given: ``[(kind, "NAME=VALUE"), ...]``."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        items = list(getattr(ns, self.dest, None) or [])
        items.append((self.const, values))
        setattr(ns, self.dest, items)


def add_workload(p: argparse.ArgumentParser) -> None:
    """The options that say what is sent and how often (``bench`` and ``tune`` alike)."""
    p.add_argument("--suite", help="builtin | shared-prefix | FILE.jsonl | sharegpt.json (default builtin)")
    p.add_argument("--concurrency", type=ints, help=f"sweep (default {DEFAULTS['concurrency']})")
    p.add_argument("--output-lengths", type=ints, help=f"max_tokens sweep (default {DEFAULTS['output_lengths']})")
    p.add_argument("--prompt-lengths", help=f"sweep (default {DEFAULTS['prompt_lengths']})")
    p.add_argument("--repeats", type=int, help="repeats per cell (default 3; fewer makes the verdict inconclusive)")
    p.add_argument("--warmup", type=int, help="warm-up requests per engine, discarded (default 2)")
    p.add_argument("--cache", choices=("cold", "warm", "both"), help="prompt-cache phases (default both)")
    p.add_argument(
        "--no-prompt-cache",
        action="store_true",
        default=None,
        help="cold phase: also send cache_prompt:false to llama.cpp",
    )
    p.add_argument("--waves", type=int, help="requests per cell repeat = concurrency × waves (default 2)")
    p.add_argument("--requests", type=int, help="requests per cell repeat (instead of concurrency × waves)")
    p.add_argument("--duration", type=float, metavar="S", help="send for S seconds per cell repeat")
    p.add_argument(
        "--request-rate",
        type=floats,
        metavar="R[,R...]",
        help="open-loop arrivals at R requests/s (a "
        "sweep replacing the concurrency sweep; at most max(--concurrency) in flight)",
    )
    p.add_argument("--burstiness", type=float, help="gamma shape of inter-arrival times (1 = Poisson, <1 burstier)")
    p.add_argument("--goodput", metavar="ttft:MS,tpot:MS,e2el:MS", help="SLOs for goodput (requests meeting all)")
    p.add_argument(
        "--aa",
        choices=("auto", "off"),
        help="A/A noise floor: a second pass of the baseline (auto; "
        "launched engines: the baseline launched again last) or none (off: the run-to-run variation "
        "stands in)",
    )
    p.add_argument("--min-effect", type=percent_arg, metavar="PCT", help=MIN_EFFECT_HELP)
    p.add_argument("--max-error-rate", type=percent_arg, metavar="PCT", help=MAX_ERROR_RATE_HELP)
    p.add_argument(
        "--fail-on",
        type=fail_on,
        metavar="stay,partial,inconclusive",
        help=f"exit {EXIT_VERDICT} when a verdict is one of these (inconclusive includes partial)",
    )
    p.add_argument(
        "--out",
        help="output directory (results.jsonl, report.md/.html, SVG charts, verdict.json; "
        "launched engines' logs in engines/); default bench-out; one holding a run is refused",
    )
    p.add_argument("--force", action="store_true", help="write into an --out that holds a run (replacing its files)")
    p.add_argument("--model", help="model name to send (default: each engine's /v1/models; required with --through)")
    p.add_argument("--seed", type=int, help="sampling seed and arrival schedule (default 1234)")
    p.add_argument("--max-tokens", type=int, help="base max_tokens (default 128)")
    p.add_argument(
        "--no-ignore-eos", action="store_true", default=None, help="let engines stop at EOS (output lengths may differ)"
    )
    p.add_argument("--memory-budget", help="GPU memory the candidate must fit in (e.g. 72GiB)")
    p.add_argument("--timeout", type=float, help="per-request timeout, seconds (default 600)")
    p.add_argument(
        "--launch-timeout",
        type=float,
        metavar="S",
        help="launched engines: seconds from launch to ready before the launch fails (default 900)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        default=None,
        help="CI-sized preset: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (what 4 slots "
        "buy shows only at c=4: add --concurrency 1,4)",
    )
    p.add_argument("--no-progress", action="store_true")
    add_quality(p)


def add_quality(p: argparse.ArgumentParser) -> None:
    """The quality phases after the timed cells (``proxy.bench.quality``)."""
    p.add_argument(
        "--agreement",
        nargs="?",
        const=f"{DEFAULT_PROMPTS}x{DEFAULT_TOKENS}",
        type=agreement_arg,
        metavar="PROMPTSxTOKENS",
        help="after the timed cells: each engine's top-20 next-token log-probabilities along the baseline's greedy "
        f"path, compared with the baseline's (same top token, KL, where greedy outputs part; default "
        f"{DEFAULT_PROMPTS}x{DEFAULT_TOKENS}; asks the engines for log-probabilities)",
    )
    p.add_argument(
        "--eval",
        dest="eval_file",
        metavar="FILE.jsonl",
        help="after the timed cells: your task file ({prompt, expected, matcher: exact|regex|number} a line) "
        "answered by every engine with the same sampling, scored, with a paired interval of the difference",
    )


def _pick(args: argparse.Namespace, file: BenchFile | None, key: str, file_key: str | None = None) -> Any:
    v = getattr(args, key, None)
    if v is None and file is not None:
        v = getattr(file, file_key or key, None)
    return v


def build_config(
    args: argparse.Namespace, file: BenchFile | None, targets: list[Target], preset_over: dict[str, Any] | None = None
) -> BenchConfig:
    """Preset < file < flags -> the run's config. ``preset_over``: a command's own defaults (``tune``)."""
    quick = bool(_pick(args, file, "quick"))
    preset: dict[str, Any] = {**(QUICK if quick else DEFAULTS), **(preset_over or {})}

    def val(key: str, default: Any = None) -> Any:
        v = _pick(args, file, key)
        return default if v is None else v

    def seq(key: str, conv: Any) -> Any:
        v = _pick(args, file, key)
        if v is None:
            v = preset[key]
        return conv(v) if isinstance(v, str) else tuple(v)

    through = val("through")
    try:
        goodput = parse_goodput(
            args.goodput if args.goodput is not None else goodput_spec(file.goodput if file else None)
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    max_tokens = val("max_tokens", preset["max_tokens"])
    outputs = seq("output_lengths", ints)
    if max_tokens not in outputs:
        outputs = tuple(sorted({*outputs, max_tokens}))
    lengths = val("prompt_lengths", preset["prompt_lengths"])
    min_effect = (
        args.min_effect
        if args.min_effect is not None
        else (file.min_effect / 100 if file and file.min_effect else MIN_EFFECT)
    )
    return BenchConfig(
        engines=targets,
        through=through.rstrip("/") if through else None,
        suite=val("suite", "builtin"),
        concurrency=seq("concurrency", ints),
        output_lengths=outputs,
        prompt_lengths=tuple(x.strip() for x in _split(lengths) if x.strip()),
        repeats=val("repeats", preset["repeats"]),
        warmup=val("warmup", preset["warmup"]),
        cache=val("cache", preset["cache"]),
        out=Path(val("out", "bench-out")),
        model=val("model"),
        seed=val("seed", 1234),
        max_tokens=max_tokens,
        waves=val("waves", preset["waves"]),
        requests=val("requests"),
        duration_s=val("duration"),
        request_rates=tuple(val("request_rate", ())),
        burstiness=val("burstiness", 1.0),
        goodput=goodput,
        aa=val("aa", "auto"),
        baseline=val("baseline") or (targets[0].name if targets else None),
        metrics_url=val("metrics_url") or (f"{through.rstrip('/')}/metrics" if through else None),
        no_prompt_cache=bool(val("no_prompt_cache", False)),
        ignore_eos=not (args.no_ignore_eos or (file is not None and file.ignore_eos is False)),
        timeout_s=val("timeout", 600.0),
        memory_budget_bytes=size_arg(val("memory_budget")),
        quick=quick,
        progress=not args.no_progress,
        min_effect=min_effect,
        max_error_rate=args.max_error_rate if args.max_error_rate is not None else MAX_ERROR_RATE,
        argv=list(getattr(args, "argv", None) or ["enginemeter", *sys.argv[1:]]),
        accept_quantization_difference=bool(val("accept_quantization_difference", False)),
        launch_timeout_s=val("launch_timeout", 900.0),
        agreement=val("agreement"),
        eval_file=_eval_file(val("eval_file")),
    )


def _eval_file(path: str | None) -> str | None:
    """``--eval``: read (and checked) now, so a bad file stops the run before anything is measured."""
    if path:
        try:
            load_eval(path)
        except EvalFileError as exc:
            raise UsageError(f"--eval: {exc}") from None
    return path


def _split(v: str | Sequence[str]) -> Sequence[str]:
    return v.split(",") if isinstance(v, str) else v


def fail_on_of(args: argparse.Namespace, file: BenchFile | None) -> frozenset[str] | None:
    """``--fail-on``, else the file's ``fail_on``."""
    fo = _pick(args, file, "fail_on")
    return fail_on(fo) if fo else None
