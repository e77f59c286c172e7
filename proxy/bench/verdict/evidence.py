"""What one verdict compares, paired: the judged cache phase's samples and answered requests of the baseline, the
candidate and the baseline's A/A pass — one figure of one cell -> a ``Comparison``. Pure.

Pairs are the same request (cell, repeat, index) on both engines where the figure is per request, else the same
repeat's aggregate (output tok/s). The noise floor is the A/A pass's interval (symmetric on the log-ratio scale;
one that excludes 0 is a protocol bias, added to the band a win must clear), else the run-to-run variation of the
per-repeat medians; never below ``Results.min_floor``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.bench.verdict.comparison import Comparison, log_ratio
from proxy.bench.verdict.inputs import Cell, Req, Results, Sample
from proxy.bench.verdict.stats import paired_bootstrap, variation
from proxy.notation import faster_ci


@dataclass(frozen=True)
class Evidence:
    r: Results
    base: str
    cand: str
    #: the baseline's A/A pass (None: none)
    aa: str | None
    #: (engine, cell) -> its repeats in the judged cache phase
    by: Mapping[tuple[str, Cell], Sequence[Sample]]
    #: (engine, cell, repeat) -> index -> its answered request in the judged cache phase
    reqs: Mapping[tuple[str, Cell, int], Mapping[int, Req]]

    def has(self, cell: Cell, metric: str) -> bool:
        """Whether the cell's requests (or samples) carry the figure: results before e2e per request have none."""
        reqs, samples = self.reqs, self.r.samples
        return any(
            getattr(q, metric) is not None for (_, c, _), qs in reqs.items() if c == cell for q in qs.values()
        ) or (not reqs and any(getattr(x, metric) is not None for x in samples if x.cell == cell))

    def compare(
        self, step: str, what: str, cell: Cell, metric: str, unit: str, higher: bool, per_req: bool, primary: bool
    ) -> Comparison | None:
        """The candidate against the baseline on ``metric`` in ``cell``; None: no pair to compare."""
        r, base, cand, aa = self.r, self.base, self.cand, self.aa
        groups, means = self.groups(base, cand, cell, metric, per_req)
        stats = paired_bootstrap(groups)
        if stats is None:
            return None
        var: dict[str, float | None] = {base: variation(means[base]), cand: variation(means[cand])}
        aa_stats = None
        if aa is not None:
            aa_groups, aa_means = self.groups(base, aa, cell, metric, per_req)
            aa_stats = paired_bootstrap(aa_groups)
            var[aa] = variation(aa_means[aa])
        bias = 0.0
        if aa_stats is not None:
            sp = [math.exp(log_ratio(x) if higher else -log_ratio(x)) for x in (aa_stats.rel, aa_stats.lo, aa_stats.hi)]
            lo_s, hi_s = min(sp[1:]), max(sp[1:])
            a_src = f"A/A: {aa} against {base}, {faster_ci(sp[0], lo_s, hi_s)}"
            lo, hi = log_ratio(aa_stats.lo), log_ratio(aa_stats.hi)  # the floor is symmetric on the log-ratio scale
            if lo > 0 or hi < 0:  # the baseline differs from itself: order or drift, not noise
                bias = math.expm1(abs(log_ratio(aa_stats.rel)))
                floor = max(r.min_floor, math.expm1((hi - lo) / 2))
                src = f"{a_src} — excludes 0: a protocol bias; the floor is its spread"
            else:
                floor = max(r.min_floor, math.expm1(max(-lo, hi)))
                src = a_src
        else:
            floor = max([r.min_floor, *(v for v in var.values() if v is not None)])
            src = "no A/A pass: run-to-run variation"
        flagged = next((r.flags[(e, cell)] for e in (base, cand, aa) if e and (e, cell) in r.flags), None)
        return Comparison(
            step,
            what,
            metric,
            unit,
            higher,
            cell,
            stats,
            floor,
            src,
            var,
            tuple(means[base]),
            tuple(means[cand]),
            r.min_effect,
            bias,
            flagged,
            primary,
            aa_stats,
        )

    def groups(
        self, x: str, y: str, cell: Cell, metric: str, per_req: bool
    ) -> tuple[list[list[tuple[float, float]]], dict[str, list[float]]]:
        """Pairs per repeat, and each engine's per-repeat medians (for the run-to-run variation: a median is not
        moved by one starved request)."""
        reps_x = {s.repeat: s for s in self.by.get((x, cell), [])}
        reps_y = {s.repeat: s for s in self.by.get((y, cell), [])}
        groups: list[list[tuple[float, float]]] = []
        means: dict[str, list[float]] = {x: [], y: []}
        for rep in sorted(set(reps_x) & set(reps_y)):
            qx, qy = self.reqs.get((x, cell, rep)), self.reqs.get((y, cell, rep))
            if per_req and qx and qy:
                pairs = [(getattr(qx[i], metric), getattr(qy[i], metric)) for i in sorted(set(qx) & set(qy))]
                pairs = [
                    (float(a), float(b)) for a, b in pairs if isinstance(a, int | float) and isinstance(b, int | float)
                ]
            else:
                a, b = getattr(reps_x[rep], metric), getattr(reps_y[rep], metric)
                pairs = [(float(a), float(b))] if isinstance(a, int | float) and isinstance(b, int | float) else []
            if pairs:
                groups.append(pairs)
                means[x].append(statistics.median(p[0] for p in pairs))
                means[y].append(statistics.median(p[1] for p in pairs))
        return groups, means
