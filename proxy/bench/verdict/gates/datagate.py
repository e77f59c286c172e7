"""The data gate: every engine answered (failures within ``--max-error-rate`` are stated), every judged cell has
its repeats, the engines share a cell, the judged cache phase is what it says, and no decode figure rests on
token events that came in one read. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from proxy.bench.verdict.inputs import Cell, Reason, Req, Results, Sample


def cache_flags(requests: Sequence[Req], shared_prefix: bool = False) -> dict[tuple[str, Cell], str]:
    """(engine, cell) -> why the cell's cache phase is not what it says: a cold request served from the
    prompt cache (half its prompt or more cached), a warm request with no cached tokens reported."""
    by: dict[tuple[str, Cell], list[Req]] = {}
    for q in requests:
        if q.ok:
            by.setdefault((q.engine, q.cell), []).append(q)
    out: dict[tuple[str, Cell], str] = {}
    for (engine, cell), reqs in by.items():
        if cell.cache == "cold" and not shared_prefix:
            hit = [q for q in reqs if q.cached_tokens and q.prompt_tokens and q.cached_tokens >= q.prompt_tokens / 2]
            if hit:
                q = hit[0]
                out[(engine, cell)] = (
                    f"{len(hit)} of {len(reqs)} cold requests were served from the prompt cache "
                    f"(e.g. {q.cached_tokens} of {q.prompt_tokens} prompt tokens cached)"
                )
        elif cell.cache == "warm":
            miss = [q for q in reqs if not q.cached_tokens]
            if miss:
                out[(engine, cell)] = f"{len(miss)} of {len(reqs)} warm requests report no cached prompt tokens"
    return out


def data_gate(
    r: Results,
    samples: Sequence[Sample],
    base: str,
    cand: str,
    judged: str | None,
    common: set[Cell],
    by: Mapping[tuple[str, Cell], Sequence[Sample]],
) -> list[Reason]:
    """The data gate's reasons, in order: failures, one-read bursts, repeats, shared cells, cache phases."""
    mine = {name: [s for s in samples if s.engine == name] for name in (base, cand)}
    out = [x for name in (base, cand) if (x := _errors(r, name, mine[name]))]
    out += [x for name in (base, cand) if (x := _bursts(name, mine[name]))]
    out += [x for name in (base, cand) if (x := _client_bursts(name, mine[name]))]
    # live traffic: the anytime-valid verdict's own minimum of pairs decides when anything is decided ("not yet")
    short = sorted(
        (c.label(), len(by[(base, c)]), len(by[(cand, c)]))
        for c in ([] if r.live else common)
        if min(len(by[(base, c)]), len(by[(cand, c)])) < r.min_repeats
    )
    if short:
        lab, nb, nc = short[0]
        more = f" (and {len(short) - 1} more cells)" if len(short) > 1 else ""
        text = f"too few repeats: {lab} has {nb} ({base}) / {nc} ({cand}) repeats, need >= {r.min_repeats}{more}"
        out.append(Reason("data", "inconclusive", text, "repeats"))
    if judged is not None and not common:
        out.append(Reason("data", "inconclusive", "the engines share no measured cell", "cells"))
    cache = _cache(r, base, cand, judged)
    if cache is not None:
        out.append(cache)
    return out


def _errors(r: Results, name: str, mine: Sequence[Sample]) -> Reason | None:
    """An engine with no answered request, or with failures: stated and left out of the figures while within
    ``--max-error-rate`` and no repeat mostly failed; beyond either, the data cannot decide."""
    n_ok = sum(s.n_ok for s in mine)
    n_err = sum(s.n_err for s in mine)
    if not mine or n_ok == 0:
        return Reason("data", "inconclusive", f"{name}: no successful requests", "errors")
    if not n_err:
        return None
    errs = sorted({e for s in mine for e in s.errors})[:3]
    rate = n_err / (n_ok + n_err)
    within = rate <= r.max_error_rate
    # a rare failure (a dropped connection) is stated and left out of the figures, as live traffic's
    # are; more than --max-error-rate says the engine does not serve this load: no figure can decide
    cap = f"{r.max_error_rate * 100:g}%"
    # a cell where most requests failed says the engine does not serve that load, whatever the total
    worst = max((s for s in mine if s.n_err), key=lambda s: s.n_err / (s.n_ok + s.n_err))
    broken = worst.n_err > worst.n_ok
    allowed = (
        f" — {rate:.1%}, above the {cap} allowed (--max-error-rate)"
        if not within
        else f" — most of one repeat failed ({worst.n_err} of {worst.n_ok + worst.n_err} at {worst.cell.label()})"
        if broken
        else f" — {rate:.2%}, within the {cap} allowed (--max-error-rate): the latency figures are over "
        "the answered requests, and output tok/s counts only their tokens (a failure costs it)"
    )
    text = f"{name}: {n_err} of {n_ok + n_err} requests failed" + (f" ({'; '.join(errs)})" if errs else "") + allowed
    return Reason("data", "ok" if within and not broken else "inconclusive", text, "errors")


def _cache(r: Results, base: str, cand: str, judged: str | None) -> Reason | None:
    """The judged cache phase as labelled (cold: nothing served from the prompt cache; warm: cached tokens seen)."""
    flags = cache_flags(r.requests, r.shared_prefix)
    bad = [
        (e, c, why)
        for (e, c), why in sorted(flags.items(), key=lambda x: (x[0][0], x[0][1].label()))
        if e in (base, cand) and c.cache == judged
    ]
    if bad:
        e, c, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return Reason("data", "inconclusive", f"cache phase not as labelled: {e} at {c.label()}: {why}{more}", "cache")
    if r.requests and judged in ("cold", "warm"):
        what = (
            "no cold request was served from the prompt cache"
            if judged == "cold"
            else "every warm request reported cached prompt tokens"
        )
        return Reason("data", "ok", f"cache accounting checked: {what}", "cache")
    return None


def _bursts(name: str, mine: Sequence[Sample]) -> Reason | None:
    """Requests whose token events came in one read: their chunk timing times the reader, not the engine. Stated
    when the engine's own timings stood in; a repeat whose decode figure rests on such requests is inconclusive."""
    hit = [s for s in mine if s.bursts]
    if not hit:
        return None
    n, unrated, total = sum(s.bursts for s in hit), sum(s.bursts_unrated for s in hit), sum(s.n_ok for s in mine)
    where = max(hit, key=lambda s: s.bursts / max(s.n_ok, 1)).cell.label()
    head = (
        f"{name}: {n} of {total} requests arrived in one read (token events under 0.1 ms apart, e.g. at "
        f"{where}): their chunk timing is not a decode rate"
    )
    if not unrated:
        return Reason("data", "ok", head + " — the engine's own timings stand in for it", "bursts")
    driven = [s for s in hit if 2 * s.bursts_unrated >= s.n_ok]
    tail = (
        f" — {unrated} without the engine's timings have none; {len(driven)} repeat(s) rest on them: "
        "a buffering hop between the engines and the bench (a proxy, a slow reader), measure closer"
        if driven
        else f" — {unrated} without the engine's timings are left out of the decode figures"
    )
    return Reason("data", "inconclusive" if driven else "ok", head + tail, "bursts")


def _client_bursts(name: str, mine: Sequence[Sample]) -> Reason | None:
    """Bursts the bench's own client caused (it was descheduled while the engine streamed): labelled the client's,
    never the engine's. A repeat whose decode figure rests on them is inconclusive: measure on a quieter box."""
    hit = [s for s in mine if s.bursts_client]
    if not hit:
        return None
    n, total = sum(s.bursts_client for s in hit), sum(s.n_ok for s in mine)
    lag = max((s.client_lag_max_s or 0.0) for s in hit)
    head = (
        f"{name}: {n} of {total} requests were read late by the bench's own client (its event loop stalled up to "
        f"{lag * 1000:.0f} ms while the engine streamed): their bursts are the client's, not the engine's"
    )
    driven = [s for s in hit if 2 * s.bursts_client_unrated >= s.n_ok]
    tail = (
        f" — {len(driven)} repeat(s) rest on them: run the bench where its client has a core to itself"
        if driven
        else " — left out of the decode figures (the engine's own timings stand in where it gives them)"
    )
    return Reason("data", "inconclusive" if driven else "ok", head + tail, "client")
