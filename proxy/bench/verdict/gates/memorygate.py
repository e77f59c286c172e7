"""The memory gate: the candidate's per-engine GPU memory peak against the user's budget, or its GPU's total when
it held that GPU alone; device-wide readings are not judged. An excess a memory-share setting makes (SGLang
``--mem-fraction-static``, vLLM ``--gpu-memory-utilization``) is a caveat up to ``CAVEAT_MAX_EXCESS`` of the budget,
inconclusive up to ``RESIZE_MAX_EXCESS`` (rerun at the share that fits), and "does not fit" beyond. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.bench.verdict.inputs import EngineInfo, Reason, Results, Sample
from proxy.gpu.scraped import PER_ENGINE
from proxy.notation import gib

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
    """The candidate's peak against the budget given, else against its GPU's total when it held that GPU alone."""
    pb, _, gb, _ = _peak(samples, base)
    pc, src, gc, total = _peak(samples, cand)
    if pc is None:
        return [_note("GPU memory peak unknown (no proxy metrics, no NVML): memory fit not judged")]
    if src not in PER_ENGINE:
        return [
            _note(
                f"GPU memory of {cand} not attributed per engine (source: {src}; it includes every process on the "
                "device): memory fit not judged — run through the proxy"
            )
        ]
    nums = f"peak {base} {gib(pb) if pb is not None else 'unknown'}, {cand} {gib(pc)}"
    budget, what = r.memory_budget_bytes, "budget"
    if budget is None and total and (not (gb & gc) or cand in r.alone):
        held = "launched alone on it" if cand in r.alone else "held by it alone"
        budget, what = total, f"its GPU's total (GPU {', '.join(map(str, sorted(gc)))}, {held})"
    elif budget is None and total:
        return [
            _note(
                f"{nums}; both engines hold memory on GPU {sorted(gb & gc)}: no budget given (--memory-budget) and "
                "the GPU's total is not the candidate's to use"
            )
        ]
    if budget is None:
        return [_note(nums + " (no budget: --memory-budget)")]
    if pc <= budget:
        return [Reason("memory", "ok", f"{nums}; fits {what} {gib(budget)} ({gib(budget - pc)} to spare)", "memory")]
    return [_over(r, cand, nums, f"{what} {gib(budget)}", (pc, budget, total))]


def _note(text: str) -> Reason:
    return Reason("memory", "note", text, "memory")


def _peak(samples: Sequence[Sample], name: str) -> tuple[int | None, str | None, set[int], int | None]:
    """An engine's GPU memory peak, its source, the GPUs it held and their total (the largest recorded)."""
    mine = [s for s in samples if s.engine == name and s.gpu_mem_peak_bytes is not None]
    if not mine:
        return None, None, set(), None
    best = max(mine, key=lambda s: s.gpu_mem_peak_bytes or 0)
    gpus = {g for s in mine for g in s.gpus}
    totals = [s.gpu_mem_total_bytes for s in mine if s.gpu_mem_total_bytes]
    return best.gpu_mem_peak_bytes, best.gpu_mem_source, gpus, max(totals) if totals else None


def _over(r: Results, cand: str, nums: str, limit: str, sizes: tuple[int, int, int | None]) -> Reason:
    """A peak over ``limit`` (what, and its size in words): a caveat or a rerun when a memory-share setting makes
    the excess, else "does not fit". ``sizes``: the peak, the budget and the GPU's total, in bytes."""
    pc, budget, total = sizes
    share = r.memory_share.get(cand)
    excess = pc - budget
    fits = share_that_fits(share, pc, budget, total) if share is not None and total else None
    if share is None or fits is None or excess > RESIZE_MAX_EXCESS * budget:
        return Reason("memory", "stay", f"{cand} does not fit: {nums} > {limit}", "memory")
    flag, now = share
    info = next((e for e in r.engines if e.name == cand), None)
    kv = _kv_tokens(info, (now - fits) * (total or 0))
    setting = (
        f"its footprint is a setting ({flag} {now:g} of the GPU's {gib(total)}: weights and KV cache), not the "
        f"model's — at {flag} {fits:g} it takes ~{gib((now - fits) * (total or 0))} less, from its KV cache{kv}"
    )
    so = "launch it so, and it fits" + _context_cut(info, (now - fits) * (total or 0))
    if excess <= CAVEAT_MAX_EXCESS * budget:
        text = f"{cand} peaked {gib(excess)} ({excess * 100 / budget:.1f} %) over {limit} as launched ({nums}); "
        return Reason("memory", "note", f"{text}{setting}: {so}", CAVEAT)
    return Reason(
        "memory",
        "inconclusive",
        f"{cand} does not fit as launched: {nums} > {limit}; over by {gib(excess)}, and {setting}; rerun it so "
        "under a new name and join that run with the baseline's",
        "memory",
    )
