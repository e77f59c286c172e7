"""The gates before any speed is judged: enough data (and honest cache phases), parity, memory. Pure.

Each returns reasons; a reason whose outcome is in ``model.FAILS`` fails its gate.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from proxy.bench.verdict.inputs import Assessment, Cell, EngineInfo, Reason, Req, Results, Sample
from proxy.engines import quant_key
from proxy.gpu.scraped import PER_ENGINE
from proxy.notation import gib


def _reason(step: str, outcome: Assessment, text: str, check: str) -> Reason:
    return Reason(step, outcome, text, check)


# ---- data --------------------------------------------------------------------------------------------


def cache_flags(requests: Sequence[Req], shared_prefix: bool = False) -> dict[tuple[str, Cell], str]:
    """(engine, cell) -> why the cell's cache phase is not what it says: a cold request served from the
    prompt cache (half its prompt or more cached), a warm request with no cached tokens reported."""
    by: dict[tuple[str, Cell], list[Req]] = {}
    for q in requests:
        if q.ok:
            by.setdefault((q.engine, q.cell), []).append(q)
    out: dict[tuple[str, Cell], str] = {}
    for (engine, cell), reqs in by.items():
        if cell.cache == "cold" and not shared_prefix:
            hit = [q for q in reqs if q.cached_tokens and q.prompt_tokens and q.cached_tokens >= q.prompt_tokens / 2]
            if hit:
                q = hit[0]
                out[(engine, cell)] = (
                    f"{len(hit)} of {len(reqs)} cold requests were served from the prompt cache "
                    f"(e.g. {q.cached_tokens} of {q.prompt_tokens} prompt tokens cached)"
                )
        elif cell.cache == "warm":
            miss = [q for q in reqs if not q.cached_tokens]
            if miss:
                out[(engine, cell)] = f"{len(miss)} of {len(reqs)} warm requests report no cached prompt tokens"
    return out


def data_gate(
    r: Results, samples: Sequence[Sample], base: str, cand: str, judged: str | None, common: set[Cell],
    by: Mapping[tuple[str, Cell], Sequence[Sample]],
) -> list[Reason]:  # fmt: skip
    out: list[Reason] = []
    for name in (base, cand):
        mine = [s for s in samples if s.engine == name]
        n_ok = sum(s.n_ok for s in mine)
        n_err = sum(s.n_err for s in mine)
        if not mine or n_ok == 0:
            out.append(_reason("data", "inconclusive", f"{name}: no successful requests", "errors"))
        elif n_err:
            errs = sorted({e for s in mine for e in s.errors})[:3]
            rate = n_err / (n_ok + n_err)
            within = rate <= r.max_error_rate
            # a rare failure (a dropped connection) is stated and left out of the figures, as live traffic's
            # are; more than --max-error-rate says the engine does not serve this load: no figure can decide
            cap = f"{r.max_error_rate * 100:g}%"
            # a cell where most requests failed says the engine does not serve that load, whatever the total
            worst = max((s for s in mine if s.n_err), key=lambda s: s.n_err / (s.n_ok + s.n_err))
            broken = worst.n_err > worst.n_ok
            allowed = (f" — {rate:.1%}, above the {cap} allowed (--max-error-rate)" if not within else
                       f" — most of one repeat failed ({worst.n_err} of {worst.n_ok + worst.n_err} at "
                       f"{worst.cell.label()})" if broken else
                       f" — {rate:.2%}, within the {cap} allowed (--max-error-rate): the latency figures are over "
                       "the answered requests, and output tok/s counts only their tokens (a failure costs it)")  # fmt: skip
            out.append(_reason("data", "ok" if within and not broken else "inconclusive", f"{name}: {n_err} of "
                               f"{n_ok + n_err} requests failed" + (f" ({'; '.join(errs)})" if errs else "") + allowed,
                               "errors"))  # fmt: skip
    out += [x for name in (base, cand) if (x := _bursts(name, [s for s in samples if s.engine == name]))]
    # live traffic: the anytime-valid verdict's own minimum of pairs decides when anything is decided ("not yet")
    judged_cells = [] if r.live else common
    short = sorted(
        (c.label(), len(by[(base, c)]), len(by[(cand, c)]))
        for c in judged_cells
        if min(len(by[(base, c)]), len(by[(cand, c)])) < r.min_repeats
    )
    if short:
        lab, nb, nc = short[0]
        out.append(_reason("data", "inconclusive", f"too few repeats: {lab} has {nb} ({base}) / {nc} ({cand}) "
                           f"repeats, need >= {r.min_repeats}"
                           + (f" (and {len(short) - 1} more cells)" if len(short) > 1 else ""), "repeats"))  # fmt: skip
    if judged is not None and not common:
        out.append(_reason("data", "inconclusive", "the engines share no measured cell", "cells"))
    flags = cache_flags(r.requests, r.shared_prefix)
    bad = [(e, c, why) for (e, c), why in sorted(flags.items(), key=lambda x: (x[0][0], x[0][1].label()))
           if e in (base, cand) and c.cache == judged]  # fmt: skip
    if bad:
        e, c, why = bad[0]
        out.append(_reason("data", "inconclusive", f"cache phase not as labelled: {e} at {c.label()}: {why}"
                           + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""), "cache"))  # fmt: skip
    elif r.requests and judged in ("cold", "warm"):
        what = (
            "no cold request was served from the prompt cache"
            if judged == "cold"
            else ("every warm request reported cached prompt tokens")
        )
        out.append(_reason("data", "ok", f"cache accounting checked: {what}", "cache"))
    return out


def _bursts(name: str, mine: Sequence[Sample]) -> Reason | None:
    """Requests whose token events came in one read: their chunk timing times the reader, not the engine. Stated
    when the engine's own timings stood in; a repeat whose decode figure rests on such requests is inconclusive."""
    hit = [s for s in mine if s.bursts]
    if not hit:
        return None
    n, unrated, total = sum(s.bursts for s in hit), sum(s.bursts_unrated for s in hit), sum(s.n_ok for s in mine)
    where = max(hit, key=lambda s: s.bursts / max(s.n_ok, 1)).cell.label()
    head = (f"{name}: {n} of {total} requests arrived in one read (token events under 0.1 ms apart, e.g. at "
            f"{where}): their chunk timing is not a decode rate")  # fmt: skip
    if not unrated:
        return _reason("data", "ok", head + " — the engine's own timings stand in for it", "bursts")
    driven = [s for s in hit if 2 * s.bursts_unrated >= s.n_ok]
    tail = (f" — {unrated} without the engine's timings have none; {len(driven)} repeat(s) rest on them: "
            "a buffering hop between the engines and the bench (a proxy, a slow reader), measure closer" if driven
            else f" — {unrated} without the engine's timings are left out of the decode figures")  # fmt: skip
    return _reason("data", "inconclusive" if driven else "ok", head + tail, "bursts")


# ---- parity ------------------------------------------------------------------------------------------


def parity_gate(r: Results, b: EngineInfo, c: EngineInfo, offered: int | None) -> list[Reason]:
    out: list[Reason] = []
    out += _prompt_parity(r, b, c)
    out += _sampling_parity(r, b, c)
    # same max_tokens is not enough if one engine stops early (EOS): then tok/s compares different work
    lens_b = [s.completion_tokens for s in r.samples if s.engine == b.name and s.completion_tokens]
    lens_c = [s.completion_tokens for s in r.samples if s.engine == c.name and s.completion_tokens]
    if lens_b and lens_c:
        mb, mc = statistics.mean(lens_b), statistics.mean(lens_c)
        if abs(mb - mc) > 0.1 * max(mb, mc):
            out.append(_reason("parity", "inconclusive", f"output lengths differ: {b.name} {mb:.1f} vs {c.name} "
                               f"{mc:.1f} tokens per request on average — set ignore_eos or compare per-token "
                               "figures only", "output length"))  # fmt: skip
    out += _context_parity(b, c, offered, "context" in r.expected)
    out += _quant_parity(b, c, r.accept_quantization_difference)
    return out


def _prompt_parity(r: Results, b: EngineInfo, c: EngineInfo) -> list[Reason]:
    pb, pc = r.prompt_tokens.get(b.name, {}), r.prompt_tokens.get(c.name, {})
    keys = sorted(set(pb) & set(pc))
    if not keys:
        return [_reason("parity", "inconclusive", "prompt-token parity unknown: no prompt was counted on both engines",
                        "prompt tokens")]  # fmt: skip
    diff = [k for k in keys if pb[k] != pc[k]]
    if diff:
        ex = "; ".join(f"{k}: {pb[k]} vs {pc[k]}" for k in diff[:3])
        return [_reason("parity", "inconclusive", f"prompt tokens differ on {len(diff)} of {len(keys)} prompts "
                        f"({b.name} vs {c.name}: {ex}) — chat template, BOS or tokenizer conversion differ; the "
                        "engines did not see the same input", "prompt tokens")]  # fmt: skip
    return [_reason("parity", "ok", f"prompt tokens equal on all {len(keys)} counts taken on both engines "
                    "(tokenizer and per-request usage)", "prompt tokens")]  # fmt: skip


def _sampling_parity(r: Results, b: EngineInfo, c: EngineInfo) -> list[Reason]:
    out: list[Reason] = []
    sb, sc = dict(b.sampling), dict(c.sampling)
    if not sb or not sc:
        out.append(_reason("parity", "inconclusive", "sampling parameters not recorded for both engines", "sampling"))
    else:
        bad = sorted(k for k in set(sb) | set(sc) if k != "max_tokens" and sb.get(k) != sc.get(k))
        if bad:
            ex = "; ".join(f"{k}: {sb.get(k, 'dropped')!r} vs {sc.get(k, 'dropped')!r}" for k in bad[:4])
            out.append(_reason("parity", "inconclusive", f"effective sampling differs ({b.name} vs {c.name}: {ex})",
                               "sampling"))  # fmt: skip
        else:
            out.append(_reason("parity", "ok", "effective sampling equal: "
                               + ", ".join(f"{k}={sb[k]}" for k in sorted(sb)), "sampling"))  # fmt: skip
    for e, other in ((b, c), (c, b)):
        if e.dropped is None:
            out.append(
                _reason("parity", "note", f"{e.name}: which params the proxy dropped is not recorded", "sampling")
            )
            continue
        only = sorted(set(e.dropped) - set(other.dropped or ()))
        if only:
            out.append(_reason("parity", "inconclusive", f"{e.name} ({e.kind}) had {', '.join(only)} dropped by the "
                               f"per-kind mapping; {other.name} got {'it' if len(only) == 1 else 'them'}", "sampling"))  # fmt: skip
    if sorted(b.max_tokens) != sorted(c.max_tokens) or not b.max_tokens:
        if r.live:
            out.append(_reason("parity", "ok", "max tokens equal by construction (one client request, both sides)",
                               "max tokens"))  # fmt: skip
        else:
            out.append(_reason("parity", "inconclusive", f"max tokens differ: {b.name} {list(b.max_tokens) or 'unknown'}"
                               f" vs {c.name} {list(c.max_tokens) or 'unknown'}", "max tokens"))  # fmt: skip
    else:
        out.append(_reason("parity", "ok", f"same max tokens: {list(b.max_tokens)}", "max tokens"))
    return out


def _context_parity(b: EngineInfo, c: EngineInfo, offered: int | None, expected: bool = False) -> list[Reason]:
    out: list[Reason] = []
    if b.context_per_slot and c.context_per_slot:
        if b.context_per_slot != c.context_per_slot and expected:
            out.append(_reason("parity", "note", f"context per slot differs: {b.name} {b.context_per_slot} vs {c.name} "
                               f"{c.context_per_slot} tokens — the swept flag changes it (llama.cpp: -c divided by "
                               "-np); that is part of what is compared", "context"))  # fmt: skip
        elif b.context_per_slot != c.context_per_slot:
            out.append(_reason("parity", "inconclusive", f"context per slot differs: {b.name} {b.context_per_slot} vs "
                               f"{c.name} {c.context_per_slot} tokens — KV-cache size and batch room differ, so the "
                               "engines are not configured alike (llama.cpp: -c divided by -np)", "context"))  # fmt: skip
        else:
            out.append(_reason("parity", "ok", f"context per slot equal: {b.context_per_slot} tokens", "context"))
    else:
        unknown = [e.name for e in (b, c) if not e.context_per_slot]
        out.append(_reason("parity", "note", f"context per slot unknown for {', '.join(unknown)}", "context"))
    for e, other in ((b, c), (c, b)):
        if e.kv_pool_tokens and e.context_per_slot and e.kv_pool_tokens < e.context_per_slot:
            longest = f"{other.context_per_slot:,} tokens" if other.context_per_slot else "context unknown"
            out.append(_reason("parity", "note", f"{e.name}'s KV pool holds {e.kv_pool_tokens:,} tokens, fewer than "
                               f"its {e.context_per_slot:,}-token context: no request longer than the pool can run "
                               f"on it ({other.name}: {longest}); a service with such requests would see that "
                               "difference, the cells measured here do not", "kv pool"))  # fmt: skip
    if offered:
        for e in (b, c):
            if e.slots is not None and e.slots < offered:
                out.append(_reason("parity", "note", f"{e.name} has {e.slots} slot(s) for an offered concurrency of "
                                   f"{offered}: requests beyond {e.slots} wait inside the engine — that queueing is "
                                   "part of what is measured", "slots"))  # fmt: skip
    return out


def quant_differs(b: EngineInfo, c: EngineInfo) -> bool:
    """Both quantizations known and different after normalization (F16 = FP16 = float16; bf16 ≠ f16)."""
    return bool(b.quantization and c.quantization and quant_key(b.quantization) != quant_key(c.quantization))


def discount(b: EngineInfo, c: EngineInfo) -> str:
    """What a verdict across a declared precision difference includes besides the engines."""
    return (f"includes the precision difference {b.quantization} vs {c.quantization}; a same-weights comparison is "
            "the clean test")  # fmt: skip


def _quant_parity(b: EngineInfo, c: EngineInfo, accept: bool = False) -> list[Reason]:
    undeclared = [e.name for e in (b, c) if not e.quantization]
    if undeclared:
        return [_reason("parity", "inconclusive", f"quantization unknown for {', '.join(undeclared)} (--quantization "
                        "NAME=Q4_K_M|FP16|...)", "quantization")]  # fmt: skip
    kb, kc = quant_key(b.quantization), quant_key(c.quantization)
    src = f"{b.name} {b.quantization} ({b.quantization_source or 'declared'}) vs {c.name} {c.quantization} " \
          f"({c.quantization_source or 'declared'})"  # fmt: skip
    if kb != kc:
        extra = " — bf16 ≠ f16: same size, different number format" if {kb, kc} == {"bf16", "f16"} else ""
        if accept:
            return [_reason("parity", "note", f"quantization differs: {src}{extra} — accepted as a declared "
                            f"difference (--accept-quantization-difference): the verdict is discounted, it "
                            f"{discount(b, c)}", "quantization")]  # fmt: skip
        return [_reason("parity", "inconclusive", f"quantization differs: {src}{extra} — speed and quality both "
                        "change; compare like with like", "quantization")]  # fmt: skip
    return [_reason("parity", "ok", f"quantization equal: {src}", "quantization")]


# ---- memory ------------------------------------------------------------------------------------------


#: what a resized engine is asked to leave free below the budget, beyond its measured excess
RESIZE_MARGIN_BYTES = 2**30 // 4
#: an excess (share of the budget) a setting makes and no larger than this is a caveat beside the verdict, with
#: the share that fits: what a smaller KV pool gives back does not change what was measured
CAVEAT_MAX_EXCESS = 0.02
#: the largest excess read as a setting: a smaller KV pool gives that back without changing what is measured;
#: beyond it the weights and graphs may not fit at all, and it stays "does not fit"
RESIZE_MAX_EXCESS = 0.10
#: the check of a memory reason that is a caveat (``Verdict.caveats``), not a stop
CAVEAT = "memory caveat"


def share_that_fits(share: tuple[str, float], peak: int, budget: int, total: int) -> float | None:
    """The memory share (SGLang ``--mem-fraction-static``, vLLM ``--gpu-memory-utilization``) at which a peak
    measured at ``share`` falls below ``budget`` with ``RESIZE_MARGIN_BYTES`` to spare; None: no share would."""
    _, now = share
    cut = (peak - budget + RESIZE_MARGIN_BYTES) / total
    new = int((now - cut) * 1000) / 1000
    return new if 0 < new < now else None


def _kv_tokens(info: EngineInfo | None, bytes_: float) -> str:
    """What ``bytes_`` of KV pool hold in tokens, when the engine said its pool's size in tokens and bytes (its
    HTTP state or its start-up log: ``proxy.bench.verdict.data``)."""
    if info is None or not info.kv_pool_tokens or not info.kv_cache_bytes:
        return ""
    n = bytes_ / info.kv_cache_bytes * info.kv_pool_tokens
    return f" (≈{n:,.0f} tokens of its {info.kv_pool_tokens:,}-token KV pool)"


def _context_cut(info: EngineInfo | None, bytes_: float) -> str:
    """vLLM will not start unless its KV cache holds one request of its whole context (``--max-model-len``): when the
    smaller pool would not, the context must come down with the share."""
    if (
        info is None
        or info.kind != "vllm"
        or not (info.kv_pool_tokens and info.kv_cache_bytes and info.context_per_slot)
    ):
        return ""
    left = int(info.kv_pool_tokens - bytes_ / info.kv_cache_bytes * info.kv_pool_tokens)
    if left >= info.context_per_slot:
        return ""
    return (
        f" — with --max-model-len at most {left:,} (its pool would hold {left:,} tokens, and vLLM refuses to "
        f"start when one request of its {info.context_per_slot:,}-token context does not fit)"
    )


def memory_gate(r: Results, samples: Sequence[Sample], base: str, cand: str) -> list[Reason]:
    def peak(name: str) -> tuple[int | None, str | None, set[int], int | None]:
        mine = [s for s in samples if s.engine == name and s.gpu_mem_peak_bytes is not None]
        if not mine:
            return None, None, set(), None
        best = max(mine, key=lambda s: s.gpu_mem_peak_bytes or 0)
        gpus = {g for s in mine for g in s.gpus}
        totals = [s.gpu_mem_total_bytes for s in mine if s.gpu_mem_total_bytes]
        return best.gpu_mem_peak_bytes, best.gpu_mem_source, gpus, max(totals) if totals else None

    pb, _, gb, _ = peak(base)
    pc, src, gc, total = peak(cand)
    if pc is None:
        return [_reason("memory", "note", "GPU memory peak unknown (no proxy metrics, no NVML): memory fit not judged",
                        "memory")]  # fmt: skip
    if src not in PER_ENGINE:
        return [_reason("memory", "note", f"GPU memory of {cand} not attributed per engine (source: {src}; it includes "
                        "every process on the device): memory fit not judged — run through the proxy", "memory")]  # fmt: skip
    nums = f"peak {base} {gib(pb) if pb is not None else 'unknown'}, {cand} {gib(pc)}"
    budget, what = r.memory_budget_bytes, "budget"
    if budget is None and total and (not (gb & gc) or cand in r.alone):
        held = "launched alone on it" if cand in r.alone else "held by it alone"
        budget, what = total, f"its GPU's total (GPU {', '.join(map(str, sorted(gc)))}, {held})"
    elif budget is None and total:
        return [_reason("memory", "note", f"{nums}; both engines hold memory on GPU {sorted(gb & gc)}: no budget "
                        "given (--memory-budget) and the GPU's total is not the candidate's to use", "memory")]  # fmt: skip
    if budget is None:
        return [_reason("memory", "note", nums + " (no budget: --memory-budget)", "memory")]
    if pc <= budget:
        return [_reason("memory", "ok", f"{nums}; fits {what} {gib(budget)} ({gib(budget - pc)} to spare)", "memory")]
    share = r.memory_share.get(cand)
    excess = pc - budget
    fits = share_that_fits(share, pc, budget, total) if share is not None and total else None
    if share is None or fits is None or excess > RESIZE_MAX_EXCESS * budget:
        return [_reason("memory", "stay", f"{cand} does not fit: {nums} > {what} {gib(budget)}", "memory")]
    flag, now = share
    info = next((e for e in r.engines if e.name == cand), None)
    kv = _kv_tokens(info, (now - fits) * (total or 0))
    setting = (f"its footprint is a setting ({flag} {now:g} of the GPU's {gib(total)}: weights and KV cache), not the "
               f"model's — at {flag} {fits:g} it takes ~{gib((now - fits) * (total or 0))} less, from its KV cache{kv}")  # fmt: skip
    so = "launch it so, and it fits" + _context_cut(info, (now - fits) * (total or 0))
    if excess <= CAVEAT_MAX_EXCESS * budget:
        return [_reason("memory", "note", f"{cand} peaked {gib(excess)} ({excess * 100 / budget:.1f} %) over {what} "
                        f"{gib(budget)} as launched ({nums}); {setting}: {so}", CAVEAT)]  # fmt: skip
    return [_reason("memory", "inconclusive", f"{cand} does not fit as launched: {nums} > {what} {gib(budget)}; over "
                    f"by {gib(excess)}, and {setting}; rerun it so under a new name and join that run with the "
                    "baseline's", "memory")]  # fmt: skip
