"""The proxy's comparison log -> one ``Live`` per primary engine: the bench report's ``Data`` (through the same
gates) plus what only live traffic has (the anytime-valid verdict, outcomes by cause, the sampling it carried).

- **Runs and pairs** (``proxy.bench.live.log``): the latest proxy run unless ``run`` says otherwise; each shadow
  compared only with the primary it was mirrored from (one ``Live`` per primary, its shadows the candidates).
- **Observed concurrency** (``proxy.bench.live.livesamples``): the record's ``concurrency.overlapping``
  (mirrored requests that overlapped the pair, itself included; the proxy counts them), else an estimate from
  record times and durations. Groups c=1, 2–3, 4–7, ≥8 (``Cell.concurrency``..``Cell.concurrency_max``); only
  c=1 is judged for single-request decode by the gates, every regime by the sequential verdict
  (``proxy.sequential``).
- **Repeats**: live traffic has none, so each group's consecutive pairs are cut into ``blocks`` slices.
- **Outcomes by cause** (``proxy.bench.live.findings``): pairs lost to a client hang-up, a shutdown, an
  unreachable engine or a request both engines refused are counted and shown, never an engine's failure.
  Engine-side failures up to ``max_error_rate`` (2 %) of the pairs are left out and stated; above it they stop
  the data gate.
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

import dataclasses
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
)
from proxy.bench.live.findings import contention, contention_reason, findings, outcome_reasons
from proxy.bench.live.livesamples import bucket, concurrency_of, group_samples
from proxy.bench.live.log import Log, Outcomes, Selection, expand, outcomes, read_log, select, start_of
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.inputs import MAX_ERROR_RATE, Cell, EngineInfo, Reason, Req, Results, Sample
from proxy.engines.quant import random_weights
from proxy.gpu.scraped import MemReading
from proxy.sequential import MIN_EFFECT, LiveVerdict, regime_of, replay

__all__ = ["Live", "ProxyInfo", "effective_for_kind", "expand", "greedy_text", "load_live", "load_log", "proxy_info"]

#: what the offline bench measures that live traffic cannot
_NOTE = (
    "aggregate throughput needs the offline bench (enginemeter bench); under load and long context are "
    "judged here by the anytime-valid live verdict, per pair"
)


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


@dataclass(frozen=True)
class _Options:
    """``load_live``'s choices, as one primary's report uses them."""

    quantization: Mapping[str, str]
    blocks: int
    min_repeats: int
    budget: int | None
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
    notes = [f"source: proxy comparison log, {sel.read}", *sel.notes, *(f"warning: {w}" for w in sel.warnings)]
    # url "": facts handed in by the caller, not read from a proxy (they apply to whatever run is reported)
    same_run = proxy is not None and not proxy.error and (not proxy.url or any(r.id == proxy.run for r in sel.runs))
    if proxy is not None and proxy.error:
        notes.append(f"proxy {proxy.url} did not answer ({proxy.error}): engine facts from the log only, no GPU memory")
    elif proxy is not None and not same_run:
        notes.append(
            f"proxy {proxy.url} is run {proxy.run}, not the run reported: its engine info and GPU memory are not used"
        )
    info = proxy if same_run and proxy is not None else ProxyInfo("")
    conc = concurrency_of([r for run_ in sel.runs for r in run_.records])
    lost = _lost(sel, info if same_run else None)
    opts = _Options(quantization or {}, blocks, min_repeats, memory_budget_bytes, min_effect, max_error_rate)
    out = []
    for p in sorted({k[0] for k in sel.pairs}):
        mine = {s: recs for (pp, s), recs in sel.pairs.items() if pp == p}
        lv = _live(p, mine, sel, conc, notes, info, opts, dict(lost))
        again = ["enginemeter", "report", "--log", *map(str, log.files), "--primary", p]
        run_id = sel.runs[0].id if len(sel.runs) == 1 else "all" if len(sel.runs) > 1 else None
        again += ["--run", run_id] if run_id else []
        lv.data.results = dataclasses.replace(lv.data.results, report_command=shlex.join(again))
        out.append(lv)
    return out


def _lost(sel: Selection, running: ProxyInfo | None) -> Counter[str]:
    """The mirror's copies never paired, by result: the runs' end records, or a running proxy's counters so far
    (every worker's)."""
    lost = Counter[str]()
    for run_ in sel.runs:
        for end in run_.ends:
            lost.update(
                {k: v for k, v in (end.get("counts") or {}).items() if k.startswith("dropped_") or k == "unpaired"}
            )
    if running is not None and running.copies:
        lost = Counter({k: n for k, n in running.copies.items() if k.startswith("dropped_") or k == "unpaired"})
    return lost


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
        raise ValueError(
            f"pairs mirrored from {len(lives)} primaries ({', '.join(x.primary for x in lives)}): "
            "pick one with --primary"
        )
    return lives[0].data


@dataclass
class _Pairs:
    """What one primary's pairs add up to, shadow after shadow, in the order the report shows them."""

    samples: list[Sample] = field(default_factory=list)
    reqs: list[Req] = field(default_factory=list)
    prompt_tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[Reason] = field(default_factory=list)
    verdicts: dict[str, LiveVerdict] = field(default_factory=dict)
    outcomes: dict[str, Outcomes] = field(default_factory=dict)
    sampling: dict[str, list[SamplingGroup]] = field(default_factory=dict)
    greedy: dict[str, Greedy] = field(default_factory=dict)
    points: list[tuple[str, int, float | None, float | None]] = field(default_factory=list)
    dropped_of: dict[str, set[str]] = field(default_factory=dict)
    canon_of: dict[str, Mapping[str, Any]] = field(default_factory=dict)


def _live(
    bl: str,
    mine: Mapping[str, list[dict[str, Any]]],
    sel: Selection,
    conc: Mapping[int, int],
    notes: list[str],
    info: ProxyInfo,
    opts: _Options,
    lost: dict[str, int],
) -> Live:
    order = [bl, *sorted(mine)]
    rnd = {n: why for n in order if (why := random_weights(None, {**sel.facts(n), **info.states.get(n, {})}))}
    acc = _Pairs()
    for other, recs in mine.items():
        _add_shadow(acc, bl, other, recs, conc, info.memory, rnd, opts)
    infos = [_engine_info(name, sel, opts.quantization.get(name), info, acc) for name in order]
    results = Results(
        engines=tuple(infos),
        baseline=bl,
        samples=tuple(acc.samples),
        prompt_tokens=acc.prompt_tokens,
        min_repeats=opts.min_repeats,
        min_effect=opts.min_effect,
        requests=tuple(acc.reqs),
        live=True,
        extra_parity=tuple(acc.reasons),
        memory_budget_bytes=opts.budget,
        max_error_rate=opts.max_error_rate,
        live_findings={s: findings(v) for s, v in acc.verdicts.items()},
        random_weights=rnd,
    )
    data = Data(
        title="enginemeter report: mirrored traffic",
        results=results,
        engines_meta=[_meta(i) for i in infos],
        requests=acc.requests,
        protocol=_protocol(sel, bl, mine, opts.blocks, conc, notes),
        notes=[_NOTE],
    )
    return Live(
        bl,
        data,
        sel,
        acc.verdicts,
        acc.outcomes,
        acc.sampling,
        acc.greedy,
        acc.points,
        lost,
        opts.min_effect,
        opts.max_error_rate,
    )


def _add_shadow(
    acc: _Pairs,
    bl: str,
    other: str,
    recs: list[dict[str, Any]],
    conc: Mapping[int, int],
    mem: Mapping[str, MemReading],
    rnd: Mapping[str, str],
    opts: _Options,
) -> None:
    """One shadow's pairs with the primary: outcomes, samples, the sides, contention, the live verdict, the
    sampling carried and greedy agreement."""
    o = acc.outcomes[other] = outcomes(recs)
    acc.reasons += outcome_reasons(bl, other, o, opts.max_error_rate)
    over = {n for n in (bl, other) if o.failure_rate(n) > opts.max_error_rate}
    kept = [r for r in recs if r["primary"].get("outcome") == "ok" and r["shadow"].get("outcome") == "ok"]
    failed = [
        r
        for r in recs
        if r not in kept
        and any(s.get("outcome") != "ok" and str(s.get("engine")) in over for s in (r["primary"], r["shadow"]))
    ]
    samples, reqs = group_samples(bl, other, kept, failed, conc, opts.blocks, mem)
    acc.samples += samples
    acc.reqs += reqs
    gpus = {name: set(m.gpus) for name, m in mem.items() if m.gpus}
    contended = _add_sides(acc, recs, kept, conc, gpus)
    if contended:
        acc.reasons.append(contention_reason(bl, other, contended))
    acc.verdicts[other] = replay(
        ((regime_of(conc[id(r)], r["primary"].get("prompt_tokens")), r["primary"], r["shadow"]) for r in kept),
        bl,
        other,
        min_effect=opts.min_effect,
        history=True,
    )
    acc.sampling[bl] = acc.sampling[bl] if bl in acc.sampling else sampling_groups(recs, "primary")
    acc.sampling[other] = sampling_groups(recs, "shadow")
    acc.reasons += sampling_reasons(bl, other, recs, acc.canon_of, acc.dropped_of)
    acc.greedy[other] = greedy_agreement(kept)
    acc.reasons.append(Reason("parity", "note", greedy_text(bl, other, acc.greedy[other], rnd), "output"))


def _add_sides(
    acc: _Pairs,
    recs: Sequence[Mapping[str, Any]],
    kept: Sequence[Mapping[str, Any]],
    conc: Mapping[int, int],
    gpus: Mapping[str, set[int]],
) -> list[str]:
    """Every side of every pair as a request of the report (its prompt tokens for the parity check, the kept
    ones as chart points); returns why each contended pair was."""
    contended = []
    for r in recs:
        rid = str(r.get("request_id") or id(r))
        for s in (r["primary"], r["shadow"]):
            if s.get("outcome") == "ok" and isinstance(s.get("prompt_tokens"), int):
                acc.prompt_tokens.setdefault(str(s["engine"]), {})[f"usage:{rid}"] = s["prompt_tokens"]
            acc.requests.append({"engine": s.get("engine"), "phase": "live", **s})
        if r in kept:
            for s in (r["primary"], r["shadow"]):
                acc.points.append((str(s.get("engine")), conc[id(r)], s.get("upstream_ttft_s"), s.get("decode_tps")))
        why = contention(r, gpus)
        if why:
            contended.append(why)
    return contended


def _engine_info(name: str, sel: Selection, declared: str | None, info: ProxyInfo, acc: _Pairs) -> EngineInfo:
    t = engine_facts(name, sel.kind(name), sel.facts(name), declared, info.states.get(name, {}))
    sampling, dropped = (
        (acc.canon_of[name], tuple(sorted(acc.dropped_of[name])))
        if name in acc.canon_of
        else legacy_sampling(sel.kind(name))
    )
    return EngineInfo(
        name=name,
        kind=t.kind,
        model=t.model,
        quantization=t.quantization,
        sampling=sampling,
        dropped=dropped,
        context_per_slot=t.context_per_slot,
        slots=t.slots,
        quantization_source=t.quantization_source,
        kv_pool_tokens=t.info.get("kv_pool_tokens"),
    )


def _meta(i: EngineInfo) -> dict[str, Any]:
    return {
        "name": i.name,
        "kind": i.kind,
        "model": i.model,
        "quantization": i.quantization,
        "quantization_source": i.quantization_source,
        "slots": i.slots,
        "context_per_slot": i.context_per_slot,
        "dropped": list(i.dropped) if i.dropped is not None else None,
    }


def _protocol(
    sel: Selection,
    bl: str,
    mine: Mapping[str, Sequence[Mapping[str, Any]]],
    blocks: int,
    conc: Mapping[int, int],
    notes: Sequence[str],
) -> list[str]:
    recs = sorted((r for rs in mine.values() for r in rs), key=lambda x: float(x.get("ts") or 0))
    first, last = start_of(recs[0]), float(recs[-1].get("ts") or 0)
    counts = Counter(bucket(conc[id(r)]) for r in recs)
    groups = ", ".join(
        f"{Cell('live', lo, 0, 'mixed', concurrency_max=hi).label().split(', ')[1]}: {n}"
        for (lo, hi), n in sorted(counts.items())
    )
    runs = "; ".join(r.label() for r in sel.runs)
    counted = (
        "mirrored requests that overlapped each pair, counted by the proxy"
        if all(isinstance(r.get("concurrency"), dict) for r in recs)
        else "overlapping pairs at each start, estimated from record times and durations"
    )
    return [
        *notes[:1],
        f"proxy run(s): {runs}",
        f"{len(recs)} pairs mirrored from {bl} to {', '.join(sorted(mine))} over {(last - first) / 60:.1f} min; each "
        "shadow is compared only with the primary it was mirrored from",
        f"pairs by observed concurrency ({counted}): {groups}",
        f"each group's consecutive pairs cut into up to {blocks} blocks, each block one 'repeat'",
        "TTFT here is upstream TTFT (sent upstream -> first token)",
        *notes[1:],
    ]
