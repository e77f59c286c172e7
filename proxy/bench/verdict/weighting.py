"""A traffic profile, and the decision for it: the measured cells weighted by where the traffic spends its time. Pure.

A **profile** (``Traffic``) is the share of busy time at each number of requests in flight ("c1=30,c16=70":
30 % of the time one request runs, 70 % sixteen), and optionally the share of requests per prompt-length class
("short=90,16k=10"). It is given inline (``parse_spec``) or taken from the proxy's own record of real traffic
(``proxy.bench.live.trafficsource``: its comparison log, its request log, its ``/metrics``, or a Prometheus server).

Each (concurrency, prompt class) of the profile is matched to the nearest measured cell — the prompt class first
(the nearest length measured), then the concurrency (nearest on a log scale) — and that cell's comparison stands
for it: at concurrency 1 the whole request's time, above 1 the output tok/s (the regimes' own figures). The
effects are log speed ratios, weighted by the profile's shares; their interval combines the cells' intervals as
independent (each cell was measured on its own requests); the band is the weighted band. The answer:

- **switch**: the whole interval beyond +band: for this traffic the candidate is faster;
- **stay**: the whole interval beyond −band, or inside ±band (no difference worth a switch);
- **inconclusive**: anything else, or a matched cell that cannot decide (flagged) — with the cells to measure.

Where the profile reaches beyond what was measured (more requests in flight than the largest cell, a prompt class
not measured), the nearest cell stands in and the answer says so.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.suite import ORDER, TARGET_TOKENS, length_rank
from proxy.bench.verdict.comparison import Comparison, log_ratio
from proxy.bench.verdict.inputs import Traffic
from proxy.judge import judge
from proxy.notation import band, faster_ci

Z = 1.959963984540054
_ITEM = re.compile(r"^\s*(?:c(?P<c>\d+(?:\.\d+)?)|(?P<p>[a-z0-9]+))\s*=\s*(?P<v>\d+(?:\.\d+)?)\s*%?\s*$")


def _c(c: float) -> str:
    return f"{c:g}" if c < 10 else f"{c:.0f}"


def _by_length(prompts: Mapping[str, float]) -> list[tuple[str, float]]:
    return sorted(prompts.items(), key=lambda kv: length_rank(kv[0]))


def parse_spec(spec: str) -> Traffic:
    """``c1=30,c16=70`` (percent of the busy time at each concurrency), optionally with prompt-length shares
    ``short=90,16k=10`` (percent of the requests; classes: short, medium, long, 4k, 16k, 32k). Shares of each kind
    are normalized to 100 %; a mistake is a ``ValueError`` naming it."""
    conc: dict[float, float] = {}
    prompts: dict[str, float] = {}
    for item in [x for x in spec.split(",") if x.strip()]:
        m = _ITEM.match(item.lower())
        if m is None:
            raise ValueError(f"--traffic: {item.strip()!r} is not cN=PERCENT or CLASS=PERCENT (e.g. c1=30,c16=70)")
        v = float(m["v"])
        if m["c"] is not None:
            c = float(m["c"])
            if c < 1:
                raise ValueError(f"--traffic: {item.strip()!r}: a concurrency is 1 or more")
            conc[c] = conc.get(c, 0.0) + v
        else:
            p = m["p"]
            if p not in TARGET_TOKENS:
                raise ValueError(f"--traffic: {p!r} is no prompt-length class ({', '.join(ORDER)})")
            prompts[p] = prompts.get(p, 0.0) + v
    if not conc:
        raise ValueError("--traffic: give the concurrency shares, e.g. c1=30,c16=70 (prompt shares may follow)")
    return Traffic(normalized(conc), normalized(prompts) if prompts else {}, source=f"inline: {spec}")


def normalized(shares: Mapping[Any, float]) -> dict[Any, float]:
    total = sum(v for v in shares.values() if v > 0)
    if total <= 0:
        raise ValueError("--traffic: every share is 0")
    return {k: v / total for k, v in shares.items() if v > 0}


def prompt_class(tokens: float) -> str:
    """The built-in suite's length class nearest to ``tokens`` (log scale)."""
    return min(TARGET_TOKENS, key=lambda k: abs(math.log(max(tokens, 1.0)) - math.log(TARGET_TOKENS[k])))


@dataclass(frozen=True)
class Part:
    """One (concurrency, prompt class) of the profile, the cell that stands for it and that cell's effect."""

    weight: float
    concurrency: float
    prompt: str
    cell: Comparison
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        g, lo, hi = self.cell.log_gain
        return {
            "weight": self.weight,
            "concurrency": self.concurrency,
            "prompt": self.prompt,
            "cell": self.cell.cell.label(),
            "figure": self.cell.what,
            "speed_ratio": math.exp(g),
            "ci95": [math.exp(lo), math.exp(hi)],
            "outcome": self.cell.outcome,
            "note": self.note,
        }


@dataclass(frozen=True)
class TrafficAnswer:
    decision: str  # switch | stay | inconclusive
    #: the candidate's time-weighted speed ratio over the baseline's, and its 95 % interval
    ratio: float
    lo: float
    hi: float
    band: float
    parts: tuple[Part, ...]
    notes: tuple[str, ...]
    #: the effect and why it decides, without the decision's word ("sglang is ×2.2 faster than llama (...), beyond
    #: the band ±14 %")
    text: str
    #: ``proxy.judge`` of the weighted interval against the weighted band (the decision's source)
    outcome: str = "unresolved"
    #: the weighted log gain and its interval (what ``ratio``, ``lo``, ``hi`` are the exponentials of)
    log_gain: tuple[float, float, float] = (math.nan, math.nan, math.nan)

    def to_json(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "outcome": self.outcome,
            "speed_ratio": self.ratio,
            "ci95": [self.lo, self.hi],
            "band": self.band,
            "text": self.text,
            "notes": list(self.notes),
            "parts": [p.to_json() for p in self.parts],
        }


def weigh(
    traffic: Traffic, cells: Sequence[Comparison], base: str, cand: str, base_prompt: str | None
) -> TrafficAnswer:
    """The decision for ``traffic`` from the measured ``cells`` (one comparison per cell: ``Verdict.cells``)."""
    if not cells:
        return TrafficAnswer(
            "inconclusive",
            math.nan,
            math.nan,
            math.nan,
            math.nan,
            (),
            (),
            "no cell was measured on both engines: nothing to weigh the traffic with",
        )
    classes = sorted({c.cell.prompt_len for c in cells}, key=length_rank)
    home = base_prompt if base_prompt in classes else classes[0]
    prompts = traffic.prompts or {home: 1.0}
    parts: list[Part] = []
    notes: list[str] = []
    for p, ps in _by_length(prompts):
        have = p if p in classes else min(classes, key=lambda k: abs(length_rank(k) - length_rank(p)))
        if have != p:
            notes.append(f"{p} prompts were not measured: the {have} cells stand for them")
        mine = [c for c in cells if c.cell.prompt_len == have]
        top = max(c.cell.concurrency for c in mine)
        for conc, cs in sorted(traffic.concurrency.items()):
            near = min(mine, key=lambda c: (abs(math.log(c.cell.concurrency) - math.log(conc)), c.cell.concurrency))
            note = None
            if conc > top * 1.5:
                note = f"c={_c(conc)} is beyond the largest measured ({top}) for {have} prompts: c={top} stands in"
                notes.append(note)
            elif conc != near.cell.concurrency:
                note = f"c={_c(conc)}: the nearest measured cell, c={near.cell.concurrency}"
            parts.append(Part(cs * ps, conc, have, near, note))
    flagged = [x for x in parts if x.cell.outcome == "flagged"]
    g = sum(x.weight * x.cell.log_gain[0] for x in parts)
    # each cell's interval keeps its own shape (a one-cell profile has exactly the cell's interval): the lower and
    # the upper half-widths combine as independent, each on its own side
    lo = g - math.sqrt(sum((x.weight * (x.cell.log_gain[0] - x.cell.log_gain[1])) ** 2 for x in parts))
    hi = g + math.sqrt(sum((x.weight * (x.cell.log_gain[2] - x.cell.log_gain[0])) ** 2 for x in parts))
    b = sum(x.weight * log_ratio(x.cell.win_band) for x in parts)
    r, rlo, rhi = math.exp(g), math.exp(lo), math.exp(hi)
    if r >= 1:
        est = f"{cand} is {faster_ci(r, rlo, rhi).replace(' (95% CI', f' than {base} (95% CI', 1)}"
    else:
        est = f"{base} is {faster_ci(1 / r, 1 / rhi, 1 / rlo).replace(' (95% CI', f' than {cand} (95% CI', 1)}"
    outcome = judge(lo, hi, b)  # the one rule, as each cell is judged
    if flagged:
        decision = "inconclusive"
        why = f"{len(flagged)} of its cells cannot decide ({flagged[0].cell.flagged})"
    elif outcome == "win":
        decision, why = "switch", f"beyond the band {band(math.expm1(b))}"
    elif outcome == "loss":
        decision, why = "stay", f"beyond the band {band(math.expm1(b))}"
    elif outcome == "tie":
        decision, why = "stay", f"a tie: inside the band {band(math.expm1(b))}, no difference worth a switch"
    else:
        decision, why = "inconclusive", f"the interval crosses the band {band(math.expm1(b))}"
    text = f"{est}, {why}"
    return TrafficAnswer(
        decision, r, rlo, rhi, math.expm1(b), tuple(parts), tuple(dict.fromkeys(notes)), text, outcome, (g, lo, hi)
    )


def crossing(cells: Sequence[Comparison], prompt: str | None) -> tuple[int, int, float] | None:
    """Where the candidate overtakes (or falls behind) as concurrency rises, from the measured cells of one prompt
    class: (the last measured concurrency before, the first after, the interpolated crossing on a log scale)."""
    mine = sorted(
        (c for c in cells if c.cell.prompt_len == prompt and c.cell.rate is None), key=lambda c: c.cell.concurrency
    )
    for a, b in itertools.pairwise(mine):
        ga, gb = a.log_gain[0], b.log_gain[0]
        if (ga < 0) != (gb < 0) and ga != gb:
            xa, xb = math.log2(a.cell.concurrency), math.log2(b.cell.concurrency)
            x = xa + (0 - ga) * (xb - xa) / (gb - ga)
            return a.cell.concurrency, b.cell.concurrency, 2**x
    return None
