"""The memory gate: the candidate's per-engine GPU memory peak against the user's budget, or its GPU's total when
it held that GPU alone; device-wide readings are not judged. An excess a memory-share setting makes (SGLang
``--mem-fraction-static``, vLLM ``--gpu-memory-utilization``) is a caveat up to ``CAVEAT_MAX_EXCESS`` of the budget,
inconclusive up to ``RESIZE_MAX_EXCESS`` (rerun at the share that fits), and "does not fit" beyond. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def _context_cut(info: EngineInfo | None, bytes_: float) -> int | None:
    """vLLM will not start unless its KV cache holds one request of its whole context (``--max-model-len``): when the
    smaller pool would not, the context it must come down to (None: unchanged)."""
    if (
        info is None
        or info.kind != "vllm"
        or not (info.kv_pool_tokens and info.kv_cache_bytes and info.context_per_slot)
    ):
        return None
    left = int(info.kv_pool_tokens - bytes_ / info.kv_cache_bytes * info.kv_pool_tokens)
    return left if left < info.context_per_slot else None


@dataclass(frozen=True)
class Resize:
    """The memory-share setting at which the candidate's measured peak fits (the gate's caveat, or its rerun): the
    flag, its value as launched and the one that fits, the context vLLM must come down to (None: unchanged). Not
    measured so: what the gate computes from the peak, the budget and the GPU's total."""

    flag: str
    now: float
    fits: float
    max_model_len: int | None

    def flags(self) -> dict[str, str]:
        """The launch flags to change, and their values."""
        out = {self.flag: f"{self.fits:g}"}
        if self.max_model_len is not None:
            out["--max-model-len"] = str(self.max_model_len)
        return out

    def words(self) -> str:
        """How to launch it so: "--gpu-memory-utilization 0.888, --max-model-len 195712"."""
        return ", ".join(f"{k} {v}" for k, v in self.flags().items())


def memory_gate(r: Results, samples: Sequence[Sample], base: str, cand: str) -> list[Reason]:
    """The candidate's peak against the budget given, else against its GPU's total when it held that GPU alone."""
    return _assess(r, samples, base, cand)[0]


def resize(r: Results, base: str, cand: str) -> Resize | None:
    """The setting the memory gate found that makes ``cand`` fit (a caveat or a rerun), else None: computed as the
    gate computes it, for the switch plan's config."""
    return _assess(r, r.samples, base, cand)[1]


def _assess(r: Results, samples: Sequence[Sample], base: str, cand: str) -> tuple[list[Reason], Resize | None]:
    pb, _, gb, _ = _peak(samples, base)
    pc, src, gc, total = _peak(samples, cand)
    if pc is None:
        return [_note("GPU memory peak unknown (no proxy metrics, no NVML): memory fit not judged")], None
    if src not in PER_ENGINE:
        why = (
            f"GPU memory of {cand} not attributed per engine (source: {src}; it includes every process on the "
            "device): memory fit not judged — run through the proxy"
        )
        return [_note(why)], None
    nums = f"peak {base} {gib(pb) if pb is not None else 'unknown'}, {cand} {gib(pc)}"
    budget, what = r.memory_budget_bytes, "budget"
    if budget is None and total and (not (gb & gc) or cand in r.alone):
        held = "launched alone on it" if cand in r.alone else "held by it alone"
        budget, what = total, f"its GPU's total (GPU {', '.join(map(str, sorted(gc)))}, {held})"
    elif budget is None and total:
        why = (
            f"{nums}; both engines hold memory on GPU {sorted(gb & gc)}: no budget given (--memory-budget) and "
            "the GPU's total is not the candidate's to use"
        )
        return [_note(why)], None
    if budget is None:
        return [_note(nums + " (no budget: --memory-budget)")], None
    if pc <= budget:
        fits = f"{nums}; fits {what} {gib(budget)} ({gib(budget - pc)} to spare)"
        return [Reason("memory", "ok", fits, "memory")], None
    reason, z = _over(r, cand, nums, f"{what} {gib(budget)}", (pc, budget, total))
    return [reason], z


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


def _over(
    r: Results, cand: str, nums: str, limit: str, sizes: tuple[int, int, int | None]
) -> tuple[Reason, Resize | None]:
    """A peak over ``limit`` (what, and its size in words): a caveat or a rerun when a memory-share setting makes
    the excess (and that setting), else "does not fit". ``sizes``: the peak, the budget and the GPU's total, in
    bytes."""
    pc, budget, total = sizes
    share = r.memory_share.get(cand)
    excess = pc - budget
    fits = share_that_fits(share, pc, budget, total) if share is not None and total else None
    if share is None or fits is None or excess > RESIZE_MAX_EXCESS * budget:
        return Reason("memory", "stay", f"{cand} does not fit: {nums} > {limit}", "memory"), None
    flag, now = share
    info = next((e for e in r.engines if e.name == cand), None)
    freed = (now - fits) * (total or 0)
    z = Resize(flag, now, fits, _context_cut(info, freed))
    setting = (
        f"its footprint is a setting ({flag} {now:g} of the GPU's {gib(total)}: weights and KV cache), not the "
        f"model's — at {flag} {fits:g} it takes ~{gib(freed)} less, from its KV cache{_kv_tokens(info, freed)}"
    )
    so = "launch it so, and it fits"
    if z.max_model_len is not None and info is not None:
        so += (
            f" — with --max-model-len at most {z.max_model_len:,} (its pool would hold {z.max_model_len:,} tokens, "
            f"and vLLM refuses to start when one request of its {info.context_per_slot:,}-token context does not "
            "fit)"
        )
    if excess <= CAVEAT_MAX_EXCESS * budget:
        text = f"{cand} peaked {gib(excess)} ({excess * 100 / budget:.1f} %) over {limit} as launched ({nums}); "
        return Reason("memory", "note", f"{text}{setting}: {so}", CAVEAT), z
    return Reason(
        "memory",
        "inconclusive",
        f"{cand} does not fit as launched: {nums} > {limit}; over by {gib(excess)}, and {setting}; rerun it so "
        "under a new name and join that run with the baseline's",
        "memory",
    ), z
