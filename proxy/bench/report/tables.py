"""The report's tables of what was measured: the engines, prompt-token parity, each cell's figures per engine
(medians over repeats), the latency percentiles over every request, and the prompt cache's accounting; and how
a figure is written in them. Pure: ``Data`` in, blocks out.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proxy.bench.report.blocks import Block
from proxy.bench.suite import length_rank
from proxy.bench.verdict.data import Data
from proxy.bench.verdict.gates.datagate import cache_flags
from proxy.bench.verdict.inputs import Cell
from proxy.bench.verdict.workload import meets_slo, percentile

#: the figures of a cell's row: (column, ``Sample`` attribute, unit)
_METRICS = (("TTFT", "ttft_s", "ms"), ("TPOT", "tpot_s", "ms"), ("decode tok/s", "decode_tps", ""),
            ("e2e", "e2e_s", "ms"), ("output tok/s", "output_tps", ""))  # fmt: skip
#: what an A/A pass never launched shows of its original (the same engine)
_AA_KEEP = ("kind", "model", "quantization", "quantization_source", "slots", "context_per_slot", "info", "dropped")


def num(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "–"
    if unit == "ms":
        return f"{x * 1000:.1f} ms"
    if abs(x) >= 100:
        return f"{x:.0f}{(' ' + unit) if unit else ''}"
    return f"{x:.{digits}g}{(' ' + unit) if unit else ''}"


def _mib(b: float | None) -> str:
    return "unknown" if b is None else f"{b / 2**20:.0f} MiB"


def _agg(vals: Iterable[float | None], unit: str = "") -> str:
    v = [x for x in vals if isinstance(x, int | float)]
    if not v:
        return "–"
    m = statistics.median(v)
    if len(v) == 1:
        return num(m, unit)
    return f"{num(m, unit)} ({num(min(v), unit)}–{num(max(v), unit)})"


def _load(c: Cell) -> str:
    """The c column: the concurrency (with its rate), or a live group's observed range."""
    if c.cache == "live" and c.concurrency_max is not None and c.concurrency_max != c.concurrency:
        return f"{c.concurrency}–{c.concurrency_max}" if c.concurrency_max else f"≥{c.concurrency}"
    return f"{c.concurrency}" + (f" @ {c.rate:g}/s" if c.rate is not None else "")


def _cell_order(c: Cell) -> tuple[Any, ...]:
    return (c.rate or 0, c.concurrency, c.max_tokens, length_rank(c.prompt_len))


# ---- the engines ---------------------------------------------------------------------------------------


def engine_blocks(d: Data) -> list[Block]:
    measured = {s.engine for s in d.results.samples}
    meta = {e["name"]: e for e in d.engines_meta}
    rows = []
    for e in d.engines_meta:
        if e.get("aa_of") and e.get("kind") is None:  # an A/A never launched: the same engine, its original's
            e = {**e, **{k: v for k, v in meta.get(e["aa_of"], {}).items() if k in _AA_KEEP}}
        rows.append(_engine_row(d, e, measured))
    header = ["engine", "kind", "model", "quantization", "slots", "context/slot", "params dropped", "url"]
    return [Block("h2", "Engines"), Block("table", header=header, rows=rows)]


def _engine_row(d: Data, e: Mapping[str, Any], measured: set[str]) -> list[str]:
    tag = " (baseline)" if e["name"] == d.results.baseline else f" (A/A pass of {e['aa_of']})" if e.get("aa_of") else ""
    if e["name"] not in measured:
        tag += ", not measured (the run ended first)" if d.stopped or d.interrupted else ", not measured"
    q = e.get("quantization") or "undeclared"
    src = e.get("quantization_source")
    dropped = e.get("dropped")
    return [
        e["name"] + tag,
        str(e.get("kind")),
        str(e.get("model")),
        f"{q} ({src})" if src else q,
        str(e.get("slots") or "–"),
        str(e.get("context_per_slot") or (e.get("info") or {}).get("n_ctx") or "–"),
        "unknown" if dropped is None else ", ".join(dropped) or "none",
        str(e.get("url") or "–"),
    ]


def parity_blocks(d: Data) -> list[Block]:
    """Prompt-token parity: each prompt counted by each engine's tokenizer, and the engines' own usage counts."""
    names = [e.name for e in d.results.engines if not e.aa_of]
    out = [Block("h2", "Prompt-token parity")]
    by: dict[str, dict[str, Any]] = {}
    methods: dict[str, str] = {}
    for t in d.tokenized:
        by.setdefault(t["prompt"], {})[t["engine"]] = t.get("tokens")
        methods[t["engine"]] = str(t.get("method"))
    rows = []
    for pid, m in by.items():
        vals = [m.get(n) for n in names]
        known = [x for x in vals if isinstance(x, int)]
        eq = "–" if len(known) < 2 else ("equal" if len(set(known)) == 1 else "**DIFFER**")
        rows.append([pid, *[str(x) if x is not None else "?" for x in vals], eq])
    if rows:
        how = "; ".join(f"{n}: {methods.get(n, '?')}" for n in names)
        out.append(Block("p", f"Counted with each engine's own tokenizer before the run ({how})."))
        out.append(Block("table", header=["prompt", *names, "parity"], rows=rows))
    pt = d.results.prompt_tokens
    keys = [k for k in pt.get(names[0], {}) if k.startswith("usage:")] if names else []
    common = [k for k in keys if all(k in pt.get(n, {}) for n in names)]
    if common:
        diff = [k for k in common if len({pt[n][k] for n in names}) > 1]
        text = (
            f"Engine-reported `usage.prompt_tokens` of identical requests: {len(common) - len(diff)} "
            f"of {len(common)} equal on all engines."
        )
        out.append(Block("p", text))
    if not rows and not common:
        out.append(Block("p", "No prompt-token counts on both engines."))
    return out


# ---- the results -----------------------------------------------------------------------------------------


def result_blocks(d: Data) -> list[Block]:
    """A section per cache phase (cold, live, warm): each cell's figures, then its latency percentiles."""
    out = []
    caches = sorted({s.cell.cache for s in d.results.samples}, key=lambda c: ("cold", "live", "warm", c).index(c))
    for cache in caches:
        out.append(Block("h2", f"Results: {cache}" + (" cache" if cache != "live" else " mirrored traffic")))
        out += _cell_tables(d, cache)
        out += _percentile_tables(d, cache)
    return out


def _cell_tables(d: Data, cache: str) -> list[Block]:
    r = d.results
    samples = [s for s in r.samples if s.cell.cache == cache]
    rows = []
    for c in sorted({s.cell for s in samples}, key=_cell_order):
        for n in (e.name for e in r.engines):
            mine = [s for s in samples if s.cell == c and s.engine == n]
            if not mine:
                continue
            err = sum(s.n_err for s in mine)
            ok = sum(s.n_ok for s in mine)
            mem = [s.gpu_mem_peak_bytes for s in mine if s.gpu_mem_peak_bytes is not None]
            rows.append(
                [
                    _load(c),
                    str(c.max_tokens),
                    c.prompt_len,
                    n,
                    str(len(mine)),
                    *[_agg((getattr(s, attr) for s in mine), unit) for _, attr, unit in _METRICS],
                    _agg(s.prompt_tokens for s in mine),
                    _agg(s.completion_tokens for s in mine),
                    f"{err}/{ok + err}" if err else "0",
                    _mib(max(mem)) if mem else "unknown",
                ]
            )
    header = ["c", "max_tokens", "prompt", "engine", "repeats", *[m[0] for m in _METRICS], "prompt tokens"]
    header += ["out tokens", "errors", "GPU mem peak"]
    note = (
        "Each figure: median over repeats (min–max) of the per-repeat median over requests; output tok/s is "
        "per repeat (all requests' completion tokens / wall time). `c @ R/s`: open-loop arrivals at R "
        "requests/s, at most c in flight."
    )
    return [Block("p", note), Block("table", header=header, rows=rows)]


def _percentile_tables(d: Data, cache: str) -> list[Block]:
    by: dict[tuple[str, Cell], list[dict[str, Any]]] = {}
    for q in d.requests:
        if q.get("phase", "measure") == "measure" and q.get("cache") == cache and q.get("ok"):
            rate = q.get("rate")
            cell = Cell(cache, int(q["concurrency"]), int(q["max_tokens"]), str(q["prompt_len"]), rate)
            by.setdefault((str(q["engine"]), cell), []).append(q)
    if not by:
        return []
    slo = d.goodput
    rows = []
    for (engine, c), reqs in sorted(by.items(), key=lambda kv: (_cell_order(kv[0][1]), kv[0][0])):
        row = [_load(c), str(c.max_tokens), c.prompt_len, engine, str(len(reqs))]
        row += [_percentiles(reqs, attr) for attr in ("ttft_s", "tpot_s", "itl_s")]
        if slo:
            good = sum(1 for q in reqs if meets_slo(q, slo))
            row.append(f"{good}/{len(reqs)} ({good / len(reqs):.0%})")
        rows.append(row)
    header = ["c", "max_tokens", "prompt", "engine", "requests", "TTFT p50 / p90 / p99", "TPOT p50 / p90 / p99"]
    header += ["ITL p50 / p90 / p99"] + (["within SLO (goodput)"] if slo else [])
    note = (
        "Latency percentiles over every measured request of the cell (all repeats). † p99 of fewer "
        "than 100 values: it is about the largest one, not a tail estimate."
    )
    return [Block("p", note), Block("table", header=header, rows=rows)]


def _percentiles(reqs: Sequence[Mapping[str, Any]], attr: str) -> str:
    """ "p50 / p90 / p99" of one figure over the requests (ITL: over every gap of every request)."""
    if attr == "itl_s":
        vals = [float(g) for q in reqs for g in (q.get(attr) or [])]
    else:
        vals = [float(q[attr]) for q in reqs if isinstance(q.get(attr), int | float)]
    if not vals:
        return "–"
    few = len(vals) < 100  # a p99 of fewer than 100 values is the largest or next-to-largest one
    return " / ".join(num(percentile(vals, p), "ms") + ("†" if p == 99 and few else "") for p in (50, 90, 99))


def cache_blocks(d: Data) -> list[Block]:
    """Cache accounting: cached / prompt tokens per cell and engine, and the cold and warm checks."""
    reqs = [q for q in d.results.requests if q.ok and q.cell.cache in ("cold", "warm")]
    if not reqs:
        return []
    flags = cache_flags(d.results.requests, d.results.shared_prefix)
    by: dict[tuple[str, Cell], list[tuple[int | None, int | None]]] = {}
    for q in reqs:
        by.setdefault((q.engine, q.cell), []).append((q.cached_tokens, q.prompt_tokens))
    rows = []
    for (engine, c), vals in sorted(by.items(), key=lambda kv: (kv[0][1].cache, _cell_order(kv[0][1]), kv[0][0])):
        cached = sum(x or 0 for x, _ in vals)
        prompt = sum(p or 0 for _, p in vals)
        unknown = sum(1 for x, _ in vals if x is None)
        rows.append(
            [
                c.label(),
                engine,
                f"{cached}/{prompt} ({cached / prompt:.0%})" if prompt else "–",
                str(unknown) if unknown else "0",
                "**" + flags[(engine, c)] + "**" if (engine, c) in flags else "ok",
            ]
        )
    note = (
        "Cold cells must show no request served from the prompt cache (under half its prompt cached: the chat "
        "template's preamble may be), warm cells cached tokens on every request; a flagged cell in the judged "
        "phase stops the verdict at the data gate."
    )
    if d.results.shared_prefix:
        note += " Shared-prefix suite: cold requests share their document by design, so the cold check is off."
    header = ["cell", "engine", "cached / prompt tokens", "unknown", "check"]
    return [Block("h2", "Cache accounting"), Block("p", note), Block("table", header=header, rows=rows)]
