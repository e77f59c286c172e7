"""Checks of the protocol itself, from the results alone (pure): did the first repeat of a cell differ from the
others (a cell measured cold: no warm-up), did every engine take each place in the order, did another client
load an engine. The report shows them; the verdict reads the foreign-load flags (``Results.flags``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.verdict.inputs import Cell, Sample

#: the per-repeat figure each check looks at, per kind of cell
_FIGURE = {"single": "tpot_s", "load": "output_tps"}


@dataclass(frozen=True, slots=True)
class FirstRepeat:
    engine: str
    cell: Cell
    metric: str
    first: float
    others_median: float
    #: |first - median(others)| / median(others)
    deviation: float
    #: the largest such deviation among the other repeats
    others_spread: float

    @property
    def outlier(self) -> bool:
        return self.deviation > max(2 * self.others_spread, 0.10)


def first_repeat(samples: Sequence[Sample]) -> list[FirstRepeat]:
    """For every engine and cell with 3+ repeats: how far repeat 0 sits from the others, on TTFT and on the
    cell's own figure (TPOT alone, output tok/s under load)."""
    by: dict[tuple[str, Cell], dict[int, Sample]] = {}
    for s in samples:
        by.setdefault((s.engine, s.cell), {})[s.repeat] = s
    out: list[FirstRepeat] = []
    for (engine, cell), reps in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1].label())):
        if len(reps) < 3 or 0 not in reps:
            continue
        metrics = ["ttft_s", _FIGURE["load" if cell.concurrency > 1 or cell.rate is not None else "single"]]
        for metric in metrics:
            first = getattr(reps[0], metric)
            others = [getattr(s, metric) for k, s in sorted(reps.items()) if k != 0]
            others = [float(x) for x in others if isinstance(x, int | float)]
            if not isinstance(first, int | float) or len(others) < 2:
                continue
            m = statistics.median(others)
            if m <= 0:
                continue
            spread = max(abs(x - m) / m for x in others)
            out.append(FirstRepeat(engine, cell, metric, float(first), m, abs(first - m) / m, spread))
    return out


def order_counts(positions: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, int]]:
    """engine -> place in the order (0 = first) -> repeats, from the sample records' ``position``."""
    out: dict[str, dict[int, int]] = {}
    for r in positions:
        pos = r.get("position")
        if isinstance(pos, int):
            d = out.setdefault(str(r["engine"]), {})
            d[pos] = d.get(pos, 0) + 1
    return out


def summary(
    samples: Sequence[Sample],
    positions: Sequence[Mapping[str, Any]],
    flags: Mapping[tuple[str, Cell], str],
    aa_names: Sequence[str],
) -> list[str]:
    """The protocol checks as lines for the report."""
    lines: list[str] = []
    fr = first_repeat(samples)
    bad = [x for x in fr if x.outlier]
    cells = {(x.engine, x.cell) for x in fr}
    if fr:
        if bad:
            worst = max(bad, key=lambda x: x.deviation)
            eng = sorted({x.engine for x in bad})
            lines.append(
                f"**first repeat differs** from the others in {len({(x.engine, x.cell) for x in bad})} of "
                f"{len(cells)} engine cells ({', '.join(eng)}); worst: {worst.engine} {worst.metric} at "
                f"{worst.cell.label()}: {_v(worst.metric, worst.first)} vs {_v(worst.metric, worst.others_median)} "
                f"in the other repeats ({worst.deviation:+.0%} away; they spread ±{worst.others_spread:.0%}) — a cell "
                "measured without its warm-up, or drift at the start of each cell"
            )
        else:
            lines.append(
                f"first repeat in line with the others in all {len(cells)} engine cells (within 2× the other "
                "repeats' spread or 10 %)"
            )
    counts = order_counts(positions)
    if counts:
        firsts = {e: d.get(0, 0) for e, d in counts.items()}
        lines.append(
            "order: times each engine ran first in a repeat — "
            + ", ".join(f"{e} {n}" + (" (A/A)" if e in aa_names else "") for e, n in sorted(firsts.items()))
        )
    elif samples:
        lines.append(
            "order: not recorded (results from before the balanced order: the first repeat of every cell "
            "ran the engines in the listed order)"
        )
    if flags:
        for (e, c), why in sorted(flags.items(), key=lambda kv: (kv[0][0], kv[0][1].label())):
            lines.append(f"**{c.label()}** on {e}: {why} — the cell cannot decide")
    return lines


def _v(metric: str, x: float) -> str:
    return f"{x * 1000:.1f} ms" if metric.endswith("_s") else f"{x:.0f} tok/s"
