"""The quality figures of a run, read from its records: token agreement and task accuracy per candidate, each
with its interval, the bound beyond which a candidate "answers differently", and the one line that says it.
Pure; the report, the verdict and the switch plan render what this computes (one truth).

Bounds (stated wherever they judge): a candidate **answers differently** when its same-top-token rate's whole
interval lies below :data:`SAME_TOP_BOUND`, its mean KL's whole interval above :data:`MEAN_KL_BOUND`, or its
accuracy difference's whole interval below ``-ACCURACY_DROP``. Within them its outputs **agree** (the switch
plan's item checked). A Q4_K_M or FP8 model against its 16-bit original usually stays within them (llama.cpp's
own tables: mean KL 0.01-0.06, same top 92-99 % for 7-8B models at 4 bits and up); a broken path does not.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.bench.quality.divergence import N_BOOT, SEED, Figure, PromptScore, figures, percentile, score_prompt

SAME_TOP_BOUND = 0.90
MEAN_KL_BOUND = 0.1
ACCURACY_DROP = 0.02
RANDOM_CAVEAT = (
    "random weights: these figures measure a random network's noise, not the model's quality nor the format's cost"
)


def _pct(f: Figure) -> str:
    return f"{f.value * 100:.1f} % [{f.low * 100:.1f}–{f.high * 100:.1f}]"


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def _kl(f: Figure) -> str:
    return f"{_num(f.value)} [{_num(f.low)}–{_num(f.high)}]"


@dataclass(frozen=True)
class TokenAgreement:
    """A candidate's next-token agreement with the baseline over ``prompts`` prompts."""

    base: str
    cand: str
    prompts: int
    positions: int
    k: int
    method: str
    figures: Mapping[str, Figure]
    never_parted: int = 0  # prompts whose greedy outputs never part within the path

    @property
    def differs(self) -> str | None:
        """Why it answers differently (a bound crossed by the whole interval), None when within bounds."""
        same, kl = self.figures["same_top"], self.figures["mean_kl"]
        if same.high < SAME_TOP_BOUND:
            return f"same top token {_pct(same)} < {SAME_TOP_BOUND:.0%}"
        if kl.low > MEAN_KL_BOUND:
            return f"mean KL {_kl(kl)} > {MEAN_KL_BOUND:g}"
        return None

    def short(self) -> str:
        """``same top token 97.1 % [96.4–97.7], mean KL 0.012``: what the discount line says."""
        return f"same top token {_pct(self.figures['same_top'])}, mean KL {_num(self.figures['mean_kl'].value)}"

    def text(self) -> str:
        f = self.figures
        part = f["first_part"]
        return (
            f"token agreement {self.base} vs {self.cand} ({self.prompts} prompts × {self.positions // max(self.prompts, 1)}"
            f" positions, {self.method}): same top token {_pct(f['same_top'])}; mean KL {_kl(f['mean_kl'])}, p99 KL "
            f"{_kl(f['p99_kl'])} (KL over the top-{self.k} + rest: a lower bound on the full KL); greedy outputs "
            f"part at token {part.value:.0f} [{part.low:.0f}–{part.high:.0f}] (median; {self.never_parted} of "
            f"{self.prompts} never part); intervals: 95 % bootstrap over prompts"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "positions": self.positions,
            "k": self.k,
            "method": self.method,
            "never_parted": self.never_parted,
            **{name: f.as_list() for name, f in self.figures.items()},
        }


def _by_engine(records: Iterable[Mapping[str, Any]], kind: str) -> dict[str, dict[int, Mapping[str, Any]]]:
    out: dict[str, dict[int, Mapping[str, Any]]] = {}
    key = "prompt" if kind == "logprobs" else "item"
    for r in records:
        if r.get("type") == kind:
            out.setdefault(str(r["engine"]), {})[int(r[key])] = r
    return out


def _topk(rows: Sequence[Sequence[Any]]) -> list[dict[int, float]]:
    return [{int(t): float(lp) for t, lp in pos} for pos in rows]


def agreements(
    records: Iterable[Mapping[str, Any]], baseline: str, *, n_boot: int = N_BOOT
) -> dict[str, TokenAgreement]:
    """Every measured candidate's agreement with ``baseline`` (on the prompts both have)."""
    got = _by_engine(records, "logprobs")
    base = got.get(baseline)
    out: dict[str, TokenAgreement] = {}
    if not base:
        return out
    for cand, rows in got.items():
        if cand == baseline:
            continue
        shared = sorted(set(base) & set(rows))
        ps: list[PromptScore] = [
            score_prompt(_topk(base[i]["scored"]), _topk(rows[i]["scored"]), base[i]["path"], rows[i]["path"])
            for i in shared
        ]
        if not ps:
            continue
        out[cand] = TokenAgreement(
            base=baseline,
            cand=cand,
            prompts=len(ps),
            positions=sum(len(p.kl) for p in ps),
            k=int(base[shared[0]].get("k", 0)),
            method=str(base[shared[0]].get("method", "")),
            figures=figures(ps, n_boot=n_boot),
            never_parted=sum(p.first_part >= p.length for p in ps),
        )
    return out


@dataclass(frozen=True)
class Accuracy:
    """Task accuracy of the baseline and a candidate on the same items, and their paired difference."""

    base: str
    cand: str
    items: int
    base_right: int
    cand_right: int
    #: candidate minus baseline accuracy, with its 95 % paired bootstrap interval over items
    diff: Figure
    #: McNemar's exact test on the discordant items (two-sided)
    p_value: float
    discordant: tuple[int, int] = field(default=(0, 0))  # (baseline right only, candidate right only)

    @property
    def differs(self) -> str | None:
        if self.diff.high < -ACCURACY_DROP:
            return f"accuracy {self.diff.value * 100:+.1f} pt [{self.diff.low * 100:+.1f}–{self.diff.high * 100:+.1f}]"
        return None

    def text(self) -> str:
        d = self.diff
        return (
            f"task accuracy {self.base} {self.base_right}/{self.items}, {self.cand} {self.cand_right}/{self.items}: "
            f"difference {d.value * 100:+.1f} pt [{d.low * 100:+.1f}–{d.high * 100:+.1f}] (95 % paired bootstrap "
            f"over items), McNemar exact p = {self.p_value:.3g} ({self.discordant[0]} right only on {self.base}, "
            f"{self.discordant[1]} only on {self.cand})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "base_right": self.base_right,
            "cand_right": self.cand_right,
            "diff": self.diff.as_list(),
            "p_value": self.p_value,
            "discordant": list(self.discordant),
        }


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` and ``c`` discordant pairs (a binomial test at 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail: float = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_diff(pairs: Sequence[tuple[bool, bool]], *, n_boot: int = N_BOOT, seed: int = SEED) -> Figure:
    """Mean of ``cand - base`` over paired items, with the 2.5-97.5 % percentiles over items resampled."""

    def diff(sample: Sequence[tuple[bool, bool]]) -> float:
        return sum(int(c) - int(b) for b, c in sample) / len(sample)

    value = diff(pairs)
    rng = random.Random(seed)
    draws = sorted(diff([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(n_boot))
    return Figure(value, percentile(draws, 0.025), percentile(draws, 0.975))


def accuracies(records: Iterable[Mapping[str, Any]], baseline: str, *, n_boot: int = N_BOOT) -> dict[str, Accuracy]:
    """Every candidate's accuracy against ``baseline`` on the items both answered."""
    got = _by_engine(records, "eval")
    base = got.get(baseline)
    out: dict[str, Accuracy] = {}
    if not base:
        return out
    for cand, rows in got.items():
        shared = sorted(set(base) & set(rows))
        if cand == baseline or not shared:
            continue
        pairs = [(bool(base[i]["correct"]), bool(rows[i]["correct"])) for i in shared]
        b = sum(x and not y for x, y in pairs)
        c = sum(y and not x for x, y in pairs)
        out[cand] = Accuracy(
            baseline,
            cand,
            len(pairs),
            sum(x for x, _ in pairs),
            sum(y for _, y in pairs),
            paired_diff(pairs, n_boot=n_boot),
            mcnemar_exact(b, c),
            (b, c),
        )
    return out


def quality_notes(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """What a quality phase says of an engine (left out, and why; scored on the baseline's ids), one line each."""
    return [f"{r['phase']}: {r['engine']}: {r['note']}" for r in records if r.get("type") == "quality_note"]


def answers_differently(agreement: TokenAgreement | None, accuracy: Accuracy | None) -> str | None:
    """The first bound a candidate crosses (``faster, but answers differently: <this>``), None within all."""
    for x in (agreement, accuracy):
        if x is not None and x.differs:
            return x.differs
    return None


@dataclass(frozen=True)
class Quality:
    """What was measured of a candidate's answers: its token agreement and task accuracy (either may be missing).
    The one object the verdict, the report and the switch plan read."""

    agreement: TokenAgreement | None = None
    accuracy: Accuracy | None = None

    @property
    def measured(self) -> bool:
        return self.agreement is not None or self.accuracy is not None

    @property
    def differs(self) -> str | None:
        """The bound crossed (``faster, but answers differently: <this>``), None within every bound."""
        return answers_differently(self.agreement, self.accuracy)

    def short(self) -> str:
        """What the discount line says was measured: ``same top token 97.1 % [96.4–97.7], mean KL 0.012``."""
        parts = [self.agreement.short()] if self.agreement is not None else []
        if self.accuracy is not None:
            a, d = self.accuracy, self.accuracy.diff
            parts.append(
                f"task accuracy {a.cand_right}/{a.items} vs {a.base_right}/{a.items} "
                f"({d.value * 100:+.1f} pt [{d.low * 100:+.1f}–{d.high * 100:+.1f}])"
            )
        return "; ".join(parts)

    def evidence(self, *, random_weights: bool = False) -> str:
        """The full lines, the bounds they were judged by, and the random-weights caveat where it applies."""
        lines = [x.text() for x in (self.agreement, self.accuracy) if x is not None]
        bounds = (
            f"bounds: same top token ≥ {SAME_TOP_BOUND:.0%} and mean KL ≤ {MEAN_KL_BOUND:g} (whole interval beyond "
            f"to fail), accuracy no more than {ACCURACY_DROP * 100:g} pt below"
        )
        verdict = f"answers differently: {self.differs}" if self.differs else "within the bounds"
        caveat = [RANDOM_CAVEAT] if random_weights else []
        return "; ".join([*lines, f"{verdict} ({bounds})", *caveat])


def quality_by_candidate(records: Sequence[Mapping[str, Any]], baseline: str) -> dict[str, Quality]:
    """Every candidate with a quality figure: its :class:`Quality` (computed once; every reader renders this)."""
    agree, acc = agreements(records, baseline), accuracies(records, baseline)
    return {c: Quality(agree.get(c), acc.get(c)) for c in sorted({*agree, *acc})}
