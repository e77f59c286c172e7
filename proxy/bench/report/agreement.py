"""Greedy-output agreement between two engines: at temperature 0 the same weights give the same text; a different
precision usually parts after some tokens. Reported beside every verdict (and the reason to trust a
*discounted* one less or more). Pure.

Pairs are requests with the same input text: the same (cell, repeat, index) and the same prompt key (prompt and
cold prefix) — every measured pair within one run; across joined runs only the warm phase's bare prompts (each
run draws its own cold prefixes). Per pair: identical or not (the whole output's hash, ``out_sha``), and where
the two first differ, in characters of the recorded head (``out_head``) and in tokens estimated from the
request's characters per token.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.report.blocks import Block
from proxy.engines.quant import RANDOM_WHY, random_among, random_who


@dataclass(frozen=True)
class Agreement:
    pairs: int
    identical: int
    #: per differing pair: the first differing character (None: beyond the recorded head)
    divergence_chars: tuple[int | None, ...] = ()
    #: the same in tokens (chars × completion tokens / output chars), where it can be told
    divergence_tokens: tuple[float, ...] = ()
    head_chars: int = 0
    #: False: the results carry no output text (written before results version 4)
    recorded: bool = True

    @property
    def share(self) -> float:
        return self.identical / self.pairs if self.pairs else 0.0

    def text(self, base: str, cand: str) -> str:
        if not self.recorded:
            return f"greedy-output agreement {base} vs {cand}: not recorded (results from before output hashes)"
        if not self.pairs:
            return (
                f"greedy-output agreement {base} vs {cand}: no request was sent identically to both (joined runs "
                "draw their own cold prefixes; a warm phase, --cache both, sends bare prompts)"
            )
        out = (
            f"greedy-output agreement {base} vs {cand} (temperature 0, {self.pairs} identical requests): "
            f"{self.identical} of {self.pairs} outputs identical ({self.share:.0%})"
        )
        diff = self.pairs - self.identical
        if diff:
            known = sorted(c for c in self.divergence_chars if c is not None)
            where = []
            if known:
                where.append(
                    f"first difference at character {statistics.median(known):.0f} (median"
                    + (f"; {known[0]}–{known[-1]}" if len(known) > 1 else "")
                    + ")"
                )
            if self.divergence_tokens:
                where.append(f"≈ token {statistics.median(self.divergence_tokens):.0f}")
            later = sum(1 for c in self.divergence_chars if c is None)
            if later:
                where.append(f"{later} after the first {self.head_chars} characters")
            out += "; where they differ: " + ", ".join(where)
        out += (
            " — the same weights should agree at temperature 0; a different precision usually parts after some tokens"
        )
        return out

    def to_json(self) -> dict[str, Any]:
        known = [c for c in self.divergence_chars if c is not None]
        return {
            "pairs": self.pairs,
            "identical": self.identical,
            "share_identical": self.share if self.pairs else None,
            "first_divergence_char_median": statistics.median(known) if known else None,
            "first_divergence_token_median": statistics.median(self.divergence_tokens)
            if self.divergence_tokens
            else None,
            "diverged_after_head": sum(1 for c in self.divergence_chars if c is None),
            "head_chars": self.head_chars,
            "recorded": self.recorded,
        }


def _index(requests: Sequence[Mapping[str, Any]], engine: str) -> dict[tuple[Any, ...], Mapping[str, Any]]:
    out = {}
    for q in requests:
        if q.get("engine") != engine or q.get("phase", "measure") != "measure" or not q.get("ok"):
            continue
        if not isinstance(q.get("out_sha"), str) or "cache" not in q:
            continue
        cell = (q["cache"], q["concurrency"], q["max_tokens"], q["prompt_len"], q.get("rate"))
        out[(cell, q.get("repeat"), q.get("index"), q.get("key"))] = q
    return out


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def agreement(requests: Sequence[Mapping[str, Any]], base: str, cand: str) -> Agreement:
    if not any("out_sha" in q for q in requests):
        return Agreement(0, 0, recorded=False)
    qb, qc = _index(requests, base), _index(requests, cand)
    keys = sorted(set(qb) & set(qc), key=repr)
    same = 0
    chars: list[int | None] = []
    tokens: list[float] = []
    head = 0
    for k in keys:
        a, b = qb[k], qc[k]
        if a["out_sha"] == b["out_sha"]:
            same += 1
            continue
        ha, hb = str(a.get("out_head") or ""), str(b.get("out_head") or "")
        head = max(head, len(ha), len(hb))
        at = _common_prefix(ha, hb)
        if at >= min(len(ha), len(hb)) and len(ha) == len(hb):
            chars.append(None)  # the heads agree: they part later
            continue
        chars.append(at)
        n_chars, n_tok = a.get("out_chars"), a.get("completion_tokens")
        if isinstance(n_chars, int) and n_chars > 0 and isinstance(n_tok, int) and n_tok > 0:
            tokens.append(at * n_tok / n_chars)
    return Agreement(len(keys), same, tuple(chars), tuple(tokens), head)


def random_text(base: str, cand: str, random: Mapping[str, str]) -> str | None:
    """What greedy agreement says when ``base`` or ``cand`` runs random weights (``random``: engine -> why)."""
    mine = random_among(random, base, cand)
    if not mine:
        return None
    return (
        f"greedy-output agreement {base} vs {cand}: cannot be judged: {random_who(mine)} — {RANDOM_WHY}; the speed "
        "figures stand (random weights cost what real ones do)"
    )


def agreement_blocks(a: Agreement, base: str, cand: str, random: Mapping[str, str] | None = None) -> list[Block]:
    return [Block("p", random_text(base, cand, random or {}) or a.text(base, cand))]
