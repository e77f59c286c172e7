"""How a run was made, in words: the protocol lines a report prints, the command that made the run (as recorded,
else rebuilt from its settings) and the ``enginemeter report`` command that reads its results again. Pure."""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def report_command(
    paths: Sequence[Path | str],
    *,
    baseline: str | None = None,
    accept_quantization_difference: bool = False,
    min_effect: float | None = None,
    max_error_rate: float | None = None,
    quantization: Mapping[str, str] | None = None,
) -> str:
    """``enginemeter report`` reading these results files again with the settings that change their verdict (no
    ``--out``): a results file as the bench wrote it is named by its directory, as ``--results`` takes it."""
    names = [str(p.parent if p.name in ("results.jsonl", "results.jsonl.gz") else p) for p in map(Path, paths)]
    argv = ["enginemeter", "report", "--results", *names]
    if baseline:
        argv += ["--baseline", baseline]
    for name, q in (quantization or {}).items():
        argv += ["--quantization", f"{name}={q}"]
    if accept_quantization_difference:
        argv.append("--accept-quantization-difference")
    for flag, v in (("--min-effect", min_effect), ("--max-error-rate", max_error_rate)):
        if v is not None:
            argv += [flag, f"{v * 100:g}"]
    return shlex.join(argv)


def protocol(run: Mapping[str, Any], end: Mapping[str, Any] | None) -> list[str]:
    cfg = run.get("config", {})
    base = run.get("base", {})
    ex = run["engines"][0].get("body_example", {}) if run["engines"] else {}
    rates = cfg.get("request_rates") or []
    per_cell = (
        f"{cfg['requests']} requests"
        if cfg.get("requests")
        else f"{cfg['duration_s']:g} s"
        if cfg.get("duration_s")
        else f"{cfg.get('waves')} × concurrency requests"
    )
    aa = [e["name"] for e in run["engines"] if e.get("aa_of")]
    launched = [e for e in run["engines"] if e.get("launch")]
    shared = (
        (
            "time-shared: each engine ran the whole suite alone, one after another"
            + (
                f" ({len(launched)} launched by enginemeter, each stopped and its GPU memory back before the next)"
                if launched
                else ""
            )
            + "; the bench's engines never ran side by side, so no contention applies"
        )
        if run.get("time_shared")
        else None
    )
    out = [
        f"started {dt.datetime.fromtimestamp(run.get('started', 0), dt.UTC):%Y-%m-%d %H:%M:%S} UTC"
        + (f", took {end['duration_s']:.0f} s" if end and isinstance(end.get("duration_s"), int | float) else ""),
        (
            f"through the proxy at {run['through']} (engine pinned per request with x-enginemeter-engine; the proxy "
            "maps sampling per engine kind)"
        )
        if run.get("through")
        else "directly against each engine (sampling mapped per engine kind by proxy.normalize)",
        f"suite: {cfg.get('suite')}; prompt lengths {', '.join(cfg.get('prompt_lengths') or [])} "
        f"(base {base.get('prompt_len')}); concurrency {', '.join(map(str, cfg.get('concurrency') or []))}; "
        f"output lengths {', '.join(map(str, cfg.get('output_lengths') or []))} (base {base.get('max_tokens')})",
        (
            f"open loop: request rates {', '.join(f'{x:g}' for x in rates)}/s, gamma arrivals with burstiness "
            f"{cfg.get('burstiness', 1.0):g} (1 = Poisson), at most {max(cfg.get('concurrency') or [1])} in flight"
        )
        if rates
        else "closed loop: at most `concurrency` requests in flight, the next sent as one ends",
        f"{cfg.get('repeats')} repeats per cell, engines rotating order; {cfg.get('warmup')} warm-up request(s) per "
        f"engine discarded; {per_cell} per cell repeat",
        *([shared] if shared else []),
        f"A/A noise floor: {', '.join(aa)} = {_aa_how(run, bool(launched))}"
        if aa
        else "no A/A pass: the noise floor is the run-to-run variation",
        f"cache: {cfg.get('cache')} (cold = unique prefix per request"
        + (
            ", drawn from --seed: every engine was launched fresh, so runs with the same seed send the same requests"
            if (run.get("protocol") or {}).get("cold_prefixes") == "seeded"
            else ""
        )
        + (", cache_prompt:false to llama.cpp" if cfg.get("no_prompt_cache") else "")
        + ", SGLang /flush_cache before each phase; warm = bare prompts, primed once)",
        "sampling sent (before per-kind mapping): "
        + ", ".join(f"{k}={v}" for k, v in sorted(ex.items()) if k not in ("model", "stream", "stream_options")),
    ]
    if run.get("goodput"):
        out.append("goodput SLOs: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in run["goodput"].items()))
    return out


def _aa_how(run: Mapping[str, Any], launched: bool) -> str:
    if not run.get("time_shared"):
        return "a second pass of the baseline in every cell repeat"
    if launched:
        return "the baseline launched again after the candidates (restart-to-restart noise)"
    return "the baseline measured again after the candidates"


def bench_command(run: Mapping[str, Any]) -> str:
    """The command that made a run: as recorded, else rebuilt from its settings (older results)."""
    argv = run.get("argv")
    if isinstance(argv, list) and argv:
        return shlex.join(str(a) for a in argv)
    cfg = run.get("config", {})
    out = ["enginemeter", "bench"]
    for e in run.get("engines", []):
        if e.get("aa_of") and e.get("name") == f"{e['aa_of']}-aa":
            continue  # the bench's own second pass of the baseline, not an engine the user listed
        out += ["--engine", f"{e['name']}={e.get('url') or ''}"]
    for flag, key in (("--concurrency", "concurrency"), ("--output-lengths", "output_lengths"),
                      ("--prompt-lengths", "prompt_lengths")):  # fmt: skip
        if cfg.get(key):
            out += [flag, ",".join(map(str, cfg[key]))]
    for flag, key in (("--repeats", "repeats"), ("--warmup", "warmup"), ("--cache", "cache"),
                      ("--max-tokens", "max_tokens"), ("--waves", "waves"), ("--requests", "requests"),
                      ("--through", "through"), ("--model", "model"), ("--baseline", "baseline")):  # fmt: skip
        if cfg.get(key) not in (None, ""):
            out += [flag, str(cfg[key])]
    if cfg.get("no_prompt_cache"):
        out.append("--no-prompt-cache")
    return shlex.join(out)
