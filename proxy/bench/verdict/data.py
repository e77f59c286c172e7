"""Bench results JSONL (version 1 or 2) -> ``Data``: the verdict's ``Results`` plus what the report shows.

Version 1 (before the A/A pass and the gates) has no ``aa_of``, ``dropped``, ``context_per_slot`` or ITL; it
does have per-request ``request`` records, so the paired statistics work on it too, with the run-to-run
variation standing in for the A/A noise floor. Its llama.cpp context per slot comes from ``info.n_ctx``.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.bench.suite import SHARED_PREFIX
from proxy.bench.verdict.inputs import MAX_ERROR_RATE, MIN_EFFECT, Cell, EngineInfo, Req, Results, Sample
from proxy.engines import started
from proxy.types import ENGINE_KINDS


@dataclass
class Data:
    """Everything a report needs, whatever produced it (bench JSONL or the proxy's comparison log)."""

    title: str
    results: Results
    engines_meta: list[dict[str, Any]]
    requests: list[dict[str, Any]] = field(default_factory=list)
    tokenized: list[dict[str, Any]] = field(default_factory=list)
    protocol: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    duration_s: float | None = None
    goodput: Mapping[str, float] = field(default_factory=dict)
    #: each sample's engine and place in its repeat's order (results version 3)
    positions: list[dict[str, Any]] = field(default_factory=list)
    #: time-shared runs: one record per engine stint (role, when, GPU processes before, the launch if launched)
    stints: list[dict[str, Any]] = field(default_factory=list)
    #: why the run ended early (a launch that failed, memory that did not come back); None: it did not
    stopped: str | None = None
    #: the results files this data was read from (several: ``report --results A B``, ``proxy.bench.verdict.merge``)
    sources: list[str] = field(default_factory=list)
    #: the ``run`` record of each source, in order
    runs: list[dict[str, Any]] = field(default_factory=list)


def results_file(path: Path) -> Path:
    """The results file a path names: the file itself (``.gz`` too), or a bench ``--out`` directory's
    ``results.jsonl`` (else ``results.jsonl.gz``, as ``scripts/gpu/collect.sh`` keeps it)."""
    if not path.is_dir():
        return path
    for name in ("results.jsonl", "results.jsonl.gz"):
        if (path / name).is_file():
            return path / name
    raise ValueError(f"{path}: no results.jsonl (or results.jsonl.gz) in this directory — not a bench --out")


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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, gzipped or not; a line cut by Ctrl-C is skipped."""
    recs: list[dict[str, Any]] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by Ctrl-C
            if isinstance(obj, dict):
                recs.append(obj)
    return recs


def _cell(r: Mapping[str, Any]) -> Cell:
    rate = r.get("rate")
    return Cell(r["cache"], int(r["concurrency"]), int(r["max_tokens"]), r["prompt_len"],
                float(rate) if isinstance(rate, int | float) else None)  # fmt: skip


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _kv_pool(info: Mapping[str, Any], log: Path, kind: Any) -> dict[str, int | None]:
    """The engine's KV pool in tokens and bytes: as the run recorded them (``info``), else as the launched engine's
    log beside the results says (``OUT/engines/NAME.log``: runs made before the bench recorded them, or an engine
    whose HTTP state leaves one out — SGLang's ``/server_info`` has the tokens, not the bytes)."""
    tokens, bytes_ = _int(info.get("kv_pool_tokens")), _int(info.get("kv_cache_bytes"))
    if (tokens is None or bytes_ is None) and kind in ENGINE_KINDS:
        logged = started(log, kind)
        tokens, bytes_ = tokens or logged.kv_cache_tokens, bytes_ or logged.kv_cache_bytes
    return {"kv_pool_tokens": tokens, "kv_cache_bytes": bytes_}


def load_bench(
    path: Path,
    *,
    baseline: str | None = None,
    quantization: Mapping[str, str] | None = None,
    min_repeats: int = 3,
    min_effect: float | None = None,
    max_error_rate: float | None = None,
    accept_quantization_difference: bool = False,
) -> Data:
    path = results_file(path)
    recs = read_jsonl(path)
    run = next((r for r in recs if r.get("type") == "run"), None)
    if run is None:
        raise ValueError(f"{path}: no 'run' record — not a bench results file")
    end = next((r for r in recs if r.get("type") == "end"), None)
    cfg = run.get("config", {})
    quant = dict(quantization or {})
    infos = []
    # a time-shared run learns each engine's facts once it is up: its ``engine`` record replaces the run's entry
    later = {r["name"]: {k: v for k, v in r.items() if k not in ("type", "role")} for r in recs
             if r.get("type") == "engine" and isinstance(r.get("name"), str)}  # fmt: skip
    run["engines"] = [later.pop(e["name"], e) for e in run["engines"]] + list(later.values())
    stints = [r for r in recs if r.get("type") == "stint"]
    for e in run["engines"]:
        declared = quant.get(e["name"])
        q = declared or e.get("quantization")
        info = e.get("info") or {}
        ctx = _int(e.get("context_per_slot")) or _int(info.get("n_ctx"))
        dropped = e.get("dropped", [] if run.get("version", 1) == 1 else None)
        infos.append(
            EngineInfo(
                name=e["name"], kind=e.get("kind"), model=e.get("model"), quantization=q,
                sampling=e.get("sampling") or {}, max_tokens=tuple(e.get("max_tokens") or ()),
                dropped=tuple(dropped) if isinstance(dropped, list) else None, context_per_slot=ctx,
                slots=_int(e.get("slots")), aa_of=e.get("aa_of"),
                quantization_source="declared" if declared else e.get("quantization_source"),
                **_kv_pool(info, path.parent / "engines" / f"{e['name']}.log", e.get("kind")),
            )
        )  # fmt: skip
        e["quantization"] = q
    samples = tuple(
        Sample(
            engine=r["engine"], cell=_cell(r), repeat=int(r["repeat"]), n_ok=int(r["n_ok"]), n_err=int(r["n_err"]),
            ttft_s=r.get("ttft_s"), tpot_s=r.get("tpot_s"), decode_tps=r.get("decode_tps"), e2e_s=r.get("e2e_s"),
            completion_tokens=r.get("completion_tokens"), prompt_tokens=r.get("prompt_tokens"),
            output_tps=r.get("output_tps"), gpu_mem_peak_bytes=r.get("gpu_mem_peak_bytes"),
            errors=tuple(r.get("errors") or ()), gpu_mem_source=r.get("gpu_mem_source"),
            gpus=tuple(r.get("gpus") or ()), gpu_mem_total_bytes=r.get("gpu_mem_total_bytes"),
            goodput_rps=r.get("goodput_rps"), bursts=int(r.get("bursts") or 0),
            bursts_unrated=int(r.get("bursts_unrated") or 0),
            percentiles={k: v for k, v in r.items() if k.endswith(("_p50_s", "_p90_s", "_p99_s"))},
        )
        for r in recs
        if r.get("type") == "sample"
    )  # fmt: skip
    tokenized = [r for r in recs if r.get("type") == "prompt_tokens"]
    requests = [r for r in recs if r.get("type") == "request"]
    measured = [r for r in requests if r.get("phase") == "measure" and "cache" in r]
    reqs = tuple(
        Req(engine=r["engine"], cell=_cell(r), repeat=int(r.get("repeat", 0)), index=int(r.get("index", 0)),
            ok=bool(r.get("ok")), ttft_s=r.get("ttft_s"), tpot_s=r.get("tpot_s"), decode_tps=r.get("decode_tps"),
            e2e_s=r.get("e2e_s"), prompt_tokens=_int(r.get("prompt_tokens")), cached_tokens=_int(r.get("cached_tokens")))
        for r in measured
    )  # fmt: skip
    pt: dict[str, dict[str, int]] = {}
    for r in tokenized:
        if isinstance(r.get("tokens"), int):
            pt.setdefault(r["engine"], {})[f"tokenizer:{r['prompt']}"] = r["tokens"]
    for r in measured:
        if r.get("ok") and isinstance(r.get("prompt_tokens"), int) and r.get("key"):
            pt.setdefault(r["engine"], {})[f"usage:{r['key']}"] = r["prompt_tokens"]
    base = run.get("base", {})
    names = [e.name for e in infos]
    bl = baseline or run.get("baseline") or names[0]
    if bl not in names:
        raise ValueError(f"baseline {bl!r} is not one of the engines: {', '.join(names)}")
    results = Results(
        engines=tuple(infos), baseline=bl, samples=samples, prompt_tokens=pt, base_max_tokens=base.get("max_tokens"),
        base_prompt_len=base.get("prompt_len"), memory_budget_bytes=run.get("memory_budget_bytes"),
        min_repeats=min_repeats, requests=reqs, shared_prefix=cfg.get("suite") == SHARED_PREFIX,
        min_effect=min_effect if min_effect is not None else float(cfg.get("min_effect") or MIN_EFFECT),
        max_error_rate=max_error_rate if max_error_rate is not None else float(cfg.get("max_error_rate", MAX_ERROR_RATE)),
        flags=_busy_flags(recs), command=bench_command(run),
        report_command=report_command([path], baseline=baseline, min_effect=min_effect, max_error_rate=max_error_rate,
                                      accept_quantization_difference=accept_quantization_difference,
                                      quantization=quantization),
        accept_quantization_difference=accept_quantization_difference or bool(cfg.get("accept_quantization_difference")),
        expected=frozenset(cfg.get("expected_differences") or ()), alone=_alone(stints),
        time_shared=bool(run.get("time_shared")), memory_share=_memory_share(run),
        random_weights={e["name"]: why for e in run["engines"] if (why := weights_random(e))},
    )  # fmt: skip
    return Data(
        title="enginemeter bench report",
        results=results,
        engines_meta=run["engines"],
        requests=requests,
        tokenized=tokenized,
        protocol=_protocol(run, end),
        notes=[f"{r.get('engine') or 'bench'}: {r.get('text')}" for r in recs if r.get("type") == "note"],
        interrupted=bool(end is None or end.get("interrupted")),
        duration_s=end.get("duration_s") if end else None,
        goodput=run.get("goodput") or {},
        positions=[{"engine": r["engine"], "position": r["position"]} for r in recs
                   if r.get("type") == "sample" and "position" in r],
        stints=stints, stopped=(end or {}).get("stopped", {}).get("cause") if (end or {}).get("stopped") else None,
        sources=[str(path)], runs=[run],
    )  # fmt: skip


def _memory_share(run: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """Launched engines whose command line sets their share of the GPU's memory (SGLang, vLLM: the dialect's)."""
    from proxy import engines
    from proxy.procs.launch import parse_launch

    out: dict[str, tuple[str, float]] = {}
    for e in run["engines"]:
        if not isinstance(e.get("launch"), str):
            continue
        try:
            spec = parse_launch(e["name"], e["launch"], port=lambda: 0)
        except ValueError:
            continue
        share = engines.dialect(spec.kind).memory_share(spec.argv) if spec.kind else None
        if share is not None:
            out[e["name"]] = share
    return out


def weights_random(meta: Mapping[str, Any]) -> str | None:
    """Why an engine of a run's records runs random weights, when it does (``proxy.engines.quant.random_weights``)."""
    from proxy.engines.quant import random_weights

    return random_weights(meta.get("launch") if isinstance(meta.get("launch"), str) else None, meta.get("info") or {})


def _alone(stints: list[dict[str, Any]]) -> frozenset[str]:
    """Launched engines that found no other process on the GPU when they started."""
    return frozenset(s["engine"] for s in stints if s.get("launch") and s.get("gpu_processes_before") == 0)


def _protocol(run: Mapping[str, Any], end: Mapping[str, Any] | None) -> list[str]:
    cfg = run.get("config", {})
    base = run.get("base", {})
    ex = run["engines"][0].get("body_example", {}) if run["engines"] else {}
    rates = cfg.get("request_rates") or []
    per_cell = (f"{cfg['requests']} requests" if cfg.get("requests") else f"{cfg['duration_s']:g} s" if
                cfg.get("duration_s") else f"{cfg.get('waves')} × concurrency requests")  # fmt: skip
    aa = [e["name"] for e in run["engines"] if e.get("aa_of")]
    launched = [e for e in run["engines"] if e.get("launch")]
    shared = (
        "time-shared: each engine ran the whole suite alone, one after another"
        + (f" ({len(launched)} launched by enginemeter, each stopped and its GPU memory back before the next)"
           if launched else "")
        + "; the bench's engines never ran side by side, so no contention applies"
    ) if run.get("time_shared") else None  # fmt: skip
    out = [
        f"started {dt.datetime.fromtimestamp(run.get('started', 0), dt.UTC):%Y-%m-%d %H:%M:%S} UTC"
        + (f", took {end['duration_s']:.0f} s" if end and isinstance(end.get("duration_s"), int | float) else ""),
        (f"through the proxy at {run['through']} (engine pinned per request with x-enginemeter-engine; the proxy "
         "maps sampling per engine kind)") if run.get("through")
        else "directly against each engine (sampling mapped per engine kind by proxy.normalize)",
        f"suite: {cfg.get('suite')}; prompt lengths {', '.join(cfg.get('prompt_lengths') or [])} "
        f"(base {base.get('prompt_len')}); concurrency {', '.join(map(str, cfg.get('concurrency') or []))}; "
        f"output lengths {', '.join(map(str, cfg.get('output_lengths') or []))} (base {base.get('max_tokens')})",
        (f"open loop: request rates {', '.join(f'{x:g}' for x in rates)}/s, gamma arrivals with burstiness "
         f"{cfg.get('burstiness', 1.0):g} (1 = Poisson), at most {max(cfg.get('concurrency') or [1])} in flight")
        if rates else "closed loop: at most `concurrency` requests in flight, the next sent as one ends",
        f"{cfg.get('repeats')} repeats per cell, engines rotating order; {cfg.get('warmup')} warm-up request(s) per "
        f"engine discarded; {per_cell} per cell repeat",
        *([shared] if shared else []),
        f"A/A noise floor: {', '.join(aa)} = {_aa_how(run, bool(launched))}" if aa
        else "no A/A pass: the noise floor is the run-to-run variation",
        f"cache: {cfg.get('cache')} (cold = unique prefix per request"
        + (", drawn from --seed: every engine was launched fresh, so runs with the same seed send the same "
           "requests" if (run.get("protocol") or {}).get("cold_prefixes") == "seeded" else "")
        + (", cache_prompt:false to llama.cpp" if cfg.get("no_prompt_cache") else "")
        + ", SGLang /flush_cache before each phase; warm = bare prompts, primed once)",
        "sampling sent (before per-kind mapping): "
        + ", ".join(f"{k}={v}" for k, v in sorted(ex.items()) if k not in ("model", "stream", "stream_options")),
    ]  # fmt: skip
    if run.get("goodput"):
        out.append("goodput SLOs: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in run["goodput"].items()))
    return out


def _aa_how(run: Mapping[str, Any], launched: bool) -> str:
    if not run.get("time_shared"):
        return "a second pass of the baseline in every cell repeat"
    if launched:
        return "the baseline launched again after the candidates (restart-to-restart noise)"
    return "the baseline measured again after the candidates"


def _busy_flags(recs: list[dict[str, Any]]) -> dict[tuple[str, Cell], str]:
    """(engine, cell) -> why it cannot decide: a repeat in which the engine ran requests the bench did not send."""
    out: dict[tuple[str, Cell], str] = {}
    for r in recs:
        busy = r.get("foreign") if r.get("type") == "sample" else None
        if isinstance(busy, dict) and busy.get("flagged"):
            key = (str(r["engine"]), _cell(r))
            out.setdefault(
                key,
                f"engine busy with other clients: {r['engine']} ran {busy.get('max_excess')} "
                f"request(s) the bench did not send (repeat {r.get('repeat')}, {busy.get('when')})",
            )
    return out


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
