"""Bench results JSONL (version 1 or 2) -> ``Data``: the verdict's ``Results`` plus what the report shows.

Version 1 (before the A/A pass and the gates) has no ``aa_of``, ``dropped``, ``context_per_slot`` or ITL; it
does have per-request ``request`` records, so the paired statistics work on it too, with the run-to-run
variation standing in for the A/A noise floor. Its llama.cpp context per slot comes from ``info.n_ctx``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy import engines
from proxy.bench.outdir import read_jsonl, results_file
from proxy.bench.quality.readout import quality_by_candidate
from proxy.bench.suite import SHARED_PREFIX
from proxy.bench.verdict.inputs import MAX_ERROR_RATE, MIN_EFFECT, Cell, EngineInfo, Req, Results, Sample
from proxy.bench.verdict.provenance import bench_command, protocol, report_command
from proxy.engines import started
from proxy.engines.quant import random_weights
from proxy.procs.launch import parse_launch
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


def _cell(r: Mapping[str, Any]) -> Cell:
    rate = r.get("rate")
    return Cell(
        r["cache"],
        int(r["concurrency"]),
        int(r["max_tokens"]),
        r["prompt_len"],
        float(rate) if isinstance(rate, int | float) else None,
    )


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
    """A bench results file (or ``--out`` directory) -> ``Data``: ``ValueError`` when it holds no ``run`` record or
    ``baseline`` is none of its engines. The settings given win over the ones the run recorded."""
    path = results_file(path)
    recs = read_jsonl(path)
    run = next((r for r in recs if r.get("type") == "run"), None)
    if run is None:
        raise ValueError(f"{path}: no 'run' record — not a bench results file")
    end = next((r for r in recs if r.get("type") == "end"), None)
    infos = _engines(run, recs, quantization or {}, path.parent / "engines")
    names = [e.name for e in infos]
    bl = baseline or run.get("baseline") or names[0]
    if bl not in names:
        raise ValueError(f"baseline {bl!r} is not one of the engines: {', '.join(names)}")
    again = report_command(
        [path],
        baseline=baseline,
        min_effect=min_effect,
        max_error_rate=max_error_rate,
        accept_quantization_difference=accept_quantization_difference,
        quantization=quantization,
    )
    results = _results(
        run,
        recs,
        infos,
        bl,
        again,
        min_repeats=min_repeats,
        min_effect=min_effect,
        max_error_rate=max_error_rate,
        accept=accept_quantization_difference,
    )
    return Data(
        title="enginemeter bench report",
        results=results,
        engines_meta=run["engines"],
        requests=[r for r in recs if r.get("type") == "request"],
        tokenized=[r for r in recs if r.get("type") == "prompt_tokens"],
        protocol=protocol(run, end),
        notes=[f"{r.get('engine') or 'bench'}: {r.get('text')}" for r in recs if r.get("type") == "note"],
        interrupted=bool(end is None or end.get("interrupted")),
        duration_s=end.get("duration_s") if end else None,
        goodput=run.get("goodput") or {},
        positions=[
            {"engine": r["engine"], "position": r["position"]}
            for r in recs
            if r.get("type") == "sample" and "position" in r
        ],
        stints=[r for r in recs if r.get("type") == "stint"],
        stopped=(end or {}).get("stopped", {}).get("cause") if (end or {}).get("stopped") else None,
        sources=[str(path)],
        runs=[run],
    )


def _engines(
    run: dict[str, Any], recs: Sequence[Mapping[str, Any]], quant: Mapping[str, str], logs: Path
) -> list[EngineInfo]:
    """The run's engines, each as its latest record says (a time-shared run's ``engine`` record, written once the
    engine is up, replaces the run's entry), with a declared quantization over the recorded one. Updates the run's
    ``engines`` entries to match (what the report shows of them)."""
    later = {
        r["name"]: {k: v for k, v in r.items() if k not in ("type", "role")}
        for r in recs
        if r.get("type") == "engine" and isinstance(r.get("name"), str)
    }
    run["engines"] = [later.pop(e["name"], e) for e in run["engines"]] + list(later.values())
    infos = []
    for e in run["engines"]:
        declared = quant.get(e["name"])
        q = declared or e.get("quantization")
        info = e.get("info") or {}
        ctx = _int(e.get("context_per_slot")) or _int(info.get("n_ctx"))
        dropped = e.get("dropped", [] if run.get("version", 1) == 1 else None)
        infos.append(
            EngineInfo(
                name=e["name"],
                kind=e.get("kind"),
                model=e.get("model"),
                quantization=q,
                sampling=e.get("sampling") or {},
                max_tokens=tuple(e.get("max_tokens") or ()),
                dropped=tuple(dropped) if isinstance(dropped, list) else None,
                context_per_slot=ctx,
                slots=_int(e.get("slots")),
                aa_of=e.get("aa_of"),
                quantization_source="declared" if declared else e.get("quantization_source"),
                **_kv_pool(info, logs / f"{e['name']}.log", e.get("kind")),
            )
        )
        e["quantization"] = q
    return infos


def _results(
    run: Mapping[str, Any],
    recs: list[dict[str, Any]],
    infos: Sequence[EngineInfo],
    baseline: str,
    report: str,
    *,
    min_repeats: int,
    min_effect: float | None,
    max_error_rate: float | None,
    accept: bool,
) -> Results:
    """What the verdict reads of the run; ``report``: the command that reads it again with these settings."""
    cfg = run.get("config", {})
    base = run.get("base", {})
    measured = [r for r in recs if r.get("type") == "request" and r.get("phase") == "measure" and "cache" in r]
    return Results(
        engines=tuple(infos),
        baseline=baseline,
        samples=tuple(_sample(r) for r in recs if r.get("type") == "sample"),
        prompt_tokens=_prompt_tokens(recs, measured),
        base_max_tokens=base.get("max_tokens"),
        base_prompt_len=base.get("prompt_len"),
        memory_budget_bytes=run.get("memory_budget_bytes"),
        min_repeats=min_repeats,
        requests=tuple(_req(r) for r in measured),
        shared_prefix=cfg.get("suite") == SHARED_PREFIX,
        min_effect=min_effect if min_effect is not None else float(cfg.get("min_effect") or MIN_EFFECT),
        max_error_rate=max_error_rate
        if max_error_rate is not None
        else float(cfg.get("max_error_rate", MAX_ERROR_RATE)),
        flags=_busy_flags(recs),
        command=bench_command(run),
        report_command=report,
        accept_quantization_difference=accept or bool(cfg.get("accept_quantization_difference")),
        expected=frozenset(cfg.get("expected_differences") or ()),
        alone=_alone([r for r in recs if r.get("type") == "stint"]),
        time_shared=bool(run.get("time_shared")),
        memory_share=_memory_share(run),
        random_weights={e["name"]: why for e in run["engines"] if (why := weights_random(e))},
        quality=quality_by_candidate(recs, baseline),
    )


def _sample(r: Mapping[str, Any]) -> Sample:
    return Sample(
        engine=r["engine"],
        cell=_cell(r),
        repeat=int(r["repeat"]),
        n_ok=int(r["n_ok"]),
        n_err=int(r["n_err"]),
        ttft_s=r.get("ttft_s"),
        tpot_s=r.get("tpot_s"),
        decode_tps=r.get("decode_tps"),
        e2e_s=r.get("e2e_s"),
        completion_tokens=r.get("completion_tokens"),
        prompt_tokens=r.get("prompt_tokens"),
        output_tps=r.get("output_tps"),
        gpu_mem_peak_bytes=r.get("gpu_mem_peak_bytes"),
        errors=tuple(r.get("errors") or ()),
        gpu_mem_source=r.get("gpu_mem_source"),
        gpus=tuple(r.get("gpus") or ()),
        gpu_mem_total_bytes=r.get("gpu_mem_total_bytes"),
        goodput_rps=r.get("goodput_rps"),
        bursts=int(r.get("bursts") or 0),
        bursts_unrated=int(r.get("bursts_unrated") or 0),
        bursts_client=int(r.get("bursts_client") or 0),
        bursts_client_unrated=int(r.get("bursts_client_unrated") or 0),
        client_lag_max_s=r.get("client_lag_max_s"),
        percentiles={k: v for k, v in r.items() if k.endswith(("_p50_s", "_p90_s", "_p99_s"))},
    )


def _req(r: Mapping[str, Any]) -> Req:
    return Req(
        engine=r["engine"],
        cell=_cell(r),
        repeat=int(r.get("repeat", 0)),
        index=int(r.get("index", 0)),
        ok=bool(r.get("ok")),
        ttft_s=r.get("ttft_s"),
        tpot_s=r.get("tpot_s"),
        decode_tps=r.get("decode_tps"),
        e2e_s=r.get("e2e_s"),
        prompt_tokens=_int(r.get("prompt_tokens")),
        cached_tokens=_int(r.get("cached_tokens")),
    )


def _prompt_tokens(
    recs: Sequence[Mapping[str, Any]], measured: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, int]]:
    """engine -> ``tokenizer:PROMPT`` (its own tokenizer's count) and ``usage:KEY`` (what a request's usage said)."""
    pt: dict[str, dict[str, int]] = {}
    for r in recs:
        if r.get("type") == "prompt_tokens" and isinstance(r.get("tokens"), int):
            pt.setdefault(r["engine"], {})[f"tokenizer:{r['prompt']}"] = r["tokens"]
    for r in measured:
        if r.get("ok") and isinstance(r.get("prompt_tokens"), int) and r.get("key"):
            pt.setdefault(r["engine"], {})[f"usage:{r['key']}"] = r["prompt_tokens"]
    return pt


def _memory_share(run: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """Launched engines whose command line sets their share of the GPU's memory (SGLang, vLLM: the dialect's)."""
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
    return random_weights(meta.get("launch") if isinstance(meta.get("launch"), str) else None, meta.get("info") or {})


def _alone(stints: list[dict[str, Any]]) -> frozenset[str]:
    """Launched engines that found no other process on the GPU when they started."""
    return frozenset(s["engine"] for s in stints if s.get("launch") and s.get("gpu_processes_before") == 0)


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
