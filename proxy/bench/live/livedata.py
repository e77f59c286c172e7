"""The proxy's comparison log -> one ``Live`` per primary engine: the bench report's ``Data`` (through the same
gates) plus what only live traffic has (the anytime-valid verdict, outcomes by cause, the sampling it carried).

- **Runs and pairs** (``proxy.bench.live.log``): the latest proxy run unless ``run`` says otherwise; each shadow
  compared only with the primary it was mirrored from (one ``Live`` per primary, its shadows the candidates).
- **Observed concurrency**: the record's ``concurrency.overlapping`` (mirrored requests that overlapped the pair,
  itself included; the proxy counts them), else an estimate from record times and durations. Groups c=1, 2–3,
  4–7, ≥8 (``Cell.concurrency``..``Cell.concurrency_max``); only c=1 is judged for single-request decode by the
  gates, every regime by the sequential verdict (``proxy.sequential``).
- **Repeats**: live traffic has none, so each group's consecutive pairs are cut into ``blocks`` slices.
- **Outcomes by cause**: pairs lost to a client hang-up, a shutdown, an unreachable engine or a request both
  engines refused are counted and shown, never an engine's failure. Engine-side failures up to
  ``max_error_rate`` (2 %) of the pairs are left out and stated; above it they stop the data gate.
- **Sampling as carried**: the pair records' per-side ``sampling`` (what each engine got after normalization,
  dropped and defaulted params), grouped temperature 0 / above 0; every pair must have given both engines the
  same canonical sampling. Records of a proxy that did not write it fall back to what ``proxy.normalize`` drops
  for each kind from a client's usual params, said as such.
- **Greedy outputs**: the share of greedy pairs whose texts differ and where (first differing token).
- **Engine facts**: ``quantization`` declared, else the run's ``engine`` records (the proxy's engine-state poller:
  model path, quantization, context, slots) read with the bench's own rules (engine info, then the GGUF header
  of the model file, then the model's name), else a running proxy's ``/health`` (``--proxy``, same run only).
- **Contention**: a pair is *contended* when its record says so (``contended``/``gpus``) or the proxy's
  per-engine GPU memory shows the two on one GPU; the parity gate stops there.
"""

from __future__ import annotations

import bisect
import dataclasses
import shlex
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.bench.live.facts import (
    Greedy,
    ProxyInfo,
    SamplingGroup,
    effective_for_kind,
    engine_facts,
    greedy_agreement,
    greedy_text,
    legacy_sampling,
    proxy_info,
    sampling_groups,
    sampling_reasons,
    side_sampling,
)
from proxy.bench.live.log import CAUSE_TEXT, Log, Outcomes, Selection, expand, outcomes, read_log, select, start_of
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.inputs import MAX_ERROR_RATE, Cell, EngineInfo, LiveFinding, Reason, Req, Results, Sample
from proxy.engines.quant import random_weights
from proxy.gpu.scraped import MemReading
from proxy.sequential import MIN_EFFECT, REGIME_LABEL, LiveVerdict, regime_of, replay, sentence

__all__ = ["Live", "ProxyInfo", "effective_for_kind", "expand", "greedy_text", "load_live", "load_log", "proxy_info"]

BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 3), (4, 7), (8, 0))  # (low, high); 0 = open


# ---- observed concurrency ------------------------------------------------------------------------------


def _estimated(recs: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Legacy records (no ``concurrency``): per engine, the intervals open at each pair's start, from record
    times and durations; the larger of its two engines'. O(n log n)."""
    spans: dict[str, tuple[list[float], list[float]]] = {}
    for r in recs:
        a, b = start_of(r), float(r.get("ts") or 0)
        for s in ("primary", "shadow"):
            st, en = spans.setdefault(str(r[s].get("engine")), ([], []))
            st.append(a)
            en.append(b)
    for st, en in spans.values():
        st.sort()
        en.sort()
    out: dict[int, int] = {}
    for r in recs:
        t = start_of(r)
        out[id(r)] = max(
            bisect.bisect_right(st, t) - bisect.bisect_left(en, t)
            for st, en in (spans[str(r[s].get("engine"))] for s in ("primary", "shadow"))
        )
    return out


def concurrency_of(recs: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """id(record) -> observed concurrency (1 = the pair ran alone)."""
    legacy = [r for r in recs if not isinstance((r.get("concurrency") or {}).get("overlapping"), int)]
    out = _estimated(legacy) if legacy else {}
    for r in recs:
        if id(r) not in out:
            out[id(r)] = max(1, int(r["concurrency"]["overlapping"]))
    return out


def bucket(n: int) -> tuple[int, int]:
    return next(b for b in BUCKETS if n >= b[0] and (b[1] == 0 or n <= b[1]))


def _med(vals: Sequence[Any]) -> float | None:
    v = [float(x) for x in vals if isinstance(x, int | float) and not isinstance(x, bool)]
    return statistics.median(v) if v else None


# ---- the report's data --------------------------------------------------------------------------------


@dataclass
class Live:
    """One primary engine and the shadows mirrored from it."""

    primary: str
    data: Data
    selection: Selection
    verdicts: dict[str, LiveVerdict]  # shadow -> its anytime-valid verdict (with history)
    outcomes: dict[str, Outcomes]  # shadow -> its pairs by cause
    sampling: dict[str, list[SamplingGroup]]  # "primary"/shadow name -> groups, per engine pair
    greedy: dict[str, Greedy]
    #: (engine, observed concurrency, upstream TTFT s, decode tok/s) of every ok side, for the charts
    points: list[tuple[str, int, float | None, float | None]]
    lost: dict[str, int]  # the mirror's own counts of copies never paired (dropped, unpaired), by result
    min_effect: float
    max_error_rate: float


def load_live(
    paths: Path | Sequence[Path] | Log,
    *,
    run: str | None = None,
    since: float | None = None,
    until: float | None = None,
    primary: str | None = None,
    shadow: str | None = None,
    quantization: Mapping[str, str] | None = None,
    blocks: int = 5,
    min_repeats: int = 3,
    proxy: ProxyInfo | None = None,
    memory_budget_bytes: int | None = None,
    min_effect: float = MIN_EFFECT,
    max_error_rate: float = MAX_ERROR_RATE,
) -> list[Live]:
    log = paths if isinstance(paths, Log) else read_log([paths] if isinstance(paths, Path) else list(paths))
    sel = select(log, run=run, since=since, until=until, primary=primary, shadow=shadow)
    notes = [f"source: proxy comparison log, {sel.read}", *sel.notes,
             *(f"warning: {w}" for w in sel.warnings)]  # fmt: skip
    # url "": facts handed in by the caller, not read from a proxy (they apply to whatever run is reported)
    same_run = proxy is not None and not proxy.error and (not proxy.url or any(r.id == proxy.run for r in sel.runs))
    if proxy is not None and proxy.error:
        notes.append(f"proxy {proxy.url} did not answer ({proxy.error}): engine facts from the log only, no GPU memory")
    elif proxy is not None and not same_run:
        notes.append(f"proxy {proxy.url} is run {proxy.run}, not the run reported: its engine info and GPU memory "
                     "are not used")  # fmt: skip
    info = proxy if same_run and proxy is not None else ProxyInfo("")
    conc = concurrency_of([r for run_ in sel.runs for r in run_.records])
    lost = Counter[str]()
    for run_ in sel.runs:
        for end in run_.ends:
            lost.update(
                {k: v for k, v in (end.get("counts") or {}).items() if k.startswith("dropped_") or k == "unpaired"}
            )
    if same_run and info.copies:  # the proxy still runs: its counters so far (every worker's)
        lost = Counter({k: n for k, n in info.copies.items() if k.startswith("dropped_") or k == "unpaired"})
    out = []
    for p in sorted({k[0] for k in sel.pairs}):
        mine = {s: recs for (pp, s), recs in sel.pairs.items() if pp == p}
        lv = _live(p, mine, sel, conc, notes, quantization or {}, blocks, min_repeats, info, memory_budget_bytes,
                   min_effect, max_error_rate, dict(lost))  # fmt: skip
        again = ["enginemeter", "report", "--log", *map(str, log.files), "--primary", p]
        run_id = sel.runs[0].id if len(sel.runs) == 1 else "all" if len(sel.runs) > 1 else None
        again += ["--run", run_id] if run_id else []
        lv.data.results = dataclasses.replace(lv.data.results, report_command=shlex.join(again))
        out.append(lv)
    return out


#: regime step -> the live stream that decides it (the others are shown beside it): single request: TPOT; under
#: load: e2e per output token (the time a loaded request takes per token); long context: TTFT
DECIDING = {
    "decode": ("decode", "tpot_s"),
    "throughput": ("load", "e2e_per_token_s"),
    "long-context": ("long", "ttft_s"),
}


def findings(v: LiveVerdict) -> dict[str, LiveFinding]:
    """Each regime as the anytime-valid live verdict has it: its deciding stream's decision, in words."""
    out: dict[str, LiveFinding] = {}
    states = v.states()
    for step, (regime, metric) in DECIDING.items():
        stream = next((s for s in states if s.regime == regime and s.metric == metric), None)
        if stream is None:
            continue
        st = states[stream]
        out[step] = LiveFinding(st.decision, sentence(v.shadow, v.primary, stream, st, v.min_effect), st.n,
                                f"{REGIME_LABEL[regime]} {stream.label}")  # fmt: skip
    return out


def load_log(
    paths: Path | Sequence[Path],
    *,
    baseline: str | None = None,
    engine_info: Mapping[str, Mapping[str, Any]] | None = None,
    memory: Mapping[str, MemReading] | None = None,
    **kw: Any,
) -> Data:
    """The single primary's ``Data`` (``baseline`` picks one when the log has several); ``engine_info`` and
    ``memory`` as a proxy's ``/health`` and ``/metrics`` would give them."""
    if engine_info is not None or memory is not None:
        kw["proxy"] = ProxyInfo(
            "", states={k: dict(v) for k, v in (engine_info or {}).items()}, memory=dict(memory or {})
        )
    lives = load_live(paths, primary=baseline, **kw)
    if len(lives) > 1:
        raise ValueError(f"pairs mirrored from {len(lives)} primaries ({', '.join(x.primary for x in lives)}): "
                         "pick one with --primary")  # fmt: skip
    return lives[0].data


def _live(
    bl: str, mine: Mapping[str, list[dict[str, Any]]], sel: Selection, conc: Mapping[int, int], notes: list[str],
    quant: Mapping[str, str], blocks: int, min_repeats: int, info: ProxyInfo,
    budget: int | None, min_effect: float, max_error_rate: float, lost: dict[str, int],
) -> Live:  # fmt: skip
    order = [bl, *sorted(mine)]
    rnd = {n: why for n in order if (why := random_weights(None, {**sel.facts(n), **info.states.get(n, {})}))}
    mem = dict(info.memory)
    gpus = {name: set(m.gpus) for name, m in mem.items() if m.gpus}
    samples: list[Sample] = []
    reqs: list[Req] = []
    pt: dict[str, dict[str, int]] = {}
    requests: list[dict[str, Any]] = []
    extra: list[Reason] = []
    verdicts: dict[str, LiveVerdict] = {}
    outs: dict[str, Outcomes] = {}
    sampling: dict[str, list[SamplingGroup]] = {}
    greedy: dict[str, Greedy] = {}
    points: list[tuple[str, int, float | None, float | None]] = []
    dropped_of: dict[str, set[str]] = {}
    canon_of: dict[str, Mapping[str, Any]] = {}
    for other, recs in mine.items():
        o = outs[other] = outcomes(recs)
        extra += _outcome_reasons(bl, other, o, max_error_rate)
        over = {n for n in (bl, other) if o.failure_rate(n) > max_error_rate}
        kept = [r for r in recs if r["primary"].get("outcome") == "ok" and r["shadow"].get("outcome") == "ok"]
        failed = [r for r in recs if r not in kept and any(
            s.get("outcome") != "ok" and str(s.get("engine")) in over for s in (r["primary"], r["shadow"]))]  # fmt: skip
        for lo, hi in BUCKETS:
            group = [r for r in kept if bucket(conc[id(r)]) == (lo, hi)]
            bad = [r for r in failed if bucket(conc[id(r)]) == (lo, hi)]
            mts = {(side_sampling(r["primary"]) or {}).get("params", {}).get("max_tokens") for r in group}
            mt = next(iter(mts)) if len(mts) == 1 and isinstance(next(iter(mts)), int) else 0
            cell = Cell("live", lo, mt, "mixed", concurrency_max=hi)
            n = len(group)
            kk = max(1, min(blocks, n))
            for b in range(kk if n else 0):
                chunk = group[b * n // kk : (b + 1) * n // kk]
                errs = bad[b * len(bad) // kk : (b + 1) * len(bad) // kk]
                for name, role in ((bl, "primary"), (other, "shadow")):
                    sides = [r[role] for r in chunk]
                    n_err = sum(1 for r in errs if r[role].get("outcome") != "ok")
                    samples.append(Sample(
                        engine=name, cell=cell, repeat=b, n_ok=len(sides), n_err=n_err,
                        ttft_s=_med([s.get("upstream_ttft_s", s.get("ttft_s")) for s in sides]),
                        tpot_s=_med([s.get("tpot_s") for s in sides]), decode_tps=_med([s.get("decode_tps") for s in sides]),
                        e2e_s=_med([s.get("e2e_s") for s in sides]), completion_tokens=_med([s.get("completion_tokens") for s in sides]),
                        prompt_tokens=_med([s.get("prompt_tokens") for s in sides]),
                        errors=tuple(sorted({f"outcome {r[role].get('outcome')}" for r in errs if r[role].get("outcome") != "ok"})),
                        gpu_mem_peak_bytes=mem[name].used_bytes if name in mem else None,
                        gpu_mem_source=mem[name].source if name in mem else None,
                        gpus=mem[name].gpus if name in mem else (), gpu_mem_total_bytes=mem[name].total_bytes if name in mem else None,
                    ))  # fmt: skip
                    for i, s in enumerate(sides):
                        reqs.append(Req(engine=name, cell=cell, repeat=b, index=i, ok=True,
                                        ttft_s=s.get("upstream_ttft_s", s.get("ttft_s")), tpot_s=s.get("tpot_s"),
                                        decode_tps=s.get("decode_tps"), e2e_s=s.get("e2e_s"),
                                        prompt_tokens=s.get("prompt_tokens"), cached_tokens=s.get("cached_tokens")))  # fmt: skip
        contended = []
        for r in recs:
            rid = str(r.get("request_id") or id(r))
            for s in (r["primary"], r["shadow"]):
                if s.get("outcome") == "ok" and isinstance(s.get("prompt_tokens"), int):
                    pt.setdefault(str(s["engine"]), {})[f"usage:{rid}"] = s["prompt_tokens"]
                requests.append({"engine": s.get("engine"), "phase": "live", **s})
            if r in kept:
                for s in (r["primary"], r["shadow"]):
                    points.append((str(s.get("engine")), conc[id(r)], s.get("upstream_ttft_s"), s.get("decode_tps")))
            why = _contention(r, gpus)
            if why:
                contended.append(why)
        if contended:
            extra.append(Reason("parity", "inconclusive", f"contended: {len(contended)} mirrored pair(s) of {bl} and "
                                f"{other} ran on a shared GPU ({contended[0]}) — each slows the other, so the speeds "
                                "are not the engines' own; mirror to a shadow on its own GPU", "contention"))  # fmt: skip
        verdicts[other] = replay(((regime_of(conc[id(r)], r["primary"].get("prompt_tokens")), r["primary"], r["shadow"])
                                  for r in kept), bl, other, min_effect=min_effect, history=True)  # fmt: skip
        sampling[bl] = sampling[bl] if bl in sampling else sampling_groups(recs, "primary")
        sampling[other] = sampling_groups(recs, "shadow")
        extra += sampling_reasons(bl, other, recs, canon_of, dropped_of)
        greedy[other] = greedy_agreement(kept)
        extra.append(Reason("parity", "note", greedy_text(bl, other, greedy[other], rnd), "output"))
    infos = []
    for name in order:
        t = engine_facts(name, sel.kind(name), sel.facts(name), quant.get(name), info.states.get(name, {}))
        sampling_, dropped = (canon_of[name], tuple(sorted(dropped_of[name]))) if name in canon_of else (
            legacy_sampling(sel.kind(name)))  # fmt: skip
        infos.append(EngineInfo(
            name=name, kind=t.kind, model=t.model, quantization=t.quantization, sampling=sampling_, dropped=dropped,
            context_per_slot=t.context_per_slot, slots=t.slots, quantization_source=t.quantization_source,
            kv_pool_tokens=t.info.get("kv_pool_tokens"),
        ))  # fmt: skip
    results = Results(engines=tuple(infos), baseline=bl, samples=tuple(samples), prompt_tokens=pt,
                      min_repeats=min_repeats, min_effect=min_effect, requests=tuple(reqs), live=True,
                      extra_parity=tuple(extra), memory_budget_bytes=budget, max_error_rate=max_error_rate,
                      live_findings={s: findings(v) for s, v in verdicts.items()},
                      random_weights=rnd)  # fmt: skip
    meta = [{"name": i.name, "kind": i.kind, "model": i.model, "quantization": i.quantization,
             "quantization_source": i.quantization_source, "slots": i.slots, "context_per_slot": i.context_per_slot,
             "dropped": list(i.dropped) if i.dropped is not None else None} for i in infos]  # fmt: skip
    data = Data(
        title="enginemeter report: mirrored traffic",
        results=results,
        engines_meta=meta,
        requests=requests,
        protocol=_protocol(sel, bl, mine, blocks, conc, notes),
        notes=[
            "aggregate throughput needs the offline bench (enginemeter bench); under load and long context are "
            "judged here by the anytime-valid live verdict, per pair"
        ],
    )
    return Live(bl, data, sel, verdicts, outs, sampling, greedy, points, lost, min_effect, max_error_rate)


def _outcome_reasons(bl: str, other: str, o: Outcomes, max_rate: float) -> list[Reason]:
    out = []
    lost = {c: n for c, n in o.by_cause.items() if c not in ("ok", "engine")}
    if lost:
        what = "; ".join(f"{n} {CAUSE_TEXT[c]}" for c, n in sorted(lost.items()))
        down = ", ".join(f"{e}: {n}" for e, n in sorted(o.unreachable.items()))
        out.append(Reason("data", "ok", f"{sum(lost.values())} of {o.total} pairs of {bl} and {other} lost for causes "
                          f"that are not an engine's speed, left out: {what}" + (f" (unreachable — {down})" if down else ""),
                          "causes"))  # fmt: skip
    for name in (bl, other):
        f = o.failures.get(name)
        if not f:
            continue
        n, rate = sum(f.values()), o.failure_rate(name)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(f.items()))
        judged = o.by_cause.get("ok", 0) + o.by_cause.get("engine", 0)
        if rate > max_rate:
            out.append(Reason("data", "inconclusive", f"{name}: engine-side failures in {n} of {judged} pairs "
                              f"({rate:.1%} > {max_rate * 100:g}%: {kinds}) — the engine itself fails under this "
                              "traffic", "errors"))  # fmt: skip
        else:
            out.append(Reason("data", "ok", f"{name}: engine-side failures in {n} of {judged} pairs ({rate:.1%}, "
                              f"within the {max_rate * 100:g}% the live report tolerates: {kinds}); those pairs are left "
                              "out", "errors"))  # fmt: skip
    return out


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


def _protocol(sel: Selection, bl: str, mine: Mapping[str, Sequence[Mapping[str, Any]]], blocks: int,
              conc: Mapping[int, int], notes: Sequence[str]) -> list[str]:  # fmt: skip
    recs = sorted((r for rs in mine.values() for r in rs), key=lambda x: float(x.get("ts") or 0))
    first, last = start_of(recs[0]), float(recs[-1].get("ts") or 0)
    counts = Counter(bucket(conc[id(r)]) for r in recs)
    groups = ", ".join(f"{Cell('live', lo, 0, 'mixed', concurrency_max=hi).label().split(', ')[1]}: {n}"
                       for (lo, hi), n in sorted(counts.items()))  # fmt: skip
    runs = "; ".join(r.label() for r in sel.runs)
    has_conc = all(isinstance(r.get("concurrency"), dict) for r in recs)
    return [
        *notes[:1],
        f"proxy run(s): {runs}",
        f"{len(recs)} pairs mirrored from {bl} to {', '.join(sorted(mine))} over {(last - first) / 60:.1f} min; each "
        "shadow is compared only with the primary it was mirrored from",
        f"pairs by observed concurrency ({'mirrored requests that overlapped each pair, counted by the proxy' if has_conc else 'overlapping pairs at each start, estimated from record times and durations'}): {groups}",
        f"each group's consecutive pairs cut into up to {blocks} blocks, each block one 'repeat'",
        "TTFT here is upstream TTFT (sent upstream -> first token)",
        *notes[1:],
    ]  # fmt: skip
