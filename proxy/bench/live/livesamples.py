"""Mirrored pairs -> the verdict's samples and requests, by observed concurrency.

- **Observed concurrency**: the record's ``concurrency.overlapping`` (mirrored requests that overlapped the pair,
  itself included; the proxy counts them), else an estimate from record times and durations.
- **Groups** c=1, 2–3, 4–7, ≥8 (``Cell.concurrency``..``Cell.concurrency_max``), one live cell each.
- **Repeats**: live traffic has none, so each group's consecutive pairs are cut into ``blocks`` slices, each one
  ``Sample`` per engine (medians of its pairs) and one ``Req`` per pair side; a group's failed pairs are spread
  over the same slices as its errors.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.bench.live.facts import side_sampling
from proxy.bench.live.log import start_of
from proxy.bench.verdict.inputs import Cell, Req, Sample
from proxy.gpu.scraped import MemReading

BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 3), (4, 7), (8, 0))  # (low, high); 0 = open


def _estimated(recs: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Legacy records (no ``concurrency``): per engine, the intervals open at each pair's start, from record
    times and durations; the larger of its two engines'. O(n log n)."""
    spans: dict[str, tuple[list[float], list[float]]] = {}
    for r in recs:
        a, b = start_of(r), float(r.get("ts") or 0)
        for s in ("primary", "shadow"):
            st, en = spans.setdefault(str(r[s].get("engine")), ([], []))
            st.append(a)
            en.append(b)
    for st, en in spans.values():
        st.sort()
        en.sort()
    out: dict[int, int] = {}
    for r in recs:
        t = start_of(r)
        out[id(r)] = max(
            bisect.bisect_right(st, t) - bisect.bisect_left(en, t)
            for st, en in (spans[str(r[s].get("engine"))] for s in ("primary", "shadow"))
        )
    return out


def concurrency_of(recs: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """id(record) -> observed concurrency (1 = the pair ran alone)."""
    legacy = [r for r in recs if not isinstance((r.get("concurrency") or {}).get("overlapping"), int)]
    out = _estimated(legacy) if legacy else {}
    for r in recs:
        if id(r) not in out:
            out[id(r)] = max(1, int(r["concurrency"]["overlapping"]))
    return out


def bucket(n: int) -> tuple[int, int]:
    return next(b for b in BUCKETS if n >= b[0] and (b[1] == 0 or n <= b[1]))


def _med(vals: Sequence[Any]) -> float | None:
    v = [float(x) for x in vals if isinstance(x, int | float) and not isinstance(x, bool)]
    return statistics.median(v) if v else None


def group_samples(
    bl: str,
    other: str,
    kept: Sequence[Mapping[str, Any]],
    failed: Sequence[Mapping[str, Any]],
    conc: Mapping[int, int],
    blocks: int,
    mem: Mapping[str, MemReading],
) -> tuple[list[Sample], list[Req]]:
    """One engine pair's samples and requests: per concurrency group, per block, the primary's then the shadow's.
    ``kept``: the pairs both engines answered; ``failed``: the pairs an engine over its error budget failed."""
    samples: list[Sample] = []
    reqs: list[Req] = []
    for lo, hi in BUCKETS:
        group = [r for r in kept if bucket(conc[id(r)]) == (lo, hi)]
        bad = [r for r in failed if bucket(conc[id(r)]) == (lo, hi)]
        mts = {(side_sampling(r["primary"]) or {}).get("params", {}).get("max_tokens") for r in group}
        mt = next(iter(mts)) if len(mts) == 1 and isinstance(next(iter(mts)), int) else 0
        cell = Cell("live", lo, mt, "mixed", concurrency_max=hi)
        n = len(group)
        kk = max(1, min(blocks, n))
        for b in range(kk if n else 0):
            chunk = group[b * n // kk : (b + 1) * n // kk]
            errs = bad[b * len(bad) // kk : (b + 1) * len(bad) // kk]
            for name, role in ((bl, "primary"), (other, "shadow")):
                sides = [r[role] for r in chunk]
                samples.append(_sample(name, cell, b, sides, [r[role] for r in errs], mem.get(name)))
                reqs += [_req(name, cell, b, i, s) for i, s in enumerate(sides)]
    return samples, reqs


def _sample(
    name: str,
    cell: Cell,
    repeat: int,
    sides: Sequence[Mapping[str, Any]],
    errs: Sequence[Mapping[str, Any]],
    mem: MemReading | None,
) -> Sample:
    """One block of one engine: the medians of its sides; ``errs``: its sides of the block's failed pairs."""
    return Sample(
        engine=name,
        cell=cell,
        repeat=repeat,
        n_ok=len(sides),
        n_err=sum(1 for e in errs if e.get("outcome") != "ok"),
        ttft_s=_med([s.get("upstream_ttft_s", s.get("ttft_s")) for s in sides]),
        tpot_s=_med([s.get("tpot_s") for s in sides]),
        decode_tps=_med([s.get("decode_tps") for s in sides]),
        e2e_s=_med([s.get("e2e_s") for s in sides]),
        completion_tokens=_med([s.get("completion_tokens") for s in sides]),
        prompt_tokens=_med([s.get("prompt_tokens") for s in sides]),
        errors=tuple(sorted({f"outcome {e.get('outcome')}" for e in errs if e.get("outcome") != "ok"})),
        gpu_mem_peak_bytes=mem.used_bytes if mem is not None else None,
        gpu_mem_source=mem.source if mem is not None else None,
        gpus=mem.gpus if mem is not None else (),
        gpu_mem_total_bytes=mem.total_bytes if mem is not None else None,
    )


def _req(name: str, cell: Cell, repeat: int, index: int, s: Mapping[str, Any]) -> Req:
    return Req(
        engine=name,
        cell=cell,
        repeat=repeat,
        index=index,
        ok=True,
        ttft_s=s.get("upstream_ttft_s", s.get("ttft_s")),
        tpot_s=s.get("tpot_s"),
        decode_tps=s.get("decode_tps"),
        e2e_s=s.get("e2e_s"),
        prompt_tokens=s.get("prompt_tokens"),
        cached_tokens=s.get("cached_tokens"),
    )
