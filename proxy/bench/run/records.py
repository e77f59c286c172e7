"""The JSONL records of measured work: one ``request`` per request, one ``sample`` per cell repeat per engine.

A burst (token events read together) is the engine's or the client's (``proxy.bench.run.client.LoopLag``): each
request says which (``burst_cause``) and how long the client stalled while it ran (``client_lag_s``); a sample
counts the engine's bursts (``bursts``, ``bursts_unrated``) apart from the client's (``bursts_client``,
``bursts_client_unrated``), with the client's longest stall in the repeat (``client_lag_max_s``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, cast

from proxy.bench.run.benchconfig import CellSpec, Target
from proxy.bench.run.client import RequestOutcome
from proxy.bench.run.memprobe import MemorySource
from proxy.bench.verdict.workload import meets_slo, percentile


def _median(vals: Sequence[float]) -> float | None:
    return percentile(vals, 50)


#: characters of each output kept in the record (the first divergence between two engines is found in them)
OUT_HEAD_CHARS = 512


def request_record(t: Target, o: RequestOutcome, t0_ns: int, **extra: Any) -> dict[str, Any]:
    tm, u, e = o.timing, o.usage, o.engine
    return {
        "type": "request",
        "engine": t.name,
        **extra,
        "ok": o.ok,
        "status": o.status,
        "error": o.error,
        "ttft_s": tm.ttft_s,
        "headers_s": tm.headers_s,
        "tpot_s": tm.tpot_s,
        "decode_tps": tm.decode_tps,
        "burst": tm.burst,  # the token events came in one read: tpot/decode are the engine's own, or None
        "burst_cause": ("client" if o.client_burst else "engine") if tm.burst else None,
        "client_lag_s": None if o.client_lag_s is None else round(o.client_lag_s, 6),
        "e2e_s": tm.e2e_s,
        "itl_s": [round(g, 6) for g in tm.gaps_s],
        "prompt_tokens": u.prompt_tokens if u else None,
        "completion_tokens": u.completion_tokens if u else None,
        "cached_tokens": o.cached_tokens,
        "token_events": o.n_token_events,
        "retried": o.retried,
        "finish_reason": o.finish_reason,
        "engine_timings": asdict(e) if e else None,
        "t_s": (o.t_start_ns - t0_ns) / 1e9,
        # the output: its hash (identical or not) and head (where two engines' greedy outputs part)
        "out_sha": hashlib.sha1(o.text.encode()).hexdigest()[:16] if o.ok else None,
        "out_head": o.text[:OUT_HEAD_CHARS] if o.ok else None,
        "out_chars": len(o.text) if o.ok else None,
    }


def sample_record(
    engine: str,
    cell: CellSpec,
    rep: int,
    outs: Sequence[RequestOutcome],
    t_a: int,
    t_b: int,
    mem_peak: int | None,
    mem: MemorySource,
    slo: Mapping[str, float],
    mem_engine: str,
) -> dict[str, Any]:
    ok = [o for o in outs if o.ok]
    wall = (t_b - t_a) / 1e9
    tokens = sum((o.usage.completion_tokens or 0) for o in ok if o.usage)

    def vals(attr: str) -> list[float]:
        return [cast(float, getattr(o.timing, attr)) for o in ok if getattr(o.timing, attr) is not None]

    itl = [g for o in ok if not o.timing.burst for g in o.timing.gaps_s]  # a burst's gaps time the reader
    comp = [float(o.usage.completion_tokens) for o in ok if o.usage and o.usage.completion_tokens]
    prompt = [float(o.usage.prompt_tokens) for o in ok if o.usage and o.usage.prompt_tokens]
    good = sum(
        1
        for o in ok
        if meets_slo({"ok": True, "ttft_s": o.timing.ttft_s, "tpot_s": o.timing.tpot_s, "e2e_s": o.timing.e2e_s}, slo)
    )
    rec: dict[str, Any] = {
        "type": "sample",
        "engine": engine,
        **cell.key(),
        "repeat": rep,
        "sweeps": list(cell.sweeps),
        "n_ok": len(ok),
        "n_err": len(outs) - len(ok),
        "errors": sorted({o.error for o in outs if o.error})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tps": tokens / wall if wall > 0 and ok else None,
        "request_rate": len(ok) / wall if wall > 0 else None,
        "completion_tokens": sum(comp) / len(comp) if comp else None,
        "prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
        "engine_decode_tps": _median(
            [o.engine.predicted_per_second for o in ok if o.engine and o.engine.predicted_per_second is not None]
        ),
        "bursts": sum(1 for o in ok if o.timing.burst and not o.client_burst),
        "bursts_unrated": sum(1 for o in ok if o.timing.burst and not o.client_burst and o.timing.decode_tps is None),
        "bursts_client": sum(1 for o in ok if o.client_burst),
        "bursts_client_unrated": sum(1 for o in ok if o.client_burst and o.timing.decode_tps is None),
        "client_lag_max_s": max((o.client_lag_s for o in outs if o.client_lag_s is not None), default=None),
        "gpu_mem_peak_bytes": mem_peak,
        "gpu_mem_source": mem.source,
        "gpus": list(mem.gpus.get(mem_engine, ())),
        "gpu_mem_total_bytes": mem.total_bytes,
    }
    for attr in ("ttft_s", "tpot_s", "decode_tps", "e2e_s"):
        rec[attr] = _median(vals(attr))
    for attr, v in (("ttft", vals("ttft_s")), ("tpot", vals("tpot_s")), ("itl", itl)):
        for q in (50, 90, 99):
            rec[f"{attr}_p{q}_s"] = percentile(v, q)
    if slo:
        rec["goodput_rps"] = good / wall if wall > 0 else None
        rec["goodput_frac"] = good / len(outs) if outs else None
    return rec
