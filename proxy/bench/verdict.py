"""Results -> stay | switch | inconclusive, each reason with its numbers. Pure: no I/O, no clock.

The order is fixed (the seeds' protocol):

1. enough data: every engine answered without errors, every judged cell has >= ``min_repeats`` repeats;
2. parity: prompt tokens equal per prompt, sampling equal, same max tokens, similar output lengths,
   quantization declared on every engine — otherwise *inconclusive* and why;
3. memory fits (when a peak and a budget are known; a candidate that does not fit -> *stay*);
4. single-request decode speed (concurrency 1) — a tie means "decode-bound, switching engines won't fix it";
5. concurrent throughput (aggregate output tok/s at the highest common concurrency);
6. long context (TTFT and decode speed at the longest prompt class).

A difference counts only when the two engines' run-to-run ranges (min..max over repeats) do not overlap: a
difference inside the measured spread is never called a win. A metric whose own spread is wider than
``max_noise`` (relative to its median) is too noisy to judge -> *inconclusive*.
Decision: wins and no losses -> switch; losses and no wins, or only ties -> stay; both -> inconclusive.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Decision = Literal["stay", "switch", "inconclusive"]
Outcome = Literal["ok", "inconclusive", "win", "loss", "tie", "noisy", "stay", "note"]


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of a sweep. ``cache`` is cold|warm|live; ``prompt_len`` short|medium|long|mixed."""

    cache: str
    concurrency: int
    max_tokens: int
    prompt_len: str

    def label(self) -> str:
        return f"{self.cache}, c={self.concurrency}, max_tokens={self.max_tokens}, prompt={self.prompt_len}"


@dataclass(frozen=True, slots=True)
class Sample:
    """One repeat of one cell on one engine: medians over its requests plus the cell's aggregates."""

    engine: str
    cell: Cell
    repeat: int
    n_ok: int
    n_err: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    decode_tps: float | None = None
    e2e_s: float | None = None
    completion_tokens: float | None = None  # mean per request
    prompt_tokens: float | None = None  # mean per request (engine usage): per-cell prompt-token parity
    output_tps: float | None = None  # all output tokens of the repeat / its wall time
    gpu_mem_peak_bytes: int | None = None
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    name: str
    kind: str | None = None
    model: str | None = None
    quantization: str | None = None
    #: the sampling actually sent, canonical (top_k "off" as 0 whatever the kind's spelling)
    sampling: Mapping[str, object] = field(default_factory=dict)
    max_tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Results:
    engines: tuple[EngineInfo, ...]
    baseline: str
    samples: tuple[Sample, ...]
    #: engine -> prompt key -> prompt tokens (tokenizer measurement and/or per-request usage)
    prompt_tokens: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    base_max_tokens: int | None = None
    base_prompt_len: str | None = None
    memory_budget_bytes: int | None = None
    min_repeats: int = 3
    max_noise: float = 0.25
    #: proxy-normalized sampling (live log): the engines' bodies are equal by construction
    sampling_normalized: bool = False


@dataclass(frozen=True, slots=True)
class Comparison:
    metric: str
    unit: str
    higher_is_better: bool
    base: tuple[float, ...]
    cand: tuple[float, ...]
    max_noise: float = 0.25

    @property
    def base_median(self) -> float:
        return statistics.median(self.base)

    @property
    def cand_median(self) -> float:
        return statistics.median(self.cand)

    @property
    def rel_diff(self) -> float:
        b = self.base_median
        return (self.cand_median - b) / b if b else 0.0

    @staticmethod
    def spread(vals: Sequence[float]) -> float:
        m = statistics.median(vals)
        return (max(vals) - min(vals)) / m if m else 0.0

    @property
    def outcome(self) -> Outcome:
        if max(self.spread(self.base), self.spread(self.cand)) > self.max_noise:
            return "noisy"
        if min(self.cand) > max(self.base):
            return "win" if self.higher_is_better else "loss"
        if max(self.cand) < min(self.base):
            return "loss" if self.higher_is_better else "win"
        return "tie"

    def numbers(self, base: str, cand: str) -> str:
        def rng(v: Sequence[float]) -> str:
            return f"{_fmt(statistics.median(v))} {self.unit} (range {_fmt(min(v))}–{_fmt(max(v))}, n={len(v)})"

        return f"{base} {rng(self.base)} vs {cand} {rng(self.cand)}; Δ {self.rel_diff:+.1%}"


@dataclass(frozen=True, slots=True)
class Reason:
    step: str  # data | parity | memory | decode | throughput | long-context
    outcome: Outcome
    text: str


@dataclass(frozen=True, slots=True)
class Verdict:
    baseline: str
    candidate: str
    decision: Decision
    summary: str
    reasons: tuple[Reason, ...]
    comparisons: tuple[Comparison, ...] = ()


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def decide_all(r: Results) -> list[Verdict]:
    """One verdict per candidate engine (every engine but the baseline)."""
    return [decide(r, e.name) for e in r.engines if e.name != r.baseline]


def decide(r: Results, candidate: str) -> Verdict:
    base = r.baseline
    reasons: list[Reason] = []
    comps: list[Comparison] = []
    infos = {e.name: e for e in r.engines}
    if base not in infos or candidate not in infos:
        missing = base if base not in infos else candidate
        return Verdict(
            base,
            candidate,
            "inconclusive",
            f"no results for engine {missing!r}",
            (Reason("data", "inconclusive", f"engine {missing!r} has no results"),),
        )

    samples = [s for s in r.samples if s.engine in (base, candidate)]
    caches = {s.cell.cache for s in samples}
    # cache-cold is the fair comparison; warm-cache results are reported, not judged, when both exist
    judged_cache = "cold" if "cold" in caches else "live" if "live" in caches else "warm" if caches else None
    judged = [s for s in samples if s.cell.cache == judged_cache]
    by: dict[tuple[str, Cell], list[Sample]] = {}
    for s in judged:
        by.setdefault((s.engine, s.cell), []).append(s)

    # 1. enough data
    for name in (base, candidate):
        mine = [s for s in samples if s.engine == name]
        n_ok = sum(s.n_ok for s in mine)
        n_err = sum(s.n_err for s in mine)
        if not mine or n_ok == 0:
            reasons.append(Reason("data", "inconclusive", f"{name}: no successful requests"))
        elif n_err:
            errs = sorted({e for s in mine for e in s.errors})[:3]
            reasons.append(
                Reason(
                    "data",
                    "inconclusive",
                    f"{name}: {n_err} of {n_ok + n_err} requests failed" + (f" ({'; '.join(errs)})" if errs else ""),
                )
            )

    # 2. parity
    reasons += _parity(r, infos[base], infos[candidate])

    cells_b = {c for (e, c) in by if e == base}
    cells_c = {c for (e, c) in by if e == candidate}
    common = cells_b & cells_c
    short = sorted(
        (c.label(), len(by[(base, c)]), len(by[(candidate, c)]))
        for c in common
        if min(len(by[(base, c)]), len(by[(candidate, c)])) < r.min_repeats
    )
    if short:
        lab, nb, nc = short[0]
        reasons.append(
            Reason(
                "data",
                "inconclusive",
                f"too few repeats: {lab} has {nb} ({base}) / {nc} ({candidate}) repeats, "
                f"need >= {r.min_repeats}" + (f" (and {len(short) - 1} more cells)" if len(short) > 1 else ""),
            )
        )
    if judged_cache is not None and not common:
        reasons.append(Reason("data", "inconclusive", "the engines share no measured cell"))

    # 3. memory
    mem = _memory(r, samples, base, candidate)
    reasons.append(mem)

    def values(name: str, cell: Cell, metric: str) -> tuple[float, ...]:
        out = []
        for s in by.get((name, cell), []):
            v = getattr(s, metric)
            if isinstance(v, int | float):
                out.append(float(v))
        return tuple(out)

    def compare(step: str, cell: Cell | None, metric: str, unit: str, higher: bool, what: str) -> Comparison | None:
        if cell is None:
            return None
        b, c = values(base, cell, metric), values(candidate, cell, metric)
        if not b or not c:
            reasons.append(Reason(step, "note", f"{what}: not measured on both engines ({cell.label()})"))
            return None
        comp = Comparison(metric, unit, higher, b, c, r.max_noise)
        comps.append(comp)
        if min(len(b), len(c)) < r.min_repeats:
            return comp  # already reported as too few repeats
        o = comp.outcome
        nums = comp.numbers(base, candidate)
        if o == "noisy":
            text = (
                f"{what} ({cell.label()}): run-to-run spread above {r.max_noise:.0%} of the median — too noisy "
                f"to judge: {nums}"
            )
        elif o == "tie":
            text = f"{what} ({cell.label()}): within run-to-run noise: {nums}"
            if step == "decode":
                text += " — decode-bound, switching engines won't fix it"
        else:
            who = candidate if o == "win" else base
            text = f"{what} ({cell.label()}): {who} is faster beyond the run-to-run spread: {nums}"
        reasons.append(Reason(step, o, text))
        return comp

    base_mt = r.base_max_tokens
    base_pl = r.base_prompt_len
    c1 = [c for c in common if c.concurrency == 1]
    single = _pick(c1, base_mt, base_pl)
    if single is None and common:
        reasons.append(Reason("decode", "note", "no concurrency-1 cell measured on both engines"))
    compare("decode", single, "decode_tps", "tok/s", True, "single-request decode")

    conc = [c for c in common if c.concurrency > 1 and (base_pl is None or c.prompt_len == base_pl)]
    conc = [c for c in conc if base_mt is None or c.max_tokens == base_mt] or conc
    if conc:
        top = max(conc, key=lambda c: c.concurrency)
        compare("throughput", top, "output_tps", "tok/s", True, "concurrent throughput")
    elif common:
        reasons.append(Reason("throughput", "note", "no concurrency > 1 cell measured on both engines"))

    order = {"short": 0, "medium": 1, "long": 2}
    longs = [c for c in c1 if c.prompt_len in order and c.prompt_len != base_pl]
    longs = [c for c in longs if base_mt is None or c.max_tokens == base_mt] or longs
    if longs:
        longest = max(longs, key=lambda c: order[c.prompt_len])
        if base_pl is None or order[longest.prompt_len] > order.get(base_pl, -1):
            compare("long-context", longest, "ttft_s", "s", False, "long-context TTFT")
            compare("long-context", longest, "decode_tps", "tok/s", True, "long-context decode")
        else:
            reasons.append(Reason("long-context", "note", f"no prompt class longer than the base ({base_pl}) measured"))
    elif common:
        reasons.append(Reason("long-context", "note", "no longer-prompt cell measured on both engines"))

    return Verdict(base, candidate, *_conclude(reasons, base, candidate), tuple(reasons), tuple(comps))


def _pick(cells: Sequence[Cell], max_tokens: int | None, prompt_len: str | None) -> Cell | None:
    if not cells:
        return None
    exact = [
        c
        for c in cells
        if (max_tokens is None or c.max_tokens == max_tokens) and (prompt_len is None or c.prompt_len == prompt_len)
    ]
    return sorted(exact or cells, key=lambda c: (c.max_tokens, c.prompt_len))[0]


def _parity(r: Results, b: EngineInfo, c: EngineInfo) -> list[Reason]:
    out: list[Reason] = []
    pb, pc = r.prompt_tokens.get(b.name, {}), r.prompt_tokens.get(c.name, {})
    keys = sorted(set(pb) & set(pc))
    if not keys:
        out.append(
            Reason("parity", "inconclusive", "prompt-token parity unknown: no prompt was counted on both engines")
        )
    else:
        diff = [k for k in keys if pb[k] != pc[k]]
        if diff:
            ex = "; ".join(f"{k}: {pb[k]} vs {pc[k]}" for k in diff[:3])
            out.append(
                Reason(
                    "parity",
                    "inconclusive",
                    f"prompt tokens differ on {len(diff)} of {len(keys)} prompts ({b.name} vs {c.name}: {ex}) "
                    "— chat template, BOS or tokenizer conversion differ; the engines did not see the same input",
                )
            )
        else:
            out.append(
                Reason(
                    "parity",
                    "ok",
                    f"prompt tokens equal on all {len(keys)} counts taken on both engines (tokenizer and per-request usage)",
                )
            )
    if r.sampling_normalized:
        out.append(Reason("parity", "ok", "sampling normalized by the proxy (identical explicit values per engine)"))
    else:
        sb, sc = dict(b.sampling), dict(c.sampling)
        if not sb or not sc:
            out.append(Reason("parity", "inconclusive", "sampling parameters not recorded for both engines"))
        else:
            bad = sorted(k for k in set(sb) | set(sc) if k != "max_tokens" and sb.get(k) != sc.get(k))
            if bad:
                ex = "; ".join(f"{k}: {sb.get(k)!r} vs {sc.get(k)!r}" for k in bad[:4])
                out.append(Reason("parity", "inconclusive", f"sampling differs ({ex})"))
            else:
                out.append(Reason("parity", "ok", "sampling equal: " + ", ".join(f"{k}={sb[k]}" for k in sorted(sb))))
    if not r.sampling_normalized:
        if sorted(b.max_tokens) != sorted(c.max_tokens) or not b.max_tokens:
            out.append(
                Reason(
                    "parity",
                    "inconclusive",
                    f"max tokens differ: {b.name} {list(b.max_tokens) or 'unknown'} vs {c.name} {list(c.max_tokens) or 'unknown'}",
                )
            )
        else:
            out.append(Reason("parity", "ok", f"same max tokens: {list(b.max_tokens)}"))
    # same max_tokens is not enough if one engine stops early (EOS): then tok/s compares different work
    lens_b = [s.completion_tokens for s in r.samples if s.engine == b.name and s.completion_tokens]
    lens_c = [s.completion_tokens for s in r.samples if s.engine == c.name and s.completion_tokens]
    if lens_b and lens_c:
        mb, mc = statistics.mean(lens_b), statistics.mean(lens_c)
        if abs(mb - mc) > 0.1 * max(mb, mc):
            out.append(
                Reason(
                    "parity",
                    "inconclusive",
                    f"output lengths differ: {b.name} {mb:.1f} vs {c.name} {mc:.1f} tokens per request on average "
                    "— set ignore_eos or compare per-token figures only",
                )
            )
    undeclared = [e.name for e in (b, c) if not e.quantization]
    if undeclared:
        out.append(
            Reason(
                "parity",
                "inconclusive",
                f"quantization not declared for {', '.join(undeclared)} (--quantization NAME=Q4_K_M|FP16|...)",
            )
        )
    elif (b.quantization or "").lower() != (c.quantization or "").lower():
        out.append(
            Reason(
                "parity",
                "note",
                f"quantization differs: {b.name} {b.quantization} vs {c.name} {c.quantization} — speed and quality both change",
            )
        )
    else:
        out.append(Reason("parity", "ok", f"quantization declared: {b.quantization} on both"))
    return out


def _memory(r: Results, samples: Sequence[Sample], base: str, cand: str) -> Reason:
    def peak(name: str) -> int | None:
        vals = [s.gpu_mem_peak_bytes for s in samples if s.engine == name and s.gpu_mem_peak_bytes is not None]
        return max(vals) if vals else None

    pb, pc = peak(base), peak(cand)
    if pc is None:
        return Reason("memory", "note", "GPU memory peak unknown (no proxy metrics, no NVML): memory fit not judged")
    budget = r.memory_budget_bytes
    nums = f"peak {base} {_gib(pb) if pb is not None else 'unknown'}, {cand} {_gib(pc)}"
    if budget is not None and pc > budget:
        return Reason("memory", "stay", f"{cand} does not fit: {nums} > budget {_gib(budget)}")
    return Reason("memory", "ok", nums + (f" (budget {_gib(budget)})" if budget is not None else ""))


def _conclude(reasons: Sequence[Reason], base: str, cand: str) -> tuple[Decision, str]:
    inc = [x for x in reasons if x.outcome == "inconclusive"]
    if inc:
        return "inconclusive", "; ".join(x.text for x in inc[:2]) + (f" (+{len(inc) - 2} more)" if len(inc) > 2 else "")
    mem = [x for x in reasons if x.outcome == "stay"]
    if mem:
        return "stay", mem[0].text
    noisy = [x for x in reasons if x.outcome == "noisy"]
    if noisy:
        return "inconclusive", noisy[0].text + " — rerun with more repeats on a quieter machine"
    wins = [x for x in reasons if x.outcome == "win"]
    losses = [x for x in reasons if x.outcome == "loss"]
    ties = [x for x in reasons if x.outcome == "tie"]
    if wins and losses:
        return "inconclusive", (
            f"mixed: {cand} wins on {', '.join(sorted({w.step for w in wins}))} but loses on "
            f"{', '.join(sorted({x.step for x in losses}))} — the choice depends on your workload"
        )
    if wins:
        return (
            "switch",
            f"{cand} is faster beyond the run-to-run spread on {', '.join(sorted({w.step for w in wins}))}, slower on nothing",
        )
    if losses:
        return "stay", f"{cand} is slower on {', '.join(sorted({x.step for x in losses}))} and faster on nothing"
    if ties:
        return "stay", (
            f"no difference beyond run-to-run noise between {base} and {cand}"
            + (" — decode-bound, switching engines won't fix it" if any(t.step == "decode" for t in ties) else "")
        )
    return "inconclusive", "nothing comparable was measured on both engines"
