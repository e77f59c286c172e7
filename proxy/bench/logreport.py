"""The proxy's mirror comparison log(s) -> the bench report's ``Data``, through the same gates.

- **Files**: several paths or globs; rotated logs (``x.jsonl``, ``x.jsonl.1``, ...) are read together, pairs
  ordered by time.
- **Observed concurrency**: each pair's interval is estimated from its record time and durations (the record
  is written when the later side ends; both sides start together), and the pairs are grouped by how many
  intervals overlapped its start: c=1, 2–3, 4–7, ≥8. Only pairs that ran alone (c=1) are judged for
  single-request decode; the other groups are shown, not judged. Throughput and long context need the bench.
- **Repeats**: live traffic has none, so each group's consecutive pairs are cut into ``blocks`` slices.
- **Effective sampling per engine**: what ``proxy.normalize`` drops for each engine's kind (from the pair
  records' ``sampling``/``dropped`` where the proxy writes them, else derived from the kind).
- **Quantization, context per slot, slots**: ``--quantization``, else the proxy's engine info (``/health``
  ``engine_state`` via ``--proxy URL``); GPU memory per engine (its peak since the proxy started) from the
  proxy's ``/metrics``, for the memory gate.
- **Contention**: a pair is *contended* when its record says so (``contended``/``gpus``) or, via ``--proxy``,
  the proxy's per-engine GPU memory shows the primary and the shadow on one GPU. Contended speeds are not the
  engines' own (each slows the other): the parity gate stops there.
"""

from __future__ import annotations

import glob as globmod
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.config import canonical_sampling
from proxy.bench.memory import PER_ENGINE, MemReading, parse_metrics, read_memory
from proxy.bench.model import MIN_EFFECT, Cell, EngineInfo, Reason, Req, Results, Sample
from proxy.bench.results import Data, read_jsonl
from proxy.normalize import normalize_request
from proxy.types import EngineKind

BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 3), (4, 7), (8, 0))  # (low, high); 0 = open
#: the sampling a client typically sends; what the proxy drops of it per kind is the "effective sampling"
TYPICAL = {"temperature": 0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0, "max_tokens": 16}  # fmt: skip


def expand(paths: Sequence[str]) -> list[Path]:
    """Paths and globs -> files, each rotated family oldest first (``x.jsonl.2``, ``x.jsonl.1``, ``x.jsonl``)."""
    out: list[Path] = []
    for p in paths:
        hits = sorted(globmod.glob(p)) if any(ch in p for ch in "*?[") else [p]
        if not hits:
            raise ValueError(f"{p}: no such file")
        for h in hits:
            if Path(h) not in out:
                out.append(Path(h))

    def rank(q: Path) -> tuple[str, int]:
        stem, _, n = q.name.rpartition(".")
        return (str(q.parent / stem), -int(n)) if n.isdigit() else (str(q), 0)

    return sorted(out, key=rank)


def effective_for_kind(kind: str | None) -> tuple[dict[str, Any], list[str] | None]:
    if kind not in ("llamacpp", "sglang", "vllm", "openai"):
        return {}, None
    k: EngineKind = kind  # type: ignore[assignment]
    norm = normalize_request(dict(TYPICAL), endpoint="chat", kind=k, served_model=None, defaults={})
    return canonical_sampling(norm.body), sorted({c.param for c in norm.changes if c.action == "dropped"})


def engine_info_from_proxy(url: str, timeout: float = 5.0) -> tuple[dict[str, dict[str, Any]], dict[str, MemReading]]:
    """(engine -> /health engine_state facts, engine -> its GPU memory peak since the proxy started, the GPUs it
    holds memory on and their total) from a running proxy."""
    import httpx

    base = url.rstrip("/")
    health = httpx.get(f"{base}/health", timeout=timeout, trust_env=False).json()
    states = ((health.get("engine_state") or {}).get("engines") or {}) if isinstance(health, dict) else {}
    text = httpx.get(f"{base}/metrics", timeout=timeout, trust_env=False).text
    peaks: dict[str, float] = {}
    for name, labels, v in parse_metrics(text):
        if name == "enginemeter_engine_gpu_memory_peak_bytes":
            peaks[labels.get("engine", "")] = peaks.get(labels.get("engine", ""), 0) + v
    mem: dict[str, MemReading] = {}
    for engine in set(states) | set(peaks):
        now = read_memory(text, engine)
        if now.source in PER_ENGINE:
            peak = int(peaks.get(engine, now.used_bytes or 0))
            mem[engine] = MemReading(max(peak, now.used_bytes or 0), "proxy engine peak", now.gpus, now.total_bytes)
    return states, mem


def _observed(recs: Sequence[Mapping[str, Any]]) -> list[int]:
    spans = []
    for r in recs:
        end = float(r.get("ts") or 0)
        dur = max((float(r[s].get("e2e_s") or 0) for s in ("primary", "shadow")), default=0.0)
        spans.append((end - dur, end))
    return [sum(1 for a, b in spans if a <= s0 <= b) for s0, _ in spans]


def _bucket(n: int) -> tuple[int, int]:
    return next(b for b in BUCKETS if n >= b[0] and (b[1] == 0 or n <= b[1]))


def _med(vals: Sequence[Any]) -> float | None:
    v = [float(x) for x in vals if isinstance(x, int | float) and not isinstance(x, bool)]
    return statistics.median(v) if v else None


def load_log(
    paths: Path | Sequence[Path],
    *,
    baseline: str | None = None,
    quantization: Mapping[str, str] | None = None,
    blocks: int = 5,
    min_repeats: int = 3,
    min_effect: float | None = None,
    engine_info: Mapping[str, Mapping[str, Any]] | None = None,
    memory: Mapping[str, MemReading] | None = None,
    memory_budget_bytes: int | None = None,
) -> Data:
    files = [paths] if isinstance(paths, Path) else list(paths)
    recs = [
        r
        for f in files
        for r in read_jsonl(f)
        if isinstance(r.get("primary"), dict) and isinstance(r.get("shadow"), dict)
    ]
    if not recs:
        raise ValueError(f"{', '.join(map(str, files))}: no comparison records (objects with 'primary' and 'shadow')")
    recs.sort(key=lambda r: r.get("ts") or 0)
    kinds: dict[str, str] = {}
    order: list[str] = []
    for r in recs:
        for side in (r["primary"], r["shadow"]):
            name = str(side.get("engine"))
            kinds.setdefault(name, str(side.get("kind")))
            if name not in order:
                order.append(name)
    primary_names = [str(r["primary"].get("engine")) for r in recs]
    bl = baseline or max(set(primary_names), key=primary_names.count)
    if bl not in order:
        raise ValueError(f"baseline {bl!r} is not in the log: {', '.join(order)}")
    if len(order) == 1:
        raise ValueError(f"{files[0]}: only one engine in the log")
    order.remove(bl)
    order.insert(0, bl)
    conc = dict(zip(map(id, recs), _observed(recs), strict=True))
    mem = dict(memory or {})
    gpus = {name: set(m.gpus) for name, m in mem.items() if m.gpus}

    def side_of(r: Mapping[str, Any], name: str) -> Mapping[str, Any]:
        s: Mapping[str, Any] = r["primary"] if r["primary"].get("engine") == name else r["shadow"]
        return s

    samples: list[Sample] = []
    reqs: list[Req] = []
    pt: dict[str, dict[str, int]] = {}
    requests: list[dict[str, Any]] = []
    contended: dict[str, list[str]] = {}
    for other in order[1:]:
        mine = [r for r in recs if {bl, other} == {r["primary"].get("engine"), r["shadow"].get("engine")}]
        for lo, hi in BUCKETS:
            cell = Cell("live", lo, hi, "mixed")
            group = [r for r in mine if _bucket(conc[id(r)]) == (lo, hi)]
            n = len(group)
            kk = max(1, min(blocks, n))
            for b in range(kk if n else 0):
                chunk = group[b * n // kk : (b + 1) * n // kk]
                for name in (bl, other):
                    sides = [side_of(r, name) for r in chunk]
                    ok = [s for s in sides if s.get("outcome") == "ok"]
                    errs = sorted({str(s.get("outcome")) for s in sides if s.get("outcome") != "ok"})
                    samples.append(Sample(
                        engine=name, cell=cell, repeat=b, n_ok=len(ok), n_err=len(sides) - len(ok),
                        ttft_s=_med([s.get("upstream_ttft_s", s.get("ttft_s")) for s in ok]),
                        tpot_s=_med([s.get("tpot_s") for s in ok]), decode_tps=_med([s.get("decode_tps") for s in ok]),
                        e2e_s=_med([s.get("e2e_s") for s in ok]), completion_tokens=_med([s.get("completion_tokens") for s in ok]),
                        prompt_tokens=_med([s.get("prompt_tokens") for s in ok]), errors=tuple(f"outcome {e}" for e in errs),
                        gpu_mem_peak_bytes=mem[name].used_bytes if name in mem else None,
                        gpu_mem_source=mem[name].source if name in mem else None,
                        gpus=mem[name].gpus if name in mem else (), gpu_mem_total_bytes=mem[name].total_bytes if name in mem else None,
                    ))  # fmt: skip
                    for i, s in enumerate(sides):
                        reqs.append(Req(engine=name, cell=cell, repeat=b, index=i, ok=s.get("outcome") == "ok",
                                        ttft_s=s.get("upstream_ttft_s", s.get("ttft_s")), tpot_s=s.get("tpot_s"),
                                        decode_tps=s.get("decode_tps"), e2e_s=s.get("e2e_s")))  # fmt: skip
        for r in mine:
            rid = str(r.get("request_id") or id(r))
            for s in (r["primary"], r["shadow"]):
                if s.get("outcome") == "ok" and isinstance(s.get("prompt_tokens"), int):
                    pt.setdefault(str(s["engine"]), {})[f"usage:{rid}"] = s["prompt_tokens"]
                requests.append({"engine": s.get("engine"), "phase": "live", **s})
            why = _contention(r, gpus)
            if why:
                contended.setdefault(other, []).append(why)
    quant = dict(quantization or {})
    info = engine_info or {}
    infos = []
    for name in order:
        st = info.get(name, {})
        sampling, dropped = effective_for_kind(kinds.get(name))
        q = quant.get(name) or st.get("quantization")
        infos.append(EngineInfo(
            name=name, kind=kinds.get(name), model=st.get("model"), quantization=q, sampling=sampling,
            dropped=tuple(dropped) if dropped is not None else None,
            context_per_slot=st.get("context_length"), slots=st.get("slots"),
            quantization_source="declared" if name in quant else "proxy engine info" if q else None,
        ))  # fmt: skip
    extra: list[Reason] = []
    for other, whys in contended.items():
        extra.append(Reason("parity", "inconclusive", f"contended: {len(whys)} mirrored pair(s) of {bl} and {other} ran "
                            f"on a shared GPU ({whys[0]}) — each slows the other, so the speeds are not the engines' "
                            "own; mirror to a shadow on its own GPU", "contention"))  # fmt: skip
    results = Results(engines=tuple(infos), baseline=bl, samples=tuple(samples), prompt_tokens=pt,
                      min_repeats=min_repeats, min_effect=MIN_EFFECT if min_effect is None else min_effect,
                      requests=tuple(reqs), live=True,
                      extra_parity=tuple(extra), memory_budget_bytes=memory_budget_bytes)  # fmt: skip
    return Data(
        title="enginemeter report: mirrored traffic",
        results=results,
        engines_meta=[
            {
                "name": i.name,
                "kind": i.kind,
                "model": i.model,
                "quantization": i.quantization,
                "quantization_source": i.quantization_source,
                "slots": i.slots,
                "context_per_slot": i.context_per_slot,
                "dropped": list(i.dropped) if i.dropped is not None else None,
            }
            for i in infos
        ],
        requests=requests,
        protocol=_protocol(files, recs, blocks, conc),
        notes=[
            "throughput and long-context steps need the offline bench (enginemeter bench)",
            "effective sampling per engine: what proxy.normalize drops for the engine's kind from a client's "
            "usual sampling params (temperature, top_p, top_k, min_p, repetition penalty, presence/frequency "
            "penalty, seed, max_tokens)",
        ],
    )


def _contention(r: Mapping[str, Any], gpus: Mapping[str, set[int]]) -> str | None:
    if r.get("contended") is True:
        g = r.get("gpus") or {}
        shared = sorted(set(g.get("primary") or ()) & set(g.get("shadow") or ()))
        return f"GPU {', '.join(map(str, shared))}" if shared else "the proxy marked the pair contended"
    if gpus:
        p, s = str(r["primary"].get("engine")), str(r["shadow"].get("engine"))
        shared = sorted(gpus.get(p, set()) & gpus.get(s, set()))
        if shared:
            return f"GPU {', '.join(map(str, shared))}, per the proxy's GPU attribution"
    return None


def _protocol(
    files: Sequence[Path], recs: Sequence[Mapping[str, Any]], blocks: int, conc: Mapping[int, int]
) -> list[str]:
    first, last = recs[0].get("ts"), recs[-1].get("ts")
    span = f"{(last - first) / 60:.1f} min" if isinstance(first, int | float) and isinstance(last, int | float) else "?"
    mism = sum(1 for r in recs if (r.get("mismatch") or {}).get("output"))
    greedy = sum(1 for r in recs if r.get("greedy"))
    counts: dict[tuple[int, int], int] = {}
    for r in recs:
        b = _bucket(conc[id(r)])
        counts[b] = counts.get(b, 0) + 1
    groups = ", ".join(
        f"{Cell('live', lo, hi, 'mixed').label().split(', ')[1]}: {n}" for (lo, hi), n in sorted(counts.items())
    )
    return [
        f"source: proxy comparison log {', '.join(map(str, files))} — {len(recs)} mirrored pairs over {span}",
        f"pairs by observed concurrency (overlapping pairs at each start, from record times and durations): {groups}",
        f"each group's consecutive pairs cut into up to {blocks} blocks, each block one 'repeat'",
        "TTFT here is upstream TTFT (sent upstream -> first token)",
        f"greedy pairs: {greedy}; greedy pairs whose output text differs: {mism}",
        "records: " + json.dumps(sorted({k for r in recs for k in r})),
    ]
