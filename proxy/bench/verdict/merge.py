"""``enginemeter report --results A/results.jsonl B/results.jsonl [...]``: separate runs joined into one verdict.

Runs made at different times (llama.cpp today, SGLang tomorrow; or resident engines benched one at a time) are
joined only when they are **comparable** — the first difference found refuses the join, naming it:

1. the same suite, and the same prompts in every length class both kept (the i-th request of a cell repeat
   draws the same prompt only then) with the same text (each prompt's digest, where recorded);
2. the same sampling as sent (temperature, top_p, top_k, min_p, penalties, seed, ignore_eos);
3. the same base max tokens and base prompt length (the judged cells);
4. the same GPU model and driver, where both runs recorded them (``comparable.gpu``).

Joined, each run's engines keep their names; an engine name found in a later file is the same engine measured
again, so it becomes that engine's A/A pass (``NAME-aa``, ``aa_of: NAME``). For the baseline that is the floor a
user's separate runs need (restart-to-restart and day-to-day noise), preferred over an A/A pass inside one run;
the report says which floor it used, or that there is none. Nothing else changes: the requests pair by (cell,
repeat, index) as within one run, so two files split from one run give that run's verdict.

Each run's quality figures (token agreement, task accuracy: ``proxy.bench.quality``) are kept, their engines
renamed, whatever the order of the files: those measured against the joined baseline or against its A/A pass (the
same engine measured again in that run); a figure against another engine has no baseline here and is left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.quality.readout import Quality
from proxy.bench.verdict.data import Data, load_bench
from proxy.bench.verdict.inputs import Results
from proxy.bench.verdict.provenance import report_command


def load_runs(
    paths: Sequence[Path],
    *,
    baseline: str | None = None,
    quantization: Mapping[str, str] | None = None,
    min_effect: float | None = None,
    max_error_rate: float | None = None,
    accept_quantization_difference: bool = False,
) -> Data:
    """One results file as it is; several joined (``ValueError`` naming the first difference when they cannot)."""
    datas = [
        load_bench(
            p,
            quantization=quantization,
            min_effect=min_effect,
            max_error_rate=max_error_rate,
            accept_quantization_difference=accept_quantization_difference,
            baseline=baseline if len(paths) == 1 else None,
        )
        for p in paths
    ]
    if len(datas) == 1:
        return datas[0]
    for p, d in zip(paths[1:], datas[1:], strict=True):
        why = difference(datas[0].runs[0], d.runs[0])
        if why:
            raise ValueError(f"{paths[0]} and {p} are not comparable runs: {why}")
    joined = join(datas, baseline=baseline)
    joined.results = dataclasses.replace(
        joined.results,
        report_command=report_command(
            paths,
            baseline=joined.results.baseline,
            min_effect=min_effect,
            max_error_rate=max_error_rate,
            accept_quantization_difference=accept_quantization_difference,
            quantization=quantization,
        ),
    )
    return joined


def _comparable(run: Mapping[str, Any]) -> dict[str, Any]:
    """What a run says makes it comparable (older runs: rebuilt from their config)."""
    cfg = run.get("config") or {}
    c = dict(run.get("comparable") or {})
    c.setdefault("suite", cfg.get("suite"))
    c.setdefault("sampling", {k: cfg.get(k) for k in ("seed", "ignore_eos") if k in cfg})
    c.setdefault("max_tokens", (run.get("base") or {}).get("max_tokens"))
    c.setdefault("prompt_len", (run.get("base") or {}).get("prompt_len"))
    return c


def difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """The first thing that makes two runs incomparable, in words; None when they can be joined."""
    ca, cb = _comparable(a), _comparable(b)
    if ca.get("suite") != cb.get("suite"):
        return f"suite differs: {ca.get('suite')!r} vs {cb.get('suite')!r}"
    by_a: dict[str, list[str]] = {}
    by_b: dict[str, list[str]] = {}
    for run, by in ((a, by_a), (b, by_b)):
        for p in run.get("prompts") or []:
            by.setdefault(str(p.get("length")), []).append(str(p.get("id")))
    common = sorted(set(by_a) & set(by_b))
    if not common:
        return "no prompt length class measured in both runs"
    for length in common:
        if by_a[length] != by_b[length]:
            return (
                f"the {length} prompts differ: {', '.join(by_a[length])} vs {', '.join(by_b[length])} (the i-th "
                "request would not be the same prompt)"
            )
    da, db = ca.get("prompts") or {}, cb.get("prompts") or {}
    for pid in sorted(set(da) & set(db)):
        if da[pid] != db[pid]:
            return f"prompt {pid} has different text in the two runs (digest {da[pid]} vs {db[pid]})"
    sa, sb = ca.get("sampling") or {}, cb.get("sampling") or {}
    for k in sorted(set(sa) | set(sb)):
        if sa.get(k) != sb.get(k):
            return f"sampling differs: {k} {sa.get(k, 'unset')!r} vs {sb.get(k, 'unset')!r}"
    for key, what in (("max_tokens", "max tokens"), ("prompt_len", "base prompt length")):
        if ca.get(key) != cb.get(key):
            return f"{what} differ: {ca.get(key)} vs {cb.get(key)}"
    ga, gb = ca.get("gpu") or {}, cb.get("gpu") or {}
    for key, what in (("model", "GPU model"), ("count", "GPU count"), ("driver", "GPU driver")):
        if ga.get(key) is not None and gb.get(key) is not None and ga[key] != gb[key]:
            return f"{what} differs: {ga[key]} vs {gb[key]}"
    return None


def _unique(name: str, taken: set[str]) -> str:
    out, n = name, 1
    while out in taken:
        n += 1
        out = f"{name}{n}"
    return out


def join(datas: Sequence[Data], *, baseline: str | None = None) -> Data:
    """The runs as one: later repeats of an engine name become its A/A passes (see the module docstring)."""
    first = datas[0]
    bl = baseline or first.results.baseline
    renames, aa_of, cross_aa = _renames(datas)
    results = _joined(datas, renames, aa_of, cross_aa, bl)
    each = _each(datas, renames)

    def renamed(recs: str, key: str = "engine") -> list[dict[str, Any]]:
        return [{**x, key: ren.get(x.get(key), x.get(key))} for d, ren, _ in each for x in getattr(d, recs)]

    meta = []
    for d, ren, src in each:
        for m in d.engines_meta:
            new = ren[m["name"]]
            meta.append({**m, "name": new, "aa_of": aa_of.get(new) or ren.get(m.get("aa_of") or ""), "source": src})
    return Data(
        title=f"enginemeter report: {len(datas)} runs joined",
        results=results,
        engines_meta=meta,
        requests=renamed("requests"),
        tokenized=renamed("tokenized"),
        protocol=_protocol(datas, renames, bl, cross_aa),
        notes=[f"{Path(src).parent.name or src}: {n}" for d, _, src in each for n in d.notes],
        interrupted=any(d.interrupted for d in datas),
        duration_s=sum(d.duration_s or 0 for d in datas) or None,
        goodput=first.goodput,
        positions=renamed("positions"),
        stints=[{**s, "role": _joined_role(s.get("engine"), bl, meta)} for s in renamed("stints")],
        stopped=next((d.stopped for d in datas if d.stopped), None),
        sources=[s for d in datas for s in d.sources],
        runs=[r for d in datas for r in d.runs],
    )


def _renames(datas: Sequence[Data]) -> tuple[list[dict[str, str]], dict[str, str], set[str]]:
    """Each run's engine names as joined (one map per run), the A/A passes made of a name measured again (new name
    -> the engine's), and those passes: an engine's repeat from another run, the A/A pass joined runs prefer."""
    taken: set[str] = set()
    renames: list[dict[str, str]] = []
    cross_aa: set[str] = set()
    aa_of: dict[str, str] = {}
    for d in datas:
        mine: dict[str, str] = {}
        for e in d.results.engines:
            if e.name in taken and e.aa_of is None:
                new = _unique(f"{e.name}-aa", taken)
                aa_of[new] = e.name
                cross_aa.add(new)
            else:
                new = _unique(e.name, taken)
            mine[e.name] = new
            taken.add(new)
        renames.append(mine)
    return renames, aa_of, cross_aa


def _joined(
    datas: Sequence[Data], renames: Sequence[dict[str, str]], aa_of: Mapping[str, str], cross_aa: set[str], bl: str
) -> Results:
    """The runs' results as one, their engines renamed; ``ValueError`` when the baseline is none of them."""
    engines, samples, reqs, flags = [], [], [], {}
    prompt_tokens: dict[str, dict[str, int]] = {}
    for d, ren in zip(datas, renames, strict=True):
        r = d.results
        for e in r.engines:
            new = ren[e.name]
            engines.append(
                dataclasses.replace(e, name=new, aa_of=aa_of.get(new) or (ren.get(e.aa_of) if e.aa_of else None))
            )
        samples += [dataclasses.replace(s, engine=ren[s.engine]) for s in r.samples]
        reqs += [dataclasses.replace(q, engine=ren[q.engine]) for q in r.requests]
        for (eng, c), why in r.flags.items():
            flags[(ren[eng], c)] = why
        for eng, counts in r.prompt_tokens.items():
            prompt_tokens.setdefault(ren.get(eng, eng), {}).update(counts)
    names = [e.name for e in engines]
    if bl not in names:
        raise ValueError(f"baseline {bl!r} is not one of the engines: {', '.join(names)}")
    # the engines as given, then the A/A passes: the baseline's repeat from another run first (it is the floor:
    # verdict.decide takes the first A/A pass of the baseline), then its pass inside a run, then the others'
    engines.sort(
        key=lambda e: (e.aa_of is not None, 0 if e.aa_of == bl and e.name in cross_aa else 1 if e.aa_of == bl else 2)
    )
    r0 = datas[0].results
    each = list(zip(datas, renames, strict=True))
    return Results(
        engines=tuple(engines),
        baseline=bl,
        samples=tuple(samples),
        prompt_tokens=prompt_tokens,
        base_max_tokens=r0.base_max_tokens,
        base_prompt_len=r0.base_prompt_len,
        memory_budget_bytes=r0.memory_budget_bytes,
        min_repeats=r0.min_repeats,
        min_effect=r0.min_effect,
        max_error_rate=r0.max_error_rate,
        min_floor=r0.min_floor,
        requests=tuple(reqs),
        shared_prefix=any(d.results.shared_prefix for d in datas),
        flags=flags,
        command=None,
        accept_quantization_difference=any(d.results.accept_quantization_difference for d in datas),
        expected=frozenset().union(*(d.results.expected for d in datas)),
        alone=frozenset(ren[e] for d, ren in each for e in d.results.alone),
        memory_share={ren[e]: v for d, ren in each for e, v in d.results.memory_share.items()},
        time_shared=True,
        random_weights={ren[e]: v for d, ren in each for e, v in d.results.random_weights.items()},
        quality=_quality(each, aa_of, bl),
    )


def _quality(each: Sequence[tuple[Data, dict[str, str]]], aa_of: Mapping[str, str], bl: str) -> dict[str, Quality]:
    """Every run's quality figures against the joined baseline (or its A/A pass), renamed; in candidate order."""
    out: dict[str, Quality] = {}
    for d, ren in each:
        base = ren.get(d.results.baseline, d.results.baseline)
        if bl not in (base, aa_of.get(base)):
            continue
        for cand, q in d.results.quality.items():
            new = ren.get(cand, cand)
            agree = q.agreement and dataclasses.replace(q.agreement, base=bl, cand=new)
            acc = q.accuracy and dataclasses.replace(q.accuracy, base=bl, cand=new)
            out[new] = Quality(agree, acc)
    return dict(sorted(out.items()))


def _joined_role(engine: Any, bl: str, meta: Sequence[Mapping[str, Any]]) -> str:
    """A stint's role in the joined comparison: each run called its own first engine the baseline."""
    if engine == bl:
        return "baseline"
    return "aa" if any(m["name"] == engine and m.get("aa_of") for m in meta) else "candidate"


def _each(datas: Sequence[Data], renames: Sequence[dict[str, str]]) -> list[tuple[Data, dict[str, str], str]]:
    return [(d, ren, d.sources[0] if d.sources else "") for d, ren in zip(datas, renames, strict=True)]


def _protocol(datas: Sequence[Data], renames: Sequence[dict[str, str]], bl: str, cross_aa: set[str]) -> list[str]:
    out = [
        f"{len(datas)} separate runs joined (same suite and prompts, sampling, max tokens"
        + (
            " and GPU"
            if all((r.get("comparable") or {}).get("gpu") for d in datas for r in d.runs)
            else "; GPU model and driver not recorded by every run"
        )
        + "): "
        + "; ".join(f"{src} ({', '.join(ren.values())})" for d, ren, src in _each(datas, renames))
    ]
    floors = [n for ren in renames for n in ren.values() if n in cross_aa]
    mine = [n for n in floors if n.startswith(f"{bl}-aa")]
    # an A/A counts only if it was measured: an interrupted run declares an A/A it never ran
    in_run = [
        (ren[e.name], bool(next((m.get("launch") for m in d.engines_meta if m["name"] == e.name), None)))
        for d, ren in zip(datas, renames, strict=True)
        for e in d.results.engines
        if (e.aa_of == bl or (e.aa_of and ren.get(e.aa_of) == bl))
        and any(s.engine == e.name for s in d.results.samples)
    ]
    if mine:
        out.append(
            f"A/A noise floor: {mine[0]} = the baseline {bl}'s run repeated (run-to-run noise, what separate runs have)"
        )
    elif in_run:
        name, relaunch = in_run[0]
        how = (
            "the baseline launched again in its own run (restart-to-restart noise)"
            if relaunch
            else "a second pass inside the baseline's own run"
        )
        out.append(
            f"A/A noise floor: {name} = {how} — the drift between separate runs is not in it; repeat "
            f"{bl}'s run and join that file too for that floor"
        )
    else:
        out.append(
            f"**no A/A noise floor**: {bl} was measured in one run only, without an A/A pass — the run-to-run "
            f"variation stands in; run {bl} again and join that file too"
        )
    for d in datas:
        out += [f"{Path(d.sources[0]).parent.name or d.sources[0]}: {line}" for line in d.protocol[:1]]
    return out


__all__ = ["difference", "join", "load_runs"]
